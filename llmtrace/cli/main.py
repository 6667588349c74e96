"""Command-line entry point: one module per command, one place that turns errors into exit codes."""

import os
import sys
from typing import NoReturn

import typer

try:  # newer typer carries its own copy of click and raises that copy's exceptions
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError as ClickUsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError as ClickUsageError

from llmtrace import sigint
from llmtrace.cli.app import ReaderGone, app
from llmtrace.errors import FieldError, LlmtraceError

# Importing a command module registers its commands on `app`.
import llmtrace.cli.generate  # noqa: F401,E402
import llmtrace.cli.tokenize  # noqa: F401,E402
import llmtrace.cli.models  # noqa: F401,E402
import llmtrace.cli.explain  # noqa: F401,E402
import llmtrace.cli.trace_files  # noqa: F401,E402
import llmtrace.cli.report  # noqa: F401,E402
import llmtrace.cli.compare  # noqa: F401,E402
import llmtrace.cli.eval  # noqa: F401,E402
import llmtrace.cli.patch  # noqa: F401,E402
import llmtrace.cli.attribute  # noqa: F401,E402
import llmtrace.cli.capture  # noqa: F401,E402
import llmtrace.cli.serve  # noqa: F401,E402


def _fail(message: str, code: int) -> NoReturn:
    first = " ".join(str(message).split()) or "unknown error"
    print(f"error: {first}", file=sys.stderr)
    sys.exit(code)


# The exit status when stdout's reader goes away (`llmtrace generate "Hi" --jsonl - | head -2`): a shell's status of
# a process ended by SIGPIPE (128 + 13), which is what `yes | head -1` leaves in ${PIPESTATUS[0]}. Nothing on stderr.
READER_GONE_EXIT = 141


def _reader_gone() -> NoReturn:
    """End quietly, as Unix tools do when the reader of their output goes away: no message, no traceback."""
    try:  # what is still buffered for stdout goes nowhere, so Python's flush at exit has nothing to complain about
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(READER_GONE_EXIT)


def main(argv=None) -> None:
    """Run the CLI. User errors print one line on stderr (no traceback unless LLMTRACE_DEBUG=1)."""
    debug = os.environ.get("LLMTRACE_DEBUG") == "1"
    try:
        from llmtrace.cli.options import flag_words
        from llmtrace.words import worded

        with worded(flag_words):  # the library's `keyword=value` reach a person as this CLI's flags
            rv = app(args=argv, standalone_mode=False, prog_name="llmtrace")
        sigint.release()  # a Ctrl-C held by a command that ended before it released the hold (--help) is not lost
        sys.stdout.flush()  # here, where a reader that went away is seen, not in Python's exit
        # Without standalone mode click returns (instead of raising) Ctrl-C as 130 and typer.Exit(n) as n.
        if isinstance(rv, int) and rv != 0:
            if rv == 130:
                _fail("interrupted", 130)
            sys.exit(rv)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _fail("interrupted", 130)
    except NoArgsIsHelpError as e:
        # `llmtrace` (or a command) with nothing after it: the help as --help prints it, but on stderr with exit 2,
        # as click does, since no command ran
        print(e.ctx.get_help(), file=sys.stderr)
        sys.exit(2)
    except ClickUsageError as e:
        if debug:
            raise
        hint = f" (see 'llmtrace {e.ctx.info_name} --help')" if e.ctx is not None and e.ctx.info_name != "llmtrace" else ""
        _fail(e.format_message() + hint, 2)
    except ClickException as e:
        if debug:
            raise
        _fail(e.format_message(), e.exit_code or 1)
    except FieldError as e:  # a value the library names by its field: say which flag gave it
        if debug:
            raise
        from llmtrace.cli.options import flag_of

        _fail(e.named(flag_of(e.field), flag_of), e.exit_code)
    except LlmtraceError as e:
        if debug:
            raise
        from llmtrace.cli.options import flag_words

        _fail(flag_words(str(e)), e.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except (ReaderGone, BrokenPipeError):  # BrokenPipeError: from the flush above
        _reader_gone()
    except OSError as e:
        # Whatever the checks did not foresee (a full disk, a file that vanished): still one line, not a traceback.
        if debug:
            raise
        where = f" ({e.filename})" if e.filename else ""
        _fail(f"{e.strerror or e}{where}", 1)
    except MemoryError:
        if debug:
            raise
        _fail("out of memory; try a smaller --max-new-tokens, a shorter prompt or --dtype bfloat16", 1)
