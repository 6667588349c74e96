"""The words of the front end: the Python API speaks keywords, the CLI speaks flags.

A note or a message below the CLI names an option as the Python API spells it, in backticks: `dtype='float32'`,
`chat=True`, `save_tensors`. A Python caller reads that as it is. While a command runs, the CLI has each written as
its flag (--dtype float32, --chat, --save-tensors): one translation (cli/options.flag_words), applied by in_words
wherever such a text leaves for a person (say(), the views, the CLI's error line). Unset, the text stays as written.
(No rich here: the CLI sets the words before any command, and a refusal before torch is imported stays quick.)
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Callable, Iterator, Optional

_WORDS: contextvars.ContextVar[Optional[Callable[[str], str]]] = contextvars.ContextVar("llmtrace_words", default=None)


@contextlib.contextmanager
def worded(words: Callable[[str], str]) -> Iterator[None]:
    """While the block runs, in_words(text) is words(text): the CLI's flags for the library's keywords."""
    token = _WORDS.set(words)
    try:
        yield
    finally:
        _WORDS.reset(token)


def in_words(text: str) -> str:
    """TEXT in the words of the front end that runs: the CLI's flags for `keyword=value`, else as written."""
    words = _WORDS.get()
    return words(text) if words is not None and "`" in text else text


def say(text: str, prefix: str = "note: ") -> None:
    """One line for a person on stderr (`note: ...`), in the words of the front end that runs."""
    print(prefix + in_words(text), file=sys.stderr)
