"""Gemma 3 270M decode speed against llama.cpp on the same GGUF, beside the default Llama-family model (issue 32).

    pip install xllamacpp            # llama.cpp's library as a prebuilt CPU wheel (benchmark only, not a dependency)
    python benchmarks/gemma3_vs_llamacpp.py                   # 2 threads, 32 tokens, 3 rounds
    python benchmarks/gemma3_vs_llamacpp.py --threads 1 --rounds 5 --no-smollm

The question: does a new family cost about what Llama costs? Each model (gemma3-270m from the registry, and the
default SmolLM2-135M unless --no-smollm) runs greedy decoding of the same prompt, --tokens new tokens with EOS
ignored, in four arms, each in its own process: llama.cpp (xllamacpp), llmtrace float32 (the exact path), llmtrace
--keep-quantized and llmtrace --fast. Arms alternate round by round (A B C D, then D C B A, ...) so that a shared
machine slows them alike; threads are pinned (torch, OMP and MKL, llama.cpp's n_threads). llama.cpp's figure is its
own `timings.predicted_per_second`, llmtrace's the summary's `decode_tok_s` (both: the steps after the first token).
Each arm's figure is its median over the rounds; the ratios to llama.cpp are of the medians of this one run.

The table also gives each arm's decode time per token per million weights (ms / tok / M), which compares models of
different sizes: the two families' figures on the same arm say whether Gemma costs what Llama costs per weight.
Arm helpers come from benchmarks/fast_vs_llamacpp.py (its subprocess runners and checks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "The history of the printing press begins"
ARMS = {"llama.cpp": None, "llmtrace float32": (), "llmtrace --keep-quantized": ("--keep-quantized",),
        "llmtrace --fast": ("--fast",)}


def run_model(name: str, gguf: str, args) -> dict:
    """Each arm's decode tok/s over the rounds, the arms alternating (forward, then backward)."""
    sys.path.insert(0, str(HERE))
    from fast_vs_llamacpp import llama_cpp, llmtrace, load_average

    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    order = list(ARMS)
    for r in range(args.rounds):
        for arm in (order if r % 2 == 0 else order[::-1]):
            extra = ARMS[arm]
            out = (llama_cpp(gguf, args.threads, PROMPT, args.tokens) if extra is None
                   else llmtrace(gguf, args.threads, PROMPT, args.tokens, *extra))
            runs[arm].append(out["decode_tok_s"])
            print(f"{name} round {r + 1}: {arm}: {runs[arm][-1]:.2f} tok/s (load {load_average()})",
                  file=sys.stderr, flush=True)
    return runs


def weights(gguf: str) -> int:
    """The model's weight count, as llmtrace counts it (the run header's params)."""
    from llmtrace.checkpoint.gguf_checkpoint import open_gguf_checkpoint
    from llmtrace.checkpoint.placement import weight_count

    return weight_count(open_gguf_checkpoint(Path(gguf)).config)


def table(name: str, runs: dict, n_weights: int) -> list[str]:
    base = statistics.median(runs["llama.cpp"])
    out = [f"| {name} | arm | decode tok/s (median) | / llama.cpp | ms / tok / M weights | rounds |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
    for arm, values in runs.items():
        m = statistics.median(values)
        per = 1000 / m / (n_weights / 1e6)
        out.append(f"| | {arm} | {m:.1f} | {m / base:.2f}× | {per:.3f} | {' '.join(f'{v:.1f}' for v in values)} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-smollm", action="store_true", help="Gemma 3 only")
    ap.add_argument("--json", type=Path, help="the runs as JSON")
    args = ap.parse_args()
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs llama.cpp's library: pip install xllamacpp")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    from llmtrace.registry.resolve import resolve

    models = {"gemma3-270m": str(resolve("gemma3-270m").path)}
    if not args.no_smollm:
        models["smollm2-135m-instruct"] = str(resolve(None).path)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr, flush=True)
    found = {name: (run_model(name, gguf, args), weights(gguf)) for name, gguf in models.items()}
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr, flush=True)
    print(f"\n{args.tokens} tokens after {PROMPT!r}, greedy, EOS ignored, {args.threads} thread(s), "
          f"{args.rounds} rounds, arms alternating")
    for name, (runs, n) in found.items():
        print("\n".join(table(f"{name} ({n / 1e6:.0f}M weights)", runs, n)))
    if args.json:
        args.json.write_text(json.dumps({name: {"runs": runs, "weights": n} for name, (runs, n) in found.items()},
                                        indent=1))


if __name__ == "__main__":
    main()
