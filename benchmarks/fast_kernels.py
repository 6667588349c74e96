"""Passes per second of torch's own matrix-vector kernels over a model's matrices (issue 24's table).

    python benchmarks/fast_kernels.py                  # SmolLM2-135M and Llama-3.2-1B shapes, 2 threads
    pip install onnxruntime onnx                       # optional: onnxruntime's MatMulNBits arms (benchmark only)

A pass is every matrix of the model once, for one token (B=1, T=1): per layer the fused QKV, the output projection,
the fused gate/up and the down projection, plus the LM head. Weights are random (the kernels' speed does not depend
on the values). The arms alternate round by round in one process; the figure is the best round of each arm.

With onnxruntime (and onnx, to write the graphs) installed, two more arms: its `MatMulNBits` contrib operator on
4-bit and on 8-bit blocks of 32 with int8 activations (`accuracy_level=4`), one session a matrix as a model would hold
them, float32 activations in and out (the call's own cost included). Q4_0 blocks map onto the 4-bit form without loss
(zero point 8) and Q8_0 onto the 8-bit one (zero point 128); the types with a float minimum (Q4_1, the K-quants) need
float zero points, which its int8 path does not take (measured: ~40x slower than torch's int4 kernel).
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
    for bits in (4, 8):
        sessions = nbits_sessions(shapes, bits)
        if sessions:
            out[f"onnxruntime MatMulNBits, {bits}-bit, int8 activations, group 32"] = (
                torch.float32, [lambda x, s=s: s.run(None, {"A": x.numpy()})[0] for s in sessions])
    return out


def nbits_sessions(shapes, bits: int, group: int = 32) -> list:
    """One onnxruntime session a matrix, each one MatMulNBits node over random blocks ([] without onnxruntime/onnx)."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return []
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = torch.get_num_threads(), 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no spinning between calls, as torch
    rng = np.random.default_rng(0)
    out = []
    for n, k in shapes:
        b = rng.integers(0, 256, (n, k // group, group * bits // 8), dtype=np.uint8)
        s = rng.random(n * k // group, dtype=np.float32) * 1e-2
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=group, accuracy_level=4)
        graph = helper.make_graph([node], "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
                                  [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
                                   helper.make_tensor("S", TensorProto.FLOAT, s.shape, s.tobytes(), raw=True)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        out.append(ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="per arm and round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY holds "
          f"torch, not onnxruntime), {args.threads} threads")
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
