"""The typer application that every command registers on."""

from typing import Annotated

import typer
import typer._click.core as _core
import typer._click.formatting as _formatting
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


def _shell_words(line: str) -> list[str]:
    """A command line's words, split at spaces outside quotes (the quotes kept): where a line may be broken."""
    words, word, quote = [], "", None
    for ch in line:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == " ":
            if word:
                words.append(word)
            word = ""
            continue
        word += ch
    return words + ([word] if word else [])


def _example_lines(par: str, width: int) -> str:
    """A paragraph of `llmtrace …` example lines, kept as written ("\b": click does not rewrap it); a line longer
    than `width` is broken between its words with a shell continuation (` \\`), so that it can be copied and run as
    it is, and never between a flag and its value. A trailing comment (after two spaces and #) is one piece."""
    lines = par.split("\n")
    if not all(line.startswith("  ") and "llmtrace " in line for line in lines if line.strip()):
        return par  # prose, or a table: click wraps it
    out = ["\b"]
    for line in lines:
        if len(line) <= width:  # as written, its comment's alignment kept
            out.append(line)
            continue
        lead = " " * (len(line) - len(line.lstrip()))
        command, sep, comment = line.strip().partition("  #")
        words = []
        for w in _shell_words(command):  # a flag stays on the line of its value
            if words and words[-1].startswith("-") and " " not in words[-1] and not w.startswith("-"):
                words[-1] += " " + w
            else:
                words.append(w)
        words += [sep.strip() + comment] if sep else []
        row = lead + words[0]
        for w in words[1:]:
            if len(row) + 1 + len(w) + 2 > width:
                out.append(row + " \\")
                row = lead + "    " + w
            else:
                row += " " + w
        out.append(row)
    return "\n".join(out)


class HelpFormatter(_formatting.HelpFormatter):
    """click's help formatter, but an example is never rewrapped in the middle of a command (_example_lines)."""

    def write_text(self, text: str) -> None:
        width = self.width - self.current_indent
        super().write_text("\n\n".join(_example_lines(par, width) for par in text.split("\n\n")))


_core.Context.formatter_class = HelpFormatter  # typer's Context is click's (vendored in typer._click)


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
