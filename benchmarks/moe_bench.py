"""A mixture of experts' decode speed against llama.cpp, and what the router ledger costs at --trace layers (issue 33).

    pip install xllamacpp                      # llama.cpp's library as a prebuilt CPU wheel (benchmark only)
    python benchmarks/moe_bench.py --threads 1 --tokens 32 --rounds 3
    python benchmarks/moe_bench.py -m moe.gguf --only ledger      # a file made before (benchmarks/moe_gguf.py)

The file is a Q8_0 Qwen3-MoE-shaped GGUF with random weights (benchmarks/moe_gguf.py: 8 layers, 32 experts a layer, 4
a token), written to a temporary directory at run time unless -m names one.

decode: each arm generates --tokens greedy tokens of the same prompt in its own process, the arms alternating round by
round so that a busy machine slows them alike: llama.cpp (its `timings.predicted_per_second`), llmtrace's exact path
(float32, the conversion cached by one untimed run first), --keep-quantized (the experts stay Q8_0 blocks) and --fast
(int4 kernels, bfloat16); llmtrace's figure is the summary's `decode_tok_s` (steps after the first, untraced). The
median of each arm, its ratio to llama.cpp, and whether its greedy tokens are llama.cpp's.

ledger: one process, the exact path, --trace steps, then --trace layers with the routing events switched off (the
recorder's ROUTING emptied: the MoE layers still report their points to the recorder), then --trace layers as it is,
in turn (reversed every other round), --pairs times; every event encoded and written to /dev/null as --jsonl does.
The routing event's cost is the third against the second; its bytes are the JSONL lines it adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Quantum mechanics is a fundamental theory in physics that describes nature at the smallest scales"

LLAMA_CPP = r"""
import json, sys, xllamacpp
p = xllamacpp.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 1024
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[2])
server = xllamacpp.Server(p)
out = server.handle_completions({"prompt": sys.argv[3], "n_predict": int(sys.argv[4]), "temperature": 0,
                                 "cache_prompt": False, "ignore_eos": True})
print(json.dumps({"decode_tok_s": out["timings"]["predicted_per_second"], "text": out["choices"][0]["text"],
                  "prompt_tokens": out["usage"]["prompt_tokens"]}))
