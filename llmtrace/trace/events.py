"""The trace's vocabulary without torch: schema id, trace levels, the names of the observable points and where each
sits in the seed table, the summary event. Renderers, sinks and `llmtrace show` need nothing more.
"""

from pathlib import Path
from types import SimpleNamespace


SCHEMA_ID = "llmtrace.trace/1"
LEVELS = ("none", "steps", "layers", "full")

# The observable points of one decoder layer, in the order the forward pass reaches them (seed steps s6.1-s6.8).
LAYER_POINTS = ("attn_norm", "q", "k", "v", "q_rope", "k_rope", "kv_write", "k_repeated", "scores", "probs",
                "attn_out", "o_proj", "resid_mid", "ffn_norm", "gate", "up", "act", "down", "resid_post")
MODEL_POINTS = ("embed", "final_norm", "last", "logits")  # outside the layers
SEED_STEP = {  # where each point sits in the seed table
    "embed": "s4", "attn_norm": "s6.1", "q": "s6.1/s6.2", "k": "s6.1/s6.2", "v": "s6.1/s6.2", "q_rope": "s6.3",
    "k_rope": "s6.3", "kv_write": "s6.8", "k_repeated": "s6.4", "scores": "s6.4", "probs": "s6.5", "attn_out": "s6.5",
    "o_proj": "s6.6", "resid_mid": "s6.6", "ffn_norm": "s6.7", "gate": "s6.7", "up": "s6.7", "act": "s6.7",
    "down": "s6.7", "resid_post": "s6.7", "final_norm": "s8", "last": "s7", "logits": "s9",
}
# At level "layers" each selected layer reports only its two residual-stream points.
LAYER_LEVEL_POINTS = ("resid_mid", "resid_post")


def schema_path() -> Path:
    return Path(__file__).with_name("trace.schema.json")


def summary_event(result) -> dict:
    """The last event of a run, from its `generate.GenerationResult` (or NOT_STARTED)."""
    return {
        "event": "summary",
        "prompt_tokens": len(result.prompt_ids),
        "generated_tokens": len(result.tokens),
        "tokens": list(result.tokens),
        "text": result.text,
        "stop_reason": result.stop_reason,
        "ttft_ms": round(result.ttft_s * 1e3, 3),
        "prefill_tok_s": round(result.prefill_tok_s, 3),
        "decode_tok_s": round(result.decode_tok_s, 3),
        "interrupted": result.interrupted,
    }


# The result of a run stopped before it started (Ctrl-C while the model loaded), for summary_event.
NOT_STARTED = SimpleNamespace(prompt_ids=(), tokens=(), text="", stop_reason="interrupted", interrupted=True,
                              ttft_s=0.0, prefill_tok_s=0.0, decode_tok_s=0.0)
