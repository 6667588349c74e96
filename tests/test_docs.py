"""The README and the documentation site in docs/ (issue 38).

- Every `llmtrace …` line in a code block of the README or of a page (English and Chinese) parses against the CLI,
  with click's own parser on the application the `llmtrace` command runs (the options exist, their values convert),
  without running the command; and each model or file it reads is one a newcomer has: a registry name (models.toml),
  a file made earlier in the same example (an output of an earlier command, or a path an earlier shell line names),
  or a file of this repository: one git tracks, never one a user left in the tree by following the tour there.
- The README stays short, with the set-up first; the site builds with `mkdocs build --strict` when the `docs` extra
  is installed; the learner's guide exists in Chinese, in the seeds' terms, with the same commands as in English.
"""

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import typer

try:  # newer typer carries its own copy of click (as llmtrace/cli/main.py does)
    from typer._click.exceptions import ClickException
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException
try:
    from click.exceptions import Exit as _ClickExit
except ImportError:
    _ClickExit = typer.Exit
ClickExit = (typer.Exit, _ClickExit)  # what --help and --version end with

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What a command's parameters hold (click's names for them). A model is a registry name or a file; these read files
# (`-` is stdin); these write them.
MODEL_PARAMS = {"model"}
REGISTRY_PARAMS = {"name", "names"}  # pull NAME, rm NAME...
INPUT_PARAMS = {"file", "prompts_file", "messages", "control_vector", "b_control_vector"}  # in any command
TRACE_INPUTS = {"show": {"trace"}, "report": {"trace"}, "diff": {"trace_a", "trace_b"}}  # (generate's --trace is a depth)
OUTPUT_PARAMS = {"json_out", "jsonl", "html", "output", "save_tensors"}
TRANSCRIPT = "$ "  # a block that shows a command and its output marks the command so
OUTPUT_LANGS = {"text", "console", "output"}  # blocks of output: only their `$ ` lines are commands
SKIPPED_LANGS = {"python", "py", "json", "jsonc", "toml", "yaml", "yml", "html", "javascript", "js"}
SEPARATORS = {"|", "||", "&&", ";", "&"}


@dataclass
class Command:
    where: str  # file:line
    words: list[str]  # the shell words after `llmtrace`


@dataclass
class Section:
    """The code of one section of a page (from a heading to the next): one example, read in order."""

    where: str
    items: list = field(default_factory=list)  # Command, or the text of a shell command that is not llmtrace


def registry_names() -> set[str]:
    return set(tomllib.loads((ROOT / "models.toml").read_text())["models"])


def shell_commands(line: str) -> list[list[str]]:
    """The commands of one shell line, split at pipes, `&&` and `;`, without comments and redirections."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current, words = [], [], list(lexer)
    i = 0
    while i < len(words):
        word = words[i]
        if word in SEPARATORS:
            commands.append(current)
            current = []
        elif word in {">", ">>", "<", "2>", "&>"}:
            i += 1  # the redirection's target
        else:
            current.append(word)
        i += 1
    commands.append(current)
    return [c for c in commands if c]


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join the lines a trailing backslash continues."""
    out, pending, start = [], "", 0
    for number, line in lines:
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def sections(path: Path, text: str | None = None) -> list[Section]:
    """The page's code blocks (or TEXT's, named by PATH), grouped by section, as commands in the order they appear."""
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    text = path.read_text(encoding="utf-8") if text is None else text
    result = [Section(f"{name}:1")]
    fence, lang, block = None, "", []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence, lang, block = stripped[:3], stripped[3:].strip().lower(), []
            elif re.match(r"#{1,6} ", line):
                result.append(Section(f"{name}:{number}"))
            continue
        if stripped.startswith(fence):
            result[-1].items.extend(_block_items(name, lang, block))
            fence = None
            continue
        block.append((number, line))
    return result


def _block_items(name: str, lang: str, block: list[tuple[int, str]]) -> list:
    if lang in SKIPPED_LANGS:
        return []
    transcript = lang in OUTPUT_LANGS or any(line.lstrip().startswith(TRANSCRIPT) for _, line in block)
    items = []
    for number, line in logical_lines(block):
        text = line.strip()
        if transcript:
            if not text.startswith(TRANSCRIPT):
                continue
            text = text[len(TRANSCRIPT):]
        try:
            commands = shell_commands(text)
        except ValueError:  # not shell (an unbalanced quote): an error only where it names llmtrace
            assert not text.startswith("llmtrace "), f"{name}:{number}: cannot split {text!r} as a shell line"
            continue
        for words in commands:
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]  # VAR=value llmtrace ...
            if words and words[0] == "llmtrace":
                items.append(Command(f"{name}:{number}", words[1:]))
            elif words:
                items.append(" ".join(words))
    return items


