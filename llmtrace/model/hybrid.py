"""A hybrid decoder layer: its sequence mixer is one of several kinds, chosen by the config's layer type.

Qwen3.5 mixes linear attention with attention, LFM2 short convolutions with attention, Granite 4.0-H Mamba2 with
attention. Each such family's block is this one with a table: `mixers` maps a layer type to the mixer's class (any
other type runs `attention`), `MIXER_KEYS` to where that mixer's tensors sit in the checkpoint (HF prefix, GGUF
prefix) where not under attention's. A layer whose mixer is not attention has no keys to attend, no RoPE (its
convolution gives it order) and no KV cache of attention's kind: its plan says so, and its kind's declaration says
what it keeps instead (model.kinds).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from llmtrace.model.llama_points import O_PROJ
from llmtrace.model.maths import LayerPlan
from llmtrace.model.points import Point, splice
from llmtrace.model.transformer import Block, Module


class HybridBlock(Block):
    """Llama's block whose mixer is chosen per layer: `mixers[config.layer_type(i)]`, else `attention`."""

    mixers: dict[str, type] = {}  # layer type -> the mixer's class (a kind of model.kinds, or a family's)
    MIXER_KEYS: dict[str, tuple[str, str]] = {}  # layer type -> the mixer's (HF, GGUF) key prefix

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        keys = self.MIXER_KEYS.get(config.layer_type(layer))
        if keys is not None:  # this layer's mixer sits under its own prefix in the checkpoint
            self.CHILDREN = {**type(self).CHILDREN, "attn": keys}

    def attention_of(self, config, layer: int) -> Module:
        return self.mixers.get(config.layer_type(layer), self.attention)(config)

    def plan(self, config, rope: Optional[dict]) -> LayerPlan:
        """Llama's plan; a layer whose mixer is not attention attends no keys, turns nothing and has no window."""
        p = super().plan(config, rope)
        return p if isinstance(self.attn, self.attention) else replace(p, attention="none", window=None, rope=None)

    @classmethod
    def layer_points(cls) -> tuple[Point, ...]:
        """Every mixer's points (a layer reports those of its own kind): each other kind's, then attention's, one
        o_proj; then the feed-forward's."""
        own = {p.name: p for p in cls.declared_points()}
        others = tuple(p for m in cls.mixers.values() for p in m.declared_points() if p.name != O_PROJ.name)
        return splice(tuple(own[p.name] if isinstance(p, Point) else p for p in cls.POINTS),
                      {"attn": others + cls.attention.declared_points(), "ffn": cls.feed_forward.declared_points()})
