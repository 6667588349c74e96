"""`llmtrace eval`: perplexity over a text as llama.cpp's llama-perplexity scores it, and with two sides its
KL-divergence statistics, where in the layers the error enters, resumable, on local processes or a Ray cluster."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.compare import side_b_flags
from llmtrace.cli.options import (DeviceOpt, DtypeOpt, FastOpt, ForceOpt, KeepQuantizedOpt, ThreadsOpt, html_target,
                                  interventions_from, json_opt, write_output)
from llmtrace.cli.outputs import check_outputs, control_vector_files
from llmtrace.errors import UsageError

EVAL_HELP = """Score a text as llama.cpp's llama-perplexity does: PPL ± its uncertainty, or two sides' KLD.

The text is cut into chunks of --ctx tokens (BOS first where the model adds one); the second half of each chunk is
scored. Progress goes to stderr (a live bar on a terminal, a line at each tenth elsewhere: the running figure,
tokens/s, time left); the summary to stdout.

Two sides (-m A -m B, or -m once and a --b-… option as compare takes them): A is the base, B the model under test;
KL(A‖B) mean, max and percentiles, Δp of the next token, same top, PPL of each side and their ln ratio, each ± its
uncertainty. --layers adds where the error enters: per layer, the relative error it adds (compare's), and MoE routing
agreement. Or in two runs: --save-base FILE keeps A's log-probs per position (16 bits each: exact; or the top K
with --base-top-k K: smaller, a lower bound), and --base FILE compares the -m model against it.

Examples:

\b
  llmtrace eval wiki.raw -m smollm2-135m-instruct --ctx 512 --chunks 20
  llmtrace eval wiki.raw --ctx 512 --b-dtype bfloat16 --layers
  llmtrace eval wiki.raw -m q4.gguf --b-fast --batch 4 --jsonl run.jsonl
  llmtrace eval wiki.raw -m q4.gguf --b-fast --batch 4 --resume run.jsonl
  llmtrace eval wiki.raw -m f16.gguf --save-base base.safetensors
  llmtrace eval wiki.raw -m q4.gguf --base base.safetensors --html eval.html
  llmtrace eval wiki.raw --workers 4 --threads 2
  llmtrace eval wiki.raw --ray auto --workers 8     # needs the ray extra
