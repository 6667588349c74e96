"""The options several commands share, as typer `Annotated` aliases, and the rules for their values.

`--json FILE` and `--jsonl FILE` mean the same in every command: write the output as one JSON document, or as one
JSON object per line, to FILE; `-` is stdout. The human view goes to stdout unless one of them takes stdout; then it
goes to stderr, and only when stderr is a terminal.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.errors import UsageError
from llmtrace.registry.models_toml import DEFAULT_MODEL

# -- what the model reads

PromptArg = Annotated[Optional[str], typer.Argument(help="The prompt text (or use --file, or stdin).", show_default=False)]
FileOpt = Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt from this UTF-8 file.")]
ChatOpt = Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="System message for --chat.")]

# -- where the output goes

JsonOpt = Annotated[Optional[str], typer.Option(
    "--json", metavar="FILE", help="Write the output as one JSON document to FILE (- for stdout).", show_default=False)]
JsonlOpt = Annotated[Optional[str], typer.Option(
    "--jsonl", metavar="FILE", help="Write the output as one JSON object per line to FILE (- for stdout); an existing "
    "FILE is replaced.", show_default=False)]

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
                 "K-quants) and dequantize each when used; memory stays near the file's size, steps are slower."),
]
FastOpt = Annotated[
    bool,
    typer.Option("--fast", help="GGUF only: run the matrices straight from their quantized blocks on torch's int4 "
                 "kernel, activations in bfloat16. Several times faster, and approximate: the trace says "
                 "\"exact\": false (README: how far it drifts)."),
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
FLAG_OF_FIELD = {"order": "--sampler-order", "level": "--trace"}


def flag_of(field: str) -> str:
    """The command-line flag that gives a library field: a BadValue's message names the flag, not the field."""
    return FLAG_OF_FIELD.get(field) or "--" + field.replace("_", "-")


def load_options(model: Optional[str], keep_quantized: bool, device_map: Optional[str], max_memory: Optional[list[str]],
                 offload_dir: Optional[Path], fast: bool = False) -> dict:
    """The scale options and --fast as load_model's keyword arguments, checked before the load (one-line errors)."""
    from llmtrace.checkpoint.load import check_fast
    from llmtrace.checkpoint.placement import parse_placement

    key = Path(model).name if model else "default"
    placement = parse_placement(device_map, max_memory, offload_dir, key)
    if fast:
        check_fast(keep_quantized, placement, None)
    return {"keep_quantized": keep_quantized, "placement": placement, "fast": fast}


def say_fast_note(lm) -> None:
    """--fast: one line on stderr naming the matrices that run in bfloat16 because their type has no int4 form."""
    if lm.config.extra.get("fast"):
        from llmtrace.checkpoint.fast import bf16_note

        note = bf16_note(lm)
        if note:
            print(f"note: {note}", file=sys.stderr)


def check_outputs(json_out: Optional[str], jsonl: Optional[str], *others: Optional[str]) -> None:
    """Before any slow work: at most one output on stdout, and every named FILE writable."""
    from llmtrace.fsutil import check_writable_target

    if json_out == "-" and jsonl == "-":
        raise UsageError("--jsonl - and --json - both want stdout; send one of them to a file")
    if jsonl not in (None, "-") and json_out not in (None, "-"):
        same = Path(jsonl).resolve()
        if same == Path(json_out).resolve() and (same.is_file() or not same.exists()):  # /dev/null twice is fine
            raise UsageError("--jsonl and --json name the same file; give them different names")
    for target in (json_out, jsonl, *others):
        if target not in (None, "-"):
            check_writable_target(Path(target))


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


def write_html(events: list[dict], target: str, tokenizer, **kwargs) -> None:
    """Write the HTML report of `events` (llmtrace.report) and say where on stderr: `report`, and --html of generate,
    explain and lens."""
    from llmtrace.report.write import write_report

    n = write_report(events, target, tokenizer=tokenizer, **kwargs)
    print(f"wrote {target} ({n / 1e6:.2f} MB)", file=sys.stderr)
