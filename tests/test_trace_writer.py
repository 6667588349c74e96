"""The trace's events are the same whether the recorder hands them to the sinks at once or on its writer thread
(trace.recorder.EventWriter, which the API uses at --trace layers and full so that formatting a pass's events
overlaps the next pass): same events, same order, same JSON text, timings aside. A sink that fails stops the run
with its own error, in the caller's thread."""

from __future__ import annotations

import json

import pytest

from llmtrace.run.generate import generate, generate_batch
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.options import TraceOptions
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.sinks import ENCODER, JsonlSink

TIMINGS = {"ms", "prefill_tok_s", "decode_tok_s", "ttft_ms", "ttft_s", "prefill_s", "decode_s"}


def _untimed(x):
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if k not in TIMINGS}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def _record(lm, level: str, writer: bool, batch: bool, sinks=(), **trace) -> list[dict]:
    events: list[dict] = []
    options = TraceOptions(level=level, logits_top=50 if level == "full" else 0, **trace)
    rec = Recorder(options, [events.append, *sinks], run_info={"prompt": "x"}, writer=writer)
    sampler = Sampler(SamplerConfig(temperature=0.8, top_k=20, seed=5), lm.config.vocab_size)
    ids = lm.tokenizer.encode("The quick brown fox jumps")
    if batch:
        other = lm.tokenizer.encode("Hello")
        generate_batch(lm, [ids, other], [sampler, sampler.with_seed(6)], 4, ignore_eos=True, observer=rec)
    else:
        generate(lm, ids, sampler, 4, ignore_eos=True, observer=rec)
    return events


@pytest.mark.parametrize("level, batch, trace", [
    ("full", False, {}), ("full", True, {}), ("layers", False, {}), ("steps", False, {"dump": ("logits", "1.probs")}),
])  # fmt: skip
def test_the_writer_thread_delivers_the_same_events(tiny_lm, level, batch, trace, tmp_path):
    at_once = _record(tiny_lm, level, False, batch, **trace)
    path = tmp_path / "trace.jsonl"
    sink = JsonlSink(str(path))
    try:
        later = _record(tiny_lm, level, True, batch, sinks=[sink], **trace)
    finally:
        sink.close()
    assert len(later) == len(at_once) and at_once[-1]["event"] == "summary"
    assert [_untimed(e) for e in later] == [_untimed(e) for e in at_once]
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(later)
    for line, ev in zip(lines, later):
        assert json.loads(line) == ev
        if "line" not in vars(type(ev)) or getattr(ev, "line", None) is None:
            assert line == ENCODER.encode(ev)
    if level == "full":
        steps = [e for e in later if e["event"] == "step"]
        assert steps and all(len(e["logits"]["ids"]) == 50 for e in steps)


def test_a_failing_sink_stops_the_run_with_its_error(tiny_lm):
    class Full(OSError):
        pass

    seen = []

    def failing(ev):
        seen.append(ev["event"])
        if ev["event"] == "tensor" and len(seen) > 20:
            raise Full("no space left")

    with pytest.raises(Full):
        _record(tiny_lm, "full", True, False, sinks=[failing])
    assert "summary" not in seen
