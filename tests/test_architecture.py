"""The package's architecture, checked from the source with `ast` (nothing is imported):

- each module belongs to a layer (its folder; the base modules at the top of the package), and imports only from its
  own layer or the layers below it;
- there is no import circle, counting the imports inside functions (they run too);
- no `_private` name is imported from another module;
- nothing is re-exported: a name is imported from the module that defines it, and every imported name is used;
- the layer packages' `__init__.py` files hold a docstring and nothing else, and `llmtrace/__init__.py` (the public
  face) imports nothing when it is imported: its names are looked up lazily;
- no function body is over 80 lines (its docstring excluded);
- no error raised below cli/ names a command-line flag: the library names its keywords, the CLI maps them to flags.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmtrace"

# Bottom to top. A module may import from its own layer and the layers before it in this list.
LAYERS = (
    "base",  # errors.py, extras.py, fsutil.py, console.py, units.py, version.py, sigint.py, words.py: every layer
    "tokens",  # text <-> ids, no torch
    "registry",  # a model spec -> files on disk, no torch
    "model",  # the forward pass
    "checkpoint",  # files -> a built model (needs model, tokens, registry)
    "trace",  # what a run records, writes and reads back
    "run",  # generate, sampler, explain and lens
    "render",  # terminal views of events
    "report",  # the HTML page of events
    "api",  # llmtrace/api.py: the Python API the CLI stands on
    "serve",  # llmtrace serve: the live page's server, on the API
    "cli",  # the commands
)
BASE = {"errors", "extras", "fsutil", "console", "units", "version", "sigint", "words"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] in BASE:
        return "base"
    if parts[1] == "api":
        return "api"
    if parts[1] == "__main__":
        return "cli"
    assert parts[1] in LAYERS, f"{module} is in no layer: add its folder to LAYERS (or its file to BASE)"
    return parts[1]


SOURCES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in SOURCES.items()}


def imports(module: str):
    """(line, imported module, name or None) for every llmtrace import in `module`, at any depth."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "llmtrace":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: a relative import; write the full module path"
            if node.module and node.module.split(".")[0] == "llmtrace":
                for alias in node.names:
                    yield node.lineno, node.module, alias


def target(imported: str, alias) -> str:
    """The module an import runs: `from pkg import submodule` runs pkg.submodule."""
    if alias is not None and f"{imported}.{alias.name}" in SOURCES:
        return f"{imported}.{alias.name}"
    return imported


