"""Batched decode against the same prompts run one after another.

For each batch size B (1, 4, 8, 16 by default) it takes B different prompts and generates N tokens after each (greedy,
EOS ignored, nothing traced) twice: as one batch (`generate_batch`: one forward pass per step for all rows) and as B
separate runs (`generate`). It reports the aggregate decode throughput of both, every row's tokens after the first
divided by the decode time, and their ratio, all measured in this one process with torch's threads pinned.

    python benchmarks/batch.py                       # B = 1, 4, 8, 16; 16 new tokens; 2 threads
    python benchmarks/batch.py --sizes 1,8 -n 8      # shorter
    python benchmarks/batch.py --threads 1 --repeat 3

Decode is bound by reading the weights (135M parameters, about 0.5 GB in float32, once per step): a batch reads them
once for all its rows, so its throughput grows with B until the arithmetic catches up. The batch also checks that
each row's tokens equal its run alone.
"""

from __future__ import annotations

import argparse
import time

PROMPTS = [
    "The capital of France is", "Once upon a time", "Quantum mechanics is a fundamental theory in physics that",
    "The best way to learn a language is", "In 1969, astronauts", "Photosynthesis converts", "My favourite recipe",
    "The stock market today", "Water boils at", "A haiku about autumn:", "The history of Rome begins",
    "To install Python on Linux,", "Dear hiring manager,", "The mitochondria is", "Rain in the desert",
    "Three reasons to exercise:",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="model (default: smollm2-135m-instruct)")
    ap.add_argument("--sizes", default="1,4,8,16", help="batch sizes, comma-separated (at most 16)")
    ap.add_argument("-n", "--new-tokens", type=int, default=16, help="tokens generated per row")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads, pinned for every arm")
    ap.add_argument("--repeat", type=int, default=3, help="rounds, each running both arms; the fastest of each is kept")
    args = ap.parse_args()

    import torch

    from llmtrace.run.generate import generate, generate_batch
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.sampler import Sampler, SamplerConfig

    torch.set_num_threads(args.threads)
    lm = llmtrace.load(args.model, device="cpu", dtype="float32").loaded
    prompts = [lm.tokenizer.encode_prompt(t, chat=False, system=None)[1] for t in PROMPTS]
    greedy = SamplerConfig(temperature=0, seed=0)
    n = args.new_tokens

    def sampler():
        return Sampler(greedy, lm.config.vocab_size)

    generate(lm, prompts[0], sampler(), 4, ignore_eos=True)  # warm-up
    print(f"{lm.name}, {args.threads} threads, {n} new tokens per row; decode tok/s over all rows")
    print(f"{'B':>3} {'batched':>10} {'sequential':>11} {'ratio':>7}")
    for B in [int(s) for s in args.sizes.split(",")]:
        rows = prompts[:B]
        best_b = best_s = 0.0
        for _ in range(args.repeat):
            res = generate_batch(lm, rows, [sampler() for _ in rows], n, ignore_eos=True)
            best_b = max(best_b, res.decode_tok_s)
            t_tokens, t_decode, alone = 0, 0.0, []
            for p in rows:
                r = generate(lm, p, sampler(), n, ignore_eos=True)
                t_tokens += len(r.tokens) - 1
                t_decode += r.decode_s
                alone.append(r.tokens)
            best_s = max(best_s, t_tokens / t_decode)
            same = [x.tokens for x in res.rows] == alone
        print(f"{B:>3} {best_b:>10.1f} {best_s:>11.1f} {best_b / best_s:>6.2f}x" + ("" if same else "  (rows differ!)"),
              flush=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
