"""`llmtrace capture`: activations over a corpus written as safetensors shards (llmtrace.run.capture)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from dataclasses import dataclass

from llmtrace.cli.options import OneDeviceLoadFlags, flag_groups, load_for_cli
from llmtrace.errors import UsageError

CAPTURE_HELP = """Activations over a corpus: the full tensors of a few points at every token, as safetensors shards.

The text is cut into chunks of --ctx tokens (BOS first where the model adds one), as `llmtrace eval` cuts it. Each
chunk runs once through the model with a hook on the asked points only (nothing is traced), and every token's
vector of each point is kept, with its id, its position in the chunk and the chunk's number. A shard holds
--shard-chunks chunks and is written whole or not at all, so an interrupted run goes on with --resume and ends with
the same shards. Read them with `llmtrace.read_capture(DIR)`: {point: (tokens, width) tensor, "ids": ...}.

Examples:

\b
  llmtrace capture wiki.raw -m smollm2-135m-instruct --points 6.resid_post \\
      --ctx 128 -o acts
  llmtrace capture wiki.raw --points "6.resid_post,6.attn_out" --ctx 256 \\
      --dtype float32 --chunks 40 -o acts32
  llmtrace capture wiki.raw --points 6.resid_post --ctx 128 -o acts --resume
  llmtrace capture wiki.raw --points 6.resid_post --ctx 128 -o acts4 --workers 4
"""


RunDtypeOpt = Annotated[Optional[str], typer.Option(
    "--run-dtype", help="The dtype the model runs in: float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 "
    "on CUDA). --dtype is how the activations are stored.", show_default=False)]


@dataclass
class CaptureLoadFlags(OneDeviceLoadFlags):
    """The load flags, the model's dtype as --run-dtype (--dtype is the shards')."""

    dtype: RunDtypeOpt = None


@app.command(help=CAPTURE_HELP)
@flag_groups
def capture(
    file: Annotated[Path, typer.Argument(metavar="CORPUS", help="The UTF-8 text (- for stdin).", show_default=False)],
    points: Annotated[Optional[str], typer.Option("--points", metavar="NAMES", help="The points to keep, by name or "
                      "glob, comma-separated: 6.resid_post,*.attn_out (`model.points()` lists them).",
                      show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="DIR", help="The directory of the shards "
                   "(new or empty, or the one to --resume).", show_default=False)] = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="Tokens per chunk.")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", metavar="N", help="Stop after N chunks (default: the "
                      "whole text).", show_default=False)] = None,
    store_dtype: Annotated[str, typer.Option("--dtype", help="How the activations are stored: float16, float32 or "
                                       "bfloat16 (the pass runs in the model's dtype).")] = "float16",
    shard_chunks: Annotated[int, typer.Option("--shard-chunks", metavar="N", help="Chunks per shard.")] = 16,
    batch: Annotated[int, typer.Option("--batch", "-b", metavar="B", help="Chunks per forward pass.")] = 1,
    resume: Annotated[bool, typer.Option("--resume", help="Go on with the interrupted capture in DIR (the same "
                                         "settings): the missing shards are written.")] = False,
    workers: Annotated[int, typer.Option("--workers", metavar="N", help="Write the shards from N local processes "
                                         "(or N Ray actors with --ray); each loads the model once.")] = 1,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="Run the workers as Ray actors on "
                   "the cluster at ADDRESS (auto, ray://host:10001, or local); DIR must be shared by the nodes.",
                   show_default=False)] = None,
    load: CaptureLoadFlags = None,
) -> None:
    from llmtrace.cli.text_input import read_file, strip_one_newline

    if not points:
        raise UsageError("--points is missing; name the points to keep, e.g. --points 6.resid_post")
    if out is None:
        raise UsageError("-o DIR is missing: the directory the shards are written to")
    text = strip_one_newline(read_file(file, "the corpus"))
    if not text.strip():
        raise UsageError(f"{file} is empty: give a text to capture activations over")
    model_ = load_for_cli(load.options())
    from llmtrace.run.capture import capture_corpus

    def progress(done: int, total: int, tokens: int) -> None:
        if sys.stderr.isatty():
            print(f"\rcapture: shard {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    r = capture_corpus(model_, text, points, ctx, out, dtype=store_dtype, chunks=chunks, shard_chunks=shard_chunks,
                       batch=batch, resume=resume, workers=workers, ray=ray, threads=load.threads,
                       on_shard=progress)
    m = r.manifest
    total = len(m["shards"])
    have = len(r.written) + len(r.skipped)
    print(f"{out}: {have} of {total} shards ({m['tokens']:,} tokens in all, {len(m['points'])} points, "
          f"{m['dtype']}); this run wrote {len(r.written)}: {r.tokens:,} tokens in {r.seconds:.1f} s "
          f"({r.tokens_per_s:,.0f} tok/s)", file=sys.stderr)
    if r.interrupted:
        print("interrupted: `--resume` with the same settings writes the missing shards", file=sys.stderr)
        raise typer.Exit(130)
