"""The researcher's API: one forward pass with full tensors kept (run_with_cache) or your own functions on the points
(run_with_hooks, hooks_attached), as TransformerLens users know them, on every family llmtrace runs.

Nothing here is a second mechanism. A cache is the one capture (model.capture) around a pass; your functions are
edits of the one hook (run.interventions.Edits, where Ablate, Scale, Patch, Steer and ControlVector are edits too),
attached with `Transformer.hooked`. A pass is the prefill `generate` runs: the prompt(s) through a fresh KV cache from
slot 0, a batch left-padded as `generate` pads it (run.generate.pad_batch), logits at every position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from llmtrace.errors import BadValue
from llmtrace.model.capture import capture, layer_points
from llmtrace.model.llama_points import ATTN_NORM, FINAL_NORM, LAST
from llmtrace.run.generate import pad_batch
from llmtrace.run.hookpoints import (HookError, Names, NoSuchPoint, PointInfo, as_declared, canonical, check_layer,
                                    did_you_mean, from_transformer_lens, function_name, needs_spelled_attention,
                                    point_table, select, translated)
from llmtrace.run.interventions import Hook, prepare
from llmtrace.units import plural

Prompt = Union[str, Sequence[str], Sequence[int], Sequence[Sequence[int]], torch.Tensor]


def points_of(lm) -> list[PointInfo]:
    """Every point of the loaded model in forward order, as its hooks see them."""
    return point_table(lm.model, lambda i: layer_points(lm.model, i))


# ----------------------------------------------------------------------------------------------------------------
# the prompt


@dataclass
class Batch:
    """The ids of one pass, (B, T), left-padded: `pads` each row's pad slots in front of it, `attention_mask` (B, T)
    True at real tokens, `positions` (B, T) each token's position (0 at a row's first real token)."""

    ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    pads: list[int]

    @property
    def padded(self) -> bool:
        return any(self.pads)


def encode(lm, prompt: Prompt, chat: bool = False, system: Optional[str] = None) -> Batch:
    """A prompt as one pass takes it: a text, a list of texts (a batch), ids (a list or a 1-D tensor), a list of id
    lists or a (B, T) tensor; texts through the tokenizer as `generate` encodes them."""
    rows = _rows(lm, prompt, chat, system)
    for r, ids in enumerate(rows):
        if not ids:
            raise BadValue("prompt", f"{f' {r + 1} of the batch' if len(rows) > 1 else ''} is empty; give some text")
        bad = [i for i in ids if not 0 <= i < lm.config.vocab_size]
        if bad:
            raise BadValue("prompt", f" holds id {bad[0]}, outside the vocabulary (0..{lm.config.vocab_size - 1})")
    longest = max(len(ids) for ids in rows)
    if longest > lm.config.max_seq_len:
        raise BadValue("prompt", f" has {longest} tokens, more than the context window ({lm.config.max_seq_len})")
    layout = pad_batch(rows, lm.tokenizer)
    dev = lm.device
    return Batch(torch.tensor(layout.ids, dtype=torch.long, device=dev),
                 torch.tensor(layout.attention_mask, dtype=torch.bool, device=dev),
                 torch.tensor(layout.position_ids, dtype=torch.long, device=dev),
                 [longest - len(ids) for ids in rows])


def _rows(lm, prompt: Prompt, chat: bool, system: Optional[str]) -> list[list[int]]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() not in (1, 2) or prompt.dtype.is_floating_point:
            raise BadValue("prompt", f" as a tensor holds token ids, (T,) or (B, T); got {tuple(prompt.shape)} "
                                     f"{prompt.dtype}")
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return [lm.tokenizer.encode_prompt(prompt, chat=chat, system=system)[1]]
    items = list(prompt)
    if items and all(isinstance(t, str) for t in items):
        return [lm.tokenizer.encode_prompt(t, chat=chat, system=system)[1] for t in items]
    if items and all(isinstance(i, int) for i in items):
        return [items]
    if items and all(isinstance(r, (list, tuple)) and all(isinstance(i, int) for i in r) for r in items):
        return [list(r) for r in items]
    raise BadValue("prompt", " must be a text, a list of texts, token ids or a list of id lists")


def forward(lm, batch: Batch) -> torch.Tensor:
    """The pass: (B, T) ids through a fresh KV cache from slot 0 -> logits (B, T, V) in float32."""
    B, T = batch.ids.shape
    cache = lm.model.new_cache(T, batch=B)
    padding = {"input_pos": batch.positions, "attention_mask": batch.attention_mask} if batch.padded else {}
    return lm.model(batch.ids, cache, 0, **padding).float()


# ----------------------------------------------------------------------------------------------------------------
# gradients: the pass as one autograd graph


def grad_mode(grad: bool):
    """torch's mode for a pass: a graph (grad=True) or none."""
    return torch.enable_grad() if grad else torch.no_grad()


