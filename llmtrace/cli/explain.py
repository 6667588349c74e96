"""Commands: `explain` (one decoder layer taken apart, step by step) and `lens` (the logit lens across all layers).

Both are thin: read the prompt, load the model, ask the API for the events of one forward pass, written to `--jsonl` as
they are made, then render them (llmtrace.render.explain, on stdout) and write `--json` and `--html`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.batch_input import PromptFlags
from llmtrace.cli.options import (INTERVENTIONS_HELP, ChatOpt, ForceOpt, HtmlOpt, InterventionFlags, JsonlOpt, JsonOpt,
                                  LoadFlags, SystemOpt, ViewLangOpt, flag_groups, load_for_cli, write_html)
from llmtrace.cli.outputs import check_outputs, control_vector_files
from llmtrace.errors import UsageError
from llmtrace import sigint
from llmtrace.console import make_console
from llmtrace.render.explain import render_explain, render_lens

EXPLAIN_HELP = """Take one decoder layer apart on your prompt: every step of s6.1–s6.8 with real numbers.

Shows, for layer N (negative N counts from the end): its parameters and FLOPs; RMSNorm; Q/K/V shapes and which query
heads share each KV head (GQA); RoPE angles and a check that q·k depends only on the distance; the attention scores,
mask and softmax, with a heatmap; the output projection and residual; the SwiGLU FFN; the KV-cache write; and the logit
lens (what the model would predict if it stopped after this layer). All numbers come from one forward pass.

Examples:

  llmtrace explain "The capital of France is" --layer 3

  llmtrace explain "The capital of France is" --layer -1 --head 4

  llmtrace explain "Write a haiku" --chat --layer 10 --json - | jq '.events[] | select(.section == "ffn")'

  llmtrace explain -f prompt.txt --layer 0 --jsonl explain.jsonl

  llmtrace explain "The capital of France is" --layer 3 --html explain.html

  llmtrace explain "The capital of France is" --layer 4 --ablate 3.h2      # layer 4 with a head of layer 3 ablated

""" + INTERVENTIONS_HELP

LENS_HELP = """The logit lens: what the model would predict after each layer, at each position.

Applies the final RMSNorm and the LM head to the residual stream after every layer (one forward pass). Each row is a
layer, each column a prompt position, each cell the top-1 token there, coloured by its probability; underlined cells
already predict the prompt's real next token. The last 12 positions are shown unless --positions or --last says more.

Examples:

  llmtrace lens "The capital of France is"

  llmtrace lens "The capital of France is" --positions all --layers 20-29

  llmtrace lens "Once upon a time there was" --last 4 --top 10 --jsonl -

  llmtrace lens "The capital of France is" --positions all --html lens.html

  llmtrace lens -p "The capital of France is" -p "Hi" --row 0   # s3: each row's padded mask, then row 0's lens

  llmtrace lens "The capital of France is" --patch 10.resid_post@-1 --from "The capital of Italy is"

The Jacobian lens reads each layer through J_l, the average Jacobian from its output to the last layer's over a
corpus, instead of J = I: fit it once, then read prompts through it.

  llmtrace lens --fit-jacobian wiki.raw --ctx 32 --chunks 8 -o lens.safetensors

  llmtrace lens "The capital of France is" --jacobian lens.safetensors --html jlens.html

