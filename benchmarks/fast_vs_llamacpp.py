"""`--fast` against llama.cpp and the exact path on one GGUF file: decode and prefill tok/s, peak memory (issue 24).

    pip install xllamacpp            # llama.cpp's library as a prebuilt CPU wheel (benchmark only, not a dependency)
    python benchmarks/fast_vs_llamacpp.py                         # the default model (SmolLM2-135M Q4_1), 2 threads
    python benchmarks/fast_vs_llamacpp.py -m Llama-3.2-1B-Instruct.Q4_0.gguf --no-exact
    python benchmarks/fast_vs_llamacpp.py --json fast.json --rounds 3 --tokens 64

Arms, each in its own process, alternating round by round (A B C D, then D C B A, ...) so that a shared machine
slows them alike: llama.cpp (xllamacpp), llmtrace exact eager (float32), llmtrace --fast eager, llmtrace --fast
--compile, and the same with --freeze (the weights compiled into the step). Decode: greedy, --tokens new tokens after
a short prompt, EOS ignored; llama.cpp's figure is its own
`timings.predicted_per_second`, llmtrace's the summary's `decode_tok_s` (both: the steps after the first token).
Prefill: a --prefill-token prompt (real text, benchmarks/passage.txt), `timings.prompt_per_second` against the
summary's `prefill_tok_s`. Peak RSS (VmHWM) of each llmtrace process over its RSS when the load starts (Python, torch,
llmtrace and every module the run imports: the baseline), less the KV cache. torch is pinned to --threads (and OMP/MKL
threads).

--memory: only the peak RSS of each llmtrace arm (see `memory`), no llama.cpp needed.

--in-process: the decode arms alternate inside one process instead, --pairs times each (llama.cpp's server object,
llmtrace exact, --fast, --fast with the compiled step and --freeze), which cancels most of the drift of a shared
machine between processes; the figure of each arm is its median over the pairs, and each pair gives one ratio to
llama.cpp.
--in-process --no-llama-cpp: the llmtrace arms only. At 2 threads an idle xllamacpp server in the same process
slows torch's decode step ~1.8x (measured: --fast eager 16 ms a step without it, 29 ms with it, same process), so
llmtrace's own ratios (--fast eager / exact eager) at 2 threads are read from a run without it.

--llama-1b [FILE]: instead of -m, a Q4_0 file shaped like Llama-3.2-1B with random weights and a full 128,256-entry
vocabulary, made at run time by benchmarks/llama1b_gguf.py (gguf's writer and quantizer; tied head in Q6_K as
llama-quantize makes it, or --embd), into FILE (kept, and reused if it is there) or a temporary directory. Random
weights generate arbitrary tokens: EOS is ignored on both sides, and every run is checked to decode --tokens tokens.
The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Quantum mechanics is a fundamental theory in physics that"

LLAMA_CPP = r"""
import json, sys, xllamacpp
p = xllamacpp.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 2048
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[2])
server = xllamacpp.Server(p)
out = server.handle_completions({"prompt": sys.argv[3], "n_predict": int(sys.argv[4]), "temperature": 0,
                                 "cache_prompt": False, "ignore_eos": True})
t = out["timings"]
print(json.dumps({"decode_tok_s": t["predicted_per_second"], "prefill_tok_s": t["prompt_per_second"],
                  "prompt_tokens": t["prompt_n"], "predicted_n": t["predicted_n"]}))
"""

# llama.cpp through llama-cpp-python, for a build of one's own (an AVX2-only one: fast_arms.py --llamacpp-avx2): greedy
# decode of n tokens after the prompt, EOS ignored, llama.cpp's own timing of its decode calls (llama_perf_context:
# t_eval_ms over n_eval one-token evaluations, the first after the prompt not counted by llama.cpp, so n + 1 are made;
# the argmax in Python between them is left out). `system` is the build's
# own line of the instruction sets it was compiled for (AVX512 = 0 in an AVX2-only build).
LLAMA_CPP_PYTHON = r"""
import json, sys
import numpy as np
import llama_cpp
path, threads, prompt, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = llm.tokenize(prompt.encode(), add_bos=True)
llama_cpp.llama_perf_context_reset(llm.ctx)
llm.eval(ids)
vocab = llm.n_vocab()
for _ in range(n + 1):  # the last position's logits, as llama.cpp left them; its timing counts all but the first
    llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))])
