"""A long traced run keeps memory flat apart from the KV cache.

Generates N tokens (2,000 by default) greedily with `--trace steps` (the Recorder, the step ledger, a JSONL stream)
and reads the process's resident set size at token 100 and at the last token. The KV cache is allocated whole (and
zero-filled, so resident) before the first step; between the two checkpoints it only fills up. So RSS growth between
them is memory that something else keeps per token.

    python benchmarks/long_run.py                   # the default model, 2,000 tokens
    python benchmarks/long_run.py -n 500 --at 50    # shorter
    python benchmarks/long_run.py --every 250       # also a checkpoint every 250 tokens
    python benchmarks/long_run.py --json            # also keep a --json document in memory (it grows by design)

Prints one line per checkpoint and a verdict. Exit code 1 if RSS grew by more than --limit-mb.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes() -> int:
    """The resident set size now (Linux: /proc/self/statm), else the peak so far (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class Probe:
    """Wraps the run's observer; at the chosen steps reads RSS and the KV cache's bytes (no extra work otherwise)."""

    def __init__(self, inner, at: set[int]):
        self.inner, self.at = inner, at
        self.rows: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def on_step(self, record) -> None:
        self.inner.on_step(record)
        token = record.step + 1  # step 0 (the prefill) gives token 1
        if token in self.at:
            gc.collect()
            kv = record.kv  # what the generation loop reports of its cache
            self.rows.append({"token": token, "rss": rss_bytes(), "kv_used": kv.seq_len * kv.bytes_per_token,
                              "kv_allocated": kv.bytes_allocated, "kv_bytes_per_token": kv.bytes_per_token,
                              "ms": record.ms})


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="registry name, .gguf file or HF directory (default model)")
    ap.add_argument("-n", "--tokens", type=int, default=2000, help="tokens to generate")
    ap.add_argument("--at", type=int, default=100, help="the early checkpoint (token number)")
    ap.add_argument("--every", type=int, default=0, help="also a checkpoint every this many tokens (0: none)")
    ap.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="also collect a --json document (held in memory by design)")
    ap.add_argument("--limit-mb", type=float, default=4.0, help="allowed RSS growth between the checkpoints, MiB")
    args = ap.parse_args(argv)

    from llmtrace.run.generate import generate
    import llmtrace  # the public API: a benchmark measures what users run
    from llmtrace.checkpoint.devices import set_threads
    from llmtrace.run.sampler import Sampler, SamplerConfig
    from llmtrace.trace.writers import JsonDocWriter, JsonlWriter
    from llmtrace.trace.recorder import Recorder
    from llmtrace.trace.options import TraceOptions

    set_threads(args.threads)
    lm = llmtrace.load(args.model, device="cpu", dtype="float32", threads=args.threads).loaded
    ids = lm.tokenizer.encode(args.prompt)
    at = {args.at, args.tokens} | (set(range(args.every, args.tokens, args.every)) if args.every else set())
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = JsonlWriter(str(Path(tmp) / "trace.jsonl"))
        sinks = [jsonl] + ([JsonDocWriter(str(Path(tmp) / "trace.json"))] if args.json else [])
        recorder = Recorder(TraceOptions(level="steps"), sinks, run_info={"prompt": args.prompt})
        probe = Probe(recorder, at)
        t0 = time.perf_counter()
        result = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), args.tokens,
                          ignore_eos=True, observer=probe)
        wall = time.perf_counter() - t0
        jsonl.close()
        jsonl_bytes = (Path(tmp) / "trace.jsonl").stat().st_size

    print(f"model {lm.name} · {len(ids)} prompt tokens · {len(result.tokens)} generated in {wall:.1f} s "
          f"({result.decode_tok_s:.1f} tok/s) · trace steps · JSONL {mib(jsonl_bytes)}"
          f"{' · --json document kept' if args.json else ''}")
    print(f"KV cache allocated whole before the first step: {mib(probe.rows[0]['kv_allocated'])} "
          f"({probe.rows[0]['kv_bytes_per_token']:,} B per position)")
    for r in probe.rows:
        print(f"  token {r['token']:>5}: RSS {mib(r['rss']):>12} · KV cache used {mib(r['kv_used']):>10} · "
              f"{r['ms']:.1f} ms/step")
    first, end = probe.rows[0], probe.rows[-1]
    grew, kv = end["rss"] - first["rss"], end["kv_used"] - first["kv_used"]
    per_token = grew / max(end["token"] - first["token"], 1)
    print(f"RSS at token {first['token']}: {mib(first['rss'])}; at token {end['token']}: {mib(end['rss'])}; "
          f"grew {mib(grew)} ({per_token / 1000:.1f} kB per token). KV cache bytes written in between: {mib(kv)}, "
          f"into memory that was already resident")
    ok = grew <= args.limit_mb * 2**20
    print("flat" if ok else f"NOT flat: grew more than {args.limit_mb} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
