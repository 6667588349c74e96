"""The report's worked cards, computed when the trace is recorded (--trace full), by the one float64 evaluator.

In the card layers (trace.worked.full_row_layers: the selected layers when there are at most four, else the first and
the last) and outside the layers, every point with a declared operation (model.maths) is computed from the pass's own
tensors by `model.recompute.apply`, then sampled at exactly the rows and entries the point's recorded sample keeps
(trace.recorder), and carried in that sample as `computed`:

    values   the computed sample, packed like the recorded values (trace.packed)
    error    [largest |computed − recorded|, that over the largest |recorded|] over the sample, in float64
    aux      per row, the few numbers the card's words print (a norm's rms; a softmax's log-sum-exp, and with a learned
             sink its logit, the scores' own log-sum-exp and the sink's share)
    dot      a matrix product's first kept output entry of every row worked as y_i = Σ_j x_j · W_ij (+ b_i): the
             input row's and the weight row's first entries j (each input row once; each weight row once a point and
             pass, or a row's own expert's), their products, the sum of the other terms and the bias

An operand spanning the KV cache (an operation's `cached`) is every pass's tensor so far, joined along the slots; a
`carried` one is the tensor the pass before left (None before the first pass). What a card reads beyond the point is
the operation kind's own declaration (model.maths.OpKind: `kept`, a matrix product's kept outputs from only the weight
rows they read, so that a 262k-row head is never turned into float64; `dot`; `aux`). Nothing here names a point, a
family or an operation kind: the declarations say what is read.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from llmtrace.model.maths import op_kind
from llmtrace.model.recompute import apply, max_error
from llmtrace.trace.packed import pack
from llmtrace.trace.worked import full_row_layers



class Cards:
    """What the worked cards need, worked out once from the model's declaration at the start of a run; each pass's
    points of `need` are kept in its CardPass (begin), and `sampled` answers a point's computed sample once the pass
    is over."""

    def __init__(self, lm, selected: Optional[list[int]]):
        self.maths, self.model = lm.maths, lm.model
        n = lm.config.n_layers
        self.layers = full_row_layers(selected, n)
        self.tables = [(None, self.maths.model)] + [(i, self.maths.layers[i]) for i in self.layers]
        self.need: set[tuple] = set()  # the points a pass keeps: the card layers' and every operand they read
        self.cached: set[tuple] = set()  # operands spanning the cache: every pass's tensor is kept
        self.carried: set[tuple] = set()  # operands carried from the pass before
        for layer, table in self.tables:
            for name, o in table.items():
                self.need.add((layer, name))
                for ref in o.inputs:
                    if ref == "ids":
                        continue
                    where = self.maths.operand(layer, ref)
                    self.need.add(where)
                    if ref in (o.const("carried") or ()):
                        self.carried.add(where)
                    elif ref in (o.const("cached") or ()):
                        self.cached.add(where)
        self.history: dict[tuple, list[torch.Tensor]] = {}  # cached operands: each earlier pass's
        self.before: dict[tuple, torch.Tensor] = {}  # carried operands: the pass before's
        self._weights: dict[tuple, torch.Tensor] = {}
        self._rows: dict[tuple, list] = {}  # a matrix product's gathered weight rows: the same in every pass

    def wants(self, layer: Optional[int]) -> bool:
        return layer is None or layer in self.layers

    def begin(self, ids: Optional[torch.Tensor], positions: torch.Tensor, padding: Optional[torch.Tensor],
              first: int) -> "CardPass":
        """A pass over slots [first, first + T): its ids (None where unknown), positions and padding. The recorder
        puts the pass's points of `need` in the CardPass returned (its `seen`), and gives it to `sampled` and `end`:
        the model may run the next pass while this one's cards are made (trace.recorder's worker)."""
        return CardPass(ids, positions, padding, first)

    def end(self, p: "CardPass") -> None:
        """Pass `p` is over, its cards made: its cached operands join the history, its carried ones are the next
        pass's. Passes end in the order they ran."""
        for where in self.cached:
            if where in p.seen:
                self.history.setdefault(where, []).append(p.seen[where].detach().clone())
        for where in self.carried:
            if where in p.seen:
                self.before[where] = p.seen[where].detach().clone()
        p.seen.clear()
        p.made.clear()

    # -- one point ---------------------------------------------------------------------------------------------

    def _weight(self, layer: Optional[int], name: str) -> Optional[torch.Tensor]:
        key = (layer, name)
        if key not in self._weights:
            try:
                w = self.model.get_parameter(("" if layer is None else f"layers.{layer}.") + name).detach()
            except AttributeError:  # a weight held quantized or packed: nothing to compute with
                w = None
            if w is not None and (not w.is_floating_point() or w.device.type == "meta"):
                w = None
            self._weights[key] = w
        return self._weights[key]

    def _operands(self, p: "CardPass", layer: Optional[int], o) -> Optional[list]:
        args = []
        for ref in o.inputs:
            if ref == "ids":
                if p.ids is None:
                    return None
                args.append(p.ids)
                continue
            where = self.maths.operand(layer, ref)
            if ref in (o.const("carried") or ()):
                if where not in self.before and p.first > 0:
                    return None  # the state an unobserved pass left (a long prompt's earlier prefill chunks)
                args.append(self.before.get(where))
                continue
            if where not in p.seen:
                return None
            if ref in (o.const("cached") or ()):
                joined = torch.cat(self.history.get(where, []) + [p.seen[where]], dim=1)
                if joined.size(1) != p.slots:
                    return None  # slots written by an unobserved pass (a long prompt's earlier prefill chunks)
                args.append(joined)
                continue
            args.append(p.seen[where])
        return args

    def _make(self, p: "CardPass", layer: Optional[int], name: str, index: list[int]) -> Optional[dict]:
        key = (layer, name, len(index))
        if key in p.made:
            return p.made[key]
        p.made[key] = None
        o = self.maths.op(layer, name)
        out = p.seen.get((layer, name))
        if o is None or out is None:
            return None
        args = self._operands(p, layer, o)
        weights = [self._weight(layer, w) for w in o.weights]
        if args is None or any(w is None for w in weights):
            return None
        shape = tuple(out.shape)
        # on the host, in float64 (the evaluator's constants and positions are host tensors); a matrix product's
        # weight rows are gathered where they are, then moved
        args = [a.detach().cpu() if torch.is_tensor(a) else a for a in args]
        with torch.no_grad():
            kind = op_kind(o.kind)
            if kind.kept is not None and shape[-1] > len(index):  # its weight read a row at a time: the kept rows
                y = kind.kept(o, args, weights, shape, index, self._rows)
                made = {"y": y, "index": index}
            else:
                weights = [w.cpu() for w in weights]
                y = apply(o, args, weights, shape, positions=p.positions, padding=p.padding)
                if y is None:
                    return None
                made = {"y": y, "index": None}
            made["dot"] = kind.dot(o, args, weights, shape, index[0], self._rows) if kind.dot else None
            made["aux"] = kind.aux(o, args, weights, shape) if kind.aux else None
        p.made[key] = made
        return made

    def sampled(self, p: "CardPass", layer: Optional[int], name: str, index: list[int],
                row: Optional[int]) -> Optional[dict]:
        """The computed sample of one recorded point (`row`: a batch's row, None for one prompt), or None where it
        was not computed (an operand not in the pass, a weight held quantized, an operation with nothing to check)."""
        made = self._make(p, layer, name, index)
        if made is None:
            return None
        r = 0 if row is None else row
        y, recorded = made["y"], p.seen[(layer, name)].detach().cpu()
        last = recorded.shape[-1]
        if made["index"] is None:
            y = y[r: r + 1].reshape(-1, last)[:, index]
        else:  # only the kept entries were computed
            y = y[r: r + 1].reshape(-1, len(index))
        rec = recorded[r: r + 1].reshape(-1, last)[:, index].double()
        absolute, relative = max_error(y, rec)
        out = {"values": pack(y.float().cpu().numpy()), "error": [_num(absolute), _num(relative)]}
        rows = y.size(0)
        if made["aux"]:
            out["aux"] = {k: pack(_per_row(v, r, rows).float().cpu().numpy()) for k, v in made["aux"].items()}
        if made["dot"] is not None:
            d = made["dot"]
            per_batch = {"x", "p", "rest"} | ({"w", "b"} if d["per_row"] else set())
            out["dot"] = {"i": index[0], "j": d["j"], "n": d["n"], "xg": d["xg"], "wg": d["wg"]} | {
                k: pack((d[k][r] if k in per_batch else d[k]).reshape(-1).float().cpu().numpy())
                for k in ("x", "w", "p", "rest", "b") if d.get(k) is not None}
        return out


