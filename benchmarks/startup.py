"""Start-up: how long short commands take from process start to exit, against bare Python and `import torch`.

Each arm is a fresh process, run in rounds whose order alternates, so that a machine getting busier favours no arm.
The default model must be in the cache and converted (run `llmtrace generate hi -n 1` once first).

    python benchmarks/startup.py                 # 5 rounds, torch pinned to 1 thread
    python benchmarks/startup.py --rounds 9 --threads 2 --json startup.json

What to read: `tokenize` and `models` should sit near `python -c pass` (they never import torch); `generate -n 1`
should cost `import torch` plus the load and one forward pass. The column "− import torch" is what llmtrace adds on
top of torch's own import, the part llmtrace can change.
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

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def arms(prompt_file: Path, threads: int) -> dict[str, list[str]]:
    llmtrace = [sys.executable, "-m", "llmtrace"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "tokenize Hello --ids": [*llmtrace, "tokenize", "Hello", "--ids"],
        "models": [*llmtrace, "models"],
        "generate -n 1": [*llmtrace, "generate", "--file", str(prompt_file), "-n", "1", "--threads", str(threads)],
    }


def run_once(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every arm (also OMP_NUM_THREADS)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "LLMTRACE_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(PROMPT + "\n")
        commands = arms(prompt_file, args.threads)
        for argv in commands.values():  # one untimed run each: files into the page cache, bytecode compiled
            run_once(argv, env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for r in range(args.rounds):
            order = list(commands) if r % 2 == 0 else list(reversed(commands))
            for name in order:
                times[name].append(run_once(commands[name], env))

    torch_s = statistics.median(times["python -c 'import torch'"])
    cpu = _cpu_name()
    print(f"{cpu}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f}; torch threads {args.threads}; "
          f"{args.rounds} rounds")
    print(f"{'command':28} {'median s':>9} {'best s':>7} {'− import torch':>15}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:28} {median:9.2f} {min(values):7.2f} {median - torch_s:+15.2f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "rounds": args.rounds,
                                         "seconds": times}, indent=1) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
