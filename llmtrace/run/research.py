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
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from llmtrace.errors import BadValue
from llmtrace.model.capture import capture, layer_points
from llmtrace.run.generate import pad_batch
from llmtrace.run.hookpoints import (Names, PointInfo, as_declared, canonical, needs_spelled_attention, point_table,
                                    select)
from llmtrace.run.interventions import Hook, prepare

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
# run_with_cache


class ActivationCache(Mapping):
    """The full tensors of one pass, by point name (`cache["3.q_rope"]`), in forward order.

    `axes(name)` names each tensor's dimensions (("B", "T", "H", "Dh")); `point(name)` is its PointInfo. A batch's
    padding is said: `ids` (B, T), `attention_mask` (B, T) True at real tokens, `pads` each row's pad slots in front
    of it (row r's real tokens are [pads[r], T)). `approximate` is True where the model computes approximately
    (--fast: int4 kernels and bfloat16 activations), so the values are not the exact path's."""

    def __init__(self, tensors: dict[str, torch.Tensor], axes: dict[str, tuple[str, ...]],
                 points: dict[str, PointInfo], batch: Batch, approximate: bool, n_layers: int):
        self._tensors, self._axes, self._points = tensors, axes, points
        self.ids, self.attention_mask, self.pads = batch.ids, batch.attention_mask, list(batch.pads)
        self.approximate = approximate
        self._n_layers = n_layers

    def _key(self, name: str) -> str:
        key = canonical(name, self._n_layers, "name") if isinstance(name, str) else name
        if key not in self._tensors:
            held = ", ".join(list(self._tensors)[:8]) + (", …" if len(self._tensors) > 8 else "")
            raise KeyError(f"{name!r} is not in this cache (it holds {len(self._tensors)} points: {held}); "
                           f"run_with_cache(names=...) chooses them")
        return key

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._key(name)]

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

    def __repr__(self) -> str:
        exact = ", approximate" if self.approximate else ""
        return f"ActivationCache({len(self)} points, {self.nbytes / 2**20:.1f} MiB{exact})"


def run_with_cache(lm, prompt: Prompt, names: Names = None, layers: Optional[Sequence[int]] = None,
                   dtype: Any = None, device: Any = None, remove_batch_dim: bool = False, chat: bool = False,
                   system: Optional[str] = None) -> tuple[torch.Tensor, ActivationCache]:
    """One pass over `prompt`; (logits (B, T, V) float32, the cache of the points `names` and `layers` pick)."""
    want_dtype = _dtype(dtype)
    table = points_of(lm)
    wanted = select(table, names, layers, lm.config.n_layers)
    batch = encode(lm, prompt, chat, system)
    if remove_batch_dim and batch.ids.size(0) != 1:
        raise BadValue("remove_batch_dim", f" drops a batch of one; this prompt is a batch of {batch.ids.size(0)}")
    pairs = [(p.layer, p.point) for p in wanted]
    hooked = sorted({p.layer for p in wanted if p.layer is not None})
    attention = sorted({p.layer for p in wanted if p.where == "attn"})
    spell = any(needs_spelled_attention(p) for p in wanted)
    with torch.no_grad(), capture(lm.model, pairs, layers=hooked, attention=attention, spell_out=spell) as kept:
        logits = forward(lm, batch)
    tensors, axes, points = {}, {}, {}
    for p in wanted:  # forward order
        x = kept.get((p.layer, p.point))
        if x is None:
            continue  # not reported by this pass (the last position's slice: the generation loop's)
        x, ax = _laid_out(x, p.axes, want_dtype, device, remove_batch_dim)
        tensors[p.name], axes[p.name], points[p.name] = x, ax, p
    _check_reported(names, wanted, tensors)
    approximate = bool(lm.config.extra.get("fast"))
    return logits, ActivationCache(tensors, axes, points, batch, approximate, lm.config.n_layers)


def _laid_out(x: torch.Tensor, axes: tuple[str, ...], dtype, device, remove_batch_dim: bool):
    x = as_declared(x, axes)
    if x.dim() != len(axes):  # the declaration's axes are what the pass reported; say it if not
        axes = tuple(axes[len(axes) - x.dim():]) if x.dim() < len(axes) else axes
    if x.is_floating_point():
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
        raise BadValue("names", f" {missing[0]!r} is not reported by a pass over every position (it is the "
                                f"generation loop's slice of the last position: take [:, -1] of the point before it)")


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


def as_interventions(hooks: Sequence[Any]) -> list:
    """(name, fn) pairs as Hooks; Hook, Ablate, Scale, Patch, Steer and ControlVector as they are."""
    out = []
    for h in hooks:
        if isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str):
            h = Hook(h[0], h[1])
        elif not hasattr(h, "kind"):
            raise BadValue("hooks", f" takes (name, fn) pairs, llmtrace.Hook or the interventions (Ablate, ...), not "
                                    f"{h!r}")
        out.append(h)
    return out


@contextlib.contextmanager
def hooks_attached(lm, hooks: Sequence[Any], pads: Optional[Sequence[int]] = None, lengths: Sequence[int] = ()):
    """Within the block, every pass of the model runs `hooks` (the one hook, as `generate` attaches its edits); on
    exit, also by an exception, the model is as before."""
    edits = prepare(lm, as_interventions(hooks), list(lengths))
    if edits is None:
        yield
        return
    edits.begin_pass(prompt=True, pads=pads)
    with lm.model.hooked(edits, edits.layers, spell_out=edits.spell_out):
        yield


def run_with_hooks(lm, prompt: Prompt, hooks: Sequence[Any] = (), chat: bool = False,
                   system: Optional[str] = None) -> torch.Tensor:
    """One pass over `prompt` with `hooks` attached: the logits (B, T, V), float32."""
    batch = encode(lm, prompt, chat, system)
    T = batch.ids.size(1)
    with torch.no_grad(), hooks_attached(lm, hooks, batch.pads, [T - pad for pad in batch.pads]):
        return forward(lm, batch)
