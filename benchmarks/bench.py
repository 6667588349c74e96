"""llmtrace against what users would otherwise run, on the same machine, in the same run.

    python benchmarks/bench.py                      # 5 rounds, all arms, torch pinned to every CPU of this machine
    python benchmarks/bench.py --rounds 7 --threads 2 --json results.json
    python benchmarks/bench.py --only hf llmtrace:none llmtrace:compiled ceiling   # just the decode-speed arms
    python benchmarks/bench.py --device cuda        # bf16 on a GPU (adds the fraction of the GPU's bandwidth)

Every arm runs as a fresh process. Within a round the arms run in one order and in the next round in the reverse
order (A B C ... C B A ...), so that a machine that slowly gets busier or quieter penalises no arm. The tables show
medians over rounds and the median of the per-round ratios; see benchmarks/README.md for how to read them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARMS_PY = HERE / "_arms.py"

# A plain-prose prompt, cut to PROMPT_TOKENS tokens by the model's tokenizer.
PROMPT_TEXT = (
    "Quantum mechanics is a fundamental theory in physics that describes the behavior of nature at and below the "
    "scale of atoms. It is the foundation of all quantum physics, which includes quantum chemistry, quantum field "
    "theory, quantum technology, and quantum information science. Classical physics, the collection of theories that "
    "existed before the advent of quantum mechanics, describes many aspects of nature at an ordinary scale, but is not "
    "sufficient for describing them at very small submicroscopic scales."
)
PROMPT_TOKENS = 64
NEW_TOKENS = 64
TRACE_LEVELS = ("none", "steps", "layers", "full")
# the llmtrace arms: a trace level, or "compiled" (--trace none --compile)
LLMTRACE_ARMS = TRACE_LEVELS + ("compiled",)


# ----------------------------------------------------------------------------------------------------------------
# running one process and what the kernel says about it


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_process(cmd: list[str], env: dict, on_line=None) -> dict:
    """Start cmd, hand each stdout line to on_line(bytes, wall_time) as it arrives, and wait for it with wait4 so that
    its own peak RSS comes back. Returns wall time from start to exit, peak RSS, the last line and stderr's tail."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    import threading

    err_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    last, pending, fd = b"", b"", proc.stdout.fileno()
    while chunk := os.read(fd, 1 << 20):  # returns as soon as the child has written something
        t = time.time()
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if on_line is not None:
                on_line(line, t)
            if line.strip():
                last = line
        # Let a few milliseconds of output pile up before the next read: one wake-up of this process per few ms
        # rather than one per event, so that the harness takes next to no CPU from the process it measures.
        time.sleep(0.002)
    if pending.strip():
        last = pending
    _, status, usage = os.wait4(proc.pid, 0)
    t_end = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    if proc.returncode != 0:
        tail = b"".join(err_chunks).decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}:\n" + "\n".join(tail))
    return {"t0": t0, "wall_s": t_end - t0, "peak_rss_mb": usage.ru_maxrss / 1024, "last_line": last}


def run_arm(arm: str, spec: dict, env: dict) -> dict:
    """A Python-level arm from _arms.py, in its own process."""
    spec = dict(spec, t0=time.time())
    res = run_process([sys.executable, str(ARMS_PY), arm, "--spec", json.dumps(spec)], env)
    out = json.loads(res["last_line"])
    out.update(process_wall_s=res["wall_s"], peak_rss_mb=res["peak_rss_mb"])
    return out


def run_in_process_arm(arm: str, spec: dict, args, env: dict):
    """One of the arms that alternate their contenders within one process (after the rounds); None if not run."""
    if args.only and arm not in args.only:
        return None
    t = time.time()
    out = None
    try:
        out = run_arm(arm, spec, env)
    except RuntimeError as e:
        print(f"  {arm} arm failed: {e}", file=sys.stderr)
    print(f"  {arm + ' (one process)':<24} {time.time() - t:6.1f} s", file=sys.stderr, flush=True)
    return out


