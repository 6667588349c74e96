"""The trace's vocabulary without torch: schema id, trace levels, the summary event. The observable points are the
model's to declare (model.points); a trace carries them in its `run` event.
"""

from pathlib import Path
from types import SimpleNamespace


SCHEMA_ID = "llmtrace.trace/1"
LEVELS = ("none", "steps", "layers", "full")

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