def defined_names(module: str) -> set[str]:
    """Names a module defines at its top level (also inside top-level if/try), imports from outside llmtrace included:
    those are its own dependencies, not re-exports of llmtrace names."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                names.update(a.asname or a.name.split(".")[0] for a in node.names if not a.name.startswith("llmtrace"))
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("llmtrace"):
                names.update(a.asname or a.name for a in node.names)

    visit(TREES[module].body)
    return names


def used_names(module: str) -> set[str]:
    """Every identifier a module reads, also inside string annotations ("TextTokenizer")."""
    used: set[str] = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "[" in node.value:
            try:  # an annotation such as "Optional[TextTokenizer]"
                used.update(n.id for n in ast.walk(ast.parse(node.value, mode="eval")) if isinstance(n, ast.Name))
            except SyntaxError:
                pass
    return used


def test_every_module_is_in_a_layer():
    for module in SOURCES:
        layer_of(module)


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for module in SOURCES:
        mine = layer_of(module)
        if mine == "face":
            continue
        for line, imported, alias in imports(module):
            theirs = layer_of(target(imported, alias))
            if theirs == "face" or LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{module}:{line} ({mine}) imports {target(imported, alias)} ({theirs})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_there_is_no_import_circle_counting_imports_inside_functions():
    graph = {m: {target(i, a) for _, i, a in imports(m)} & set(SOURCES) for m in SOURCES if layer_of(m) != "face"}
    # Tarjan's strongly connected components: a circle is a component of two or more modules, or a self-import.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert not circles, f"import circles: {circles}"


def test_no_private_name_is_imported_from_another_module():
    crossing = [f"{m}:{line} imports {alias.name} from {imported}"
                for m in SOURCES for line, imported, alias in imports(m)
                if alias is not None and alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not crossing, "private names crossing modules:\n" + "\n".join(crossing)


def test_names_are_imported_from_the_module_that_defines_them_and_used():
    problems = []
    for module in SOURCES:
        if layer_of(module) == "face":
            continue
        used = used_names(module)
        for line, imported, alias in imports(module):
            if alias is None:  # `import llmtrace.cli.generate`: runs a module (registers its commands)
                continue
            if target(imported, alias) != imported:  # `from llmtrace.checkpoint import placement`: a module
                name = alias.asname or alias.name
            else:
                if imported not in SOURCES:
                    problems.append(f"{module}:{line}: no module {imported}")
                    continue
                if alias.name not in defined_names(imported):
                    problems.append(f"{module}:{line} imports {alias.name} from {imported}, which does not define it")
                name = alias.asname or alias.name
            if name not in used:
                problems.append(f"{module}:{line} imports {name} from {imported} and never uses it (a re-export?)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if SOURCES[m].name == "__init__.py" and "." in m))
def test_layer_packages_init_files_hold_only_a_docstring(module):
    body = TREES[module].body
    assert len(body) <= 1 and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body), \
        f"{SOURCES[module]} holds code; put it in a module named for its job"


def test_the_package_face_imports_nothing_when_imported():
    """`import llmtrace` must stay light (no torch for `tokenize`): its public names are imported on first use."""
    top_level = [n for n in TREES["llmtrace"].body if isinstance(n, (ast.Import, ast.ImportFrom))
                 and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    assert not top_level, f"llmtrace/__init__.py imports at its top level (line {top_level[0].lineno})"


# The newest torch feature each of these needs: pyproject's lower bound must be the highest one the source uses.
TORCH_FEATURES = {"F.rms_norm(": (2, 4), "enable_gqa=": (2, 5), "torch.compiler.set_stance(": (2, 6)}


def test_pyproject_states_the_torch_version_the_source_needs():
    import re

    text = "\n".join(p.read_text(encoding="utf-8") for p in SOURCES.values())
    used = [version for feature, version in TORCH_FEATURES.items() if feature in text]
    assert used, "none of the features found: update TORCH_FEATURES"
    stated = re.search(r'"torch>=(\d+)\.(\d+)"', (PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert stated and (int(stated[1]), int(stated[2])) == max(used), f"torch>={max(used)} is what the source needs"


# ----------------------------------------------------------------------------------------------------------------
# function length, and errors in the caller's words

MAX_BODY_LINES = 80
# Functions being split by other hands (issue 31), until their changes land: run/compare.py and run/diff.py (h30),
# tokens/tokenizer.py (h-fam). Remove an entry when its function is in parts; a new entry is not a way out.
LONG_UNTIL_SPLIT: set[str] = set()


def function_bodies():
    """(qualified name, lines of its body without the docstring) of every function and method in the package."""
    for module, tree in TREES.items():
        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = child.body
                    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                            and isinstance(body[0].value.value, str):
                        body = body[1:]
                    if body:
                        yield f"{prefix}.{child.name}", body[-1].end_lineno - body[0].lineno + 1
                    yield from visit(child, f"{prefix}.{child.name}")
                elif isinstance(child, ast.ClassDef):
                    yield from visit(child, f"{prefix}.{child.name}")

        yield from visit(tree, module)


def test_no_function_body_is_over_80_lines():
    long = [f"{name}: {n} lines" for name, n in function_bodies() if n > MAX_BODY_LINES and name not in LONG_UNTIL_SPLIT]
    assert not long, f"function bodies over {MAX_BODY_LINES} lines (docstring excluded); take them apart:\n" + \
        "\n".join(long)


def test_the_length_check_sees_a_long_function():
    tree = ast.parse("def f():\n    '''doc'''\n" + "    x = 1\n" * 81)
    TREES["__probe__"] = tree
    try:
        assert dict(function_bodies())["__probe__.f"] == 81
    finally:
        del TREES["__probe__"]


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Errors whose files other hands are changing (issue 31), until those changes land: run/compare.py and run/diff.py
# (h30), tokens/tokenizer.py (h-fam); checkpoint/fast.py and checkpoint/quantized.py (the lead's weight loading; a
# test asserts their wording). Remove a file when its errors name keywords; a new entry is not a way out.
FLAGS_UNTIL_REWORDED: set[str] = set()


def flags_in_errors(module: str) -> list[str]:
    """`line: --flag` for each CLI flag written in the message of an exception raised in `module`."""
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            parts = node.exc.args + [k.value for k in node.exc.keywords]
            texts = [n.value for a in parts for n in ast.walk(a) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            found += [f"{node.lineno}: {flag}" for text in texts for flag in FLAG.findall(text)]
    return found


def test_no_error_below_the_cli_names_a_flag():
    """Below cli/ an error names the Python keyword (BadValue("top_p", ...), also=(...) for others it mentions);
    the CLI maps fields to flags (cli/options.flag_of): `llmtrace.load(fast=True, keep_quantized=True)` says
    "fast and keep_quantized ...", `llmtrace generate --fast --keep-quantized` says "--fast and --keep-quantized"."""
    named = [f"{m}:{hit}" for m in SOURCES if layer_of(m) not in ("cli", "face") and m not in FLAGS_UNTIL_REWORDED
             for hit in flags_in_errors(m)]
    assert not named, "errors below cli/ that name a flag (name the keyword; the CLI names the flag):\n" + \
        "\n".join(named)


OUTPUT_FLAGS = {"--json", "--jsonl", "--html"}  # the CLI's outputs: a Python caller has the objects themselves


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def flags_in_strings(module: str) -> list[str]:
    """`line: --flag` for each CLI flag written in a string of `module` that reaches a person: a note, a message, a
    view's words (docstrings aside). Not counted: a command line shown whole ("llmtrace lens PROMPT --positions all",
    or the pieces of one in a function that writes commands), a bare flag given to another program (pip's
    "--quiet"), and, in a view (render/, report/), the CLI's outputs (--json, --jsonl, --html), which have no keyword.
    Everything else names the keyword in backticks (`dtype='float32'`), which the CLI writes as its flag."""
    tree, found = TREES[module], []
    docs, in_commands = _docstrings(tree), set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and "command" in fn.name:
            in_commands |= {id(n) for n in ast.walk(fn)}
    parts_of = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts_of | docs:
            text = node.value
        else:
            continue
        if "llmtrace " in text or id(node) in in_commands or re.fullmatch(FLAG, text):
            continue
        view = layer_of(module) in ("render", "report")
        found += [(node.lineno, flag) for flag in FLAG.findall(text) if not (view and flag in OUTPUT_FLAGS)]
    return [f"{line}: {flag}" for line, flag in sorted(found)]


def test_no_note_or_message_below_the_cli_names_a_flag():
    """Notes and messages that reach a Python caller (placement's "(--dtype float32 overrides)", compare's and diff's
    notes, the tokenizer's, the trace's "--fast: approximate") named CLI flags. The library names the keyword in
    backticks; the CLI has it written as its flag (cli/options.flag_words, through words.in_words)."""
    named = [f"{m}:{hit}" for m in SOURCES if layer_of(m) not in ("cli", "face") for hit in flags_in_strings(m)]
    assert not named, "strings below cli/ that name a flag (write `keyword=value`; the CLI names the flag):\n" + \
        "\n".join(named)


def test_the_flag_check_sees_a_flag_in_a_note():
    TREES["__probe__"] = ast.parse('def f():\n    """--doc is fine"""\n    notes.append(f"use --dtype {x} instead")\n'
                                   'say("(--json)")\nrun(["pip", "--quiet"])\nc = f"llmtrace lens {p} --last 3"')
    try:
        assert flags_in_strings("__probe__") == ["3: --dtype", "4: --json"]
    finally:
        del TREES["__probe__"]


def test_the_flag_check_sees_a_flag_in_an_error():
    TREES["__probe__"] = ast.parse('raise UsageError(f"--fast and --keep-quantized do not combine {x}")')
    try:
        assert flags_in_errors("__probe__") == ["1: --fast", "1: --keep-quantized"]
    finally:
        del TREES["__probe__"]


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers.py (fixtures in conftest.py, tiny checkpoints in tiny.py): a test module
    imported by another runs its module-level code twice and makes the two depend on each other's names."""
    tests = Path(__file__).resolve().parent
    crossing = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            crossing += [f"{path.name}:{node.lineno} imports {n}" for n in names
                         if n.split(".")[-1].startswith("test_") or n.startswith("tests.")]
    assert not crossing, "\n".join(crossing)


