"""The CUDA case of `--fast` (issue 24), for benchmarks/gpu_check.sh: torch's CUDA int4 kernel (_weight_int4pack_mm,
as gpt-fast uses it) on each block type, then the default model's drift and decode speed.

    python benchmarks/gpu_fast_check.py --json fast.json     # on CUDA
    python benchmarks/gpu_fast_check.py --device cpu         # the same checks on the CPU kernel, anywhere

1. Each type that maps onto int4 groups (Q4_0, Q4_1, Q4_K, Q5_*, Q8_0): FastLinear on the device against x W^T with W
   the mapping's matrix (llmtrace.model.fast.int4_reference, scale and zero in bf16), within bf16 output rounding.
2. The default model: --fast against the exact float32 path over benchmarks/passage.txt (mean KLD, same top-1;
   targets 0.01 and 0.97), and decode tok/s of --fast eager, --fast with the compiled step, and exact bf16 eager.
Exit status: non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def kernel_checks(device: torch.device) -> dict:
    from llmtrace.model.fast import fast_linear, int4_groups, int4_reference
    from llmtrace.model.quant import BLOCKS, GROUP_KINDS, Segment

    out = {}
    rng = np.random.default_rng(0)
    for kind in GROUP_KINDS:
        block, size = BLOCKS[kind]
        raw = rng.integers(0, 256, size=(4208, 512 // block * size), dtype=np.uint8)
        b = raw.reshape(-1, size)
        for j in range(2 if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1):
            b[:, 2 * j : 2 * j + 2] = (rng.random(b.shape[0]) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw = torch.from_numpy(raw)
        lin = fast_linear([raw], [Segment(kind, "t")], 512, device, int4=True)
        x = torch.randn(3, 512).to(torch.bfloat16)
        want = x.float() @ int4_reference(int4_groups(raw, kind)).t()
        got = lin(x.to(device)).float().cpu()
        excess = ((got - want).abs() - want.abs() * 2**-8 - 1e-4 * want.abs().max()).max().item()
        out[kind] = {"kernel": lin.kernel, "ok": excess <= 0, "max_abs_err": (got - want).abs().max().item()}
        print(f"{kind}: {lin.kernel}: {'ok' if excess <= 0 else 'FAILED'} (max |err| {out[kind]['max_abs_err']:.3g})")
    return out


@torch.inference_mode()
def model_checks(device: torch.device, tokens: int) -> dict:
    from fast_drift import drift
    from llmtrace.run.generate import compile_decode, generate
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.sampler import Sampler, SamplerConfig

    text = (ROOT / "benchmarks" / "passage.txt").read_text()
    exact = llmtrace.load(None, device="cpu", dtype="float32").loaded
    ids = exact.tokenizer.encode(text)
    ref = exact.model(torch.tensor([ids]))[0].float()
    del exact
    fast = llmtrace.load(None, device=str(device), fast=True).loaded
    got = fast.model(torch.tensor([ids], device=device))[0].float().cpu()
    out = {"drift": drift(ref, got), "kernel_choice": fast.config.extra["fast"]["kernel_choice"]}
    print(f"drift over {len(ids)} tokens: {json.dumps(out['drift'])}")

    def tok_s(lm, compiled=None):
        prompt = lm.tokenizer.encode("Quantum mechanics is a fundamental theory in physics that")
        res = generate(lm, prompt, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), tokens,
                       ignore_eos=True, compiled=compiled)
        return res.decode_tok_s

    n_prompt = len(fast.tokenizer.encode("Quantum mechanics is a fundamental theory in physics that"))
    out["decode_tok_s"] = {"fast eager": tok_s(fast)}
    t = time.perf_counter()
    compiled = compile_decode(fast, n_prompt, tokens)
    out["compile_s"] = time.perf_counter() - t
    out["decode_tok_s"]["fast compiled"] = tok_s(fast, compiled)
    del fast, compiled
    bf16 = llmtrace.load(None, device=str(device), dtype="bfloat16").loaded
    out["decode_tok_s"]["exact bf16 eager"] = tok_s(bf16)
    print(f"decode tok/s: {json.dumps(out['decode_tok_s'])}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "kernels": kernel_checks(device)}
    out |= model_checks(device, args.tokens)
    ok = all(k["ok"] for k in out["kernels"].values())
    ok = ok and out["drift"]["mean_kld"] <= 0.01 and out["drift"]["same_top1"] >= 0.97
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
