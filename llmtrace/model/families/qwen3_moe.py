"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head, model/families/qwen3.py) and a mixture-of-experts
feed-forward (model/moe.py): a router picks each token's top K of E SwiGLU experts of width moe_intermediate_size;
their weights are renormalised to sum to 1 when `norm_topk_prob` says so. No shared expert. `mlp_only_layers` and
`decoder_sparse_step` keep some layers dense (a SwiGLU of width intermediate_size); released models have none.

From a GGUF (arch `qwen3moe`) the weights are always renormalised: the converter does not write norm_topk_prob, and
llama.cpp's qwen3moe graph renormalises (transformers' GGUF loader sets norm_topk_prob true too). Such a file of a
model whose config says false computes what llama.cpp computes, not what transformers does on its HF directory."""

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family
from llmtrace.model.families.qwen3 import WORDS as QWEN3_WORDS, Qwen3Attention, changes as qwen3_changes
from llmtrace.model.moe import MOE_WORDS, MoEBlock, moe_changes, moe_fields
from llmtrace.model.transformer import Transformer
from llmtrace.units import plural


class Qwen3MoeBlock(MoEBlock):
    attention = Qwen3Attention


class Qwen3Moe(Transformer):
    block = Qwen3MoeBlock


def dense_layers(cfg: dict, n_experts: int) -> list[int]:
    """The layers transformers builds with a dense MLP: those in mlp_only_layers, and those (i + 1) % step != 0."""
    step = cfg.get("decoder_sparse_step") or 1
    only = cfg.get("mlp_only_layers") or []
    n = int(cfg["num_hidden_layers"])
    bad = [i for i in only if not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise LlmtraceError(f"config.json: mlp_only_layers names layer {bad[0]!r}, "
                            f"but the model has {plural(n, 'layer')}")
    return [i for i in range(n) if i in only or not (n_experts > 0 and (i + 1) % int(step) == 0)]


def hf_config(cfg: dict) -> dict:
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    fields = moe_fields(n_experts, "num_experts", cfg.get("num_experts_per_tok", 8), "num_experts_per_tok")
    return fields | {"expert_ffn_dim": int(cfg.get("moe_intermediate_size", 768)),
                     "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                     "dense_layers": dense_layers(cfg, fields["n_experts"]) or None}


def gguf_config(meta) -> dict:
    fields = moe_fields(meta("expert_count"), "expert_count", meta("expert_used_count"), "expert_used_count")
    width = meta("expert_feed_forward_length")
    if width is None:
        raise LlmtraceError("GGUF metadata lacks qwen3moe.expert_feed_forward_length (one expert's width)")
    return fields | {"expert_ffn_dim": int(width), "norm_topk_prob": True}


FAMILY = Family(
    name="qwen3_moe",
    title="Qwen3-MoE",
    model=Qwen3Moe,
    hf_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
    gguf_archs={"qwen3moe": False},  # not permuted (NEOX RoPE), as Qwen3
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=lambda c: qwen3_changes(c) + moe_changes(c),
    words={**QWEN3_WORDS, **MOE_WORDS},
)