# ----------------------------------------------------------------------------------------------------------------
# the model declares; the rest reads (issue 31)


def declared_point_names() -> set[str]:
    """Every point name declared in llmtrace/model/: the first argument of each Point(...) call there."""
    out = set()
    for module, tree in TREES.items():
        if layer_of(module) != "model":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Point" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                out.add(node.args[0].value)
    return out


def test_point_names_are_spelled_only_in_the_model():
    """The trace, the views, compare and the interventions read the model's declaration: none of them writes a point
    name as a string (the distinctive ones, with an underscore: single words such as "logits" are also field names of
    the events). Code that takes one point apart names it through the declaration (model/llama_points.py)."""
    names = {n for n in declared_point_names() if "_" in n}
    assert {"q_rope", "resid_post", "k_repeated"} <= names
    spelled = []
    for module, tree in TREES.items():
        if layer_of(module) == "model":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{SOURCES[module]}:{node.lineno} {node.value!r}")
    assert not spelled, "point names written outside llmtrace/model/:\n" + "\n".join(spelled)


# Modules that take each block apart and so read model.layers (each with why); a new one must be declared here.
# None now: direct logit attribution and attribution patching read the blocks' declared wiring (model.wiring(),
# model.direct_parts, model.heads_points()).
LAYER_WALKS: set[str] = set()


