"""Mixtral: Llama whose feed-forward is a mixture of experts (model/moe.py): a router picks each token's top K of E
SwiGLU experts, their weights always renormalised to sum to 1. A GGUF of it is a Llama file (arch `llama`, q/k rows
permuted) that has experts: `llama.expert_count` and the 3-D `ffn_*_exps` tensors, which is how this family claims it
(Family.gguf_requires)."""

from llmtrace.model.family import Family
from llmtrace.model.moe import MOE_WORDS, MoEBlock, MoEFeedForward, moe_changes, moe_fields
from llmtrace.model.transformer import Block, Transformer


class MixtralFeedForward(MoEFeedForward):
    HF_EXPERTS = {"gate": "experts.{e}.w1.weight", "up": "experts.{e}.w3.weight", "down": "experts.{e}.w2.weight"}


class MixtralBlock(MoEBlock):
    feed_forward = MixtralFeedForward
    CHILDREN = {**Block.CHILDREN, "ffn": ("block_sparse_moe", "")}


class Mixtral(Transformer):
    block = MixtralBlock


def hf_config(cfg: dict) -> dict:
    return moe_fields(cfg.get("num_local_experts", 8), "num_local_experts", cfg.get("num_experts_per_tok", 2),
                      "num_experts_per_tok") | {"norm_topk_prob": True}


def gguf_config(meta) -> dict:
    # nothing in the file says "renormalise": llama.cpp's llama graph always does (so does Mixtral)
    return moe_fields(meta("expert_count"), "expert_count", meta("expert_used_count"), "expert_used_count") | {
        "norm_topk_prob": True}


FAMILY = Family(
    name="mixtral",
    title="Mixtral",
    model=Mixtral,
    hf_types={"mixtral": "MixtralForCausalLM"},
    gguf_archs={"llama": True},
    gguf_requires=("expert_count",),
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=moe_changes,
    words=MOE_WORDS,
)
