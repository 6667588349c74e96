"""Can a greedy step multiply only part of Gemma 3's head? A measurement of the idea, not a feature (issue 51 item 2).

    python benchmarks/head_screen.py                      # the real Gemma 3 270M (Q4_K_M: a tied Q8_0 head), 12 steps
    python benchmarks/head_screen.py -m smollm2-135m-instruct --steps 8

The head of Gemma 3 is 262,144 rows of Q8_0. `--fast` multiplies it on torch's int4 kernel as two 4-bit matrices
(the high and the low nibble of each int8 weight, model.fast's `int4x2`): two passes over 4-bit rows. The idea
measured here: a greedy step that nothing observes needs only the top token, so one pass over the high nibbles
(half the bytes) could screen the rows, and only rows that might still be the top would be multiplied exactly.

For a Q8_0 weight w = d·(16h + l − 128), with h and l its two nibbles, the screen multiplies by 16d·(h − 8) + 7.5d
(l at the middle of its range) and misses by d·(l − 7.5): at most 7.5|d| a weight. A row's exact logit is then
within r = 7.5 Σ_g |d_g| Σ_{j in g} |x_j| of its screened one (g the row's blocks of 32; this ideal screen computes
in float32, so the bf16 rounding a kernel adds is left out and the real bound would be wider still). A row can be
skipped only if its screened logit + r is below the largest screened logit − r of any row. This script counts, per
greedy step after a short prompt, the rows that cannot be skipped, and checks that the top token is among them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llmtrace  # noqa: E402  (the public API: a benchmark measures what users run)
from llmtrace.model.quant import BLOCKS  # noqa: E402

PROMPT = "Quantum mechanics is a fundamental theory in physics that"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="gemma3-270m")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    lm = llmtrace.load(args.model, device="cpu", threads=args.threads, fast=True).loaded
    model = lm.model
    head = model.lm_head
    if [s.kind for s in head.segments] != ["Q8_0"] or not hasattr(model.embed, "raw0"):
        sys.exit(f"{args.model}: the head is {'+'.join(s.kind for s in head.segments)}, not a tied Q8_0 table")
    raw = model.embed.raw0  # (V, bytes per row): the tied table's blocks, mapped from the file
    V = raw.size(0)
    blocks = raw.reshape(V, -1, BLOCKS["Q8_0"][1])  # (V, G, 34)
    d = blocks[:, :, :2].contiguous().view(torch.float16).float().squeeze(-1)  # (V, G)
    q = blocks[:, :, 2:].contiguous().view(torch.int8).float()  # (V, G, 32)
    high = torch.div(q + 128, 16, rounding_mode="floor")
    exact = (d[:, :, None] * q).reshape(V, -1)  # (V, K) the file's values
    screen = (d[:, :, None] * (16 * (high - 8) + 7.5)).reshape(V, -1)  # (V, K) what one high-nibble pass multiplies by
    del q, high
    ids = lm.tokenizer.encode_prompt(PROMPT, chat=False, system=None)[1]
    cache = model.new_cache(len(ids) + args.steps + 1)
    idx, start = torch.tensor([ids]), 0
    print(f"{args.model}: head {V} x {exact.size(1)} Q8_0; rows a rigorous screen cannot skip, per greedy step")
    print("| step | rows left | of the head | top token among them | gap between the two largest logits |")
    print("| ---: | ---: | ---: | --- | ---: |")
    with torch.inference_mode():
        for step in range(args.steps):
            x = model.embed_tokens(idx)
            x = model.run_layers(x, model.layer_inputs(idx, cache, start, dtype=x.dtype))
            cache.seq_len = start + idx.size(1)
            start += idx.size(1)
            h = model.norm(x)[:, -1, :].float()  # (1, K): the bf16 vector the head multiplies
            y, c = h @ exact.T, h @ screen.T  # (1, V) each
            r = 7.5 * (h.abs().reshape(1, -1, 32).sum(-1) @ d.abs().T)  # (1, V)
            left = (c + r) >= (c - r).max()
            top = int(y.argmax())
            gap = float(y.topk(2).values.diff().abs())
            share = float(left.float().mean())
            print(f"| {step} | {int(left.sum()):,} | {share:.0%} | {bool(left[0, top])} | {gap:.2f} |")
            idx = torch.tensor([[top]])


if __name__ == "__main__":
    main()
