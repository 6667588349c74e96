"""The KV cache's figures of a batch: every step event's kv_cache says what the whole batch's cache holds
(batch_bytes_used: every row's slots, pads included) beside each row's own, and the terminal prints that figure at
the end of a batch. Each is checked against the bytes of the cache's own tensors, worked out here from the config."""

from __future__ import annotations

import io

import llmtrace
from llmtrace.console import make_console
from llmtrace.render.generate import TerminalRenderer
from llmtrace.units import human_bytes

PROMPTS = ["The quick brown fox jumps over", "Hello"]  # of different lengths: the second row is left-padded
N_NEW = 3


def _cache_bytes_per_slot(config, element_size: int = 4) -> int:
    """Keys and values of one slot of one row, over every layer: 2 · L · Hkv · Dh elements (float32 here)."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * element_size


def test_batch_bytes_used_is_every_rows_slots_in_every_step(tiny_lm, monkeypatch):
    model = llmtrace.Model(tiny_lm)
    trace = model.generate(PROMPTS, max_new_tokens=N_NEW, ignore_eos=True, trace="steps")
    lengths = [len(tiny_lm.tokenizer.encode(p)) for p in PROMPTS]
    padded = max(lengths)
    per_slot = _cache_bytes_per_slot(tiny_lm.config)
    steps = [e for e in trace.events if e["event"] == "step"]
    assert len(steps) == len(PROMPTS) * N_NEW
    for ev in steps:
        kv, row = ev["kv_cache"], ev["row"]
        slots = padded + ev["step"]  # the prompt's padded slots, then one a step (the token of step s is not cached yet)
        assert kv["batch"] == len(PROMPTS) and kv["batch_seq_len"] == slots
        assert kv["bytes_per_token"] == per_slot
        assert kv["batch_bytes_used"] == len(PROMPTS) * slots * per_slot
        assert kv["bytes_used"] == (lengths[row] + ev["step"]) * per_slot  # the row's own real tokens
        assert kv["batch_bytes_used"] <= kv["bytes_allocated"]

    monkeypatch.setenv("COLUMNS", "200")
    out = io.StringIO()
    view = TerminalRenderer(make_console(file=out), show_steps=True)
    for ev in trace.events:
        view(ev)
    last = len(PROMPTS) * (padded + N_NEW - 1) * per_slot
    text = " ".join(out.getvalue().split())
    assert (f"KV cache: {len(PROMPTS)} rows × {padded + N_NEW - 1} slots × {per_slot:,} B = {human_bytes(last)}"
            in text), text[-600:]