"""

EvalJsonOpt = json_opt("the whole run (its settings, every chunk and the summary) as one JSON document")
EvalJsonlOpt = Annotated[Optional[str], typer.Option(
    "--jsonl", metavar="FILE", help="Stream the run to FILE (- for stdout): an `eval` event, a `chunk` event per chunk "
    "as it finishes, and `eval_summary` at the end (also after Ctrl-C, marked interrupted). --resume FILE goes on.",
    show_default=False)]


def _sides(models: Optional[list[str]], b_changes: dict, base: Optional[str]) -> tuple[Optional[str], Optional[str], bool]:
    """(spec A, spec B, two sides?)."""
    models = models or []
    if len(models) > 2:
        raise UsageError(f"eval takes at most two models, -m A -m B; {len(models)} were given")
    if base is not None and (len(models) == 2 or b_changes):
        raise UsageError("--base compares the -m model against the base file: give one -m and no --b-… option")
    if len(models) == 2:
        return models[0], models[1], True
    return (models[0] if models else None), None, bool(b_changes)


@app.command("eval", help=EVAL_HELP)
def eval_command(
    file: Annotated[Path, typer.Argument(help="The UTF-8 text to score (- for stdin).", show_default=False)],
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="The model (side A); repeat for side B: -m A -m B.", show_default=False)] = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="Tokens per chunk; the second half of each is scored.")] = 512,
    chunks: Annotated[Optional[int], typer.Option("--chunks", metavar="K", help="Score at most K chunks.", show_default=False)] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", metavar="B", help="Chunks per forward pass, the rows of one batch (default: 2048 // --ctx, as llama-perplexity's default batch holds them).", show_default=False)] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    keep_quantized: KeepQuantizedOpt = False,
    fast: FastOpt = False,
    b_dtype: Annotated[Optional[str], typer.Option("--b-dtype", help="Side B's dtype.", show_default=False)] = None,
    b_device: Annotated[Optional[str], typer.Option("--b-device", help="Side B's device.", show_default=False)] = None,
    b_keep_quantized: Annotated[Optional[bool], typer.Option("--b-keep-quantized/--b-dequantized", help="Side B keeps a GGUF's quantized blocks, or not.", show_default=False)] = None,
    b_fast: Annotated[bool, typer.Option("--b-fast", help="Side B on --fast's int4 kernels (bfloat16; approximate).")] = False,
    b_ablate: Annotated[Optional[list[str]], typer.Option("--b-ablate", metavar="L.hH|L.eK|L.attn|L.ffn", help="Side B with --ablate (repeatable).", show_default=False)] = None,
    b_scale: Annotated[Optional[list[str]], typer.Option("--b-scale", metavar="L.hH=α", help="Side B with --scale (repeatable).", show_default=False)] = None,
    b_steer: Annotated[Optional[int], typer.Option("--b-steer", metavar="L", help="Side B with --steer (with --b-toward, --b-away-from, --b-strength).", show_default=False)] = None,
    b_toward: Annotated[Optional[str], typer.Option("--b-toward", metavar="TEXT", help="--b-steer's positive text.", show_default=False)] = None,
    b_away_from: Annotated[Optional[str], typer.Option("--b-away-from", metavar="TEXT", help="--b-steer's negative text.", show_default=False)] = None,
    b_strength: Annotated[float, typer.Option("--b-strength", metavar="α", help="--b-steer's factor α.")] = 1.0,
    b_control_vector: Annotated[Optional[list[str]], typer.Option("--b-control-vector", metavar="FILE[:SCALE]", help="Side B with a llama.cpp control vector (repeatable).", show_default=False)] = None,
    ids_from: Annotated[Optional[str], typer.Option("--ids-from", metavar="a", help="a: feed A's token ids to both sides when the tokenizers disagree.", show_default=False)] = None,
    save_base: Annotated[Optional[str], typer.Option("--save-base", metavar="FILE", help="Write the model's log-probs per scored position to FILE (safetensors), for --base: every entry as 16 bits (exact), or see --base-top-k.", show_default=False)] = None,
    base: Annotated[Optional[str], typer.Option("--base", metavar="FILE", help="Compare the -m model (with any load option: --fast, --dtype, --keep-quantized) against a --save-base FILE.", show_default=False)] = None,
    layers: Annotated[bool, typer.Option("--layers", help="Two sides: the relative error each layer adds, where positions first diverge, MoE routing agreement.")] = False,
    tolerance: Annotated[float, typer.Option("--tolerance", help="--layers: the relative error above which a position has diverged.")] = 1e-4,
    workers: Annotated[int, typer.Option("--workers", metavar="N", help="Score on N local processes (or N Ray actors with --ray); each loads the model once.")] = 1,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="Run the workers as Ray actors on the cluster at ADDRESS (auto, ray://host:10001, or local). Needs the extra ray: pip install 'llmtrace[ray]', or pip install -e '.[ray]' in a clone.", show_default=False)] = None,
    resume: Annotated[Optional[str], typer.Option("--resume", metavar="FILE", help="Continue the interrupted run whose --jsonl FILE this is (same settings); it is written on.", show_default=False)] = None,
    json_out: EvalJsonOpt = None,
    jsonl: EvalJsonlOpt = None,
    html: Annotated[Optional[str], typer.Option("--html", metavar="FILE", help="Also write the evaluation page (self-contained HTML) to FILE.", show_default=False, callback=html_target)] = None,
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    base_top_k: Annotated[Optional[int], typer.Option("--base-top-k", metavar="K", help="--save-base keeps only the top K log-probs and the rest's mass: K·8+16 bytes a position, and a KLD that is a lower bound (the summary says by how much at most).", show_default=False)] = None,
) -> None:
    with side_b_flags():
        b_ivs = interventions_from(b_ablate, b_scale, None, None, b_steer, b_toward, b_away_from, b_strength,
                                   b_control_vector)
    b_changes = {k: v for k, v in (("dtype", b_dtype), ("device", b_device), ("keep_quantized", b_keep_quantized),
                                   ("fast", b_fast or None), ("interventions", tuple(b_ivs) or None)) if v is not None}
    spec_a, spec_b, two = _sides(model, b_changes, base)
    if resume is not None:
        if jsonl not in (None, resume):
            raise UsageError("--resume FILE writes on FILE: give no other --jsonl")
        jsonl = resume
    check_outputs({"--resume" if resume is not None else "--jsonl": jsonl, "--json": json_out, "--html": html,
                   "--save-base": save_base},
                  {"the text to score": file, "a model (-m)": model, "the --base file": base,
                   "a control vector (--b-control-vector)": control_vector_files(b_ivs)}, force=force)
    text = _read_text(file)
    events = _resume_events(resume)
    from llmtrace.api import LoadOptions

    LoadOptions(device=device, dtype=dtype, keep_quantized=keep_quantized, fast=fast, threads=threads)
    with side_b_flags(tuple(b_changes)):  # B's values, its errors naming B's flags
        LoadOptions(**{"device": device, "dtype": dtype, "keep_quantized": keep_quantized, "fast": fast,
                       **{k: v for k, v in b_changes.items() if k != "interventions"}})
    from llmtrace.run.compare import Side

    side_a = Side(model=spec_a, dtype=dtype, device=device, keep_quantized=keep_quantized, fast=fast)
    side_b = side_a.with_changes(model=spec_b, **b_changes) if two else None
    from llmtrace.checkpoint.devices import set_threads

    set_threads(threads)
    _run(side_a, side_b, text, events, jsonl, json_out, html,
         dict(base=base, ctx=ctx, chunks=chunks, batch=batch, save_base=save_base, base_top_k=base_top_k, layers=layers,
              tolerance=tolerance, workers=workers, ray=ray, threads=threads if (workers > 1 or ray) else None,
              ids_from=ids_from))


def _read_text(file: Path) -> str:
    from llmtrace.cli.text_input import read_file, strip_one_newline

    text = strip_one_newline(read_file(file, "the text"))
    if not text.strip():
        raise UsageError(f"{file} is empty: give a text to score")
    return text


def _resume_events(resume: Optional[str]) -> Optional[list[dict]]:
    if resume is None:
        return None
    if not Path(resume).is_file():
        raise UsageError(f"--resume {resume}: no such file (it is the --jsonl FILE of the run to continue)")
    from llmtrace.run.eval import read_events

    return read_events(resume)


class _Stream:
    """The --jsonl stream: one line per event, flushed, so that a Ctrl-C or a kill leaves whole lines."""

    def __init__(self, target: Optional[str]):
        self.target, self.f = target, None

    def start(self, header: dict, kept: list[dict]) -> None:
        if self.target is None:
            return
        lines = "".join(json.dumps(ev, ensure_ascii=False) + "\n" for ev in [header] + kept)
        if self.target == "-":
            self.f = sys.stdout
            self.f.write(lines)
        else:
            write_output(self.target, lines)  # the header and the chunks kept (a resumed run's summary dropped)
            self.f = open(self.target, "a", encoding="utf-8")
        self.f.flush()

    def write(self, ev: dict) -> None:
        if self.f is not None:
            from llmtrace.fsutil import sigint_deferred

            with sigint_deferred():
                self.f.write(json.dumps(ev, ensure_ascii=False) + "\n")
                self.f.flush()

    def close(self) -> None:
        if self.f is not None and self.f is not sys.stdout:
            self.f.close()


def _run(side_a, side_b, text: str, events, jsonl, json_out, html, options: dict) -> None:
    from llmtrace.api import evaluate
    from llmtrace.render.eval import summary_text

    stream = _Stream(jsonl)
    try:
        with side_b_flags():
            result = evaluate(side_a, text, b=side_b, resume=events, on_start=stream.start,
                              on_chunk=lambda rec, _p: stream.write(rec), progress=True, **options)
        stream.write(result.summary)
    finally:
        stream.close()
    out = sys.stderr if "-" in (jsonl, json_out) else sys.stdout
    print(summary_text(result.header, result.summary), file=out, end="", flush=True)
    if json_out:
        write_output(json_out, json.dumps(result.to_json(), ensure_ascii=False) + "\n")
    if result.base_written:
        form = result.header["base_form"]
        kept = "16-bit log-probs of every token" if form == "exact" else f"top {result.header['top_k']} log-probs"
        print(f"wrote {result.base_written} ({kept} per position)", file=sys.stderr)
    if html and not result.interrupted:
        n = result.report(html)
        print(f"wrote {html} ({n / 1e6:.2f} MB)", file=sys.stderr)
    if result.interrupted:
        raise typer.Exit(130)
