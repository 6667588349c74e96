"""Every arm of issue 51 in one run, alternating, under torch's default CPU capability and held to AVX2.

    pip install xllamacpp                      # llama.cpp's library (benchmark only; without it that arm is left out)
    python benchmarks/fast_arms.py --out fast_arms.md            # 2 threads, 3 rounds, 32 tokens, both capabilities
    python benchmarks/fast_arms.py --capabilities avx2 --models gemma3 --rounds 2 --no-extra
    python benchmarks/moe_gguf.py /tmp/moe.Q8_0.gguf && python benchmarks/fast_arms.py --models /tmp/moe.Q8_0.gguf

For each capability (`default`: what torch dispatches on this CPU; `avx2`: ATEN_CPU_CAPABILITY=avx2, torch's AVX2
kernels on the same machine) and each model (SmolLM2-135M Q4_1, the default; the real Gemma 3 270M Q4_K_M):

- **decode arms**, each a fresh process, greedy decode of --tokens tokens after a short prompt, EOS ignored, the arms
  alternating round by round (A B C ..., then ... C B A) so that a shared machine slows them alike: llama.cpp
  (xllamacpp, its own `predicted_per_second`), llmtrace exact float32, `--fast` eager, `--fast --compile`,
  `--keep-quantized` (llmtrace's summary `decode_tok_s`). The table gives each arm's median over the rounds, its
  ratio to llama.cpp per round (median and spread), and the kernels each --fast run chose (its `run` event).
  llama.cpp dispatches its own kernels: ATEN_CPU_CAPABILITY holds torch, not llama.cpp, so xllamacpp's figure is
  this CPU's best (its AVX-512 code, on an AVX-512 CPU) under both capabilities. `--llamacpp-avx2 PYTHON` gives an
  interpreter with llama-cpp-python built for AVX2 without AVX-512 (below): under the avx2 capability that build is
  the llama.cpp arm, the baseline of the ratios, and xllamacpp runs beside it as `llama.cpp (xllamacpp)`; each table
  says which build its llama.cpp arm is, with the instruction sets the build reports.
- **trace** (default model, exact float32, one process): `--trace steps` and `--trace full` against `--trace none`,
  one --tokens generation each in turn, --pairs times (benchmarks/_arms.py's `overhead` arm): untraced step time /
  traced step time per pair.
- **batch** (default model, exact float32, one process): 16 prompts as one batch against the same 16 one after another,
  in turn, --pairs times (`_arms.py batch`): aggregate decode tok/s and their ratio per pair.

torch and OpenMP are pinned to --threads in every process, as is llama.cpp. The table is written to --out (markdown)
and the figures to --json; progress goes to stderr with the load average.

An AVX2-only llama.cpp (what a CPU without AVX-512 runs), in a virtual environment of its own (about 25 minutes of
two busy cores):

    python -m venv /work/venv-llamacpp-avx2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
      -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
      /work/venv-llamacpp-avx2/bin/pip install --no-binary :all: llama-cpp-python numpy
    python benchmarks/fast_arms.py --llamacpp-avx2 /work/venv-llamacpp-avx2/bin/python --out fast_arms.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Quantum mechanics is a fundamental theory in physics that"
MODELS = {"smollm2": None, "gemma3": "gemma3-270m"}  # registry names (None: the default model)
XLLAMACPP = "llama.cpp (xllamacpp)"  # the wheel's build beside one's own (--llamacpp-avx2)
ARMS = {"llama.cpp": None, "exact float32": (), "--fast": ("--fast",), "--fast --compile": ("--fast", "--compile"),
        "--keep-quantized": ("--keep-quantized",)}


def capability_env(cap: str) -> dict:
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap != "default":
        env["ATEN_CPU_CAPABILITY"] = cap
    return env


def torch_capability(env: dict) -> str:
    """The capability torch dispatches in a process with this environment."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def decode_arms(gguf: str, args, env: dict, have_llama: bool, own_build: str = "") -> dict[str, list[dict]]:
    """Each arm's runs over the rounds (dicts with decode_tok_s and, for llmtrace, its kernels). `own_build`: an
    interpreter whose llama-cpp-python is the llama.cpp arm (xllamacpp then runs as `llama.cpp (xllamacpp)`)."""
    from fast_vs_llamacpp import llama_cpp, llama_cpp_python, llmtrace, load_average

    arms = [a for a in ARMS if (have_llama or own_build or ARMS[a] is not None) and a in args.arms]
    if own_build and have_llama and "llama.cpp" in arms:
        arms.insert(1, XLLAMACPP)
    os.environ.clear()
    os.environ.update(env)  # fast_vs_llamacpp's runners start their processes with this environment
    refused: dict[str, str] = {}
    if "--fast --compile" in arms:  # fills Inductor's cache: the rounds' compiles load it
        try:
            llmtrace(gguf, args.threads, PROMPT, 4, "--fast", "--compile")
        except RuntimeError as e:  # llmtrace's one line (a mixture of experts is not compiled)
            refused["--fast --compile"] = str(e)
            arms.remove("--fast --compile")
            log(f"  --fast --compile: {e}")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            if arm == "llama.cpp" and own_build:
                out = llama_cpp_python(own_build, gguf, args.threads, PROMPT, args.tokens)
            elif arm in ("llama.cpp", XLLAMACPP):
                out = llama_cpp(gguf, args.threads, PROMPT, args.tokens) | {"build": "xllamacpp"}
            else:
                out = llmtrace(gguf, args.threads, PROMPT, args.tokens, *ARMS[arm])
            runs[arm].append(out)
            log(f"  round {r + 1}: {arm}: {out['decode_tok_s']:.1f} tok/s (load {load_average()})")
    return runs | {a: [{"refused": why}] for a, why in refused.items()}


