"""Multi-head latent attention (MLA, DeepSeek V2/V3): attention whose memory is a low-rank latent, not K and V.

Notation as in model/transformer.py, plus
    R   kv_lora_rank: the latent's width          Rq  q_lora_rank: the query's low-rank code (V3; none in V2-Lite)
    Dn  qk_nope_head_dim: a head's key/query dims without position
    Dr  qk_rope_head_dim: the decoupled RoPE dims, one key shared by every head
    Dq  Dn + Dr: a query head's width             Dv  v_head_dim: a value head's width

For each token x (the attn_norm output):
    q        = x·W_qᵀ, or RMSNorm(x·W_qaᵀ)·W_qbᵀ       (H, Dq): each head's q_nope (Dn) then q_pe (Dr)
    [c, k_pe] = x·W_dkvᵀ                              c (R): the latent; k_pe (Dr): one RoPE key for all heads
    c_kv     = RMSNorm(c)                             what the cache keeps, with k_pe after RoPE
    q_rope, k_rope = RoPE(q_pe), RoPE(k_pe)           adjacent pairs (x_2i, x_2i+1) turned by pos·θ_i (DeepSeek's
                                                      layout; llama.cpp's too; a V3 config with rope_interleave
                                                      false turns halves, as Llama does)
  over every cached slot s (this pass's and the earlier ones'):
    k_nope_h = c_kv,s · W_kb,h      (Dn)             each head's key, up-projected from the latent
    v_h      = c_kv,s · W_vb,hᵀ     (Dv)             each head's value, likewise
    score    = (q_nope,h · k_nope,h + q_rope,h · k_rope) · scale,  scale = 1/√Dq (× YaRN's mscale² where set)
    o_h      = softmax(score) · v_h;  out = concat(o_h)·W_oᵀ

The form llmtrace runs is transformers': cache c_kv and k_rope (R + Dr numbers a token a layer), and up-project K
and V from every cached latent at every step. The absorbed form (DeepSeek's inference code, llama.cpp) computes the
same scores without K: q_nope,h · (W_kb,h c) = (W_kb,hᵀ q_nope,h) · c, so each query is mapped into the latent
space once (R numbers per head) and scored against the cached latents directly; and since P·(c W_vb,hᵀ) =
(P·c) W_vb,hᵀ, the heads' outputs are read from the latent and W_vb,h folds into W_o. It saves the up-projection of
every slot at every step (the cost that grows with the context) at the price of wider queries; the numbers agree to
rounding. llama.cpp's converter splits kv_b_proj into W_kb (stored (H, R, Dn), the absorbed layout) and W_vb
((H, Dv, R)) for it; this module holds them in those layouts and reads an HF kv_b_proj through load transforms.

Memory: c_kv (R) and k_rope (Dr) per token per layer, against H·(Dq + Dv) for full multi-head attention with the
same heads (model.memory); the cache hands the layer a LayerSlots whose update writes both.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.llama_points import ATTN_OUT, O_PROJ, PROBS, SCORES
from llmtrace.model.maths import LayerPlan, Op, OpKind, cached_words, declare, op, weight_name
from llmtrace.model.ops import masked
from llmtrace.model.memory import Memory
from llmtrace.model.points import Point, Source, Weight
from llmtrace.model.transformer import LayerInput, Module, RMSNorm, apply_rope
from llmtrace.model.recompute import declared_weight
from llmtrace.units import sig6, sig6_rows

KIND = "mla"

Q_A = Point("q_a", "s6.1", ("T", "Rq"), about="X·W_qa: the query's low-rank code (q_lora_rank)")
Q_A_NORM = Point("q_a_norm", "s6.1", ("T", "Rq"), about="RMSNorm of the query's code", input="q_a")
Q_MLA = Point("q", "s6.1/s6.2", ("T", "H", "Dq"), about="queries, split into heads: each head's q_nope then q_pe")
Q_NOPE = Point("q_nope", "s6.2", ("T", "H", "Dn"), about="each head's query dims without position", input="q")
Q_PE = Point("q_pe", "s6.2", ("T", "H", "Dr"), about="each head's decoupled RoPE query dims", input="q")
KV_LATENT = Point("kv_latent", "s6.1", ("T", "R"), about="X·W_dkv's first R rows: the latent before its norm")
K_PE = Point("k_pe", "s6.1", ("T", "Dr"), about="X·W_dkv's last Dr rows: one RoPE key shared by every head")
C_KV = Point("c_kv", "s6.2", ("T", "R"), editable=True, input="kv_latent",
             about="the latent, RMS-normed: what the cache keeps for this token (with k_rope)")
Q_ROPE = Point("q_rope", "s6.3", ("T", "H", "Dr"), about="q_pe rotated by the token's position", input="q_pe")
K_ROPE = Point("k_rope", "s6.3", ("T", "Dr"), about="k_pe rotated by the token's position: cached", input="k_pe")
LATENT_WRITE = Point("latent_write", "s6.8", ("T",), stored=False, about="the cache slots this pass writes")
K_NOPE = Point("k_nope", "s6.4", ("S", "H", "Dn"), about="each head's keys up-projected from every cached latent")
V_UP = Point("v_up", "s6.5", ("S", "H", "Dv"), about="each head's values up-projected from every cached latent")
MLA_SCORES = replace(SCORES, about="(q_nope·k_nopeᵀ + q_rope·k_ropeᵀ)·scale, masked keys at -inf")
MLA_OUT = replace(ATTN_OUT, axes=("T", "H", "Dv"))

# what a learner reads at each seed step of an MLA layer (model.kinds: HEADINGS)
HEADINGS = {
    "s6.1": ("down-projections: q, the latent and the shared RoPE key", "降维投影：q、潜变量与共享 RoPE 键"),
    "s6.2": ("the latent normed; q split into heads", "潜变量归一化；q 分头"),
    "s6.3": ("RoPE on the decoupled q_pe and k_pe", "对解耦的 q_pe 与 k_pe 施加 RoPE"),
    "s6.4": ("keys up-projected from the latent; scores", "由潜变量上投影出键；注意力分数"),
    "s6.5": ("values up-projected; softmax, then P·V", "由潜变量上投影出值；softmax 与 P·V"),
    "s6.8": ("the latent and k_rope written to the cache", "潜变量与 k_rope 写入缓存"),
}


def mla_sizes(config) -> dict:
    """The config part an MLA layer reads (ModelConfig.parts["mla"])."""
    return config.parts["mla"]


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x_2i, x_2i+1), kept in place: x (..., Dr); cos, sin broadcastable to (..., Dr/2)."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


class HeadMatrices(nn.Module):
    """H matrices (H, out, in), one a head, used as model.moe.ExpertMatrices is (y = x W_hᵀ), so that a kept-
    quantized stack (model.quant.QuantExperts) fits in its place."""

    def __init__(self, n: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))  # (H, out, in)

    def forward(self, x: torch.Tensor, h: int) -> torch.Tensor:
        return F.linear(x, self.weight[h])


def _stack(m: nn.Module) -> torch.Tensor:
    """The (H, out, in) values of a HeadMatrices, or of a module that holds them in blocks in its place
    (--keep-quantized, --fast: read one head at a time through its call, W_h = (I · W_hᵀ)ᵀ)."""
    if isinstance(m, HeadMatrices):
        return m.weight
    stand_in = m.weight  # (H, out, in) of the run's dtype and device, holding no data
    eye = torch.eye(stand_in.size(2), dtype=stand_in.dtype, device=stand_in.device)
    return torch.stack([m(eye, h).T for h in range(stand_in.size(0))])


class MLA(Module):
    """Multi-head latent attention (module docstring): the latent and the RoPE key are cached; K and V are
    up-projected from every cached latent at each step."""

    KIND = KIND
    HEADINGS = HEADINGS
    WHERE = "attn"
    POINTS = (Q_A, Q_A_NORM, Q_MLA, Q_NOPE, Q_PE, KV_LATENT, K_PE, C_KV, Q_ROPE, K_ROPE, LATENT_WRITE, K_NOPE, V_UP,
              MLA_SCORES, PROBS, MLA_OUT, O_PROJ)
    NORMS = {Q_A_NORM.name: "q_norm", C_KV.name: "kv_norm"}
    OPTIONAL = (Q_A.name, Q_A_NORM.name)  # reported only where the config has a q_lora_rank (V3; not V2-Lite)
    HEADS = (MLA_OUT.name, "wo")  # its output splits by head, as attention's (model.wiring)

    def __init__(self, config):
        super().__init__()
        m = mla_sizes(config)
        self.n_heads = H = config.n_heads
        self.rq, self.r, self.dn, self.dr, self.dv = m["q_lora_rank"], m["kv_lora_rank"], m["nope"], m["rope"], m["v"]
        self.dq = self.dn + self.dr
        self.pairs = m.get("pairs", "adjacent")  # how RoPE pairs the Dr dims
        self.scale = m["scale"]
        self.scale_label = m.get("scale_label", "1/√Dq")
        self.attn_bias = bool(config.attn_bias)
        D, eps = config.d_model, m.get("norm_eps", config.rms_eps)
        if self.rq:
            self.w_qa = nn.Linear(D, self.rq, bias=self.attn_bias)  # (Rq, D)
            self.q_norm = RMSNorm(self.rq, eps, axis="Rq")
            self.w_qb = nn.Linear(self.rq, H * self.dq, bias=False)  # (H·Dq, Rq)
        else:
            self.wq = nn.Linear(D, H * self.dq, bias=False)  # (H·Dq, D)
        self.w_dkv = nn.Linear(D, self.r + self.dr, bias=self.attn_bias)  # (R + Dr, D): W_dkv, the latent and k_pe
        self.kv_norm = RMSNorm(self.r, eps, axis="R", step="s6.2")
        self.w_kb = HeadMatrices(H, self.r, self.dn)  # (H, R, Dn): k_nope,h = c · W_kb,h
        self.w_vb = HeadMatrices(H, self.dv, self.r)  # (H, Dv, R): v_h = c · W_vb,hᵀ
        self.wo = nn.Linear(H * self.dv, D, bias=self.attn_bias)  # (D, H·Dv)
        self.CHILDREN = ({"q_norm": ("q_a_layernorm", "attn_q_a_norm")} if self.rq else {}) | {
            "kv_norm": ("kv_a_layernorm", "attn_kv_a_norm")}

    # -- declarations ------------------------------------------------------------------------------------------

    def weights(self) -> tuple[Weight, ...]:
        H, dn, dv = self.n_heads, self.dn, self.dv
        bias = lambda name, hf, gg, rows: ((Weight(name, (rows,), "s6.1", "vector",  # noqa: E731
                                                   (Source(hf, gg, rows, "b"),)),) if self.attn_bias else ())
        if self.rq:
            q = (Weight("w_qa.weight", ("Rq", "D"), "s6.1", "matrix", (Source("q_a_proj.weight", "attn_q_a.weight",
                                                                            "Rq", "W_qa"),)),
                 *bias("w_qa.bias", "q_a_proj.bias", "attn_q_a.bias", "Rq"),
                 Weight("w_qb.weight", ("H*Dq", "Rq"), "s6.1", "matrix", (Source("q_b_proj.weight", "attn_q_b.weight",
                                                                               "H*Dq", "W_qb"),)))
        else:
            q = (Weight("wq.weight", ("H*Dq", "D"), "s6.1", "matrix",
                        (Source("q_proj.weight", "attn_q.weight", "H*Dq", "Wq"),)),)
        return (*q,
                Weight("w_dkv.weight", ("R+Dr", "D"), "s6.1", "matrix",
                       (Source("kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight", "R+Dr", "W_dkv"),)),
                *bias("w_dkv.bias", "kv_a_proj_with_mqa.bias", "attn_kv_a_mqa.bias", "R+Dr"),
                # kv_b_proj holds, per head, Dn rows of W_kb then Dv rows of W_vb (HF); the GGUF splits them. Kind
                # "heads": a stack of H matrices, one a head, each used whole (not "experts": every token uses all)
                Weight("w_kb.weight", ("H", "R", "Dn"), "s6.4", "heads",
                       (Source("kv_b_proj.weight", "attn_k_b.weight", "H", "W_kb",
                               hf_transform=(f"head_rows:{H}:0:{dn}", "transpose")),)),
                Weight("w_vb.weight", ("H", "Dv", "R"), "s6.5", "heads",
                       (Source("kv_b_proj.weight", "attn_v_b.weight", "H", "W_vb",
                               hf_transform=(f"head_rows:{H}:{dn}:{dn + dv}",)),)),
                Weight("wo.weight", ("D", "H*Dv"), "s6.6", "matrix",
                       (Source("o_proj.weight", "attn_output.weight", "D", "Wo"),)),
                *bias("wo.bias", "o_proj.bias", "attn_output.bias", "D"))

    def memory(self) -> Memory:
        """s6.8 the latent and the rotated shared key, one entry a token; full MHA would keep every head's K and V."""
        return Memory("latent", per_token={"c_kv": (self.r,), "k_pe": (self.dr,)},
                      mha_per_token=self.n_heads * (self.dq + self.dv))

    EXPLAIN = ("latent_cache",)  # its cache beside MHA's and GQA's, the absorbed form on real numbers (below)

    def explain(self, key: str, cap, model, maths, head: Optional[int]) -> Optional[dict]:
        """explain's section `key` of this layer (one of EXPLAIN), from the pass's capture."""
        return latent_section(cap, model, maths, head if head is not None else 0)
    FLOPS_NOTE = ("the up-projection of every cached slot is paid at every pass, as llmtrace runs it; the absorbed "
                  "form folds W_kb into q and W_vb into the output and would not pay it",
                  "按 llmtrace 的运行方式，每次前向都要为每个缓存槽位付出上投影的代价；吸收形式把 W_kb 并入 q、把 W_vb "
                  "并入输出，就不必付出")

    def flops(self, n_tokens: int) -> list[tuple]:
        """Multiply-add FLOPs (2 a multiply-add) of a pass of n tokens from an empty cache, in the form llmtrace runs
        (the up-projection of every slot is paid at every pass; the absorbed form would not pay it), as rows."""
        n, H, D = n_tokens, self.n_heads, self.wo.out_features
        q = 2 * n * (D * self.rq + self.rq * H * self.dq) if self.rq else 2 * n * D * H * self.dq
        out = {"q": q, "latent": 2 * n * D * (self.r + self.dr), "up": 2 * n * self.r * H * (self.dn + self.dv),
               "scores": 2 * n * n * H * self.dq, "pv": 2 * n * n * H * self.dv, "o": 2 * n * H * self.dv * D}
        return [(k, *self.FLOP_WORDS[k], v) for k, v in out.items()]

    # how explain names each part of flops() and its formula (T tokens, from an empty cache)
    FLOP_WORDS = {"q": (("query projections", "查询投影"), "2·T·D·H·Dq, or 2·T·(D·Rq + Rq·H·Dq)"),
                  "latent": (("the latent and k_pe", "潜变量与 k_pe"), "2·T·D·(R + Dr)"),
                  "up": (("K and V up-projected", "K 和 V 的上投影"), "2·T·R·H·(Dn + Dv)"),
                  "scores": (("scores", "分数"), "2·H·T·T·Dq"),
                  "pv": (("weighted sum P·V", "加权求和 P·V"), "2·H·T·T·Dv"),
                  "o": (("output projection", "输出投影"), "2·T·H·Dv·D")}

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Each point's operation; the cached latent and k_rope span every slot (`cached`)."""
        H, dn, dq, r = self.n_heads, self.dn, self.dq, self.r
        rope = dict(plan.rope, pairs=self.pairs) if plan.rope else {"rotation": "none"}
        out: dict[str, Op] = {}
        if self.rq:
            out[Q_A.name] = op("matmul", [x], ["w_qa.weight"] + (["w_qa.bias"] if self.attn_bias else []))
            out[Q_A_NORM.name] = self.q_norm.op(Q_A.name, "q_norm.")
            out[Q_MLA.name] = op("matmul", [Q_A_NORM.name], ["w_qb.weight"], split="H")
        else:
            out[Q_MLA.name] = op("matmul", [x], ["wq.weight"], split="H")
        dkv = ["w_dkv.weight"] + (["w_dkv.bias"] if self.attn_bias else [])
        return out | {
            Q_NOPE.name: op("slice", [Q_MLA.name], cols=[0, dn], split="H"),
            Q_PE.name: op("slice", [Q_MLA.name], cols=[dn, dq], split="H"),
            KV_LATENT.name: op("matmul", [x], dkv, rows=[0, r]),
            K_PE.name: op("matmul", [x], dkv, rows=[r, r + self.dr]),
            C_KV.name: self.kv_norm.op(KV_LATENT.name, "kv_norm."),
            Q_ROPE.name: op("rope", [Q_PE.name], **rope),
            K_ROPE.name: op("rope", [K_PE.name], **rope),
            LATENT_WRITE.name: op("cache_write", [C_KV.name, K_ROPE.name]),
            K_NOPE.name: op("latent_up", [C_KV.name], ["w_kb.weight"], stored="in_out", cached=[C_KV.name]),
            V_UP.name: op("latent_up", [C_KV.name], ["w_vb.weight"], stored="out_in", cached=[C_KV.name]),
            MLA_SCORES.name: op("mla_scores", [Q_NOPE.name, K_NOPE.name, Q_ROPE.name, K_ROPE.name], scale=self.scale,
                                scale_label=self.scale_label, softcap=None, mask="causal", window=None,
                                cached=[K_ROPE.name]),
            PROBS.name: op("softmax", [MLA_SCORES.name], sink=None),
            MLA_OUT.name: op("weighted_sum", [PROBS.name, V_UP.name], group=1),
            O_PROJ.name: op("matmul", [MLA_OUT.name], ["wo.weight"] + (["wo.bias"] if self.attn_bias else []),
                            merge="H")}

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.n_heads
        q = self.query(x)  # s6.1, s6.2: (B, T, H, Dq)
        q_nope, q_pe = q.split_with_sizes([self.dn, self.dr], dim=-1)
        if self.hook is not None:
            self.point(Q_NOPE.name, q_nope)
            self.point(Q_PE.name, q_pe)
        latent, k_pe = self.w_dkv(x).split_with_sizes([self.r, self.dr], dim=-1)  # (B, T, R), (B, T, Dr)
        latent, k_pe = self.point(KV_LATENT.name, latent), self.point(K_PE.name, k_pe)
        c = self.point(C_KV.name, self.kv_norm(latent))  # (B, T, R): what the cache keeps
        q_pe, k_pe = self.rotate(q_pe, k_pe, io.cos, io.sin)  # s6.3
        if io.cache is not None:  # s6.8 write this pass's latent and key; read every filled slot's
            held = io.cache.update(io.start, c_kv=c, k_pe=k_pe)
            c, k_pe = held["c_kv"], held["k_pe"]  # (B, S, R), (B, S, Dr)
            if self.hook is not None:
                self.point(LATENT_WRITE.name, torch.arange(io.start, io.start + T))
        # s6.4, s6.5 every slot's keys and values, up-projected from its latent (transformers' form), head first
        k_nope = c[:, None] @ _stack(self.w_kb)  # (B, 1, S, R) @ (H, R, Dn) -> (B, H, S, Dn)
        v = c[:, None] @ _stack(self.w_vb).transpose(1, 2)  # (B, H, S, Dv)
        if self.hook is not None:
            k_nope = self.point(K_NOPE.name, k_nope.transpose(1, 2)).transpose(1, 2)  # reported as (B, S, H, Dn)
            v = self.point(V_UP.name, v.transpose(1, 2)).transpose(1, 2)
            y = self.attend_spelled_out(q_nope, q_pe, k_nope, k_pe, v, io.mask)
        else:
            S = c.size(1)
            qh = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # (B, H, T, Dq)
            kh = torch.cat([k_nope, k_pe[:, None].expand(B, H, S, self.dr)], dim=-1)  # (B, H, S, Dq)
            y = F.scaled_dot_product_attention(qh, kh, v, attn_mask=io.mask, scale=self.scale)
        y = self.point(MLA_OUT.name, y.transpose(1, 2))  # (B, T, H, Dv)
        return self.point(O_PROJ.name, self.wo(y.reshape(B, T, H * self.dv)))  # s6.6: (B, T, D)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """s6.1 q = x·W_qᵀ, or through the low-rank code RMSNorm(x·W_qaᵀ)·W_qbᵀ; s6.2 split into heads."""
        B, T, _ = x.shape
        if self.rq:
            qa = self.point(Q_A.name, self.w_qa(x))
            q = self.w_qb(self.point(Q_A_NORM.name, self.q_norm(qa)))
        else:
            q = self.wq(x)
        return self.point(Q_MLA.name, q.view(B, T, self.n_heads, self.dq))

    def rotate(self, q_pe, k_pe, cos, sin):
        """s6.3 RoPE on each head's q_pe (B, T, H, Dr) and the shared k_pe (B, T, Dr); none where the plan has none."""
        if cos is not None:
            if self.pairs == "adjacent":
                half = self.dr // 2
                c, s = cos[..., :half].to(q_pe.dtype), sin[..., :half].to(q_pe.dtype)  # (T, Dr/2) or (B, T, Dr/2)
                pe = torch.cat([q_pe, k_pe.unsqueeze(-2)], dim=-2)  # (B, T, H + 1, Dr): the heads' q_pe, then k_pe
                pe = rotate_pairs(pe, c.unsqueeze(-2), s.unsqueeze(-2))  # one rotation for both (elementwise: the same)
                q_pe, k_pe = pe[..., :-1, :], pe[..., -1, :]
            else:
                q_pe = apply_rope(q_pe, cos, sin)
                k_pe = apply_rope(k_pe[:, :, None], cos, sin)[:, :, 0]
        return self.point(Q_ROPE.name, q_pe), self.point(K_ROPE.name, k_pe)

    def attend_spelled_out(self, q_nope, q_pe, k_nope, k_pe, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax((q_nope·k_nopeᵀ + q_rope·k_ropeᵀ)·scale + mask)·V, step by step: q_nope (B, T, H, Dn), q_pe
        (B, T, H, Dr), k_nope (B, H, S, Dn), k_pe (B, S, Dr), v (B, H, S, Dv) -> (B, H, T, Dv)."""
        scores = (q_nope.transpose(1, 2) @ k_nope.transpose(-2, -1)
                  + q_pe.transpose(1, 2) @ k_pe[:, None].transpose(-2, -1)) * self.scale  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        scores = self.point(MLA_SCORES.name, scores)
        probs = self.point(PROBS.name, F.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype))
        return probs @ v  # (B, H, T, Dv)


def yarn_mscale(factor: float, m: float) -> float:
    """YaRN's mscale: 0.1·m·ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


# -- its operations (model.maths.OpKind): each formula line with its words, and its float64 evaluator ------------


def _latent_up(o, x, w, shape, **_):
    c = x[0]  # (B, S, R): every cached latent
    if o.const("stored") == "out_in":  # W_h (out, R): y = c · W_hᵀ
        return torch.einsum("bsr,hor->bsho", c, w[0])
    return torch.einsum("bsr,hro->bsho", c, w[0])  # W_h (R, out): y = c · W_h


def _scores(o, x, w, shape, padding=None, **_):
    q_nope, k_nope, q_rope, k_rope = x  # (B, T, H, Dn), (B, S, H, Dn), (B, T, H, Dr), (B, S, Dr)
    s = (torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_rope, k_rope))
    return masked(o, s * o.const("scale"), padding)


