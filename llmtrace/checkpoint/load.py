"""load_model: a model spec -> LoadedModel (ModelConfig + weights + tokenizer), in four steps that each hand data down:

    resolve (registry: spec -> files on disk)
      -> open the checkpoint (config, tensor plan and tokenizer; no weight read yet)
      -> plan (device, dtype, and whether the weights fit)
      -> build (read the weights tensor by tensor into the model)

The model says what it is made of: each module declares its parameters with the HF and GGUF tensors they are read
from (model.transformer's `weights()`), and weights.plan_weights maps a file's tensors onto them, checking every shape
before anything is read (q, k and v stacked into one matrix; llama.cpp's q/k row order undone for the archs the
family says were permuted; Gemma's norms given their 1 + w). hf_checkpoint.py reads an HF directory's config (the
family decides which: model.family), gguf_checkpoint.py a GGUF file's, both opened once (open_gguf_checkpoint is the
one way every GGUF load starts). weights.py reads tensors one by one and builds the model; conversion.py converts a GGUF once and caches the result as safetensors, so later loads
are plain reads; quantized.py keeps a GGUF's matrices in their blocks; devices.py chooses device, dtype and threads;
placement.py checks what fits and spreads layers over devices.
"""

from __future__ import annotations

import json
import sys
import time
from typing import NamedTuple, Optional

import torch

from llmtrace.checkpoint.choices import check_combination, check_fast_device
from llmtrace.checkpoint.conversion import OutdatedConversion, convert_gguf, open_converted
from llmtrace.checkpoint.devices import pick_device, pick_dtype
from llmtrace.checkpoint.hf_checkpoint import config_from_hf, hf_entries, text_model
from llmtrace.checkpoint.loaded import LoadedModel
from llmtrace.checkpoint.placement import Placement, check_fits, choose_dtype, weight_count
from llmtrace.checkpoint.quantized import build_quantized, open_gguf_blocks
from llmtrace.checkpoint.weights import build_model, plan_weights, read_weights, tied_head
from llmtrace.console import progress_to_stderr
from llmtrace.errors import BadValue, LlmtraceError, one_line
from llmtrace.model.transformer import ModelConfig, Transformer
from llmtrace.registry.cache import converted_dir
from llmtrace.registry.resolve import resolve
from llmtrace.tokens.tokenizer import TextTokenizer


class Checkpoint(NamedTuple):
    """A model's files, opened: everything but the weights, which `plan` says where to read."""

    config: ModelConfig
    plan: dict[str, list]  # parameter name -> its parts in the files (weights.plan_weights)
    tokenizer: TextTokenizer
    converted: bool  # opening it converted a GGUF file (a cold start)


def load_model(spec: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None, *,
               keep_quantized: bool = False, placement: Optional[Placement] = None, fast: bool = False) -> LoadedModel:
    """Resolve a model spec (registry name, hub id, HF directory or .gguf file) and load it ready to run.

    Weights are read tensor by tensor straight into the run dtype. `keep_quantized`: a GGUF's matrices stay in their
    blocks (quantized.py). `fast`: a GGUF's matrices run from their blocks on torch's int4 kernel, activations in
    bfloat16 (fast.py; approximate, and traces say so). `placement`: layers spread over devices and disk by accelerate
    (placement.py). Before any weight is read, the memory they need is checked against what is available
    (placement.check_fits)."""
    # what combines is choices.check_load_values' to say (LoadOptions checks it before torch is imported); a direct
    # caller of load_model gets the same answers here, before anything is resolved
    check_combination(device, dtype, keep_quantized, placement is not None, fast)
    resolved = resolve(spec)
    if fast:
        return load_fast(resolved, device)
    if keep_quantized and resolved.kind != "gguf":
        raise BadValue("keep_quantized", f" keeps a GGUF file's blocks; {resolved.name} is not a GGUF file "
                       f"(use dtype bfloat16 to halve its memory)", also=("dtype",))
    dev = pick_device(device) if placement is None else placement.main_device
    t0 = time.perf_counter()
    if keep_quantized:
        dt = pick_dtype(dtype, dev)
        check_fits(resolved.name, resolved.path.stat().st_size, "its quantized blocks", dev)
        checkpoint = Checkpoint(*open_gguf_blocks(resolved.path), converted=False)
    else:
        checkpoint = open_checkpoint(resolved)
    config = checkpoint.config
    checkpoint.tokenizer.check_fits(config.vocab_size, str(resolved.path))
    if not keep_quantized:
        dt = choose_dtype(dtype, dev, resolved.name, weight_count(config), placement)
    model = build(checkpoint, dev, dt, keep_quantized=keep_quantized, placement=placement, name=resolved.name)
    return LoadedModel(name=resolved.name, source=resolved.kind, path=resolved.path, config=config, model=model,
                       tokenizer=checkpoint.tokenizer, device=dev, dtype=dt, load_s=time.perf_counter() - t0,
                       converted=checkpoint.converted)


