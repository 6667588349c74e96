"""Granite 4.0-H (transformers' GraniteMoeHybridForCausalLM): most layers are Mamba2 (model/kinds/mamba2.py), whose
memory is a fixed-size state, and a few are attention; every layer's feed-forward is a shared SwiGLU MLP, beside a
mixture of experts where the model has them (the dense 350M and 1B have none). µP multipliers, as transformers
computes them:

    x      = E[id] · embedding_multiplier                          s4
    x      = x + residual_multiplier · mixer(RMSNorm(x))           the mixer: Mamba2 or attention
    x      = x + residual_multiplier · (experts(h) + shared(h)),  h = RMSNorm(x)
    logits = (RMSNorm(x) W_head) / logits_scaling                  s9
    attention scores = q·kᵀ · attention_multiplier (not 1/√Dh); no RoPE unless position_embedding_type is "rope"
                       (the released models have none: attention sees content, order comes from the Mamba2 layers)
    the router: the top K of the raw logits, then a softmax over those K (gpt-oss's order)

An HF directory stores each expert stack's gate and up as one tensor (input_linear, [gate; up]) and the shared MLP
likewise; llama.cpp's converter splits them (ffn_gate_exps / ffn_up_exps, ffn_gate_shexp / ffn_up_shexp, or ffn_gate
/ ffn_up for a dense model), stores A = −exp(A_log) and its q/k rows permuted. A GGUF says which layers are attention
by a per-layer KV head count (0 for a Mamba2 layer) and whether attention rotates by `rope.scaling.finetuned`, which
llama.cpp reads as its use-RoPE flag: llmtrace follows the file.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.model.kinds import mamba2
from llmtrace.model.kinds.mamba2 import Mamba2
from llmtrace.model.llama_points import EMBED, LAST, LOGITS, O_PROJ
from llmtrace.model.hybrid import HybridBlock
from llmtrace.model.maths import LayerPlan, Op, op
from llmtrace.model.moe import MoEFeedForward, moe_fields
from llmtrace.model.moe_points import EXPERT_DOWN, MOE_POINTS
from llmtrace.model.points import Point, Source, Weight, inserted
from llmtrace.model.transformer import Attention, Block, FeedForward, Module, Transformer
from llmtrace.units import plural

PART = "granite"  # the config part of the multipliers


def multiplier(config, name: str) -> float:
    return float(config.parts.get(PART, {}).get(name, 1.0))

EMBED_SCALED = Point("embed_scaled", "s4", ("T", "D"), input=EMBED.name,
                     about="the embedding × embedding_multiplier: the stream entering layer 0")
LOGITS_RAW = Point("logits_raw", "s9", ("V",), about="the LM head's output before ÷ logits_scaling")
LOGITS_SCALED = replace(LOGITS, about="logits_raw ÷ logits_scaling: one score per vocabulary entry")
ATTN_SCALED = Point("attn_scaled", "s6.6", ("T", "D"), about="the mixer's output × residual_multiplier, added to the "
                    "stream", input=O_PROJ.name)
FFN_OUT = Point("ffn_out", "s6.7", ("T", "D"), editable=True, about="the experts' weighted sum plus the shared MLP's "
                "output: the feed-forward's output")
FFN_SCALED = Point("ffn_scaled", "s6.7", ("T", "D"), about="the feed-forward's output × residual_multiplier, added to "
                   "the stream")
SHARED_GATE = Point("shared_gate", "s6.7", ("T", "F"), about="the shared MLP's x·W_gate")
SHARED_UP = Point("shared_up", "s6.7", ("T", "F"), about="the shared MLP's x·W_up")
SHARED_ACT = Point("shared_act", "s6.7", ("T", "F"), about="the shared MLP's silu(gate) ⊙ up")
SHARED_DOWN = Point("shared_down", "s6.7", ("T", "D"), editable=True, about="the shared MLP's output: ·W_down, run "
                    "for every token beside the experts")
EXPERTS_DOWN = replace(EXPERT_DOWN, about="the chosen experts' outputs (·W_down of each), weighted and summed: the "
                       "experts' part of the feed-forward")


def _gate_up(hf: str, gate: str, up: str, rows: str = "F") -> Source:
    """W_gate and W_up: one [gate; up] HF tensor, two GGUF tensors."""
    return (Source(hf, gate, rows, "W_gate", hf_transform=("gate_half",)),
            Source(hf, up, rows, "W_up", hf_transform=("up_half",)))


class GraniteAttention(Attention):
    """Llama's attention, its score scale attention_multiplier (config.attn_scale), without RoPE in the released
    models (the layer plan says which)."""

    SCALE_LABEL = "attention_multiplier"


class SharedMLP(FeedForward):
    """The SwiGLU every token runs beside its experts (HF shared_mlp), under its own point names."""

    POINTS = (SHARED_GATE, SHARED_UP, SHARED_ACT, SHARED_DOWN)

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_gate_up.weight", ("2*F", "D"), "s6.7", "matrix",
                       _gate_up("input_linear.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight")),
                Weight("w_down.weight", ("D", "F"), "s6.7", "matrix",
                       (Source("output_linear.weight", "ffn_down_shexp.weight", "D", "W_down"),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split_with_sizes([self.ffn_dim, self.ffn_dim], dim=-1)  # (B, T, F) each
        self.point(SHARED_GATE.name, gate)
        self.point(SHARED_UP.name, up)
        act = self.point(SHARED_ACT.name, self.glu(gate, up))  # (B, T, F)
        return self.point(SHARED_DOWN.name, self.w_down(act))  # (B, T, D)

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        F_ = self.ffn_dim
        return {SHARED_GATE.name: op("matmul", [x], ["w_gate_up.weight"], rows=[0, F_]),
                SHARED_UP.name: op("matmul", [x], ["w_gate_up.weight"], rows=[F_, 2 * F_]),
                SHARED_ACT.name: op("glu", [SHARED_GATE.name, SHARED_UP.name], act=self.act_name, clamp=None),
                SHARED_DOWN.name: op("matmul", [SHARED_ACT.name], ["w_down.weight"])}

    def flops(self, n_tokens: int) -> list[tuple]:
        return [("shared", ("shared MLP", "共享 MLP"), *super().flops(n_tokens)[0][2:])]


class DenseMLP(FeedForward):
    """A dense Granite's feed-forward: the shared MLP alone, under Llama's point names (GGUF ffn_gate/up/down)."""

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_gate_up.weight", ("2*F", "D"), "s6.7", "matrix",
                       _gate_up("shared_mlp.input_linear.weight", "ffn_gate.weight", "ffn_up.weight")),
                Weight("w_down.weight", ("D", "F"), "s6.7", "matrix",
                       (Source("shared_mlp.output_linear.weight", "ffn_down.weight", "D", "W_down"),)))


class GraniteMoE(MoEFeedForward):
    """The experts (the top K of the raw router logits, softmaxed over those K) plus the shared MLP."""

    POINTS = (*(EXPERTS_DOWN if p == EXPERT_DOWN else p for p in MOE_POINTS), *SharedMLP.POINTS, FFN_OUT)
    CHILDREN = {"shared": ("shared_mlp", "")}
    choice = "topk_softmax"

    def __init__(self, config):
        super().__init__(config)
        self.shared = SharedMLP(config)

    def weights(self) -> tuple[Weight, ...]:
        moe = "block_sparse_moe."
        return (Weight("router.weight", ("E", "D"), "s6.7", "matrix",
                       (Source(moe + "router.layer.weight", "ffn_gate_inp.weight", "E", "W_router"),)),
                Weight("w_gate.weight", ("E", "Fe", "D"), "s6.7", "experts", (_gate_up(
                    moe + "input_linear.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "E")[0],)),
                Weight("w_up.weight", ("E", "Fe", "D"), "s6.7", "experts", (_gate_up(
                    moe + "input_linear.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "E")[1],)),
                Weight("w_down.weight", ("E", "D", "Fe"), "s6.7", "experts",
                       (Source(moe + "output_linear.weight", "ffn_down_exps.weight", "E", "W_down"),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = super().forward(x)  # (B, T, D)
        return self.point(FFN_OUT.name, experts + self.shared(x))  # (B, T, D)

    def maths(self, x: str, plan) -> dict[str, Op]:
        shared = {n: o.prefixed("shared.") for n, o in self.shared.maths(x, plan).items()}
        return super().maths(x, plan) | shared | {FFN_OUT.name: op("add", [EXPERT_DOWN.name, SHARED_DOWN.name])}

    def flops(self, n_tokens: int) -> list[tuple]:
        return [*super().flops(n_tokens), *self.shared.flops(n_tokens)]


class GraniteHybridBlock(HybridBlock):
    """Pre-norm, each sub-layer's output × residual_multiplier before the add; the mixer is Mamba2 in the config's
    "mamba" layers (its tensors under mamba. in an HF file)."""

    attention = GraniteAttention
    mixers = {"mamba": Mamba2}
    MIXER_KEYS = {"mamba": ("mamba", "")}
    feed_forward = GraniteMoE
    dense_feed_forward = DenseMLP
    POINTS = inserted(inserted(Block.POINTS, "attn", ATTN_SCALED), "ffn", FFN_SCALED)
    CHILDREN = {**Block.CHILDREN, "ffn": ("", "")}
    WIRING = tuple(replace(add, factor="residual_multiplier", scaled=scaled)
                   for add, scaled in zip(Block.WIRING, (ATTN_SCALED.name, FFN_SCALED.name)))

    def __init__(self, config, layer: int):
        super().__init__(config, layer)
        self.residual_multiplier = multiplier(config, "residual_multiplier")

    def feed_forward_of(self, config, layer: int) -> Module:
        return (self.feed_forward if config.n_experts else self.dense_feed_forward)(config)


class GraniteHybrid(Transformer):
    block = GraniteHybridBlock
    POINTS = tuple(LOGITS_SCALED if p == LOGITS else p
                   for p in inserted(inserted(Transformer.POINTS, EMBED.name, EMBED_SCALED), LAST.name, LOGITS_RAW))
    STREAM_IN = EMBED_SCALED.name

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """s4: ids (B, T) -> their embedding rows × embedding_multiplier (B, T, D)."""
        x = self.point(EMBED.name, self.embed(idx))
        return self.point(EMBED_SCALED.name, x * multiplier(self.config, "embedding_multiplier"))

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        x = self.point("final_norm", self.norm(x))  # s8: (B, T, D)
        if last_only:
            x = self.point("last", x[:, -1, :])  # s7: (B, D)
        raw = self.point(LOGITS_RAW.name, self.lm_head(x))  # s9: (B, V) or (B, T, V)
        return self.point(LOGITS.name, raw / multiplier(self.config, "logits_scaling"))

    def model_maths(self) -> dict[str, Op]:
        out = super().model_maths()
        head, embedding = out[LOGITS.name], multiplier(self.config, "embedding_multiplier")
        return out | {EMBED_SCALED.name: op("scale", [EMBED.name], factor=embedding, label="embedding_multiplier"),
                      LOGITS_RAW.name: head,
                      LOGITS.name: op("scale", [LOGITS_RAW.name], factor=1 / multiplier(self.config, "logits_scaling"),
                                      label="1/logits_scaling")}


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def refuse(field: str, value, why: str) -> LlmtraceError:
    return LlmtraceError(f"{field} {value!r} is not supported: {why}")


LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full", "full_attention": "full"}


def _number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise refuse(field, value, "a Granite multiplier is a number above 0")
    return float(value)


def _json_float(v) -> float:
    """A number of config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _common(types: list[str], rope: bool, heads, head_dim, groups, state, kernel, dt_limit, n_experts, n_used,
            expert_width, shared_width, multipliers: dict, where: str) -> dict:
    n_heads, hd, g = int(heads), int(head_dim), int(groups)
    if min(n_heads, hd, g, int(state)) < 1 or n_heads % g or int(kernel) < 2:
        raise refuse(f"{where} Mamba2 sizes", [n_heads, hd, g, state, kernel],
                     "Mamba2 needs heads a multiple of the groups and a kernel of 2 or more")
    experts = moe_fields(n_experts, "num_local_experts", n_used, "num_experts_per_tok") if n_experts else {}
    mamba_layers = [i for i, t in enumerate(types) if t == "mamba"]
    return dict(layer_types=types, ffn_dim=int(shared_width), expert_ffn_dim=int(expert_width) if experts else None,
                **experts, **({"norm_topk_prob": False} if experts else {}), attn_scale=multipliers.pop("attention_multiplier"),
                no_rope_layers=mamba_layers if rope else list(range(len(types))),
                parts={mamba2.KEY: mamba2.config_part(n_heads, hd, g, int(state), int(kernel), True, dt_limit),
                       PART: multipliers})