class CardPass:
    """One pass as its cards read it: its ids (B, T) or None where unknown, positions (B, T) or (T,), padding (B, S)
    (False at pad slots) or None, its first slot and the cache's slots after it, the tensors of its points that the
    cards read (`seen`) and the cards made so far (`made`)."""

    __slots__ = ("ids", "positions", "padding", "first", "slots", "seen", "made")

    def __init__(self, ids: Optional[torch.Tensor], positions: torch.Tensor, padding: Optional[torch.Tensor],
                 first: int):
        self.ids, self.positions, self.padding = ids, positions, padding
        self.first, self.slots = first, first + positions.size(-1)
        self.seen: dict[tuple, torch.Tensor] = {}
        self.made: dict[tuple, Optional[dict]] = {}  # (layer, name, entries) -> {"y", "index" or None, "dot", "aux"}


def _num(v: float) -> Optional[float]:
    return float(f"{v:.4g}") if math.isfinite(v) else None


def _per_row(v: torch.Tensor, r: int, rows: int) -> torch.Tensor:
    """An aux value (B, ...) as one number per sample row of batch row r: a value per norm row spread over the
    sample's rows when a norm row spans several of them."""
    v = v[r: r + 1].reshape(-1)
    return v.repeat_interleave(rows // v.numel()) if rows % v.numel() == 0 and v.numel() < rows else v[:rows]