def load_fast(resolved, device: Optional[str]) -> LoadedModel:
    """--fast: a GGUF file's matrices on int4 kernels straight from their blocks, everything else in bfloat16."""
    from llmtrace.checkpoint.fast import load_gguf_fast
    from llmtrace.model.fast import COMPUTE

    if resolved.kind != "gguf":
        raise BadValue("fast", f" runs a GGUF file's quantized blocks on int4 kernels; {resolved.name} is not a GGUF "
                       f"file (dtype bfloat16 gives it the fast path's bfloat16 compute)", also=("dtype",))
    dev = pick_device(device)
    check_fast_device(dev.type)
    t0 = time.perf_counter()
    check_fits(resolved.name, resolved.path.stat().st_size, "its quantized blocks", dev)
    config, model, tokenizer = load_gguf_fast(resolved.path, dev)
    tokenizer.check_fits(config.vocab_size, str(resolved.path))
    return LoadedModel(name=resolved.name, source=resolved.kind, path=resolved.path, config=config, model=model,
                       tokenizer=tokenizer, device=dev, dtype=COMPUTE, load_s=time.perf_counter() - t0,
                       converted=False)


def build(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, *, keep_quantized: bool = False,
          placement: Optional[Placement] = None, name: str = "the model") -> Transformer:
    """Read the weights the plan names into the model: as blocks (--keep-quantized), over devices and disk
    (--device-map), or onto one device."""
    config, plan = checkpoint.config, checkpoint.plan
    if keep_quantized:
        return build_quantized(config, plan, device, dtype)
    if placement is not None:
        return placement.load(config, plan, dtype)
    progress, stop = progress_to_stderr(f"loading {name}")
    try:
        sd = read_weights(plan, dtype, device, progress)
    finally:
        stop()
    return build_model(config, sd, device, dtype)


def open_checkpoint(resolved) -> Checkpoint:
    """Config, tensor plan (nothing read yet) and tokenizer of an HF directory or a GGUF file (converted once)."""
    if resolved.kind == "gguf":
        dest = converted_dir(resolved.path)
        converted = not (dest / "llmtrace_config.json").exists()
        if converted:
            convert_gguf(resolved.path, dest)
        try:
            config, plan, tokenizer = open_converted(dest)
        except OutdatedConversion as e:  # written by an older llmtrace: convert it again, once
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
            print(f"the cached conversion of {resolved.path.name} was written by an older llmtrace ({e}):\n"
                  f"  converting it again", file=sys.stderr, flush=True)
            convert_gguf(resolved.path, dest)
            config, plan, tokenizer = open_converted(dest)
            converted = True
        except Exception as e:  # a damaged cache entry: convert again next time
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
            raise LlmtraceError(f"the cached conversion of {resolved.path.name} was unreadable ({one_line(e)}) and "
                                f"has been removed; run the command again") from None
        return Checkpoint(config, plan, tokenizer, converted)
    where = str(resolved.path)
    cfg_path = resolved.path / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise LlmtraceError(f"{where}: no config.json in this directory") from None
    except json.JSONDecodeError as e:
        raise LlmtraceError(f"{cfg_path}: not valid JSON (line {e.lineno}: {e.msg}); fix it or fetch it again") from None
    config = config_from_hf(raw, where)
    config.extra = config.extra | {"format": "safetensors", "torch_dtype": raw.get("torch_dtype", raw.get("dtype"))}
    entries = hf_entries(resolved.path, text_model(raw, where)[1])
    config, note = tied_head(entries, config, where)
    if note:
        print(note, file=sys.stderr)
    plan = plan_weights(entries, config, "hf", where)
    return Checkpoint(config, plan, TextTokenizer.from_hf_dir(resolved.path), False)
