"""Passes per second of torch's own matrix-vector kernels over a model's matrices (issue 24's table).

    python benchmarks/fast_kernels.py                  # SmolLM2-135M and Llama-3.2-1B shapes, 2 threads

A pass is every matrix of the model once, for one token (B=1, T=1): per layer the fused QKV, the output projection,
the fused gate/up and the down projection, plus the LM head. Weights are random (the kernels' speed does not depend
on the values). The arms alternate round by round in one process; the figure is the best round of each arm.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # (layers, D, H*Dh, Hkv*Dh, F, V)
    "SmolLM2-135M": (30, 576, 576, 192, 1536, 49152),
    "Llama-3.2-1B": (16, 2048, 2048, 512, 8192, 128256),
}


def matrices(layers, d, q, kv, f, v):
    per_layer = [(q + 2 * kv, d), (d, q), (2 * f, d), (d, f)]
    return per_layer * layers + [(v, d)]


def arms(shapes):
    out = {}
    g = 32
    dense32 = [torch.randn(n, k) * 0.02 for n, k in shapes]
    out["float32 F.linear"] = (torch.float32, [lambda x, w=w: torch.nn.functional.linear(x, w) for w in dense32])
    dense16 = [w.bfloat16() for w in dense32]
    out["bfloat16 F.linear"] = (torch.bfloat16, [lambda x, w=w: torch.nn.functional.linear(x, w) for w in dense16])
    del dense32
    i8 = [(torch.randint(-128, 127, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16)) for n, k in shapes]
    out["_weight_int8pack_mm, bf16 activations"] = (
        torch.bfloat16, [lambda x, w=w, s=s: torch._weight_int8pack_mm(x, w, s) for w, s in i8])
    i4 = []
    for n, k in shapes:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        i4.append((packed, torch.rand(k // g, n, 2, dtype=torch.bfloat16)))
    out["_weight_int4pack_mm_for_cpu, bf16 activations, group 32"] = (
        torch.bfloat16, [lambda x, w=w, sz=sz: torch._weight_int4pack_mm_for_cpu(x, w, g, sz) for w, sz in i4])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="per arm and round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for model, dims in SHAPES.items():
        shapes = matrices(*dims)
        best: dict[str, float] = {}
        table = arms(shapes)
        for _ in range(args.rounds):
            for name, (dt, fns) in table.items():
                xs = {k: torch.randn(1, k, dtype=dt) for _, k in shapes}
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < args.seconds:
                    for (_, k), fn in zip(shapes, fns):
                        fn(xs[k])
                    n += 1
                best[name] = max(best.get(name, 0.0), n / (time.perf_counter() - t0))
        print(f"\n{model} passes/s (best of {args.rounds} rounds)")
        for name, v in best.items():
            print(f"| {name} | {v:.1f} |")
        del table


if __name__ == "__main__":
    main()
