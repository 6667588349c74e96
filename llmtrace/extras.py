"""How to install one of llmtrace's optional extras (serve, ray, docs, big), said in the form that fits how this
llmtrace was installed: a clone installed with `pip install -e .` (or run from its folder) needs
`pip install -e '.[serve]'` in that folder, an install from an index `pip install 'llmtrace[serve]'`. pip records
how it installed a package in the distribution's direct_url.json (PEP 610): `dir_info` for a local folder (with
`editable`), `vcs_info` for a git URL, no file at all for an index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

EXTRAS = {
    "serve": "Starlette and uvicorn",
    "ray": "Ray",
    "docs": "MkDocs and its theme",
    "big": "accelerate",
}


def direct_url() -> Optional[dict]:
    """The installed llmtrace's direct_url.json, or None (installed from an index, or not installed at all)."""
    from importlib import metadata

    try:
        text = metadata.distribution("llmtrace").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def install_form(extra: str, package_dir: Path, recorded: Optional[dict], cwd: Path) -> str:
    """The pip command that adds EXTRA to the llmtrace whose package folder is `package_dir`, installed as `recorded`
    (its direct_url.json, or None) says; `cwd`: where the user is (a clone that is the current folder is '.')."""
    clone = package_dir.parent
    local = recorded is not None and "dir_info" in recorded
    editable = local and bool(recorded["dir_info"].get("editable"))
    if (clone / "pyproject.toml").is_file() and (recorded is None or editable):  # the code runs from a clone
        where = "." if cwd.resolve() == clone.resolve() else str(clone)
        return f"pip install -e '{where}[{extra}]'"
    if local and recorded.get("url", "").startswith("file://"):  # a wheel built from a folder
        return f"pip install '{recorded['url'][len('file://'):]}[{extra}]'"
    if recorded is not None and "vcs_info" in recorded:
        vcs = recorded["vcs_info"].get("vcs", "git")
        return f"pip install 'llmtrace[{extra}] @ {vcs}+{recorded['url']}'"
    return f"pip install 'llmtrace[{extra}]'"


def install_hint(extra: str) -> str:
    """`install_form` for the llmtrace running now, from where the user is."""
    return install_form(extra, Path(__file__).resolve().parent, direct_url(), Path.cwd())


def needs_extra(what: str, extra: str) -> str:
    """The one line for a feature whose optional extra is missing: `llmtrace serve needs its optional extra serve
    (Starlette and uvicorn): pip install -e '.[serve]'`."""
    return f"{what} needs its optional extra {extra} ({EXTRAS[extra]}): {install_hint(extra)}"
