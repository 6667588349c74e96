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


class BadValue(UsageError):
    """A value out of range or malformed, named as the library knows it: `field` ("temperature", "layers") starts the
    message, `rest` is what follows ("temperature must be >= 0 ..."). A front end that took the value from a flag says
    which one with `named("--temperature")`; the library never names a flag itself. `also`: other fields the message
    names by their field names ("system only applies with chat"), which `named` renames too."""

    def __init__(self, field: str, rest: str, also: tuple[str, ...] = ()):
        super().__init__(f"{field}{rest}")
        self.field, self.rest, self.also = field, rest, tuple(also)

    def named(self, label: str, rename=None) -> str:
        """The message with `label` for the field, and `rename(other)` for each field in `also`."""
        import re

        rest = self.rest
        for other in self.also if rename is not None else ():
            rest = re.sub(rf"(?<![\w-]){re.escape(other)}(?![\w-])", rename(other), rest)
        return f"{label}{rest}"


def one_line(e: BaseException) -> str:
    """A library's exception text on one line, for an LlmtraceError message that quotes it."""
    return " ".join(str(e).split())[:200] or type(e).__name__
