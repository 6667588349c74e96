"""What `llmtrace compare` costs against one `--trace full` run of one model, and what it holds in memory.

    python benchmarks/compare_bench.py --threads 2 [--tokens 64] [--new 0] [--pairs 5] [--b-dtype bfloat16]

One process, both models loaded once before the clock starts (A in float32, B in --b-dtype), torch pinned to
--threads. The two arms run in turn, the order reversed every other pair, so that the machine's drift favours
neither:
    full      generate over the same --tokens prompt ids with --trace full, every event encoded and written to
              /dev/null as --jsonl FILE would (-n --new; 0 is the prefill alone, as compare -n 0 reads the prompt)
    compare   run.compare.compare(A, B, the same prompt, max_new_tokens=--new): A's layer, B's layer and B's layer on
              A's input, every point of every layer compared in float64
Prints each arm's median seconds and the median of the per-pair ratios compare / full (the issue's budget: 3x).

Memory: each arm once more in a fresh process (--memory), its resident set sampled every 2 ms: the peak above what the
loaded models already hold. The full trace holds its statistics and events; compare holds one layer's activations of
each side (and of B's layer on A's input) at a time, plus the per-position sums and the two sides' logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TEXT = ("The history of computing is a story of ideas that became machines. Early mechanical calculators gave way to "
        "electronic computers, then to transistors, integrated circuits and the microprocessor, and each step made "
        "the next one cheaper, smaller and faster than anyone had expected. Software followed the same path.")


def prompt_ids(lm, n: int) -> list[int]:
    ids = lm.tokenizer.encode(TEXT * 4)
    assert len(ids) >= n, len(ids)
    return ids[:n]


def rss_above(fn) -> tuple[float, float]:
    """Run fn; return (resident set before it, its peak above that), MiB, sampled every 2 ms by a thread."""
    import threading

    import psutil

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return base / 2**20, (peak[0] - base) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or spec (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--new", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--b-dtype", default="bfloat16")
    ap.add_argument("--b-keep-quantized", action="store_true", help="side B keeps the GGUF's blocks")
    ap.add_argument("--memory", choices=["full", "compare"], help="(internal) one arm once, then print its peak RSS")
    args = ap.parse_args()

    import torch

    from llmtrace.checkpoint.devices import set_threads
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.compare import compare
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig
    from llmtrace.trace.options import TraceOptions
    from llmtrace.trace.recorder import Recorder
    from llmtrace.trace.writers import JsonlWriter

    set_threads(args.threads)
    a = llmtrace.load(args.model, device="cpu", dtype="float32", threads=args.threads).loaded
    b = (llmtrace.load(args.model, device="cpu", dtype=args.b_dtype, keep_quantized=args.b_keep_quantized,
                       threads=args.threads).loaded
         if args.memory != "full" else None)
    ids = prompt_ids(a, args.tokens)
    text = a.tokenizer.decode(ids)

    def full() -> float:
        sink = JsonlWriter(os.devnull)
        rec = Recorder(TraceOptions(level="full"), [sink], run_info={"prompt": text})
        t = time.perf_counter()
        generate(a, ids, Sampler(SamplerConfig(temperature=0.0), a.config.vocab_size), max(args.new, 0),
                 ignore_eos=True, observer=rec)
        sink.close()
        return time.perf_counter() - t

    def cmp() -> float:
        t = time.perf_counter()
        compare(a, b, text, max_new_tokens=args.new)
        return time.perf_counter() - t

    if args.memory:
        base, above = rss_above(full if args.memory == "full" else cmp)
        print(json.dumps({"arm": args.memory, "models_loaded_mib": round(base, 1), "peak_above_mib": round(above, 1)}))
        return

    full(), cmp()  # warm-up: first calls, allocator
    times = {"full": [], "compare": []}
    for r in range(args.pairs):
        for name, fn in ((("full", full), ("compare", cmp)) if r % 2 == 0 else (("compare", cmp), ("full", full))):
            times[name].append(fn())
    ratios = [c / f for c, f in zip(times["compare"], times["full"])]
    mem = {}
    for arm in ("full", "compare"):
        out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--tokens", str(args.tokens),
                              "--new", str(args.new), "--b-dtype", args.b_dtype, "--memory", arm]
                             + (["--b-keep-quantized"] if args.b_keep_quantized else [])
                             + (["--model", args.model] if args.model else []),
                             capture_output=True, text=True, check=True, env=os.environ | {"PYTHONPATH": ROOT})
        mem[arm] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps({"tokens": args.tokens, "new": args.new, "threads": args.threads, "b_dtype": args.b_dtype, "b_keep_quantized": args.b_keep_quantized,
                      "torch": torch.__version__,
                      "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
                      "ratio_compare_over_full": {"median": round(statistics.median(ratios), 2),
                                                  "all": [round(x, 2) for x in ratios]},
                      "memory": mem}, indent=1))


if __name__ == "__main__":
    main()