def test_nothing_above_the_model_walks_its_layers():
    """One layer loop, the model's own (Transformer.run_layers): nothing above model/ indexes or iterates
    model.layers."""
    import re

    walks = [f"{SOURCES[m]}:{i + 1}" for m in SOURCES if layer_of(m) not in ("model", "face") and m not in LAYER_WALKS
             for i, line in enumerate(SOURCES[m].read_text(encoding="utf-8").splitlines())
             if re.search(r"\bmodel\.layers\b", line) and not line.lstrip().startswith("#")]
    assert not walks, "model.layers used outside llmtrace/model/: " + ", ".join(walks)


# ----------------------------------------------------------------------------------------------------------------
# Kinds of layer: what a family or a kind of layer changes is declared in model/, and nothing above it branches on it


def family_words() -> set[str]:
    """Every name a family goes by: its own, its HF model types and its GGUF architectures."""
    from llmtrace.model.family import families

    out = set()
    for f in families():
        out |= {f.name, *f.hf_types, *f.gguf_archs}
    return out


# The few places a file format forces a family's name outside model/: (module, the string, why).
FAMILY_NAMES_ALLOWED = {
    ("llmtrace.checkpoint.gguf_checkpoint", "mistral"): "llama.cpp's converter drops Mistral's window: the file's name says it",
    ("llmtrace.checkpoint.hf_checkpoint", "qwen2"): "Qwen2's config.json has no attention_bias; its q/k/v have biases",
    ("llmtrace.tokens.vocab", "qwen2"): "a GGUF's tokenizer.ggml.pre names the pre-tokenizer, not the family",
    ("llmtrace.tokens.vocab", "gemma"): "SentencePiece's space handling follows general.architecture",
    ("llmtrace.tokens.vocab", "gemma2"): "SentencePiece's space handling follows general.architecture",
    ("llmtrace.tokens.vocab", "gemma3"): "SentencePiece's space handling follows general.architecture",
    ("llmtrace.tokens.chat_template", "gemma"): "a GGUF without a template: Gemma's turn markers",
    ("llmtrace.tokens.chat_template", "gemma2"): "a GGUF without a template: Gemma's turn markers",
    ("llmtrace.tokens.chat_template", "gemma3"): "a GGUF without a template: Gemma's turn markers",
    ("llmtrace.tokens.tokenizer", "llama"): "tokenizer.ggml.model 'llama' is SentencePiece, not the family",
    ("llmtrace.report.page", "llama"): "a trace from before the run event named its arch",
    ("llmtrace.registry.models_toml", "llama"): "an entry that names no architecture",
}


