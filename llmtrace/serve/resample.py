"""Re-sampling one step of a run the server made: llmtrace's own Sampler (run/sampler.py) on the logits that step
produced, under other settings, without running the model again.

While a run generates, `KeepingSampler` stands in for its sampler. Before each draw it keeps what the draw depends
on: the step's raw logits (V,), the random generator's state and mirostat's μ; then the run's sampler draws as it
would have (it only looks: the run's tokens are the same). `resample` makes a Sampler of the run's settings with the
request's changes, puts its generator where the run's stood before that step and draws: at the run's own settings it
draws the same u and so the same token, the same ledger; under others the same u falls where the new distribution
puts it. A request that gives `seed` draws afresh from that seed instead. The answer is the step event the trace
writes (survivors per stage, the draw, the chosen token), with the survivors' probabilities after the last stage.

Memory: the kept logits of all runs together stay under Limits.kept_logits_bytes (V float32 a step: 192 KiB for a
49,152-token vocabulary); the oldest runs' go first, and a step that does not fit is not kept (said when asked).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from llmtrace.errors import BadValue

STATE_BYTES = 5056  # a CPU torch.Generator's state (mt19937)


class NoSuchRun(Exception):
    """A run id the server does not keep (never made, or gone to make room): answered 404."""


@dataclass
class KeptStep:
    logits: Any  # (V,) float32 on the CPU: the raw logits the sampler started from
    state: Any  # the generator's state before the draw (a uint8 tensor)
    mu: Optional[float]  # mirostat's μ before the draw (None without mirostat)
    history: int  # ids the sampler saw as the history (prompt and tokens before this step)


@dataclass
class KeptRun:
    """What re-sampling a run's steps needs: its model, its sampler's settings, its history, each step's draw."""

    model: str  # the served model's name
    config: Any  # the run's SamplerConfig, with the seed it used
    show_top: int  # candidates a step event lists
    history: list[int] = field(default_factory=list)  # the run's ids, prompt included (the row's own list)
    steps: list[Optional[KeptStep]] = field(default_factory=list)  # None: a step past the memory bound
    events: dict[int, dict] = field(default_factory=dict)  # step -> the run's own step event

    @property
    def nbytes(self) -> int:
        return sum(s.logits.numel() * 4 + STATE_BYTES for s in self.steps if s is not None)


class Kept:
    """The kept runs, by run id, under a bound in bytes; thread-safe (runs of different models go at once)."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.runs: OrderedDict[str, KeptRun] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def start(self, run_id: str, run: KeptRun) -> None:
        with self.lock:
            self.runs[run_id] = run

    def drop(self, run_id: str) -> None:
        with self.lock:
            run = self.runs.pop(run_id, None)
            if run is not None:
                self.bytes -= run.nbytes

    def get(self, run_id: str) -> Optional[KeptRun]:
        with self.lock:
            return self.runs.get(run_id)

    def add(self, run_id: str, step: KeptStep) -> None:
        """The run's next step, kept if it fits: the oldest other runs make room first."""
        size = step.logits.numel() * 4 + STATE_BYTES
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                return
            while self.bytes + size > self.limit and next(iter(self.runs)) != run_id:
                old = self.runs.popitem(last=False)[1]
                self.bytes -= old.nbytes
            fits = self.bytes + size <= self.limit
            run.steps.append(step if fits else None)
            self.bytes += size if fits else 0


class KeepingSampler:
    """A run's sampler that keeps, before each draw, what re-sampling that step needs, then draws as the run's
    sampler does. Everything else is the run's sampler's (its settings, its seed, what the recorder reads)."""

    def __init__(self, sampler, kept: Kept, run_id: str):
        self.sampler, self.kept, self.run_id = sampler, kept, run_id

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)

    def sample(self, logits, history, *, ledger: bool):
        run = self.kept.get(self.run_id)
        if run is not None:
            run.history = history  # the row's own list: it grows by each token taken
            state = self.sampler.generator.get_state()
            self.kept.add(self.run_id, KeptStep(logits.detach().float().cpu().clone(), state, self.sampler.mu,
                                                len(history)))
        return self.sampler.sample(logits, history, ledger=ledger)


def settings_of(config, given: dict) -> Any:
    """The run's sampler settings with the request's changes, checked as `generate`'s keywords are (BadValue)."""
    from llmtrace.api import sampler_config

    keywords = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("order", "seed")}
    keywords["sampler_order"] = list(config.order)
    keywords["seed"] = config.seed
    return sampler_config(**(keywords | given))


