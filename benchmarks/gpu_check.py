"""The GPU half of benchmarks/gpu_check.sh: bf16 parity with transformers, peak GPU memory, --keep-quantized.

    python benchmarks/gpu_check.py                  # on CUDA (what gpu_check.sh runs)
    python benchmarks/gpu_check.py --device cpu -n 4  # a smoke test of the script itself, anywhere

Parity: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in bfloat16 with SDPA attention, llmtrace against
transformers' load of the same file in bfloat16. For each of 4 prompts: the greedy tokens must be identical, and the
prefill logits must be as close to the float32 reference as transformers' bf16 ones (tolerance below). Each check prints one line and the script exits non-zero if
one fails; the figures go to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The capital of France is",
    "Quantum mechanics is a fundamental theory in physics that",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
# bf16 keeps 8 bits of mantissa, so bf16 logits are off the float32 ones by a few bf16 ulps whoever computes them.
# The tolerance is relative: llmtrace's bf16 prefill logits may be no further from the float32 reference (transformers,
# dense float32) than 1.25x transformers' own bf16 logits are.
LOGIT_FACTOR = 1.25


def greedy(step, prompt_ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        logits = step(prompt_ids + out)
        out.append(int(logits.argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import transformers

    from llmtrace.run.generate import generate
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.registry.resolve import resolve
    from llmtrace.run.sampler import Sampler, SamplerConfig

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    path = resolve(None).path
    results: dict = {"device": torch.cuda.get_device_name(dev) if cuda else str(dev), "logit_factor": LOGIT_FACTOR}
    failed = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failed.append(name)

    # -- bf16 parity with transformers ----------------------------------------------------------------------
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    lm = llmtrace.load(str(path), device=args.device, dtype="bfloat16").loaded
    # dequantize=True: dense models (transformers otherwise keeps GGUF blocks and computes in float32)
    packed = {"quantization_config": transformers.GgufConfig(dequantize=True)} if hasattr(transformers, "GgufConfig") else {}

    def hf_model(dtype):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation="sdpa", **packed).to(dev).eval()

    hf, hf32 = hf_model(torch.bfloat16), hf_model(torch.float32)
    ours_err, hf_err, same = 0.0, 0.0, 0
    encoded = [lm.tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]
    for ids in encoded:  # prefill logits first: plain forward passes, before any generation sets up a KV cache
        with torch.no_grad():
            x = torch.tensor([ids], device=dev)
            ours, theirs, reference = lm.model(x).float(), hf(x).logits.float(), hf32(x).logits
        ours_err = max(ours_err, float((ours - reference).abs().max()))
        hf_err = max(hf_err, float((theirs - reference).abs().max()))
    del hf32
    for prompt, ids in zip(PROMPTS, encoded):
        with torch.no_grad():
            hf_tokens = greedy(lambda t: hf(torch.tensor([t], device=dev)).logits[0, -1], ids, args.n)
        res = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), args.n, ignore_eos=True)
        same += res.tokens == hf_tokens
        if res.tokens != hf_tokens:
            print(f"     {prompt!r}: llmtrace {res.tokens} vs transformers {hf_tokens}")
    results["parity"] = {"prompts": len(PROMPTS), "greedy_identical": same, "llmtrace_bf16_vs_fp32": round(ours_err, 4),
                         "transformers_bf16_vs_fp32": round(hf_err, 4)}
    check("bf16 greedy tokens vs transformers", same == len(PROMPTS), f"{same}/{len(PROMPTS)} prompts identical")
    check("bf16 prefill logits", ours_err <= LOGIT_FACTOR * hf_err,
          f"max |llmtrace bf16 - fp32| {ours_err:.3f}, transformers bf16's {hf_err:.3f} (tolerance {LOGIT_FACTOR}x that)")
    del hf

    # -- peak GPU memory of a run -----------------------------------------------------------------------------
    ids = lm.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
    res = generate(lm, ids, sampler, 64, ignore_eos=True)
    results["bf16"] = {"decode_tok_s": round((len(res.tokens) - 1) / res.decode_s, 1)}
    if cuda:
        results["bf16"]["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
        check("peak GPU memory", True, f"{torch.cuda.max_memory_allocated(dev) / 2**20:.0f} MiB (bf16 load + 64 tokens; "
              f"transformers' copy freed before)")
    reference = res.tokens
    del lm

    # -- --keep-quantized: blocks on the GPU, dequantization fused into the products by torch.compile ----------
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    q = llmtrace.load(str(path), device=args.device, dtype="bfloat16", keep_quantized=True).loaded
    first = generate(q, ids, sampler, 4, ignore_eos=True)  # compiles (one function per block type)
    compile_s = time.perf_counter() - t0
    res = generate(q, ids, sampler, 64, ignore_eos=True)
    agree = sum(a == b for a, b in zip(res.tokens, reference))
    results["keep_quantized"] = {"decode_tok_s": round((len(res.tokens) - 1) / res.decode_s, 1),
                                 "load_and_compile_s": round(compile_s, 1), "tokens_equal_bf16": agree}
    if cuda:
        results["keep_quantized"]["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
    check("--keep-quantized decode", first.tokens == reference[:4],
          f"{results['keep_quantized']['decode_tok_s']} tok/s vs {results['bf16']['decode_tok_s']} dense bf16; "
          f"{agree}/64 tokens equal the dense bf16 run's")
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
