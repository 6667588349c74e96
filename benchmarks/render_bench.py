"""What the terminal view costs against the generation it shows, measured in one process.

    python benchmarks/render_bench.py                       # --trace full, 64 new tokens, 1 thread, 100 columns
    python benchmarks/render_bench.py -n 16 --level layers --columns 200 --threads 2

One generation is recorded (the Recorder feeding an in-memory list, as it feeds the JSONL sink), then the same events
are rendered into an in-memory console of the given width, the way the terminal and `llmtrace show` render them.
The figure is render seconds / generation seconds; the goal is at most 0.20. Torch threads are pinned, and both
halves run in the same process one after the other, so machine drift moves them together.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Quantum mechanics is a fundamental theory in physics that"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--new-tokens", type=int, default=64)
    ap.add_argument("--level", default="full", choices=("steps", "layers", "full"))
    ap.add_argument("--columns", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_out", help="also write the result to this file")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from rich.console import Console

    from llmtrace.run.generate import generate
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.render.generate import render_events
    from llmtrace.run.sampler import Sampler, SamplerConfig
    from llmtrace.trace.recorder import Recorder
    from llmtrace.trace.options import TraceOptions

    lm = llmtrace.load(None, device="cpu", dtype="float32").loaded
    ids = lm.tokenizer.encode(PROMPT)
    events: list[dict] = []
    recorder = Recorder(TraceOptions(level=args.level), [events.append], run_info={"prompt": PROMPT})
    sampler = Sampler(SamplerConfig(temperature=0.0, seed=0), lm.config.vocab_size)
    t0 = time.perf_counter()
    result = generate(lm, ids, sampler, args.new_tokens, ignore_eos=True, observer=recorder)
    gen_s = time.perf_counter() - t0

    out = io.StringIO()
    console = Console(file=out, width=args.columns, no_color=True, highlight=False, soft_wrap=False)
    t0 = time.perf_counter()
    render_events(events, console)
    render_s = time.perf_counter() - t0

    n_tensor = sum(e["event"] == "tensor" for e in events)
    lines = out.getvalue().count("\n")
    steps = len(result.tokens)
    res = {
        "level": args.level, "new_tokens": steps, "threads": args.threads, "columns": args.columns,
        "events": len(events), "tensor_events": n_tensor, "generation_s": round(gen_s, 3),
        "render_s": round(render_s, 3), "ratio": round(render_s / gen_s, 4), "lines": lines,
        "lines_per_layer_step": round(lines / (steps * lm.config.n_layers), 2),
    }
    print(f"--trace {args.level}, {steps} tokens, {args.threads} thread(s), {args.columns} columns: generation "
          f"{gen_s:.2f} s, render {render_s:.2f} s → render/generation = {render_s / gen_s:.3f} (goal ≤ 0.20); "
          f"{lines:,} lines from {len(events):,} events ({n_tensor:,} tensor events)")
    print(json.dumps(res))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