def check_grad(lm, field: str = "grad") -> None:
    """A pass with gradients needs a model whose every step has one: the exact path (float or keep_quantized)."""
    if lm.config.extra.get("fast"):
        raise BadValue(field, " needs the exact path: a model loaded with fast=True multiplies by int4 kernels, which "
                              "have no gradient; load it without fast (keep_quantized=True keeps the file's blocks)")


@contextlib.contextmanager
def graph_hook(lm, table: list[PointInfo], through: Sequence[PointInfo], backward: Sequence[tuple[PointInfo, Any]]):
    """Within the block, a pass is one autograd graph from its first point on (the embedding's rows become a leaf
    that requires a gradient, the weights staying frozen), and the pass goes on from the very tensors kept at the
    points `through` and at the points of `backward`: at an editable point the hook hands the pass an alias of its
    tensor, a node of its own in the graph, so that q (which Llama's projection reports as a slice of one q/k tensor)
    has a gradient too. `backward`: (point, fn) pairs, fn(grad, point) registered on that tensor, called with the
    gradient flowing back through the point (None observes; a tensor of its shape replaces it). Yields the list of
    (point, tensor) the backward hooks sit on, for `check_backward`."""
    first = (table[0].layer, table[0].point)
    keys = {(p.layer, p.point) for p in through if p.editable} | {(p.layer, p.point) for p, _ in backward if p.editable}
    on = {}
    for p, fn in backward:
        on.setdefault((p.layer, p.point), []).append((p, fn))
    registered: list[tuple[PointInfo, torch.Tensor]] = []

    def hook(layer, name, x):
        y = x
        if (layer, name) == first and not x.requires_grad:
            y = x.detach().requires_grad_(True)  # (B, T, D): where the graph starts
        elif (layer, name) in keys and x.is_floating_point():
            y = x.view_as(x) if x.requires_grad else x.detach().requires_grad_(True)
        for info, fn in on.get((layer, name), ()):
            if y.requires_grad:
                y.register_hook(backward_op(info, fn))
            registered.append((info, y))
        return None if y is x else y

    layers = sorted({p.layer for p in list(through) + [p for p, _ in backward] if p.layer is not None})
    attention = sorted({p.layer for p in list(through) + [p for p, _ in backward] if p.where == "attn"})
    spell = any(needs_spelled_attention(p) for p, _ in backward)
    with lm.model.hooked(hook, layers, attention=attention, spell_out=spell):
        yield registered


def backward_op(info: PointInfo, fn, what: str = "backward hook"):
    """fn(grad, info) as a tensor hook: None observes the gradient, a tensor of its shape replaces it; anything else
    and any exception fn raises is a HookError naming the point."""
    who = function_name(fn)

    def op(grad: torch.Tensor):
        try:
            y = fn(grad, info)
        except HookError:
            raise
        except Exception as e:
            raise HookError(f"{what} {who} at point {info.name!r} raised {type(e).__name__}: {e}", info.name) from e
        if y is None or y is grad:
            return None
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(grad.shape):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise HookError(f"{what} {who} at point {info.name!r} returned {got}; a gradient's replacement must be "
                            f"a tensor of the gradient's shape {tuple(grad.shape)} ({', '.join(info.axes)})",
                            info.name)
        return y.to(device=grad.device, dtype=grad.dtype)

    return op


def graph_of(out: torch.Tensor) -> tuple[set, set]:
    """The autograd nodes `out` was computed through, and the ids of the leaves it reads."""
    nodes, leaves, todo = set(), set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        variable = getattr(node, "variable", None)  # a leaf's AccumulateGrad
        if variable is not None:
            leaves.add(id(variable))
        todo.extend(f for f, _ in node.next_functions)
    return nodes, leaves


