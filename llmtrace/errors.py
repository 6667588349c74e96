"""Errors a user can cause, each with an exit code and a one-line message.

Every problem that comes from user input (a bad path, a corrupt file, an out-of-range flag) is raised as one of these.
The CLI prints `error: <message>` on stderr and exits with `exit_code`; only `LLMTRACE_DEBUG=1` shows a traceback.
"""


class LlmtraceError(Exception):
    """A runtime problem the user can fix (exit code 1)."""

    exit_code = 1


class UsageError(LlmtraceError):
    """The command line itself is wrong: a flag out of range, a malformed value (exit code 2)."""

    exit_code = 2


class FieldError(LlmtraceError):
    """A problem with one value the caller gave, named as the library knows it: `field` ("temperature", "device")
    starts the message, `rest` is what follows ("temperature must be >= 0 ..."). A front end that took the value from
    a flag says which one with `named("--temperature")`; the library never names a flag itself. `also`: other fields
    the message names by their field names ("system only applies with chat"), which `named` renames too. `before`:
    words before the field, for a message that cannot start with it ("bad max_memory 'cpu20GiB': ..."). Raised as it
    is, a runtime problem (exit code 1: "device cuda was asked for, but this machine has no CUDA device")."""

    def __init__(self, field: str, rest: str, also: tuple[str, ...] = (), before: str = ""):
        super().__init__(f"{before}{field}{rest}")
        self.field, self.rest, self.also, self.before = field, rest, tuple(also), before

    def named(self, label: str, rename=None) -> str:
        """The message with `label` for the field, and `rename(other)` for each field in `also`."""
        import re

        rest = self.rest
        for other in self.also if rename is not None else ():
            rest = re.sub(rf"(?<![\w-]){re.escape(other)}(?![\w-])", rename(other), rest)
        return f"{self.before}{label}{rest}"


class BadValue(FieldError, UsageError):
    """A value out of range or malformed, named by its field (FieldError): a usage problem (exit code 2)."""

    exit_code = 2


def one_line(e: BaseException) -> str:
    """A library's exception text on one line, for an LlmtraceError message that quotes it."""
    return " ".join(str(e).split())[:200] or type(e).__name__