def hf_config(cfg: dict) -> dict:
    n = int(cfg["num_hidden_layers"])
    raw = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    unknown = sorted({str(t) for t in raw if t not in LAYER_TYPES})
    if unknown or len(raw) != n:
        raise refuse("layer_types", unknown[0] if unknown else f"{len(raw)} entries",
                     f"Granite 4.0-H has {plural(n, 'layer')}, each mamba or attention")
    if cfg.get("attention_bias") or cfg.get("mamba_proj_bias"):
        raise refuse("attention_bias / mamba_proj_bias", True, "no released Granite 4.0-H has them")
    if not cfg.get("mamba_conv_bias", True):
        raise refuse("mamba_conv_bias", False, "every released Granite 4.0-H has a convolution bias")
    pos = cfg.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise refuse("position_embedding_type", pos, "Granite 4.0-H runs with rope or none")
    d, heads = int(cfg["hidden_size"]), int(cfg.get("mamba_n_heads", 128))
    inner = int(cfg.get("mamba_expand", 2)) * d
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise refuse("mamba_d_head", head_dim, f"heads × head width must be mamba_expand × hidden_size = {inner}")
    limit = [_json_float(v) for v in cfg.get("time_step_limit") or (0.0, float("inf"))]
    multipliers = {k: _number(cfg.get(k, 1.0), k) for k in ("embedding_multiplier", "residual_multiplier",
                                                              "attention_multiplier", "logits_scaling")}
    return _common([LAYER_TYPES[t] for t in raw], pos == "rope", heads, head_dim, cfg.get("mamba_n_groups", 1),
                   cfg.get("mamba_d_state", 256), cfg.get("mamba_d_conv", 4), limit, cfg.get("num_local_experts", 0),
                   cfg.get("num_experts_per_tok", 0), cfg["intermediate_size"],
                   cfg.get("shared_intermediate_size", 1024), multipliers, "config.json")


