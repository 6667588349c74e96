"""What the user typed: text from an argument, a file or stdin, read and decoded in one place for every command.

A file or stdin loses exactly one trailing newline ("\\n" or "\\r\\n"), the one `echo` and editors add: without that,
`echo "The capital of France is" | llmtrace generate` would end the prompt with token 198 ("\\n") and change the
output. A second newline, and any newline in an argument, is kept.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.fsutil import read_user_file

NEWLINE_NOTE = "One trailing newline of a file or stdin (the one echo adds) is dropped; a second one is kept."


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LlmtraceError(
            f"{what} is not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason})"
        ) from None


def strip_one_newline(text: str) -> str:
    """`text` without one final "\\n" or "\\r\\n"."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def read_stdin(what: str = "stdin") -> str:
    return decode_utf8(sys.stdin.buffer.read(), what)


def read_file(path: Union[str, Path], what: str = "text") -> str:
    """A whole UTF-8 file, as it is ("-" is stdin). Errors say which file and why, in one line."""
    if str(path) == "-":
        return read_stdin()
    return decode_utf8(read_user_file(Path(path), what), str(path))


def read_text(
    text: Optional[str], file: Union[str, Path, None], what: str = "prompt", *, stdin: bool = True
) -> Optional[str]:
    """TEXT, else the --file contents, else stdin when it is piped (and `stdin`); None when there is none of them."""
    if text is not None and file is not None:
        raise UsageError(f"give the {what} either as an argument or with --file, not both")
    if file is not None:
        return strip_one_newline(read_file(file, what))
    if text is not None:
        # Bytes that are not UTF-8 in argv arrive as lone surrogates.
        return decode_utf8(text.encode("utf-8", errors="surrogateescape"), "the argument")
    if stdin and sys.stdin is not None and not sys.stdin.isatty():
        return strip_one_newline(read_stdin())
    return None


def read_prompt(prompt: Optional[str], file: Union[str, Path, None], what: str = "prompt") -> str:
    """The prompt from the argument, --file, or stdin (in that order); a usage error when there is none or it is
    empty (found here, before any model loads)."""
    text = read_text(prompt, file, what)
    if text is None:
        raise UsageError(f"no {what}: give it as an argument, with --file, or on stdin")
    if text == "":
        raise UsageError(f"the {what} is empty; give some text")
    return text