def _cli():
    import typer.main

    import llmtrace.cli.main  # noqa: F401  (registers every command on the application)
    from llmtrace.cli.app import app

    return typer.main.get_command(app)


def parse(group, words: list[str]):
    """click's own parse of `llmtrace WORDS`, without running it: the command's parameters, or None for --help."""
    if not words or words[0].startswith("-"):
        try:
            group.make_context("llmtrace", list(words), resilient_parsing=False)
        except ClickExit:  # --version, --help
            pass
        return None
    root = group.make_context("llmtrace", [words[0]], resilient_parsing=False)
    command = group.get_command(root, words[0])
    if command is None:
        raise AssertionError(f"no command {words[0]!r}")
    try:
        return command.make_context(words[0], list(words[1:]), parent=root, resilient_parsing=False).params
    except ClickExit:  # --help
        return None


def _norm(value: str) -> str:
    return os.path.normpath(value)


_SHIPPED: list = []


def in_the_repository(value: str) -> bool:
    """VALUE (relative to the root) is a file, or a folder of files, that a fresh clone holds: one git tracks. A file
    a user left in the root (the README tour's trace.jsonl, report.html) is not one a newcomer has. Outside a git
    checkout (an unpacked sdist), what exists and .gitignore does not name."""
    if not _SHIPPED:
        done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True)
        _SHIPPED.append(set(done.stdout.split("\0")) - {""} if done.returncode == 0 else None)
    shipped, name = _SHIPPED[0], Path(_norm(value)).as_posix()
    if Path(value).is_absolute() or name.startswith("../"):
        return False
    if shipped is None:
        ignored = {line.strip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if line.startswith("/")}
        return (ROOT / name).exists() and name not in ignored
    return name in shipped or any(f.startswith(name + "/") for f in shipped)


def _named_before(value: str, shell_lines: list[str]) -> bool:
    """An earlier shell line of the example names the path, or a folder it is in (python -c "...Path('/tmp/moe')...")."""
    path = Path(_norm(value))
    candidates = [path, *[p for p in path.parents if len(p.parts) >= (3 if p.is_absolute() else 1)]]
    return any(str(c) in line for c in candidates for line in shell_lines)


def check_section(group, section: Section, models: set[str]) -> list[str]:
    """The problems of one example's commands, each as `file:line: llmtrace ...: what is wrong`."""
    problems, made, shell_lines = [], set(), []
    for item in section.items:
        if isinstance(item, str):
            shell_lines.append(item)
            continue
        shown = f"{item.where}: llmtrace {' '.join(item.words)}"
        try:
            params = parse(group, item.words)
        except (ClickException, AssertionError) as e:
            message = e.format_message() if isinstance(e, ClickException) else str(e)
            problems.append(f"{shown}: {message}")
            continue
        if params is None:
            continue

        def have(value: str, *, model: bool) -> bool:
            if value == "-" or _norm(value) in made or _named_before(value, shell_lines):
                return True
            if model and value in models:
                return True
            return in_the_repository(value)

        for key, value in params.items():
            values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, str)]
            for v in values:
                if key in REGISTRY_PARAMS and item.words[0] in ("pull", "rm") and v not in models:
                    problems.append(f"{shown}: {v!r} is not a registry name")
                elif key in MODEL_PARAMS and not have(v, model=True):
                    problems.append(f"{shown}: the model {v!r} is neither a registry name nor made earlier")
                elif (key in INPUT_PARAMS or key in TRACE_INPUTS.get(item.words[0], ())) and not have(v.rsplit(":", 1)[0] if "control_vector" in key else v,
                                                      model=False):
                    problems.append(f"{shown}: reads {v!r}, which no earlier line of the example makes")
        for key in OUTPUT_PARAMS:
            if isinstance(params.get(key), str):
                made.add(_norm(params[key]))
    return problems


def all_sections() -> list[Section]:
    return [s for path in DOC_FILES for s in sections(path)]


# ----------------------------------------------------------------------------------------------------------------