def string_constants(tree) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_module_outside_the_model_names_a_family():
    """A family is one file in model/families/ (and its kind in model/kinds/): no module above the model writes a
    family's name, its HF model type or its GGUF architecture, except where a file format forces it (the allowlist,
    each with its reason)."""
    words = family_words()
    assert {"qwen3_5", "gpt_oss", "gemma3"} <= words
    named = [f"{SOURCES[m]}:{line} {s!r}" for m, tree in TREES.items() if layer_of(m) not in ("model",)
             for line, s in string_constants(tree) if s in words and (m, s) not in FAMILY_NAMES_ALLOWED]
    assert not named, "a family named outside llmtrace/model/ (declare what it changes instead):\n" + "\n".join(named)


def test_the_family_check_sees_a_family_name():
    tree = ast.parse('if config.family == "qwen3_5":\n    pass\n')
    assert any(s in family_words() for _, s in string_constants(tree))


def kind_keys() -> set[str]:
    """The keys of the kinds of layer and of memory: the model declares them (model.kinds, model.memory)."""
    from llmtrace.model.memory import KINDS

    return {"linear_attention", "mla", "mamba2", "short_conv", *KINDS} - {"none", "window"}


def compared_strings(tree) -> list[tuple[int, str]]:
    """The strings a comparison tests against: x == "s", x != "s", x in ("s", ...)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                items = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                out += [(node.lineno, i.value) for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
    return out


def test_nothing_above_the_model_branches_on_a_kind_of_layer_or_memory():
    """The views iterate over what each layer's kind declares (its memory, FLOPs, headings, explain sections): no
    module above the model compares a value with a kind's key ("linear_attention", "mla", "state", ...)."""
    keys = kind_keys()
    found = [f"{SOURCES[m]}:{line} {s!r}" for m, tree in TREES.items() if layer_of(m) != "model"
             for line, s in compared_strings(tree) if s in keys]
    assert not found, "a branch on a kind outside llmtrace/model/ (let the kind declare it):\n" + "\n".join(found)


# Where a module above the model branches on an operation's kind, with why: none. A view reads what the kind
# declares (OpKind.role: the rotation, the gated activation; OpKind.card: the numbers a card prints from the constants;
# OpKind.evaluate: whether there is anything to recompute), or the points explain's lines say (ATTENTION_LINE,
# ROUTER_LINE); explain's sections are named through trace.events.Section (a section's key is not an operation's,
# though "rope" and "router" read alike). Only a branch a file format forces may be added here, with its reason.
OP_BRANCHES_ALLOWED: dict[str, set[str]] = {}


def test_branches_on_an_operation_kind_are_declared():
    from llmtrace.model.maths import op_kinds

    found = []
    for m, tree in TREES.items():
        if layer_of(m) == "model":
            continue
        for line, s in compared_strings(tree):
            if s in op_kinds() and s not in OP_BRANCHES_ALLOWED.get(m, set()):
                found.append(f"{SOURCES[m]}:{line} {s!r}")
    assert not found, "a branch on an operation kind outside llmtrace/model/:\n" + "\n".join(found)


