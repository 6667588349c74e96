"""The activation-patching sweep (`llmtrace patch`) against L·T separate prefills of the corrupt prompt.

The issue's target: the whole sweep in at most 0.3× the time of L·T separate prefills (each a plain prefill of the
corrupt prompt, what running the patched prompts one by one would cost at least). Both arms run in this one process,
alternating, torch pinned to --threads; the best of --repeat rounds of each is kept, and the ratio is reported.

    python benchmarks/patch_bench.py                  # the README's Eiffel Tower / Colosseum pair, 2 threads
    python benchmarks/patch_bench.py --repeat 3 --threads 1
"""

from __future__ import annotations

import argparse
import time

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="model (default: smollm2-135m-instruct)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads, pinned for both arms")
    ap.add_argument("--repeat", type=int, default=2, help="rounds, each running both arms; the best of each is kept")
    ap.add_argument("--clean", default=CLEAN)
    ap.add_argument("--corrupt", default=CORRUPT)
    args = ap.parse_args()

    import torch

    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.patching import sweep_metrics

    torch.set_num_threads(args.threads)
    lm = llmtrace.load(args.model, device="cpu", dtype="float32").loaded
    tok = lm.tokenizer
    clean, corrupt = tok.encode_prompt(args.clean)[1], tok.encode_prompt(args.corrupt)[1]
    a, b = tok.encode(" Paris", add_special_tokens=False)[0], tok.encode(" Rome", add_special_tokens=False)[0]
    L, T = lm.config.n_layers, len(corrupt)
    idx = torch.tensor([corrupt])

    def separate() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            for _ in range(L * T):
                lm.model(idx, last_only=True)
        return time.perf_counter() - t

    def sweep() -> float:
        t = time.perf_counter()
        sweep_metrics(lm.model, clean, corrupt, a, b, "resid_post")
        return time.perf_counter() - t

    sweep()  # first calls (allocations, kernels) outside the timing
    best_sep, best_sweep = float("inf"), float("inf")
    for _ in range(args.repeat):
        best_sep = min(best_sep, separate())
        best_sweep = min(best_sweep, sweep())
    print(f"model {lm.name}, L={L} layers × T={T} positions = {L * T} patched runs, {args.threads} threads")
    print(f"L·T separate prefills: {best_sep:.2f} s ({best_sep / (L * T) * 1e3:.1f} ms each)")
    print(f"sweep:                 {best_sweep:.2f} s")
    print(f"ratio sweep / separate: {best_sweep / best_sep:.2f} (target ≤ 0.30)")


if __name__ == "__main__":
    main()
