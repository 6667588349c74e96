"""load_model: a model spec -> LoadedModel (ModelConfig + weights + tokenizer), through the checkpoint adapters.

Each format maps onto one internal layout, the parameter names of llmtrace.model.Transformer: hf_checkpoint.py (an HF
directory of safetensors), gguf_checkpoint.py (a GGUF file, read by gguf_file.py); key renames and the llama.cpp q/k
row permutation are tables and small named transforms there, kept out of the model. weights.py reads tensors one by
one and builds the model; conversion.py converts a GGUF once and caches the result as safetensors, so later loads are
plain reads; devices.py chooses device, dtype and threads. Their public names are importable from here too.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from llmtrace.checkpoint.devices import pick_device, pick_dtype
from llmtrace.errors import LlmtraceError, UsageError, one_line
from llmtrace.checkpoint.conversion import _open_converted, _progress_to_stderr, convert_gguf
from llmtrace.checkpoint.hf_checkpoint import config_from_hf, hf_entries
from llmtrace.checkpoint.weights import build_model, plan_layout, read_weights
from llmtrace.checkpoint.loaded import LoadedModel
from llmtrace.model.transformer import ModelConfig
from llmtrace.registry.cache import converted_dir

# ----------------------------------------------------------------------------------------------------------------
# public entry points


def _resolve(spec: Optional[str]):
    from llmtrace.registry.resolve import resolve

    return resolve(spec)


def load_model(spec: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None, *,
               keep_quantized: bool = False, placement: Optional["Placement"] = None,  # noqa: F821
               fast: bool = False) -> LoadedModel:
    """Resolve a model spec (registry name, hub id, HF directory or .gguf file) and load it ready to run.

    Weights are read tensor by tensor straight into the run dtype. `keep_quantized`: a GGUF's matrices stay in their
    blocks (checkpoint.quantized). `fast`: a GGUF's matrices run from their blocks on torch's int4 kernel, activations
    in bfloat16 (checkpoint.fast; approximate, and traces say so). `placement`: layers spread over devices and disk by
    accelerate (checkpoint.placement).
    Before any weight is read, the memory they need is checked against what is available (placement.check_fits)."""
    from llmtrace.checkpoint import placement as place

    if placement is not None and device is not None:
        raise UsageError("--device and --device-map both place the model; give one (with --device-map, --max-memory "
                         "names the devices)")
    if fast:
        check_fast(keep_quantized, placement, dtype, device)
    resolved = _resolve(spec)
    dev = pick_device(device) if placement is None else placement.main_device
    t0 = time.perf_counter()
    converted = False
    if fast:
        if resolved.kind != "gguf":
            raise UsageError(f"--fast runs a GGUF file's quantized blocks on int4 kernels; {resolved.name} is not a GGUF "
                             f"file (--dtype bfloat16 gives it the fast path's bfloat16 compute)")
        if dev.type not in ("cpu", "cuda"):
            raise UsageError(f"--fast runs on cpu and cuda, not {dev.type}; leave out --fast or give --device cpu")
        from llmtrace.checkpoint.fast import load_gguf_fast
        from llmtrace.model.fast import COMPUTE

        dt = COMPUTE
        place.check_fits(resolved.name, resolved.path.stat().st_size, "its quantized blocks", dev)
        config, model, tokenizer = load_gguf_fast(resolved.path, dev)
        tokenizer.check_fits(config.vocab_size, str(resolved.path))
    elif keep_quantized:
        if resolved.kind != "gguf":
            raise UsageError(f"--keep-quantized keeps a GGUF file's blocks; {resolved.name} is not a GGUF file "
                             f"(use --dtype bfloat16 to halve its memory)")
        if placement is not None:
            raise UsageError("--keep-quantized and --device-map cannot be combined yet; choose one")
        from llmtrace.checkpoint.quantized import load_gguf_quantized

        dt = pick_dtype(dtype, dev)
        place.check_fits(resolved.name, resolved.path.stat().st_size, "its quantized blocks", dev)
        config, model, tokenizer = load_gguf_quantized(resolved.path, dev, dt)
        tokenizer.check_fits(config.vocab_size, str(resolved.path))
    else:
        config, plan, tokenizer, converted = _open_checkpoint(resolved)
        tokenizer.check_fits(config.vocab_size, str(resolved.path))
        dt = place.choose_dtype(dtype, dev, resolved.name, place.weight_count(config), placement)
        if placement is None:
            progress, stop = _progress_to_stderr(f"loading {resolved.name}")
            try:
                sd = read_weights(plan, dt, dev, progress)
            finally:
                stop()
            model = build_model(config, sd, dev, dt)
            del sd
        else:
            model = placement.load(config, plan, dt)
    return LoadedModel(name=resolved.name, source=resolved.kind, path=resolved.path, config=config, model=model,
                       tokenizer=tokenizer, device=dev, dtype=dt, load_s=time.perf_counter() - t0, converted=converted)


def check_fast(keep_quantized: bool, placement, dtype: Optional[str], device: Optional[str] = None) -> None:
    """--fast with options it does not combine with: one line each, before anything is resolved or loaded."""
    if keep_quantized:
        raise UsageError("--fast and --keep-quantized do not combine: --fast already runs from the quantized blocks "
                         "(approximately, on int4 kernels); --keep-quantized gives the exact values; choose one")
    if placement is not None:
        raise UsageError("--fast and --device-map do not combine yet: --fast runs the whole model on one device; "
                         "choose one")
    if dtype not in (None, "bfloat16", "bf16"):
        raise UsageError(f"--fast computes in bfloat16; leave out --dtype {dtype}")


def _open_checkpoint(resolved) -> tuple[ModelConfig, dict[str, list], "TextTokenizer", bool]:  # noqa: F821
    """Config, tensor plan (nothing read yet) and tokenizer of an HF directory or a GGUF file (converted once)."""
    from llmtrace.tokens.tokenizer import TextTokenizer

    if resolved.kind == "gguf":
        dest = converted_dir(resolved.path)
        converted = not (dest / "llmtrace_config.json").exists()
        if converted:
            convert_gguf(resolved.path, dest)
        try:
            config, plan, tokenizer = _open_converted(dest)
        except Exception as e:  # a damaged cache entry: convert again next time
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
            raise LlmtraceError(f"the cached conversion of {resolved.path.name} was unreadable ({one_line(e)}) and "
                                f"has been removed; run the command again") from None
        return config, plan, tokenizer, converted
    where = str(resolved.path)
    cfg_path = resolved.path / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise LlmtraceError(f"{where}: no config.json in this directory") from None
    except json.JSONDecodeError as e:
        raise LlmtraceError(f"{cfg_path}: not valid JSON (line {e.lineno}: {e.msg}); fix it or fetch it again") from None
    config = config_from_hf(raw, where)
    config.extra = {"format": "safetensors", "torch_dtype": raw.get("torch_dtype", raw.get("dtype"))}
    plan = plan_layout(hf_entries(resolved.path), config, where)
    return config, plan, TextTokenizer.from_hf_dir(resolved.path), False
