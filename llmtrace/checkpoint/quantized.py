"""The load that keeps a GGUF's matrices in their blocks (--keep-quantized): matrices become model.quant's
QuantLinear/QuantEmbedding, vectors (norms, biases) are read in the run dtype."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmtrace.model.quant import BLOCKS, QuantEmbedding, QuantLinear, Segment


def load_gguf_quantized(path, device: torch.device, dtype: torch.dtype):
    """Config, model and tokenizer of a GGUF file whose matrices stay in their blocks. The q/k rows are put in HF order
    (rows are whole blocks, so this moves bytes, not values) and QKV and gate/up are fused as row segments."""
    from llmtrace.errors import LlmtraceError
    from llmtrace.checkpoint.weights import build_model, plan_layout, read_weights
    from llmtrace.checkpoint.gguf_checkpoint import config_from_gguf, gguf_entries
    from llmtrace.checkpoint.conversion import gguf_facts
    from llmtrace.checkpoint.gguf_file import open_gguf
    from llmtrace.tokens.tokenizer import TextTokenizer

    where = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, where)
    tokenizer = TextTokenizer.from_gguf(reader)
    plan = plan_layout(gguf_entries(reader, config, where), config, where)
    config.extra = gguf_facts(reader) | {"keep_quantized": True}
    del reader
    matrices = {name: parts for name, parts in plan.items() if len(parts[0].shape) == 2}
    for parts in matrices.values():
        for p in parts:
            if p.kind not in BLOCKS:
                raise LlmtraceError(f"{where}: --keep-quantized cannot keep tensor {p.key} of type {p.kind} (it keeps "
                                    f"{', '.join(BLOCKS)}); leave out --keep-quantized to dequantize the file once")
    sd = read_weights({n: ps for n, ps in plan.items() if n not in matrices}, dtype, device)
    modules: dict[str, nn.Module] = {}
    for name, parts in matrices.items():
        module = name.removesuffix(".weight")
        raws = [p.raw().to(device) for p in parts]
        segments = [Segment(p.kind, p.key) for p in parts]
        if module == "embed":
            modules[module] = QuantEmbedding(raws[0], segments[0], config.d_model, dtype)
        else:
            modules[module] = QuantLinear(raws, segments, parts[0].shape[1], dtype, bias=sd.pop(module + ".bias", None))
    if config.tie_embeddings:  # the head multiplies by the embedding's own blocks
        e = modules["embed"]
        modules["lm_head"] = QuantLinear([e.raw0], e.segments, config.d_model, dtype)
    model = build_model(config, sd, device, dtype, modules)
    return config, model, tokenizer