"""


def llama_cpp(gguf: str, threads: int, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", LLAMA_CPP, gguf, str(threads), PROMPT, str(tokens)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llmtrace(gguf: str, threads: int, tokens: int, *extra: str) -> dict:
    argv = [sys.executable, "-m", "llmtrace", "generate", PROMPT, "-m", gguf, "-n", str(tokens), "--trace", "none",
            "--ignore-eos", "--threads", str(threads), "--jsonl", "-", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"decode_tok_s": summary["decode_tok_s"], "text": summary["text"], "prompt_tokens": summary["prompt_tokens"]}


ARMS = {"llama.cpp": lambda g, t, n: llama_cpp(g, t, n), "llmtrace": lambda g, t, n: llmtrace(g, t, n),
        "llmtrace --keep-quantized": lambda g, t, n: llmtrace(g, t, n, "--keep-quantized"),
        "llmtrace --fast": lambda g, t, n: llmtrace(g, t, n, "--fast")}


def decode(gguf: str, args) -> None:
    llmtrace(gguf, args.threads, 2)  # untimed: the float32 conversion is cached once, as a user's first run does
    rates: dict[str, list[float]] = {a: [] for a in ARMS}
    texts: dict[str, str] = {}
    names = list(ARMS)
    for r in range(args.rounds):
        for arm in names if r % 2 == 0 else names[::-1]:
            out = ARMS[arm](gguf, args.threads, args.tokens)
            rates[arm].append(out["decode_tok_s"])
            texts[arm] = out["text"]
            print(f"  round {r + 1} {arm}: {out['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    ref = statistics.median(rates["llama.cpp"])
    print(f"\ndecode, {args.tokens} tokens greedy, {args.threads} thread(s), median of {args.rounds} rounds:")
    print("| arm | tok/s | / llama.cpp | greedy text = llama.cpp's |\n| --- | ---: | ---: | --- |")
    for arm in names:
        same = "—" if arm == "llama.cpp" else _same(texts[arm], texts["llama.cpp"])
        med = statistics.median(rates[arm])
        print(f"| {arm} | {med:.2f} | {med / ref:.2f}× | {same} |")


def _same(ours: str, theirs: str) -> str:
    """'all', or how many characters of the text agree (random weights give near-uniform logits, whose ties
    llama.cpp's 8-bit activations can break otherwise)."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return "all" if n == len(ours) == len(theirs) else f"the first {n} of {len(theirs)} characters"


def ledger(gguf: str, args) -> None:
    """The routing event's cost at --trace layers, in one process (the module's docstring)."""
    from llmtrace.checkpoint.devices import set_threads
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig
    from llmtrace.trace import recorder as recorder_module
    from llmtrace.trace.options import TraceOptions
    from llmtrace.trace.recorder import Recorder

    set_threads(args.threads)
    lm = llmtrace.load(gguf, device="cpu", dtype="float32", threads=args.threads).loaded
    ids = lm.tokenizer.encode_prompt(PROMPT)[1]
    routing = recorder_module.ROUTING

    def one(arm: str) -> tuple[float, int]:
        level, on = {"steps": ("steps", True), "layers, no routing": ("layers", False),
                     "layers": ("layers", True)}[arm]
        recorder_module.ROUTING = routing if on else ()
        sizes = []

        def count(ev: dict) -> None:
            if ev.get("event") == "routing":
                sizes.append(len(json.dumps(ev, ensure_ascii=False)) + 1)

        from llmtrace.trace.writers import JsonlWriter

        rec = Recorder(TraceOptions(level=level), [JsonlWriter(os.devnull), count], run_info={"prompt": PROMPT})
        sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
        t = time.perf_counter()
        result = generate(lm, ids, sampler, args.tokens, ignore_eos=True, observer=rec)
        elapsed = time.perf_counter() - t
        recorder_module.ROUTING = routing
        return elapsed / max(1, len(result.tokens)), sum(sizes)

    arms = ["steps", "layers, no routing", "layers"]
    for arm in arms:
        one(arm)  # warm-up
    per_token: dict[str, list[float]] = {a: [] for a in arms}
    size = 0
    for r in range(args.pairs):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            s, n = one(arm)
            per_token[arm].append(s)
            size = max(size, n)
    med = {a: statistics.median(v) * 1e3 for a, v in per_token.items()}
    print(f"\nthe router ledger, exact path, {args.tokens} tokens, {args.threads} thread(s), median of {args.pairs}:")
    print("| trace | ms per token | / steps |\n| --- | ---: | ---: |")
    for a in arms:
        print(f"| {a} | {med[a]:.2f} | {med[a] / med['steps']:.2f}× |")
    cost = med["layers"] - med["layers, no routing"]
    share = cost / med["layers, no routing"]
    print(f"\nrouting events: {cost:+.2f} ms a token ({share:+.1%} of --trace layers without "
          f"them); {size:,} bytes of JSONL for {len(ids)} prompt tokens + {args.tokens} steps × "
          f"{lm.config.n_layers} layers")


def main() -> None:
    sys.path.insert(0, str(HERE))
    from moe_gguf import shape_args, shape_of, write

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="a MoE GGUF file (default: benchmarks/moe_gguf.py's, made at run time)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=4, help="alternations of the ledger arm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["decode", "ledger"], help="run one of the two measurements")
    shape_args(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        gguf = args.model or str(write(Path(tmp) / "moe.Q8_0.gguf", shape_of(args), args.seed,
                                       log=lambda m: print(m, file=sys.stderr)))
        env_home = os.environ.setdefault("LLMTRACE_HOME", str(Path(tmp) / "home"))  # the conversion stays in tmp
        print(f"file {gguf}; llmtrace home {env_home}", file=sys.stderr)
        if args.only in (None, "decode"):
            decode(gguf, args)
        if args.only in (None, "ledger"):
            ledger(gguf, args)


if __name__ == "__main__":
    main()
