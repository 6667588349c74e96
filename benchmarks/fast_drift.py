"""How far `--fast` drifts from the exact path on the same GGUF file: KL divergence and top-1 agreement of the
next-token distributions over a teacher-forced passage of real text.

    python benchmarks/fast_drift.py                       # the default model, benchmarks/passage.txt
    python benchmarks/fast_drift.py -m model.gguf --passage my.txt --json drift.json
    python benchmarks/fast_drift.py --kernels measured int4,int4x2 int8 bf16     # each kernel choice (issue 51)
    python benchmarks/fast_drift.py -m gemma3-270m --tokens 256 --kernels measured int8

--kernels: one fast load per entry, each an order of preference for $LLMTRACE_FAST_KERNELS (`int8`: every quantized
matrix requantized to int8 rows; `bf16`: every matrix dequantized to bfloat16), or `measured`: this machine's own
choice (the probe's). Each line of the table is one such choice against the same exact logits.

The passage (the opening of Jane Austen's Pride and Prejudice, 1813, public domain) is tokenized once and both
paths run it as one prefill pass with every position's logits kept (teacher forcing: each position predicts the
next token of the same text, whatever either path would have chosen). At each position t, with P the exact path's
next-token distribution and Q the fast path's (softmax of the float32 logits):
    KLD_t = sum_v P(v) (log P(v) - log Q(v))        same_top1_t = argmax P == argmax Q
The figures are the mean KLD, its 99th percentile and maximum, and the fraction of positions with the same top-1.
Targets (issue 24): same top-1 >= 0.97, mean KLD <= 0.01, over at least 256 tokens. `llmtrace compare` (fast
against exact on one file) reports the same two figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def drift(exact_logits: torch.Tensor, fast_logits: torch.Tensor) -> dict:
    """(T, V) logits of the exact and the fast path at the same positions -> KLD(exact || fast) and top-1 figures."""
    logp = torch.log_softmax(exact_logits.double(), dim=-1)
    logq = torch.log_softmax(fast_logits.double(), dim=-1)
    kld = (logp.exp() * (logp - logq)).sum(-1)  # (T,)
    same = exact_logits.argmax(-1) == fast_logits.argmax(-1)
    return {"positions": int(kld.numel()), "mean_kld": float(kld.mean()), "p99_kld": float(kld.quantile(0.99)),
            "max_kld": float(kld.max()), "same_top1": float(same.float().mean())}


@torch.inference_mode()
def passage_logits(lm, ids: list[int]) -> torch.Tensor:
    """Every position's logits (T, V) in float32, one pass without a cache."""
    return lm.model(torch.tensor([ids], device=lm.device))[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file or registry name (default: the default model)")
    ap.add_argument("--passage", type=Path, default=HERE / "passage.txt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--kernels", nargs="+", default=["measured"], help="kernel choices to measure (see above)")
    ap.add_argument("--tokens", type=int, help="only the passage's first TOKENS tokens")
    args = ap.parse_args()
    import os

    from llmtrace.checkpoint.devices import set_threads
    import llmtrace  # the public API: a benchmark measures what users run

    set_threads(args.threads)
    text = args.passage.read_text()
    lm = llmtrace.load(args.model, device="cpu", dtype="float32", threads=args.threads).loaded
    ids = lm.tokenizer.encode(text)[: args.tokens]
    exact = passage_logits(lm, ids)
    del lm
    out = {"model": args.model or "default", "passage": args.passage.name, "tokens": len(ids), "choices": {}}
    print("| kernel choice | kernels that ran | same top-1 | mean KLD | p99 KLD | max KLD |\n| --- | --- | ---: | ---: | "
          "---: | ---: |")
    for choice in args.kernels:
        os.environ.pop("LLMTRACE_FAST_KERNELS", None)
        if choice != "measured":
            os.environ["LLMTRACE_FAST_KERNELS"] = choice
        lm = llmtrace.load(args.model, device="cpu", fast=True, threads=args.threads).loaded
        ran = lm.config.extra["fast"]["kernel_choice"]["kernels"]
        d = drift(exact, passage_logits(lm, ids)) | {"kernels": ran}
        del lm
        out["choices"][choice] = d
        print(f"| {choice} | {', '.join(f'{k} x{n}' for k, n in ran.items())} | {d['same_top1']:.3f} | "
              f"{d['mean_kld']:.2e} | {d['p99_kld']:.2e} | {d['max_kld']:.2e} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