declare(
    __name__,
    OpKind("latent_up", "y_h = c · W_h",
           lambda o, name, x, c, say: say("latent_up", name=name, c=cached_words(c, x[0], say), w=weight_name(o),
                                          t="ᵀ" if c.get("stored") == "out_in" else ""),
           {"latent_up": ("{name}_h = {c} · {w}_h{t}, per head", "{name}_h = {c} · {w}_h{t}，按头计算")}, _latent_up),
    OpKind("mla_scores", "s = (q_nope · k_nopeᵀ + q_rope · k_ropeᵀ) · scale",
           lambda o, name, x, c, say: (f"{name} = ({x[0]} · {x[1]}ᵀ + {x[2]} · {cached_words(c, x[3], say)}ᵀ) · "
                                       f"{c['scale']:.4g} ({c['scale_label']})" + (say("mask") if c.get("mask") else "")),
           {}, _scores),
)


# ----------------------------------------------------------------------------------------------------------------
# explain's own section of an MLA layer ("latent_cache", its EXPLAIN key; run.explain calls MLA.explain)
#
# explain on a multi-head latent attention layer (model.kinds.mla: DeepSeek V2/V3), beside its steps table: what
# its cache keeps per token against MHA and GQA with the same heads, and why the up-projection can be absorbed, worked
# on the pass's own numbers.
#
# For query head h at the last token t and every slot s (notation of model/kinds/mla.py):
#     up-projected (what llmtrace runs, as transformers):   k_nope,h,s = c_s · W_kb,h      score_s = q_nope,h · k_nope,h,s
#     absorbed (DeepSeek's inference code, llama.cpp):      q̃_h = W_kb,h q_nope,h (R)     score_s = q̃_h · c_s
# and for the output, with P the softmax row of head h:
#     up-projected:  o_h = Σ_s P_s (c_s W_vb,hᵀ)          absorbed:  o_h = (Σ_s P_s c_s) W_vb,hᵀ
# each side in float64 from the captured latents c_kv and queries q_nope and the layer's own W_kb, W_vb; the output
# beside the value the pass computed. The cost per decode step: the up-projection of every cached slot, against one
# query mapped into the latent space and one output mapped out of it.

