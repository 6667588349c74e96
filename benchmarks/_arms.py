"""The benchmark arms that run inside a fresh Python process: `python benchmarks/_arms.py ARM --spec JSON`.

Each arm prints one JSON object on its last stdout line. bench.py starts every arm as a new process, so that imports,
loads and first calls are paid the way a user pays them, and reads peak RSS from the kernel when the process ends.

Arms:
    hf        HF transformers: GGUF load, then greedy `generate` (eager attention, DynamicCache), timed per token
    ceiling   one pass of matrix-vector products over every weight matrix the decode step reads (best of N), and the
              rate of 63 passes back to back (median of 3 blocks)
    cold      llmtrace's GGUF load with an empty cache directory (read, dequantize, fuse, cache), then a warm load
    overhead  the trace levels against no trace in one process, one generation each in turn, repeated: the tracing
              cost with the machine's minute-to-minute drift (which moves whole processes by 10-20%) cancelled out
    decode    HF transformers, llmtrace (eager and --compile) and the ceiling's 63 passes in one process, one run each in
              turn, repeated: the decode ratios with that drift cancelled out
    kernels   --fast with each kernel choice of spec["choices"] (an order for $LLMTRACE_FAST_KERNELS, or "measured"),
              one model per choice, their greedy decodes in turn, repeated (issue 51)
    batch     B prompts decoded as one batch (generate_batch) and one after another (generate), in turn, repeated: the
              aggregate decode tok/s of each and their ratio per pair (issue 51)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def _emit(result: dict) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# HF transformers: what a user would otherwise run


class _TokenClock:
    """A generate() streamer that only notes when each new token comes out (the first put() is the prompt)."""

    def __init__(self, device: str):
        self.device = device
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.time())

    def end(self) -> None:
        pass


def arm_hf(spec: dict) -> dict:
    t0 = spec["t0"]  # wall clock when the parent started this process
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    gguf = spec["gguf"]
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=dtype,
                                                 attn_implementation="eager").to(spec["device"]).eval()
    _sync(spec["device"])
    load_s = time.perf_counter() - t_load
    ids = torch.tensor([spec["prompt_ids"]], device=spec["device"])
    n = spec["new_tokens"]
    clock = _TokenClock(spec["device"])
    t_gen = time.time()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, streamer=clock, pad_token_id=model.config.eos_token_id)
    _sync(spec["device"])
    t_end = time.time()
    times = clock.times
    return {
        "load_s": load_s,
        "ttft_s": times[0] - t0,  # from process start
        "prefill_tok_s": ids.size(1) / (times[0] - t_gen),
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
        "gen_s": t_end - t_gen,
        "tokens": out[0, ids.size(1):].tolist(),
        "prompt_tokens": ids.size(1),
    }


# ----------------------------------------------------------------------------------------------------------------
# the memory-bandwidth ceiling of one decode step


def decode_matrices(model) -> list:
    """Every weight matrix one decode step multiplies a vector by: the fused projections of each layer and the head."""
    mats = []
    for block in model.layers:
        mats += [block.attn.wqkv.weight, block.attn.wo.weight, block.ffn.w_gate_up.weight, block.ffn.w_down.weight]
    mats.append(model.lm_head.weight)
    return mats


def arm_ceiling(spec: dict) -> dict:
    import gc

    import torch
    import torch.nn.functional as F

    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.checkpoint.devices import set_threads

    set_threads(spec["threads"])
    rss_before = _rss_mb()
    lm = llmtrace.load(spec["gguf"], device=spec["device"], dtype=spec["dtype"], threads=spec["threads"]).loaded
    gc.collect()
    rss_loaded = _rss_mb()
    params = list(lm.model.parameters())
    weight_bytes = sum(p.nbytes for p in params)
    storages = {p.untyped_storage().data_ptr() for p in params}
    mats = decode_matrices(lm.model)
    mat_bytes = sum(w.nbytes for w in mats)
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in mats]
    times = []
    with torch.inference_mode():
        for r in range(spec.get("ceiling_passes", 40) + 5):
            _sync(spec["device"])
            t = time.perf_counter()
            for x, w in zip(xs, mats):
                F.linear(x, w)
            _sync(spec["device"])
            if r >= 5:  # the first passes warm the allocator and the caches
                times.append(time.perf_counter() - t)
        # Sustained: as many passes back to back as the decode arms' rate counts steps (63), timed as one block, like
        # their decode tok/s. The best single pass above is the extreme of a noisy distribution that no run of 63
        # steps sustains; the block is the like-for-like limit for a 64-token decode.
        blocks = []
        n_block = spec["new_tokens"] - 1
        for _ in range(spec.get("ceiling_blocks", 3)):
            _sync(spec["device"])
            t = time.perf_counter()
            for _ in range(n_block):
                for x, w in zip(xs, mats):
                    F.linear(x, w)
            _sync(spec["device"])
            blocks.append((time.perf_counter() - t) / n_block)
    best = min(times)
    sustained = statistics.median(blocks)
    rss_used = _rss_mb()  # every weight page has now been read: a second copy of the weights would show here
    out = {
        "pass_ms_best": best * 1e3,
        "pass_ms_median": statistics.median(times) * 1e3,
        "pass_ms_sustained": sustained * 1e3,
        "ceiling_sustained_tok_s": 1.0 / sustained,
        "matrices": len(mats),
        "matrix_bytes": mat_bytes,
        "gb_s": mat_bytes / best / 1e9,
        "ceiling_tok_s": 1.0 / best,
        "weight_bytes": weight_bytes,
        "n_params": lm.model.num_params(),
        "distinct_storages": len(storages),
        "n_parameters": len(params),
        "rss_before_load_mb": rss_before,
        "rss_after_load_mb": rss_loaded,
        "rss_after_use_mb": rss_used,
    }
    if spec["device"].startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock_khz and bus_bits:
            out["gpu_peak_gb_s"] = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
        out["gpu_name"] = props.name
    return out


# ----------------------------------------------------------------------------------------------------------------
# llmtrace's cold GGUF load


def arm_cold(spec: dict) -> dict:
    home = tempfile.mkdtemp(prefix="llmtrace-bench-home-")
    os.environ["LLMTRACE_HOME"] = home  # an empty cache: this load must convert the GGUF
    try:
        import llmtrace  # the public API: a benchmark measures what users run
        from llmtrace.checkpoint.devices import set_threads

        set_threads(spec["threads"])
        lm = llmtrace.load(spec["gguf"], device=spec["device"], dtype=spec["dtype"], threads=spec["threads"]).loaded
        cold_s, converted = lm.load_s, lm.converted
        rss_cold = _rss_mb()
        del lm
        lm = llmtrace.load(spec["gguf"], device=spec["device"], dtype=spec["dtype"], threads=spec["threads"]).loaded
        return {"cold_load_s": cold_s, "converted": converted, "warm_load_s": lm.load_s,
                "warm_converted": lm.converted, "rss_after_cold_load_mb": rss_cold}
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# the cost of tracing, measured in one process


def _runqueue_s() -> float:
    """Seconds this thread has waited for a CPU while ready to run (Linux's schedstat; 0 where there is none): what a
    shared machine adds to a wall-clock time that a quiet one would not."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def arm_overhead(spec: dict) -> dict:
    """The trace levels through the public API, as `llmtrace generate --trace LEVEL --jsonl FILE` runs them (the
    1,000 largest logits of each step at --trace full included): each level's untraced-decode ratio, from the times
    at which step events reach the sink (the decode steps alone), and the whole run's time.

    Beside the wall clock, per decode step: the generation loop's thread's CPU time (the sinks run in it; at --trace
    full the recorder's worker makes each pass's events in a thread of its own, whose CPU time is not
    the loop's: it shows in the wall clock only as what it delays the loop), the process's CPU time (both threads),
    and the wall clock less the loop thread's wait for a CPU (what other processes on a shared machine add)."""
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.api import GenerateOptions
    from llmtrace.trace.writers import JsonlWriter

    model = llmtrace.load(spec["gguf"], device=spec["device"], dtype=spec["dtype"], threads=spec["threads"])
    text = spec.get("prompt_text") or model.tokenizer.decode(spec["prompt_ids"])
    levels = ["none", "steps", "layers", "full"]

    def one(level: str) -> tuple[float, float]:
        sink = JsonlWriter(os.devnull)  # every event encoded and written, as with --jsonl FILE
        steps: list[tuple[float, float, float, float]] = []

        def clock(ev: dict) -> None:
            if ev.get("event") == "step":
                _sync(spec["device"])
                steps.append((time.perf_counter(), time.thread_time(), time.process_time(), _runqueue_s()))

        options = GenerateOptions.of(max_new_tokens=spec["new_tokens"], ignore_eos=True, trace=level)
        _sync(spec["device"])
        t = time.perf_counter()
        try:
            model.generate_with(text, options, sinks=[sink, clock], keep_events=False)
        finally:
            sink.close()
        _sync(spec["device"])
        per = [(b - a) / (len(steps) - 1) for a, b in zip(steps[0], steps[-1])]
        per[3] = per[0] - per[3]  # the wall clock less the wait for a CPU
        return time.perf_counter() - t, per

    for level in levels:  # warm-up: first calls, allocator
        one(level)
    times: dict[str, list[float]] = {lv: [] for lv in levels}
    views = ("step_seconds", "loop_cpu_seconds", "process_cpu_seconds", "wall_less_runqueue_seconds")
    per_step: dict[str, dict[str, list[float]]] = {v: {lv: [] for lv in levels} for v in views}
    for r in range(spec.get("overhead_pairs", 8)):
        for level in levels if r % 2 == 0 else levels[::-1]:
            whole, each = one(level)
            times[level].append(whole)
            for v, x in zip(views, each):
                per_step[v][level].append(x)
    step_s = per_step["step_seconds"]
    # time per decode step, traced / untraced (> 1: slower); its inverse is the speed ratio the targets name
    ratios = {lv: [t / n for t, n in zip(step_s[lv], step_s["none"])] for lv in levels[1:]}
    other = {v: {lv: [t / n for t, n in zip(per_step[v][lv], per_step[v]["none"])] for lv in levels[1:]}
             for v in views[1:]}
    return {"seconds": times, **per_step, "ratios": ratios, "other_ratios": other, "load_avg": os.getloadavg(),
            "median_ratio": {lv: statistics.median(v) for lv, v in ratios.items()},
            "speed_ratio": {lv: statistics.median(n / t for t, n in zip(step_s[lv], step_s["none"]))
                            for lv in levels[1:]}}


# ----------------------------------------------------------------------------------------------------------------
# decode speed, HF / llmtrace / the ceiling, measured in one process


class _StepClock:
    """A generation observer that only notes when each token comes out, as _TokenClock does for HF."""

    def __init__(self):
        self.times: list[float] = []

    def wants_ledger(self) -> bool:
        return False

    def observation(self, phase):
        return None  # observes no pass

    def on_start(self, lm, prompt_ids, sampler) -> None:
        pass

    def before_forward(self, step, phase, start, n_tokens) -> None:
        pass

    def after_forward(self, step) -> None:
        pass

    def on_step(self, record) -> None:
        self.times.append(time.time())

    def on_end(self, result) -> None:
        pass


def arm_decode(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers

    from llmtrace.run.generate import compile_decode, generate
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.checkpoint.devices import set_threads
    from llmtrace.run.sampler import Sampler, SamplerConfig

    set_threads(spec["threads"])
    transformers.logging.set_verbosity_error()
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    gguf, dev, n = spec["gguf"], spec["device"], spec["new_tokens"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=dtype, attn_implementation="eager").to(dev).eval()
    lm = llmtrace.load(gguf, device=dev, dtype=spec["dtype"], threads=spec["threads"]).loaded
    compiled_step = compile_decode(lm, len(spec["prompt_ids"]), n)  # Inductor's cache from the rounds: seconds
    compile_s = compiled_step.compile_s
    ids = torch.tensor([spec["prompt_ids"]], device=dev)
    mats = decode_matrices(lm.model)
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in mats]
    tokens = {}

    def run_hf() -> float:
        clock = _TokenClock(dev)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, streamer=clock, pad_token_id=hf.config.eos_token_id)
        tokens["hf"] = out[0, ids.size(1):].tolist()
        return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])

    def run_llmtrace(compiled: bool) -> float:
        clock = _StepClock()
        res = generate(lm, spec["prompt_ids"], Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), n,
                       ignore_eos=True, observer=clock, compiled=compiled_step if compiled else None)
        tokens["compiled" if compiled else "none"] = res.tokens
        return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])

    def run_ceiling() -> float:  # n - 1 passes back to back, as the decode rates above count n - 1 steps
        with torch.inference_mode():
            _sync(dev)
            t = time.time()
            for _ in range(n - 1):
                for x, w in zip(xs, mats):
                    F.linear(x, w)
            _sync(dev)
        return (n - 1) / (time.time() - t)

    arms = {"hf": run_hf, "compiled": lambda: run_llmtrace(True), "none": lambda: run_llmtrace(False),
            "ceiling": run_ceiling}
    for f in arms.values():  # warm-up: first calls, allocator
        f()
    rates: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(spec.get("decode_pairs", 6)):
        for a in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            rates[a].append(arms[a]())
    ratios = {
        "compiled / HF": [c / h for c, h in zip(rates["compiled"], rates["hf"])],
        "compiled / ceiling (sustained)": [c / x for c, x in zip(rates["compiled"], rates["ceiling"])],
        "none / HF": [c / h for c, h in zip(rates["none"], rates["hf"])],
        "HF / ceiling (sustained)": [h / x for h, x in zip(rates["hf"], rates["ceiling"])],
    }
    return {"decode_tok_s": rates, "ratios": ratios, "compile_s": compile_s,
            "tokens_equal": {a: tokens[a] == tokens["hf"] for a in ("compiled", "none")}}


