"""llmtrace: watch a real LLaMA-family model turn a prompt into tokens, step by step.

This module is the package's public face. Its names are looked up lazily (module `__getattr__`), so
`import llmtrace` imports nothing heavy (no torch) until a name that needs it is used.
"""

_PUBLIC = {  # public name -> the module that defines it
    "__version__": "llmtrace.version",
}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'llmtrace' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