def on_path(x: torch.Tensor, graph: tuple[set, set]) -> bool:
    """Whether the output the graph was taken of depends on x (so that it has a gradient with respect to x)."""
    nodes, leaves = graph
    if not x.requires_grad:
        return False
    return x.grad_fn in nodes if x.grad_fn is not None else id(x) in leaves


def check_backward(registered: list[tuple[PointInfo, torch.Tensor]], logits: torch.Tensor) -> None:
    """A backward hook on a point the logits do not depend on would never be called: said, with the point."""
    graph = graph_of(logits)
    for info, x in registered:
        if not on_path(x, graph):
            raise HookError(f"no gradient flows back through {info.name}: the pass does not go on from it (it is "
                            f"reported beside the computation); a backward hook needs a point the logits depend on, "
                            f"such as an editable one", info.name)


# ----------------------------------------------------------------------------------------------------------------
# run_with_cache


class ActivationCache(Mapping):
    """The full tensors of one pass, by point name (`cache["3.q_rope"]`), in forward order.

    `axes(name)` names each tensor's dimensions (("B", "T", "H", "Dh")); `point(name)` is its PointInfo. A batch's
    padding is said: `ids` (B, T), `attention_mask` (B, T) True at real tokens, `pads` each row's pad slots in front
    of it (row r's real tokens are [pads[r], T)). `approximate` is True where the model computes approximately
    (--fast: int4 kernels and bfloat16 activations), so the values are not the exact path's. `spelled_out`: the
    layers whose attention this pass spelled out step by step because a kept point exists only there (the scores,
    the probabilities): the fused kernel's rounding differs (~1e-5), so the logits are those of that path; empty, the
    pass computed what an unobserved pass computes, bit for bit. `grad`: the tensors are the pass's own, nodes of
    one autograd graph with the logits (run_with_cache(grad=True)); a point the logits do not depend on is held
    detached. TransformerLens's names are understood (`cache["blocks.3.attn.hook_pattern"]` is `cache["3.probs"]`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], axes: dict[str, tuple[str, ...]],
                 points: dict[str, PointInfo], batch: Batch, approximate: bool, n_layers: int,
                 table: Sequence[PointInfo] = (), model=None, spelled_out: Sequence[int] = (), grad: bool = False):
        self._tensors, self._axes, self._points = tensors, axes, points
        self.ids, self.attention_mask, self.pads = batch.ids, batch.attention_mask, list(batch.pads)
        self.approximate = approximate
        self._n_layers = n_layers
        self._table, self._model = list(table), model
        self.spelled_out, self.grad = list(spelled_out), grad

    def _key(self, name: str) -> str:
        if not isinstance(name, str):
            return name
        try:
            ours = from_transformer_lens(name, self._table) if self._table else None
        except NoSuchPoint as e:
            raise KeyError(str(e)) from None
        key = canonical(ours or name, self._n_layers, "name")
        if key not in self._tensors:
            held = ", ".join(list(self._tensors)[:8]) + (", …" if len(self._tensors) > 8 else "")
            said = f"{name!r} (TransformerLens) is {key}, which" if ours else f"{name!r} is not in this cache: it"
            known = any(p.name == key for p in self._table) or not self._table
            hint = "" if known or ours else did_you_mean(key, self._table)
            raise KeyError(f"{said} is not held{hint} (this cache holds {len(self._tensors)} points: {held}); "
                           f"run_with_cache(names=...) chooses them")
        return key

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._key(name)]

    def __contains__(self, name) -> bool:
        try:
            self._key(name)
        except (KeyError, BadValue):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def names(self) -> list[str]:
        """The names held, in forward order."""
        return list(self._tensors)

    def axes(self, name: str) -> tuple[str, ...]:
        return self._axes[self._key(name)]

    def point(self, name: str) -> PointInfo:
        return self._points[self._key(name)]

    @property
    def nbytes(self) -> int:
        """The bytes the kept tensors take."""
        return sum(t.nbytes for t in self._tensors.values())

    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: Any = None, return_labels: bool = False):
        """The residual stream as the layers receive it, stacked: (components, B, T, D) (no B after
        remove_batch_dim). The components are resid_pre of layers 0 .. `layer` (with resid_mid after each of those
        before `layer` when `incl_mid`); `layer` None (or -1, or the number of layers) takes every layer's and the
        last layer's resid_post, the stream the final norm reads. `apply_ln`: each component through the norm that
        reads the stream there, computed afresh for each (the logit lens): the final norm for every layer, else
        `layer`'s norm before attention. `pos_slice`: an index or slice of the T axis. `return_labels`: (stack, the
        point names). TransformerLens's `cache.accumulated_resid`; it needs the stream kept:
        run_with_cache(names="*.resid_*")."""
        L = self._n_layers
        upto = L if layer in (None, -1, L) else check_layer("layer", layer, L)
        labels = []
        for i in range(upto + 1):
            if i == L:
                labels.append(f"{L - 1}.resid_post")
                continue
            labels += [f"{i}.resid_pre"] + ([f"{i}.resid_mid"] if incl_mid and i < upto else [])
        missing = [n for n in labels if n not in self._tensors]
        if missing:
            raise KeyError(f"accumulated_resid needs {missing[0]}, which this cache does not hold; keep the stream: "
                           f"run_with_cache(names=\"*.resid_*\")")
        stack = torch.stack([self._tensors[n] for n in labels])  # (components, B, T, D)
        if apply_ln:
            stack = self._norm_before(None if upto == L else upto)(stack)
        if pos_slice is not None:
            index = [slice(None)] * stack.dim()
            index[1 + self._axes[labels[0]].index("T")] = pos_slice
            stack = stack[tuple(index)]
        return (stack, labels) if return_labels else stack

    def _norm_before(self, layer: Optional[int]):
        """The norm that reads the stream next: the final norm (layer None), or `layer`'s norm before attention."""
        if self._model is None:
            raise BadValue("apply_ln", " needs the model's norms; this cache was made without the model")
        if layer is None:
            return self._model.norm
        try:
            return self._model.norm_of(layer, ATTN_NORM.name)
        except KeyError:
            raise BadValue("apply_ln", f" with layer={layer}: layer {layer} reads the stream without a norm before "
                                       f"attention (its norms follow the sub-layers); leave layer=None for the final "
                                       f"norm") from None

    def __repr__(self) -> str:
        exact = ", approximate" if self.approximate else ""
        spelled = f", attention spelled out in {plural(len(self.spelled_out), 'layer')}" if self.spelled_out else ""
        grad = ", with gradients" if self.grad else ""
        return f"ActivationCache({len(self)} points, {self.nbytes / 2**20:.1f} MiB{exact}{spelled}{grad})"


