"""`llmtrace compare` (two models, or one under two settings, on one prompt) and `llmtrace diff` (two saved traces)."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.batch_input import PromptsFileOpt, read_prompt_list
from llmtrace.cli.options import (ChatOpt, DeviceOpt, DtypeOpt, FileOpt, ForceOpt, JsonOpt, KeepQuantizedOpt, LangOpt,
                                  PromptArg, SystemOpt, ThreadsOpt, check_lang, html_target, interventions_from,
                                  jsonl_opt, write_output)
from llmtrace.cli.outputs import check_outputs, control_vector_files
from llmtrace.cli.text_input import read_prompt
from llmtrace.errors import UsageError

# compare and diff have their figures only at the end: the stream is written then, whole or not at all
JsonlOpt = jsonl_opt("the comparison as events (compare, then one compare_layer per layer and one compare_position "
                     "per position)", " when the comparison is done, whole or not at all (an existing FILE is kept "
                     "until then)")
HtmlOpt = Annotated[Optional[str], typer.Option(
    "--html", metavar="FILE", help="Also write the comparison page (one self-contained HTML file) to FILE.",
    show_default=False, callback=html_target)]

COMPARE_HELP = """Run one prompt through two models (or one model under two settings) and find where they part.

At every point of every layer (attn_norm, q, k, v, q_rope, …, resid_post; then final_norm and logits) and at every
position: relative error ‖a−b‖/‖a‖, max |a−b| and cosine, in float64. The first line names the first point, in
forward order, whose error exceeds --tolerance. Each layer's error is shown twice: accumulated (its output) and added
(B's layer run on A's input, against A's layer: zero for a layer whose weights and maths agree). Then the answers:
KL(P_A‖P_B) per position, same top-1, Δp = P_B(A's top) − P_A(A's top).

Side B is side A with B's options changed: give -m twice, or -m once and a --b-… option (--b-dtype, --b-device,
--b-keep-quantized, --b-fast, or an intervention: --b-ablate, --b-scale, --b-patch, --b-steer, --b-control-vector,
spelled as generate's --ablate, ...). With -n N, both sides also read A's N greedy tokens (teacher forcing), so
positions line up.

Examples:

\b
  llmtrace compare "The capital of France is" -m model.gguf --b-dtype bfloat16
  llmtrace compare "Hello" -m model.Q4_1.gguf --b-keep-quantized -n 8
  llmtrace compare "Hello" -m ./Llama-3.2-1B -m llama-3.2-1b.Q8_0.gguf \\
      --ids-from a --json out.json --html out.html
  llmtrace compare -p "One" -p "Two" -m A -m B --tolerance 1e-3
  llmtrace compare "The capital of France is" --b-ablate 3.h2   # one head
  llmtrace compare --file passage.txt --b-fast     # how far --fast drifts
  llmtrace compare "Hello" --b-ablate 0.attn --html cmp.html --lang zh   # the page in Chinese
"""


def _model_list(models: Optional[list[str]], b_changes: dict) -> tuple[Optional[str], Optional[str]]:
    models = models or []
    if len(models) > 2:
        raise UsageError(f"compare takes two models, -m A -m B; {len(models)} were given")
    if len(models) == 2:
        return models[0], models[1]
    if not b_changes:
        what = f"-m {models[0]}" if models else "no -m"
        raise UsageError(f"compare needs two sides: with {what} they would be the same; give a second -m, or a --b-… "
                         f"option that changes side B (e.g. --b-dtype bfloat16)")
    return (models[0] if models else None), None


@app.command(help=COMPARE_HELP, no_args_is_help=False)
def compare(
    prompt: PromptArg = None,
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Side A's model, then side B's (repeat: -m A -m B). One -m: both sides, B changed by --b-… options.", show_default=False)] = None,
    file: FileOpt = None,
    prompt_list: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt; repeat it to compare over several prompts (summarized together).", show_default=False)] = None,
    prompts_file: PromptsFileOpt = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Also compare this many decode steps (A's greedy tokens fed to both sides). 0: the prompt only.")] = 0,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Relative error above which two tensors differ.")] = 1e-4,
    ids_from: Annotated[Optional[str], typer.Option("--ids-from", metavar="a", help="a: feed A's token ids to both sides when the tokenizers disagree.", show_default=False)] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    keep_quantized: KeepQuantizedOpt = False,
    b_dtype: Annotated[Optional[str], typer.Option("--b-dtype", help="Side B's dtype (default: side A's).", show_default=False)] = None,
    b_device: Annotated[Optional[str], typer.Option("--b-device", help="Side B's device (default: side A's).", show_default=False)] = None,
    b_keep_quantized: Annotated[Optional[bool], typer.Option("--b-keep-quantized/--b-dequantized", help="Side B keeps a GGUF's quantized blocks, or not (default: as side A).", show_default=False)] = None,
    b_fast: Annotated[bool, typer.Option("--b-fast", help="Side B runs the GGUF on --fast's int4 kernels (bfloat16; approximate).")] = False,
    b_ablate: Annotated[Optional[list[str]], typer.Option("--b-ablate", metavar="L.hH|L.eK|L.attn|L.ffn",
                                                          help="Side B with --ablate (repeatable).",
                                                          show_default=False)] = None,
    b_scale: Annotated[Optional[list[str]], typer.Option("--b-scale", metavar="L.hH=α", help="Side B with --scale (repeatable).", show_default=False)] = None,
    b_patch: Annotated[Optional[list[str]], typer.Option("--b-patch", metavar="L.POINT@P", help="Side B with --patch (with --b-from).", show_default=False)] = None,
    b_from: Annotated[Optional[str], typer.Option("--b-from", metavar="TEXT", help="--b-patch's source text.", show_default=False)] = None,
    b_steer: Annotated[Optional[int], typer.Option("--b-steer", metavar="L", help="Side B with --steer (with --b-toward, --b-away-from, --b-strength).", show_default=False)] = None,
    b_toward: Annotated[Optional[str], typer.Option("--b-toward", metavar="TEXT", help="--b-steer's positive text.", show_default=False)] = None,
    b_away_from: Annotated[Optional[str], typer.Option("--b-away-from", metavar="TEXT", help="--b-steer's negative text.", show_default=False)] = None,
    b_strength: Annotated[float, typer.Option("--b-strength", metavar="α", help="--b-steer's factor α.")] = 1.0,
    b_control_vector: Annotated[Optional[list[str]], typer.Option("--b-control-vector", metavar="FILE[:SCALE]", help="Side B with a llama.cpp control vector (repeatable).", show_default=False)] = None,
    json_out: JsonOpt = None,
    jsonl: JsonlOpt = None,
    html: HtmlOpt = None,
    lang: LangOpt = "en",
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
) -> None:
    from llmtrace.api import LoadOptions

    check_lang(lang, html)

    with side_b_flags():
        b_interventions = interventions_from(b_ablate, b_scale, b_patch, b_from, b_steer, b_toward, b_away_from,
                                             b_strength, b_control_vector)
    b_changes = {k: v for k, v in (("dtype", b_dtype), ("device", b_device), ("keep_quantized", b_keep_quantized),
                                   ("fast", b_fast or None), ("interventions", tuple(b_interventions) or None))
                 if v is not None}
    spec_a, spec_b = _model_list(model, b_changes)
    if max_new_tokens < 0:
        raise UsageError("--max-new-tokens must be ≥ 0")
    if not tolerance > 0:
        raise UsageError(f"--tolerance must be > 0, not {tolerance:g}")
    if ids_from not in (None, "a"):
        raise UsageError(f"--ids-from takes a (A's ids for both sides), not {ids_from!r}")
    if system is not None and not chat:
        raise UsageError("--system only applies with --chat")
    check_outputs({"--json": json_out, "--jsonl": jsonl, "--html": html},
                  {"the prompt file (--file)": file, "the prompts file (--prompts)": prompts_file, "a model (-m)": model,
                   "a control vector (--b-control-vector)": control_vector_files(b_interventions)}, force=force)
    texts = read_prompt_list(prompt_list, prompts_file, sys.maxsize)
    if texts is not None and (prompt is not None or file is not None):
        raise UsageError("give the prompt as an argument or --file, or prompts with -p/--prompts, not both")
    text = read_prompt(prompt, file) if texts is None else texts
    # each side's load values, before torch is imported (B's errors name B's flags for what B changes)
    LoadOptions(device=device, dtype=dtype, keep_quantized=keep_quantized, threads=threads)
    with side_b_flags(tuple(b_changes)):
        LoadOptions(**{"device": device, "dtype": dtype, "keep_quantized": keep_quantized,
                       **{k: v for k, v in b_changes.items() if k != "interventions"}})

    from llmtrace.api import compare as run_compare
    from llmtrace.checkpoint.devices import set_threads
    from llmtrace.run.compare import Side

    side_a = Side(model=spec_a, dtype=dtype, device=device, keep_quantized=keep_quantized)
    side_b = side_a.with_changes(model=spec_b, **b_changes)

    set_threads(threads)
    with side_b_flags():
        result = run_compare(side_a, side_b, text, max_new_tokens=max_new_tokens, chat=chat, system=system,
                             tolerance=tolerance, ids_from=ids_from, progress=_progress)
    show(result.to_json(), json_out, jsonl)
    if html:
        n = result.report(html, lang)
        print(f"wrote {html} ({n / 1e6:.2f} MB)", file=sys.stderr)


INTERVENTION_FIELDS = ("ablate", "scale", "patch", "from", "source", "steer", "toward", "away_from", "strength",
                       "control_vector")


@contextlib.contextmanager
def side_b_flags(b_fields: tuple[str, ...] = ()):
    """A value error of side B names compare's flags for it (--b-ablate, --b-from, --b-dtype), not generate's: the
    interventions' fields, and `b_fields` (the load options B's flags changed)."""
    import re

    from llmtrace.cli.options import flag_of
    from llmtrace.errors import BadValue

    try:
        yield
    except BadValue as e:
        if e.field not in INTERVENTION_FIELDS + b_fields:
            raise
        message = e.named(flag_of(e.field), flag_of)
        names = [flag_of(f)[2:] for f in INTERVENTION_FIELDS + b_fields if f != "source"]
        raise UsageError(re.sub(rf"(?<![\w-])--({'|'.join(map(re.escape, names))})(?![\w-])", r"--b-\1",
                                message)) from None


def _progress(message: str) -> None:
    print(f"compare: {message}", file=sys.stderr, flush=True)


def show(doc: dict, json_out: Optional[str], jsonl: Optional[str]) -> None:
    """The terminal view (stdout, or stderr when stdout carries JSON and stderr is a terminal), --json, --jsonl."""
    from llmtrace.console import make_console
    from llmtrace.render.compare import render_compare
    from llmtrace.words import in_words

    doc = doc | {"notes": [in_words(note) for note in doc.get("notes", [])]}  # the CLI's words, in its JSON too
    if json_out:
        write_output(json_out, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    if jsonl:
        from llmtrace.trace.comparison import jsonl_events

        write_output(jsonl, "".join(json.dumps(ev, ensure_ascii=False) + "\n" for ev in jsonl_events(doc)))
    if "-" not in (json_out, jsonl):
        render_compare(doc, make_console())
    elif sys.stderr.isatty():
        render_compare(doc, make_console(stderr=True))


DIFF_HELP = """Compare two saved runs of the same prompt (traces written by generate --json or --jsonl).

