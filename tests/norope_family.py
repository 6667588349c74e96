"""A test-only family: Llama with no RoPE in some layers, as SmolLM3 runs it (`no_rope_layers`: 1 where a layer
rotates q and k, 0 where it does not), for the tests of a layer without RoPE (tests/test_report_cards.py).

llmtrace has no such family of its own. This one is registered for the length of a test only (`registered`), by
putting its `Family` record in the registry that model.family reads (`families()`): a config.json whose
model_type is "smollm3" is then read by it, through the same loader, CLI and pages as every real family, and no
core hook is needed. Its model is the Llama `Transformer` with one change, declared where a family declares it: the
layer plan's RoPE (`rope_plan`) is None in a layer whose flag is 0. The forward pass, the maths declaration, explain
and the report all read that plan; nothing else is overridden.

The reference is transformers' own SmolLM3ForCausalLM with the same weights (`NOROPE`, built by tests/families.py's
make_model): its attention skips `apply_rotary_pos_emb` where `no_rope_layers[i]` is 0.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from families import Family as TestFamily
from llmtrace.model import family as registry
from llmtrace.model.family import Family
from llmtrace.model.transformer import Transformer

NO_ROPE_LAYERS = [1, 0, 1, 0]  # layers 1 and 3 rotate nothing

# the tiny checkpoint (tests/families.py's Family record; kept out of FAMILIES, which every family test iterates)
NOROPE = TestFamily("smollm3_norope", "smollm3", {
    "num_hidden_layers": 4, "no_rope_layers": NO_ROPE_LAYERS, "use_sliding_window": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "no RoPE in layers 1 and 3 (SmolLM3's no_rope_layers); a test-only llmtrace family reads it")


class NoRopeTransformer(Transformer):
    """Llama, but a layer flagged 0 in `no_rope_layers` has no RoPE in its plan (so none in its pass)."""

    def rope_plan(self, layer: int) -> Optional[dict]:
        flags = self.config.extra.get("no_rope_layers")
        if flags is not None and not flags[layer]:
            return None
        return super().rope_plan(layer)


def _hf_config(cfg: dict) -> dict:
    flags = cfg.get("no_rope_layers")
    if not isinstance(flags, list) or len(flags) != int(cfg["num_hidden_layers"]):
        raise ValueError("no_rope_layers must list one flag per layer")
    return {"extra": {"no_rope_layers": [int(f) for f in flags]}}


def _changes(config) -> list[str]:
    flags = config.extra.get("no_rope_layers") or []
    off = [str(i) for i, f in enumerate(flags) if not f]
    return [f"no RoPE in layers {', '.join(off)}: their attention sees content, not position"] if off else []


FAMILY = Family(name="norope_test", title="Llama without RoPE in some layers (test only)", model=NoRopeTransformer,
                hf_types={"smollm3": "SmolLM3ForCausalLM"}, hf_config=_hf_config, changes=_changes)


@contextlib.contextmanager
def registered(monkeypatch):
    """The registry with FAMILY in it (after Llama, before the others: the first family to claim a model_type reads
    it), for the block: model.family's functions look `families` up when they are called."""
    before = registry.families
    monkeypatch.setattr(registry, "families", lambda: (before()[0], FAMILY, *before()[1:]))
    try:
        yield FAMILY
    finally:
        monkeypatch.setattr(registry, "families", before)