def run_with_cache(lm, prompt: Prompt, names: Names = None, layers: Optional[Sequence[int]] = None,
                   dtype: Any = None, device: Any = None, remove_batch_dim: bool = False, chat: bool = False,
                   system: Optional[str] = None, grad: bool = False,
                   names_filter: Names = None) -> tuple[torch.Tensor, ActivationCache]:
    """One pass over `prompt`; (logits (B, T, V) float32, the cache of the points `names` and `layers` pick).
    `names_filter` is `names` under TransformerLens's keyword. `grad`: the logits and the kept tensors are one
    autograd graph (the tensors the pass's own, in its dtype and on its device), so that
    torch.autograd.grad(logits[0, -1, t], cache["1.resid_post"]) is that logit's gradient there."""
    names = _one_of(names, names_filter)
    if grad:
        check_grad(lm)
        if remove_batch_dim or device is not None or (dtype is not None and _dtype(dtype) != lm.dtype):
            asked = "remove_batch_dim" if remove_batch_dim else "device" if device is not None else "dtype"
            raise BadValue(asked, f" makes a copy the pass does not go on from, which has no gradient; with grad=True "
                                  f"the cache holds the pass's own tensors (take [0], .to() of what you compute)")
    want_dtype = None if grad else _dtype(dtype)
    table = points_of(lm)
    wanted = select(table, names, layers, lm.config.n_layers)
    batch = encode(lm, prompt, chat, system)
    if remove_batch_dim and batch.ids.size(0) != 1:
        raise BadValue("remove_batch_dim", f" drops a batch of one; this prompt is a batch of {batch.ids.size(0)}")
    pairs = [(p.layer, p.point) for p in wanted]
    derived = any(p.point == LAST.name and p.layer is None for p in wanted)
    if derived:  # the last position's row of final_norm: the generation loop's slice, taken here from the pass's
        pairs.append((None, FINAL_NORM.name))
    hooked = sorted({p.layer for p in wanted if p.layer is not None})
    attention = sorted({p.layer for p in wanted if p.where == "attn"})
    spell = any(needs_spelled_attention(p) for p in wanted)
    with contextlib.ExitStack() as held:
        held.enter_context(grad_mode(grad))
        if grad:
            held.enter_context(graph_hook(lm, table, wanted, ()))
        kept = held.enter_context(capture(lm.model, pairs, layers=hooked, attention=attention, spell_out=spell,
                                          clone=not grad))
        spelled = spelled_layers(lm.model)
        logits = forward(lm, batch)
    graph = graph_of(logits) if grad else None
    tensors, axes, points = {}, {}, {}
    for p in wanted:  # forward order
        x = kept.get((p.layer, p.point))
        if x is None and derived and p.point == LAST.name:
            x = kept[(None, FINAL_NORM.name)][:, -1]  # (B, D)
        if x is None:
            continue  # not reported by this pass
        if grad and not on_path(x, graph):
            x = x.detach()  # reported beside the computation: the logits do not depend on it
        x, ax = _laid_out(x, p.axes, want_dtype, device, remove_batch_dim)
        tensors[p.name], axes[p.name], points[p.name] = x, ax, p
    _check_reported(names, wanted, tensors)
    approximate = bool(lm.config.extra.get("fast"))
    return logits, ActivationCache(tensors, axes, points, batch, approximate, lm.config.n_layers, table, lm.model,
                                   spelled, grad)


