"""A mixture-of-experts feed-forward (s6.7), the part Mixtral and Qwen3-MoE change in Llama's layer.

Notation as in model/transformer.py, plus
    E   experts of the layer         K   experts chosen per token         Fe  one expert's hidden width
    N   tokens of the call, B·T

The layer has E SwiGLU experts and a router W_r (E, D). For each token x (the ffn_norm output):
    p = softmax(x W_rᵀ), in float32                          the router's probabilities over the E experts
    chosen = the K largest p_e                               (ties: the lower index, as torch.topk)
    w_e = p_e / Σ_chosen p  if the family renormalises,     else w_e = p_e
    out = Σ_chosen w_e · W_down,e (act(x W_gate,eᵀ) ⊙ x W_up,eᵀ)
It is computed expert by expert, as transformers does: each expert gathers the tokens that chose it, runs on those
rows only, and adds its weighted output back at their places (index_add), so a token costs K experts, not E. A decode
step's single token skips the gathering (one_token): the same K outputs added in the same order, the same sums.

Points (model/moe_points.py): router_logits (editable: an ablated expert's score is -inf, so the next best is
chosen), router_probs, expert_weights (editable: scaling an expert's weight scales its output), then Llama's gate,
up, act with an axis K (each token's chosen experts, most probable first) and down, the weighted sum.

Weights: the router is a matrix (E, D); the experts are three stacks of E matrices (Weight kind "experts"):
W_gate and W_up (E, Fe, D), W_down (E, D, Fe). A GGUF holds each stack as one 3-D tensor (ffn_gate_exps, ...); an HF
directory one tensor per expert (experts.{e}.gate_proj.weight, Mixtral's experts.{e}.w1.weight), stacked at load.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.family import say
from llmtrace.model.maths import Op, op
from llmtrace.model.moe_points import EXPERT_WEIGHTS, MOE_POINTS
from llmtrace.model.points import Point, Source, Weight
from llmtrace.model.transformer import ACTIVATIONS, EXPERTS, Block, FeedForward, Module
from llmtrace.units import plural


class ExpertMatrices(nn.Module):
    """E matrices of one shape, (E, out, in), used one expert at a time: y = x W_eᵀ (+ b_e where the family has
    biases: gpt-oss). (--keep-quantized and --fast replace it by a module of the same call that holds the GGUF's
    blocks: model.quant.QuantExperts, model.fast.)"""

    def __init__(self, n: int, out_features: int, in_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))  # (E, out, in)
        self.bias = nn.Parameter(torch.empty(n, out_features)) if bias else None  # (E, out)

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])  # (n, in) -> (n, out)


class MoEFeedForward(Module):
    """The router and E SwiGLU experts; each token runs through its K most probable experts (module docstring)."""

    WHERE = "ffn"
    POINTS = MOE_POINTS
    # each expert's tensors in an HF directory, relative to the feed-forward's prefix (Qwen3-MoE's names; Mixtral's
    # file says w1, w3, w2)
    HF_EXPERTS = {"gate": "experts.{e}.gate_proj.weight", "up": "experts.{e}.up_proj.weight",
                  "down": "experts.{e}.down_proj.weight"}

    def __init__(self, config):
        super().__init__()
        e = config.parts[EXPERTS]  # its own config part: E, K, one expert's width, whether the K weights renormalise
        self.n_experts, self.k = int(e["n"]), int(e["k"])
        self.expert_dim = e.get("width") or config.ffn_dim  # Fe
        self.renormalise = bool(e.get("renormalise", True))
        self.act, self.act_name = ACTIVATIONS[config.ffn_act], config.ffn_act
        # the router's declared variant (ModelConfig.parts["router"], none for Mixtral's): its score ("softmax" or
        # "sigmoid"), a bias added to the scores for choosing only, a choice within the best `groups_used` of
        # `groups` groups of experts (a group's score: the sum of its top two, or its best), and a factor on the
        # chosen weights (DeepSeek's routed_scaling_factor)
        r = config.parts.get("router", {})
        self.score, self.scale = r.get("score", "softmax"), float(r.get("scale", 1.0))
        self.groups, self.groups_used = int(r.get("groups") or 1), int(r.get("groups_used") or 1)
        self.group_score = r.get("group_score", "top2_sum")
        E, D, Fe = self.n_experts, config.d_model, self.expert_dim
        self.router = nn.Linear(D, E, bias=False)  # (E, D): W_r
        self.choice_bias = nn.Parameter(torch.zeros(E)) if r.get("choice_bias") else None  # (E,)
        self.w_gate = ExpertMatrices(E, Fe, D)  # (E, Fe, D)
        self.w_up = ExpertMatrices(E, Fe, D)  # (E, Fe, D)
        self.w_down = ExpertMatrices(E, D, Fe)  # (E, D, Fe)

    def weights(self) -> tuple[Weight, ...]:
        hf = self.HF_EXPERTS
        bias = (Weight("choice_bias", ("E",), "s6.7", "vector", (Source(
            "gate.e_score_correction_bias", "exp_probs_b.bias", "E", "b_choice"),)),) if self.choice_bias is not None else ()
        return (Weight("router.weight", ("E", "D"), "s6.7", "matrix",
                       (Source("gate.weight", "ffn_gate_inp.weight", "E", "W_router"),)), *bias,
                Weight("w_gate.weight", ("E", "Fe", "D"), "s6.7", "experts",
                       (Source(hf["gate"], "ffn_gate_exps.weight", "E", "W_gate"),)),
                Weight("w_up.weight", ("E", "Fe", "D"), "s6.7", "experts",
                       (Source(hf["up"], "ffn_up_exps.weight", "E", "W_up"),)),
                Weight("w_down.weight", ("E", "D", "Fe"), "s6.7", "experts",
                       (Source(hf["down"], "ffn_down_exps.weight", "E", "W_down"),)))

    # The choice rule, a declared variant: "softmax_topk" (Mixtral, Qwen3-MoE: softmax over the E experts, keep the
    # top K, renormalised where the family does) or "topk_softmax" (gpt-oss: the top K of the raw logits, then a
    # softmax over those K alone; router_probs is then that softmax, 0 for the experts not chosen).
    choice = "softmax_topk"

    def maths(self, x: str, plan) -> dict[str, Op]:
        """The router's three steps (in the order of its choice rule), then each chosen expert's gated
        activation, weighted and summed; a bias wherever the family's matrices have one."""
        if self.choice == "topk_softmax":  # the raw logits chosen, then their softmax: probs and weights are one
            chosen = op("router", ["router_logits"], k=self.k, renormalise=False, order="topk_softmax")
            probs, weights = chosen, chosen
        else:
            probs = (op("sigmoid", ["router_logits"]) if self.score == "sigmoid" else
                     op("softmax", ["router_logits"], sink=None))
            weights = op("router", ["router_probs"], ["choice_bias"] if self.choice_bias is not None else [],
                         k=self.k, renormalise=self.renormalise, order=f"{self.score}_topk",
                         **self._choice_consts())
        return {"router_logits": op("matmul", [x], self._with_bias("router")),
                "router_probs": probs, "expert_weights": weights,
                "gate": op("expert_matmul", [x, "expert_weights"], self._with_bias("w_gate")),
                "up": op("expert_matmul", [x, "expert_weights"], self._with_bias("w_up")),
                "act": self.glu_op(),
                "down": op("expert_mix", ["act", "expert_weights"], self._with_bias("w_down"))}

    def _choice_consts(self) -> dict:
        """The router's declared variant, where it has one (none in Mixtral's declaration)."""
        out = {}
        if self.groups > 1:
            out.update(groups=self.groups, groups_used=self.groups_used, group_score=self.group_score)
        if self.scale != 1.0:
            out["scale"] = self.scale
        return out

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        """The K experts each token runs, (B, T, K): the K best scores, each plus the choice bias where the router has
        one, among the experts of the best `groups_used` groups where it groups them."""
        pick = probs if self.choice_bias is None else probs + self.choice_bias
        pick = pick.masked_fill(probs == 0, float("-inf"))  # an ablated expert (score −∞) is not chosen, bias or not
        if self.groups > 1:
            g = pick.unflatten(-1, (self.groups, -1))  # (B, T, groups, E / groups)
            best = g.topk(2, dim=-1).values.sum(-1) if self.group_score == "top2_sum" else g.amax(-1)
            # 0 on the kept groups, −∞ on the others, added to their experts' scores (+0 changes no score)
            off = torch.full_like(best, float("-inf")).scatter_(-1, best.topk(self.groups_used, dim=-1).indices, 0.0)
            pick = (g + off.unsqueeze(-1)).flatten(-2)
        return pick.topk(self.k, dim=-1).indices

    def glu_op(self) -> Op:
        """The declared operation of `glu`."""
        return op("glu", ["gate", "up"], act=self.act_name, clamp=None)

    def _with_bias(self, module: str) -> list[str]:
        has_bias = getattr(getattr(self, module), "bias", None) is not None
        return [f"{module}.weight"] + ([f"{module}.bias"] if has_bias else [])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router: x (B, T, D) -> each token's K chosen experts (B, T, K), most probable first, and their
        weights (B, T, K) in float32."""
        logits = self.point("router_logits", self.router(x))  # (B, T, E)
        if self.choice == "topk_softmax":
            top_l, top_e = logits.topk(self.k, dim=-1)  # (B, T, K) each: the K largest scores
            top_p = F.softmax(top_l, dim=-1, dtype=torch.float32)  # (B, T, K): a softmax over the chosen K
            probs = self.point("router_probs", torch.zeros_like(logits, dtype=torch.float32).scatter(-1, top_e, top_p))
        else:
            probs = (logits.float().sigmoid() if self.score == "sigmoid" else
                     F.softmax(logits, dim=-1, dtype=torch.float32))
            probs = self.point("router_probs", probs)  # (B, T, E)
            if self.choice_bias is None and self.groups == 1:
                top_p, top_e = probs.topk(self.k, dim=-1)  # (B, T, K) each
            else:
                top_e = self.choose(probs)
                top_p, order = probs.gather(-1, top_e).sort(dim=-1, descending=True)  # most probable first
                top_e = top_e.gather(-1, order)
        if self.renormalise:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            top_p = top_p * self.scale
        if self.hook is not None:  # the weights as one (B, T, E) tensor, 0 where not chosen: a hook may change them
            given = torch.zeros_like(probs).scatter(-1, top_e, top_p)
            weights = self.point("expert_weights", given)
            if weights is not given and bool((weights != 0).logical_and(given == 0).any()):
                top_p, top_e = weights.topk(self.k, dim=-1)  # weight given to an expert not chosen: the K largest run
            else:
                top_p = weights.gather(-1, top_e)
        return top_e, top_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        K, Fe = self.k, self.expert_dim
        top_e, top_p = self.route(x)  # (B, T, K) each
        h = x.reshape(-1, D)  # (N, D)
        if h.size(0) == 1 and self.hook is None:  # one token, nothing observed: a decode step
            return self.output(x, self.one_token(h, top_e.view(K), top_p.view(K)).view(B, T, D))
        chosen, weight = top_e.view(-1, K), top_p.view(-1, K)  # (N, K) each
        out = torch.zeros_like(h)  # (N, D)
        rows = {e: (chosen == e).nonzero(as_tuple=True) for e in chosen.unique().tolist()}  # expert -> (tokens, slot)
        if self.hook is not None:  # each token's chosen experts' gate, up and act, (B, T, K, Fe), as points
            seen = self.expert_steps(h, rows)  # (N, K, Fe) each
            self.point("gate", seen["gate"].view(B, T, K, Fe))
            self.point("up", seen["up"].view(B, T, K, Fe))
            act = self.point("act", seen["act"].view(B, T, K, Fe)).view(-1, K, Fe)  # the experts' W_down read it
        for e, (tokens, slot) in rows.items():  # expert by expert, in index order (as transformers adds them)
            a = act[tokens, slot] if self.hook is not None else self.expert_act(h[tokens], e)  # (n, Fe)
            y = self.w_down(a, e)  # (n, D)
            out.index_add_(0, tokens, (y * weight[tokens, slot, None]).to(out.dtype))
        return self.output(x, out.view(B, T, D))  # (B, T, D)

    def one_token(self, h: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One token's weighted sum, h (1, D), chosen and weight (K,): its experts' outputs added in index order, the
        sums forward's index_add makes, without gathering rows for each expert (the cost of a decode step)."""
        experts, weights = chosen.tolist(), weight.tolist()  # each float32 weight exactly, as a Python float
        out = None
        for j in sorted(range(self.k), key=experts.__getitem__):
            e = experts[j]
            y = (self.w_down(self.expert_act(h, e), e) * weights[j]).to(h.dtype)  # (1, D)
            out = y if out is None else out + y
        return out

    def expert_act(self, xe: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's gated activation of its tokens' rows xe (n, D) -> (n, Fe)."""
        return self.glu(self.w_gate(xe, e), self.w_up(xe, e))

    def expert_steps(self, h: torch.Tensor, rows: dict) -> dict[str, torch.Tensor]:
        """Every chosen expert's gate, up and act of h (N, D), laid out by token and slot: (N, K, Fe) each."""
        seen = {name: h.new_zeros(h.size(0), self.k, self.expert_dim) for name in ("gate", "up", "act")}
        for e, (tokens, slot) in rows.items():
            xe = h[tokens]  # (n, D)
            gate, up = self.w_gate(xe, e), self.w_up(xe, e)  # (n, Fe) each
            for name, value in (("gate", gate), ("up", up), ("act", self.glu(gate, up))):
                seen[name][tokens, slot] = value
        return seen

    def output(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The feed-forward's output from the chosen experts' weighted sum (B, T, D): that sum itself here."""
        return self.point("down", routed)

    def flops(self, n_tokens: int) -> list[tuple]:
        """Over T tokens: the router's scores, then K experts a token (each a gated FFN of width Fe)."""
        T, D, E, K, Fe = n_tokens, self.router.in_features, self.n_experts, self.k, self.expert_dim
        return [("router", ("router scores", "路由器分数"), "2·T·D·E", 2 * T * D * E),
                ("ffn", ("K gated experts a token", "每个词元 K 个门控专家"),
                 "K·(2·T·D·2Fe + 2·T·Fe·D)", K * (2 * T * D * 2 * Fe + 2 * T * Fe * D))]

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """An expert's gated activation: act(gate) ⊙ up (a family with a clamped GLU changes it: gpt-oss)."""
        return self.act(gate) * up

    def direct_points(self) -> tuple[str, ...]:
        """What its split reads (model.wiring): the expert weights, and the shared experts' output where it has them."""
        shared = getattr(self, "shared", None)
        return (EXPERT_WEIGHTS.name,) + ((shared.output_point(),) if shared is not None else ())

    def direct_parts(self, x: torch.Tensor, got) -> dict[str, tuple[str, torch.Tensor]]:
        """Its output at one position by expert: each chosen expert run again on the input x (D,), times its weight
        ("expertE"); the shared experts' output as one part ("shared") where it has them."""
        weights = got(EXPERT_WEIGHTS.name)  # (E,), 0 where not chosen
        out = {}
        for e in weights.nonzero()[:, 0].tolist():
            y = self.w_down(self.expert_act(x[None], e), e)  # (1, D)
            out[f"expert{e}"] = ("expert", y[0].float() * weights[e].float())
        shared = getattr(self, "shared", None)
        if shared is not None:
            out["shared"] = ("shared_experts", got(shared.output_point()).float())
        return out


# shared experts (DeepSeek V2/V3): a SwiGLU every token runs, added to the routed experts' sum
ROUTED_DOWN = Point("routed_down", "s6.7", ("T", "D"), about="the chosen experts' outputs, weighted and summed")
SHARED_GATE = Point("shared_gate", "s6.7", ("T", "Fs"), about="the shared experts' x·W_gate: every token runs them")
SHARED_UP = Point("shared_up", "s6.7", ("T", "Fs"), about="the shared experts' x·W_up")
SHARED_ACT = Point("shared_act", "s6.7", ("T", "Fs"), about="the shared experts' act(gate) ⊙ up")
SHARED_DOWN = Point("shared_down", "s6.7", ("T", "D"), about="the shared experts' output: ·W_down")
MOE_SHARED_DOWN = replace(MOE_POINTS[-1], about="the routed experts' weighted sum plus the shared experts' output: "
                                                "the feed-forward's output")


class SharedExperts(FeedForward):
    """The shared experts of a layer as one SwiGLU of width Fs (n_shared_experts · one expert's width), which every
    token runs beside its routed experts."""

    POINTS = (SHARED_GATE, SHARED_UP, SHARED_ACT, SHARED_DOWN)

    def __init__(self, config, width: int):
        Module.__init__(self)
        self.ffn_dim = width
        self.act, self.act_name = ACTIVATIONS[config.ffn_act], config.ffn_act
        self.w_gate_up = nn.Linear(config.d_model, 2 * width, bias=False)  # (2Fs, D): W_gate rows, then W_up
        self.w_down = nn.Linear(width, config.d_model, bias=False)  # (D, Fs)

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_gate_up.weight", ("2*Fs", "D"), "s6.7", "matrix", (
                    Source("gate_proj.weight", "ffn_gate_shexp.weight", "Fs", "W_gate,shared"),
                    Source("up_proj.weight", "ffn_up_shexp.weight", "Fs", "W_up,shared"))),
                Weight("w_down.weight", ("D", "Fs"), "s6.7", "matrix",
                       (Source("down_proj.weight", "ffn_down_shexp.weight", "D", "W_down,shared"),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split_with_sizes([self.ffn_dim, self.ffn_dim], dim=-1)  # (B, T, Fs) each
        self.point(SHARED_GATE.name, gate)
        self.point(SHARED_UP.name, up)
        act = self.point(SHARED_ACT.name, self.glu(gate, up))
        return self.point(SHARED_DOWN.name, self.w_down(act))  # (B, T, D)

    def maths(self, x: str, plan) -> dict[str, Op]:
        inner = super().maths(x, plan)
        names = dict(zip(("gate", "up", "act", "down"), (p.name for p in self.POINTS)))
        return {names[n]: Op(o.kind, tuple(names.get(i, i) for i in o.inputs), o.weights, o.consts)
                for n, o in inner.items()}


class SharedExpertsMoE(MoEFeedForward):
    """Routed experts and shared experts side by side: output = Σ_chosen w_e · expert_e(x) + shared(x). The shared
    width comes from the config part "shared_experts" (its axis Fs)."""

    POINTS = MOE_POINTS[:-1] + (ROUTED_DOWN,) + SharedExperts.POINTS + (MOE_SHARED_DOWN,)
    CHILDREN = {"shared": ("shared_experts", "")}

    def __init__(self, config):
        super().__init__(config)
        self.shared = SharedExperts(config, config.parts["shared_experts"]["axes"]["Fs"])

    def flops(self, n_tokens: int) -> list[tuple]:
        """The router and the routed experts, then the shared experts every token runs."""
        T, D, Fs = n_tokens, self.router.in_features, self.shared.ffn_dim
        return [*super().flops(n_tokens),
                ("shared", ("shared experts", "共享专家"), "2·T·D·2Fs + 2·T·Fs·D", 2 * T * D * 2 * Fs + 2 * T * Fs * D)]

    def output(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        routed = self.point(ROUTED_DOWN.name, routed)
        return self.point("down", routed + self.shared(x))

    def maths(self, x: str, plan) -> dict[str, Op]:
        out = super().maths(x, plan)
        out[ROUTED_DOWN.name] = out.pop("down")
        shared = {n: o.prefixed("shared.") for n, o in self.shared.maths(x, plan).items()}
        return out | shared | {"down": op("add", [ROUTED_DOWN.name, SHARED_DOWN.name])}


class MoEBlock(Block):
    """A decoder layer whose feed-forward is a mixture of experts, except in the layers the config keeps dense
    (config.dense_layers: Qwen3-MoE's mlp_only_layers and decoder_sparse_step), which run Llama's FeedForward and
    report its points (gate, up, act, down: a subset of the declared ones)."""

    feed_forward = MoEFeedForward
    dense_feed_forward = FeedForward

    def feed_forward_of(self, config, layer: int) -> Module:
        if layer in (config.dense_layers or ()):
            return self.dense_feed_forward(config)
        return self.feed_forward(config)


def active_weights(config, declared) -> tuple[int, int]:
    """(weights a token uses, weights the model holds): a token runs K of each MoE layer's E experts, so of every
    expert stack it uses K/E; everything else it uses whole. `declared`: model.points.DeclaredWeight list."""
    import math

    total = active = 0
    for w in declared:
        n = math.prod(w.shape)
        total += n
        active += n * config.n_experts_used // config.n_experts if w.weight.kind == "experts" else n
    return active, total


def moe_fields(n_experts, experts_key: str, n_used, used_key: str) -> dict:
    """E and K from a checkpoint's fields (named by their keys in the errors): 1 ≤ K ≤ E."""
    from llmtrace.errors import LlmtraceError

    for value, key in ((n_experts, experts_key), (n_used, used_key)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
            raise LlmtraceError(f"the checkpoint's {key} is {value!r}; a mixture of experts needs a whole number ≥ 1")
    n_experts, n_used = int(n_experts), int(n_used)
    if n_used > n_experts:
        raise LlmtraceError(f"the checkpoint's {used_key} {n_used} is more than its {experts_key} {n_experts}")
    return {"n_experts": int(n_experts), "n_experts_used": int(n_used)}


def moe_changes(c) -> list[str]:
    """What a mixture of experts changes in Llama's layer, with the checkpoint's numbers."""
    E, K, Fe = c.n_experts, c.n_experts_used, c.expert_ffn_dim or c.ffn_dim
    out = [say(MOE_WORDS, "experts" if c.norm_topk_prob else "experts_raw", e=E, w=f"{Fe:,}", k=K,
               top=plural(K, "expert"))]
    dense = c.dense_layers or []
    if dense:
        one = len(dense) == 1  # the layer numbers are the count here: 'layer 3 keeps', 'layers 0, 3 keep'
        out.append(say(MOE_WORDS, "dense_one" if one else "dense", which=", ".join(map(str, dense)), n=c.n_layers,
                       f=f"{c.ffn_dim:,}"))
    return out


# What a mixture of experts changes, each line in English and Chinese (model.family.say); a family that says them
# declares these words beside its own (Family.words).
MOE_WORDS = {
    "experts": ("feed-forward: {e} SwiGLU experts (width {w}) and a router; p = softmax(x·W_routerᵀ) in float32, each "
                "token runs its top {top}, weights renormalised to sum to 1; output Σ weight·expert(x)",
                "前馈网络：{e} 个 SwiGLU 专家（宽 {w}）和一个路由器；p = softmax(x·W_routerᵀ)（float32），每个词元运行"
                "概率最高的 {k} 个专家，权重重新归一化为和 1；输出 Σ 权重·专家(x)"),
    "experts_raw": ("feed-forward: {e} SwiGLU experts (width {w}) and a router; p = softmax(x·W_routerᵀ) in float32, "
                    "each token runs its top {top}, weights as the softmax gave them (not renormalised); output "
                    "Σ weight·expert(x)",
                    "前馈网络：{e} 个 SwiGLU 专家（宽 {w}）和一个路由器；p = softmax(x·W_routerᵀ)（float32），每个词元"
                    "运行概率最高的 {k} 个专家，权重保持 softmax 给出的值（不重新归一化）；输出 Σ 权重·专家(x)"),
    "dense_one": ("layer {which} of {n} keeps a dense SwiGLU feed-forward (width {f})",
                  "{n} 层中的第 {which} 层保留稠密的 SwiGLU 前馈网络（宽 {f}）"),
    "dense": ("layers {which} of {n} keep a dense SwiGLU feed-forward (width {f})",
              "{n} 层中的第 {which} 层保留稠密的 SwiGLU 前馈网络（宽 {f}）"),
}
