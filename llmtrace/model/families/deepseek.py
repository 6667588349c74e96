"""DeepSeek V2 and V3: multi-head latent attention (model/kinds/mla.py) and a mixture of experts with shared experts
(model/moe.py), as transformers' DeepseekV2ForCausalLM and DeepseekV3ForCausalLM compute them:

  - attention through a cached low-rank latent: q directly (V2-Lite) or through a code of q_lora_rank (V3); the latent
    c_kv (kv_lora_rank) and one RoPE key k_pe (qk_rope_head_dim) shared by all heads are all a layer keeps per token;
    each head's k_nope and v are up-projected from every cached latent at each step; scale 1/√(qk_nope + qk_rope),
    × YaRN's mscale² where the config sets mscale_all_dim; RoPE on adjacent pairs of the rope dims;
  - the feed-forward: the first `first_k_dense_replace` layers a dense SwiGLU; the others `n_routed_experts` routed
    SwiGLU experts (K chosen per token) plus `n_shared_experts` shared ones every token runs (one SwiGLU of
    n_shared · moe_intermediate_size);
  - V2's router: softmax, the top K (within the best topk_group of n_group groups, a group's score its best expert,
    where topk_method is group_limited_greedy), weights × routed_scaling_factor, never renormalised (transformers
    5.25's V2 ignores norm_topk_prob);
  - V3's router: sigmoid scores; a correction bias added to them to choose (not to weigh); the choice within the best
    topk_group of n_group groups (a group's score: the sum of its best two); the chosen scores renormalised when
    norm_topk_prob, × routed_scaling_factor.

From a GGUF (arch `deepseek2`, llama.cpp's converter): W_kb and W_vb are stored apart (the converter splits kv_b_proj
for the absorbed form); the router is sigmoid where the file says expert_gating_func 2 (else softmax, llama.cpp's
default), groups score by their best two whatever the version (llama.cpp's one rule), and the weights are renormalised
where expert_weights_norm says so; YaRN's score factor is (1 + rope.scaling.yarn_log_mul · ln factor)², llama.cpp's.
Such a file computes what llama.cpp computes.
"""

from __future__ import annotations

import math

from llmtrace.errors import LlmtraceError
from llmtrace.model.families.gpt_oss import YARN_KEYS, yarn_attention_factor
from llmtrace.model.family import Family, say
from llmtrace.model.kinds.mla import MLA, yarn_mscale
from llmtrace.model.maths import LayerPlan
from llmtrace.model.moe import MoEBlock, SharedExpertsMoE, moe_fields
from llmtrace.model.transformer import FeedForward, Transformer, rope_angles
from llmtrace.units import plural


class DeepseekBlock(MoEBlock):
    attention = MLA
    feed_forward = SharedExpertsMoE
    dense_feed_forward = FeedForward

    def plan(self, config, rope) -> LayerPlan:
        """Llama's plan with the attention named by its kind: MLA."""
        p = super().plan(config, rope)
        return LayerPlan(MLA.KIND, None, p.rope, p.ffn, p.experts)


class Deepseek(Transformer):
    block = DeepseekBlock

    @property
    def attention_factor(self) -> float:
        """cos and sin × this: YaRN's, 1 without it."""
        return yarn_attention_factor(self.config.rope_scaling)

    def rope_plan(self, layer: int):
        plan = super().rope_plan(layer)
        return None if plan is None else plan | {"attention_factor": self.attention_factor}

    def rope_tables(self, positions, dtype):
        cos, sin = rope_angles(self.inv_freq, positions)
        cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return {"global": (cos.to(dtype), sin.to(dtype)) if dtype is not None else (cos, sin), "none": (None, None)}


# ----------------------------------------------------------------------------------------------------------------
# reading a config


