"""The points of a mixture-of-experts feed-forward (model/moe.py), declared once and free of torch, so that the trace's
reader, the views and the report can take a routing apart without the model (as llama_points does for Llama).

The router's three tensors are points of their own; the SwiGLU of the chosen experts keeps Llama's names (gate, up,
act, down) with an axis K for each token's chosen experts, so a learner finds the same steps in the same place."""

from llmtrace.model.points import Point

ROUTER_LOGITS = Point("router_logits", "s6.7", ("T", "E"), editable=True,
                      about="the router's score of each expert: x·W_routerᵀ", input="ffn_norm")
ROUTER_PROBS = Point("router_probs", "s6.7", ("T", "E"),
                     about="softmax of the router's scores, in float32: each row sums to 1", input="router_logits")
EXPERT_WEIGHTS = Point("expert_weights", "s6.7", ("T", "E"), editable=True,
                       about="each token's weight on each expert: its top-K probabilities (renormalised to sum to 1 "
                             "where the family does), 0 for the experts not chosen", input="router_probs")
EXPERT_GATE = Point("gate", "s6.7", ("T", "K", "Fe"), about="each chosen expert's x·W_gate")
EXPERT_UP = Point("up", "s6.7", ("T", "K", "Fe"), about="each chosen expert's x·W_up")
EXPERT_ACT = Point("act", "s6.7", ("T", "K", "Fe"), editable=True, about="each chosen expert's act(gate) ⊙ up")
EXPERT_DOWN = Point("down", "s6.7", ("T", "D"), editable=True,
                    about="the chosen experts' outputs (·W_down of each), weighted and summed: the feed-forward's "
                          "output")

MOE_POINTS = (ROUTER_LOGITS, ROUTER_PROBS, EXPERT_WEIGHTS, EXPERT_GATE, EXPERT_UP, EXPERT_ACT, EXPERT_DOWN)
# the points whose formulas make the router's one line in explain (the choice rule, the experts' gated activation,
# the weighted sum), in every language
ROUTER_LINE = (ROUTER_PROBS.name, EXPERT_WEIGHTS.name, EXPERT_ACT.name, EXPERT_DOWN.name)


def expert_points(points) -> tuple[str, str]:
    """The points where experts are ablated and scaled, as the model declares them (model.points.Points): the first
    editable feed-forward point with an expert axis (the router's scores: an ablated expert's is -inf) and the last
    (the weights its output is summed with). None when the model has no experts."""
    named = [p.name for p in points.layer if p.where == "ffn" and p.editable and "E" in p.axes]
    return (named[0], named[-1]) if named else None


def moe_layers(config) -> list[int]:
    """The layers of a model's config whose feed-forward is a mixture of experts (none for a dense model)."""
    if not config.n_experts:
        return []
    return [i for i in range(config.n_layers) if i not in (config.dense_layers or ())]


def chosen_experts(probs, weights, k: int):
    """The K experts each token ran, (..., T, K), most probable first: those with a weight (expert_weights, 0 for the
    others), ranked by router_probs. Not simply the K most probable: a router may choose with a bias or within groups
    (DeepSeek V3), and an ablated expert has no weight. Tensors (..., T, E); no torch import here."""
    return probs.float().masked_fill(weights == 0, float("-inf")).topk(k, dim=-1).indices
