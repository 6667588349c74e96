"""Any declared operation (model.maths) applied to tensors, in float64: the declaration's own check.

`apply(op, args, weights, out_shape, ...)` computes a point from its operands as the declaration says, written from
the formula and not from the model's code, so that a test can lay each declared operation beside the value the
forward pass reported (tests/test_maths.py, for every family) and `explain` can show "computed" beside "in the trace".
Tensors keep the batch axis, as a capture holds them: (B, T, ...); k_repeated may be the (B, Hkv, G, S, Dh) view.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from llmtrace.model.maths import Op

ACTS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def apply(o: Op, args: list, weights: list, out_shape: tuple, *, positions: Optional[torch.Tensor] = None,
          padding: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The point `o` makes from `args` (its operands' tensors, in order) and `weights` (its weights' tensors), in
    float64, shaped `out_shape`. `positions` (B, T) or (T,): each token's position (RoPE); `padding` (B, S): False at
    pad slots (the mask). None for an operation that makes no tensor to check (the slots a cache write names)."""
    fn = _KINDS.get(o.kind)
    if fn is None:
        return None
    x = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    w = [t.double() for t in weights]
    y = fn(o, x, w, out_shape, positions=positions, padding=padding)
    return None if y is None else y.reshape(out_shape)


def _stream(o, x, w, shape, **_):
    return x[0]


def _lookup(o, x, w, shape, **_):
    return w[0][x[0]]


def _scale(o, x, w, shape, **_):
    return x[0] * (w[0] if w else o.const("factor"))


def _rmsnorm(o, x, w, shape, **_):
    g = w[0] if w else None  # no weight: a norm without a scale (gamma "none")
    width = g.numel() if g is not None else shape[-1]
    v = x[0].reshape(*x[0].shape[:1], -1, width)  # (B, rows, width): the width γ covers
    y = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + o.const("eps"))
    y = y * g if g is not None else y
    return y.reshape(shape)


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


def rope_frequencies(o: Op, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
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


def _repeat_kv(o, x, w, shape, **_):
    k = x[0].transpose(1, 2)  # (B, Hkv, T, Dh)
    return k.repeat_interleave(o.const("group"), dim=1)  # (B, H, T, Dh)


def _mask(o, s: torch.Tensor, padding) -> torch.Tensor:
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
    return _mask(o, s, padding)


def _softcap(o, x, w, shape, padding=None, **_):
    y = torch.tanh(x[0] / o.const("cap")) * o.const("cap")
    return _mask(o, y, padding) if o.const("mask") else y


def _softmax(o, x, w, shape, **_):
    s = x[0]
    if o.const("sink") is None:
        return torch.softmax(s, dim=-1)
    sink = w[0].reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)  # (B, H, T, 1): one more logit per head
    both = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)
    return both[..., -1] if o.const("take") == "sink" else both[..., :-1]  # the sink's share, or the keys' probs


def _weighted_sum(o, x, w, shape, **_):
    p = x[0]  # (B, H, T, S)
    v = x[1].transpose(1, 2).repeat_interleave(o.const("group"), dim=1)  # (B, H, S, Dh)
    return (p @ v).transpose(1, 2)  # (B, T, H, Dh)


def _glu(o, x, w, shape, **_):
    gate, up = x
    limit = o.const("clamp")
    if limit is not None:  # gpt-oss: gate ≤ limit, −limit ≤ up ≤ limit, gate·σ(α·gate)·(up + 1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(o.const("alpha") * gate) * (up + o.const("up_offset", 0.0))
    return ACTS[o.const("act")](gate) * up


def _add(o, x, w, shape, **_):
    return x[0] + x[1]


def _select_last(o, x, w, shape, **_):
    return x[0][:, -1]


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


def _conv1d(o, x, w, shape, **_):
    qkv, before = x[0], x[1]  # (B, T, C), the carried (B, C, Kc-1) or None
    B, T, C = qkv.shape
    kc = o.const("kernel")
    before = torch.zeros(B, C, kc - 1, dtype=qkv.dtype) if before is None else before
    xs = torch.cat([before, qkv.transpose(1, 2)], dim=-1)  # (B, C, Kc-1+T)
    if o.const("output") == "state":
        return xs[:, :, -(kc - 1):]
    y = F.conv1d(xs, w[0].unsqueeze(1), w[1] if len(w) > 1 else None, groups=C)  # (B, C, T)
    return (ACTS[o.const("act")](y) if o.const("act") else y).transpose(1, 2)


def _columns(o, x, shape):
    a, b = o.const("cols")
    return x[0][..., a:b].reshape(shape)


def _l2norm(o, x, w, shape, **_):
    v = _columns(o, x, shape)
    return v / torch.sqrt((v * v).sum(-1, keepdim=True) + o.const("eps")) * o.const("scale")


def _slice(o, x, w, shape, **_):
    return _columns(o, x, shape)


def _sigmoid(o, x, w, shape, **_):
    return torch.sigmoid(x[0])


def _decay(o, x, w, shape, **_):
    return torch.exp(w[0] * F.softplus(x[0] + w[1]))


