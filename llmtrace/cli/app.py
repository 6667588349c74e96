"""The typer application that every command registers on."""

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
