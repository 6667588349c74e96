"""`llmtrace capture` against an untraced pass over the same chunks: tokens per second, and their ratio.

The issue's target: a capture at ≥ 0.9× an untraced pass's tokens/s. The untraced arm is the model's forward over the
same chunks (`batch` rows a pass, no hook, no_grad); the capture arm is `capture_corpus` writing float16 shards to a
temporary directory, the writing included. Two captures are timed: the last layer's resid_post (the whole depth runs)
and a middle layer's (the pass stops after it, so it may beat the untraced pass). Both arms run in this process,
alternating, torch pinned to --threads; the best of --repeat rounds of each is kept.

    python benchmarks/capture_bench.py                       # SmolLM2-135M, ctx 128, 16 chunks, CPU
    python benchmarks/capture_bench.py --device cuda --chunks 64 --batch 8
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="model (default: smollm2-135m-instruct)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads, pinned for both arms")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="rounds, each running every arm; the best of each is kept")
    args = ap.parse_args()

    import torch

    import llmtrace
    from llmtrace.run.capture import capture_corpus, plan
    from llmtrace.run.eval_score import Chunking

    torch.set_num_threads(args.threads)
    model = llmtrace.load(args.model, device=args.device, dtype=args.dtype)
    lm = model.loaded
    L = lm.config.n_layers
    text = (Path(__file__).with_name("passage.txt").read_text() + "\n") * 40
    manifest, ids = plan(lm, text, [f"{L - 1}.resid_post"], args.ctx, chunks=args.chunks)
    n = manifest["chunks"]
    chunking = Chunking(args.ctx, manifest["bos"])
    rows = [chunking.ids(ids, i) for i in range(n)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def untraced() -> float:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in range(0, n, args.batch):
                lm.model(torch.tensor(rows[b:b + args.batch], device=lm.device))
        sync()
        return time.perf_counter() - t0

    def captured(points: str) -> float:
        out = Path(tempfile.mkdtemp(prefix="capture-bench-"))
        try:
            sync()
            t0 = time.perf_counter()
            capture_corpus(lm, text, points, args.ctx, out / "acts", chunks=args.chunks, shard_chunks=args.batch * 2,
                           batch=args.batch)
            sync()
            return time.perf_counter() - t0
        finally:
            shutil.rmtree(out)

    arms = {"untraced pass": untraced, f"capture {L - 1}.resid_post": lambda: captured(f"{L - 1}.resid_post"),
            f"capture {L // 2}.resid_post": lambda: captured(f"{L // 2}.resid_post")}
    untraced()  # warm-up
    best = {k: float("inf") for k in arms}
    for _ in range(args.repeat):
        for k, f in arms.items():
            best[k] = min(best[k], f())
    tokens = n * args.ctx
    print(f"{lm.name} on {args.device} ({str(lm.dtype).replace('torch.', '')}, {args.threads} threads): "
          f"{n} chunks × {args.ctx} tokens, {args.batch} a pass, best of {args.repeat}")
    base = tokens / best["untraced pass"]
    for k, s in best.items():
        print(f"  {k:<28} {tokens / s:10,.0f} tok/s   {tokens / s / base:5.2f}× the untraced pass")


if __name__ == "__main__":
    main()