""" + INTERVENTIONS_HELP

RowOpt = Annotated[int, typer.Option("--row", help="With several prompts (-p … -p …, --prompts): the row to take apart, "
                                     "0-based. Every row's combined causal and padding mask is shown first (s3).")]

# ----------------------------------------------------------------------------------------------------------------
# the commands


@app.command(help=EXPLAIN_HELP)
@flag_groups
def explain(
    prompts: PromptFlags,
    layer: Annotated[int, typer.Option("--layer", "-l", help="The layer to explain, 0-based; -1 is the last.")] = 0,
    head: Annotated[Optional[int], typer.Option(
        "--head", help="Query head for the heatmap and examples (default: the mean over heads).", show_default=False)] = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    top: Annotated[int, typer.Option("--top", help="Candidates shown by the logit lens.")] = 5,
    jsonl: JsonlOpt = None,
    json_out: JsonOpt = None,
    html: HtmlOpt = None,
    lang: ViewLangOpt = "en",
    load: LoadFlags = None,
    row: RowOpt = 0,
    interventions: InterventionFlags = None,
    force: ForceOpt = False,
) -> None:
    from llmtrace.api import ExplainOptions

    options = ExplainOptions(layer=layer, head=head, top=top, chat=chat, system=system, row=row,
                             interventions=interventions.parse())
    _check_outputs(jsonl, json_out, html, prompts, load, options, force)
    texts = prompts.read(row)
    _run("explain", lambda m, sinks: m.explain_with(texts, options, sinks=sinks), load.options(), jsonl, json_out, html,
         lang)


@app.command(help=LENS_HELP)
@flag_groups
def lens(
    prompts: PromptFlags,
    positions: Annotated[Optional[str], typer.Option(
        "--positions", help="Prompt positions to show: all, 0,3,-1 or 2-5 (default: the last --last).", show_default=False)] = None,
    last: Annotated[int, typer.Option("--last", help="Without --positions, show this many final positions.")] = 12,
    layers: Annotated[Optional[str], typer.Option(
        "--layers", help="Layers (rows) to show, e.g. 0,3,-1 or 20-29 (default: all).", show_default=False)] = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    top: Annotated[int, typer.Option("--top", help="Candidates recorded per cell in --json/--jsonl.")] = 5,
    jsonl: JsonlOpt = None,
    json_out: JsonOpt = None,
    html: HtmlOpt = None,
    lang: ViewLangOpt = "en",
    load: LoadFlags = None,
    row: RowOpt = 0,
    interventions: InterventionFlags = None,
    force: ForceOpt = False,
    fit_jacobian: Annotated[Optional[Path], typer.Option("--fit-jacobian", metavar="CORPUS", help="Fit the Jacobian "
                            "lens over CORPUS (a UTF-8 text) and write it to -o FILE, instead of drawing a lens.",
                            show_default=False)] = None,
    jacobian: Annotated[Optional[Path], typer.Option("--jacobian", metavar="FILE", help="Read the prompt out through "
                        "the Jacobian lens FILE: softmax(W_U · norm(J_l · h_l)) (J = I is the logit lens).",
                        show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE", help="With --fit-jacobian: the "
                      "lens file to write (safetensors).", show_default=False)] = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="With --fit-jacobian: tokens per chunk.")] = 64,
    chunks: Annotated[Optional[int], typer.Option("--chunks", metavar="N", help="With --fit-jacobian: stop after N "
                      "chunks (default: the whole text).", show_default=False)] = None,
    workers: Annotated[int, typer.Option("--workers", metavar="N", help="With --fit-jacobian: fit on N local "
                       "processes (or N Ray actors with --ray); their sums are added in chunk order.")] = 1,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="With --fit-jacobian: run the "
                   "workers as Ray actors on the cluster at ADDRESS (auto, ray://host:10001, or local).",
                   show_default=False)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="With --fit-jacobian: go on with the interrupted fit of "
                      "-o FILE.")] = False,
) -> None:
    from llmtrace.api import LensOptions

    if fit_jacobian is not None:
        from llmtrace.cli.jlens import fit_command

        # --resume goes on writing the lens file it names; otherwise the rule of every output (cli.outputs)
        check_outputs({"-o": None if output is None else str(output)},
                      {"the corpus (--fit-jacobian)": str(fit_jacobian), "the model (-m)": load.model},
                      force=force or resume)
        code = fit_command(fit_jacobian, output, ctx, chunks, workers, ray, resume, load.options(), load.threads)
        if code:
            raise typer.Exit(code)
        return
    if jacobian is not None:
        from llmtrace.cli.jlens import readout_command

        if lang != "en":
            raise UsageError("the Jacobian lens page is in English only: leave out --lang")
        check_outputs({"--json": json_out, "--html": html},
                      prompts.inputs() | {"the lens file (--jacobian)": str(jacobian), "the model (-m)": load.model},
                      force=force)
        readout_command(prompts.read(), jacobian, load.options(), last, top, chat, json_out, html)
        return

    options = LensOptions(positions=positions, last=last, layers=layers, top=top, chat=chat, system=system, row=row,
                          interventions=interventions.parse())
    _check_outputs(jsonl, json_out, html, prompts, load, options, force)
    texts = prompts.read(row)
    _run("lens", lambda m, sinks: m.lens_with(texts, options, sinks=sinks), load.options(), jsonl, json_out, html, lang)


def _check_outputs(jsonl, json_out, html, prompts, load, options, force: bool) -> None:
    check_outputs({"--json": json_out, "--jsonl": jsonl, "--html": html},
                  prompts.inputs() | {"the model (-m)": load.model,
                                      "a control vector (--control-vector)": control_vector_files(options.interventions)},
                  force=force)


def _release() -> None:
    """Everything the run needs imported while Ctrl-C is held (llmtrace/sigint.py); interruptible from here on."""
    import llmtrace.api  # noqa: F401
    import llmtrace.checkpoint.load  # noqa: F401
    import llmtrace.run.explain  # noqa: F401

    sigint.release()


def _run(command: str, pass_of, load_args, jsonl: Optional[str], json_out: Optional[str], html: Optional[str],
         lang: str = "en") -> None:
    """Load, run the pass (`pass_of(model, sinks)`) with the --jsonl stream written as its events are made, then the
    other outputs. As generate's: the stream ends with a summary, interrupted after Ctrl-C (exit 130), and a file is
    replaced only once the run has an event to write (a Ctrl-C during the load leaves it as it was; on stdout the
    stream is then that summary alone)."""
    from llmtrace.fsutil import sigint_deferred
    from llmtrace.trace.writers import JsonlWriter

    jsonl_sink = JsonlWriter(jsonl) if jsonl else None
    try:
        _release()
        model_ = load_for_cli(load_args)
        trace = pass_of(model_, [jsonl_sink] if jsonl_sink is not None else [])
    except KeyboardInterrupt:
        if jsonl_sink is not None and not jsonl_sink.started and jsonl_sink.target == "-":
            with sigint_deferred():
                jsonl_sink({"event": "summary", "command": command, "prompt_tokens": 0, "interrupted": True})
        raise
    finally:
        if jsonl_sink is not None:
            jsonl_sink.close()
    _output(trace, render_lens if command == "lens" else render_explain, jsonl, json_out, html, lang)
    if trace.interrupted:
        raise typer.Exit(130)


def _output(trace, render, jsonl: Optional[str], json_out: Optional[str], html: Optional[str] = None,
            lang: str = "en") -> None:
    """The document and the page (not of a pass cut short by Ctrl-C: the stream and the document say how far it got);
    the view to stdout, or to stderr (if a terminal) when stdout carries data."""
    from llmtrace.trace.writers import JsonDocWriter

    events = trace.events
    if json_out:
        doc = JsonDocWriter(json_out)
        for ev in events:
            doc(ev)
        doc.write()
    if html and not trace.interrupted:
        write_html(events, html, trace.tokenizer, lang=lang)
    if "-" not in (jsonl, json_out) or sys.stderr.isatty():
        from llmtrace.render.say import Say
        from llmtrace.report.explain_view import localized

        view = localized(events, lang) if render is render_explain else events  # its formulas in the view's language
        render(view, make_console(stderr="-" in (jsonl, json_out)), Say(lang))
