"""`llmtrace lens --fit-jacobian CORPUS` and `llmtrace lens PROMPT --jacobian FILE`: the Jacobian lens
(llmtrace.run.jlens), the two branches of the `lens` command (cli/explain.py) that do not draw the logit lens."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from llmtrace.cli.options import load_for_cli, write_output
from llmtrace.errors import UsageError


def fit_command(corpus: Path, out: Optional[Path], ctx: int, chunks: Optional[int], workers: int, ray: Optional[str],
                resume: bool, load_args, threads: Optional[int]) -> int:
    """Fit the lens over CORPUS and write it to OUT; the exit code (130 when interrupted)."""
    from llmtrace.cli.text_input import read_file, strip_one_newline

    if out is None:
        raise UsageError("--fit-jacobian writes a lens file: give it with -o lens.safetensors")
    text = strip_one_newline(read_file(corpus, "the corpus"))
    if not text.strip():
        raise UsageError(f"{corpus} is empty: give a text to fit the lens over")
    model_ = load_for_cli(load_args)
    from llmtrace.run.jlens import fit

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\rfitting: chunk {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    try:
        r = fit(model_, text, ctx, out, chunks=chunks, resume=resume, workers=workers, ray=ray, threads=threads,
                on_chunk=progress)
    except KeyboardInterrupt:
        print(f"interrupted: `--resume` with the same settings goes on from {out.name}.partial", file=sys.stderr)
        return 130
    print(f"wrote {out}: the Jacobian lens of {r['layers']} layers over {r['positions']:,} positions "
          f"({r['chunks']} chunks of {r['ctx']})", file=sys.stderr)
    return 0


def readout_command(prompt: str, lens_file: Path, load_args, last: int, top: int, chat: bool,
                    json_out: Optional[str], html: Optional[str] = None) -> None:
    """The lens read out on PROMPT: each layer's top token at the last positions; --json the top candidates of both
    lenses at every layer and position; --html the page with the Jacobian lens beside the logit lens."""
    from rich.text import Text

    from llmtrace.console import make_console
    from llmtrace.render.generate import visible
    from llmtrace.run.jlens import lens_info, read_lens, readout_top

    model_ = load_for_cli(load_args)
    lm = model_.loaded
    lens = read_lens(lens_file, lm)
    r = readout_top(lm, prompt, lens, top, chat=chat)  # each (L, T, top)
    tok = lm.tokenizer
    ids = tok.encode_prompt(prompt, chat=chat)[1]
    L, T, _ = r["jlens_p"].shape
    shown = list(range(max(0, T - last), T))

    def candidates(name: str, layer: int, p: int) -> list[dict]:
        return [{"text": tok.decode([int(i)]), "id": int(i), "p": round(float(q), 6)}
                for q, i in zip(r[f"{name}_p"][layer, p], r[f"{name}_id"][layer, p])]

    event = {"event": "jlens", "lens": str(lens_file), "fit": lens_info(lens_file), "model": lm.name,
             "prompt": prompt, "tokens": [tok.decode([i]) for i in ids], "n_layers": L,
             "cells": [{"layer": layer, "position": p, "top": candidates("jlens", layer, p),
                        "logit_lens": candidates("logit", layer, p)}
                       for layer in range(L) for p in range(T)]}
    if json_out:
        import json

        write_output(json_out, json.dumps(event, ensure_ascii=False) + "\n")
    if html:
        from llmtrace.report.jlens import write_jlens_html

        n = write_jlens_html(event, html)
        print(f"wrote {html} ({n / 1e3:.0f} kB)", file=sys.stderr)
    if json_out == "-" and not sys.stderr.isatty():
        return
    console = make_console(stderr=json_out == "-")
    console.print(Text(f"the Jacobian lens ({lens_file}): softmax(W_U · norm(J_l · h_l)), top-1 per layer and "
                       f"position", style="bold cyan"))
    w = max(6, min(12, (console.width - 5) // max(1, len(shown))))
    head = Text("     ")
    for p in shown:
        head.append(visible(tok.decode([ids[p]]))[: w - 1].rjust(w), style="bold")
    console.print(head)
    for layer in range(L):
        row = Text(f"L{layer:<3} ")
        for p in shown:
            piece = visible(tok.decode([int(r["jlens_id"][layer, p, 0])]))[: w - 1]
            row.append(piece.rjust(w), style="green" if float(r["jlens_p"][layer, p, 0]) > 0.5 else "")
        console.print(row)
