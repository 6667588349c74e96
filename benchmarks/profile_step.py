"""Where the time of one decode step goes, measured with torch.profiler (the evidence behind benchmarks/RESULTS.md).

    python benchmarks/profile_step.py --threads 2            # untraced decode steps, and --trace full steps
    python benchmarks/profile_step.py --threads 2 --steps 20 --top 15
    python benchmarks/profile_step.py --threads 2 --levels none --compiled   # also the torch.compile'd step
                                                                              # (one more compile: ~2 min the first time)
    python benchmarks/profile_step.py --fast --threads 1 --levels none --pieces   # the --fast path (GGUF, int4)
    python benchmarks/profile_step.py --fast -m gemma3-270m --threads 1 --levels none --pieces   # another model

For each mode it profiles --steps decode steps after a 64-token prompt and prints, per step: wall time, the time inside
the matrix products (aten::mm/bmm), the time of all other aten ops, how many aten ops ran, and the time outside aten
(Python: module calls, the trace's bookkeeping, event encoding). The matrix products alone are compared with the
measured ceiling: one pass of matrix-vector products over the same weights, timed in the same process.

--fast: the model's GGUF (-m; by default the default model's) on the fast path; the ceiling is then one pass of its
products alone (every FastLinear's kernel called back to back on a bfloat16 vector). --pieces: what each piece of the
step costs in place, between the products (which evict the caches each op runs from, so an op costs ~2-3x its cost
in a loop of its own): the step timed with one piece at a time replaced by a stand-in of the same shapes,
alternating with the whole step, medians of process CPU time (timing only; the stand-ins compute nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmtrace.run.generate import generate  # noqa: E402
import llmtrace  # the public API: a benchmark measures what users run
from llmtrace.checkpoint.devices import set_threads
from llmtrace.run.sampler import Sampler, SamplerConfig  # noqa: E402
from llmtrace.trace.recorder import Recorder  # noqa: E402
from llmtrace.trace.options import TraceOptions
from _arms import decode_matrices  # noqa: E402  (benchmarks/, this script's directory)

MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int4pack_mm"}


def ceiling_ms(model, passes: int = 30) -> tuple[float, float]:
    """One pass of matrix-vector products over every weight matrix a decode step reads: (best pass, mean pass of
    `passes` back to back), in ms."""
    mats = decode_matrices(model)
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in mats]
    times = []
    with torch.inference_mode():
        for _ in range(passes):
            t = time.perf_counter()
            for x, w in zip(xs, mats):
                F.linear(x, w)
            times.append(time.perf_counter() - t)
    return min(times) * 1e3, statistics.mean(times) * 1e3


def int4_ceiling_ms(model, passes: int = 30) -> tuple[float, float]:
    """--fast: one pass of the products a decode step makes (each FastLinear's kernels on a bfloat16 vector):
    (best pass, mean pass), in ms."""
    from llmtrace.model.fast import FastLinear

    calls = []
    for m in model.modules():
        if isinstance(m, FastLinear):
            for part in m.parts:
                calls.append((part, torch.randn(1, m.in_features, dtype=torch.bfloat16)))  # a split part doubles it
    times = []
    with torch.inference_mode():
        for _ in range(passes):
            t = time.perf_counter()
            for part, x in calls:
                part.forward(x)
            times.append(time.perf_counter() - t)
    return min(times) * 1e3, statistics.mean(times) * 1e3


def pieces(lm, ids: list[int], rounds: int = 8) -> None:
    """Each piece's cost in place (see the module's docstring): the step with the piece stubbed, against the step."""
    import llmtrace.model.transformer as T
    from llmtrace.model.fast import DenseMatmul, Int4Matmul, Int8Matmul

    m = lm.model
    zeros: dict = {}

    def product_stub(self, x):
        key = (tuple(x.shape), self.out_features)
        if key not in zeros:
            zeros[key] = torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)
        return zeros[key]

    def silu_mul_stub(self, x):  # FeedForward without silu and the product: its two matrices only
        gate, up = self.w_gate_up(x).split_with_sizes([self.ffn_dim, self.ffn_dim], dim=-1)
        return self.w_down(gate)

    kinds = (Int4Matmul, Int8Matmul, DenseMatmul)
    count = lambda *types: sum(isinstance(x, types) for x in m.modules())  # noqa: E731
    L = m.config.n_layers
    stubs = {  # name: [(owner, attribute, stand-in), ...]
        f"RMSNorm ({count(T.RMSNorm)} calls)": [(T.RMSNorm, "forward", lambda self, x: x)],
        f"RoPE ({L})": [(T, "apply_rope", lambda x, cos, sin: x)],
        f"fused attention ({L})": [(T.F, "scaled_dot_product_attention", lambda q, k, v, **kw: q)],
        f"KV cache write ({L})": [(T.LayerKV, "update", lambda self, start, k, v: (self.k[:, :, :start + 1],
                                                                                 self.v[:, :, :start + 1]))],
        f"act(gate) * up ({L})": [(T.FeedForward, "forward", silu_mul_stub)],
        f"matrix products ({count(*kinds)}: int4, int8 and bf16 parts)": [(k, "forward", product_stub) for k in kinds],
    }
    if hasattr(m.lm_head, "parts"):  # the head's share of the products
        stubs[f"of which the LM head ({m.lm_head.kernel})"] = [(m.lm_head, "forward", lambda x: product_stub(
            m.lm_head, x))]
    clock = time.process_time
    with torch.inference_mode():
        cache = m.new_cache(len(ids) + 2)
        m(torch.tensor([ids]), cache, 0, last_only=True)
        tok = torch.tensor([[ids[-1]]])

        def steps(n: int = 8) -> list[float]:
            out = []
            for _ in range(n):
                t = clock()
                m(tok, cache, len(ids), last_only=True)
                out.append(clock() - t)
            return out

        runs: dict[str, list[float]] = {n: [] for n in ["whole step", *stubs]}
        for r in range(rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                real = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in stubs.get(name, ())]
                for owner, attr, stub in stubs.get(name, ()):
                    setattr(owner, attr, stub)
                runs[name] += steps()
                for owner, attr, was in real:
                    if isinstance(owner, torch.nn.Module):
                        delattr(owner, attr)  # the instance's stand-in gone: its class's method again
                    else:
                        setattr(owner, attr, was)
    whole = statistics.median(runs["whole step"]) * 1e3
    print(f"\nin place (process CPU time, median of {len(runs['whole step'])} steps each): whole step {whole:.2f} ms")
    for name in stubs:
        print(f"  {name}: {whole - statistics.median(runs[name]) * 1e3:.2f} ms")


def profile_decode(lm, ids: list[int], level: str, steps: int, warm: int, compiled=None):
    """Run generate() with a recorder at `level`; profile the decode steps after `warm` of them."""
    window = {"start": 1 + warm, "end": 1 + warm + steps}
    prof = profile(activities=[ProfilerActivity.CPU])
    wall: list[float] = []
    null = open(os.devnull, "w")

    def sink(event: dict) -> None:  # the JSONL sink's work, to a file that discards it
        null.write(json.dumps(event, ensure_ascii=False, allow_nan=False) + "\n")

    class Timed(Recorder):
        def before_forward(self, step, phase, start, n_tokens):
            if step == window["start"]:
                prof.start()
            if window["start"] <= step < window["end"]:
                wall.append(time.perf_counter())
            super().before_forward(step, phase, start, n_tokens)

        def on_step(self, rec):
            super().on_step(rec)
            if window["start"] <= rec.step < window["end"]:
                wall[-1] = time.perf_counter() - wall[-1]
            if rec.step == window["end"] - 1:
                prof.stop()

    rec = Timed(TraceOptions(level=level), [sink], run_info={"prompt": ""})
    sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
    generate(lm, ids, sampler, window["end"] + 1, ignore_eos=True, observer=rec, compiled=compiled)
    events = prof.events()
    mm = sum(e.self_cpu_time_total for e in events if e.name in MATMUL_OPS) / 1e3 / steps
    aten = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::")) / 1e3 / steps
    n_ops = sum(1 for e in events if e.name.startswith("aten::")) / steps
    n_top = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None) / steps
    return {"wall_ms": statistics.median(wall) * 1e3, "matmul_ms": mm, "other_aten_ms": aten - mm,
            "aten_ops": n_ops, "top_level_aten_ops": n_top, "table": prof.key_averages()}


def decode_ms(lm, ids: list[int], steps: int, compiled=None) -> float:
    """Mean time of one untraced decode step (forward and greedy pick), no profiler."""
    result = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), steps + 1, ignore_eos=True,
                      compiled=compiled)
    return result.decode_s / steps * 1e3


def report(label: str, r: dict, ceil: float, args) -> None:
    python_ms = r["wall_ms"] - r["matmul_ms"] - r["other_aten_ms"]
    print(f"\n{label}: {r['wall_ms']:.1f} ms per decode step (median of {args.steps}, under the profiler)")
    print(f"  matrix products {r['matmul_ms']:.1f} ms ({r['matmul_ms'] / ceil:.2f}x the ceiling pass) | other aten ops "
          f"{r['other_aten_ms']:.1f} ms | outside aten {python_ms:.1f} ms")
    print(f"  aten ops per step: {r['aten_ops']:.0f} ({r['top_level_aten_ops']:.0f} called from Python)")
    print(r["table"].table(sort_by="self_cpu_time_total", row_limit=args.top))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12, help="rows of the per-op table to print")
    p.add_argument("--levels", nargs="*", default=["none", "full"])
    p.add_argument("--compiled", action="store_true", help="then compile the decode step (--compile) and profile it")
    p.add_argument("--fast", action="store_true", help="the --fast path (the model's GGUF, int4 kernels)")
    p.add_argument("-m", "--model", default=None, help="a registry name or GGUF file (default: the default model)")
    p.add_argument("--pieces", action="store_true", help="then each piece's cost in place (see above)")
    args = p.parse_args()
    set_threads(args.threads)
    how = {"fast": True} if args.fast else {"dtype": "float32"}
    lm = llmtrace.load(args.model, device="cpu", threads=args.threads, **how).loaded
    ids = lm.tokenizer.encode("Quantum mechanics is a fundamental theory in physics that " * 8)[:64]
    ceiling = int4_ceiling_ms if args.fast else ceiling_ms
    ceil, sustained = ceiling(lm.model)
    what = "the int4 products alone" if args.fast else "matrix-vector products over all weights"
    print(f"threads {args.threads}; ceiling ({what}): best of 30 passes {ceil:.1f} ms, "
          f"30 back to back {sustained:.1f} ms a pass")
    for level in args.levels:
        report(f"--trace {level}", profile_decode(lm, ids, level, args.steps, warm=4), ceil, args)
    if args.pieces:
        pieces(lm, ids)
    if args.compiled:
        from llmtrace.model.compiled import CompiledDecode
        from llmtrace.run.generate import compile_decode

        eager = [decode_ms(lm, ids, 32)]
        step = compile_decode(lm, len(ids), 64)
        print(f"\ncompiling the decode step: {step.compile_s:.1f} s")
        compiled = [decode_ms(lm, ids, 32, step)]
        for _ in range(2):  # alternate, so that drift on a shared machine cancels
            eager.append(decode_ms(lm, ids, 32))
            compiled.append(decode_ms(lm, ids, 32, step))
        ceil, sustained = ceiling(lm.model)
        e, c = statistics.median(eager), statistics.median(compiled)
        print(f"untraced decode step, no profiler (3 alternating runs of 32 steps, medians): eager {e:.1f} ms, compiled "
              f"{c:.1f} ms ({e / c:.2f}x); ceiling pass now {ceil:.1f} ms best, {sustained:.1f} ms back to back: "
              f"compiled step = {c / ceil:.2f}x the best pass, {c / sustained:.2f}x a sustained pass")
        # The C++ wrapper that --compile uses calls the matrix products and kernels where the profiler cannot see
        # them; for the profile, the same step is compiled with Inductor's Python wrapper and a record per kernel.
        torch._dynamo.reset()
        torch._inductor.config.cpp.enable_kernel_profile = True
        step = CompiledDecode(lm.model)
        step._fn = torch.compile(lm.model.forward, dynamic=True, fullgraph=True)  # without the C++ wrapper option
        print(f"\ncompiling it again with Inductor's Python wrapper, for the profile: "
              f"{first_compiled_step(lm, len(ids), step):.1f} s")
        report("--trace none, compiled decode step (Python wrapper)",
               profile_decode(lm, ids, "none", args.steps, warm=4, compiled=step), ceil, args)


def first_compiled_step(lm, n_prompt: int, step) -> float:
    """Run a freshly compiled step once on a scratch KV cache, as generate.compile_decode does; the compile happens
    here. Returns the seconds it took."""
    t = time.perf_counter()
    with torch.inference_mode():
        step(torch.zeros((1, 1), dtype=torch.long), lm.model.new_cache(n_prompt + 64), n_prompt)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
