"""The file of a comparison (`llmtrace compare`, `llmtrace diff`) in its two forms, and back.

    --json    one object, schema llmtrace.compare/1: the sides, the first divergence, the summaries, "layers" (one
              record per decoder layer) and "positions" (one record per compared position)
    --jsonl   the same object as events: "compare" (everything but the layers and the positions), then one
              "compare_layer" per layer and one "compare_position" per position

`llmtrace show` and `llmtrace report` read either form back to the one object the views draw.
"""

from __future__ import annotations

COMPARE_SCHEMA = "llmtrace.compare/1"


def model_points_around(model_points: dict) -> tuple[list[str], list[str]]:
    """The model-level points of a comparison, in forward order, split into those before the layers (the embedding
    and what a family does to it: seed steps s1-s5) and those after (s7-s9: final norm, logits, a soft-cap). The
    records keep forward order; a record without a seed step counts as after the layers."""
    before = [n for n, r in model_points.items() if (r.get("seed_step") or "s9") in BEFORE_LAYERS]
    return before, [n for n in model_points if n not in before]


BEFORE_LAYERS = ("s1", "s2", "s3", "s4", "s5")


def jsonl_events(doc: dict) -> list[dict]:
    """A comparison's JSON object as events, one JSON object per line: "compare" (everything but the layers and the
    positions), one "compare_layer" per layer, one "compare_position" per position."""
    head = {"event": "compare"} | {k: v for k, v in doc.items() if k not in ("layers", "positions")}
    return ([head] + [{"event": "compare_layer"} | lay for lay in doc["layers"]]
            + [{"event": "compare_position"} | p for p in doc["positions"]])


def document(events: list[dict]) -> dict:
    """The comparison's JSON object from its events (the inverse of `jsonl_events`)."""
    head = next(e for e in events if e["event"] == "compare")
    strip = lambda e: {k: v for k, v in e.items() if k != "event"}  # noqa: E731
    return strip(head) | {"layers": [strip(e) for e in events if e["event"] == "compare_layer"],
                          "positions": [strip(e) for e in events if e["event"] == "compare_position"]}