def test_every_llmtrace_line_parses_and_names_what_a_newcomer_has():
    group, models = _cli(), registry_names()
    every = all_sections()
    commands = [i for s in every for i in s.items if isinstance(i, Command)]
    problems = [p for s in every for p in check_section(group, s, models)]
    assert not problems, "\n".join(problems)
    # the check read what it should: the README's run command and lines of the Chinese guide among them
    assert any(c.where.startswith("README.md") and c.words[:1] == ["generate"] for c in commands)
    assert any(c.where.startswith("docs/guide.zh.md") for c in commands)
    assert {c.words[0] for c in commands if c.words} >= {"generate", "tokenize", "detokenize", "explain", "lens",
                                                          "show", "report", "compare", "diff", "patch", "serve"}


@pytest.mark.parametrize(("lines", "wrong"), [
    # issue 38: the README's compare example named a file a newcomer does not have
    (['llmtrace compare "Hi" -m SmolLM2-135M-Instruct.Q4_1.gguf --b-dtype bfloat16'], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    (["llmtrace generate 'Hi' --no-such-option"], "--no-such-option"),
    (["llmtrace show trace.jsonl"], "trace.jsonl"),
    (["llmtrace generate 'Hi' --json other.json", "llmtrace report trace.json -o r.html"], "trace.json"),
    (["llmtrace pull no-such-model"], "no-such-model"),
    (["llmtrace frobnicate 'Hi'"], "frobnicate"),
    (["llmtrace generate 'Hi' -n many"], "many"),
])
def test_the_check_catches_a_wrong_line(lines, wrong):
    section = Section("example", [Command("example", shlex.split(line)[1:]) for line in lines])
    problems = check_section(_cli(), section, registry_names())
    assert len(problems) == 1 and wrong in problems[0], problems


def test_a_file_left_in_the_root_is_not_one_a_newcomer_has():
    """Following the README's tour inside the clone leaves trace.jsonl (and report.html) in the root: the check still
    says that `show trace.jsonl` reads a file no earlier line makes, and git ignores the tour's outputs. (A file of
    that name already there is the user's: the test leaves it as it is.)"""
    stray = ROOT / "trace.jsonl"
    mine = not stray.exists()
    if mine:
        stray.write_text('{"event": "run"}\n')
    try:
        test_the_check_catches_a_wrong_line(["llmtrace show trace.jsonl"], "trace.jsonl")
        test_the_check_catches_a_wrong_line(["llmtrace report trace.jsonl -o report.html"], "trace.jsonl")
    finally:
        if mine:
            stray.unlink()
    assert in_the_repository("benchmarks/passage.txt") and in_the_repository("benchmarks")  # a file, a folder
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "trace.jsonl", "report.html", "eval.html"],
                             capture_output=True, text=True)
    assert ignored.stdout.split() == ["trace.jsonl", "report.html", "eval.html"]


@pytest.mark.parametrize("lines", [
    ["llmtrace generate 'Hi' -n 4 --jsonl trace.jsonl", "llmtrace show trace.jsonl"],
    ["llmtrace generate 'Hi' --html a.html --json ./t.json", "llmtrace report t.json -o b.html"],
    ["llmtrace compare --file benchmarks/passage.txt --b-fast -m smollm2-135m-instruct"],
    ["llmtrace --version", "llmtrace generate --help"],
])
def test_the_check_accepts_a_right_example(lines):
    section = Section("example", [Command("example", shlex.split(line)[1:]) for line in lines])
    assert check_section(_cli(), section, registry_names()) == []


def test_a_file_an_earlier_shell_line_makes_counts():
    text = ("## x\n\n```sh\n"
            "python3 -c \"from pathlib import Path; make(Path('/tmp/moe'))\"\n"
            "llmtrace generate 'Hi' -m /tmp/moe/qwen3_moe/hf -n 3 | head -2 && echo done  # a comment\n"
            "```\n\n```text\n$ llmtrace lens 'Hi' -m /tmp/other/hf\nllmtrace output, not a command\n```\n")
    found = sections(Path("example.md"), text)
    items = found[-1].items
    assert [i.words[0] if isinstance(i, Command) else i.split()[0] for i in items] == ["python3", "generate", "head",
                                                                                      "echo", "lens"]
    problems = check_section(_cli(), found[-1], registry_names())
    assert len(problems) == 1 and "/tmp/other/hf" in problems[0], problems


# ----------------------------------------------------------------------------------------------------------------