def gguf_config(meta) -> dict:
    n = int(meta("block_count"))
    kv = meta("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
    need = {k: meta(k) for k in ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size",
                                 "ssm.conv_kernel", "expert_shared_feed_forward_length")}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise LlmtraceError(f"GGUF metadata lacks granitehybrid.{missing[0]}, which Granite 4.0-H needs")
    heads = int(need["ssm.time_step_rank"])
    multipliers = {k: _number(meta(key) or 1.0, key) for k, key in (
        ("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
        ("attention_multiplier", "attention.scale"), ("logits_scaling", "logit_scale"))}
    rope = bool(meta("rope.scaling.finetuned", True))  # llama.cpp's use-RoPE flag for this arch
    return _common(["full" if k else "mamba" for k in kv], rope, heads, int(need["ssm.inner_size"]) // heads,
                   need["ssm.group_count"], need["ssm.state_size"], need["ssm.conv_kernel"], (0.0, float("inf")),
                   meta("expert_count") or 0, meta("expert_used_count") or 0, meta("feed_forward_length"),
                   need["expert_shared_feed_forward_length"], multipliers, "GGUF")


# What Granite 4.0-H changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "mamba2": ("{k} of {n} layers are Mamba2: a state h of {h} heads × {dh} × {ds} = {state} numbers per layer, "
               "updated h ← exp(Δ·A)·h + Δ·x⊗B and read y = C·h + D·x, in place of a KV cache that grows with every "
               "token",
               "{n} 层中有 {k} 层是 Mamba2：每层一个 {h} 个头 × {dh} × {ds} = {state} 个数的状态 h，按 "
               "h ← exp(Δ·A)·h + Δ·x⊗B 更新，按 y = C·h + D·x 读出，代替随每个词元增长的 KV 缓存"),
    "mamba2_parts": ("Mamba2 layers: a causal convolution over the last {kernel} tokens (no RoPE), B and C in "
                     "{groups}, the output RMS-normed per group after the gate silu(z)",
                     "Mamba2 层：对最近 {kernel} 个词元做因果卷积（不做 RoPE），B 和 C 分成 {g} 组，输出先乘以门 silu(z)，"
                     "再按组做 RMSNorm"),
    "attention_one_rope": ("layer {which}: attention with {kv} KV heads, scores scaled by attention_multiplier {a} "
                           "(not 1/√Dh), RoPE",
                           "第 {which} 层：注意力，{kv} 个 KV 头，分数 × attention_multiplier {a}（不是 1/√Dh），做 RoPE"),
    "attention_some_rope": ("layers {which}: attention with {kv} KV heads, scores scaled by attention_multiplier {a} "
                            "(not 1/√Dh), RoPE",
                            "第 {which} 层：注意力，{kv} 个 KV 头，分数 × attention_multiplier {a}（不是 1/√Dh），做 "
                            "RoPE"),
    "attention_one": ("layer {which}: attention with {kv} KV heads, scores scaled by attention_multiplier {a} (not "
                      "1/√Dh), no RoPE: it sees content, not position",
                      "第 {which} 层：注意力，{kv} 个 KV 头，分数 × attention_multiplier {a}（不是 1/√Dh），不做 RoPE："
                      "它看内容，不看位置"),
    "attention_some": ("layers {which}: attention with {kv} KV heads, scores scaled by attention_multiplier {a} (not "
                       "1/√Dh), no RoPE: it sees content, not position",
                       "第 {which} 层：注意力，{kv} 个 KV 头，分数 × attention_multiplier {a}（不是 1/√Dh），不做 "
                       "RoPE：它们看内容，不看位置"),
    "multipliers": ("embedding × {e}; each sub-layer's output × residual_multiplier {r} before the add; logits ÷ {l}",
                    "嵌入 × {e}；每个子层的输出在加回残差之前 × residual_multiplier {r}；logits ÷ {l}"),
    "experts": ("feed-forward: {e} SwiGLU experts (width {w}), each token's top {top} of the raw router logits, "
                "softmaxed over those; plus a shared SwiGLU (width {f}) every token runs",
                "前馈网络：{e} 个 SwiGLU 专家（宽 {w}），每个词元取路由器原始 logits 最高的 {k} 个，再对这 {k} 个做 "
                "softmax；另有一个共享的 SwiGLU（宽 {f}），每个词元都运行"),
    "shared_only": ("feed-forward: one SwiGLU (width {f}, HF's shared_mlp), no experts",
                    "前馈网络：一个 SwiGLU（宽 {f}，即 HF 的 shared_mlp），没有专家"),
}


