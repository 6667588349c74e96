"""The typer application that every command registers on."""

from typing import Annotated

import typer
from typer.core import TyperGroup


class ReaderGone(Exception):
    """stdout's reader went away (`llmtrace generate "Hi" --jsonl - | head -2`). Raised in place of BrokenPipeError,
    which click would turn into a bare exit 1; cli/main.py ends quietly with 141, as a process ended by SIGPIPE."""


def _reader_may_go(method):
    def method_or_reader_gone(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except BrokenPipeError:
            raise ReaderGone() from None
    return method_or_reader_gone


class Commands(TyperGroup):
    """llmtrace's command group: a reader that goes away is ReaderGone in every command and in every --help."""

    make_context = _reader_may_go(TyperGroup.make_context)  # `llmtrace --help | head -1`
    invoke = _reader_may_go(TyperGroup.invoke)  # every command's run and its own --help


app = typer.Typer(
    cls=Commands,
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
    # help uses the terminal's width (or $COLUMNS) up to 200 columns; click's default stops at 80
    context_settings={"max_content_width": 200},
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# generate, explain and lens end the hold of Ctrl-C themselves, once their imports are done and their outputs can be
# finished; every other command is interruptible from its start (llmtrace/sigint.py).
RELEASE_CTRL_C_THEMSELVES = ("generate", "explain", "lens")


def _print_version(value: bool) -> None:
    if value:
        from llmtrace.version import __version__

        print(f"llmtrace {__version__}")
        raise typer.Exit()


@app.callback()
def _start(ctx: typer.Context, version: Annotated[bool, typer.Option(
        "--version", help="Print llmtrace's version and exit.", is_eager=True, callback=_print_version)] = False) -> None:
    from llmtrace import sigint

    if ctx.invoked_subcommand not in RELEASE_CTRL_C_THEMSELVES:
        sigint.release()
