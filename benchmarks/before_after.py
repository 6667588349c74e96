"""This tree against an earlier commit, in one run: decode speed untraced and the cost of a full trace.

    python benchmarks/before_after.py --base 71d8dee              # 6 rounds, 1 thread
    python benchmarks/before_after.py --base HEAD~5 --rounds 8 --threads 2

The earlier commit is checked out into a temporary git worktree. Each round runs both trees, each in a fresh process,
in the order A B then B A (so that a machine that slowly gets busier or quieter penalises neither), on the default
model: a greedy generation of --tokens tokens at --trace none (decode tok/s) and at --trace full --layers 0,-1 (ms a
step). It prints medians and the median of the per-round ratios (this tree / the base); higher tok/s and lower ms are
better. The machine and the CPU are printed with the figures, since they change from session to session.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Quantum mechanics is a fundamental theory in physics that"

ARM = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import llmtrace
n = int(sys.argv[2])
model = llmtrace.load(None, device="cpu", threads=int(sys.argv[1]))
out = {}
for level, layers in (("none", None), ("full", "0,-1")):
    model.generate(sys.argv[3], max_new_tokens=2, ignore_eos=True, trace=level, layers=layers)  # warm up
    run = model.generate(sys.argv[3], max_new_tokens=n, ignore_eos=True, trace=level, layers=layers)
    summary = next(e for e in run.events if e.get("event") == "summary")
    out[level] = summary["decode_tok_s"]
print(json.dumps(out))
"""


def arm(tree: Path, home: Path, threads: int, tokens: int) -> dict:
    """One fresh process of one tree, with a cache of its own (each tree's conversion cache is its own format)."""
    r = subprocess.run([sys.executable, "-c", ARM, str(threads), str(tokens), PROMPT], cwd=tree, capture_output=True,
                       text=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                       "LLMTRACE_HOME": str(home), "HF_HUB_OFFLINE": "1"}, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the earlier commit")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmtrace-base-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), a.base], check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            for r in range(a.rounds):
                order = [("base", base), ("head", ROOT)] if r % 2 == 0 else [("head", ROOT), ("base", base)]
                for name, tree in order:
                    runs[name].append(arm(tree, Path(tmp) / f"home-{name}", a.threads, a.tokens))
                print(f"round {r + 1}/{a.rounds}: base {runs['base'][-1]}, head {runs['head'][-1]}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    print(f"{platform.processor() or platform.machine()} · {a.threads} thread(s) · {a.tokens} tokens · "
          f"{a.rounds} rounds · base {a.base}")
    for level in ("none", "full"):
        b = [x[level] for x in runs["base"]]
        h = [x[level] for x in runs["head"]]
        ratio = statistics.median(y / x for x, y in zip(b, h))
        print(f"decode tok/s at --trace {level}: base {statistics.median(b):.1f}, head {statistics.median(h):.1f}, "
              f"head/base {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
