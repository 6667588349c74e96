"""llmtrace: watch a real LLaMA-family model turn a prompt into tokens, step by step.

This module is the package's public face. Its names are looked up lazily (module `__getattr__`), so
`import llmtrace` imports nothing heavy (no torch) until a name that needs it is used.
"""

_PUBLIC = {  # public name -> the module that defines it
    "__version__": "llmtrace.version",
    # the Python API (llmtrace/api.py): load a model, run it, read traces
    "load": "llmtrace.api",
    "read_trace": "llmtrace.api",
    "Model": "llmtrace.api",
    "Trace": "llmtrace.api",
    "LoadOptions": "llmtrace.api",
    "GenerateOptions": "llmtrace.api",
    "ExplainOptions": "llmtrace.api",
    "LensOptions": "llmtrace.api",
    # what it raises: a user's mistake (BadValue names the keyword), a problem with a file or a model
    "LlmtraceError": "llmtrace.errors",
    "UsageError": "llmtrace.errors",
    "BadValue": "llmtrace.errors",
    # comparing two runs (llmtrace/run/compare.py)
    "compare": "llmtrace.api",  # compare(a, b, prompt, ...) -> Comparison
    "diff": "llmtrace.api",  # diff(trace_a, trace_b, ...) -> Comparison: two saved runs
    "Comparison": "llmtrace.api",
    "Side": "llmtrace.run.compare",  # how one side of a comparison is loaded and run
    # interventions (a list of them is the `interventions=` of generate, explain and lens) and the patching sweep
    "Ablate": "llmtrace.run.interventions",
    "Scale": "llmtrace.run.interventions",
    "Patch": "llmtrace.run.interventions",
    "Steer": "llmtrace.run.interventions",
    "ControlVector": "llmtrace.run.interventions",
    "patch_sweep": "llmtrace.api",
    # the researcher's API (Model.points, run_with_cache, run_with_hooks, hooks): your own function at a point
    "Hook": "llmtrace.run.interventions",
    "HookError": "llmtrace.run.hookpoints",
    "PointInfo": "llmtrace.run.hookpoints",
    "ActivationCache": "llmtrace.run.research",
    "read_capture": "llmtrace.run.capture",  # read_capture(DIR) -> {point: (tokens, width), "ids": ...}
    "capture_corpus": "llmtrace.run.capture",  # what `llmtrace capture` runs
    # evaluating over a corpus (llmtrace/run/eval.py): perplexity, KLD against a second side or a base file
    "evaluate": "llmtrace.api",  # evaluate(model, text, ctx=, b=, ...) -> Evaluation
    "Evaluation": "llmtrace.api",
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
