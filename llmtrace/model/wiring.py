"""A block's wiring, declared: how each part of a decoder layer enters the residual stream.

A layer reads the stream x and hands it on changed by a few additions, each the output of one part:

    x ← x + post(factor · part(norm(x)))        for each addition, in order
    x ← x · scale                                 where the layer rescales the whole stream (Gemma 4's layer_scalar)

A block declares its additions (`Block.WIRING`, a tuple of `Addition`) and any rescale (`Block.RESCALE`); its forward
pass and its maths are made from them (model.transformer.Block), so a family composes declared parts instead of
rewriting the loop:

    Llama, Qwen3, Mistral ...   pre-norm: Addition("attn", "resid_mid", norm="attn_norm"), then the feed-forward's
    OLMo 2                      post-norm: no norm before, `post_norm` on the output
    Gemma 2, 3, 4               sandwich norms: both
    Granite 4.0-H               pre-norm, each output × residual_multiplier (`factor`, a number the block holds)
    Gemma 4                     a third addition (the per-layer input, a step of the block's own, `output` its point),
                                then the stream × the layer's learned scalar (`RESCALE`)
    Falcon-H1 (not yet a family) parallel mixers: the second mixer `reads` the stream the first read (and shares its
                                normed input), and both outputs are added

What a direct logit attribution needs from a layer (`Path`, resolved from the declaration by `Block.paths`): each
addition's output point, the point it reads, its post-norm and factor, and how its output splits into parts
(`Module.direct_parts`): an attention-like mixer by head (its merged heads through the output projection, `HEADS`), a
mixture of experts by expert (and its shared experts), anything else as one part named by its kind. A post-norm
makes its part nonlinear in the sub-layer's output: DLA then takes the post-normed output, with the norm's scale
frozen at this input's value (x ↦ x · s · γ), which is linear again, so the heads still split exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Addition:
    """One addition to the residual stream: `part` (the block's attribute holding the sub-layer, or a step of the
    block's own such as Gemma 4's "ple"), the stream point after the add (`total`); the norm of its input (`norm`, a
    point of the block's NORMS; None: it reads the stream as it is), of its output before the add (`post_norm`), a
    constant the output is multiplied by first (`factor`: the block's attribute holding it; `scaled`: the point of the
    product), the stream point it reads where not the stream at its turn (`reads`: parallel mixers), and its output
    point where the part is no module of its own (`output`)."""

    part: str
    total: str
    norm: Optional[str] = None
    post_norm: Optional[str] = None
    factor: Optional[str] = None
    scaled: Optional[str] = None
    reads: Optional[str] = None
    output: Optional[str] = None


@dataclass(frozen=True)
class Rescale:
    """The whole stream multiplied after the additions: total = x · the block's parameter `factor` (Gemma 4)."""

    factor: str
    total: str


@dataclass(frozen=True)
class Path:
    """One addition of one layer, resolved: the points its output split reads (`capture`), the point it reads
    (`input`), its output point, its post-norm's point (None) and its factor as a number."""

    addition: Addition
    input: str
    output: str
    capture: tuple[str, ...]
    factor: float = 1.0

    @property
    def part(self) -> str:
        return self.addition.part

    @property
    def post_norm(self) -> Optional[str]:
        return self.addition.post_norm


@dataclass(frozen=True)
class LayerWiring:
    """A layer's additions (Path each, in order), the stream point it hands on, and the factor the whole stream is
    multiplied by at its end (1.0: none)."""

    paths: tuple[Path, ...]
    output: str
    rescale: float = 1.0


# ----------------------------------------------------------------------------------------------------------------
# splitting an output into its parts (at one position: vectors, in float32)


def linear32(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) in float32: a plain Linear's weights upcast, anything else (GGUF blocks kept, --fast) called in its
    own dtype."""
    if type(module) is nn.Linear:
        b = None if module.bias is None else module.bias.float()
        return F.linear(x.float(), module.weight.float(), b)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    if hasattr(module, "compute"):
        dtype = module.compute
    return module(x.to(dtype)).float()


def split_heads(proj: nn.Module, heads: torch.Tensor) -> dict[str, tuple[str, torch.Tensor]]:
    """heads (H, width), the merged heads an output projection reads -> each head's share of its output, head h
    through the projection's columns h·width .. (h+1)·width ("h{h}", (D,) each), and the projection's bias as a part
    of its own ("attn_bias") where it has one: they sum to proj(heads merged)."""
    H, width = heads.shape
    spread = torch.zeros(H, H, width, device=heads.device, dtype=heads.dtype)
    spread[torch.arange(H), torch.arange(H)] = heads  # row h holds head h alone
    zero = linear32(proj, torch.zeros(1, H * width, device=heads.device))  # (1, D): the bias, or 0
    out = {f"h{h}": ("head", v) for h, v in enumerate(linear32(proj, spread.view(H, H * width)) - zero)}
    if zero.abs().max() > 0:
        out["attn_bias"] = ("attn_bias", zero[0])
    return out