def arm_batch(spec: dict) -> dict:
    """spec["batch"] prompts (benchmarks/batch.py's), greedy, spec["new_tokens"] each, EOS ignored: as one batch and as
    a loop of single runs, alternating, spec["pairs"] times. Decode tok/s = every row's tokens after its first / the
    decode time (the loop: the sum of its runs' decode times). Each pair checks that the batch's rows are the loop's.

    With spec["torch_products"] a third arm, the batch on torch's own products (model.packed turned off: the batch
    before issue 51 item 4), joins the alternation. Each arm also gets a CPU-time rate: its tokens after the first over
    the process CPU time of the whole call less that of the same call generating one token (the prefill and the first
    token); at 1 thread the load of other processes moves it far less than the wall-clock rate."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from batch import PROMPTS

    import llmtrace  # the public API: a benchmark measures what users run
    import llmtrace.run.generate as generation
    from llmtrace.run.generate import generate, generate_batch
    from llmtrace.run.sampler import Sampler, SamplerConfig

    lm = llmtrace.load(spec["gguf"], device="cpu", dtype=spec["dtype"], threads=spec["threads"]).loaded
    rows = [lm.tokenizer.encode_prompt(t, chat=False, system=None)[1] for t in PROMPTS[: spec["batch"]]]
    n = spec["new_tokens"]
    packed_products = generation.batch_products

    def sampler():
        return Sampler(SamplerConfig(temperature=0, seed=0), lm.config.vocab_size)

    def batch_of(k: int):
        res = generate_batch(lm, rows, [sampler() for _ in rows], k, ignore_eos=True)
        return res.decode_tok_s, [r.tokens for r in res.rows]

    def loop_of(k: int):
        outs = [generate(lm, p, sampler(), k, ignore_eos=True) for p in rows]
        decode_s = sum(r.decode_s for r in outs)  # 0 when k is 1: only the prefill ran
        return sum(len(r.tokens) - 1 for r in outs) / decode_s if decode_s else 0.0, [r.tokens for r in outs]

    def torch_batch_of(k: int):
        generation.batch_products = lambda lm: None
        try:
            return batch_of(k)
        finally:
            generation.batch_products = packed_products

    def timed(fn):
        t = time.process_time()
        rate, tokens = fn(n)
        cpu = time.process_time() - t
        t = time.process_time()
        fn(1)
        cpu -= time.process_time() - t
        return rate, sum(len(x) - 1 for x in tokens) / cpu, tokens

    arms = {"batched": batch_of, "sequential": loop_of}
    if spec.get("torch_products"):
        arms["batched, torch products"] = torch_batch_of
    for fn in arms.values():  # warm-up (the first batch packs the weights)
        fn(4)
    runs: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    load: list[float] = []
    same = True
    names = list(arms)
    for i in range(spec["pairs"]):
        got = {}
        for name in names if i % 2 == 0 else names[::-1]:
            rate, cpu_rate, got[name] = timed(arms[name])
            runs[name].append(rate)
            cpu[name].append(cpu_rate)
        load.append(os.getloadavg()[0])
        same = same and all(got[a] == got["sequential"] for a in got)
    ratios = [b / s for b, s in zip(runs["batched"], runs["sequential"])]
    out = {"runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios), "same_tokens": same,
           "cpu_tok_s": cpu, "cpu_ratios": [b / s for b, s in zip(cpu["batched"], cpu["sequential"])], "load": load,
           "threads": spec["threads"]}
    if spec.get("torch_products"):
        out["before_ratios"] = [b / s for b, s in zip(runs["batched, torch products"], runs["sequential"])]
        out["before_cpu_ratios"] = [b / s for b, s in zip(cpu["batched, torch products"], cpu["sequential"])]
    return out


def arm_kernels(spec: dict) -> dict:
    """Decode tok/s of --fast under each kernel choice, the choices alternating in this one process, spec["pairs"]
    times; each choice's kernels (how many matrices ran on each) with it."""
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    models = {}
    for choice in spec["choices"]:
        os.environ.pop("LLMTRACE_FAST_KERNELS", None)
        if choice != "measured":
            os.environ["LLMTRACE_FAST_KERNELS"] = choice
        models[choice] = llmtrace.load(spec["gguf"], device="cpu", fast=True, threads=spec["threads"]).loaded
    ids = next(iter(models.values())).tokenizer.encode(spec["prompt_text"])

    def one(lm) -> float:
        res = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), spec["new_tokens"],
                       ignore_eos=True)
        return res.decode_tok_s

    for lm in models.values():  # warm-up
        one(lm)
    runs: dict[str, list[float]] = {c: [] for c in models}
    names = list(models)
    for i in range(spec["pairs"]):
        for c in names if i % 2 == 0 else names[::-1]:
            runs[c].append(one(models[c]))
    base = runs[names[0]]
    return {"runs": runs, "kernels": {c: lm.config.extra["fast"]["kernel_choice"]["kernels"] for c, lm in models.items()},
            "ratios": {c: [a / b for a, b in zip(v, base)] for c, v in runs.items()}}


ARMS = {"hf": arm_hf, "ceiling": arm_ceiling, "cold": arm_cold, "overhead": arm_overhead, "decode": arm_decode,
        "batch": arm_batch, "kernels": arm_kernels}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("arm", choices=sorted(ARMS))
    p.add_argument("--spec", required=True, help="the arm's settings as JSON")
    a = p.parse_args()
    _emit(ARMS[a.arm](json.loads(a.spec)))


if __name__ == "__main__":
    main()
