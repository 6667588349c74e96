"""LFM2 (Liquid AI): most layers are short gated convolutions (model.kinds.short_conv: B·x, a causal depthwise
convolution of length Lc, C·, W_out), whose memory is the last Lc−1 inputs of each channel; the others are GQA
attention with Qwen3's RMSNorm on each query and key head before RoPE. As transformers' Lfm2ForCausalLM computes it
(modeling_lfm2.py):

  every layer: h += mixer(RMSNorm(h)); h += SwiGLU(RMSNorm(h))   (Llama's pre-norm block; the norms scale by w)
  the mixer:   a ShortConv in the "conv" layers of config.layer_types, attention in the "full_attention" ones
  the end:     the last norm is called `embedding_norm` in the checkpoint, but it is applied after the last layer,
               as Llama's final norm is; the LM head is tied to the embedding in the released models

The feed-forward's width is adjusted from the config's (block_auto_adjust_ff_dim): F = ⌊2·F₀/3⌋, times
block_ffn_dim_multiplier, rounded up to a multiple of block_multiple_of, as transformers and llama.cpp's converter do.

From GGUF (arch lfm2, llama.cpp's converter): the KV head count is one number per layer, 0 in a convolution layer,
which is how the file says which layers are which; the kernel is shortconv.l_cache; q/k rows are in HF order.
"""

from __future__ import annotations

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.families.qwen3 import Qwen3Attention
from llmtrace.model.hybrid import HybridBlock
from llmtrace.model.kinds.short_conv import KERNEL, KIND, ShortConv
from llmtrace.model.points import Source, Weight
from llmtrace.model.transformer import FeedForward, Transformer


class Lfm2Attention(Qwen3Attention):
    """Qwen3's attention (q/k RMSNorm per head, γ as stored), its tensors named as LFM2 names them."""

    CHILDREN = {"q_norm": ("q_layernorm", "attn_q_norm"), "k_norm": ("k_layernorm", "attn_k_norm")}

    def weights(self) -> tuple[Weight, ...]:
        *qkv, wo = super().weights()
        return (*qkv, Weight(wo.name, wo.shape, wo.step, wo.kind, (Source("out_proj.weight", "attn_output.weight", "D",
                                                                         "Wo"),)))


class Lfm2FeedForward(FeedForward):
    """Llama's SwiGLU; the checkpoint calls W_gate, W_up, W_down w1, w3, w2."""

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_gate_up.weight", ("2*F", "D"), "s6.7", "matrix", (
                    Source("w1.weight", "ffn_gate.weight", "F", "W_gate"),
                    Source("w3.weight", "ffn_up.weight", "F", "W_up"))),
                Weight("w_down.weight", ("D", "F"), "s6.7", "matrix",
                       (Source("w2.weight", "ffn_down.weight", "D", "W_down"),)))


class Lfm2Block(HybridBlock):
    """Llama's block; its mixer is a short convolution in the config's "conv" layers (its tensors under conv. in an
    HF file, shortconv. in a GGUF)."""

    attention = Lfm2Attention
    mixers = {"conv": ShortConv}
    MIXER_KEYS = {"conv": ("conv", "shortconv")}
    feed_forward = Lfm2FeedForward
    CHILDREN = {"attn_norm": ("operator_norm", "attn_norm"), "attn": ("self_attn", ""),
                "ffn_norm": ("ffn_norm", "ffn_norm"), "ffn": ("feed_forward", "")}


class Lfm2(Transformer):
    block = Lfm2Block
    CHILDREN = {**Transformer.CHILDREN, "norm": ("model.embedding_norm", "token_embd_norm")}


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def refuse(field: str, value, why: str) -> LlmtraceError:
    return LlmtraceError(f"{field} {value!r} is not supported: {why}")


def _kernel(value, field: str) -> dict:
    kernel = int(value)
    if kernel < 2:
        raise refuse(field, value, "a short convolution needs a kernel of 2 or more")
    return {KIND: {"kernel": kernel}}


