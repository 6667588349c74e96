"""The fast path's load (`--fast`): a GGUF file's matrices become model.fast's FastLinear modules on the kernel
their block types map onto, the token embedding stays in its blocks (model.quant's QuantEmbedding), vectors (norms,
biases) are read in bfloat16."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from llmtrace.model.fast import COMPUTE, DENSE, FastLinear, choose_kernel, fast_linear
from llmtrace.model.quant import BLOCKS, GROUP_KINDS, QuantEmbedding, Segment




def load_gguf_fast(path, device: torch.device, choice: Optional[dict] = None):
    """Config, model and tokenizer of a GGUF file for the fast path: matrices on FastLinear, the embedding in its
    blocks, vectors in bfloat16. config.extra["fast"] records the kernel choice and the matrices that run in bf16."""
    from llmtrace.checkpoint.conversion import gguf_facts
    from llmtrace.checkpoint.gguf_checkpoint import config_from_gguf, gguf_entries
    from llmtrace.checkpoint.gguf_file import open_gguf
    from llmtrace.checkpoint.weights import build_model, plan_layout, read_weights
    from llmtrace.errors import LlmtraceError
    from llmtrace.tokens.tokenizer import TextTokenizer

    where = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, where)
    tokenizer = TextTokenizer.from_gguf(reader)
    plan = plan_layout(gguf_entries(reader, config, where), config, where)
    facts = gguf_facts(reader)
    del reader
    choice = choice or choose_kernel(device)
    matrices = {name: parts for name, parts in plan.items() if len(parts[0].shape) == 2}
    for parts in matrices.values():
        for p in parts:
            if p.kind not in BLOCKS:
                raise LlmtraceError(f"{where}: --fast cannot run tensor {p.key} of type {p.kind} (it runs "
                                    f"{', '.join(BLOCKS)}); leave out --fast to dequantize the file once")
    sd = read_weights({n: ps for n, ps in plan.items() if n not in matrices}, COMPUTE, device)
    modules: dict[str, nn.Module] = {}
    for name, parts in matrices.items():
        module = name.removesuffix(".weight")
        raws = [p.raw() for p in parts]
        segments = [Segment(p.kind, p.key) for p in parts]
        if module == "embed":
            modules[module] = QuantEmbedding(raws[0].to(device), segments[0], config.d_model, COMPUTE)
            if config.tie_embeddings:  # the head multiplies by the embedding's own blocks, on its own kernel
                modules["lm_head"] = fast_linear(raws, segments, config.d_model, device, choice["int4"])
        else:
            modules[module] = fast_linear(raws, segments, parts[0].shape[1], device, choice["int4"],
                                          bias=sd.pop(module + ".bias", None))
        del raws
    model = build_model(config, sd, device, COMPUTE, modules)
    for block in model.layers:  # decode attention as G query rows per KV head (model.transformer.Attention)
        block.attn.fold_gqa_decode = True
    dense = [n for n, m in model.named_modules() if isinstance(m, FastLinear) and DENSE in m.kernel]
    config.extra = facts | {"fast": {"kernel_choice": choice, "bf16_matrices": dense}}
    return config, model, tokenizer


def bf16_note(lm) -> Optional[str]:
    """One line naming the matrices that run in bfloat16 on the fast path because their type has no int4 form (None
    when every matrix runs on the int4 kernel, or when the int4 kernel was not chosen: the header says that)."""
    fast = lm.config.extra.get("fast")
    if not fast or not fast["kernel_choice"]["int4"] or not fast["bf16_matrices"]:
        return None
    model, names = lm.model, fast["bf16_matrices"]
    kinds = sorted({s.kind for n in names for s in model.get_submodule(n).segments if s.kind not in GROUP_KINDS})
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    kinds = " and ".join(kinds) + (" have" if len(kinds) > 1 else " has")
    return (f"--fast: {len(names)} matri{'x' if len(names) == 1 else 'ces'} ({shown}) run in bfloat16, whole or in "
            f"part: {kinds} no int4 form")