def resample(lm, run: KeptRun, step: int, given: dict) -> dict:
    """Step `step` of `run` drawn again under the run's settings changed by `given` (sampler keywords; `seed`: a
    fresh draw from it): {"step": the step event, "survivors": the most likely tokens left after the last stage (their
    raw logit, their probability after the last stage), "sampling": the settings, "draw": "the run's" or "fresh"}."""
    import torch

    from llmtrace.run.generate import KVFacts, StepRecord
    from llmtrace.run.sampler import Sampler
    from llmtrace.trace.options import TraceOptions
    from llmtrace.trace.records import candidate_records
    from llmtrace.trace.recorder import Recorder

    own = run.events.get(step)
    if own is None or step >= len(run.steps):
        raise BadValue("step", f" {step} is not a step of this run (it has {len(run.events)})")
    kept = run.steps[step]
    if kept is None:
        raise BadValue("step", f" {step}'s logits were not kept: they did not fit in the server's "
                               f"kept_logits_bytes (see /api/models); run again to re-sample it")
    fresh = "seed" in given
    config = settings_of(run.config, given)
    t0 = time.perf_counter()
    twins = [Sampler(config, lm.config.vocab_size, k_show=run.show_top, tokenizer=lm.tokenizer) for _ in range(2)]
    for s in twins:  # where the run's generator stood before this step (a seed given: a fresh draw from it)
        if not fresh:
            s.generator.set_state(kept.state)
        if s.mirostat and kept.mu is not None:
            s.mu = kept.mu
    history = run.history[: kept.history]
    final = twins[0].process(kept.logits, history)[-1][1]  # the twin's draws are the sampler's: the same stages
    token, ledger = twins[1].sample(kept.logits, history, ledger=True)
    ms = (time.perf_counter() - t0) * 1e3
    events: list[dict] = []
    recorder = Recorder(TraceOptions(level="steps", topk=run.show_top), [])
    recorder.on_start(lm, run.history[: kept.history], twins[1])  # (its run and tokens events go nowhere)
    recorder.sinks.append(events.append)
    kv = own["kv_cache"]
    recorder.on_step(StepRecord(step=step, phase=own["phase"], position=own["position"], token=token, text="",
                                ledger=ledger, ms=ms, kv=KVFacts(**{k: kv[k] for k in KV_FIELDS}, **_state(kv))))
    probs = torch.softmax(final.double(), dim=-1)
    n = min(run.show_top, int(torch.isfinite(final).sum()))
    top_p, top_ids = torch.topk(probs, n)
    top = [(i, float(kept.logits[i]), p) for i, p in zip(top_ids.tolist(), top_p.tolist())]  # the raw logit
    return {"step": events[-1], "survivors": candidate_records(lm.tokenizer, top),
            "sampling": config.to_dict(), "draw": "fresh" if fresh else "the run's"}


KV_FIELDS = ("seq_len", "capacity", "bytes_per_token", "bytes_allocated", "element_size", "mha_bytes_per_token")


def _state(kv: dict) -> dict:
    """A recorded step's recurrent state (kv_cache.state), as KVFacts holds it."""
    state = kv.get("state")
    return {} if not state else {"state_layers": tuple(state["layers"]),
                                 "state_bytes_per_layer": state["bytes_per_layer"], "state_bytes": state["bytes"]}


def resample_request(body: Any, kept: Kept, served: dict) -> dict:
    """POST /api/resample: {"run": ID, "step": N, and sampler keywords (temperature, top_k, top_p, min_p, ...,
    seed)}, checked as `generate` checks them; NoSuchRun for a run the server does not keep."""
    from llmtrace.api import SAMPLER_KEYWORDS

    if not isinstance(body, dict):
        raise BadValue("body", " must be a JSON object")
    unknown = sorted(set(body) - {"run", "step"} - set(SAMPLER_KEYWORDS))
    if unknown:
        raise BadValue(unknown[0], f" is not an option of resample; it takes: run, step, "
                                   f"{', '.join(sorted(SAMPLER_KEYWORDS))}")
    run_id, step = body.get("run"), body.get("step")
    if not isinstance(run_id, str) or not run_id:
        raise BadValue("run", " must be the id of a run (its stream's run_id line)")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise BadValue("step", " must be a whole number ≥ 0")
    run = kept.get(run_id)
    if run is None or run.model not in served:
        raise NoSuchRun("no such run: the server keeps the steps of its last generate runs, within "
                          "kept_logits_bytes (see /api/models)")
    given = {k: v for k, v in body.items() if k not in ("run", "step")}
    return resample(served[run.model].model.loaded, run, step, given)
