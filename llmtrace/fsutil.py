"""Write files so that a crash or Ctrl-C never leaves a half-written one behind.

Everything llmtrace saves (traces, converted models, downloads) goes through `atomic_path`: the data is written to a
temporary name in the same directory, flushed, and renamed over the target only once it is complete. An existing file
of the same name is replaced only then.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from llmtrace.errors import LlmtraceError


def check_writable_target(path: Path) -> None:
    """Fail early (before any slow work) if `path` cannot be created: missing or unwritable directory."""
    parent = path.resolve().parent
    if not parent.is_dir():
        raise LlmtraceError(f"cannot write {path}: directory {parent} does not exist")
    if path.is_dir():
        raise LlmtraceError(f"cannot write {path}: it is a directory")
    if not os.access(parent, os.W_OK):
        raise LlmtraceError(f"cannot write {path}: directory {parent} is not writable")


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` only if the block finishes without an exception."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".partial", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; it becomes `path` only if the block finishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
