"""The trace's vocabulary without torch: schema id, trace levels, the summary event. The observable points are the
model's to declare (model.points); a trace carries them in its `run` event.
"""

from enum import Enum
from pathlib import Path
from types import SimpleNamespace


SCHEMA_ID = "llmtrace.trace/1"
LEVELS = ("none", "steps", "layers", "full")


class Level(str, Enum):
    """How much a trace records (--trace): a type, so code asks what a level means instead of comparing strings.
    A str, so it is written and read as its name ("full")."""

    NONE = "none"
    STEPS = "steps"
    LAYERS = "layers"
    FULL = "full"

    @property
    def records(self) -> bool:
        """Whether anything beyond the tokens is recorded."""
        return self is not Level.NONE

    @property
    def every_pass(self) -> bool:
        """Whether every pass (each decode step too) is observed, not only the prefill."""
        return self in (Level.LAYERS, Level.FULL)

    @property
    def full(self) -> bool:
        """Whether every point's statistics (and samples) are recorded, attention included."""
        return self is Level.FULL

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value) -> "Level":
        """A level from its name, refused in one line when it names none."""
        from llmtrace.errors import BadValue

        if value not in LEVELS:
            raise BadValue("trace", f" must be one of {', '.join(LEVELS)}, not {value!r}")
        return cls(value)

class Section:
    """explain's sections by key: the `section` of an explain event (the schema's enum, checked equal by a test). The
    views branch on a section through these names; a section's key is not an operation's, though some read alike
    (the rope section works the rotation; the router section the choice of experts). A kind of layer's own sections
    are its EXPLAIN keys (model.kinds), listed here too."""

    MODEL = "model"
    LAYER = "layer"
    STEPS = "steps"
    RMSNORM = "rmsnorm"
    QKV = "qkv"
    ROPE = "rope"
    ATTENTION = "attention"
    ATTENTION_HEAD = "attention_head"
    ATTENTION_MAP = "attention_map"
    RESIDUAL = "residual"
    FFN = "ffn"
    ROUTER = "router"
    KV_CACHE = "kv_cache"
    DELTA_RULE = "delta_rule"
    STATE_UPDATE = "state_update"
    STATE_CACHE = "state_cache"
    MEMORY = "memory"
    LATENT_CACHE = "latent_cache"
    CONVOLUTION = "convolution"


def sections() -> tuple[str, ...]:
    """Every section key, in the schema's order."""
    return tuple(v for k, v in vars(Section).items() if k.isupper())


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
