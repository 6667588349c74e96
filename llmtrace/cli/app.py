"""The typer application and the option aliases that several commands share."""

from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="llmtrace",
    help=(
        "Watch a real LLaMA-family model turn a prompt into tokens, step by step.\n\n"
        "Examples:\n\n"
        "  llmtrace generate \"Quantum mechanics is\" -n 8\n\n"
        "  llmtrace tokenize \"Hello world\" --merges\n\n"
        "  llmtrace explain \"The capital of France is\" --layer 3\n\n"
        "  llmtrace generate \"Hi\" --jsonl - | jq .event"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        help="Registry name, hub id, local HF directory or .gguf file (default: smollm2-135m-instruct).",
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
