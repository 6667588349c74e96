"""The operation kinds every model uses, each declared once (model.maths.OpKind): its formula line with its words in
English and Chinese, and its float64 evaluator, written from the formula and not from the model's code.

A kind only one kind of layer uses is declared in that layer's file instead (model.kinds.mamba2, model.kinds.mla,
model.kinds.short_conv, model.families.qwen3_5's linear attention). Every evaluator reads `(o, x, w, shape, ...)`:
the operation, its operands' tensors in float64 (x), its weights' (w) and the point's shape; keywords `positions`
(RoPE) and `padding` (the mask). Tensors keep the batch axis, as a capture holds them: (B, T, ...).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from llmtrace.model.maths import (ACTIVATION, ROTATION, OpKind, carried_words, declare, glu_name, mask_words, number,
                                  weight_name)
from llmtrace.model.recompute import ACTS

# ----------------------------------------------------------------------------------------------------------------
# the stream, the embedding, a scale, a norm, a projection



# ----------------------------------------------------------------------------------------------------------------
# what a worked card reads beside the evaluated point (OpKind.kept, .dot, .aux; trace.cards calls them)

DOT_TERMS = 8  # a dot product's card shows its first 8 terms, and the sum of the others


def _gather(memo, key: tuple, make):
    """`make()`, kept in `memo` under `key` (weights are frozen: the rows one pass gathers are every pass's)."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _feature_rows(o, shape_last: int, features: torch.Tensor) -> torch.Tensor:
    """The rows of a matmul's weight that output features `features` read (its declared `rows` and `blocks`)."""
    f = features
    blocks = o.const("blocks")
    if blocks:  # each head's rows are n blocks of the output's width; this point is block i
        n, i = blocks
        f = (f // shape_last) * n * shape_last + i * shape_last + f % shape_last
    rows = o.const("rows")
    return f + rows[0] if rows is not None else f


def _terms(x: torch.Tensor, w: torch.Tensor, xg: int, bias, per_row: bool) -> dict:
    """y = Σ_j x_j·w_j (+ b) of every output row, told at its first entries j. x (B, input rows, D): each input row
    is read by `xg` output rows in turn; w (groups, D), cycled over the output rows (one weight row per group, the same
    in every pass), or with `per_row` (B, rows, D), a row's own (an expert's, as chosen). Kept: x and w at j (each
    input row and weight row once), the products at j and the sum of the other terms of every output row, the bias
    (like w)."""
    n, B = x.size(-1), x.size(0)
    j = list(range(min(DOT_TERMS, n)))
    xr = x.repeat_interleave(xg, dim=1)  # (B, rows, D)
    wr = w if per_row else w[None].repeat(B, xr.size(1) // w.size(0), 1)
    p = xr * wr
    shown = p[..., : len(j)]
    return {"j": j, "n": n, "xg": xg, "wg": wr.size(1) if per_row else w.size(0), "x": x[..., : len(j)],
            "w": w[..., : len(j)], "p": shown, "rest": p.sum(-1) - shown.sum(-1), "b": bias, "per_row": per_row}


def _matmul_kept(o, x, w, shape, index, memo=None):
    """The kept output entries (`index` along the last axis) from the weight rows they read only (gathered, then
    made float64): (B, ..., len(index))."""
    from dataclasses import replace

    from llmtrace.model.recompute import apply

    at = torch.tensor(index, device=w[0].device)
    a = x[0].flatten(-2) if o.const("merge") else x[0]
    lead = a.dim() - 1
    trailing = shape[lead:]  # the output's axes after the input's rows: (…, last)
    features = (torch.arange(math.prod(trailing[:-1]), device=at.device)[:, None] * shape[-1] + at[None])
    rows = _gather(memo, ("kept", id(o), id(w[0]), tuple(index), tuple(trailing)), lambda: [
        t[_feature_rows(o, shape[-1], features.reshape(-1))].cpu().double() for t in w[:2]])  # float64 once a run
    plain = replace(o, consts=tuple((c, v) for c, v in o.consts if c not in ("rows", "blocks")))
    return apply(plain, x, rows, (*shape[:lead], *trailing[:-1], len(index)))


def _experts_kept(o, x, w, shape, index, memo=None):
    """W (E, out, in): the kept outputs' rows of every expert."""
    from llmtrace.model.recompute import apply

    at = torch.tensor(index, device=w[0].device)
    rows = _gather(memo, ("kept", id(o), id(w[0]), tuple(index)), lambda: [t[:, at].cpu().double() for t in w[:2]])
    return apply(o, x, rows, (*shape[:-1], len(index)))


def _lookup_kept(o, x, w, shape, index, memo=None):
    """The pass's ids' rows of the table, at the kept entries."""
    from llmtrace.model.recompute import apply

    at = torch.tensor(index, device=w[0].device)
    unique, inverse = torch.unique(x[0], return_inverse=True)
    return apply(o, [inverse], [w[0][unique.to(at.device)][:, at].cpu()], (*shape[:-1], len(index)))


def _matmul_dot(o, x, w, shape, first, memo=None):
    """Output entry `first` of every row as its dot product (the weight row it reads gathered)."""
    a = (x[0].flatten(-2) if o.const("merge") else x[0]).double()
    groups = math.prod(shape[a.dim() - 1:-1])
    features = torch.arange(groups, device=w[0].device) * shape[-1] + first
    W, b = _gather(memo, ("dot", id(o), id(w[0]), first, groups), lambda: [
        t[_feature_rows(o, shape[-1], features)].cpu().double() for t in w[:2]] + [None] * (2 - len(w)))
    return _terms(a.reshape(a.size(0), -1, a.size(-1)), W, groups, b, False)  # W (groups, D): each group's row


def _expert_dot(o, x, w, shape, first, memo=None):
    """Output entry `first` of each chosen expert's product, with that expert's weight row."""
    h, chosen = x[0].double(), x[1]
    idx = chosen.topk(shape[-2], dim=-1).indices  # (B, T, K): the chosen experts, as the evaluator takes them
    wrow = w[0][:, first].cpu().double()[idx]  # (B, T, K, D): entry `first`'s row of each chosen expert
    bias = w[1][:, first].cpu().double()[idx].reshape(h.size(0), -1) if len(w) > 1 else None
    return _terms(h.reshape(h.size(0), -1, h.size(-1)), wrow.reshape(h.size(0), -1, h.size(-1)), shape[-2], bias, True)


def _rmsnorm_aux(o, x, w, shape):
    """The rms of each row the norm divides by."""
    g = w[0] if w else None
    width = g.numel() if g is not None else shape[-1]
    v = x[0].double().reshape(x[0].size(0), -1, width)
    return {"rms": torch.sqrt(v.pow(2).mean(-1) + o.const("eps"))}


def _softmax_aux(o, x, w, shape):
    """Each row's log-sum-exp; with a learned sink, the sink's logit, the scores' own lse and the sink's share."""
    if o.const("take") == "sink":
        return None
    s = x[0].double()  # (B, H, T, S)
    own = torch.logsumexp(s, dim=-1)
    if o.const("sink") is None:
        return {"lse": own}
    sink = w[0].double().reshape(1, -1, 1).expand_as(own)
    total = torch.logaddexp(own, sink)
    return {"lse": total, "lse_s": own, "sink": sink, "share": torch.exp(sink - total)}


def _stream(o, x, w, shape, **_):
    return x[0]


def _lookup(o, x, w, shape, **_):
    return w[0][x[0]]


def _scale(o, x, w, shape, **_):
    return x[0] * (w[0] if w else o.const("factor"))


def _scale_line(o, name, x, c, say):
    if o.weights:  # a learned factor (Gemma 4's layer scalar)
        return f"{name} = {x[0]} × {weight_name(o) if '.' in o.weights[0] else o.weights[0]}"
    return f"{name} = {x[0]} × {c.get('label', '')} = {x[0]} × {c.get('factor', 0):.6g}"


def _rmsnorm(o, x, w, shape, **_):
    g = w[0] if w else None  # no weight: a norm without a scale (gamma "none")
    width = g.numel() if g is not None else shape[-1]
    v = x[0].reshape(*x[0].shape[:1], -1, width)  # (B, rows, width): the width γ covers
    y = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + o.const("eps"))
    y = y * g if g is not None else y
    return y.reshape(shape)


def _rmsnorm_line(o, name, x, c, say):
    over = "" if c["over"] == "D" else say("per_head") if c["over"] == "Dh" else say("over_whole", axis=c["over"])
    gamma = say("gamma_1w") if c["gamma"] not in ("w", "none") else ""
    g = "" if c["gamma"] == "none" else " · γ"  # "none": no scale (Gemma 4's norm of the values)
    if " " in x[0]:  # an operand said in words: name it x
        return f"{name} = x / √(mean(x²) + {c['eps']:g}){g}{gamma}{over}, x = {x[0]}"
    return f"{name} = {x[0]} / √(mean({x[0]}²) + {c['eps']:g}){g}{gamma}{over}"


def _matmul(o, x, w, shape, **_):
    a = x[0]
    if o.const("merge"):
        a = a.flatten(-2)  # (B, T, H, Dh) -> (B, T, H·Dh)
    rows = o.const("rows")
    W = w[0] if rows is None else w[0][rows[0]:rows[1]]
    blocks = o.const("blocks")  # [n, i]: each head's rows are n blocks of its width; this point is block i
    if blocks:
        W = W.reshape(-1, blocks[0], shape[-1], W.size(-1))[:, blocks[1]].reshape(-1, W.size(-1))
    y = a @ W.T
    if len(w) > 1:
        y = y + (w[1] if rows is None else w[1][rows[0]:rows[1]])
    return y


def _matmul_line(o, name, x, c, say):
    split = say("split_" + c["split"]) if c.get("split") in ("H", "Hkv") else ""
    rows = f"[{c['rows'][0]}:{c['rows'][1]}]" if c.get("rows") else ""
    arg = say("merge", x=x[0]) if c.get("merge") else x[0]
    bias = " + b" if len(o.weights) > 1 else ""
    if c.get("blocks"):  # each head's rows are n blocks of its width; this point is one of them
        rows += say("block_of", i=c["blocks"][1] + 1, n=c["blocks"][0])
    return f"{name} = {arg} · {weight_name(o)}{rows}ᵀ{bias}{split}"


def _slice(o, x, w, shape, **_):
    a, b = o.const("cols")
    return x[0][..., a:b].reshape(shape)


def _add(o, x, w, shape, **_):
    return x[0] + x[1]


def _select_last(o, x, w, shape, **_):
    return x[0][:, -1]


declare(
    __name__,
    OpKind("stream", "x = the stream", lambda o, name, x, c, say: f"{name} = {x[0]}", {}, _stream),
    OpKind("lookup", "x = E[id]", lambda o, name, x, c, say: say("lookup", name=name, w=o.weights[0] if o.weights
                                                                 else "E"),
           {"lookup": ("{name} = row id of {w} for each token", "{name} = 每个词元取 {w} 的第 id 行")}, _lookup,
           kept=_lookup_kept),
    OpKind("scale", "y = c · x", _scale_line, {}, _scale),
    OpKind("rmsnorm", "y = x / √(mean(x²) + ε) · γ", _rmsnorm_line,
           {"per_head": (", per head (width Dh)", "，按头计算（宽度 Dh）"),
            "over_whole": (", over the whole {axis}", "，在整个 {axis} 上计算"),
            "gamma_1w": (" (γ = 1 + w)", "（γ = 1 + w）")}, _rmsnorm, aux=_rmsnorm_aux),
    OpKind("matmul", "y = x · Wᵀ (+ b)", _matmul_line,
           {"split_H": (", split into H heads", "，拆成 H 个头"), "split_Hkv": (", split into Hkv heads", "，拆成 Hkv 个头"),
            "merge": ("concat(heads of {x})", "concat({x} 的各头)"),
            "block_of": (" (block {i} of each head's {n})", "（每个头 {n} 块中的第 {i} 块）")}, _matmul,
           kept=_matmul_kept, dot=_matmul_dot),
    OpKind("slice", "y = x[a:b]", lambda o, name, x, c, say: say("slice", name=name, x=x[0], a=c["cols"][0],
                                                                 b=c["cols"][1], split=c["split"]),
           {"slice": ("{name} = {x}[{a}:{b}], split into {split} heads", "{name} = {x}[{a}:{b}]，拆成 {split} 个头")},
           _slice),
    OpKind("add", "y = a + b", lambda o, name, x, c, say: f"{name} = {x[0]} + {x[1]}", {}, _add),
    OpKind("select_last", "x_last = x[-1]", lambda o, name, x, c, say: say("select_last", name=name, x=x[0]),
           {"select_last": ("{name} = {x}[last position]", "{name} = {x}[最后一个位置]")}, _select_last),
)

# ----------------------------------------------------------------------------------------------------------------
# attention: RoPE, the cache, GQA, scores, the soft-cap, softmax, P·V


def rope_frequencies(o, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """θ_i of this pass (LongRoPE: the long set once the pass reaches past the original context) and the factor cos
    and sin are multiplied by."""
    inv = o.const("inv_freq")
    if o.const("inv_freq_long") is not None and int(positions.max()) + 1 > o.const("original"):
        inv = o.const("inv_freq_long")
    return torch.tensor(inv, dtype=torch.float64), float(o.const("attention_factor") or 1.0)


def _rope(o, x, w, shape, positions=None, **_):
    v = x[0].reshape(shape)  # (B, T, heads, Dh): a whole-width norm's output split into heads
    if o.const("rotation") == "none":
        return v
    if v.dim() == 3:  # one key shared by every head (MLA's k_pe): (B, T, Dr)
        return _rope(o, [v[:, :, None]], w, (*shape[:2], 1, shape[-1]), positions=positions)[:, :, 0]
    inv, factor = rope_frequencies(o, positions)
    pos = positions.double()
    if pos.dim() == 1:
        pos = pos[None]  # (1, T)
    angle = pos[..., None] * inv  # (B, T, Dr/2)
    cos, sin = (angle.cos() * factor)[:, :, None], (angle.sin() * factor)[:, :, None]  # (B, T, 1, Dr/2)
    half = inv.numel()
    if o.const("pairs") == "adjacent":  # (x_2i, x_2i+1) share angle i, and stay where they are
        a, b, rest = v[..., 0:2 * half:2], v[..., 1:2 * half:2], v[..., 2 * half:]
        return torch.cat([torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2), rest], dim=-1)
    a, b, rest = v[..., :half], v[..., half:2 * half], v[..., 2 * half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def _rope_line(o, name, x, c, say):
    if c.get("rotation") == "none":
        return say("no_rotation", name=name, x=x[0])
    dr = c["rotary_dim"]
    part = say("rope_part", dr=dr, dh=c["head_dim"]) if dr != c["head_dim"] else ""
    kind = (c.get("scaling") or {}).get("rope_type")
    scaled = say("rope_scaled", kind=kind) if kind and kind != "default" else ""
    factor = say("rope_factor", f=f"{c['attention_factor']:.4g}") if c.get("attention_factor") not in (None, 1.0) else ""
    pairs = "rope_adjacent" if c.get("pairs") == "adjacent" else "rope"  # DeepSeek's: neighbours share an angle
    return say(pairs, name=name, x=x[0], half=dr // 2, base=number(c["base"]), dr=dr) + part + scaled + factor


def _rope_card(o) -> Optional[dict]:
    """What a RoPE card prints beside the θᵢ the layer declares: an entry i and the unscaled base^(−2i/d) there,
    which a scaled RoPE (YaRN, LongRoPE, ...) does not run; None where the layer turns nothing."""
    c = o.const
    if c("rotation") == "none" or not c("rotary_dim") or not c("base"):
        return None
    i = min(4, c("rotary_dim") // 2 - 1)
    return {"i": i, "plain": c("base") ** (-2 * i / c("rotary_dim"))}


def _repeat_kv(o, x, w, shape, **_):
    k = x[0].transpose(1, 2)  # (B, Hkv, T, Dh)
    return k.repeat_interleave(o.const("group"), dim=1)  # (B, H, T, Dh)


def masked(o, s: torch.Tensor, padding) -> torch.Tensor:
    """s (B, H, T, S) with −∞ where the declared mask hides a key: later slots (causal), more than W back (window),
    pad slots (a pad query still sees itself)."""
    if o.const("mask") is None:
        return s
    T, S = s.shape[-2:]
    q = torch.arange(S - T, S)[:, None]
    k = torch.arange(S)[None, :]
    ok = k <= q
    if o.const("window"):
        ok = ok & (q - k < o.const("window"))
    ok = ok[None, None]
    if padding is not None:
        ok = (ok & padding[:, None, None, :S].bool()) | (k == q)
    return s.masked_fill(~ok, float("-inf"))


def _scores(o, x, w, shape, padding=None, **_):
    q = x[0].transpose(1, 2)  # (B, H, T, Dh)
    k = x[1].reshape(q.size(0), q.size(1), -1, q.size(-1))  # (B, H, S, Dh)
    s = (q @ k.transpose(-2, -1)) * o.const("scale")
    if o.const("softcap"):
        s = torch.tanh(s / o.const("softcap")) * o.const("softcap")
    return masked(o, s, padding)


def _scores_line(o, name, x, c, say):
    s = f"{x[0]} · {x[1]}ᵀ · {c['scale']:.4g} ({c['scale_label']})"
    if c.get("softcap"):
        s = f"{c['softcap']:g}·tanh({s} / {c['softcap']:g})"
    return f"{name} = {s}" + mask_words(c, say)


def _softcap(o, x, w, shape, padding=None, **_):
    y = torch.tanh(x[0] / o.const("cap")) * o.const("cap")
    return masked(o, y, padding) if o.const("mask") else y


def _softmax(o, x, w, shape, **_):
    s = x[0]
    if o.const("sink") is None:
        return torch.softmax(s, dim=-1)
    sink = w[0].reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)  # (B, H, T, 1): one more logit per head
    both = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)
    return both[..., -1] if o.const("take") == "sink" else both[..., :-1]  # the sink's share, or the keys' probs


def _softmax_line(o, name, x, c, say):
    if c.get("take") == "sink":  # gpt-oss: the sink's column of the same softmax, the share no key gets
        return say("sink_share", name=name, x=x[0], w=o.weights[0])
    return say("softmax_sink" if c.get("sink") else "softmax", name=name, x=x[0], w=o.weights[0] if o.weights else "")


def _weighted_sum(o, x, w, shape, **_):
    p = x[0]  # (B, H, T, S)
    v = x[1].transpose(1, 2).repeat_interleave(o.const("group"), dim=1)  # (B, H, S, Dh)
    return (p @ v).transpose(1, 2)  # (B, T, H, Dh)


declare(
    __name__,
    OpKind("rope", "(x_i, x_i+d/2) rotated by pos · θ_i", _rope_line,
           {"no_rotation": ("{name} = {x}: no rotation in this layer (attention here sees content, not position)",
                            "{name} = {x}：这一层不旋转（这里的注意力只看内容，不看位置）"),
            "rope": ("{name}: pairs ({x}_i, {x}_i+{half}) turned by pos·θ_i, θ_i = {base}^(−2i/{dr})",
                     "{name}：每一对 ({x}_i, {x}_i+{half}) 旋转 pos·θ_i，θ_i = {base}^(−2i/{dr})"),
            "rope_adjacent": ("{name}: pairs ({x}_2i, {x}_2i+1) turned by pos·θ_i, θ_i = {base}^(−2i/{dr})",
                              "{name}：相邻的每一对 ({x}_2i, {x}_2i+1) 旋转 pos·θ_i，θ_i = {base}^(−2i/{dr})"),
            "rope_part": (" (the first {dr} of {dh} dims)", "（只转前 {dr} 维，共 {dh} 维）"),
            "rope_factor": (", cos and sin × {f}", "，cos 与 sin × {f}")}, _rope, role=ROTATION, card=_rope_card),
    OpKind("cache_write", "K, V → cache[slots]", lambda o, name, x, c, say: say("cache_write", x=", ".join(x)),
           {"cache_write": ("{x} → the cache's slots for this pass", "{x} → 本次前向在缓存中的槽位")}),
    OpKind("repeat_kv", "K_h = K_{h // G}", lambda o, name, x, c, say: say("repeat_kv", name=name, x=x[0],
                                                                           g=c.get("group")),
           {"repeat_kv": ("{name}: each KV head of {x} seen by its {g} query heads (GQA)",
                          "{name}：{x} 的每个 KV 头由它的 {g} 个查询头共用（GQA）")}, _repeat_kv),
    OpKind("scores", "s = q · kᵀ · scale", _scores_line, {}, _scores),
    OpKind("softcap", "y = cap · tanh(x / cap)",
           lambda o, name, x, c, say: f"{name} = {c['cap']:g} · tanh({x[0]} / {c['cap']:g})" + mask_words(c, say),
           {}, _softcap),
    OpKind("softmax", "p = exp(s − max) / Σ exp(s − max)", _softmax_line,
           {"softmax": ("{name} = softmax({x}) over the last axis: each row sums to 1",
                        "{name} = softmax({x})，沿最后一维：每行之和为 1"),
            "softmax_sink": ("{name} = softmax({x}) over the last axis, with one sink logit per head ({w}) in the sum, "
                             "dropped after: rows sum to less than 1",
                             "{name} = softmax({x})，沿最后一维，每个头多一个汇点 logit（{w}）参与求和、之后丢弃：每行之和小于 1"),
            "sink_share": ("{name} = exp(sink) / (Σ exp({x}) + exp(sink)), one sink logit per head ({w}): 1 − Σ probs, "
                           "the share of each row no key gets",
                           "{name} = exp(sink) / (Σ exp({x}) + exp(sink))，每个头一个汇点 logit（{w}）：1 − Σ probs，"
                           "即每行没有分给任何键的份额")}, _softmax, aux=_softmax_aux),
    OpKind("weighted_sum", "o = Σ_s p_s · v_s", lambda o, name, x, c, say: say("weighted_sum", name=name, x=x[0],
                                                                               v=x[1], g=c.get("group")),
           {"weighted_sum": ("{name} = {x} · {v} (each query head reading KV head h // {g})",
                             "{name} = {x} · {v}（每个查询头读取 KV 头 h // {g}）")}, _weighted_sum),
)

# ----------------------------------------------------------------------------------------------------------------
# the feed-forward: a gated activation; experts: the router, each chosen expert's projections, their mix


def _glu(o, x, w, shape, **_):
    gate, up = x
    limit = o.const("clamp")
    if limit is not None:  # gpt-oss: gate ≤ limit, −limit ≤ up ≤ limit, gate·σ(α·gate)·(up + 1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(o.const("alpha") * gate) * (up + o.const("up_offset", 0.0))
    return ACTS[o.const("act")](gate) * up


def _glu_line(o, name, x, c, say):
    if c.get("clamp") is not None:
        lim = c["clamp"]
        return (f"{name} = g·σ({c['alpha']:g}·g) · (u + {c.get('up_offset', 0):g}), g = min({x[0]}, {lim:g}), "
                f"u = clamp({x[1]}, −{lim:g}, {lim:g}) ({glu_name(o)})")
    return f"{name} = {c['act']}({x[0]}) ⊙ {x[1]} ({glu_name(o)})"


def _router(o, x, w, shape, **_):
    z = x[0]
    k = o.const("k")
    if o.const("order") == "topk_softmax":  # the raw logits chosen, then their softmax
        top, idx = z.topk(k, dim=-1)
        p = torch.softmax(top, dim=-1)
    else:
        pick = z + w[0] if w else z  # a choice bias chooses; the weights are the scores themselves
        pick = pick.masked_fill(z == 0, float("-inf"))  # an ablated expert (probability 0) is never chosen
        n = o.const("groups") or 1
        if n > 1:  # only the experts of the best `groups_used` groups may be chosen
            g = pick.unflatten(-1, (n, -1))
            best = g.topk(2, dim=-1).values.sum(-1) if o.const("group_score") == "top2_sum" else g.amax(-1)
            keep = torch.zeros_like(best).scatter(-1, best.topk(o.const("groups_used"), dim=-1).indices, 1.0)
            pick = pick.masked_fill(keep.repeat_interleave(g.size(-1), dim=-1) == 0, float("-inf"))
        idx = pick.topk(k, dim=-1).indices
        p = z.gather(-1, idx)
        if o.const("renormalise"):
            p = p / p.sum(-1, keepdim=True)
        p = p * (o.const("scale") or 1.0)
    return torch.zeros_like(z).scatter(-1, idx, p)


ORDERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")  # the router's `order`: a key, said by "order_<key>"


def _router_line(o, name, x, c, say):
    order = say("order_" + (c.get("order") if c.get("order") in ORDERS else "softmax_topk"))
    return (say("router", name=name, order=order, k=c.get("k"), x=x[0])
            + (say("router_bias", w=o.weights[0]) if o.weights else "")
            + (say("router_groups", used=c["groups_used"], n=c["groups"],
                   how=say("group_top2_sum" if c.get("group_score") == "top2_sum" else "group_best"))
               if c.get("groups") else "")
            + (say("router_norm") if c.get("renormalise") else "")
            + (say("router_scale", scale=c["scale"]) if c.get("scale") else "") + say("router_rest"))


def _chosen(weights: torch.Tensor, k: int) -> torch.Tensor:
    return weights.topk(k, dim=-1).indices  # (B, T, K): the chosen experts, most weighted first


def _expert_matmul(o, x, w, shape, **_):
    h, weights = x
    idx = _chosen(weights, shape[-2])
    W = w[0][idx]  # (B, T, K, Fe, D)
    y = (W @ h[:, :, None, :, None]).squeeze(-1)  # (B, T, K, Fe)
    return y + w[1][idx] if len(w) > 1 else y


def _expert_mix(o, x, w, shape, **_):
    act, weights = x
    idx = _chosen(weights, act.size(-2))
    W = w[0][idx]  # (B, T, K, D, Fe)
    y = (W @ act[..., None]).squeeze(-1)  # (B, T, K, D)
    if len(w) > 1:
        y = y + w[1][idx]
    return (y * weights.gather(-1, idx)[..., None]).sum(-2)


ROUTER_WORDS = {
    "router": ("{name}: {order} {k} of {x}", "{name}：{order} {k} 个，取自 {x}"),
    "router_norm": (", renormalised to sum to 1", "，重新归一化使和为 1"),
    "router_rest": ("; 0 elsewhere", "；其余为 0"),
    "order_softmax_topk": ("softmax, then top-k", "先 softmax，再取 top-k"),
    "order_topk_softmax": ("top-k, then softmax", "先取 top-k，再 softmax"),
    "order_sigmoid_topk": ("sigmoid, then top-k", "先 sigmoid，再取 top-k"),
    "router_bias": (" (chosen by score + {w}, weighted by the score alone)", "（按分数 + {w} 选择，权重只用分数本身）"),
    "router_groups": (", among the experts of the best {used} of {n} groups (a group's score: {how})",
                      "，只在 {n} 组中最好的 {used} 组的专家里选（一组的分数：{how}）"),
    "group_top2_sum": ("its best two, summed", "组内最好的两个之和"),
    "group_best": ("its best", "组内最好的一个"),
    "router_scale": (", × {scale:g}", "，× {scale:g}"),
}

declare(
    __name__,
    OpKind("glu", "y = act(gate) ⊙ up", _glu_line, {}, _glu, role=ACTIVATION),
    OpKind("router", "w = top-k(softmax(logits))", _router_line, ROUTER_WORDS, _router),
    OpKind("expert_matmul", "y_k = x · W_{e_k}ᵀ",
           lambda o, name, x, c, say: say("expert_matmul_bias" if len(o.weights) > 1 else "expert_matmul", name=name,
                                          x=x[0], w=weight_name(o)),
           {"expert_matmul": ("{name} = {x} · {w}[e]ᵀ for each chosen expert e", "{name} = {x} · {w}[e]ᵀ，对每个被选中的专家 e"),
            "expert_matmul_bias": ("{name} = {x} · {w}[e]ᵀ + b[e] for each chosen expert e",
                                   "{name} = {x} · {w}[e]ᵀ + b[e]，对每个被选中的专家 e")}, _expert_matmul,
           kept=_experts_kept, dot=_expert_dot),
    OpKind("expert_mix", "y = Σ_k w_k · (act_k · W_down,e_kᵀ)",
           lambda o, name, x, c, say: f"{name} = Σ_e weight_e · ({x[0]}_e · W_down[e]ᵀ)", {}, _expert_mix,
           kept=_experts_kept),
)

# ----------------------------------------------------------------------------------------------------------------
# a causal convolution over a carried window (linear attention's, Mamba2's, LFM2's short convolution)


def _conv1d(o, x, w, shape, **_):
    seq, before = x[0], x[1]  # (B, T, C), the carried (B, C, Kc-1) or None
    B, T, C = seq.shape
    kc = o.const("kernel")
    before = torch.zeros(B, C, kc - 1, dtype=seq.dtype) if before is None else before
    xs = torch.cat([before, seq.transpose(1, 2)], dim=-1)  # (B, C, Kc-1+T)
    if o.const("output") == "state":
        return xs[:, :, -(kc - 1):]
    y = F.conv1d(xs, w[0].unsqueeze(1), w[1] if len(w) > 1 else None, groups=C)  # (B, C, T)
    return (ACTS[o.const("act")](y) if o.const("act") else y).transpose(1, 2)


def _conv1d_line(o, name, x, c, say):
    kc = c["kernel"]
    if c.get("output") == "state":
        return say("conv_state", name=name, n=kc - 1, before=carried_words(c, x[1], say), x=x[0])
    total = f"Σ_j w_conv,j · {x[0]}_(t−{kc - 1}+j){' + b_conv' * (len(o.weights) > 1)}"
    return (f"{name}_t = {c['act']}({total})" if c.get("act") else f"{name}_t = {total}") + \
        say("conv_out", before=carried_words(c, x[1], say))


declare(
    __name__,
    OpKind("conv1d", "y_t = act(Σ_j w_j · x_{t−Kc+1+j} (+ b))", _conv1d_line,
           {"conv_state": ("{name} = the last {n} inputs of ({before}, then {x})",
                           "{name} = （{before}，接着 {x}）的最后 {n} 个输入"),
            "conv_out": (", per channel, the earlier inputs from {before}", "，逐通道计算，更早的输入取自 {before}")},
           _conv1d),
)
