"""The one console factory, for any layer: terminal views on stdout, progress and notes on stderr."""

from __future__ import annotations

import os
import re
import sys
import time

from rich.console import Console

DEFAULT_WIDTH = 100  # when stdout is not a terminal and $COLUMNS says nothing
_TRAILING_SPACES = re.compile(r" +(?=\n)")


class OurConsole(Console):
    """rich's Console with two manners of a Unix tool:

    - into a file or a pipe, no line ends in spaces (rich pads each line of a table or a panel to the width, which a
      terminal does not show and a file keeps: 101 of 156 lines of `explain > out.txt` did);
    - when the reader goes away (`llmtrace tokenize … | head -2`), BrokenPipeError reaches the caller, where rich
      would exit 1 on its own; the CLI ends quietly (cli/main.py)."""

    def _render_buffer(self, buffer) -> str:  # the one place rich turns a print into the text it writes
        text = super()._render_buffer(buffer)
        return text if self.is_terminal else _TRAILING_SPACES.sub("", text)

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more to write: the reader is gone
        raise BrokenPipeError()


def make_console(stderr: bool = False, file=None) -> Console:
    """The one console factory: the terminal's width, else $COLUMNS, else 100 columns; NO_COLOR drops colour."""
    stream = file or (sys.stderr if stderr else sys.stdout)
    width = None
    if not stream.isatty():
        columns = os.environ.get("COLUMNS", "")
        width = int(columns) if columns.isdigit() and int(columns) > 0 else DEFAULT_WIDTH
    return OurConsole(stderr=stderr, file=file, no_color="NO_COLOR" in os.environ, highlight=False, soft_wrap=False,
                      width=width)


def progress_to_stderr(label: str):
    """A tiny progress callback for slow work (conversion, loading): a rich bar on a terminal, silence otherwise."""
    if not sys.stderr.isatty():
        return None, lambda: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    transient=True, console=make_console(stderr=True))
    prog.start()
    task = prog.add_task(label, total=None)

    def update(done, total):
        prog.update(task, completed=done, total=total)

    return update, prog.stop


def prefill_progress(after_s: float = 2.0):
    """A progress callback for a chunked prefill: on stderr once the prefill looks like taking more than `after_s`."""
    t0 = time.perf_counter()
    shown = [False]

    def show(done: int, total: int) -> None:
        elapsed = time.perf_counter() - t0
        if not shown[0] and elapsed * total / done < after_s:
            return
        shown[0] = True
        tty = sys.stderr.isatty()  # a terminal gets one line rewritten in place, a file one line per pass
        print(f"{chr(13) if tty else ''}prefill: {done:,}/{total:,} prompt tokens ({100 * done // total}%), "
              f"{elapsed:.1f} s", end="\n" if done == total or not tty else "", file=sys.stderr, flush=True)

    return show