perf = llama_cpp.llama_perf_context(llm.ctx)
print(json.dumps({"decode_tok_s": 1e3 * perf.n_eval / perf.t_eval_ms, "prefill_tok_s": 1e3 * perf.n_p_eval / perf.t_p_eval_ms,
                  "prompt_tokens": len(ids), "predicted_n": perf.n_eval, "build": "llama-cpp-python " + llama_cpp.__version__,
                  "system": llama_cpp.llama_print_system_info().decode()}))
"""

LLMTRACE = r"""
import json, sys
from pathlib import Path
def hwm(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def library_pages():  # resident pages of shared libraries' files (code and read-only data, mapped on first use)
    total, lib = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and not head[0].endswith(":"):
            lib = len(head) > 5 and ".so" in head[5]
        elif lib and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total
import torch, llmtrace.checkpoint.load, llmtrace.run.generate  # the RSS after these imports: "baseline_rss"
base = hwm("VmRSS:")
at_load = {}
load_model = llmtrace.checkpoint.load.load_model
def measured_load(*args, **kwargs):  # the RSS when the load starts: Python, torch and every module the run imports
    at_load.update(rss=hwm("VmRSS:"), libs=library_pages())
    return load_model(*args, **kwargs)
llmtrace.checkpoint.load.load_model = measured_load
from llmtrace.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    if e.code:
        raise
print(json.dumps({"peak_rss": hwm("VmHWM:"), "baseline_rss": base, "load_start_rss": at_load["rss"],
                  "library_pages_added": library_pages() - at_load["libs"], "end_anon": hwm("RssAnon:"),
                  "end_file": hwm("RssFile:")}), file=sys.stderr)
"""


def llama_cpp(gguf: str, threads: int, prompt: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", LLAMA_CPP, gguf, str(threads), prompt, str(tokens)],
                          capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    decoded(out["predicted_n"], tokens, "llama.cpp")
    return out


def llama_cpp_python(python: str, gguf: str, threads: int, prompt: str, tokens: int) -> dict:
    """llama.cpp through llama-cpp-python installed for the interpreter PYTHON (a build of one's own), pinned to
    `threads` (OMP_NUM_THREADS too: an OpenMP build spins that many)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([python, "-c", LLAMA_CPP_PYTHON, gguf, str(threads), prompt, str(tokens)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{python}: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    decoded(out["predicted_n"], tokens, "llama.cpp (" + python + ")")
    return out


def decoded(n: int, tokens: int, arm: str) -> None:
    """Both sides must decode the same number of tokens (EOS ignored), or their rates measure different work."""
    if n != tokens:
        raise RuntimeError(f"{arm} decoded {n} tokens, not {tokens}")


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def llmtrace(gguf: str, threads: int, prompt: str, tokens: int, *extra: str) -> dict:
    argv = ["generate", prompt, "-m", gguf, "-n", str(tokens), "--trace", "none", "--ignore-eos", "--threads",
            str(threads), "--jsonl", "-", *extra]
    proc = subprocess.run([sys.executable, "-c", LLMTRACE, *argv], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    lines = proc.stdout.strip().splitlines()
    run, summary = json.loads(lines[0]), json.loads(lines[-1])
    decoded(summary["generated_tokens"], tokens, "llmtrace " + " ".join(extra))
    mem = json.loads(proc.stderr.strip().splitlines()[-1])
    m = run["model"]
    slots = summary["prompt_tokens"] + tokens  # the cache the loop allocates: prompt + new tokens
    kv_bytes = 2 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * (2 if run["dtype"] == "bfloat16" else 4) * slots
    return {"decode_tok_s": summary["decode_tok_s"], "prefill_tok_s": summary["prefill_tok_s"],
            "prompt_tokens": summary["prompt_tokens"], **mem, "kv_bytes": kv_bytes,
            "kernels": sorted({r.get("kernel") for r in run["model"]["storage"] if r.get("kernel")}),
            "kernel_choice": (run.get("fast") or {}).get("kernel_choice")}


def long_prompt(gguf: str, n: int) -> str:
    """The first n tokens of benchmarks/passage.txt (repeated as needed), as text."""
    from llmtrace.checkpoint.gguf_file import open_gguf
    from llmtrace.tokens.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(open_gguf(gguf))
    text = (HERE / "passage.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return tok.decode(ids[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the default model's, from llmtrace's cache)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-exact", action="store_true", help="leave out the exact float32 arm (slow on big files)")
    ap.add_argument("--in-process", action="store_true", help="decode arms alternating in one process (see above)")
    ap.add_argument("--pairs", type=int, default=6, help="alternations of --in-process")
    ap.add_argument("--no-llama-cpp", action="store_true", help="--in-process without the llama.cpp arm (see above)")
    ap.add_argument("--memory", action="store_true",
                    help="only the peak RSS of --fast and --keep-quantized (and the exact path unless --no-exact), "
                         "one fresh process each, for a short and a --prefill-token prompt (no llama.cpp)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--llama-1b", nargs="?", const="", metavar="FILE",
                    help="make a Llama-3.2-1B-shaped Q4_0 file (see above) into FILE, or a temporary directory")
    ap.add_argument("--embd", default="Q6_K", choices=["Q6_K", "Q8_0", "Q4_0"], help="--llama-1b's tied head type")
    ap.add_argument("--seed", type=int, default=0, help="--llama-1b's weights and synthetic merges")
    args = ap.parse_args()
    try:
        if not (args.memory or args.no_llama_cpp):
            import xllamacpp  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs llama.cpp's library: pip install xllamacpp")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="llama-1b-shape-") as tmp:
        gguf = args.model
        if args.llama_1b is not None:
            gguf = made_1b(args, Path(args.llama_1b) if args.llama_1b else Path(tmp) / "llama-1b-shape.Q4_0.gguf")
        elif gguf is None:
            from llmtrace.registry.resolve import resolve

            gguf = str(resolve(None).path)
        print(f"load average before: {load_average()}", file=sys.stderr, flush=True)
        (in_process if args.in_process else memory if args.memory else run)(args, gguf)
        print(f"load average after: {load_average()}", file=sys.stderr, flush=True)


def made_1b(args, path: Path) -> str:
    """benchmarks/llama1b_gguf.py's file at `path` (written unless it is there), its size printed."""
    sys.path.insert(0, str(HERE))
    import llama1b_gguf

    if path.exists():
        print(f"reusing {path} (delete it to make it again)", file=sys.stderr)
    else:
        llama1b_gguf.write(path, args.seed, args.embd, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{path}: {path.stat().st_size:,} bytes", file=sys.stderr, flush=True)
    return str(path)


def memory(args, gguf: str) -> None:
    """Peak RSS (VmHWM) of each llmtrace arm in a fresh process, over the RSS when the load starts (Python, torch and
    every module the run imports: the baseline), less the KV cache, as a multiple of the GGUF file's size. Shared
    libraries' pages that torch and tokenizers map on first use (code, not data) are part of the peak; the column
    beside it gives the figure without them."""
    size = os.path.getsize(gguf)
    arms = {"--fast": ("--fast",), "--keep-quantized": ("--keep-quantized",)}
    if not args.no_exact:
        arms["exact (float32)"] = ()
    prompts = {f"{PROMPT!r}, {args.tokens} tokens": (PROMPT, args.tokens)}
    if args.prefill:
        prompts[f"{args.prefill}-token prompt, 2 tokens"] = (long_prompt(gguf, args.prefill), 2)
    out = {"gguf": os.path.basename(gguf), "gguf_bytes": size, "threads": args.threads, "runs": []}
    mib = 2**20
    print(f"{out['gguf']}: {size / mib:.1f} MiB; target (issue 24): peak − baseline − KV ≤ 1.3× the file")
    print("| arm | run | peak − baseline (MiB) | KV cache (MiB) | (peak − baseline − KV) / file | library pages "
          "added (MiB) | without them / file | RSS at load start (MiB) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, extra in arms.items():
        for label, (prompt, tokens) in prompts.items():
            r = llmtrace(gguf, args.threads, prompt, tokens, *extra)
            grew = r["peak_rss"] - r["load_start_rss"]
            ratio = (grew - r["kv_bytes"]) / size
            bare = (grew - r["kv_bytes"] - r["library_pages_added"]) / size
            out["runs"].append({"arm": name, "run": label, **r, "ratio": ratio, "ratio_without_library_pages": bare})
            print(f"| {name} | {label} | {grew / mib:.1f} | {r['kv_bytes'] / mib:.2f} | {ratio:.2f}× | "
                  f"{r['library_pages_added'] / mib:.1f} | {bare:.2f}× | {r['load_start_rss'] / mib:.0f} |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def in_process(args, gguf: str) -> None:
    """Decode tok/s of the four arms, alternating in this process (order reversed every other pair)."""
    import torch

    from llmtrace.checkpoint.devices import set_threads
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.run.generate import compile_decode, generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    set_threads(args.threads)
    server = None
    if not args.no_llama_cpp:
        import xllamacpp

        p = xllamacpp.CommonParams()
        p.model.path = gguf
        p.n_ctx = 1024
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = args.threads
        server = xllamacpp.Server(p)
    exact = None if args.no_exact else llmtrace.load(gguf, device="cpu", dtype="float32",
                                                     threads=args.threads).loaded
    fast = llmtrace.load(gguf, device="cpu", fast=True, threads=args.threads).loaded
    ids = fast.tokenizer.encode(PROMPT)
    compiled = compile_decode(fast, len(ids), args.tokens, freeze=True)

    def llmtrace_arm(lm, comp=None):
        res = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), args.tokens,
                       ignore_eos=True, compiled=comp)
        decoded(len(res.tokens), args.tokens, "llmtrace")
        return res.decode_tok_s

    def llama_arm():
        out = server.handle_completions({"prompt": PROMPT, "n_predict": args.tokens, "temperature": 0,
                                         "cache_prompt": False, "ignore_eos": True})
        decoded(out["timings"]["predicted_n"], args.tokens, "llama.cpp")
        return out["timings"]["predicted_per_second"]

    arms = {} if server is None else {"llama.cpp": llama_arm}
    if exact is not None:
        arms["exact eager (float32)"] = lambda: llmtrace_arm(exact)
    arms["--fast eager"] = lambda: llmtrace_arm(fast)
    arms["--fast --compile --freeze"] = lambda: llmtrace_arm(fast, compiled)
    names = list(arms)
    for fn in arms.values():  # warm-up
        fn()
    runs: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            runs[name].append(arms[name]())
        print(f"pair {i + 1}: " + ", ".join(f"{n} {runs[n][-1]:.2f}" for n in names), file=sys.stderr, flush=True)
    ref = runs.get("llama.cpp") or runs[names[0]]  # without llama.cpp: ratios to the first llmtrace arm
    base = statistics.median(ref)
    out = {"gguf": os.path.basename(gguf), "threads": args.threads, "tokens": args.tokens, "pairs": args.pairs,
           "capability": torch.backends.cpu.get_cpu_capability(), "mode": "in-process", "arms": {},
           "gguf_bytes": os.path.getsize(gguf), "load_average": load_average(),
           "fast": fast.config.extra.get("fast")}
    print(f"\n{out['gguf']}, in one process, {args.tokens} tokens, {args.threads} threads, capability "
          f"{out['capability']}, median of {args.pairs} alternations (per-pair ratios to {names[0]} in brackets)")
    print(f"| arm | decode tok/s | / {names[0]} |\n| --- | ---: | ---: |")
    for name in names:
        d = statistics.median(runs[name])
        ratios = [a / b for a, b in zip(runs[name], ref)]
        out["arms"][name] = {"decode_tok_s": d, "decode_ratio": d / base, "runs": runs[name],
                             "ratios_per_pair": ratios}
        print(f"| {name} | {d:.2f} | {statistics.median(ratios):.2f}× ({' '.join(f'{r:.2f}' for r in ratios)}) |")
    if exact is not None:
        r = [a / b for a, b in zip(runs["--fast eager"], runs["exact eager (float32)"])]
        out["fast_eager_over_exact_eager"] = r
        print(f"--fast eager / exact eager decode: {statistics.median(r):.2f}× ({' '.join(f'{x:.2f}' for x in r)})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def run(args, gguf: str) -> None:
    import torch

    arms = {"llama.cpp": lambda p, n: llama_cpp(gguf, args.threads, p, n)}
    if not args.no_exact:
        arms["exact eager (float32)"] = lambda p, n: llmtrace(gguf, args.threads, p, n)
    arms["--fast eager"] = lambda p, n: llmtrace(gguf, args.threads, p, n, "--fast")
    arms["--fast --compile"] = lambda p, n: llmtrace(gguf, args.threads, p, n, "--fast", "--compile")
    arms["--fast --compile --freeze"] = lambda p, n: llmtrace(gguf, args.threads, p, n, "--fast", "--compile",
                                                              "--freeze")
    llmtrace(gguf, args.threads, PROMPT, 4, "--fast", "--compile")  # fills Inductor's cache: later compiles take s
    names = list(arms)
    decode: dict[str, list[dict]] = {n: [] for n in names}
    prefill: dict[str, list[dict]] = {n: [] for n in names}
    long = long_prompt(gguf, args.prefill) if args.prefill else None
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            decode[name].append(arms[name](PROMPT, args.tokens))
            print(f"round {r + 1}: {name}: decode {decode[name][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr,
                  flush=True)
            if long is not None and "--compile" not in name:  # the compiled step is a decode step only
                prefill[name].append(arms[name](long, 2))
                print(f"round {r + 1}: {name}: prefill {prefill[name][-1]['prefill_tok_s']:.1f} tok/s",
                      file=sys.stderr, flush=True)
    size = os.path.getsize(gguf)
    out = {"gguf": os.path.basename(gguf), "gguf_bytes": size, "threads": args.threads, "tokens": args.tokens,
           "rounds": args.rounds, "capability": torch.backends.cpu.get_cpu_capability(), "arms": {},
           "load_average": load_average()}
    base = statistics.median(x["decode_tok_s"] for x in decode["llama.cpp"])
    base_pre = statistics.median(x["prefill_tok_s"] for x in prefill["llama.cpp"]) if long else None
    print(f"\n{out['gguf']} ({size / 2**20:.0f} MiB), {args.tokens} tokens, {args.threads} threads, capability "
          f"{out['capability']}, median of {args.rounds} rounds (per-round ratios to llama.cpp in brackets)")
    print("| arm | decode tok/s | / llama.cpp | prefill tok/s | / llama.cpp | peak RSS − baseline (MiB) | / GGUF |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        d = statistics.median(x["decode_tok_s"] for x in decode[name])
        ratios = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(decode[name], decode["llama.cpp"])]
        row = {"decode_tok_s": d, "decode_ratio": d / base, "decode_ratios_per_round": ratios,
               "runs": decode[name] + prefill[name]}
        pre = "–"
        pre_ratio = "–"
        if prefill[name]:
            p = statistics.median(x["prefill_tok_s"] for x in prefill[name])
            row |= {"prefill_tok_s": p, "prefill_ratio": p / base_pre,
                    "prefill_prompt_tokens": prefill[name][0]["prompt_tokens"]}
            pre, pre_ratio = f"{p:.1f}", f"{p / base_pre:.2f}×"
        mem = "–"
        mem_ratio = "–"
        if "peak_rss" in decode[name][0]:
            extra = max(x["peak_rss"] - x["load_start_rss"] for x in decode[name])
            kv = decode[name][0]["kv_bytes"] or 0
            row |= {"peak_minus_baseline": extra, "kv_bytes": kv, "rss_ratio": (extra - kv) / size,
                    "kernels": decode[name][0]["kernels"], "kernel_choice": decode[name][0]["kernel_choice"]}
            mem, mem_ratio = f"{extra / 2**20:.0f}", f"{(extra - kv) / size:.2f}×"
        out["arms"][name] = row
        rr = " ".join(f"{x:.2f}" for x in ratios)
        print(f"| {name} | {d:.1f} | {d / base:.2f}× ({rr}) | {pre} | {pre_ratio} | {mem} | {mem_ratio} |")
    if "exact eager (float32)" in out["arms"]:
        e = out["arms"]["exact eager (float32)"]["decode_tok_s"]
        print(f"--fast eager / exact eager decode: {out['arms']['--fast eager']['decode_tok_s'] / e:.2f}×")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
