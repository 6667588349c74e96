"""The options several commands share, as typer `Annotated` aliases, and the rules for their values.

`--json FILE` and `--jsonl FILE` mean the same in every command: write the output as one JSON document, or as one
JSON object per line, to FILE; `-` is stdout. The human view goes to stdout unless one of them takes stdout; then it
goes to stderr, and only when stderr is a terminal.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from typer.core import TyperCommand

from llmtrace.errors import UsageError
from llmtrace.registry.models_toml import DEFAULT_MODEL

# -- what the model reads

PromptArg = Annotated[Optional[str], typer.Argument(help="The prompt text (or use --file, or stdin).", show_default=False)]
FileOpt = Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt from this UTF-8 file.")]
ChatOpt = Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="System message for --chat.")]

# -- where the output goes

def json_opt(what: str = "the output as one JSON document", more: str = ", all at once at the end: an existing FILE "
             "is kept until the new document is complete"):
    """The --json option (declared here only), its help saying what the document holds."""
    return Annotated[Optional[str], typer.Option(
        "--json", metavar="FILE", help=f"Write {what} to FILE (- for stdout){more}.", show_default=False)]


def jsonl_opt(what: str = "the output as one JSON object per line", more: str = ", as it is made: `tail -f FILE` "
              "follows a run. An existing FILE is replaced once the run has its first event to write (a Ctrl-C "
              "before that leaves it as it was). A killed run leaves the lines written so far; after Ctrl-C the last "
              "line is the summary"):
    """The --jsonl option (declared here only), its help saying what each line holds."""
    return Annotated[Optional[str], typer.Option(
        "--jsonl", metavar="FILE", help=f"Write {what} to FILE (- for stdout){more}.", show_default=False)]


JsonOpt = json_opt()
JsonlOpt = jsonl_opt()
ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Write over an existing output file that llmtrace did not write. (Its own files are replaced "
    "without it; an input of the command, never.)")]

# -- the model and where it runs

ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        help=f"Registry name, hub id, local HF directory or .gguf file (default: {DEFAULT_MODEL}).",
        show_default=False,
    ),
]
DeviceOpt = Annotated[
    Optional[str], typer.Option("--device", help="cuda, mps or cpu (default: the best available).", show_default=False)
]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option("--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA).", show_default=False),
]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        help="CPU threads for torch (default: $LLMTRACE_THREADS, else the number of physical cores; on a busy "
        "machine fewer threads can be much faster).",
        show_default=False,
    ),
]
KeepQuantizedOpt = Annotated[
    bool,
    typer.Option("--keep-quantized", help="GGUF only: keep the matrices in their quantized blocks (Q4_0 … Q8_0, "
                 "K-quants) and dequantize each when used: the exact values in memory near the file's size, for steps "
                 "slower than float32's (each step dequantizes every matrix again: 0.2-0.5x on a CPU)."),
]
FastOpt = Annotated[
    bool,
    typer.Option("--fast", help="GGUF only: run the matrices straight from their quantized blocks on torch's int4 "
                 "kernel, activations in bfloat16. Several times faster, and approximate: the trace says "
                 "\"exact\": false; `llmtrace compare --b-fast` measures how far it drifts (docs/performance.md)."),
]
DeviceMapOpt = Annotated[
    Optional[str],
    typer.Option("--device-map", metavar="auto", help="auto: accelerate spreads the layers over GPUs, CPU memory and disk "
                 "(see --max-memory).", show_default=False),
]
MaxMemoryOpt = Annotated[
    Optional[list[str]],
    typer.Option("--max-memory", metavar="DEV=SIZE", help="DEVICE=SIZE a device may hold with --device-map, e.g. cuda:0=20GiB, "
                 "cpu=32GiB (repeatable); what does not fit goes to disk.", show_default=False),
]
OffloadDirOpt = Annotated[
    Optional[Path],
    typer.Option("--offload-dir", metavar="DIR", help="Where --device-map writes layers that go to disk (default: the user cache; "
                 "removed at exit).", show_default=False),
]


# A value's flag, where it is not the field's name with dashes ("top_p" -> --top-p).
FLAG_OF_FIELD = {"order": "--sampler-order", "dry_sequence_breakers": "--dry-sequence-breaker", "level": "--trace",
                 "for_report": "--html", "spec": "--model", "source": "--from"}


def flag_of(field: str) -> str:
    """The command-line flag that gives a library field: a BadValue's message names the flag, not the field."""
    return FLAG_OF_FIELD.get(field) or "--" + field.replace("_", "-")