def _whole(value, key: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < least:
        raise LlmtraceError(f"the checkpoint's {key} is {value!r}; DeepSeek's attention needs a whole number ≥ {least}")
    return int(value)


def _parts(H: int, rq, r, nope, rope, v, scale_factor: float, pairs: str, router: dict, n_shared: int,
           expert_width: int) -> dict:
    rq = None if rq in (None, 0) else _whole(rq, "q_lora_rank")
    r, nope, rope, v = (_whole(x, k) for x, k in ((r, "kv_lora_rank"), (nope, "qk_nope_head_dim"),
                                                  (rope, "qk_rope_head_dim"), (v, "v_head_dim")))
    if rope % 2:
        raise LlmtraceError(f"qk_rope_head_dim {rope} is odd; RoPE turns pairs of dims")
    if n_shared < 1:
        raise LlmtraceError("n_shared_experts is 0; llmtrace runs DeepSeek's MoE with its shared experts")
    axes = {"R": r, "Dn": nope, "Dr": rope, "Dq": nope + rope, "Dv": v} | ({"Rq": rq} if rq else {})
    mla = {"q_lora_rank": rq, "kv_lora_rank": r, "nope": nope, "rope": rope, "v": v, "pairs": pairs,
           "scale": (nope + rope) ** -0.5 * scale_factor,
           "scale_label": "1/√Dq" + (f" × mscale² ({scale_factor:.4g})" if scale_factor != 1.0 else ""), "axes": axes}
    return {"mla": mla, "router": router, "shared_experts": {"n": n_shared, "axes": {"Fs": n_shared * expert_width}}}


def _groups(n_experts: int, groups, used, key: str) -> tuple[int, int]:
    groups, used = int(groups or 1), int(used or 1)
    if groups < 1 or n_experts % groups or not 1 <= used <= groups:
        raise LlmtraceError(f"{key}: {groups} groups of {n_experts} experts, {used} kept, is not a grouping llmtrace "
                            f"can run (the groups must divide the experts, and 1 ≤ kept ≤ groups)")
    return groups, used


def hf_config(cfg: dict) -> dict:
    v3 = cfg.get("model_type") == "deepseek_v3"
    H = int(cfg["num_attention_heads"])
    rope = dict(cfg.get("rope_parameters") or {}) | dict(cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise LlmtraceError(f"rope type {kind!r} is not what llmtrace runs for DeepSeek (yarn, or none)")
    scaling = ({"rope_type": "yarn"} | {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
               if kind == "yarn" else None)
    scale_factor = 1.0
    if scaling and scaling.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        scale_factor = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    n_routed = cfg.get("n_routed_experts")
    fields = moe_fields(n_routed, "n_routed_experts", cfg.get("num_experts_per_tok"), "num_experts_per_tok")
    E = fields["n_experts"]
    if v3:
        groups, used = _groups(E, cfg.get("n_group"), cfg.get("topk_group"), "n_group/topk_group")
        router = {"score": "sigmoid", "choice_bias": True, "groups": groups, "groups_used": used,
                  "group_score": "top2_sum", "scale": float(cfg.get("routed_scaling_factor", 2.5))}
        renormalise = bool(cfg.get("norm_topk_prob", True))
        pairs = "adjacent" if cfg.get("rope_interleave", True) else "halves"
    else:
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise LlmtraceError(f"topk_method {method!r} is not what transformers runs for DeepSeek V2 (greedy, "
                                f"group_limited_greedy)")
        groups, used = (_groups(E, cfg.get("n_group"), cfg.get("topk_group"), "n_group/topk_group")
                        if method == "group_limited_greedy" else (1, 1))
        router = {"score": "softmax", "groups": groups, "groups_used": used, "group_score": "max",
                  "scale": float(cfg.get("routed_scaling_factor", 1.0))}
        renormalise, pairs = False, "adjacent"
    width = int(cfg.get("moe_intermediate_size", 1407))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    n = int(cfg["num_hidden_layers"])
    return fields | {
        "head_dim": int(cfg.get("qk_rope_head_dim", 64)), "n_kv_heads": H, "rotary_dim": None,
        "expert_ffn_dim": width, "norm_topk_prob": renormalise, "rope_scaling": scaling,
        "dense_layers": list(range(min(first_dense, n))) or None,
        "parts": _parts(H, cfg.get("q_lora_rank"), cfg.get("kv_lora_rank", 512), cfg.get("qk_nope_head_dim", 128),
                        cfg.get("qk_rope_head_dim", 64), cfg.get("v_head_dim", 128), scale_factor, pairs, router,
                        int(cfg.get("n_shared_experts") or 0), width)}


def gguf_config(meta) -> dict:
    H = int(meta("attention.head_count"))
    rope = int(meta("rope.dimension_count") or 64)
    qk = meta("attention.key_length_mla")
    if qk is None or meta("attention.kv_lora_rank") is None:
        raise LlmtraceError("GGUF metadata lacks deepseek2.attention.key_length_mla or kv_lora_rank (a file from an "
                            "older converter, without MLA's sizes); convert the checkpoint again")
    fields = moe_fields(meta("expert_count"), "expert_count", meta("expert_used_count"), "expert_used_count")
    E = fields["n_experts"]
    groups, used = _groups(E, meta("expert_group_count"), meta("expert_group_used_count"), "expert_group_count")
    sigmoid = meta("expert_gating_func") == 2
    router = {"score": "sigmoid" if sigmoid else "softmax", "choice_bias": sigmoid, "groups": groups,
              "groups_used": used, "group_score": "top2_sum", "scale": float(meta("expert_weights_scale") or 1.0)}
    scaling, scale_factor = None, 1.0
    if meta("rope.scaling.type") == "yarn":
        factor = float(meta("rope.scaling.factor"))
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                   "beta_fast": float(meta("rope.scaling.yarn_beta_fast") or 32.0),
                   "beta_slow": float(meta("rope.scaling.yarn_beta_slow") or 1.0), "truncate": True,
                   "attention_factor": 1.0}  # llama.cpp's deepseek2 graph cancels YaRN's factor on cos and sin
        log_mul = float(meta("rope.scaling.yarn_log_multiplier") or 0.0)
        scale_factor = (1.0 + log_mul * math.log(factor)) ** 2 if factor > 1 else 1.0
    elif meta("rope.scaling.type") not in (None, "none"):
        raise LlmtraceError(f"rope scaling {meta('rope.scaling.type')!r} is not what llmtrace runs for DeepSeek")
    width = int(meta("expert_feed_forward_length"))
    n = int(meta("block_count"))
    return fields | {
        "head_dim": rope, "n_kv_heads": H, "rotary_dim": None, "expert_ffn_dim": width,
        "norm_topk_prob": bool(meta("expert_weights_norm")), "rope_scaling": scaling,
        "dense_layers": list(range(min(int(meta("leading_dense_block_count") or 0), n))) or None,
        "parts": _parts(H, meta("attention.q_lora_rank"), meta("attention.kv_lora_rank"), int(qk) - rope, rope,
                        meta("attention.value_length_mla"), scale_factor, "adjacent", router,
                        int(meta("expert_shared_count") or 0), width)}


# What DeepSeek changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "mla_code": ("multi-head latent attention: q through a code of {rq} (RMS-normed); K and V up-projected from a "
                 "cached latent of {r} and one RoPE key of {dr} shared by the {h} heads; each head's key {dn} + {dr} "
                 "dims, value {dv}",
                 "多头潜在注意力（MLA）：q 先经过宽 {rq} 的低秩编码（做 RMSNorm）；K 和 V 由缓存中宽 {r} 的潜变量上投影"
                 "得到，另有一个 {dr} 维的 RoPE 键由 {h} 个头共享；每个头的键 {dn} + {dr} 维，值 {dv} 维"),
    "mla_direct": ("multi-head latent attention: q projected directly; K and V up-projected from a cached latent of "
                   "{r} and one RoPE key of {dr} shared by the {h} heads; each head's key {dn} + {dr} dims, value {dv}",
                   "多头潜在注意力（MLA）：q 直接投影得到；K 和 V 由缓存中宽 {r} 的潜变量上投影得到，另有一个 {dr} 维的 "
                   "RoPE 键由 {h} 个头共享；每个头的键 {dn} + {dr} 维，值 {dv} 维"),
    "latent_cache": ("the cache keeps {latent} numbers a token a layer, where multi-head attention with these heads "
                     "would keep {mha} ({x}×); llmtrace up-projects K and V from the latent at every step, as "
                     "transformers does (the absorbed form folds W_kb into q and W_vb into W_o)",
                     "KV 缓存每层每个词元只存 {latent} 个数，同样头数的多头注意力要存 {mha} 个（{x} 倍）；llmtrace 与 "
                     "transformers 一样，每一步都由潜变量上投影出 K 和 V（吸收形式把 W_kb 并入 q、把 W_vb 并入 W_o）"),
    "scale_adjacent": ("scores scaled by {s} ({label}); RoPE on adjacent pairs of the rope dims",
                       "分数 × {s}（{label}）；RoPE 作用在 rope 维度中相邻的两维一对上"),
    "scale_halves": ("scores scaled by {s} ({label}); RoPE on the halves of the rope dims",
                     "分数 × {s}（{label}）；RoPE 把 rope 维度的前一半与后一半配成对"),
    "yarn": ("YaRN RoPE: factor {f} over an original context of {L}", "YaRN RoPE：在 {L} 的原始上下文上放大 {f} 倍"),
    "dense_one": ("the first layer of {n} keeps a dense SwiGLU (width {f})",
                  "{n} 层中的第一层保留稠密的 SwiGLU 前馈网络（宽 {f}）"),
    "dense_some": ("the first {k} layers of {n} keep a dense SwiGLU (width {f})",
                   "{n} 层中的前 {k} 层保留稠密的 SwiGLU 前馈网络（宽 {f}）"),
}

