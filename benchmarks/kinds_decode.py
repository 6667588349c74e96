"""Decode speed of the tiny checkpoints of the families that remember differently (issue "four ways to remember"),
each beside a tiny Llama of the same width and depth, in one process.

Each family's tiny random checkpoint (tests/families.py) is built in a temporary directory, loaded by llmtrace in
float32 on the CPU, and asked for N greedy tokens (EOS ignored, nothing traced) after the same prompt; Llama's twin has
the family's width, heads, FFN width, depth and vocabulary. The runs alternate (family, Llama, family, ...) R times so
that the machine's drift falls on both alike; the median of each is reported, as tokens per second and as tokens per
second times parameters (the rate per parameter, which the issue asks to be within 1.5× of Llama's).

    python benchmarks/kinds_decode.py                    # lfm2 (and gemma4 once it exists), 32 tokens, 5 rounds
    python benchmarks/kinds_decode.py --families lfm2 -n 64 --repeat 7 --threads 1

At these sizes (width 64) a step costs far more in Python and torch's dispatch than in arithmetic: the figures compare
the paths' overheads (how many modules and kernels a step runs), not the maths of a real model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def twin_of(family):
    """A Llama with the family's width, heads, FFN width, depth and vocabulary."""
    from families import COMMON, Family

    c = {**COMMON, **family.config}
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
            "tie_word_embeddings")
    return Family(f"llama_{family.name}", "llama", {k: c[k] for k in keep if k in c} | {
        "intermediate_size": c["intermediate_size"], "head_dim": c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "Llama of the same size")


def decode_rate(lm, ids: list[int], n: int) -> float:
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
    return generate(lm, ids, sampler, n, (), True, None).decode_tok_s  # the tokens after the prefill's first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="lfm2,gemma4")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import families as fx
    from llmtrace.checkpoint.load import load_model

    ids = fx.PROMPT_IDS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            if name not in fx.FAMILIES:
                print(f"skip {name}: no tiny checkpoint in tests/families.py", file=sys.stderr)
                continue
            family, twin = fx.FAMILIES[name], twin_of(fx.FAMILIES[name])
            models = {}
            for f in (family, twin):
                path = Path(tmp) / f.name
                fx.write_hf_dir(path, f, fx.make_model(f))
                models[f.name] = load_model(str(path), device="cpu", dtype="float32")
            rates = {k: [] for k in models}
            for k, lm in models.items():  # one warm-up each
                decode_rate(lm, ids, 4)
            for _ in range(args.repeat):
                for k, lm in models.items():
                    rates[k].append(decode_rate(lm, ids, args.n))
            params = {k: lm.model.num_params() for k, lm in models.items()}
            med = {k: statistics.median(v) for k, v in rates.items()}
            per_param = {k: med[k] * params[k] for k in med}
            rows.append({"family": name, "tok_s": round(med[family.name], 1), "params": params[family.name],
                         "llama_tok_s": round(med[twin.name], 1), "llama_params": params[twin.name],
                         "rate_per_param_vs_llama": round(per_param[family.name] / per_param[twin.name], 3),
                         "tok_s_vs_llama": round(med[family.name] / med[twin.name], 3),
                         "runs": {k: [round(x, 1) for x in v] for k, v in rates.items()}})
    for r in rows:
        print(f"{r['family']:>8}: {r['tok_s']:7.1f} tok/s ({r['params']:,} params)   llama twin: {r['llama_tok_s']:7.1f} "
              f"tok/s ({r['llama_params']:,})   speed {r['tok_s_vs_llama']:.2f}×, per parameter "
              f"{r['rate_per_param_vs_llama']:.2f}×")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