SHOWN = 6  # slots and dims shown


def cache_rows(n_heads: int, width: int, element_size: int) -> list[dict]:
    """What a layer would cache per token with G KV heads of K and V `width` numbers together, G = H, H/2, ..., 1
    (MHA at G = H, GQA below, MQA at 1)."""
    out, g = [], n_heads
    while g >= 1:
        out.append({"kv_heads": g, "numbers": g * width, "bytes": g * width * element_size})
        if g % 2:
            break
        g //= 2
    if out[-1]["kv_heads"] != 1:
        out.append({"kv_heads": 1, "numbers": width, "bytes": width * element_size})
    return out


def latent_section(cap, model, maths, head: int = 0) -> dict:
    """The MLA layer's memory and its absorbed form, worked for one head at the last token (module docstring)."""
    layer = cap.layer
    mla = model.attention_of(layer)
    H, R, Dr, Dn, Dv = mla.n_heads, mla.r, mla.dr, mla.dn, mla.dv
    es = cap.kv_element_size
    out = {"event": "explain", "section": "latent_cache", "layer": layer, "seed_step": "s6.4-s6.5", "head": head,
           "sizes": {"H": H, "R": R, "Dr": Dr, "Dn": Dn, "Dv": Dv}, "element_size": es,
           "latent_numbers": R + Dr, "latent_bytes": (R + Dr) * es,
           "cache_rows": cache_rows(H, Dn + Dr + Dv, es), "form": "up_projected"}
    w_kb = declared_weight(model, layer, maths.op(layer, K_NOPE.name))  # (H, R, Dn)
    w_vb = declared_weight(model, layer, maths.op(layer, V_UP.name))  # (H, Dv, R)
    c, q = cap.points.get(C_KV.name), cap.points.get(Q_NOPE.name)
    if w_kb is None or w_vb is None or c is None or q is None:
        return out | {"worked": None}
    c, t = c.double().cpu(), len(cap.ids) - 1  # c (S, R): this pass's latents, every slot (the cache starts empty)
    S = c.size(0)
    qn = q[t, head].double().cpu()  # (Dn,)
    k_nope = c @ w_kb[head]  # (S, Dn): every slot's key, up-projected
    up = k_nope @ qn  # (S,) the position-free half of the scores, up-projected
    q_latent = w_kb[head] @ qn  # (R,) the query mapped into the latent space once
    absorbed = c @ q_latent  # (S,)
    p = cap.points[PROBS.name][head, t].double().cpu()  # (S,) the pass's softmax row
    o_up = p @ (c @ w_vb[head].T)  # (Dv,) every slot's value, up-projected, then weighted
    o_abs = (p @ c) @ w_vb[head].T  # (Dv,) the latents weighted first, then one up-projection
    o_pass = cap.points[MLA_OUT.name][t, head].double().cpu()  # (Dv,)
    return out | {"worked": {
        "position": t, "slots": S, "q_latent_width": R,
        "scores_up": sig6_rows(up[:SHOWN]), "scores_absorbed": sig6_rows(absorbed[:SHOWN]),
        "scores_diff": sig6((up - absorbed).abs().max()),
        "out_up": sig6_rows(o_up[:SHOWN]), "out_absorbed": sig6_rows(o_abs[:SHOWN]), "out_pass": sig6_rows(o_pass[:SHOWN]),
        "out_diff": sig6((o_up - o_abs).abs().max()), "out_pass_diff": sig6((o_up - o_pass).abs().max()),
        # multiply-adds × 2 of one decode step over S cached slots, for the up-projection and for the absorbed form
        "flops_up": 2 * S * R * H * (Dn + Dv), "flops_absorbed": 2 * H * R * (Dn + Dv)}}
