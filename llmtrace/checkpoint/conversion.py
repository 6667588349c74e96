"""The conversion cache for GGUF files: a GGUF is read, dequantized and un-permuted once, and the result cached as
float32 safetensors with its config and tokenizer (model_cache.converted_dir), so later loads are plain reads."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, fields
from pathlib import Path


from llmtrace.console import progress_to_stderr
from llmtrace.errors import LlmtraceError
from llmtrace.checkpoint.gguf_checkpoint import open_gguf_checkpoint
from llmtrace.checkpoint.weights import check_shape, expected_shapes, safetensors_entries, write_safetensors
from llmtrace.model.transformer import MOVED_TO_PARTS, ModelConfig
from llmtrace.registry.cache import CONVERSION_SOURCE, conversion_source
from llmtrace.units import human_bytes

# ----------------------------------------------------------------------------------------------------------------
# the conversion cache for GGUF files


def _config_to_json(c: ModelConfig) -> str:
    return json.dumps(asdict(c), indent=1)


class OutdatedConversion(Exception):
    """A cached conversion's config names a field this llmtrace's ModelConfig no longer has."""


def _config_from_json(text: str) -> ModelConfig:
    d = json.loads(text)
    known = {f.name for f in fields(ModelConfig)} | set(MOVED_TO_PARTS)
    unknown = sorted(set(d) - known)
    if unknown:
        raise OutdatedConversion(f"its config has {', '.join(unknown)}")
    return ModelConfig.from_dict(d)


def convert_gguf(path: Path, dest: Path) -> None:
    """Read and dequantize a GGUF once; write config, float32 weights (tensor by tensor) and tokenizer to `dest`
    atomically."""
    from llmtrace.fsutil import atomic_dir

    config, plan, tokenizer, facts = open_gguf_checkpoint(path)
    config.extra = facts
    size = 4 * sum(math.prod(shape) for shape in expected_shapes(config).values())  # float32 bytes
    print(f"converting {path.name} to float32 once, for fast later loads ({human_bytes(size)}),\n  into {dest}",
          file=sys.stderr, flush=True)
    progress, stop = progress_to_stderr(f"converting {path.name}")
    try:
        with atomic_dir(dest) as tmp:
            write_safetensors(plan, tmp / "weights.safetensors", progress)
            tokenizer.save_hf_dir(tmp / "tokenizer")
            (tmp / "llmtrace_config.json").write_text(_config_to_json(config))
            (tmp / CONVERSION_SOURCE).write_text(conversion_source(path))  # whose conversion this is, for models/rm
    finally:
        stop()


def open_converted(dest: Path) -> tuple[ModelConfig, dict[str, list], "TextTokenizer"]:  # noqa: F821
    """The cached conversion: its config, a plan of one part per tensor, its tokenizer."""
    from llmtrace.tokens.tokenizer import TextTokenizer

    where = str(dest / "weights.safetensors")
    config = _config_from_json((dest / "llmtrace_config.json").read_text())
    entries = safetensors_entries(dest / "weights.safetensors")
    shapes = expected_shapes(config)
    for key, shape in shapes.items():
        if key not in entries:
            raise LlmtraceError(f"{where}: tensor {key} is missing")
        check_shape(where, key, entries[key], shape)
    plan = {key: [entries[key]] for key in shapes}
    return config, plan, TextTokenizer.from_hf_dir(dest / "tokenizer")
