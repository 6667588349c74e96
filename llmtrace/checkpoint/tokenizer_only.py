"""Only the tokenizer of a model, with no weights read and no torch imported while a cached conversion exists
(`llmtrace tokenize`, `llmtrace report` add the BPE story with it)."""

from __future__ import annotations

from llmtrace.errors import LlmtraceError
from llmtrace.tokens.tokenizer import TextTokenizer


def load_tokenizer(spec: str | None = None) -> TextTokenizer:
    """Only the tokenizer of a model (`spec` as --model takes it). No weights are read, and torch is imported only
    the first time a GGUF file is used, when its conversion is not cached yet."""
    from llmtrace.registry.cache import converted_dir
    from llmtrace.registry.resolve import resolve

    resolved = resolve(spec)
    if resolved.kind == "gguf":
        dest = converted_dir(resolved.path)
        if (dest / "llmtrace_config.json").exists():
            return TextTokenizer.from_hf_dir(dest / "tokenizer")
        from llmtrace.checkpoint.gguf_checkpoint import config_from_gguf
        from llmtrace.checkpoint.gguf_file import open_gguf

        reader = open_gguf(resolved.path)
        config_from_gguf(reader, str(resolved.path))  # refuse unsupported architectures here too
        return TextTokenizer.from_gguf(reader, str(resolved.path))
    if not (resolved.path / "tokenizer.json").exists():
        raise LlmtraceError(f"{resolved.path}: no tokenizer.json in this directory, so it has no tokenizer llmtrace can use")
    return TextTokenizer.from_hf_dir(resolved.path)


