"""The fast path's compiled decode step with its weights frozen in (`--fast --compile --freeze`, CPU only) against the
same step with the weights as graph inputs (plain `--fast --compile`): step time, compile time, memory (issue 24).

    python benchmarks/frozen_step.py                    # 2 threads, 4 rounds
    python benchmarks/frozen_step.py --threads 1 --rounds 6 --steps 64

Each arm runs in a fresh process, arms alternating round by round (A B, then B A, ...), so that a shared machine
slows them alike. A process loads the default model with `fast=True`, prefills a 64-token prompt, compiles the decode
step (`llmtrace.model.compiled.CompiledDecode`, freeze=True or False) and times --steps greedy steps back to back, as
generation calls them (guards skipped after the first). It reports the median step, the compile's seconds (Inductor's
cache as it is: run once first for warm figures) and the RSS after the compile. torch is pinned to --threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def arm(freeze: bool, threads: int, steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from llmtrace.checkpoint.devices import set_threads
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.model.compiled import CompiledDecode

    set_threads(threads)
    lm = llmtrace.load(None, device="cpu", fast=True, threads=threads).loaded
    model, n0 = lm.model, 64
    step = CompiledDecode(model, freeze=freeze)
    with torch.inference_mode():
        cache = model.new_cache(n0 + steps + 2)  # never full: a step that fills it would compile anew
        model(torch.randint(0, 1000, (1, n0), generator=torch.Generator().manual_seed(0)), cache, 0)
        idx = torch.tensor([[42]])
        t = time.perf_counter()
        step(idx, cache, n0)
        compile_s = time.perf_counter() - t
        times = []
        for s in range(1, steps + 1):
            t = time.perf_counter()
            idx = step(idx, cache, n0 + s, next_of_same_run=True).argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
    rss = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return {"step_ms": statistics.median(times) * 1e3, "compile_s": compile_s, "rss_mib": rss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed in each process")
    ap.add_argument("--arm", choices=["frozen", "inputs"], help=argparse.SUPPRESS)  # one process's arm
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm == "frozen", args.threads, args.steps)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    results: dict[str, list[dict]] = {"frozen": [], "inputs": []}
    for r in range(args.rounds):
        for name in (["frozen", "inputs"] if r % 2 == 0 else ["inputs", "frozen"]):
            proc = subprocess.run([sys.executable, __file__, "--arm", name, "--threads", str(args.threads),
                                   "--steps", str(args.steps)], capture_output=True, text=True, env=env)
            if proc.returncode:
                sys.exit(f"{name}: {proc.stderr.strip().splitlines()[-1]}")
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            res = results[name][-1]
            print(f"round {r + 1}: {name}: {res['step_ms']:.2f} ms a step, compile {res['compile_s']:.1f} s, "
                  f"RSS {res['rss_mib']:.0f} MiB", flush=True)
    ratios = [f["step_ms"] / i["step_ms"] for f, i in zip(results["frozen"], results["inputs"])]
    print(f"\n{args.threads} threads, {args.rounds} rounds, median step: frozen "
          f"{statistics.median(r['step_ms'] for r in results['frozen']):.2f} ms, weights as inputs "
          f"{statistics.median(r['step_ms'] for r in results['inputs']):.2f} ms; frozen / inputs "
          f"{statistics.median(ratios):.3f} (per round {' '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
