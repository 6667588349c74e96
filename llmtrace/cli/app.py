"""The typer application and the option aliases that several commands share."""

from pathlib import Path
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
        "  llmtrace generate \"Hi\" --jsonl - | jq .event\n\n"
        "  llmtrace generate \"Hi\" -m model.Q4_K_M.gguf --keep-quantized\n\n"
        "  llmtrace generate \"Hi\" -m ./Llama-3.1-8B --device-map auto --max-memory cpu=12GiB"
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
KeepQuantizedOpt = Annotated[
    bool,
    typer.Option("--keep-quantized", help="GGUF only: keep the matrices in their quantized blocks (Q4_0 … Q8_0, "
                 "K-quants) and dequantize each when used; memory stays near the file's size, steps are slower."),
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


def load_options(model: Optional[str], keep_quantized: bool, device_map: Optional[str], max_memory: Optional[list[str]],
                 offload_dir: Optional[Path]) -> dict:
    """The scale options as load_model's keyword arguments, checked before the load (one-line errors)."""
    from llmtrace.placement import parse_placement

    key = Path(model).name if model else "default"
    return {"keep_quantized": keep_quantized, "placement": parse_placement(device_map, max_memory, offload_dir, key)}
