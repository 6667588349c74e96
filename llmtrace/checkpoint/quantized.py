"""The load that keeps a GGUF's matrices in their blocks (--keep-quantized): matrices become model.quant's
QuantLinear/QuantEmbedding, vectors (norms, biases) are read in the run dtype."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmtrace.checkpoint.gguf_checkpoint import open_gguf_checkpoint
from llmtrace.checkpoint.weights import build_model, declared, read_weights
from llmtrace.errors import FieldError
from llmtrace.model.quant import BLOCKS, QuantEmbedding, QuantExperts, QuantLinear, Segment
from llmtrace.model.transformer import ModelConfig, Transformer
from llmtrace.tokens.tokenizer import TextTokenizer


def open_gguf_blocks(path) -> tuple[ModelConfig, dict[str, list], TextTokenizer]:
    """Config, tensor plan (nothing read yet) and tokenizer of a GGUF file whose matrices will stay in their blocks.
    A matrix of a type that cannot be kept is refused here, before anything is read."""
    config, plan, tokenizer, facts = open_gguf_checkpoint(path)
    config.extra = facts | {"keep_quantized": True}
    for name, parts in plan.items():
        for p in parts:
            if is_matrix(name, parts) and p.kind not in BLOCKS:
                raise FieldError("keep_quantized", f" cannot keep tensor {p.key} of type {p.kind} (it keeps "
                                 f"{', '.join(BLOCKS)}); leave out keep_quantized to dequantize the file once",
                                 also=("keep_quantized",), before=f"{path}: ")
    return config, plan, tokenizer


def is_matrix(name: str, parts: list) -> bool:
    """A parameter kept in its blocks: a matrix or a stack of them (a stack's biases, (E, out), are vectors)."""
    return name.endswith(".weight") and len(parts[0].shape) >= 2


def build_quantized(config: ModelConfig, plan: dict[str, list], device: torch.device, dtype: torch.dtype) -> Transformer:
    """The model with its matrices as blocks. The q/k rows are put in HF order (rows are whole blocks, so this moves
    bytes, not values) and QKV and gate/up are fused as row segments; a mixture of experts' 3-D stacks stay one tensor
    of blocks each (model.quant.QuantExperts)."""
    matrices = {name: parts for name, parts in plan.items() if is_matrix(name, parts)}
    sd = read_weights({n: ps for n, ps in plan.items() if n not in matrices}, dtype, device)
    modules: dict[str, nn.Module] = {}
    tables = {w.param for w in declared(config) if w.weight.kind == "embedding"}  # looked up by row: the token table, a per-layer one
    for name, parts in matrices.items():
        module = name.removesuffix(".weight")
        if len(parts[0].shape) == 3:  # a mixture of experts' stack, (E, out, in): one tensor, its rows whole blocks
            p = parts[0]
            modules[module] = QuantExperts(p.raw().to(device), Segment(p.kind, p.key), p.shape, dtype,
                                           bias=sd.pop(module + ".bias", None))
            continue
        raws = [p.raw().to(device) for p in parts]
        segments = [Segment(p.kind, p.key) for p in parts]
        if name in tables:
            modules[module] = QuantEmbedding(raws[0], segments[0], parts[0].shape[1], dtype)
        else:
            modules[module] = QuantLinear(raws, segments, parts[0].shape[1], dtype, bias=sd.pop(module + ".bias", None))
    if config.tie_embeddings:  # the head multiplies by the embedding's own blocks
        e = modules["embed"]
        modules["lm_head"] = QuantLinear([e.raw0], e.segments, config.d_model, dtype)
    return build_model(config, sd, device, dtype, modules)