def per_value_head(x: torch.Tensor, group: int, order: str) -> torch.Tensor:
    """(B, T, Hk, Dk) -> (B, T, Hv, Dk): value head j reads key head j // group ("grouped") or j % Hk ("tiled")."""
    return x.repeat(1, 1, group, 1) if order == "tiled" else x.repeat_interleave(group, dim=2)


def _delta_rule(o, x, w, shape, **_):
    q, k, v, alpha, beta, state = x  # (B, T, Hk, Dk) twice, (B, T, Hv, Dv), (B, T, Hv) twice, carried S or None
    g, order = o.const("group"), o.const("v_order")
    q, k = per_value_head(q, g, order), per_value_head(k, g, order)
    B, T, Hv, Dv = v.shape
    S = torch.zeros(B, Hv, q.size(-1), Dv, dtype=v.dtype) if state is None else state
    out = []
    for t in range(T):
        S = alpha[:, t, :, None, None] * S
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return S if o.const("output") == "state" else torch.stack(out, dim=1)


def _gated_rmsnorm(o, x, w, shape, **_):
    h, z = x
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + o.const("eps")) * w[0] * F.silu(z)


def _gate(o, x, w, shape, **_):
    return x[0] * torch.sigmoid(x[1])


def _latent_up(o, x, w, shape, **_):
    c = x[0]  # (B, S, R): every cached latent
    if o.const("stored") == "out_in":  # W_h (out, R): y = c · W_hᵀ
        return torch.einsum("bsr,hor->bsho", c, w[0])
    return torch.einsum("bsr,hro->bsho", c, w[0])  # W_h (R, out): y = c · W_h


def _mla_scores(o, x, w, shape, padding=None, **_):
    q_nope, k_nope, q_rope, k_rope = x  # (B, T, H, Dn), (B, S, H, Dn), (B, T, H, Dr), (B, S, Dr)
    s = (torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_rope, k_rope))
    return _mask(o, s * o.const("scale"), padding)


def _softplus(o, x, w, shape, **_):
    dt = F.softplus(x[0] + w[0])
    lo, hi = o.const("limit") or (0.0, math.inf)
    return dt.clamp(lo, hi)


def _ssm_decay(o, x, w, shape, **_):
    return torch.exp(x[0] * w[0])


def _ssm_scan(o, x, w, shape, **_):
    """Mamba2's recurrence from its formula: per head, h (P × N) ← a·h + Δ·x ⊗ B, y = C·h + D·x; head j reads
    group j // (H/G) of B and C."""
    xs, b, c, dt, a, h = x  # (B, T, H, P), (B, T, G, N) twice, (B, T, H) twice, the carried (B, H, P, N) or None
    g = o.const("group")
    b, c = b.repeat_interleave(g, dim=2), c.repeat_interleave(g, dim=2)  # (B, T, H, N)
    Bn, T, H, P = xs.shape
    h = torch.zeros(Bn, H, P, b.size(-1), dtype=xs.dtype) if h is None else h
    ys = []
    for t in range(T):
        h = a[:, t, :, None, None] * h + dt[:, t, :, None, None] * xs[:, t, :, :, None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, c[:, t]) + w[0][:, None] * xs[:, t])
    return h if o.const("output") == "state" else torch.stack(ys, dim=1)


def _group_gated_rmsnorm(o, x, w, shape, **_):
    v = x[0].reshape(*x[0].shape[:2], -1) * F.silu(x[1].reshape(*x[1].shape[:2], -1))  # (B, T, I)
    grouped = v.reshape(*v.shape[:2], -1, o.const("group"))
    y = grouped / torch.sqrt(grouped.pow(2).mean(-1, keepdim=True) + o.const("eps"))
    return y.reshape(v.shape) * w[0]


def _mul(o, x, w, shape, **_):
    return x[0] * x[1]


_KINDS = {"stream": _stream, "lookup": _lookup, "scale": _scale, "rmsnorm": _rmsnorm, "matmul": _matmul,
          "rope": _rope, "repeat_kv": _repeat_kv, "scores": _scores, "softcap": _softcap, "softmax": _softmax,
          "weighted_sum": _weighted_sum, "glu": _glu, "add": _add, "select_last": _select_last, "router": _router,
          "expert_matmul": _expert_matmul, "expert_mix": _expert_mix, "conv1d": _conv1d, "l2norm": _l2norm,
          "slice": _slice, "sigmoid": _sigmoid, "decay": _decay, "delta_rule": _delta_rule,
          "gated_rmsnorm": _gated_rmsnorm, "gate": _gate, "latent_up": _latent_up, "mla_scores": _mla_scores,
          "softplus": _softplus, "ssm_decay": _ssm_decay, "ssm_scan": _ssm_scan,
          "group_gated_rmsnorm": _group_gated_rmsnorm, "mul": _mul}


def max_error(computed: torch.Tensor, recorded: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference (−∞ against −∞ counts as none) and the largest relative one (against the
    recorded value's largest magnitude)."""
    a, b = computed.double(), recorded.double()
    same_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    absolute = float(d.max()) if d.numel() else 0.0
    scale = float(b[torch.isfinite(b)].abs().max()) if torch.isfinite(b).any() else 1.0
    return absolute, absolute / max(scale, 1e-30) if math.isfinite(absolute) else math.inf