def run_llmtrace(arm: str, args, prompt_file: Path, env: dict, new_tokens: int = NEW_TOKENS) -> dict:
    """`llmtrace generate` as a user runs it, with the event stream on stdout; timestamps are taken as lines arrive.
    `arm` is a trace level, or "compiled": no trace and `--compile` (the compile happens before the prefill)."""
    level, extra = ("none", ["--compile"]) if arm == "compiled" else (arm, [])
    cmd = [sys.executable, "-m", "llmtrace", "generate", "--file", str(prompt_file), "-m", str(args.gguf),
           "-n", str(new_tokens), "--ignore-eos", "--temperature", "0", "--trace", level, "--jsonl", "-",
           "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype, *extra]
    stamps: dict[str, float] = {}
    run_event: dict = {}
    steps: list[float] = []
    summary: dict = {}

    def on_line(line: bytes, t: float) -> None:
        # the first key of every event is "event": a prefix test is enough, and leaves the parent nearly idle
        if line.startswith(b'{"event": "step"'):
            steps.append(t)
        elif line.startswith(b'{"event": "run"'):
            run_event.update(json.loads(line))
        elif line.startswith(b'{"event": "tokens"'):
            stamps["tokens"] = t
        elif line.startswith(b'{"event": "summary"'):
            stamps["summary"] = t
            summary.update(json.loads(line))

    res = run_process(cmd, env, on_line)
    if len(steps) != new_tokens:
        raise RuntimeError(f"llmtrace {arm}: {len(steps)} steps, expected {new_tokens}")
    return {
        "compile_s": run_event.get("compiled", {}).get("compile_s"),
        "process_wall_s": res["wall_s"],
        "peak_rss_mb": res["peak_rss_mb"],
        "ttft_s": steps[0] - res["t0"],  # from process start, as the stream's reader sees it
        "prefill_tok_s": summary["prefill_tok_s"],  # the prompt's forward pass and the first sampling, in-process
        "decode_tok_s": (len(steps) - 1) / (steps[-1] - steps[0]),  # everything per step: model, sampler, trace, I/O
        "decode_tok_s_reported": summary["decode_tok_s"],  # what llmtrace itself reports (forward + sampling only)
        "gen_s": stamps["summary"] - stamps["tokens"],  # the whole generation loop, trace events included
        "tokens": summary["tokens"],
        "prompt_tokens": summary["prompt_tokens"],
    }


def run_warm_n1(args, prompt_file: Path, env: dict) -> dict:
    """`llmtrace generate PROMPT -n 1` with a warm conversion cache: process start to exit."""
    cmd = [sys.executable, "-m", "llmtrace", "generate", "--file", str(prompt_file), "-m", str(args.gguf), "-n", "1",
           "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype]
    res = run_process(cmd, env)
    return {"process_wall_s": res["wall_s"], "peak_rss_mb": res["peak_rss_mb"]}


# ----------------------------------------------------------------------------------------------------------------
# the rounds


def prepare_prompt(gguf: Path, workdir: Path) -> tuple[Path, list[int]]:
    """Cut PROMPT_TEXT to PROMPT_TOKENS tokens and check that the text re-encodes to exactly those ids."""
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer

    tok = load_tokenizer(str(gguf))
    ids = tok.encode(PROMPT_TEXT)[:PROMPT_TOKENS]
    text = tok.decode(ids)
    if tok.encode(text) != ids:
        raise SystemExit("the benchmark prompt does not re-encode to the same ids; change PROMPT_TEXT")
    path = workdir / "prompt.txt"
    path.write_text(text, encoding="utf-8")
    return path, ids


def arm_names(args) -> list[str]:
    names = ["hf"] + [f"llmtrace:{a}" for a in LLMTRACE_ARMS] + ["ceiling", "cold", "warm_n1"]
    return [n for n in names if not args.only or n.split(":")[0] in args.only or n in args.only]


def one_round(r: int, args, prompt_file: Path, ids: list[int], env: dict) -> dict:
    spec = {"gguf": str(args.gguf), "threads": args.threads, "device": args.device, "dtype": args.dtype,
            "prompt_ids": ids, "new_tokens": NEW_TOKENS}
    names = arm_names(args)
    order = names if r % 2 == 0 else names[::-1]
    out = {}
    for name in order:
        t = time.time()
        try:
            if name == "hf":
                out[name] = run_arm("hf", spec, env)
            elif name.startswith("llmtrace:"):
                out[name] = run_llmtrace(name.split(":")[1], args, prompt_file, env)
            elif name == "warm_n1":
                out[name] = run_warm_n1(args, prompt_file, env)
            else:
                out[name] = run_arm(name, spec, env)
        except RuntimeError as e:  # one failed arm costs its own numbers, not the run's
            out[name] = {"error": str(e)}
            print(f"  round {r + 1}: {name} failed: {e}", file=sys.stderr, flush=True)
        print(f"  round {r + 1}: {name:<16} {time.time() - t:6.1f} s", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
# figures and ratios


def _get(rounds, arm, key):
    return [rd[arm][key] for rd in rounds if arm in rd and key in rd[arm]]


def _ratio(rounds, arm_a, key_a, arm_b, key_b, invert=False):
    """Per-round a/b (or b/a with invert), so that each ratio compares two measurements taken minutes apart."""
    out = []
    for rd in rounds:
        if arm_a in rd and arm_b in rd and key_a in rd[arm_a] and key_b in rd[arm_b]:
            a, b = rd[arm_a][key_a], rd[arm_b][key_b]
            out.append(b / a if invert else a / b)
    return out


def summarise(rounds: list[dict], args) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    rows = []
    for arm in ["hf"] + [f"llmtrace:{a}" for a in LLMTRACE_ARMS]:
        if not any(arm in rd for rd in rounds):
            continue
        rows.append({"arm": arm, **{k: med(_get(rounds, arm, k)) for k in
                                     ("prefill_tok_s", "decode_tok_s", "ttft_s", "gen_s", "process_wall_s", "peak_rss_mb",
                                      "load_s", "decode_tok_s_reported")}})
    ceil = {k: med(_get(rounds, "ceiling", k)) for k in
            ("pass_ms_best", "pass_ms_median", "pass_ms_sustained", "ceiling_sustained_tok_s", "gb_s", "ceiling_tok_s",
             "matrix_bytes", "weight_bytes",
             "rss_before_load_mb", "rss_after_load_mb", "rss_after_use_mb", "distinct_storages", "n_parameters",
             "gpu_peak_gb_s")}
    weight_mb = (ceil["weight_bytes"] or 0) / 2**20
    R = {}  # name -> (per-round values, target, "ge" | "le")

    def ratio(name, values, target=None, sense="ge"):
        R[name] = {"per_round": values, "median": med(values), "target": target, "sense": sense}

    ratio("decode: compiled / HF", _ratio(rounds, "llmtrace:compiled", "decode_tok_s", "hf", "decode_tok_s"), 2.0)
    ratio("decode: compiled / ceiling (sustained)", _ratio(rounds, "llmtrace:compiled", "decode_tok_s", "ceiling",
                                                            "ceiling_sustained_tok_s"), 0.85)
    ratio("decode: compiled / ceiling (best single pass)", _ratio(rounds, "llmtrace:compiled", "decode_tok_s", "ceiling",
                                                                  "ceiling_tok_s"), 0.85)
    ratio("decode: compiled / none", _ratio(rounds, "llmtrace:compiled", "decode_tok_s", "llmtrace:none", "decode_tok_s"))
    ratio("decode: none / HF", _ratio(rounds, "llmtrace:none", "decode_tok_s", "hf", "decode_tok_s"))
    ratio("decode: none / ceiling (sustained)", _ratio(rounds, "llmtrace:none", "decode_tok_s", "ceiling",
                                                        "ceiling_sustained_tok_s"))
    ratio("decode: HF / ceiling (sustained)", _ratio(rounds, "hf", "decode_tok_s", "ceiling", "ceiling_sustained_tok_s"))
    ratio("ceiling: sustained / best single pass", _ratio(rounds, "ceiling", "ceiling_sustained_tok_s", "ceiling",
                                                          "ceiling_tok_s"))
    ratio("prefill: none / HF", _ratio(rounds, "llmtrace:none", "prefill_tok_s", "hf", "prefill_tok_s"))
    ratio("TTFT from process start: none / HF", _ratio(rounds, "llmtrace:none", "ttft_s", "hf", "ttft_s"))
    for lv, target in (("steps", 1.05), ("layers", None), ("full", 1.5)):
        ratio(f"generation wall: {lv} / none", _ratio(rounds, f"llmtrace:{lv}", "gen_s", "llmtrace:none", "gen_s"),
              target, "le")
    ratio("GGUF cold load: llmtrace / HF", _ratio(rounds, "cold", "cold_load_s", "hf", "load_s"), 0.2, "le")
    ratio("load: llmtrace warm / HF", _ratio(rounds, "cold", "warm_load_s", "hf", "load_s"))
    ratio("peak RSS (none) / fp32 weight bytes", [x / weight_mb for x in _get(rounds, "llmtrace:none", "peak_rss_mb")]
          if weight_mb else [], 2.0, "le")
    ratio("peak RSS (cold load) / fp32 weight bytes", [x / weight_mb for x in _get(rounds, "cold", "peak_rss_mb")]
          if weight_mb else [], None, "le")
    ratio("peak RSS: none / HF", _ratio(rounds, "llmtrace:none", "peak_rss_mb", "hf", "peak_rss_mb"))
    ratio("RSS added by load + one read of every weight / weight bytes",
          [(a - b) / weight_mb for a, b in zip(_get(rounds, "ceiling", "rss_after_use_mb"),
                                               _get(rounds, "ceiling", "rss_before_load_mb"))] if weight_mb else [],
          1.1, "le")
    if ceil.get("gpu_peak_gb_s"):
        for arm in ("none", "compiled"):
            ratio(f"decode bandwidth / GPU peak: {arm}",
                  [c["matrix_bytes"] * d["decode_tok_s"] / 1e9 / c["gpu_peak_gb_s"]
                   for c, d in ((rd.get("ceiling", {}), rd.get(f"llmtrace:{arm}", {})) for rd in rounds)
                   if "gpu_peak_gb_s" in c and "decode_tok_s" in d])
    def agreement(arm_a, arm_b):  # per round: how many leading greedy tokens two arms share
        out = []
        for rd in rounds:
            if "tokens" in rd.get(arm_a, {}) and "tokens" in rd.get(arm_b, {}):
                a, b = rd[arm_a]["tokens"], rd[arm_b]["tokens"]
                out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
        return out

    other = {
        "cold_load_s": med(_get(rounds, "cold", "cold_load_s")),
        "warm_load_s": med(_get(rounds, "cold", "warm_load_s")),
        "cold_peak_rss_mb": med(_get(rounds, "cold", "peak_rss_mb")),
        "warm_n1_wall_s": med(_get(rounds, "warm_n1", "process_wall_s")),
        "warm_n1_per_round": _get(rounds, "warm_n1", "process_wall_s"),
        "greedy_tokens_equal_to_hf": agreement("hf", "llmtrace:none"),
        "compiled_tokens_equal_to_eager": agreement("llmtrace:none", "llmtrace:compiled"),
        "compile_s_warm": med(_get(rounds, "llmtrace:compiled", "compile_s")),
        "compile_s_per_round": _get(rounds, "llmtrace:compiled", "compile_s"),
        "compile_s_cold": getattr(args, "cold_compile_s", None),
    }
    return {"rows": rows, "ceiling": ceil, "ratios": R, "other": other}


def _fmt(x, nd=1):
    if x is None:
        return "–"
    return f"{x:,.{nd}f}"


def _met(r) -> str:
    if r["target"] is None or r["median"] is None:
        return ""
    ok = r["median"] >= r["target"] if r["sense"] == "ge" else r["median"] <= r["target"]
    return ("met" if ok else "**not met**") + f" ({'≥' if r['sense'] == 'ge' else '≤'} {r['target']})"


def report(s: dict, meta: dict) -> str:
    lines = [f"threads: {meta['threads']} · device: {meta['device']} · dtype: {meta['dtype']} · rounds: {meta['rounds']} · "
             f"prompt {meta['prompt_tokens']} tokens, {NEW_TOKENS} new, greedy, EOS ignored", ""]
    lines += ["| arm | prefill tok/s | decode tok/s | TTFT from process start (s) | generation wall (s) | process wall (s) "
              "| peak RSS (MiB) | GGUF load (s) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in s["rows"]:
        lines.append(f"| {row['arm']} | {_fmt(row['prefill_tok_s'])} | {_fmt(row['decode_tok_s'])} | "
                     f"{_fmt(row['ttft_s'], 2)} | {_fmt(row['gen_s'], 2)} | {_fmt(row['process_wall_s'], 2)} | "
                     f"{_fmt(row['peak_rss_mb'], 0)} | {_fmt(row['load_s'], 2)} |")
    c, o = s["ceiling"], s["other"]
    lines += ["", f"Ceiling: one pass of matrix-vector products over the {_fmt((c['matrix_bytes'] or 0) / 2**20, 0)} MiB "
              f"of weight matrices a decode step reads: best {_fmt(c['pass_ms_best'], 2)} ms, median "
              f"{_fmt(c['pass_ms_median'], 2)} ms ({_fmt(c['gb_s'], 1)} GB/s) → ceiling {_fmt(c['ceiling_tok_s'])} tok/s; "
              f"sustained over 63 passes back to back (as a 64-token decode runs 63 steps): "
              f"{_fmt(c['pass_ms_sustained'], 2)} ms a pass → {_fmt(c['ceiling_sustained_tok_s'])} tok/s.",
              f"llmtrace GGUF load: cold (convert + cache) {_fmt(o['cold_load_s'], 2)} s, warm {_fmt(o['warm_load_s'], 2)} s; "
              f"`generate -n 1` warm, process start to exit: {_fmt(o['warm_n1_wall_s'], 2)} s; "
              f"fp32 weights {_fmt((c['weight_bytes'] or 0) / 2**20, 0)} MiB.",
              f"Greedy tokens identical to HF's, per round: {o['greedy_tokens_equal_to_hf']} of {NEW_TOKENS}; "
              f"compiled to eager: {o['compiled_tokens_equal_to_eager']} of {NEW_TOKENS}.",
              f"`--compile`: compiling the decode step took {_fmt(o['compile_s_cold'])} s with an empty Inductor cache, "
              f"{_fmt(o['compile_s_warm'])} s (median) once cached; per round "
              f"{' '.join(f'{v:.1f}' for v in o['compile_s_per_round'])} s.", ""]
    if s.get("decode"):
        d = s["decode"]
        lines[-1:-1] = [f"In-process decode arm: tok/s medians "
                        + ", ".join(f"{a} {statistics.median(v):.1f}" for a, v in d["decode_tok_s"].items())
                        + f"; greedy tokens equal to HF's: {d['tokens_equal']}; compiled step ready in "
                          f"{d['compile_s']:.1f} s."]
    lines += ["| ratio | median | per round | target |", "| --- | ---: | --- | --- |"]
    for name, r in s["ratios"].items():
        if r["median"] is None:
            continue
        lines.append(f"| {name} | {r['median']:.2f} | {' '.join(f'{v:.2f}' for v in r['per_round'])} | {_met(r)} |")
    lines.append(f"| `generate -n 1` warm, process wall (s) | {_fmt(o['warm_n1_wall_s'], 2)} | "
                 f"{' '.join(f'{v:.2f}' for v in o['warm_n1_per_round'])} | "
                 f"{'met' if (o['warm_n1_wall_s'] or 99) <= 3 else '**not met**'} (≤ 3 s) |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["load_avg_start"] = os.getloadavg()
    except OSError:
        pass
    import torch

    info["torch"] = torch.__version__
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds of all arms (at least 5 for the record)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, the same for every arm")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    p.add_argument("--only", nargs="*",
                   help="run only these arms: hf llmtrace llmtrace:steps llmtrace:compiled ceiling cold warm_n1 overhead "
                        "decode")
    p.add_argument("--decode-pairs", type=int, default=6,
                   help="alternations of the in-process decode arm (each runs HF, llmtrace eager and compiled, ceiling)")
    p.add_argument("--overhead-pairs", type=int, default=8,
                   help="alternations of the in-process trace-overhead arm (each runs every level once)")
    p.add_argument("--json", default=None, help="write every number to this file")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    sys.path.insert(0, str(ROOT))
    if args.model:
        args.gguf = Path(args.model).resolve()
    else:
        from llmtrace.registry.resolve import resolve

        args.gguf = resolve(None).path
    import tempfile

    env = _child_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="llmtrace-bench-") as tmp:
        prompt_file, ids = prepare_prompt(args.gguf, Path(tmp))
        started = datetime.now(timezone.utc)
        meta = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
                "date": started.isoformat(timespec="seconds"), "machine": machine_info(), "threads": args.threads,
                "device": args.device, "dtype": args.dtype, "rounds": args.rounds, "model": str(args.gguf),
                "prompt_tokens": len(ids), "new_tokens": NEW_TOKENS}
        print(f"{meta['command']}: {args.rounds} rounds, threads {args.threads}, {args.device} {args.dtype}",
              file=sys.stderr)
        # one untimed llmtrace run so the conversion cache is warm for the warm arms (a cold run is its own arm)
        run_warm_n1(args, prompt_file, env)
        # Inductor's cache lives in this run's temporary directory: the first --compile run below compiles from
        # nothing (its time is the cold compile), the rounds then find the code cached, as a user's later runs do
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        args.cold_compile_s = None
        if any(n == "llmtrace:compiled" for n in arm_names(args)):
            args.cold_compile_s = run_llmtrace("compiled", args, prompt_file, env, new_tokens=2)["compile_s"]
            print(f"  cold compile: {args.cold_compile_s:.1f} s", file=sys.stderr, flush=True)
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(r, args, prompt_file, ids, env))
        base = {"gguf": str(args.gguf), "threads": args.threads, "device": args.device, "dtype": args.dtype,
                "prompt_ids": ids, "prompt_text": prompt_file.read_text(encoding="utf-8"), "new_tokens": NEW_TOKENS}
        overhead = run_in_process_arm("overhead", dict(base, overhead_pairs=args.overhead_pairs), args, env)
        decode = run_in_process_arm("decode", dict(base, decode_pairs=args.decode_pairs), args, env)
        try:
            meta["machine"]["load_avg_end"] = os.getloadavg()
        except OSError:
            pass
        meta["wall_minutes"] = (datetime.now(timezone.utc) - started).total_seconds() / 60
    s = summarise(rounds, args)
    if overhead is not None:
        # time per decode step, traced / untraced: at most 1/0.97 (steps) and 1/0.85 (full), the speeds issue 51 asks
        for lv, target in (("steps", 1 / 0.97), ("layers", None), ("full", 1 / 0.85)):
            values = overhead["ratios"][lv]
            s["ratios"][f"one process, alternating: {lv} / none"] = {
                "per_round": values, "median": statistics.median(values), "target": target, "sense": "le"}
        # the same steps on other clocks (a shared machine's wall clock swings): the loop thread's CPU time (the
        # recorder's worker not included), the process's, and the wall clock less the loop's wait for a CPU
        for view, label in (("loop_cpu_seconds", "loop thread's CPU"), ("process_cpu_seconds", "process CPU"),
                            ("wall_less_runqueue_seconds", "wall less run-queue wait")):
            for lv in ("steps", "full"):
                values = overhead["other_ratios"][view][lv]
                s["ratios"][f"one process, alternating: {lv} / none, {label}"] = {
                    "per_round": values, "median": statistics.median(values), "target": None, "sense": "le"}
        s["overhead"] = overhead
    if decode is not None:
        for name, target in (("compiled / HF", 2.0), ("compiled / ceiling (sustained)", 0.85), ("none / HF", None),
                             ("HF / ceiling (sustained)", None)):
            values = decode["ratios"][name]
            s["ratios"][f"one process, alternating: decode {name}"] = {
                "per_round": values, "median": statistics.median(values), "target": target, "sense": "ge"}
        s["decode"] = decode
    text = report(s, meta)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": s, "rounds": rounds},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
