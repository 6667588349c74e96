"""`--compile`: the torch.compile'd decode step gives the eager step's tokens, and logits to float rounding.

Compiling takes minutes on a 2-core CPU the first time (seconds once Inductor's cache holds the code), so the real model
is compiled once here, for every test in this file. What compiled.DenseInputLinear buys (no copy of each one-token
input before its matrix product) is speed, so the benchmark guards it: `decode: compiled / ceiling` in
benchmarks/bench.py, not an op count here, which would test a torch version.
"""

import pytest
import torch

from llmtrace.run.generate import compile_decode, generate
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.options import TraceOptions

pytestmark = pytest.mark.slow  # compares with transformers or compiles: minutes on a small CPU

PROMPT = "The three laws of thermodynamics state that"
N = 16


def greedy_run(lm, level="steps", compiled=None):
    events = []
    rec = Recorder(TraceOptions(level=level), [events.append], run_info={"prompt": PROMPT})
    ids = lm.tokenizer.encode(PROMPT)
    result = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), N, ignore_eos=True,
                      observer=rec, compiled=compiled)
    return result, [e["topk"] for e in events if e["event"] == "step"]


@pytest.fixture(scope="module")
def compiled_runs(smollm):
    eager, eager_top = greedy_run(smollm)
    ids = smollm.tokenizer.encode(PROMPT)
    step = compile_decode(smollm, len(ids), N)
    with torch.compiler.set_stance("fail_on_recompile"):  # one compile serves every decode step
        compiled, compiled_top = greedy_run(smollm, compiled=step)
        full, _ = greedy_run(smollm, level="full", compiled=step)  # observed steps bypass the compiled step
    return {"eager": (eager, eager_top), "compiled": (compiled, compiled_top), "full": full, "seconds": step.compile_s}


def test_compiled_greedy_tokens_equal_eager(compiled_runs):
    eager, _ = compiled_runs["eager"]
    compiled, _ = compiled_runs["compiled"]
    assert len(compiled.tokens) == N
    assert compiled.tokens == eager.tokens
    assert compiled_runs["seconds"] > 0


def test_compiled_logits_match_eager_to_float_rounding(compiled_runs):
    _, eager_top = compiled_runs["eager"]
    _, compiled_top = compiled_runs["compiled"]
    assert len(compiled_top) == len(eager_top) == N
    worst = 0.0
    for a, b in zip(eager_top, compiled_top):
        assert [c["id"] for c in a[:5]] == [c["id"] for c in b[:5]]
        worst = max(worst, max(abs(x["logit"] - y["logit"]) for x, y in zip(a[:5], b[:5])))
    assert worst <= 1e-4  # a different kernel schedule: equal to float rounding, not bit for bit (NaN fails here too)


def test_observed_steps_run_eagerly_with_a_compiled_model(compiled_runs):
    """A full trace with the compiled step present gives the eager tokens: observed passes do not use it."""
    assert compiled_runs["full"].tokens == compiled_runs["eager"][0].tokens