def test_the_operation_check_sees_a_branch_on_a_kind():
    from llmtrace.model.maths import op_kinds

    tree = ast.parse('if o.kind in ("scores", "softmax"):\n    pass\nif ev["section"] == Section.ROPE:\n    pass\n')
    assert [s for _, s in compared_strings(tree) if s in op_kinds()] == ["scores", "softmax"]


def test_explain_sections_are_the_schemas_and_the_kinds():
    """explain's section keys are declared once (trace.events.Section): the schema's enum lists exactly those, and
    every section a kind of layer declares (EXPLAIN) is one of them."""
    import importlib
    import json

    from llmtrace.trace.events import schema_path, sections

    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    assert list(sections()) == schema["$defs"]["explain"]["properties"]["section"]["enum"]
    declared = set()
    for m in SOURCES:
        if layer_of(m) == "model" and any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "EXPLAIN"
                                          for t in n.targets) for n in ast.walk(TREES[m])):
            declared |= {k for v in vars(importlib.import_module(m)).values() if isinstance(v, type)
                         for k in getattr(v, "EXPLAIN", ())}
    assert declared and declared <= set(sections()), declared - set(sections())


def test_no_script_compares_a_kind_or_an_english_phrase():
    """The page's scripts read keys: no comparison with a kind of layer's key, and none with an English phrase as a
    protocol value (a string with a space or a comma)."""
    keys = kind_keys()
    bad = []
    for js in sorted((PACKAGE / "report" / "assets").glob("*.js")):
        for i, line in enumerate(js.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r'={2,3}\s*"([^"]*)"', line):
                legacy = "a trace before" in line  # reading an older trace's value, said so on the line
                if (m.group(1) in keys or (", " in m.group(1) and not legacy)):
                    bad.append(f"{js.name}:{i} {m.group(1)!r}")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------------------------------------------
# what a new family costs: the files outside its own file and its kind's that speak only its vocabulary (issue 47)

# The families of "four ways to remember", each with the kind of layer it brought (model/kinds/<kind>.py), and the
# config-part names and fields only that family or kind reads (ModelConfig.parts: the declarations' own words).
NEW_FAMILIES = {
    "deepseek": ("mla", {"q_lora_rank", "kv_lora_rank"}),
    "granite_hybrid": ("mamba2", {"granite", "dt_limit", "residual_multiplier", "embedding_multiplier",
                                  "logits_scaling", "attention_multiplier"}),
    "lfm2": ("short_conv", set()),
    "gemma4": ("shared_kv", {"global_attention", "per_layer_input", "wide_ffn"}),
}
# The files a fresh add of a family may touch outside its own file and its kind's (tests and docs aside), with why.
MAX_COST = 2
COST_ALLOWED = {
    "registry/models.toml": "the models `llmtrace pull` knows: a real checkpoint of the family, by its hub id",
}
# Files that still speak a kind's vocabulary because the piece that would take it off them is other hands' work:
# (family, file) -> why. Remove an entry when its file reads the declaration instead; a new entry is not a way out.
COST_UNTIL_DECLARED: dict = {}  # (family, file) -> why it still speaks of the family: none left
SPLIT = re.compile(r"[./:#]")


def family_vocabulary(family: str) -> tuple[set[str], set[str]]:
    """(the words only `family` and its kind declare, the modules that declare them): its names (module, family,
    HF model types, GGUF architectures), its kind's key, the operation kinds the two files declare with their
    words' keys, and its config-part names and fields."""
    import importlib

    from llmtrace.model.maths import op_kinds

    kind, fields = NEW_FAMILIES[family]
    modules = {f"llmtrace.model.families.{family}", f"llmtrace.model.kinds.{kind}"}
    declared = importlib.import_module(f"llmtrace.model.kinds.{kind}")
    keys = {getattr(v, "KIND", None) for v in vars(declared).values() if isinstance(v, type)} - {None}
    assert kind in keys, f"model/kinds/{kind}.py declares no layer of KIND {kind!r}"
    f = importlib.import_module(f"llmtrace.model.families.{family}").FAMILY
    words = {family, f.name, *f.hf_types, *f.gguf_archs, kind, *fields}
    own = [d for d in op_kinds().values() if d.module in modules]
    words |= {d.key for d in own} | {w for d in own for w in d.words}  # its operation kinds, and their words' keys
    return words, modules


