"""An eager `--fast` decode step with and without FastRMSNorm (model.fast.use_fast_norms), in one process (issue 51).

    python benchmarks/fast_eager_ab.py                          # SmolLM2 Q4_1, 1 thread, 8 rounds of 32 steps
    python benchmarks/fast_eager_ab.py -m gemma3-270m --threads 2 --rounds 6

One model, loaded once for the fast path; its RMSNorm modules are switched between their own class (F.rms_norm,
~30 aten calls on the CPU) and the fast path's (one layer norm over [x, −x]), and the two arms alternate round by
round (A B, then B A, ...). A round: a short prompt prefilled into a fresh cache, then --steps greedy decode steps;
each step timed in the process's CPU time (time.process_time, over torch's threads: the time other processes hold
the cores is left out) and in wall time. Prints each arm's median ms a step, and the ratio before / after per round
(median and spread), with the load average. The greedy tokens of the two arms are printed too: they may part where
two logits are a bfloat16 step apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

PROMPT = "Quantum mechanics is a fundamental theory in physics that"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="a registry name or a GGUF path (default: the default model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from llmtrace.checkpoint.load import load_model
    from llmtrace.model.fast import FastRMSNorm
    from llmtrace.registry.resolve import resolve

    lm = load_model(str(resolve(args.model).path), device="cpu", fast=True)
    norms = [m for m in lm.model.modules() if isinstance(m, FastRMSNorm)]
    fast_cls = {m: type(m) for m in norms}
    own_cls = {m: type(m).__mro__[2] for m in norms}  # (the fast subclass, FastRMSNorm, the module's own class, ...)
    ids = torch.tensor([lm.tokenizer.encode(PROMPT)])

    @torch.inference_mode()
    def round_(arm: str) -> tuple[float, float, list[int]]:
        for m in norms:
            m.__class__ = (fast_cls if arm == "after" else own_cls)[m]
        cache = lm.model.new_cache(ids.size(1) + args.steps + 1)
        logits = lm.model(ids, cache, 0, last_only=True)
        tok, pos, cpu, wall, out = int(logits.argmax(-1)), ids.size(1), [], [], []
        for _ in range(args.steps):
            c, w = time.process_time(), time.perf_counter()
            logits = lm.model(torch.tensor([[tok]]), cache, pos, last_only=True)
            tok = int(logits.argmax(-1))
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
            out.append(tok)
            pos += 1
        return statistics.median(cpu) * 1e3 / args.threads, statistics.median(wall) * 1e3, out

    print(f"{len(norms)} RMSNorm modules switched; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    round_("after")  # warm-up
    res: dict[str, list] = {"before": [], "after": []}
    for r in range(args.rounds):
        for arm in (("before", "after") if r % 2 == 0 else ("after", "before")):
            res[arm].append(round_(arm))
    for arm, rs in res.items():
        print(f"{arm:6}: {statistics.median(r[0] for r in rs):.2f} ms CPU a step (per thread), "
              f"{statistics.median(r[1] for r in rs):.2f} ms wall")
    for i, name in ((0, "CPU"), (1, "wall")):
        ratios = [b[i] / a[i] for b, a in zip(res["before"], res["after"])]
        print(f"before / after ({name}): median {statistics.median(ratios):.3f}, "
              f"spread {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds")
    same = res["before"][0][2] == res["after"][0][2]
    print(f"greedy tokens {'the same' if same else 'differ'}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
