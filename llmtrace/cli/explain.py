"""Commands: `explain` (one decoder layer taken apart, step by step) and `lens` (the logit lens across all layers).

Both are thin: read the prompt, load the model, ask llmtrace.run.explain for the events of one forward pass, and render
those events (llmtrace.render.explain, on stdout) or write them (`--json` / `--jsonl`).
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import (ChatOpt, DeviceMapOpt, DeviceOpt, DtypeOpt, FastOpt, FileOpt, JsonlOpt, JsonOpt,
                                  KeepQuantizedOpt, MaxMemoryOpt, ModelOpt, OffloadDirOpt, PromptArg, SystemOpt,
                                  ThreadsOpt, check_outputs, HtmlOpt, load_options, say_fast_note,
                                  write_html)
from llmtrace.cli.batch_input import MaxBatchOpt, PromptsFileOpt, PromptsOpt, read_prompt_list
from llmtrace.errors import UsageError
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
"""

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
"""

RowOpt = Annotated[int, typer.Option("--row", help="With several prompts (-p … -p …, --prompts): the row to take apart, "
                                     "0-based. Every row's combined causal and padding mask is shown first (s3).")]

# ----------------------------------------------------------------------------------------------------------------
# the commands


@app.command(help=EXPLAIN_HELP)
def explain(
    prompt: PromptArg = None,
    layer: Annotated[int, typer.Option("--layer", "-l", help="The layer to explain, 0-based; -1 is the last.")] = 0,
    head: Annotated[Optional[int], typer.Option(
        "--head", help="Query head for the heatmap and examples (default: the mean over heads).", show_default=False)] = None,
    model: ModelOpt = None,
    file: FileOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    top: Annotated[int, typer.Option("--top", help="Candidates shown by the logit lens.")] = 5,
    jsonl: JsonlOpt = None,
    json_out: JsonOpt = None,
    html: HtmlOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    keep_quantized: KeepQuantizedOpt = False,
    fast: FastOpt = False,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadDirOpt = None,
    threads: ThreadsOpt = None,
    prompt_list: PromptsOpt = None,
    prompts_file: PromptsFileOpt = None,
    max_batch: MaxBatchOpt = 64,
    row: RowOpt = 0,
) -> None:
    from llmtrace.run.explain import explain_events

    texts = read_prompt_list(prompt_list, prompts_file, max_batch)
    text = _check_common(prompt, file, chat, system, top, jsonl, json_out, html, texts, row)
    lm = _load(model, device, dtype, threads, load_options(model, keep_quantized, device_map, max_memory, offload_dir, fast))
    prompt_text, ids = lm.tokenizer.encode_prompt(text, chat=chat, system=system)
    events = explain_events(lm, ids, layer, head=head, top=top, prompt=prompt_text, chat=chat)
    events = _with_batch(lm, texts, row, chat, system, events)
    _output(events, render_explain, jsonl, json_out, html, lm.tokenizer)


@app.command(help=LENS_HELP)
def lens(
    prompt: PromptArg = None,
    positions: Annotated[Optional[str], typer.Option(
        "--positions", help="Prompt positions to show: all, 0,3,-1 or 2-5 (default: the last --last).", show_default=False)] = None,
    last: Annotated[int, typer.Option("--last", help="Without --positions, show this many final positions.")] = 12,
    layers: Annotated[Optional[str], typer.Option(
        "--layers", help="Layers (rows) to show, e.g. 0,3,-1 or 20-29 (default: all).", show_default=False)] = None,
    model: ModelOpt = None,
    file: FileOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    top: Annotated[int, typer.Option("--top", help="Candidates recorded per cell in --json/--jsonl.")] = 5,
    jsonl: JsonlOpt = None,
    json_out: JsonOpt = None,
    html: HtmlOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    keep_quantized: KeepQuantizedOpt = False,
    fast: FastOpt = False,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadDirOpt = None,
    threads: ThreadsOpt = None,
    prompt_list: PromptsOpt = None,
    prompts_file: PromptsFileOpt = None,
    max_batch: MaxBatchOpt = 64,
    row: RowOpt = 0,
) -> None:
    from llmtrace.run.explain import lens_events, parse_positions
    from llmtrace.run.generate import check_context
    from llmtrace.trace.indices import parse_layers

    texts = read_prompt_list(prompt_list, prompts_file, max_batch)
    text = _check_common(prompt, file, chat, system, top, jsonl, json_out, html, texts, row)
    if last < 1:
        raise UsageError("--last must be ≥ 1")
    lm = _load(model, device, dtype, threads, load_options(model, keep_quantized, device_map, max_memory, offload_dir, fast))
    prompt_text, ids = lm.tokenizer.encode_prompt(text, chat=chat, system=system)
    check_context(lm, len(ids), 0)
    rows = parse_layers(layers, lm.config.n_layers)
    cols = parse_positions(positions, len(ids), last)
    events = lens_events(lm, ids, cols, rows, top=top, prompt=prompt_text, chat=chat)
    events = _with_batch(lm, texts, row, chat, system, events)
    _output(events, render_lens, jsonl, json_out, html, lm.tokenizer)


def _with_batch(lm, texts: Optional[list[str]], row: int, chat: bool, system: Optional[str], events: list[dict]):
    """Several prompts: the s3 batch event (every row's padded ids and combined mask) before the row's events."""
    if texts is None or len(texts) < 2:
        return events
    from llmtrace.run.explain import batch_event

    prompts = [lm.tokenizer.encode_prompt(t, chat=chat, system=system)[1] for t in texts]
    for r, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {r + 1} of the batch is empty (it encodes to zero tokens); give some text")
    return events[:1] + [batch_event(lm.tokenizer, prompts, row)] + events[1:]


def _check_common(prompt, file, chat, system, top, jsonl, json_out, html=None, texts=None, row=0) -> str:
    """Everything the user typed that can be checked before the (slow) model load. Returns the prompt text (with
    several prompts, `texts`, the one of --row)."""
    from llmtrace.cli.text_input import read_prompt

    if not 1 <= top <= 100:
        raise UsageError("--top must be between 1 and 100")
    check_outputs(json_out, jsonl, html)
    if system is not None and not chat:
        raise UsageError("--system only applies with --chat")
    if texts is not None:
        if prompt is not None or file is not None:
            raise UsageError("give the prompt as an argument or --file, or prompts with -p/--prompts, not both")
        if not 0 <= row < len(texts):
            raise UsageError(f"--row {row} is out of range; the batch has {len(texts)} prompts (rows 0..{len(texts) - 1})")
        return texts[row]
    if row != 0:
        raise UsageError("--row picks one of several prompts; give them with -p … -p … or --prompts")
    text = read_prompt(prompt, file)
    if text == "":
        raise UsageError("the prompt is empty; give some text")
    return text


def _load(model, device, dtype, threads, scale: dict):
    from llmtrace.checkpoint.load import load_model
    from llmtrace.checkpoint.devices import pick_device, pick_dtype, set_threads

    pick_dtype(dtype, pick_device(device))  # --device cuda without CUDA fails before a download or a load, as in generate
    set_threads(threads)
    lm = load_model(model, device=device, dtype=dtype, **scale)
    say_fast_note(lm)
    return lm


def _output(events: list[dict], render, jsonl: Optional[str], json_out: Optional[str], html: Optional[str] = None,
            tokenizer=None) -> None:
    """Machine formats to their targets; the view to stdout, or to stderr (if a terminal) when stdout carries data."""
    from llmtrace.fsutil import sigint_deferred
    from llmtrace.trace.sinks import JsonDocSink, JsonlSink

    if jsonl:
        sink = JsonlSink(jsonl)
        try:
            with sigint_deferred():  # the events exist already: the stream is written whole
                for ev in events:
                    sink(ev)
        finally:
            sink.close()
    if json_out:
        doc = JsonDocSink(json_out)
        for ev in events:
            doc(ev)
        doc.write()
    if html:
        write_html(events, html, tokenizer)
    if "-" not in (jsonl, json_out):
        render(events, make_console())
    elif sys.stderr.isatty():
        render(events, make_console(stderr=True))
