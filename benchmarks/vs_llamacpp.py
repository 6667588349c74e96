"""Decode speed on one GGUF file: llama.cpp against llmtrace's float32 path and its --keep-quantized path.

    pip install xllamacpp            # llama.cpp's library as a prebuilt CPU wheel (benchmark only, not a dependency)
    python benchmarks/vs_llamacpp.py                     # the default model (SmolLM2-135M Q4_1), 1 thread
    python benchmarks/vs_llamacpp.py -m model.gguf --tokens 64 --rounds 3 --threads 2

Each arm runs greedy decoding of the same prompt for --tokens new tokens, in its own process, and the arms alternate
round by round so that a busy machine slows them alike. llama.cpp's figure is its own `timings.predicted_per_second`
(the decode steps after the prompt); llmtrace's is the summary's `decode_tok_s` (the same: steps after the first
token, untraced). The table gives each arm's median over the rounds and its ratio to llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPT = "Quantum mechanics is a fundamental theory in physics that"

LLAMA_CPP = r"""
import json, sys, xllamacpp
p = xllamacpp.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 1024
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[2])
server = xllamacpp.Server(p)
out = server.handle_completions({"prompt": sys.argv[3], "n_predict": int(sys.argv[4]), "temperature": 0,
                                 "cache_prompt": False})
print(json.dumps({"decode_tok_s": out["timings"]["predicted_per_second"]}))
"""


def llama_cpp(gguf: str, threads: int, tokens: int) -> float:
    proc = subprocess.run([sys.executable, "-c", LLAMA_CPP, gguf, str(threads), PROMPT, str(tokens)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_tok_s"]


def llmtrace(gguf: str, threads: int, tokens: int, *extra: str) -> float:
    argv = [sys.executable, "-m", "llmtrace", "generate", PROMPT, "-m", gguf, "-n", str(tokens), "--trace", "none",
            "--ignore-eos", "--threads", str(threads), "--jsonl", "-", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the default model's, from llmtrace's cache)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs llama.cpp's library: pip install xllamacpp")
    gguf = args.model
    if gguf is None:
        from llmtrace.registry.resolve import resolve

        gguf = str(resolve(None).path)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    arms = {
        "llama.cpp (xllamacpp)": lambda: llama_cpp(gguf, args.threads, args.tokens),
        "llmtrace float32": lambda: llmtrace(gguf, args.threads, args.tokens),
        "llmtrace --keep-quantized": lambda: llmtrace(gguf, args.threads, args.tokens, "--keep-quantized"),
    }
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, arm in arms.items():
            runs[name].append(arm())
            print(f"round {r + 1}: {name}: {runs[name][-1]:.2f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(runs["llama.cpp (xllamacpp)"])
    print(f"\n{os.path.basename(gguf)}, {args.tokens} tokens, {args.threads} thread(s), median of {args.rounds} rounds")
    print(f"| arm | decode tok/s | / llama.cpp |\n| --- | ---: | ---: |")
    for name, values in runs.items():
        m = statistics.median(values)
        print(f"| {name} | {m:.2f} | {m / base:.2f}× |")


if __name__ == "__main__":
    main()