def keys_in(strings, words: set[str]) -> set[str]:
    """The words of `words` said as a key or a name: in a string without spaces, split at . / : # (prose aside)."""
    return {part for s in strings if not re.search(r"\s", s) for part in SPLIT.split(s) if part in words}


def vocabulary_of_module(module: str, words: set[str], modules: set[str]) -> set[str]:
    """The words a module says in its strings (docstrings aside), and the last part of each of `modules` it
    imports."""
    tree = TREES[module]
    docs = _docstrings(tree)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docs]
    imported = {m for _, i, a in imports(module) for m in (i, target(i, a)) if m in modules}
    return {m.rsplit(".", 1)[1] for m in imported} | keys_in(strings, words)


def vocabulary_in(path: Path, words: set[str], modules: set[str]) -> set[str]:
    """The words a file of the package says: a module's (vocabulary_of_module), another file's quoted strings."""
    if path.suffix == ".py":
        return vocabulary_of_module(module_name(path), words, modules)
    quoted = re.findall(r'"([^"\n]*)"|\'([^\'\n]*)\'', path.read_text(encoding="utf-8"))
    return keys_in([a or b for a, b in quoted], words)


def family_cost(family: str) -> dict[str, set[str]]:
    """The files under llmtrace/ outside the family's own file and its kind's that say its vocabulary: what a fresh
    add of the family has to touch. {file (relative to llmtrace/): the words it says}."""
    words, modules = family_vocabulary(family)
    own = {f"model/families/{family}.py", f"model/kinds/{NEW_FAMILIES[family][0]}.py"}
    out = {}
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not path.is_file() or "__pycache__" in path.parts or rel in own or path.suffix in (".pyc", ".png", ".woff2"):
            continue
        said = vocabulary_in(path, words, modules)
        if said:
            out[rel] = said
    return out


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_a_new_family_costs_at_most_two_files_outside_its_own(family):
    """Issue 47's goal, measured: each of the four families of "four ways to remember" (DeepSeek's MLA, Granite
    4.0-H's Mamba2, LFM2's short convolution, Gemma 4's shared KV) is its own file and its kind's; at most two
    other files under llmtrace/ name anything only it declares (its names, its kind's key, its operation kinds, its
    config part's fields), and each of those is allowed for a reason (COST_ALLOWED)."""
    cost = family_cost(family)
    pending = {f for (fam, f) in COST_UNTIL_DECLARED if fam == family}
    counted = {f: said for f, said in cost.items() if f not in pending}
    assert len(counted) <= MAX_COST, f"{family} is spoken of in {len(counted)} files: {counted}"
    assert set(counted) <= set(COST_ALLOWED), {f: s for f, s in counted.items() if f not in COST_ALLOWED}
    assert pending <= set(cost), f"{sorted(pending - set(cost))} no longer speak of {family}: take them off the list"


def test_the_cost_check_sees_a_kind_named_elsewhere():
    words, modules = family_vocabulary("granite_hybrid")
    assert {"ssm_scan", "mamba2", "granitemoehybrid", "dt_limit"} <= words
    TREES["__probe__"] = ast.parse('from llmtrace.model.kinds.mamba2 import Mamba2\nif o.kind == "ssm_decay": pass\n'
                                   'w("maths.ssm_scan_y")\nsay("the ssm_scan of a layer")\nc.parts["granite"]')
    try:  # the import, an operation kind, its word's key, a config part; prose aside
        assert vocabulary_of_module("__probe__", words, modules) == {"mamba2", "ssm_decay", "ssm_scan_y", "granite"}
    finally:
        del TREES["__probe__"]