def in_process(arm: str, spec: dict, env: dict) -> dict:
    """One of _arms.py's arms in its own process; None (and the reason on stderr) if it failed."""
    proc = subprocess.run([sys.executable, str(HERE / "_arms.py"), arm, "--spec", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        log(f"  {arm} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def kernels_of(run: dict) -> str:
    choice = run.get("kernel_choice") or {}
    counts = choice.get("kernels")
    if not counts:
        return ""
    short = {"int4pack_mm_for_cpu": "int4", "int4pack_mm_for_cpu (two nibbles)": "int4x2",
             "int8pack_mm (int8 rows)": "int8", "bf16 linear": "bf16"}
    return " ".join(f"{short.get(k, k)}×{n}" for k, n in counts.items())


def decode_table(name: str, runs: dict[str, list[dict]]) -> list[str]:
    base_arm = "llama.cpp" if "llama.cpp" in runs else "exact float32"
    base = [r["decode_tok_s"] for r in runs[base_arm]]
    out = []
    if base_arm == "llama.cpp":
        first = runs["llama.cpp"][0]
        out = [f"llama.cpp arm: {first.get('build', 'xllamacpp')}"
               + (f" (built for: {_isa(first['system'])})" if first.get("system") else "") + "", ""]
    out += [f"| {name} | arm | decode tok/s (median) | / {base_arm} (median, spread over rounds) | kernels |",
            "| --- | --- | ---: | ---: | --- |"]
    for arm, rs in runs.items():
        if "refused" in rs[0]:
            out.append(f"| | `{arm}` | refused: {rs[0]['refused'].removeprefix('error: ')} | | |")
            continue
        tok = [r["decode_tok_s"] for r in rs]
        ratios = [a / b for a, b in zip(tok, base)]
        out.append(f"| | `{arm}` | {statistics.median(tok):.1f} | {statistics.median(ratios):.2f} "
                   f"({spread(ratios)}) | {kernels_of(rs[0])} |")
    return out


def _isa(system: str) -> str:
    """The instruction sets a llama.cpp build says it uses (llama_print_system_info: "CPU : SSE3 = 1 | AVX2 = 1 |
    ...") -> "SSE3, AVX2, ...", with "no AVX512" where it has none."""
    names = []
    for part in system.replace(":", "|").split("|"):
        key, _, value = part.partition("=")
        if value.strip() == "1":
            names.append(key.strip())
    return ", ".join(names) + ("" if any(n.startswith("AVX512") for n in names) else "; no AVX512")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the decode arms")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens of the decode arms")
    ap.add_argument("--pairs", type=int, default=4, help="alternations of the trace and batch arms")
    ap.add_argument("--capabilities", default="default,avx2", help="comma-separated: default, avx2")
    ap.add_argument("--models", default="smollm2,gemma3",
                    help="comma-separated: " + ", ".join(MODELS) + ", or a GGUF file's path (the MoE shape: "
                         "benchmarks/moe_gguf.py FILE)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated decode arms: " + ", ".join(ARMS))
    ap.add_argument("--llamacpp-avx2", metavar="PYTHON", default="",
                    help="an interpreter with llama-cpp-python built for AVX2 only: the llama.cpp arm under avx2")
    ap.add_argument("--no-extra", action="store_true", help="leave out the trace and batch arms")
    ap.add_argument("--out", type=Path, default=Path("fast_arms.md"), help="the tables, as markdown")
    ap.add_argument("--json", type=Path, help="every figure, as JSON")
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    sys.path.insert(0, str(HERE))
    try:
        import xllamacpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False
        log("xllamacpp is not installed: the llama.cpp arm is left out (pip install xllamacpp)")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    from llmtrace.registry.resolve import resolve

    models = {m if m in MODELS else Path(m).stem: str(resolve(MODELS[m]).path) if m in MODELS else str(Path(m).resolve())
              for m in args.models.split(",")}
    base_env = dict(os.environ)
    t0 = time.time()
    found: dict = {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "capabilities": {}}
    lines = [f"# issue 51's arms ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"{args.threads} threads pinned; decode: {args.tokens} tokens after {PROMPT!r}, greedy, EOS ignored, "
             f"{args.rounds} rounds, arms alternating, each a fresh process; load average at start "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}."]
    for cap in args.capabilities.split(","):
        env = capability_env(cap) | {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        torch_cap = torch_capability(env)
        log(f"capability {cap} (torch dispatches {torch_cap})")
        entry: dict = {"torch_capability": torch_cap, "models": {}}
        lines += ["", f"## capability `{cap}` (torch dispatches `{torch_cap}`)", ""]
        for name, gguf in (models.items() if args.arms else ()):
            log(f" {name}: decode arms")
            runs = decode_arms(gguf, args, env, have_llama, args.llamacpp_avx2 if cap == "avx2" else "")
            entry["models"][name] = runs
            lines += decode_table(f"{name} ({Path(gguf).name})", runs) + [""]
        if not args.no_extra:
            spec = {"gguf": models.get("smollm2") or str(resolve(None).path), "device": "cpu", "dtype": "float32",
                    "threads": args.threads, "new_tokens": args.tokens, "prompt_text": PROMPT, "overhead_pairs": args.pairs}
            log(" trace overhead (one process)")
            over = in_process("overhead", spec, env)
            entry["overhead"] = over
            lines += [f"| trace level, default model, exact float32, {args.tokens} tokens, one process | untraced / "
                      "traced step time (median) | spread over pairs |", "| --- | ---: | ---: |"]
            for lv in ("steps", "layers", "full") if over else ():
                speed = [1 / r for r in over["ratios"][lv]]
                lines.append(f"| `--trace {lv}` | {statistics.median(speed):.2f} | {spread(speed)} |")
            log(" batch B=16 against the loop (one process)")
            batch = in_process("batch", spec | {"batch": 16, "new_tokens": 16, "pairs": args.pairs}, env)
            entry["batch"] = batch
            if batch is not None:
                b, s = batch["runs"]["batched"], batch["runs"]["sequential"]
                lines += ["", "| B = 16, default model, exact float32, 16 tokens a row, one process | tok/s (median) "
                          "| batched / sequential (median, spread) |", "| --- | ---: | ---: |",
                          f"| batched (`generate_batch`) | {statistics.median(b):.1f} | {batch['median_ratio']:.2f} "
                          f"({spread(batch['ratios'])}) |",
                          f"| sequential (`generate` × 16) | {statistics.median(s):.1f} | |",
                          "" if batch["same_tokens"] else "\n**the batch's rows differ from the loop's**"]
        args.out.write_text("\n".join(lines) + "\n")  # what is done so far, in case a later capability fails
        found["capabilities"][cap] = entry
        os.environ.clear()
        os.environ.update(base_env)
    lines += ["", f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
                  f"{(time.time() - t0) / 60:.0f} min."]
    args.out.write_text("\n".join(lines) + "\n")
    log(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