KEYWORD = re.compile(r"`([a-z_][a-z0-9_]*)(?:=([^`]*))?`")  # `dtype="float32"`, `chat=True`, `save_tensors`


def cli_flags() -> Optional[frozenset]:
    """Every long flag of every command of the CLI that runs (--dtype, --chat, --no-merges, ...), read from its
    commands; None outside a command."""
    try:
        import click

        root = click.get_current_context().find_root().command
    except RuntimeError:  # no command is running
        return None
    return _flags_of(root)


@functools.cache
def _flags_of(command) -> frozenset:
    def walk(cmd):
        yield from (o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
        for sub in getattr(cmd, "commands", {}).values():
            yield from walk(sub)

    return frozenset(walk(command))


def flag_words(text: str, known: Optional[frozenset] = None) -> str:
    """The CLI's words for a library's text: each `keyword=value` it names becomes the flag that gives it
    (`dtype="float32"` -> --dtype float32, `chat=True` -> --chat, `dump=["logits"]` -> --dump logits,
    `save_tensors` -> --save-tensors). A name that is no flag of the running CLI stays as written. The one translation:
    console.in_words applies it while a command runs (cli/main.py)."""
    import json

    def flag(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        option, flags = flag_of(name), known if known is not None else cli_flags()
        if flags is not None and option not in flags:
            return m.group(0)
        if value is None or value == "True":
            return option
        try:
            given = json.loads(value.replace("'", '"'))
        except ValueError:
            given = value
        if isinstance(given, list):
            return " ".join(f"{option} {v}" for v in given)
        return f"{option} {given}"

    return KEYWORD.sub(flag, text)


# -- flag groups: the flags several commands share, declared once


class FlagGroup:
    """A group of flags that several commands share, declared once as a dataclass whose fields are the flags (typer
    `Annotated` options, with their defaults). A command takes the group as one parameter (`load: LoadFlags`), and
    `@flag_groups` spreads the group's fields into the command's own flags and gathers them back into the group."""


def flag_groups(command: Callable) -> Callable:
    """Spread each FlagGroup parameter of `command` into its fields (where the parameter stands), for typer; the
    command receives the group, made from the values of those flags."""
    import dataclasses
    import functools
    import inspect
    import typing

    signature = inspect.signature(command, eval_str=True)
    params, groups = [], {}
    for p in signature.parameters.values():
        group = p.annotation
        if not (isinstance(group, type) and issubclass(group, FlagGroup)):
            params.append(p)
            continue
        groups[p.name] = group
        hints = typing.get_type_hints(group, include_extras=True)
        params += [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default,
                                     annotation=hints[f.name]) for f in dataclasses.fields(group) if f.init]

    @functools.wraps(command)
    def spread(**values):
        for name, group in groups.items():
            values[name] = group(**{f.name: values.pop(f.name) for f in dataclasses.fields(group) if f.init})
        return command(**values)

    spread.__signature__ = signature.replace(parameters=params)
    spread.__annotations__ = {p.name: p.annotation for p in params}
    return spread


@dataclass
class LoadFlags(FlagGroup):
    """The model and where it runs: api.LoadOptions, whose fields these are (--model is its spec)."""

    model: ModelOpt = None
    device: DeviceOpt = None
    dtype: DtypeOpt = None
    keep_quantized: KeepQuantizedOpt = False
    fast: FastOpt = False
    device_map: DeviceMapOpt = None
    max_memory: MaxMemoryOpt = None
    offload_dir: OffloadDirOpt = None
    threads: ThreadsOpt = None

    def options(self):
        """The flags as api.LoadOptions, which checks them (before torch is imported)."""
        from llmtrace.api import LoadOptions

        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return LoadOptions(spec=given.pop("model"), **given)


@dataclass
class OneDeviceLoadFlags(LoadFlags):
    """The load flags of a command that runs on one device (patch): no --fast, --device-map, --max-memory,
    --offload-dir."""

    model: ModelOpt = None
    device: DeviceOpt = None
    dtype: DtypeOpt = None
    keep_quantized: KeepQuantizedOpt = False
    threads: ThreadsOpt = None
    fast: bool = field(default=False, init=False)
    device_map: None = field(default=None, init=False)
    max_memory: None = field(default=None, init=False)
    offload_dir: None = field(default=None, init=False)


def load_for_cli(args):
    """The model of checked load flags (LoadFlags.options: api.LoadOptions): --device checked before a download,
    then the load; with --fast, one line naming the matrices that run in bfloat16."""
    from llmtrace.api import load_with

    model = load_with(args)
    say_fast_note(model.loaded)
    return model


def say_fast_note(lm) -> None:
    """--fast: one line on stderr naming the matrices that run in bfloat16 because their type has no int4 form."""
    if lm.config.extra.get("fast"):
        from llmtrace.checkpoint.fast import bf16_note

        from llmtrace.words import say

        note = bf16_note(lm)
        if note:
            say(note)


def write_output(target: str, text: str) -> None:
    """TEXT to stdout (`-`), or to the file TARGET, whole or not at all."""
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from llmtrace.fsutil import write_text_atomic

    write_text_atomic(Path(target), text)


# -- the HTML report (--html of generate, explain and lens; `llmtrace report -o`)


def html_target(value: Optional[str]) -> Optional[str]:
    if value == "-":
        raise typer.BadParameter("the report is a file; give it a name such as report.html")
    return value


HtmlOpt = Annotated[Optional[str], typer.Option(
    "--html", help="Also write the run as a self-contained HTML report to FILE (see 'llmtrace report --help').",
    show_default=False, callback=html_target)]


def html_lang(value: str) -> str:
    from llmtrace.report.i18n import LANGS

    if value not in LANGS:
        raise typer.BadParameter(f"must be one of {', '.join(LANGS)}, not {value!r}")
    return value


LangOpt = Annotated[str, typer.Option(
    "--lang", help="The language of the HTML page's words: en or zh (Simplified Chinese, in the seed documents' "
    "terms). The terminal stays English.", callback=html_lang)]
ViewLangOpt = Annotated[str, typer.Option(
    "--lang", help="The language of the view and of the HTML page's words: en or zh (Simplified Chinese, in the seed "
    "documents' terms); formulas, tokens and names stay as they are.", callback=html_lang)]


def check_lang(lang: str, html: Optional[str]) -> None:
    """--lang names the language of the --html page: without one, it would be ignored, so it is refused."""
    if lang != "en" and not html:
        raise UsageError(f"--lang {lang} sets the language of the --html page; give --html FILE too")


def write_html(events: list[dict], target: str, tokenizer, **kwargs) -> None:
    """Write the HTML report of `events` (llmtrace.report) and say where on stderr: `report`, and --html of generate,
    explain and lens."""
    from llmtrace.report.write import write_report

    n = write_report(events, target, tokenizer=tokenizer, **kwargs)
    print(f"wrote {target} ({n / 1e6:.2f} MB)", file=sys.stderr)


# -- help: options grouped by panel


class PanelCommand(TyperCommand):
    """A command whose --help lists its options in sections by their `rich_help_panel`: the app's help is plain text
    (rich_markup_mode=None), where typer itself puts every option under one "Options" heading. Options without a
    panel come first, under "Options"; then each panel in the order its first option appears."""

    def format_options(self, ctx, formatter) -> None:
        args: list = []
        groups: dict[str, list] = {"Options": []}
        for param in self.get_params(ctx):
            rv = param.get_help_record(ctx)
            if rv is None:
                continue
            if param.param_type_name == "argument":
                args.append(rv)
            else:
                groups.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(rv)
        for title, rows in [("Arguments", args), *groups.items()]:
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# -- interventions (generate, explain, lens): llmtrace.run.interventions

AblateOpt = Annotated[Optional[list[str]], typer.Option(
    "--ablate", metavar="L.hH|L.eK|L.attn|L.ffn", help="Zero head H of layer L (its slice of the input of Wo), or "
    "that layer's attention or FFN output; L.hH=mean: the head's mean over the prompt instead; L.eK (a mixture of "
    "experts): expert K's router score is −∞, so each token's next best expert runs in its place (repeatable).",
    show_default=False)]
ScaleOpt = Annotated[Optional[list[str]], typer.Option(
    "--scale", metavar="L.hH=α", help="Multiply head H's output (or L.attn=α, L.ffn=α; L.eK=α: expert K's output "
    "wherever it runs) by α (repeatable).", show_default=False)]
PatchOpt = Annotated[Optional[list[str]], typer.Option(
    "--patch", metavar="L.POINT@P", help="Replace the activation at layer L, POINT (resid_pre, resid_mid, resid_post "
    "or hH), position P (negative: from the end) by the --from text's, in the prompt's pass (repeatable).",
    show_default=False)]
FromOpt = Annotated[Optional[str], typer.Option(
    "--from", metavar="TEXT", help="The text --patch takes its activations from (run alone, as plain text).",
    show_default=False)]
SteerOpt = Annotated[Optional[int], typer.Option(
    "--steer", metavar="L", help="Add --strength × v to layer L's output at every position; v = L's output at the "
    "last token of --toward minus that of --away-from.", show_default=False)]
TowardOpt = Annotated[Optional[str], typer.Option("--toward", metavar="TEXT", help="--steer's positive text.",
                                                  show_default=False)]
AwayOpt = Annotated[Optional[str], typer.Option("--away-from", metavar="TEXT", help="--steer's negative text.",
                                                show_default=False)]
StrengthOpt = Annotated[float, typer.Option("--strength", metavar="α", help="--steer's factor α.")]
ControlVectorOpt = Annotated[Optional[list[str]], typer.Option(
    "--control-vector", metavar="FILE[:SCALE]", help="Add a llama.cpp control vector (GGUF, as llama-cvector-generator "
    "writes it) × SCALE (default 1) to the layers' outputs, as llama.cpp does (repeatable; they add up).",
    show_default=False)]

INTERVENTIONS_HELP = """Interventions (repeatable, they combine; listed in the header and the run event):

\b
  --ablate 3.h2          head 2 of layer 3 adds nothing (also 3.attn, 3.ffn)
  --ablate 3.h2=mean     the head's output: its mean over the prompt
  --scale 3.h2=0.5       that output × 0.5 (also 3.attn=α, 3.ffn=α)
  --ablate 3.e5          a mixture of experts: expert 5 of layer 3 is never
                         chosen (router score −∞: the next best runs instead)
  --scale 3.e5=2         expert 5's output × 2 wherever it runs
  --patch 8.resid_post@-1 --from "The capital of Italy is"
                         that activation from the other text (run alone)
  --steer 6 --toward "I love it" --away-from "I hate it" --strength 4
                         adds 4·(v_toward − v_away) to layer 6's output
  --control-vector happy.gguf:0.8
                         a llama.cpp control vector (GGUF), scaled by 0.8
"""


@dataclass
class InterventionFlags(FlagGroup):
    """The interventions of generate, explain and lens (llmtrace.run.interventions), each flag repeatable."""

    ablate: AblateOpt = None
    scale: ScaleOpt = None
    patch: PatchOpt = None
    source: FromOpt = None
    steer: SteerOpt = None
    toward: TowardOpt = None
    away_from: AwayOpt = None
    strength: StrengthOpt = 1.0
    control_vector: ControlVectorOpt = None

    def parse(self) -> list:
        """The flags as llmtrace.run.interventions objects, checked before the model loads."""
        return interventions_from(self.ablate, self.scale, self.patch, self.source, self.steer, self.toward,
                                  self.away_from, self.strength, self.control_vector)


def interventions_from(ablate, scale, patch, source, steer, toward, away_from, strength, control_vector) -> list:
    """The command line's interventions as llmtrace.run.interventions objects, checked before the model loads."""
    from llmtrace.run.interventions import parse_interventions

    return parse_interventions(ablate, scale, patch, source, steer, toward, away_from, strength, control_vector)