def spelled_layers(model) -> list[int]:
    """The layers whose attention the attached hooks make spell out, where it has a fused form (an unobserved pass
    takes the fused kernel there)."""
    attention = [model.attention_of(i) for i in range(model.config.n_layers)]
    return [i for i, attn in enumerate(attention) if getattr(attn, "spell_out", False) and getattr(attn, "fused", False)]


def _one_of(names: Names, names_filter: Names) -> Names:
    if names is not None and names_filter is not None:
        raise BadValue("names_filter", " is TransformerLens's name for names; give one of them")
    return names if names is not None else names_filter


def _laid_out(x: torch.Tensor, axes: tuple[str, ...], dtype, device, remove_batch_dim: bool):
    x = as_declared(x, axes)
    if x.dim() != len(axes):  # the declaration's axes are what the pass reported; say it if not
        axes = tuple(axes[len(axes) - x.dim():]) if x.dim() < len(axes) else axes
    if x.is_floating_point() and dtype is not None:
        x = x.to(dtype)
    if device is not None:
        x = x.to(device)
    if remove_batch_dim and axes[:1] == ("B",):
        x, axes = x[0], axes[1:]
    return x, axes


def _check_reported(names: Names, wanted: list[PointInfo], tensors: dict) -> None:
    """A point named one by one that the pass did not report is an error (a glob or a predicate takes what is)."""
    if names is None or callable(names):
        return
    explicit = [names] if isinstance(names, str) else list(names)
    if any(any(c in n for c in "*?[") for n in explicit):
        return
    missing = [p.name for p in wanted if p.name not in tensors]
    if missing:
        raise BadValue("names", f" {missing[0]!r} is not reported by this pass")


