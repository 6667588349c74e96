"""Hooks are attached and detached by the model alone (model/transformer.py: `hooked`, `unhooked`). STYLE.md's "state
travels in the open": nobody else saves, clears and restores a module's `hook` to run a pass without it (issue 38:
model/families/phi3.py's `_unhooked` did)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llmtrace"
OWNER = PACKAGE / "model" / "transformer.py"


def hook_assignments(source: str) -> list[int]:
    """Lines that assign an attribute named `hook` (x.hook = ..., setattr(x, "hook", ...))."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr == "hook":
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "hook":
            lines.append(node.lineno)
    return lines


def test_the_check_finds_a_hook_assignment():
    assert hook_assignments("for m, h in saved:\n    m.hook = h\n") == [2]
    assert hook_assignments("m.hooked = 1\nsetattr(m, 'hook', None)\n") == [2]


def test_only_the_model_attaches_hooks():
    found = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if p != OWNER and (lines := hook_assignments(p.read_text()))}
    assert found == {}, f"use Transformer.hooked / unhooked instead: {found}"