def changes(c) -> list[str]:
    p, m = c.parts.get(mamba2.KEY, {}), c.parts.get(PART, {})
    n_ssm = sum(t == "mamba" for t in c.layer_types or [])
    state = p.get("heads", 0) * p.get("head_dim", 0) * p.get("state", 0)
    attn = [i for i, t in enumerate(c.layer_types or []) if t != "mamba"]
    rope = len(c.no_rope_layers or ()) < c.n_layers
    out = [say(WORDS, "mamba2", k=n_ssm, n=c.n_layers, h=p.get("heads"), dh=p.get("head_dim"), ds=p.get("state"),
               state=f"{state:,}"),
           say(WORDS, "mamba2_parts", kernel=p.get("conv_kernel"), groups=plural(p.get("groups", 1), "group"),
               g=p.get("groups", 1)),
           say(WORDS, f"attention_{'one' if len(attn) == 1 else 'some'}{'_rope' if rope else ''}",
               which=", ".join(map(str, attn)), kv=c.n_kv_heads, a=f"{c.attn_scale:g}"),
           say(WORDS, "multipliers", e=f"{m.get('embedding_multiplier', 1):g}",
               r=f"{m.get('residual_multiplier', 1):g}", l=f"{m.get('logits_scaling', 1):g}")]
    if c.n_experts:
        out.append(say(WORDS, "experts", e=c.n_experts, w=f"{c.expert_ffn_dim:,}",
                       top=plural(c.n_experts_used, "expert"), k=c.n_experts_used, f=f"{c.ffn_dim:,}"))
    else:
        out.append(say(WORDS, "shared_only", f=f"{c.ffn_dim:,}"))
    return out


FAMILY = Family(
    name="granite_hybrid",
    title="Granite 4.0-H",
    model=GraniteHybrid,
    hf_types={"granitemoehybrid": "GraniteMoeHybridForCausalLM"},
    gguf_archs={"granitehybrid": True},  # the converter permutes the attention layers' q/k rows, as Llama's
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
)
