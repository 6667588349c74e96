"""The local model cache: where models live, the manifest that says a copy is whole, GGUF conversions, removal.

Layout and rules: see llmtrace/registry.py's docstring.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional

try:
    import fcntl
except ImportError:  # Windows: no lock, so no clean-up of killed downloads either
    fcntl = None

from llmtrace.fsutil import env_dir, sigint_deferred
from llmtrace.registry.models_toml import Source

MANIFEST_NAME = "llmtrace-manifest.json"
MANIFEST_VERSION = 1
CONVERT_VERSION = 1  # bump when the cached conversion format of GGUF files changes


def cache_dir() -> Path:
    """$LLMTRACE_HOME, else $XDG_CACHE_HOME/llmtrace, else ~/.cache/llmtrace."""
    return env_dir("LLMTRACE_HOME") or (env_dir("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmtrace"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# the cache


@dataclass
class ResolvedModel:
    name: str
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the HF directory that holds config.json
    downloaded: bool = field(default=False, compare=False)  # true when this call fetched it


@dataclass
class CacheStatus:
    state: Literal["present", "absent", "incomplete"]
    model: Optional[ResolvedModel] = None
    reason: str = ""  # why an existing directory is not a whole model
    bytes: int = 0  # the model's size on disk, when present


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir(gguf: Path) -> Path:
    """Where the float32 conversion of a GGUF file is cached: named after the file's path, size and mtime."""
    st = gguf.stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERT_VERSION}"
    return cache_dir() / "converted" / f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def model_dir(key: str) -> Path:
    """The cache directory of a registry name, or of a hub id ("org/name")."""
    if "/" in key:
        org, name = key.split("/")
        return cache_dir() / "hub" / org / name
    return cache_dir() / "models" / key


def cache_status(key: str, *, verify: bool = False) -> CacheStatus:
    """Whether the cache holds a whole copy of `key` (sizes checked; every sha256 too when `verify`)."""
    directory = model_dir(key)
    if not directory.is_dir():
        return CacheStatus("absent")
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return CacheStatus("incomplete", reason=f"{directory} has no {MANIFEST_NAME}")
    except (OSError, ValueError):
        return CacheStatus("incomplete", reason=f"{directory / MANIFEST_NAME} is unreadable")
    known = isinstance(manifest, dict) and manifest.get("version") == MANIFEST_VERSION
    files = manifest.get("files") if known else None
    main = manifest.get("path") if known else None
    if not known or manifest.get("kind") not in ("gguf", "hf") or not isinstance(files, dict) or main not in {".", *files}:
        return CacheStatus("incomplete", reason=f"{directory / MANIFEST_NAME} is not a manifest this llmtrace knows")
    total = 0
    for rel, info in files.items():
        path = directory / rel
        size = path.stat().st_size if path.is_file() else None
        if not isinstance(info, dict) or size != info.get("size"):
            return CacheStatus("incomplete", reason=f"{path} is missing or has the wrong size")
        if verify and sha256_of(path) != info.get("sha256"):
            return CacheStatus("incomplete", reason=f"{path} fails its sha256 check")
        total += size
    model = ResolvedModel(name=key, kind=manifest["kind"], path=(directory / main).resolve())
    return CacheStatus("present", model=model, bytes=total)


