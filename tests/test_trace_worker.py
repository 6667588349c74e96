"""The recorder's worker (issue 51 item 3): at --trace full an observed pass's events (statistics, samples, worked
cards) are made in a thread of the recorder's own while the model runs the next pass, and reach the sinks a pass
later. What reaches them is the inline recorder's, byte for byte and in the same order (LLMTRACE_TRACE_INLINE=1 makes
them in the loop's thread), for the tiny Llama, families with experts (routing events), a recurrent state (carried
operands) and a KV-shared cache, a batch, and the real SmolLM2 (slow); --trace layers stays inline (each step out as
it ends: tests/test_interrupt.py); an exception the worker raises reaches the caller as itself; a Ctrl-C or a failed
run leaves what the inline recorder would have sent.
"""

from __future__ import annotations

import signal
import sys
import threading

import orjson
import pytest

from llmtrace.run.generate import generate, generate_batch
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace import cards as cards_module
from llmtrace.trace.options import TraceOptions
from llmtrace.trace.recorder import INLINE_ENV, Recorder
from llmtrace.trace.writers import ORJSON_OPTIONS

PROMPT = "The quick brown fox"
TIMINGS = ("ms", "ttft_ms", "prefill_tok_s", "decode_tok_s")  # the clock's readings: every run's own


def lines(events: list[dict]) -> list[bytes]:
    """Each event as the JSONL file holds it (a tensor event's own line), the clock's readings left out."""
    out = []
    for ev in events:
        line = getattr(ev, "line", None)
        out.append(line if line is not None else orjson.dumps({k: v for k, v in ev.items() if k not in TIMINGS},
                                                              option=ORJSON_OPTIONS))
    return out


def traced(lm, level: str, *, inline: bool, monkeypatch, n: int = 5, layers=None, batch: bool = False):
    """One greedy run's events, and the threads the worked cards were computed in."""
    if inline:
        monkeypatch.setenv(INLINE_ENV, "1")
    else:
        monkeypatch.delenv(INLINE_ENV, raising=False)
    threads: set[str] = set()
    sampled = cards_module.Cards.sampled

    def noted(self, *a, **k):
        threads.add(threading.current_thread().name)
        return sampled(self, *a, **k)

    monkeypatch.setattr(cards_module.Cards, "sampled", noted)
    events: list[dict] = []
    rec = Recorder(TraceOptions(level=level, layers=layers), [events.append], run_info={"prompt": PROMPT})
    greedy = lambda: Sampler(SamplerConfig(temperature=0.0, seed=1), lm.config.vocab_size)
    ids = lm.tokenizer.encode(PROMPT)
    if batch:
        generate_batch(lm, [ids, ids[:3]], [greedy(), greedy()], n, ignore_eos=True, observer=rec)
    else:
        generate(lm, ids, greedy(), n, ignore_eos=True, observer=rec)
    monkeypatch.setattr(cards_module.Cards, "sampled", sampled)
    return events, threads


def same_bytes(lm, monkeypatch, level="full", **kw) -> list[dict]:
    switch = sys.getswitchinterval()
    worker, where = traced(lm, level, inline=False, monkeypatch=monkeypatch, **kw)
    assert sys.getswitchinterval() == switch  # the worker's shorter interval ends with the run
    inline, where_inline = traced(lm, level, inline=True, monkeypatch=monkeypatch, **kw)
    a, b = lines(worker), lines(inline)
    assert len(a) == len(b)
    assert [i for i, (x, y) in enumerate(zip(a, b)) if x != y] == []
    if level == "full":  # the cards really were made in the worker, and inline in the loop's thread
        assert where and all(name.startswith("llmtrace-trace") for name in where)
        assert where_inline == {threading.main_thread().name}
        assert any("computed" in (e.get("sample") or {}) for e in worker)
    return worker


@pytest.mark.parametrize("level", ["full", "layers"])
def test_the_worker_writes_the_inline_bytes(tiny_lm, monkeypatch, level):
    events = same_bytes(tiny_lm, monkeypatch, level)
    kinds = [e["event"] for e in events]
    assert kinds.count("step") == 5 and kinds[-1] == "summary"
    # each pass's tensor events come before its step, as inline
    steps = [i for i, e in enumerate(events) if e["event"] == "step"]
    for k, at in enumerate(steps):
        assert {e["step"] for e in events[at - 3: at] if e["event"] == "tensor"} == {k}