def _ffn_dim(cfg: dict) -> int:
    """The feed-forward width as transformers' Lfm2MLP works it out (block_auto_adjust_ff_dim)."""
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    if cfg.get("block_ffn_dim_multiplier") is not None:
        width = int(float(cfg["block_ffn_dim_multiplier"]) * width)
        multiple = int(cfg.get("block_multiple_of") or 256)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def hf_config(cfg: dict) -> dict:
    if cfg.get("conv_bias"):
        raise refuse("conv_bias", True, "no released LFM2 has biases in its convolution layers")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise refuse("rope_parameters.rope_type", rope.get("rope_type"), "llmtrace runs LFM2's default RoPE")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(n)]
    unknown = sorted({t for t in types if t not in ("full_attention", "conv")})
    if unknown or len(types) != n:
        raise refuse("layer_types", unknown[0] if unknown else f"{len(types)} entries",
                     f"LFM2 has {n} layers, each full_attention or conv")
    return dict(layer_types=["conv" if t == "conv" else "full" for t in types], ffn_dim=_ffn_dim(cfg),
                rms_eps=float(cfg.get("norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 1_000_000.0),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
                parts=_kernel(cfg.get("conv_L_cache", KERNEL), "conv_L_cache"))


def gguf_config(meta) -> dict:
    kv = meta("attention.head_count_kv")
    if not isinstance(kv, list):
        raise LlmtraceError("GGUF metadata lfm2.attention.head_count_kv is one number: an LFM2 file gives one per "
                            "layer (0 in a convolution layer)")
    kernel = meta("shortconv.l_cache")
    if kernel is None:
        raise LlmtraceError("GGUF metadata lacks lfm2.shortconv.l_cache, the convolution's kernel length")
    return dict(layer_types=["conv" if int(h) == 0 else "full" for h in kv], parts=_kernel(kernel, "lfm2.shortconv.l_cache"))


# What LFM2 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "conv": ("{k} of {n} layers are short gated convolutions, not attention: B, C and x are three projections of the "
             "normed input; B ⊙ x is convolved causally over each channel's last {kernel} values (no RoPE, no scores), "
             "multiplied by C, then projected by W_out",
             "{n} 层中有 {k} 层是短门控卷积，不是注意力：B、C 和 x 是归一化后输入的三个投影；B ⊙ x 在每个通道最近的 "
             "{kernel} 个值上做因果卷积（不做 RoPE，没有注意力分数），乘以 C，再由 W_out 投影"),
    "window": ("a convolution layer remembers only its last {m} inputs per channel: {d} × {m} = {w} numbers, the same "
               "at every step, in place of a KV cache that grows with every token",
               "卷积层只记住每个通道最近的 {m} 个输入：{d} × {m} = {w} 个数，每一步都一样，代替随每个词元增长的 KV 缓存"),
    "attention": ("the other {k} layers ({which}): grouped-query attention with q/k RMSNorm per head (width {dh}) "
                  "before RoPE",
                  "其余 {k} 层（第 {which} 层）：分组查询注意力 GQA，q/k 在 RoPE 之前按头做 RMSNorm（宽 {dh}）"),
    "last_norm": ("the last norm (the checkpoint's embedding_norm) is applied after the last layer, as Llama's final "
                  "norm",
                  "最后的归一化（检查点里叫 embedding_norm）放在最后一层之后，与 Llama 的最终归一化相同"),
}


def changes(c) -> list[str]:
    kernel = int(c.parts.get(KIND, {}).get("kernel", KERNEL))
    kinds = c.layer_types or []
    n_conv = sum(t == "conv" for t in kinds)
    attn = [i for i, t in enumerate(kinds) if t != "conv"]
    return [say(WORDS, "conv", k=n_conv, n=c.n_layers, kernel=kernel),
            say(WORDS, "window", m=kernel - 1, d=c.d_model, w=f"{c.d_model * (kernel - 1):,}"),
            say(WORDS, "attention", k=len(attn), which=", ".join(map(str, attn)), dh=c.head_dim),
            say(WORDS, "last_norm")]


FAMILY = Family(
    name="lfm2",
    title="LFM2",
    model=Lfm2,
    hf_types={"lfm2": "Lfm2ForCausalLM"},
    gguf_archs={"lfm2": False},  # the converter keeps q/k rows in HF order (NEOX-style RoPE)
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
)