# the routed experts' line, one key per router: how it scores (a choice bias or not), whether it groups the experts,
# whether it renormalises the chosen weights; each part in both languages
_SCORES = {"bias": ("sigmoid scores, chosen by score + a correction bias (the bias chooses, the score weighs)",
                    "按 sigmoid 分数取最高的，选时分数加上校正偏置（偏置决定选谁，分数决定权重）"),
           "sigmoid": ("sigmoid scores", "按 sigmoid 分数取最高的"),
           "softmax": ("softmax scores", "按 softmax 分数取最高的")}
_GROUPS = {"grouped": (", within the best {gu} of {g} groups of experts", "，只在 {g} 组专家中最好的 {gu} 组里选"),
           "all": ("", "")}
_WEIGHTS = {"renorm": ("renormalised to sum to 1", "重新归一化为和 1"), "raw": ("not renormalised", "不重新归一化")}
WORDS |= {f"experts_{s}_{g}_{w}": (
    "feed-forward: {e} routed SwiGLU experts (width {fe}), each token's top {top} by " + s_en + g_en + "; weights "
    + w_en + ", × {scale}; plus {shared} (one SwiGLU of width {fs}) every token runs",
    "前馈网络：{e} 个路由 SwiGLU 专家（宽 {fe}），每个词元运行其中 {k} 个：" + s_zh + g_zh + "；权重" + w_zh
    + "，再 × {scale}；另有 {n} 个共享专家（合成一个宽 {fs} 的 SwiGLU），每个词元都运行")
    for s, (s_en, s_zh) in _SCORES.items() for g, (g_en, g_zh) in _GROUPS.items()
    for w, (w_en, w_zh) in _WEIGHTS.items()}


