"""`explain` of a mixture-of-experts layer: its router taken apart for every prompt token (the `router` section), and
what a token costs in such a layer (the weights it uses, the FLOPs of its K experts).

The router of model/moe.py, from the layer's points of one pass: router_logits (T, E), router_probs (T, E) and
expert_weights (T, E), after any intervention, and the feed-forward's output `down` (T, D)."""

from __future__ import annotations

import torch

from llmtrace.model.moe_points import (EXPERT_DOWN, EXPERT_WEIGHTS, ROUTER_LINE, ROUTER_LOGITS, ROUTER_PROBS,
                                      chosen_experts)
from llmtrace.trace.records import rounded


def _rl(t: torch.Tensor) -> list:
    return [rounded(float(v)) for v in t.tolist()]


def router_section(points: dict, resid_mid: torch.Tensor, layer: int, config, maths=None) -> dict:
    """Every prompt token's routing at `layer`: all E scores and probabilities, the K experts it ran and their
    weights, the cut (the least probability chosen, the most left out), the entropy in bits, and how much the
    experts' sum changed the stream; the layer's load over the prompt. `points`: the layer's points, batch axis
    dropped; `resid_mid` (T, D): the stream the feed-forward adds to."""
    E, K = config.n_experts, config.n_experts_used
    logits, probs = points[ROUTER_LOGITS.name].float(), points[ROUTER_PROBS.name].float()  # (T, E) each
    weights, down = points[EXPERT_WEIGHTS.name].float(), points[EXPERT_DOWN.name].float()  # (T, E), (T, D)
    declared = maths.op(layer, EXPERT_WEIGHTS.name) if maths is not None else None
    scale = (declared.const("scale") if declared is not None else None) or 1.0  # a factor on the weights (DeepSeek)
    ran = weights != 0  # (T, E): the experts a token ran (the K most probable, unless a bias or groups chose)
    chosen = chosen_experts(probs, weights, K)  # (T, K), most probable first
    cut_p = probs.gather(-1, chosen)[:, -1]  # (T,): the least probability chosen
    left = probs.masked_fill(ran, float("-inf")).amax(-1)  # (T,): the best left out
    p = probs.clamp_min(0)
    entropy = -(torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p))).sum(-1)  # (T,) bits
    load = torch.bincount(chosen.flatten(), minlength=E).tolist()
    mean = len(chosen) * K / E
    tokens = []
    for t in range(probs.size(0)):
        tokens.append({
            "position": t, "logits": _rl(logits[t]), "probs": _rl(probs[t]), "experts": chosen[t].tolist(),
            "weights": _rl(weights[t, chosen[t]]), "cut": rounded(float(cut_p[t])),
            "next": rounded(float(left[t])) if K < E else None, "entropy": rounded(float(entropy[t])),
            "norm_down": rounded(float(down[t].norm())),
            "rel_change": rounded(float(down[t].norm() / resid_mid[t].float().norm()))})
    return {
        "event": "explain", "section": "router", "layer": layer, "seed_step": "s6.7",
        "formula": ("p = softmax(x̂ W_routerᵀ) in float32; the K most probable experts run; w = p / Σ_chosen p"
                    if config.norm_topk_prob else
                    "p = softmax(x̂ W_routerᵀ) in float32; the K most probable experts run; w = p as it is")
        + "; FFN(x̂) = Σ_chosen w_e · W_down,e (silu(x̂ W_gate,e) ⊙ x̂ W_up,e)",
        "n_experts": E, "k": K, "renormalised": config.norm_topk_prob,
        **({} if maths is None else {"formula": declared_formula(maths, layer)}),
        "expert_ffn_dim": config.expert_ffn_dim or config.ffn_dim, "tokens": tokens, "load": load,
        "imbalance": rounded(max(load) / mean) if mean else None,
        "check_weights_sum": rounded(float((weights.sum(-1) - scale * (1.0 if config.norm_topk_prob else
                                                                       probs.gather(-1, chosen).sum(-1))
                                            ).abs().max())),
    }


def declared_formula(maths, layer: int) -> str:
    """The router and the experts as the model declares them (model.maths): its choice rule (softmax then top-k, or
    gpt-oss's top-k then softmax), the experts' gated activation (a clamped GLU) and the weighted sum."""
    from llmtrace.model.maths import formula

    return "; ".join(formula(maths.op(layer, name), name, layer, maths) for name in ROUTER_LINE
                     if maths.op(layer, name) is not None)


def moe_costs(model, layer: int, n_tokens: int) -> dict:
    """What a token costs in MoE layer `layer`: the weights it uses there and in the whole model (K of E experts in
    each MoE layer). Its FLOPs are the layer's declaration (MoEFeedForward.flops)."""
    from llmtrace.model.moe import active_weights

    c = model.config
    declared = model.declared_weights()
    mine = [w for w in declared if w.param.startswith(f"layers.{layer}.")]
    active_layer, _ = active_weights(c, mine)
    active_model, total = active_weights(c, declared)
    return {"layer_active_params": active_layer, "model_active_params": model.num_params() - (total - active_model)}
