"""Where the peak RSS of a `--fast` load comes from (issue 24): /proc/self/status at each stage of the load, in MiB
over the RSS after importing torch and llmtrace, for the default model's GGUF or -m FILE.

    python benchmarks/fast_load_memory.py [-m FILE.gguf]

VmRSS is RssAnon (heap, tensors) + RssFile (pages of mapped files: shared libraries' code on first use, a mapped
GGUF's pages); VmHWM is the peak of VmRSS so far. The stages are observed by wrapping the loader's steps (the
tokenizer's construction, each matrix's packing, the model's assembly), not by changing them; then one forward pass
over 9 tokens. Linux only."""

from __future__ import annotations

import argparse
from pathlib import Path

KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in KEYS:
            out[key] = int(line.split()[1]) / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the default model's, from llmtrace's cache)")
    args = ap.parse_args()
    import torch

    import llmtrace.checkpoint.fast as fast
    import llmtrace.checkpoint.load  # noqa: F401
    import llmtrace.checkpoint.weights as weights
    import llmtrace.tokens.tokenizer as tokenizer

    torch.set_num_threads(1)
    gguf = args.model
    if gguf is None:
        from llmtrace.registry.resolve import resolve

        gguf = str(resolve(None).path)
    base = status()
    rows = []

    def mark(stage: str) -> None:
        now = status()
        rows.append((stage, {k: now[k] - base[k] for k in KEYS}))

    from_gguf, fast_linear, build_model = tokenizer.TextTokenizer.from_gguf, fast.fast_linear, weights.build_model
    calls = {"n": 0}

    def tokenizer_step(*a, **k):
        out = from_gguf(*a, **k)
        mark("GGUF metadata read, tokenizer built")
        return out

    def linear_step(*a, **k):
        out = fast_linear(*a, **k)
        calls["n"] += 1
        if calls["n"] == 1:
            mark("first matrix packed (a tied file: the LM head)")
        return out

    def build_step(*a, **k):
        mark("every matrix packed")
        out = build_model(*a, **k)
        mark("model assembled (load done)")
        return out

    tokenizer.TextTokenizer.from_gguf = staticmethod(tokenizer_step)
    fast.fast_linear, weights.build_model = linear_step, build_step
    config, model, tok = fast.load_gguf_fast(gguf, torch.device("cpu"))
    with torch.no_grad():
        model(torch.tensor([tok.encode("The capital of France is a city that")]))
    mark("one forward pass, 9 tokens")
    size = Path(gguf).stat().st_size / 2**20
    print(f"{Path(gguf).name}: {size:.1f} MiB; baseline (after importing torch and llmtrace) "
          + ", ".join(f"{k} {base[k]:.0f}" for k in KEYS) + " MiB")
    print("| stage | " + " | ".join(KEYS) + " |\n| --- |" + " ---: |" * len(KEYS))
    for stage, d in rows:
        print(f"| {stage} | " + " | ".join(f"{d[k]:+.1f}" for k in KEYS) + " |")
    stored = sum(b.nbytes for b in model.buffers()) + sum(p.nbytes for p in model.parameters())
    mapped = model.embed.raw0.nbytes if isinstance(model.embed, getattr(fast, "MappedEmbedding", ())) else 0
    print(f"tensors held: {(stored - mapped) / 2**20:.1f} MiB in memory, {mapped / 2**20:.1f} MiB mapped from the file")


if __name__ == "__main__":
    main()