def test_the_worker_writes_the_inline_bytes_for_a_batch(tiny_lm, monkeypatch):
    same_bytes(tiny_lm, monkeypatch, batch=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5", "gemma4", "lfm2"])
def test_the_worker_writes_the_inline_bytes_per_family(loaded, monkeypatch, family):
    """Experts (routing events), a carried state (Qwen3.5's linear attention, LFM2's convolution), Gemma 4's
    KV-shared layers."""
    events = same_bytes(loaded(family, "hf"), monkeypatch, layers=[0, -1])
    if family == "qwen3_moe":
        assert any(e["event"] == "routing" for e in events)


@pytest.mark.slow
def test_the_worker_writes_the_inline_bytes_on_smollm(smollm, monkeypatch):
    same_bytes(smollm, monkeypatch, n=4)


def test_an_exception_in_the_worker_reaches_the_caller(tiny_lm, monkeypatch):
    """A card that fails raises its own exception from the run, with the worker as inline."""

    def broken(self, *a, **k):
        raise ValueError("a card could not be made")

    for inline in (False, True):
        monkeypatch.setattr(cards_module.Cards, "_make", broken)
        with pytest.raises(ValueError, match="a card could not be made"):
            traced(tiny_lm, "full", inline=inline, monkeypatch=monkeypatch)
        monkeypatch.undo()


def test_a_ctrl_c_leaves_a_whole_trace(tiny_lm, monkeypatch):
    """A SIGINT while the worker holds a pass: the run ends as interrupted, and every pass's events, each step and the
    summary reach the sinks, in order."""
    monkeypatch.delenv(INLINE_ENV, raising=False)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    events: list[dict] = []
    steps = []

    def sink(ev):
        events.append(ev)
        if ev["event"] == "step":
            steps.append(ev["step"])

    rec = Recorder(TraceOptions(level="full"), [sink], run_info={"prompt": PROMPT})
    after = rec.after_forward

    def interrupting(step):
        after(step)
        if step == 3:  # pass 3 is in the worker, or just made; pass 2's step waits behind it
            signal.raise_signal(signal.SIGINT)

    rec.after_forward = interrupting
    try:
        greedy = Sampler(SamplerConfig(temperature=0.0, seed=1), tiny_lm.config.vocab_size)
        result = generate(tiny_lm, tiny_lm.tokenizer.encode(PROMPT), greedy, 8, ignore_eos=True, observer=rec)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.interrupted
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "summary" and kinds.count("summary") == 1
    assert steps == list(range(len(steps))) and events[-1]["tokens"] == result.tokens
    assert len(result.tokens) == len(steps) == 3
    assert {e["step"] for e in events if e["event"] == "tensor"} == {0, 1, 2, 3}  # pass 3 too, as inline


def test_a_failed_run_sends_what_was_made(tiny_lm, monkeypatch):
    """An exception out of the model in the fourth pass: the run raises it, and the sinks have received the same events
    as inline (the three passes before it and their steps), the worker's included."""
    import llmtrace
    from llmtrace.api import GenerateOptions
    from llmtrace.run import generate as loop

    forward = loop.forward_step

    def failing(*a, **k):
        failing.calls += 1
        if failing.calls == 4:
            raise RuntimeError("the model failed")
        return forward(*a, **k)

    got = {}
    for inline in (False, True):
        if inline:
            monkeypatch.setenv(INLINE_ENV, "1")
        else:
            monkeypatch.delenv(INLINE_ENV, raising=False)
        failing.calls = 0
        monkeypatch.setattr(loop, "forward_step", failing)
        events: list[dict] = []
        options = GenerateOptions.of(max_new_tokens=6, ignore_eos=True, trace="full", seed=1)
        with pytest.raises(RuntimeError, match="the model failed"):
            llmtrace.Model(tiny_lm).generate_with(PROMPT, options, sinks=[events.append])
        got[inline] = lines(events)
    assert got[False] == got[True]
    assert sum(line.startswith(b'{"event":"step"') for line in got[False]) == 3
