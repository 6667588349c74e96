"""Write files so that a crash or Ctrl-C never leaves a half-written one behind.

Everything llmtrace saves whole (JSON documents, converted models, downloads) is written to a temporary name in the
same directory, flushed, and renamed over the target only once it is complete (`atomic_path`, `atomic_dir`). An
existing file of the same name is replaced only then. (A JSONL stream is the exception: it is written in place, line by
line, so that it can be followed; see `writers.JsonlWriter`.) A device or a pipe (/dev/null, /dev/stdout) is written in place:
there is nothing to rename over it.
"""

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional

from llmtrace.errors import LlmtraceError


def _in_place(path: Path) -> bool:
    """A device or a pipe (/dev/null, /dev/stdout, a FIFO): written where it is, never replaced by a renamed file."""
    return path.exists() and not path.is_file() and not path.is_dir()


def _file_mode(directory: bool = False) -> int:
    """The mode an ordinary new file gets (0o666 less the umask; 0o777 less it for a directory). mkstemp alone would
    give 0o600, mkdtemp 0o700."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def check_writable_target(path: Path) -> None:
    """Fail early (before any slow work) if `path` cannot be written: a missing or unwritable directory, or a
    directory of that name. A file is created beside it and removed again, the one test that also holds for root and
    for read-only file systems."""
    path = Path(path)
    if path.is_dir():
        raise LlmtraceError(f"cannot write {path}: it is a directory; give a file name")
    if _in_place(path):
        if not os.access(path, os.W_OK):
            raise LlmtraceError(f"cannot write {path}: permission denied")
        return
    parent = path.resolve().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise LlmtraceError(f"cannot write {path}: {parent} {what}; create the directory or choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise LlmtraceError(f"cannot write {path}: directory {parent} is not writable{_why_not(e)}; "
                            f"choose another path") from None
    os.close(fd)
    os.unlink(probe)


def _why_not(e: OSError) -> str:
    """Why a file could not be created, in words that are true of the error (a /proc directory answers "No such file
    or directory" although it exists: it takes no new files)."""
    if e.errno in (errno.EACCES, errno.EPERM):
        return " (permission denied)"
    if e.errno == errno.EROFS:
        return ": it is on a read-only file system"
    return f": it takes no new files (creating one fails with {e.strerror or e!s})"


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block is done, then raise KeyboardInterrupt: a rename or a summary is never cut in half.

    Only in the main thread and over Python's own SIGINT handler; anywhere else the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` only if the block finishes without an exception.

    A symlink is written through (its target is replaced, not the link); a device or a pipe is written in place."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    if _in_place(path):
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".partial", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with sigint_deferred():
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
                # the umask's mode, set after the writer is done: mkstemp makes 0o600, and a writer may make its own
                # file in the place of ours (safetensors' save_file does, with 0o600 again)
                os.fchmod(f.fileno(), _file_mode())
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
        os.chmod(tmp, _file_mode(directory=True))
        with sigint_deferred():
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def env_dir(var: str) -> Optional[Path]:
    """The directory an environment variable names (~ expanded, made absolute), or None when it is unset or empty."""
    value = os.environ.get(var, "").strip()
    return Path(value).expanduser().absolute() if value else None


def read_user_file(path: Path, what: str) -> bytes:
    """The bytes of a file the user named (`what`: "prompt", "prompts", "trace" …); every failure is one line that
    names the file and why."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise LlmtraceError(f"{what} file not found: {path}; check the path") from None
    except IsADirectoryError:
        raise LlmtraceError(f"{what} file is a directory: {path}") from None
    except PermissionError:
        raise LlmtraceError(f"{what} file is not readable: {path}") from None
    except OSError as e:
        raise LlmtraceError(f"cannot read {what} file {path}: {e.strerror or e}") from None