With the tensors of both runs (generate --save-tensors FILE.safetensors, which the trace names), the same figures as
`llmtrace compare`: relative error, max |a−b| and cosine at every recorded point and position, the first divergence,
and KLD / same top / Δp where the logits were saved (--dump logits or --trace full). Runs on two machines become
comparable (CUDA against CPU). Decode steps are compared while both runs had generated the same tokens.

Without tensors, what the traces hold: the tokens, the top-k of each step, the sampler ledger, and each recorded
point's statistics (mean, std, min, max, norm).

Examples:

  llmtrace generate "Hello" --trace full -n 4 --json cpu.json --save-tensors cpu.safetensors

  llmtrace generate "Hello" --trace full -n 4 --json gpu.json --save-tensors gpu.safetensors --device cuda

  llmtrace diff cpu.json gpu.json --html diff.html

  llmtrace diff cpu.json gpu.json --html diff-zh.html --lang zh
"""


@app.command(help=DIFF_HELP)
def diff(
    trace_a: Annotated[str, typer.Argument(help="The first trace (A).")],
    trace_b: Annotated[str, typer.Argument(help="The second trace (B).")],
    tolerance: Annotated[float, typer.Option("--tolerance", help="Relative error above which two tensors differ.")] = 1e-4,
    no_tensors: Annotated[bool, typer.Option("--no-tensors", help="Compare what the traces hold, even when their tensors were saved.")] = False,
    json_out: JsonOpt = None,
    jsonl: JsonlOpt = None,
    html: HtmlOpt = None,
    lang: LangOpt = "en",
    force: ForceOpt = False,
) -> None:
    from llmtrace.api import diff as run_diff

    check_lang(lang, html)

    if not tolerance > 0:
        raise UsageError(f"--tolerance must be > 0, not {tolerance:g}")
    check_outputs({"--json": json_out, "--jsonl": jsonl, "--html": html},
                  {"trace A": trace_a, "trace B": trace_b}, force=force)
    result = run_diff(trace_a, trace_b, tolerance=tolerance, tensors=not no_tensors)
    show(result.to_json(), json_out, jsonl)
    if html:
        n = result.report(html, lang)
        print(f"wrote {html} ({n / 1e6:.2f} MB)", file=sys.stderr)
