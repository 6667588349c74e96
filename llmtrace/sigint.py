"""Ctrl-C while the command starts: held from the entry point's first line until the command can finish its outputs.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. During start-up that is
inside some library's import, and libraries do not all let it through: torch's C++ start-up catches the failed
`import numpy` (the run then goes on, and numpy is half-imported), so a Ctrl-C there was lost and the run generated
every token. So the CLI's entry point calls `hold()` first, before any other import: a SIGINT from then on is only
noted. The command calls `release()` once it can honour one (for generate, explain and lens: once the `--jsonl`
stream exists, so that it ends with an interrupted summary); a SIGINT noted by then is raised there, and later ones
are raised by Python's own handler as usual. The CLI's `main` releases at the end whatever a command did not.

Only `signal` is imported here, so that nothing runs before the hold but Python's own start-up. (Writes that must
be whole defer Ctrl-C with `fsutil.sigint_deferred`; while the hold is on, they simply run inside it.)
"""

import signal

_noted: list[int] = []


def _note(signum, frame) -> None:
    _noted.append(signum)


def hold() -> None:
    """From now on a SIGINT is noted, not raised, until `release()`. Does nothing where SIGINT is not Python's own
    handler (ignored, as in a background job, or set by a program that embeds the CLI) or off the main thread."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _note)
    except ValueError:  # not the main thread
        pass


def release() -> None:
    """Python's Ctrl-C handler again; a SIGINT noted during the hold is raised here, as KeyboardInterrupt."""
    if signal.getsignal(signal.SIGINT) is not _note:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _noted:
        _noted.clear()
        raise KeyboardInterrupt
