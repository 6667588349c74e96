"""Where a command may write: the one check of every output path, made before any slow work.

Three rules, for every file a command writes (--json, --jsonl, --html, report's -o, --save-base, --save-tensors, ...):

1. No output is one of the command's inputs (the prompt file, the text, a trace, a base file, the --resume file, a
   model or control vector given as a path), and no two outputs are one file. Paths are compared as the file system
   sees them: relative paths, `..` and symlinks resolved, hard links by their inode.
2. An existing file is written over only when llmtrace wrote it (`written_by_llmtrace`: recognised by its content) or
   when it is empty; anything else needs --force.
3. The directory can take the file (fsutil.check_writable_target).

`-` (stdout) and devices (/dev/null) are no files: they are never refused for existing.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from llmtrace.errors import UsageError

Paths = Union[str, Path, None, Iterable[Union[str, Path, None]]]

FORCE_HINT = "give another name, or --force to write over it"


def check_outputs(outputs: Mapping[str, Optional[str]], inputs: Optional[Mapping[str, Paths]] = None, *,
                  force: bool = False) -> None:
    """Refuse, with one line (exit 2), what the rules above forbid. `outputs`: {flag: FILE or None}, e.g.
    {"--json": "run.json", "--jsonl": None}; `inputs`: {what the command reads, in words: path(s) or None}, e.g.
    {"the prompt file (--file)": "prompt.txt"}. An input that is not there is left out (a registry name given to -m
    is no file); the command says so itself when it reads it."""
    from llmtrace.fsutil import check_writable_target

    given = [(flag, str(path)) for flag, path in outputs.items() if path is not None]
    on_stdout = [flag for flag, path in given if path == "-"]
    if len(on_stdout) > 1:
        raise UsageError(f"{on_stdout[0]} - and {on_stdout[1]} - both want stdout; send one of them to a file")
    files = [(flag, path) for flag, path in given if path != "-"]
    for i, (flag, path) in enumerate(files):
        if _is_device(path):
            continue
        for other_flag, other in files[:i]:
            if _same_file(path, other):
                raise UsageError(f"{other_flag} and {flag} name the same file ({other}); give them different names")
        for what, source in _inputs(inputs or {}):
            if _same_file(path, source):
                same = "" if path == source else f"{source}, "
                raise UsageError(f"{flag} {path} is {same}{what}: writing it would destroy it; give the output "
                                 f"another name")
        if not force and os.path.isfile(path) and not written_by_llmtrace(path):
            raise UsageError(f"{flag} {path}: the file exists and llmtrace did not write it; {FORCE_HINT}")
    for _, path in files:
        check_writable_target(Path(path))


def _inputs(inputs: Mapping[str, Paths]) -> Iterable[tuple[str, str]]:
    """(what, path) for each input that is a file or directory here (stdin, `-`, is none)."""
    for what, paths in inputs.items():
        if paths is None or isinstance(paths, (str, Path)):
            paths = [paths]
        for p in paths:
            if p is not None and str(p) != "-" and os.path.exists(p):
                yield what, str(p)


def _is_device(path: str) -> bool:
    """A device or a pipe (/dev/null, /dev/stdout): written in place, never replaced, so never refused for existing
    or for being named twice."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def _same_file(a: str, b: str) -> bool:
    """Whether two paths reach one file: the same path once resolved (relative, `..`, symlinks), or, when both exist,
    the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there yet
        return False


# ----------------------------------------------------------------------------------------------------------------
# what llmtrace wrote, by content

# The first JSON object of each output that names no "schema" of its own, by the keys it always has (the writers
# are in cli/tokenize.py and cli/models.py). Trace, comparison, sweep and eval files name their schema, or start
# with an event of a kind the trace schema lists.
SIGNATURES = (
    frozenset({"text", "parse_special", "add_special_tokens", "count", "tokens"}),  # tokenize --json
    frozenset({"ids", "tokens", "text"}),  # detokenize --json
    frozenset({"kind", "index", "id", "piece", "visible", "bytes", "special"}),  # tokenize/detokenize --jsonl
    frozenset({"cache_dir", "user_registry", "models"}),  # models --json
    frozenset({"name", "sources", "state", "defined_in"}),  # models --jsonl
    frozenset({"name", "kind", "path", "downloaded"}),  # pull --json
    frozenset({"name", "kind", "file", "bytes"}),  # pull --jsonl
)
SCHEMA_FIRST = re.compile(rb'\s*\{\s*"schema"\s*:\s*"llmtrace\.')  # {"schema": "llmtrace.trace/1", ... (JSON)
GENERATOR = re.compile(rb'<meta\s+name="generator"\s+content="llmtrace', re.IGNORECASE)  # every page's <head>
OLD_PAGE = re.compile(rb"<title>llmtrace (report|compare|eval|patch)\b")  # a page of a version before that tag
HEAD = 8192  # bytes read to recognise a page or a document by its start
WHOLE = 64 << 20  # the most read to parse a JSON document or first line that does not say at its start


def written_by_llmtrace(path: Union[str, Path]) -> bool:
    """Whether the file at `path` is one llmtrace writes (or empty, which holds nothing to lose): a trace or any
    --json/--jsonl output, an HTML page (its generator meta tag), a --save-tensors or --save-base file (safetensors
    whose metadata names an llmtrace schema)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEAD)
            if size == 0:
                return True
            if GENERATOR.search(head) or OLD_PAGE.search(head) or SCHEMA_FIRST.match(head):
                return True
            if _llmtrace_safetensors(f, head):
                return True
            f.seek(0)
            first = f.readline(WHOLE)
            if _llmtrace_object(first):
                return True
            if size <= WHOLE and first.strip() in (b"{", b"["):  # an indented document (models --json)
                f.seek(0)
                return _llmtrace_object(f.read())
    except OSError:
        return False
    return False


def _llmtrace_object(text: bytes) -> bool:
    try:
        value = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(value, dict):
        return False
    if isinstance(value.get("event"), str):
        from llmtrace.trace.reader import event_kinds

        return value["event"] in event_kinds()
    keys = value.keys()
    return any(signature <= keys for signature in SIGNATURES)


def _llmtrace_safetensors(f, head: bytes) -> bool:
    """A safetensors file (8 bytes of header length, then the header's JSON) whose metadata says llmtrace wrote it:
    {"schema": "llmtrace.tensors/1"} (--save-tensors) or {"format": "llmtrace.eval-base/1"} (--save-base)."""
    if len(head) < 10 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    if n > WHOLE:
        return False
    f.seek(8)
    try:
        meta = json.loads(f.read(n)).get("__metadata__") or {}
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(meta, dict) and any(str(meta.get(k, "")).startswith("llmtrace.") for k in ("schema", "format"))


def control_vector_files(interventions) -> list[str]:
    """The files of the control vectors among parsed interventions (run.interventions): inputs of the command."""
    return [iv.path for iv in interventions if getattr(iv, "kind", None) == "control_vector"]
