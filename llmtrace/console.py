"""The one console factory, for any layer: terminal views on stdout, progress and notes on stderr."""

from __future__ import annotations

import os
import sys

from rich.console import Console

DEFAULT_WIDTH = 100  # when stdout is not a terminal and $COLUMNS says nothing


def make_console(stderr: bool = False, file=None) -> Console:
    """The one console factory: the terminal's width, else $COLUMNS, else 100 columns; NO_COLOR drops colour."""
    stream = file or (sys.stderr if stderr else sys.stdout)
    width = None
    if not stream.isatty():
        columns = os.environ.get("COLUMNS", "")
        width = int(columns) if columns.isdigit() and int(columns) > 0 else DEFAULT_WIDTH
    return Console(stderr=stderr, file=file, no_color="NO_COLOR" in os.environ, highlight=False, soft_wrap=False,
                   width=width)
