"""The few values beyond each point's sample that the report's worked examples read (--trace full).

A point's sample (the first entries of each half of every row, and each row's norm) lets a page recompute most steps
on the same head and row: an add, a GLU, a soft-cap, RoPE's pairs. Some steps need a little more, and the model's
declaration (model.maths) says which:
    gamma      a norm's γ at the sampled entries (rmsnorm: y_i = x_i / rms(x) · γ_i, rms from the row's norm)
    sink       a softmax's sink logit per head (gpt-oss), beside the scores' log-sum-exp
    lse        the log-sum-exp of each row of a softmax's input (p_i = exp(s_i − lse) for the sampled entries)
    full       whole rows of the scores' operands in a few layers: every key of the pass, and every query of a short
               pass (else the last position's), so that q·k is worked out over all Dh entries (packed as float32,
               trace.packed, as the samples are); and, in the same rows, whole rows of RoPE's input where its sample
               lacks a rotated entry's partner (a partial rotary width whose half is past the sample's first entries,
               or a q/k normed over the whole projection before the split), so that every rotated entry is worked
Nothing here names a point: the operations say what is read.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmtrace.trace.records import rounded

SAMPLE_WIDTH = 16  # a sample keeps a row whole up to this many entries, else the first 8 of each half (recorder)
FULL_ROW_LAYERS = 4  # whole q/k rows are kept in at most this many layers (the selected ones, else the first and last)
ALL_QUERIES = 64  # a pass of at most this many tokens keeps every query row whole; a longer one its last


def full_row_layers(selected: Optional[list[int]], n_layers: int) -> list[int]:
    """The layers whose scores' operands keep whole rows: the selected layers when there are at most four, else the
    first and the last of them."""
    layers = sorted({l % n_layers for l in selected}) if selected is not None else list(range(n_layers))
    return layers if len(layers) <= FULL_ROW_LAYERS else [layers[0], layers[-1]]


class Worked:
    """What the worked examples read, worked out once from the model's declaration at the start of a run."""

    def __init__(self, lm, selected: Optional[list[int]]):
        maths, model, n = lm.maths, lm.model, lm.config.n_layers
        self.layers = set(range(n)) if selected is None else {l % n for l in selected}
        self.full_layers = full_row_layers(selected, n)
        self.every_query = selected is not None  # with every layer traced, the last query's rows only (a page's size)
        self.weights: dict[tuple, tuple[str, torch.Tensor]] = {}  # (layer, point) -> ("gamma" | "sink", values)
        self._extra: dict[tuple, Optional[dict]] = {}  # sample_extra's answers: the same in every pass
        self.softmax_inputs: set[str] = set()
        self.full: dict[tuple, str] = {}  # (layer, point) -> "last" (the pass's last position) or "all"
        self.rope_inputs: dict[tuple, tuple[int, int]] = {}  # (layer, point) -> RoPE's (rotary width, head width)
        for layer, table in [(None, maths.model)] + [(i, maths.layers[i]) for i in sorted(self.layers)]:
            for name, o in table.items():
                if o.kind == "rmsnorm" and o.weights:  # (a norm without a scale has no γ to keep)
                    self._keep(model, layer, name, "gamma", o.weights[0])
                elif o.kind == "softmax":
                    self.softmax_inputs.add(o.inputs[0])
                    if o.const("sink"):
                        self._keep(model, layer, name, "sink", o.weights[0])
                elif o.kind == "scores" and layer in self.full_layers:
                    q, k = o.inputs[0], o.inputs[1]
                    if table.get(k) is not None and table[k].kind == "repeat_kv":
                        k = table[k].inputs[0]  # the keys before the GQA view
                    self.full[(layer, q)], self.full[(layer, k)] = "last", "all"
            for name, o in table.items():  # RoPE's input, kept whole as its output is (see rope_needs_rows)
                if o.kind == "rope" and (layer, name) in self.full and o.inputs[0] in table:
                    c = o.const
                    if c("rotation") != "none" and c("rotary_dim"):
                        self.rope_inputs[(layer, o.inputs[0])] = (c("rotary_dim"), c("head_dim"))
                        self.full[(layer, o.inputs[0])] = self.full[(layer, name)]

    def _keep(self, model, layer: Optional[int], name: str, kind: str, weight: str) -> None:
        try:
            w = model.get_parameter(("" if layer is None else f"layers.{layer}.") + weight)
        except AttributeError:  # a weight the model holds quantized or packed: the card says so
            return
        if w.is_floating_point() and w.device.type != "meta":  # a layer offloaded to disk (device_map) keeps none
            self.weights[(layer, name)] = (kind, w.detach().double().cpu().reshape(-1))

    def sample_extra(self, layer: Optional[int], name: str, index: list[int]) -> Optional[dict]:
        """The weight values a sample of this point carries: γ at its entries, or a sink per head (worked out once per
        point and entries, then the same dict every pass)."""
        key = (layer, name, len(index), index[-1])  # an index list is fixed by its length and last entry (recorder)
        if key not in self._extra:
            got = self.weights.get((layer, name))
            if got is None:
                self._extra[key] = None
            else:
                kind, w = got
                values = w[index] if kind == "gamma" and w.numel() > max(index) else w
                self._extra[key] = {kind: [rounded(v) for v in values.tolist()]}
        return self._extra[key]

    def full_rows(self, layer: Optional[int], name: str, x: torch.Tensor) -> Optional[dict]:
        """Whole rows of a scores operand (x: (1, T, heads, Dh)) or of RoPE's input where its sample lacks a partner
        (x: (1, T, heads, Dh) or (1, T, heads·Dh)): {"t": [first, last] (the rows along the pass's T), "values": (rows,
        heads, Dh), heads 1 for a whole projection}."""
        which = self.full.get((layer, name))
        if which is None or x.dim() not in (3, 4):
            return None
        rope = self.rope_inputs.get((layer, name))
        if rope is not None and not rope_needs_rows(x.size(-1), *rope):
            return None
        if x.dim() == 3:
            if rope is None:
                return None
            x = x.unsqueeze(2)  # a whole projection: one "head" of H·Dh entries
        T = x.size(1)
        if which == "last" and T <= ALL_QUERIES and self.every_query:  # a short pass keeps every query
            which = "all"
        rows = x[0, -1:] if which == "last" else x[0]  # (1 or T, heads, Dh)
        first = T - 1 if which == "last" else 0
        return {"t": [first, T - 1], "values": rows.detach().float().cpu()}


def sample_index(width: int, sample_width: int = SAMPLE_WIDTH) -> list[int]:
    """The entries a sample keeps along a last axis of `width` (the recorder's rule): all of them up to
    `sample_width`, else the first sample_width/2 of each half."""
    half = sample_width // 2
    return list(range(width)) if width <= sample_width else list(range(half)) + list(range(width // 2, width // 2 + half))


def rope_needs_rows(width: int, rotary_dim: int, head_dim: int) -> bool:
    """Whether RoPE's input, `width` entries a row, lacks in its sample a partner of a rotated entry of its output's
    sample: rotate-half pairs entry i with i + d/2 over the rotary width d; a whole projection (width ≠ Dh) keeps
    only the first heads' entries."""
    if width != head_dim:
        return True
    have, half = set(sample_index(width, SAMPLE_WIDTH)), rotary_dim // 2
    return any((i if i < half else i - half) not in have or (i if i < half else i - half) + half not in have
               for i in sample_index(head_dim, SAMPLE_WIDTH) if i < rotary_dim)
