"""The suite's result must not depend on which files are collected, or in which order: no test module (nor conftest)
changes torch's global state when it is imported. A module that called torch.set_num_threads(1) at import changed
the summation order of every test collected after it (issue 38: two KV-cache parity checks then failed by 1.4e-5).
Such settings belong in fixtures (conftest.py: `torch_threads`, `one_thread`)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# torch's process-wide settings
GLOBAL_SETTERS = {"set_num_threads", "set_num_interop_threads", "manual_seed", "set_default_dtype",
                  "set_default_device", "use_deterministic_algorithms", "set_grad_enabled", "set_printoptions",
                  "set_float32_matmul_precision"}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def import_time_settings(source: str) -> list[str]:
    """Calls of torch's global setters made by a module's top-level statements (what runs when it is imported)."""
    found = []
    for stmt in ast.parse(source).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # bodies run when called, not at import
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name.startswith("torch.") and name.rsplit(".", 1)[-1] in GLOBAL_SETTERS:
                    found.append(f"line {node.lineno}: {name}()")
    return found


def test_the_check_finds_an_import_time_setting():
    assert import_time_settings("import torch\ntorch.set_num_threads(1)\n") == ["line 2: torch.set_num_threads()"]
    assert import_time_settings("import torch\ndef f():\n    torch.set_num_threads(1)\n") == []


def test_no_test_module_sets_torch_state_at_import():
    offenders = {p.name: hits for p in sorted(TESTS.glob("*.py")) if (hits := import_time_settings(p.read_text()))}
    assert offenders == {}, f"set these in a fixture instead: {offenders}"