def test_the_tour_marks_each_line_that_needs_an_extra_and_promises_only_what_it_runs():
    """After the README's own install (`pip install -e .`) every line of the tour runs, or says on the line which
    extra it needs and how to install it; a comment promises per-layer figures only where the line asks for them."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    tour = readme[readme.index("## A ten-line tour"):].split("```")[1].splitlines()[1:]
    needs = {"serve": "serve", "--ray": "ray", "--device-map": "big"}
    for line in tour:
        command, _, comment = line.partition("#")
        for word, extra in needs.items():
            if re.search(rf"(^llmtrace {word}\b|\s{word}\b)", command):
                assert f"pip install -e '.[{extra}]'" in comment, line
        if "per layer" in comment and command.split()[1] in ("eval", "generate"):
            assert "--layers" in command, line
    assert any(line.startswith("llmtrace serve") for line in tour)


def test_no_page_gives_a_count_of_tests_to_go_stale():
    """The suite's size is what `pytest --collect-only` says; the README and the pages give no figure to keep in
    sync (they gave 1,702 and 1,383 for one suite)."""
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b\d[\d,]* (quick )?tests\b|collects [\d,]+", text), path.name


def test_the_readme_is_short_and_starts_with_the_set_up():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert headings[0] == "Set up and run"
    for marker in ("<!-- run-command -->", "<!-- test-command -->"):
        block = readme[readme.index(marker):].split("```")[1]
        assert block.startswith("sh\n") and len(block.strip().splitlines()) == 2, block
    test_command = readme[readme.index("<!-- test-command -->"):].split("```")[1]
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", test_command).group(1).split(",")
    assert {"test", "serve", "docs"} <= set(extras) and "pytest" in test_command
    run_command = readme[readme.index("<!-- run-command -->"):].split("```")[1]
    assert " -m " not in run_command.split("llmtrace generate")[1]  # the default model
    assert re.search(r"!\[[^\]]+\]\(docs/[a-z-]+\.png\)", readme)  # one picture
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)\)", readme):
        assert (ROOT / link).exists(), link


def test_the_chinese_guide_follows_the_english_one_in_the_seeds_terms():
    en = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    zh = (ROOT / "docs" / "guide.zh.md").read_text(encoding="utf-8")
    for term in ("分词", "词元", "嵌入", "旋转位置编码", "注意力", "分组查询注意力", "前馈网络", "残差", "归一化", "采样", "温度",
                 "KV 缓存"):
        assert term in zh, term
    for step in range(1, 13):
        assert f"s{step}" in zh and f"s{step}" in en

    def commands(path: Path) -> list[str]:
        return [" ".join(i.words) for s in sections(path) for i in s.items if isinstance(i, Command)]

    assert commands(ROOT / "docs" / "guide.zh.md") == commands(ROOT / "docs" / "guide.md")


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:"):]
    entries = re.findall(r":\s*([\w.-]+\.md)\s*$", nav, flags=re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if not p.name.endswith(".zh.md"))
    assert sorted(entries) == pages
    for name in ("research-api.md", "eval.md", "exit-codes.md"):  # pages other work fills in
        assert name in entries
    for page in (ROOT / "docs").glob("*.zh.md"):
        assert (page.parent / page.name.replace(".zh.md", ".md")).exists(), page.name
    assert ".site/" in (ROOT / ".gitignore").read_text().splitlines()  # mkdocs.yml's site_dir


def test_mkdocs_build_strict(tmp_path):
    """The site builds with no warning (links, anchors, nav) in both languages."""
    missing = [m for m in ("mkdocs", "material", "mkdocs_static_i18n") if _missing(m)]
    if missing:
        from llmtrace.extras import install_hint

        said = f"the docs extra is not installed ({', '.join(missing)}): {install_hint('docs')}"
        pytest.fail(said) if os.environ.get("CI") == "true" else pytest.skip(said)
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file() and (site / "guide.html").is_file()
    zh = (site / "zh" / "guide.html").read_text(encoding="utf-8")
    assert "旋转位置编码" in zh and 'lang="zh"' in zh
    assert (site / "report.png").is_file() and not (site / "screenshot.py").exists()
    for page in [*site.glob("*.html"), *site.glob("zh/*.html")]:  # nothing loaded from the network (no web fonts)
        loads = re.findall(r'<(?:script|img|link|iframe)[^>]+(?:src|href)="(https?://[^"]+)"', page.read_text("utf-8"))
        assert not loads, (page.name, loads)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