def _dtype(dtype: Any) -> torch.dtype:
    """float32 unless told: a torch dtype or its name ("bfloat16")."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise BadValue("dtype", f" {dtype!r} is not a floating-point dtype (float32, bfloat16, float16, float64)")
    return value


# ----------------------------------------------------------------------------------------------------------------
# run_with_hooks and hooks


def as_interventions(hooks: Sequence[Any], table: Optional[list[PointInfo]] = None, field: str = "hooks") -> list:
    """(name, fn) pairs as Hooks; Hook, Ablate, Scale, Patch, Steer and ControlVector as they are. With the model's
    `table`, a TransformerLens name is translated (("blocks.3.attn.hook_z", fn) runs at 3.attn_out)."""
    out = []
    for h in hooks:
        if isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str):
            h = Hook(h[0], h[1])
        elif not hasattr(h, "kind"):
            raise BadValue(field, f" takes (name, fn) pairs, llmtrace.Hook or the interventions (Ablate, ...), not "
                                  f"{h!r}")
        if isinstance(h, Hook) and table is not None:
            h = replace(h, name=translated(h.name, table, field))
        out.append(h)
    return out


@contextlib.contextmanager
def hooks_attached(lm, hooks: Sequence[Any], pads: Optional[Sequence[int]] = None, lengths: Sequence[int] = ()):
    """Within the block, every pass of the model runs `hooks` (the one hook, as `generate` attaches its edits); on
    exit, also by an exception, the model is as before."""
    edits = prepare(lm, as_interventions(hooks, points_of(lm) if hooks else None), list(lengths))
    if edits is None:
        yield
        return
    edits.begin_pass(prompt=True, pads=pads)
    with lm.model.hooked(edits, edits.layers, spell_out=edits.spell_out):
        yield


def backward_hooks(lm, table: list[PointInfo], hooks: Sequence[Any]) -> list[tuple[PointInfo, Any]]:
    """(name, fn) pairs as (point, fn) pairs, one for each point a name (a glob, a TransformerLens name) picks."""
    out = []
    for h in hooks:
        if not (isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str) and callable(h[1])):
            raise BadValue("bwd_hooks", f" takes (name, fn) pairs, fn(grad, point); not {h!r}")
        out += [(info, h[1]) for info in select(table, h[0], None, lm.config.n_layers, "bwd_hooks")]
    return out


def run_with_hooks(lm, prompt: Prompt, hooks: Sequence[Any] = (), chat: bool = False,
                   system: Optional[str] = None, fwd_hooks: Sequence[Any] = (), bwd_hooks: Sequence[Any] = (),
                   grad: bool = False) -> torch.Tensor:
    """One pass over `prompt` with `hooks` attached (and `fwd_hooks`, TransformerLens's keyword for the same): the
    logits (B, T, V), float32. `bwd_hooks` ((name, fn) pairs) and `grad` make the pass one autograd graph: the logits
    carry it, and each fn(grad, point) is called with the gradient flowing back through its point when a backward
    pass (logits[...].backward(), torch.autograd.grad) goes through it."""
    batch = encode(lm, prompt, chat, system)
    T = batch.ids.size(1)
    grad = grad or bool(bwd_hooks)
    if grad:
        check_grad(lm, "bwd_hooks" if bwd_hooks else "grad")
    table = points_of(lm) if grad else []
    backward = backward_hooks(lm, table, bwd_hooks)
    with contextlib.ExitStack() as held:
        held.enter_context(grad_mode(grad))
        held.enter_context(hooks_attached(lm, list(hooks) + list(fwd_hooks), batch.pads,
                                          [T - pad for pad in batch.pads]))
        registered = held.enter_context(graph_hook(lm, table, (), backward)) if grad else []
        logits = forward(lm, batch)
    if backward:
        check_backward(registered, logits)
    return logits


def to_tokens(lm, prompt: Prompt, chat: bool = False, system: Optional[str] = None) -> torch.Tensor:
    """The ids a pass over `prompt` runs, (B, T) on the model's device: a text as `generate` encodes it (the
    tokenizer's BOS where the model's template puts one), a list of texts left-padded as a batch is.
    TransformerLens's `model.to_tokens`."""
    return encode(lm, prompt, chat, system).ids


def to_str_tokens(lm, prompt: Union[str, Sequence[int], torch.Tensor], chat: bool = False,
                  system: Optional[str] = None) -> list[str]:
    """Each token of one prompt (a text, or ids) as the text it stands for alone. TransformerLens's
    `model.to_str_tokens`."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist() if prompt.dim() == 1 or prompt.size(0) == 1 else prompt
    if not isinstance(prompt, str) and prompt and not all(isinstance(i, int) for i in prompt):
        raise BadValue("prompt", " of to_str_tokens is one text or one list of ids")
    ids = encode(lm, prompt, chat, system).ids[0].tolist()
    return [lm.tokenizer.decode([i]) for i in ids]
