"""explain on a layer whose memory is a recurrent state (a layer that declares a `delta_rule` operation: Qwen3.5's
Gated DeltaNet), in place of the attention sections: one delta-rule update worked out on the pass's own numbers, and
why no cache grows.

The update is the last prompt token's, for one value head h, read from the declaration (model.maths): the state
before it S₀ (recomputed from the earlier tokens' q, k, v, α, β by the declared operation, from zeros), then
    α·S₀                      the decay: every entry of the state times α
    m = (α·S₀)ᵀk              what the state already holds at the key
    δ = β·(v − m)             the correction: the value less what is there, times the write strength
    S = α·S₀ + k ⊗ δ          written at the key
    o = Sᵀq                   the output: the state read with the query
each computed in float64 beside the value the pass kept (S after the prompt, o at the last position).
"""

from __future__ import annotations

from typing import Optional

import torch

from llmtrace.model.maths import formula
from llmtrace.model.recompute import apply, per_value_head
from llmtrace.units import sig6, sig6_rows

CORNER = 4  # rows and columns of the state shown


def state_op(mixer, maths, layer: int, output: str):
    """The point of the layer's recurrence making `output` ("o" or "state"), as its kind names it (RECURRENCE), and
    its declared operation."""
    name = mixer.RECURRENCE[output]
    return name, maths.op(layer, name)


def delta_rule_section(cap, mixer, maths, head: Optional[int] = None) -> dict:
    """One delta-rule update of value head `head` (default 0) at the last prompt token, worked on real numbers and
    checked against the pass's own state and output."""
    out_name, o = state_op(mixer, maths, cap.layer, "o")
    state_name, _ = state_op(mixer, maths, cap.layer, "state")
    q_name, k_name, v_name, a_name, b_name = o.inputs[:5]
    p = {n: cap.points[n].double() for n in (q_name, k_name, v_name, a_name, b_name)}  # (T, ...) each, no batch axis
    T, h = p[v_name].size(0), head or 0
    g, order = o.const("group"), o.const("v_order")
    q, k = (per_value_head(p[n][None], g, order)[0, :, h] for n in (q_name, k_name))  # (T, Dk)
    v, alpha, beta = p[v_name][:, h], p[a_name][:, h], p[b_name][:, h]  # (T, Dv), (T,), (T,)
    before = torch.zeros(1, p[v_name].size(1), q.size(-1), v.size(-1), dtype=torch.float64)
    if T > 1:  # the state after the earlier tokens: the declared operation on their numbers
        earlier = [p[n][None, : T - 1] for n in (q_name, k_name, v_name, a_name, b_name)]
        state_after = maths.layers[cap.layer][state_name]
        before = apply(state_after, earlier + [None], [], tuple(before.shape))
    S0 = before[0, h]  # (Dk, Dv)
    decayed = alpha[-1] * S0
    held = decayed.T @ k[-1]  # (Dv,) what the state holds at the key
    delta = beta[-1] * (v[-1] - held)  # (Dv,)
    S = decayed + torch.outer(k[-1], delta)  # (Dk, Dv)
    out = S.T @ q[-1]  # (Dv,)
    recorded_S, recorded_o = cap.points[state_name][h].double(), cap.points[out_name][-1, h].double()
    c, n = CORNER, min(CORNER, v.size(-1))
    return {
        "event": "explain", "section": "delta_rule", "layer": cap.layer, "seed_step": "s6.4-s6.8", "head": h,
        "position": T - 1, "point_state": state_name, "point_out": out_name,
        "formula": "S ← α·S + k ⊗ β·(v − (α·S)ᵀk);  o = Sᵀq", "shape_state": list(cap.points[state_name].shape),
        "alpha": sig6(alpha[-1]), "beta": sig6(beta[-1]), "k": sig6_rows(k[-1][:c]), "q": sig6_rows(q[-1][:c]), "v": sig6_rows(v[-1][:n]),
        "held": sig6_rows(held[:n]), "delta": sig6_rows(delta[:n]), "norm_k": sig6(k[-1].norm()),
        "S_before": sig6_rows(S0[:c, :n]), "S_decayed": sig6_rows(decayed[:c, :n]), "write": sig6_rows(torch.outer(k[-1], delta)[:c, :n]),
        "S_after": sig6_rows(S[:c, :n]), "out": sig6_rows(out[:n]),
        "check_state_max_abs_diff": sig6((S - recorded_S).abs().max()),
        "check_out_max_abs_diff": sig6((out - recorded_o).abs().max()),
        "alpha_all": sig6_rows(alpha), "beta_all": sig6_rows(beta),
    }


def state_cache_section(cap, maths, config, kv_element_size: int, memory: list) -> dict:
    """s6.8 for a state layer: what it keeps (its carried points, the same size at every step) beside what an
    attention layer of this model caches for the same tokens (growing by 2·Hkv·Dh numbers a token)."""
    carried = [n for n, o in maths.layers[cap.layer].items() if n in (o.const("carried") or ())]
    updates = {n: formula(maths.layers[cap.layer][n], n, cap.layer, maths) for n in carried}
    kept = {n: list(cap.points[n].shape) for n in carried if n in cap.points}
    numbers = sum(int(torch.tensor(s).prod()) for s in kept.values())
    T = len(cap.ids)
    per_token = 2 * config.n_kv_heads * config.head_dim * kv_element_size
    mine = memory[cap.layer]  # the layer's declared memory (model.memory): a state, a window, another layer's K and V
    attention_layers = [i for i, m in enumerate(memory) if m.per_token]  # layers whose memory grows
    state_bytes = mine.constant_bytes(kv_element_size) if mine.constant else numbers * 4
    even = -(-state_bytes // per_token) if per_token else None  # tokens at which one attention layer's cache is as big
    return {"event": "explain", "section": "state_cache", "layer": cap.layer, "seed_step": "s6.8", "n_tokens": T,
            "memory_kind": mine.kind, "reads": mine.reads,
            "state": kept, "state_bytes": state_bytes, "kv_bytes_per_token": per_token, "kv_bytes_now": per_token * T,
            "kv_bytes_context": per_token * config.max_seq_len, "context": config.max_seq_len, "break_even": even,
            "attention_layers": attention_layers, "state_layers": [i for i, m in enumerate(memory) if m.constant],
            "updates": updates}