def write_manifest(directory: Path, key: str, kind: str, main: str, source: Source, known: dict[str, str]) -> None:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": known.get(rel) or sha256_of(path)}
    manifest = {
        "version": MANIFEST_VERSION,
        "name": key,
        "kind": kind,
        "path": main,
        "source": source.to_dict(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# conversions and disk use: what a cached model takes, and removing it
#
# A GGUF model is converted to float32 safetensors on first load, under converted/<stem>-<key>/ (converted_dir).
# That copy is several times the GGUF's size, and it belongs to the model: `models` counts it, `rm` removes it, and a
# new copy of the GGUF (`pull --force`) removes the conversions of the old one, which nothing would open again.

CONVERSION_SOURCE = "source.json"  # in a conversion directory: the GGUF file it was made from
_CONVERSION_NAME_RE = re.compile(r"(?P<stem>.+)-[0-9a-f]{16}\Z")


def conversion_source(gguf: Path) -> str:
    """The text of a conversion's source.json: the path, size and mtime of the GGUF file it is made from."""
    st = gguf.stat()
    return json.dumps({"path": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n"


def conversions_of(gguf: Path) -> list[Path]:
    """Every cached conversion of the file at `gguf`'s path: the current one and those of earlier copies of it.

    A conversion names its source in source.json; one made before llmtrace wrote that is known by the stem alone.
    """
    root = cache_dir() / "converted"
    if not root.is_dir():
        return []
    target = str(gguf.resolve())
    found = []
    for directory in sorted(root.iterdir()):
        named = _CONVERSION_NAME_RE.match(directory.name)
        if not named or not directory.is_dir():
            continue
        try:
            record = json.loads((directory / CONVERSION_SOURCE).read_text(encoding="utf-8"))
            ours = isinstance(record, dict) and record.get("path") == target
        except FileNotFoundError:
            ours = named["stem"] == gguf.stem
        except (OSError, ValueError):
            ours = False
        if ours:
            found.append(directory)
    return found


def disk_bytes(path: Path) -> int:
    """The bytes of the files under `path` (symbolic links not followed), or of the file itself."""
    if not path.is_dir():
        return path.lstat().st_size if path.exists() else 0
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file that went away while we counted
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


@dataclass
class CachedFiles:
    """Everything on disk that belongs to one cache key."""

    key: str
    directory: Optional[Path]  # the model's directory (whole or not), if there is one
    leftovers: list[Path]  # temporary directories of downloads that were cut off
    conversions: list[Path]  # float32 conversions of its GGUF file

    @property
    def paths(self) -> list[Path]:
        return [*self.conversions, *self.leftovers, *([self.directory] if self.directory else [])]

    @property
    def model_bytes(self) -> int:
        return sum(disk_bytes(p) for p in [*self.leftovers, *([self.directory] if self.directory else [])])

    @property
    def converted_bytes(self) -> int:
        return sum(disk_bytes(p) for p in self.conversions)


def leftovers(target: Path) -> list[Path]:
    """Temporary directories that downloads of `target` left behind: ".NAME.<8 chars>.partial", ".NAME.download-<8>"."""
    stale = re.compile(rf"\.{re.escape(target.name)}\.([a-z0-9_]{{8}}\.partial|download-[a-z0-9_]{{8}})\Z")
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if stale.match(p.name) and p.is_dir())


def cached_files(key: str) -> CachedFiles:
    """What the cache holds for `key` (a registry name or hub id), whole or not."""
    directory = model_dir(key)
    status = cache_status(key)
    if status.model is not None:
        ggufs = [status.model.path] if status.model.kind == "gguf" else []
    else:
        ggufs = sorted(directory.glob("*.gguf")) if directory.is_dir() else []
    conversions = sorted({c for g in ggufs for c in conversions_of(g)})
    return CachedFiles(key, directory if directory.exists() else None, leftovers(directory), conversions)


def _remove_tree(path: Path) -> None:
    """Remove a directory by renaming it to a temporary name first, so that no half-removed copy is ever in place."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    os.replace(path, doomed / path.name)
    shutil.rmtree(doomed)


def prune_conversions(gguf: Path) -> None:
    """Remove the conversions of earlier copies of `gguf`: a new file at its path is never read through them."""
    current = converted_dir(gguf)
    for conversion in conversions_of(gguf):
        if conversion != current:
            with sigint_deferred():
                _remove_tree(conversion)


def remove(key: str) -> int:
    """Remove everything the cache holds for `key`: the model, what downloads of it left, its conversions.

    Returns the bytes freed. Holds the download lock, so that it never removes a copy another llmtrace is writing.
    """
    target = model_dir(key)
    if not target.parent.is_dir():
        return 0
    before = cached_files(key)
    freed = before.model_bytes + before.converted_bytes
    with download_lock(target):  # taking it removes the leftovers of killed downloads
        with sigint_deferred():
            for path in cached_files(key).paths:
                _remove_tree(path)
    return freed  # the empty lock file stays: another llmtrace may be waiting on it


@contextlib.contextmanager
def download_lock(target: Path) -> Iterator[None]:
    """Hold the lock for downloading into `target`. Whoever holds it may delete what killed downloads left behind.

    A second llmtrace that wants the same model waits here, and then finds it in the cache.
    """
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a") as lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"waiting for another llmtrace that is downloading {target.name}…")
                fcntl.flock(lock, fcntl.LOCK_EX)
            for leftover in leftovers(target):
                shutil.rmtree(leftover, ignore_errors=True)
        yield