def changes(c) -> list[str]:
    m, r, s = c.parts["mla"], c.parts["router"], c.parts["shared_experts"]
    H = c.n_heads
    latent, mha = m["kv_lora_rank"] + m["rope"], H * (m["nope"] + m["rope"] + m["v"])
    sizes = dict(r=f"{m['kv_lora_rank']:,}", dr=m["rope"], h=H, dn=m["nope"], dv=m["v"])
    out = [say(WORDS, "mla_code", rq=f"{m['q_lora_rank']:,}", **sizes) if m["q_lora_rank"] else
           say(WORDS, "mla_direct", **sizes),
           say(WORDS, "latent_cache", latent=f"{latent:,}", mha=f"{mha:,}", x=f"{mha / latent:.1f}"),
           say(WORDS, "scale_adjacent" if m["pairs"] == "adjacent" else "scale_halves", s=f"{m['scale']:.4g}",
               label=m["scale_label"])]
    if c.rope_scaling:
        out.append(say(WORDS, "yarn", f=f"{c.rope_scaling['factor']:g}",
                       L=f"{c.rope_scaling['original_max_position_embeddings']:,}"))
    E, K, Fe = c.n_experts, c.n_experts_used, c.expert_ffn_dim
    score = "bias" if r.get("choice_bias") else r["score"]
    grouped = "grouped" if r.get("groups", 1) > 1 else "all"
    key = f"experts_{score}_{grouped}_{'renorm' if c.norm_topk_prob else 'raw'}"
    out.append(say(WORDS, key, e=E, fe=f"{Fe:,}", top=plural(K, "expert"), k=K, g=r.get("groups", 1),
                   gu=r.get("groups_used", 1), scale=f"{r.get('scale', 1.0):g}", shared=plural(s["n"], "shared expert"),
                   n=s["n"], fs=f"{s['axes']['Fs']:,}"))
    dense = c.dense_layers or []
    if dense:
        out.append(say(WORDS, "dense_one" if len(dense) == 1 else "dense_some", k=len(dense), n=c.n_layers,
                       f=f"{c.ffn_dim:,}"))
    return out


FAMILY = Family(
    name="deepseek",
    title="DeepSeek V2/V3",
    model=Deepseek,
    hf_types={"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"},
    gguf_archs={"deepseek2": False},  # the converter keeps q/k rows as HF holds them (llama.cpp turns adjacent pairs)
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
    reads_rope=True,
)
