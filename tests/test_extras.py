"""The optional extras (llmtrace/extras.py, issue 52 item 4): the line that says one is missing names the pip
command that fits how llmtrace was installed (a clone: `pip install -e '.[serve]'` in it; an index:
`pip install 'llmtrace[serve]'`), read from pip's own record (direct_url.json, PEP 610)."""

import sys
from pathlib import Path

import pytest
from helpers import fails

from llmtrace.extras import EXTRAS, direct_url, install_form, install_hint

ROOT = Path(__file__).resolve().parents[1]


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "my clone"
    (clone / "llmtrace").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("[project]\nname = 'llmtrace'\n")
    return clone


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_the_form_follows_pips_record(tmp_path, extra):
    clone = _clone(tmp_path)
    editable = {"url": clone.as_uri(), "dir_info": {"editable": True}}  # what `pip install -e .` records
    assert install_form(extra, clone / "llmtrace", editable, clone) == f"pip install -e '.[{extra}]'"
    assert install_form(extra, clone / "llmtrace", editable, tmp_path) == f"pip install -e '{clone}[{extra}]'"
    assert install_form(extra, clone / "llmtrace", None, clone) == f"pip install -e '.[{extra}]'"  # PYTHONPATH
    site = tmp_path / "site-packages"
    (site / "llmtrace").mkdir(parents=True)
    assert install_form(extra, site / "llmtrace", None, tmp_path) == f"pip install 'llmtrace[{extra}]'"  # an index
    built = {"url": "file:///src/llmtrace", "dir_info": {}}  # `pip install /src/llmtrace`: a wheel built from it
    assert install_form(extra, site / "llmtrace", built, tmp_path) == f"pip install '/src/llmtrace[{extra}]'"
    vcs = {"url": "https://github.com/x/llmtrace", "vcs_info": {"vcs": "git", "commit_id": "ab12"}}
    assert install_form(extra, site / "llmtrace", vcs, tmp_path) == \
        f"pip install 'llmtrace[{extra}] @ git+https://github.com/x/llmtrace'"


def test_this_checkout_is_a_clone(monkeypatch):
    """The suite runs from a clone (editable, or on PYTHONPATH): the hint is the editable form, '.' from its root."""
    record = direct_url()
    assert record is None or "dir_info" in record  # pip's record, read for real
    monkeypatch.chdir(ROOT)
    assert install_hint("serve") == "pip install -e '.[serve]'"
    monkeypatch.chdir(ROOT / "docs")
    assert install_hint("ray") == f"pip install -e '{ROOT}[ray]'"


def test_serve_without_its_extra_says_the_clones_form(capsys, monkeypatch):
    """README tour line 10 after the README's install (`pip install -e .`): one line naming the editable form."""
    monkeypatch.setitem(sys.modules, "starlette", None)  # import starlette fails, as where it is not installed
    monkeypatch.chdir(ROOT)
    line = fails(capsys, 1, "serve", "--no-browser", says=("needs its optional extra serve",))
    assert line.endswith("pip install -e '.[serve]'"), line
    assert "llmtrace[serve]" not in line


def test_device_map_without_accelerate_says_the_clones_form(capsys, monkeypatch, tiny_lm):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # find_spec gives None, as where it is not installed
    monkeypatch.chdir(ROOT)
    fails(capsys, None, "generate", "Hi", "-m", tiny_lm.path, "--device-map", "auto",
          says=("needs accelerate", "pip install -e '.[big]'"))
