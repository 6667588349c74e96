"""Writing a trace as it happens: the JSONL stream and the JSON document, without torch.

The stream is written to the file the user named, line by line, so that a reader can follow it (`tail -f`) and a run
that dies leaves a prefix in which every complete line parses. The document is one JSON value, so it is written whole
under a temporary name and renamed over the target at the end (`fsutil.write_text_atomic`), or not at all.

Neither needs the model or torch: the command opens its stream before the model loads, so that a Ctrl-C during the
load still ends the stream with a summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import orjson

from llmtrace.errors import LlmtraceError
from llmtrace.trace.events import SCHEMA_ID
from llmtrace.fsutil import sigint_deferred

ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
# what orjson cannot write (an integer beyond 64 bits) goes to the json module, in orjson's compact layout
_FALLBACK = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def dumps(value) -> str:
    """One event (or any JSON value) as compact JSON text, the one encoding of every line llmtrace writes.

    orjson: a full trace writes 574 tensor events a step on SmolLM2, and the json module's encoding cost more than a
    third of what tracing did. Numbers are the shortest text that reads back as the same double (Python's repr, except
    that 1e-05 is written 0.00001); text is UTF-8 as it is (no \\u escapes); a non-finite float becomes null (JSON
    has none; the trace writes None for one anyway)."""
    return dumps_bytes(value).decode()


def dumps_bytes(value) -> bytes:
    """dumps, as the UTF-8 bytes a file receives (what the JSONL sink writes, and TensorEvent.line holds)."""
    try:
        return orjson.dumps(value, option=ORJSON_OPTIONS)
    except orjson.JSONEncodeError:
        return _FALLBACK.encode(value).encode()


def _write_stdout(data: bytes) -> None:
    """UTF-8 lines to standard output: to its byte stream, after what its text layer holds (a stand-in without one,
    as a test's capture may be, gets the text)."""
    raw = getattr(sys.stdout, "buffer", None)
    if raw is None:
        sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()
        return
    sys.stdout.flush()
    raw.write(data)
    raw.flush()


class JsonlWriter:
    """One JSON object per line to FILE (`-` is stdout), written as the events come.

    FILE is created, or emptied if it exists, by the first event, so a command that fails before its run starts leaves
    an existing FILE alone. Lines are written whole: the tensor events of a forward pass are held and written together
    with the event that follows them, in one write call, and flushed. So a reader sees each step as it ends and never
    half a line (except after a crash, which can cut the last one)."""

    def __init__(self, target: str):
        self.target = target
        self.started = False  # something has been written
        self.ended = False  # the last event written was the summary
        self._held: list[bytes] = []  # lines of tensor events not written yet, as UTF-8
        self._fd: Optional[int] = None

    def __call__(self, event: dict) -> None:
        # A tensor event carries its JSON line already (trace.recorder.TensorEvent.line).
        self._held.append(getattr(event, "line", None) or dumps_bytes(event))
        kind = event.get("event")
        self.ended = kind == "summary"
        if kind != "tensor":  # one write per step instead of hundreds at --trace full
            self._write_held()

    def many(self, events: list[dict]) -> None:
        """Tensor events, held to be written with the event that follows them (Recorder.emit_many)."""
        self._held.extend(getattr(event, "line", None) or dumps_bytes(event) for event in events)
        self.ended = False

    def _write_held(self) -> None:
        if not self._held:
            return
        with sigint_deferred():  # a Ctrl-C waits until the lines are out whole
            data = b"\n".join(self._held) + b"\n"
            self._held.clear()
            self.started = True
            if self.target == "-":
                _write_stdout(data)
                return
            if self._fd is None:
                self._fd = self._open()
            data = memoryview(data)
            try:
                while data:  # one call writes it all, but a write may legally stop short
                    data = data[os.write(self._fd, data):]
            except OSError as e:  # a full disk (/dev/full), a lost mount: say which file
                raise LlmtraceError(f"cannot write {self.target}: {e.strerror}") from None

    def _open(self) -> int:
        try:  # through a symlink, and in place for a device or a pipe (/dev/null, a FIFO)
            return os.open(self.target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as e:
            raise LlmtraceError(f"cannot write {self.target}: {e.strerror}; choose another path") from None

    def close(self) -> None:
        """Write what is held and close the file. What was written stays, whether the run finished or not."""
        try:
            self._write_held()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class JsonDocWriter:
    """Collects every event; `write()` saves one JSON document atomically (never a half-written file)."""

    def __init__(self, target: str):
        self.target = target
        self.events: list[dict] = []

    def __call__(self, event: dict) -> None:
        self.events.append(event)

    def document(self) -> dict:
        return {"schema": SCHEMA_ID, "events": self.events}

    def write(self) -> None:
        text = dumps(self.document())
        if self.target == "-":
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            return
        from llmtrace.fsutil import write_text_atomic

        write_text_atomic(Path(self.target), text + "\n")
