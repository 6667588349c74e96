"""Load time and peak memory of big checkpoints: llmtrace against transformers, on checkpoints made at run time.

    python benchmarks/scale.py                       # Llama-3.2-1B shape (16 layers), bf16 safetensors + Q8_0 GGUF
    python benchmarks/scale.py --layers 4 --quant Q4_0 --json scale.json
    python benchmarks/scale.py --decode 16           # also decode tok/s: fp32 path vs --keep-quantized
    python benchmarks/scale.py --kernels             # one head GEMV: fp32, torch's int8 kernel, dequantize + GEMV

The checkpoint has random weights shaped like Llama-3.2-1B (D 2048, 32 query / 8 KV heads, F 8192, V 128256, tied
embeddings, llama3 RoPE scaling), written as bf16 safetensors by transformers, and as a GGUF by the gguf package's
writer and quantizer with llama.cpp's tensor names and q/k row permutation (tests/tiny.py). Every arm runs in a fresh
process; its peak RSS (ru_maxrss) is compared with the weight bytes in its dtype, after subtracting the process's own
RSS before the load (Python, torch, llmtrace: the "baseline"). Target (issue 17): peak - baseline <= 1.15 x weights
(run dtype), and <= 1.3 x the GGUF file with --keep-quantized. Threads are pinned (--threads, default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})  # fmt: skip


def rss_bytes() -> int:
    """Peak resident memory of this process so far (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------------------------------------------
# checkpoints


def make_checkpoints(where: Path, layers: int, quant: str) -> tuple[Path, Path]:
    """An HF directory (bf16 safetensors) and a GGUF file of the same random weights."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import write_gguf, write_tokenizer, tiny_tokenizer

    hf_dir, gguf_path = where / "llama-1b-shape", where / f"llama-1b-shape.{quant}.gguf"
    config = transformers.LlamaConfig(num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, **LLAMA_1B)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(str(hf_dir))
    write_tokenizer(hf_dir, tiny_tokenizer())
    write_gguf(gguf_path, model, plan=lambda name, a: None if a.ndim == 1 else quant, tokenizer=tiny_tokenizer(),
               name="llama-1b-shape", vocab_metadata=True)
    return hf_dir, gguf_path


# ----------------------------------------------------------------------------------------------------------------
# one arm, in its own process


def arm(kind: str, path: str, dtype: str, decode: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("SCALE_THREADS", "1")))
    if kind.startswith("hf"):
        import transformers  # noqa: F401  (imported before the baseline, like llmtrace below)
    else:
        import llmtrace  # the public API: a benchmark measures what users run
    base = rss_bytes()
    t0 = time.perf_counter()
    if kind.startswith("hf"):
        if path.endswith(".gguf"):
            p = Path(path)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=getattr(torch, dtype))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        forward = lambda idx: model(idx).logits  # noqa: E731
    else:
        lm = llmtrace.load(path, device="cpu", dtype=dtype, keep_quantized=kind == "llmtrace-quantized").loaded
        from llmtrace.model.quant import QUANT_MODULES

        seen, weights = set(), 0
        for m in lm.model.modules():
            if isinstance(m, QUANT_MODULES) and id(m.raw0) not in seen:
                seen.add(id(m.raw0))
                weights += m.stored_bytes()
        weights += sum(p.numel() * p.element_size() for p in lm.model.parameters())
        forward = None
    load_s = time.perf_counter() - t0
    out = {"arm": kind, "path": Path(path).name, "dtype": dtype, "load_s": round(load_s, 2), "baseline_bytes": base,
           "peak_bytes": rss_bytes(), "weight_bytes": weights}
    out["ratio"] = round((out["peak_bytes"] - base) / weights, 3)
    if decode and not kind.startswith("hf"):
        from llmtrace.run.generate import generate
        from llmtrace.run.sampler import Sampler, SamplerConfig

        ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
        sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
        res = generate(lm, ids, sampler, decode, ignore_eos=True)
        out["decode_tok_s"] = round((len(res.tokens) - 1) / res.decode_s, 2)  # the first token comes from the prefill
        out["tokens"] = res.tokens
        out["peak_bytes_after_decode"] = rss_bytes()
    return out


def run_arm(kind: str, path: Path, dtype: str, decode: int, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--arm", kind, str(path), dtype, str(decode)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"arm": kind, "dtype": dtype, "error": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernels(threads: int, reps: int = 20) -> list[dict]:
    """One decode GEMV on SmolLM2's 49152 x 576 head, best of `reps`: fp32 F.linear, torch's int8 weight-only kernel
    (_weight_int8pack_mm), and --keep-quantized's dequantize-then-GEMV for Q8_0 and Q4_1 (the default model's types)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from llmtrace.model.quant import dequantize

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    w, x = torch.randn(49152, 576) * 0.05, torch.randn(1, 576)
    w8 = (w / w.abs().amax(1, keepdim=True) * 127).round().to(torch.int8)
    scales = w.abs().amax(1) / 127
    q8 = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    q41 = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_1))
    arms = {
        "fp32 F.linear": lambda: F.linear(x, w),
        "int8 _weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, w8, scales),
        "Q8_0 dequantize + F.linear": lambda: F.linear(x, dequantize(q8, "Q8_0")),
        "Q4_1 dequantize + F.linear": lambda: F.linear(x, dequantize(q41, "Q4_1")),
        "Q4_1 dequantize only": lambda: dequantize(q41, "Q4_1"),
    }
    rows = []
    for name, fn in arms.items():
        fn()
        best = min(_timed(fn) for _ in range(reps))
        rows.append({"kernel": name, "ms": round(best * 1e3, 2)})
    base = rows[0]["ms"]
    for r in rows:
        r["x_fp32"] = round(r["ms"] / base, 2)
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (Llama-3.2-1B has 16)")
    ap.add_argument("--quant", default="Q8_0", help="GGUF type of the matrices (Q8_0, Q4_0, ...)")
    ap.add_argument("--decode", type=int, default=0, help="also time this many greedy decode steps per llmtrace arm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers arms")
    ap.add_argument("--kernels", action="store_true", help="only time one head GEMV: fp32, torch int8, dequantize")
    args = ap.parse_args()
    if args.kernels:
        for r in kernels(args.threads):
            print(f"{r['kernel']:30} {r['ms']:8.2f} ms  {r['x_fp32']:5.2f}x fp32")
        return
    if args.arm:
        print(json.dumps(arm(args.arm[0], args.arm[1], args.arm[2], int(args.arm[3]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        env = dict(os.environ, LLMTRACE_HOME=str(home), SCALE_THREADS=str(args.threads), PYTHONPATH=str(ROOT),
                   OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        t0 = time.perf_counter()
        hf_dir, gguf_path = make_checkpoints(Path(tmp), args.layers, args.quant)
        print(f"checkpoints made in {time.perf_counter() - t0:.0f} s; GGUF {gguf_path.stat().st_size / 2**20:.0f} MiB",
              file=sys.stderr)
        arms = [("llmtrace", hf_dir, "bfloat16"), ("llmtrace", hf_dir, "float32")]
        if not args.skip_hf:
            arms += [("hf", hf_dir, "bfloat16"), ("hf", hf_dir, "float32")]
        arms += [("llmtrace-gguf-cold", gguf_path, "float32"), ("llmtrace-gguf-warm", gguf_path, "float32"),
                 ("llmtrace-gguf-warm", gguf_path, "bfloat16"), ("llmtrace-quantized", gguf_path, "float32")]
        rows = []
        for kind, path, dtype in arms:
            row = run_arm(kind, path, dtype, args.decode if kind in ("llmtrace-gguf-warm", "llmtrace-quantized") and dtype == "float32" else 0, env)
            if "error" not in row and kind == "llmtrace-quantized":
                row["file_bytes"] = gguf_path.stat().st_size
                row["ratio_to_file"] = round((row["peak_bytes"] - row["baseline_bytes"]) / row["file_bytes"], 3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(f"\n{'arm':22} {'dtype':9} {'load s':>7} {'weights':>10} {'peak-base':>10} {'ratio':>6} {'tok/s':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['arm']:22} {r['dtype']:9} error: {r['error'][0]}")
            continue
        print(f"{r['arm']:22} {r['dtype']:9} {r['load_s']:7.2f} {r['weight_bytes'] / 2**30:9.2f}G "
              f"{(r['peak_bytes'] - r['baseline_bytes']) / 2**30:9.2f}G {r['ratio']:6.3f} {r.get('decode_tok_s', ''):>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": args.layers, "quant": args.quant, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
