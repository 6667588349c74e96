"""The maths a model declares: for every point, the operation that computed it, and for every layer, its plan.

No torch here: a saved trace carries this declaration (its `run` event's `maths`), and `show`, the report and explain
render each step's formula from it, never from a step name, a config field or Llama's defaults.

An *operation* (`Op`) names what made a point: its kind (a word of `OPS`), its operands (`inputs`: point names), the
weights it reads (`weights`: parameter names of the model, "layers.3.attn.wqkv.weight") and its constants (`consts`:
numbers and words, with this layer's values: the RoPE base of *this* layer, the window of *this* layer). An operand
is a point of the same scope (the layer's own, or the model's outside the layers); "^name" is that point of the layer
before (a layer's `resid_pre` is the previous layer's `resid_post`; the final norm reads the last layer's), and in
layer 0 it is the model's `stream_in` (the embedding, or Gemma's embedding × √D). "ids" are the token ids.

An operand named in an operation's `cached` constant spans every slot of the KV cache, not only this pass's tokens:
the keys a query is scored against and the values it reads are this pass's `k_rope` and `v` after every earlier
pass's. An operand named in its `carried` constant is a recurrent state as the previous pass of the same cache left
it (linear attention's S, its convolution's last inputs), zeros before the first pass: the state, not the slots,
is what such a layer remembers.

A *layer plan* (`LayerPlan`) is what differs between layers, worked out once by the model: the attention (global,
a window of W, or none), the RoPE (base, rotary width, scaling) or none, a dense feed-forward or experts, and the
norms present. Layers with the same plan share one table of operations in the record (`kinds`, `layer_kind`).

A family that changes a step declares that step's operation in its own file (model.families); a new kind of step is
one word added to `OPS` and one function in model.recompute, which applies any declared operation to recorded inputs
in float64: the declaration's own check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

# The vocabulary: kind -> the formula as the views write it (the catalogues translate it; model.recompute computes it)
OPS = {
    "lookup": "x = E[id]",  # the embedding's row of each token id
    "scale": "y = c · x",  # a constant factor (Gemma's √D), or a learned one (a weight: Gemma 4's layer scalar)
    "rmsnorm": "y = x / √(mean(x²) + ε) · γ",  # over the last axis (the width, a head, or the whole projection)
    "matmul": "y = x · Wᵀ (+ b)",  # a projection; `split` heads after it, or `merge` the heads before it
    "rope": "(x_i, x_i+d/2) rotated by pos · θ_i",  # θ_i = base^(-2i/d) over the rotary width d; or no rotation
    "cache_write": "K, V → cache[slots]",  # the slots this pass writes
    "repeat_kv": "K_h = K_{h // G}",  # GQA: each KV head seen by its G query heads
    "scores": "s = q · kᵀ · scale",  # then the mask (−∞ outside it) and, where declared, the soft-cap
    "softcap": "y = cap · tanh(x / cap)",
    "softmax": "p = exp(s − max) / Σ exp(s − max)",  # with a sink: one more logit per head in the sum, dropped after
    "weighted_sum": "o = Σ_s p_s · v_s",  # P·V, each query head reading its KV head
    "glu": "y = act(gate) ⊙ up",  # SwiGLU (SiLU), GeGLU (GELU, tanh approximation), or a clamped GLU
    "add": "y = a + b",  # the residual stream
    "select_last": "x_last = x[-1]",
    "router": "w = top-k(softmax(logits))",  # an expert's weight: its probability if chosen (renormalised), else 0
    "expert_matmul": "y_k = x · W_{e_k}ᵀ",  # each of the token's K chosen experts
    "expert_mix": "y = Σ_k w_k · (act_k · W_down,e_kᵀ)",
    "stream": "x = the stream",  # a layer's input: the previous layer's output (no computation)
    # linear attention (Qwen3.5's Gated DeltaNet): a fixed-size state instead of a KV cache
    "conv1d": "y_t = act(Σ_j w_j · x_{t−Kc+1+j} (+ b))",  # causal, depthwise, over the carried last Kc−1 inputs
    "l2norm": "y = x / √(Σx² + ε) · c",  # per head, over the head's width
    "slice": "y = x[a:b]",  # some columns of a point, split into heads
    "sigmoid": "y = σ(x)",
    "decay": "α = exp(A · softplus(x + dt_bias))",  # A = −exp(A_log) < 0, so 0 < α < 1
    "delta_rule": "S ← α·S + k⊗β(v − Sᵀk);  o = Sᵀq",  # token by token, from the carried S
    "gated_rmsnorm": "y = x / √(mean(x²) + ε) · γ · silu(z)",
    "gate": "y = x · σ(g)",  # an output gate
    # multi-head latent attention (DeepSeek's MLA): K and V up-projected from a cached latent
    "latent_up": "y_h = c · W_h",  # each head's keys (or values) from every cached latent c
    "mla_scores": "s = (q_nope · k_nopeᵀ + q_rope · k_ropeᵀ) · scale",  # then the mask
    # Mamba2 (model.kinds.mamba2): a selective state-space layer, a fixed-size state per head
    "softplus": "Δ = softplus(x + dt_bias)",  # the step of each head and token, > 0
    "ssm_decay": "a = exp(Δ · A)",  # A = −exp(A_log) < 0, so 0 < a < 1
    "ssm_scan": "h ← a·h + Δ·x⊗B;  y = C·h + D·x",  # token by token, from the carried h
    "group_gated_rmsnorm": "y = g / √(mean_group(g²) + ε) · γ,  g = x · silu(z)",
    "mul": "y = a ⊙ b",  # element by element (LFM2's short convolution: its input and output gates)
}

PREV = "^"  # an operand of the layer before (see the module docstring)
OF_LAYER = "@"  # "@j:x", the point x of layer j: an earlier layer's keys and values that a KV-shared layer reads


@dataclass(frozen=True)
class Op:
    """One point's operation: `kind` (a word of OPS), the points it reads, the weights it reads, its constants."""

    kind: str
    inputs: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    consts: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.kind not in OPS:
            raise ValueError(f"unknown operation {self.kind!r}: the vocabulary is {', '.join(OPS)}")

    def const(self, key: str, default: Any = None) -> Any:
        return dict(self.consts).get(key, default)

    def record(self) -> dict:
        return {"op": self.kind, "inputs": list(self.inputs), "weights": list(self.weights),
                "consts": dict(self.consts)}

    def prefixed(self, prefix: str) -> "Op":
        """The same operation with its weights named from a parent module ("attn." + "wqkv.weight")."""
        return Op(self.kind, self.inputs, tuple(prefix + w for w in self.weights), self.consts)


def op(kind: str, inputs=(), weights=(), **consts) -> Op:
    """Op(kind, ...) with its constants as keywords; None values are kept (a declared absence: no soft-cap)."""
    return Op(kind, tuple(inputs), tuple(weights), tuple(consts.items()))


def op_from_record(r: dict) -> Op:
    consts = dict(r.get("consts") or {})
    if consts.get("order") in LEGACY_ORDERS:  # a trace written when the order was an English phrase
        consts["order"] = LEGACY_ORDERS[consts["order"]]
    return Op(r["op"], tuple(r.get("inputs") or ()), tuple(r.get("weights") or ()), tuple(consts.items()))


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does differently from the others, decided once by the model.

    `attention`: which keys a query reads, "global" (every earlier key), "window" (at most the last `window` keys),
    or "none" in a layer whose mixer is not attention; `rope`: {"base", "rotary_dim", "head_dim", "scaling", ...} or
    None (no rotation in this layer); `ffn`: "dense" or "experts" ({"n": E, "k": K} in `experts`); `norms`: the norm
    points the layer has, in forward order. `mixer`: the key of the layer's kind (model.kinds: "attention",
    "linear_attention", ...), and `headings`: the titles its kind teaches its seed steps under ({step: [English,
    Chinese]}, with "summary": one line on the kind), where they are not the seed table's."""

    attention: str = "global"
    window: Optional[int] = None
    rope: Optional[dict] = None
    ffn: str = "dense"
    experts: Optional[dict] = None
    norms: tuple[str, ...] = ()
    mixer: str = "attention"
    headings: Optional[dict] = None

    def record(self) -> dict:
        return {"attention": self.attention, "window": self.window, "rope": self.rope, "ffn": self.ffn,
                "experts": self.experts, "norms": list(self.norms), "mixer": self.mixer,
                "headings": self.headings or {}}

    def heading(self, step: str, lang: str = "en") -> Optional[str]:
        """This layer's title for a seed step, where its kind gives its own (None: the seed table's)."""
        h = (self.headings or {}).get(step)
        return None if not h else h[1 if lang == "zh" and len(h) > 1 else 0]


def plan_from_record(r: dict) -> LayerPlan:
    attention = r.get("attention", "global")
    mixer = r.get("mixer") or ("linear_attention" if attention == "linear" else "attention")  # a trace before kinds
    return LayerPlan("none" if attention == "linear" else attention, r.get("window"), r.get("rope"),
                     r.get("ffn", "dense"), r.get("experts"), tuple(r.get("norms") or ()), mixer,
                     r.get("headings") or None)


@dataclass(frozen=True)
class Maths:
    """A model's maths: the operations of the points outside the layers (`model`), of each layer's points
    (`layers[i]`), each layer's plan, and the model point that enters layer 0 (`stream_in`)."""

    model: dict = field(default_factory=dict)  # point -> Op
    layers: tuple = ()  # (point -> Op) per layer
    plan: tuple = ()  # LayerPlan per layer
    stream_in: str = "embed"

    def op(self, layer: Optional[int], name: str) -> Optional[Op]:
        """The operation that made point `name` of `layer` (None: outside the layers); None if none is declared."""
        table = self.model if layer is None else (self.layers[layer] if 0 <= layer < len(self.layers) else {})
        return table.get(name)

    def operand(self, layer: Optional[int], ref: str) -> tuple[Optional[int], str]:
        """Where an operand lives: (layer or None, point name). "^x" in layer L is x of layer L − 1 (in layer 0:
        the model's stream_in); "^x" outside the layers is x of the last layer; a name not of the layer's table is
        the model's."""
        if ref.startswith(OF_LAYER):  # "@j:x": x of layer j (a KV-shared layer reads layer j's keys and values)
            j, _, name = ref[len(OF_LAYER):].partition(":")
            return int(j), name
        if ref.startswith(PREV):
            name = ref[len(PREV):]
            if layer is None:
                return len(self.layers) - 1, name
            return (layer - 1, name) if layer > 0 else (None, self.stream_in)
        if layer is not None and ref not in self.layers[layer] and ref in self.model:
            return None, ref
        return layer, ref

    def record(self) -> dict:
        """The run event's `maths`: layers of one plan and one table of operations share an entry of `kinds`."""
        kinds: list[dict] = []
        keys: list[str] = []
        layer_kind = []
        for table, plan in zip(self.layers, self.plan):
            entry = {"plan": plan.record(), "ops": {n: o.record() for n, o in table.items()}}
            key = json.dumps(entry, sort_keys=True, default=str)
            if key not in keys:
                keys.append(key)
                kinds.append(entry)
            layer_kind.append(keys.index(key))
        return {"stream_in": self.stream_in, "model": {n: o.record() for n, o in self.model.items()},
                "kinds": kinds, "layer_kind": layer_kind}

    @classmethod
    def from_record(cls, r: Optional[dict]) -> Optional["Maths"]:
        if not r:
            return None
        kinds = [({n: op_from_record(o) for n, o in k["ops"].items()}, plan_from_record(k["plan"])) for k in r["kinds"]]
        return cls({n: op_from_record(o) for n, o in r.get("model", {}).items()},
                   tuple(kinds[k][0] for k in r["layer_kind"]), tuple(kinds[k][1] for k in r["layer_kind"]),
                   r.get("stream_in", "embed"))


# ----------------------------------------------------------------------------------------------------------------
# names the views say: one place


GLU_NAMES = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}


def glu_name(o: Op) -> str:
    """SwiGLU, GeGLU, or the family's own name for its gated activation (a clamped SwiGLU)."""
    return o.const("name") or GLU_NAMES.get(o.const("act"), f"{o.const('act')} GLU")


def rope_words(plan: LayerPlan, words: Optional[dict] = None) -> str:
    """One line on this layer's RoPE: its base and rotary width, or none (in `words`' language: WORDS)."""
    W = WORDS if not words else {**WORDS, **words}
    r = plan.rope
    if not r:
        return W["rope_none"]
    width = W["rope_width"].format(dr=r["rotary_dim"], dh=r["head_dim"]) if r.get("rotary_dim") != r.get("head_dim") else ""
    kind = (r.get("scaling") or {}).get("rope_type")
    return W["rope_base"].format(base=_n(r["base"])) + width + (
        W["rope_scaled"].format(kind=kind) if kind and kind != "default" else "")


def _n(x: float) -> str:
    """1,000,000 rather than 1e+06: a RoPE base as people write it."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,g}"


def attention_words(plan: LayerPlan) -> str:
    if plan.heading("summary"):  # a kind of layer other than attention says what it is
        return plan.heading("summary")
    if plan.attention == "window":
        return f"a window of {plan.window:,} keys"
    return "global: every earlier key" if plan.attention == "global" else plan.attention


ACT_WORDS = {"silu": "silu", "gelu_tanh": "gelu_tanh"}


def _w(o: Op) -> str:
    """A weight's short name: the last two parts of its parameter ("attn.wqkv.weight" -> "wqkv")."""
    return o.weights[0].split(".")[-2] if o.weights else "W"


# The words of the formulas, by key: English here; a page in another language passes its own (its catalogue's
# "maths.*" entries), so a formula is said in the page's language. {name} marks a value.
WORDS = {
    "per_head": ", per head (width Dh)",
    "over_whole": ", over the whole {axis}",
    "gamma_1w": " (γ = 1 + w)",
    "no_rotation": "{name} = {x}: no rotation in this layer (attention here sees content, not position)",
    "rope": "{name}: pairs ({x}_i, {x}_i+{half}) turned by pos·θ_i, θ_i = {base}^(−2i/{dr})",
    "rope_part": " (the first {dr} of {dh} dims)",
    "rope_scaled": ", {kind} scaling",
    "rope_factor": ", cos and sin × {f}",
    "before_mask": " (before the mask)",
    "mask": "; −∞ at later keys",
    "mask_window": "; −∞ at later keys and keys {w} or more back",
    "softmax": "{name} = softmax({x}) over the last axis: each row sums to 1",
    "softmax_sink": "{name} = softmax({x}) over the last axis, with one sink logit per head ({w}) in the sum, dropped "
                    "after: rows sum to less than 1",
    "split_H": ", split into H heads",
    "split_Hkv": ", split into Hkv heads",
    "merge": "concat(heads of {x})",
    "lookup": "{name} = row id of {w} for each token",
    "cache_write": "{x} → the cache's slots for this pass",
    "repeat_kv": "{name}: each KV head of {x} seen by its {g} query heads (GQA)",
    "weighted_sum": "{name} = {x} · {v} (each query head reading KV head h // {g})",
    "select_last": "{name} = {x}[last position]",
    "router": "{name}: {order} {k} of {x}",
    "router_norm": ", renormalised to sum to 1",
    "router_rest": "; 0 elsewhere",
    "order_softmax_topk": "softmax, then top-k",
    "order_topk_softmax": "top-k, then softmax",
    "order_sigmoid_topk": "sigmoid, then top-k",
    "router_bias": " (chosen by score + {w}, weighted by the score alone)",
    "router_groups": ", among the experts of the best {used} of {n} groups (a group's score: {how})",
    "router_scale": ", × {scale:g}",
    "expert_matmul": "{name} = {x} · {w}[e]ᵀ for each chosen expert e",
    "expert_matmul_bias": "{name} = {x} · {w}[e]ᵀ + b[e] for each chosen expert e",
    "sink_share": "{name} = exp(sink) / (Σ exp({x}) + exp(sink)), one sink logit per head ({w}): 1 − Σ probs, the "
                  "share of each row no key gets",
    "prev_last": "{name} of the last layer",
    "prev_any": "{name} of the layer before (in layer 0: {first})",
    "prev_n": "{name} of layer {n}",
    "rope_base": "base θ = {base}",
    "rope_width": ", rotary width {dr} of {dh}",
    "rope_none": "no rotation in this layer",
    "window_of": "; a window of {w}",
}
# the router's `order`: a key, said in the reader's language by these words' keys
ORDERS = {"softmax_topk": "order_softmax_topk", "topk_softmax": "order_topk_softmax", "sigmoid_topk": "order_sigmoid_topk"}
LEGACY_ORDERS = {"softmax, then top-k": "softmax_topk", "top-k, then softmax": "topk_softmax",
                 "sigmoid, then top-k": "sigmoid_topk"}  # traces before keys


def formula(o: Op, name: str, layer: Optional[int] = None, maths: Optional["Maths"] = None,
            words: Optional[dict] = None) -> str:
    """The declared operation as one line of maths with its operands and this layer's constants: what a view shows
    beside the point `name` of `layer` (None: outside the layers; −1: any layer of its kind). The one home of these
    formulas: explain, the report and serve take them from here; `words` says them in another language (WORDS)."""
    W = WORDS if not words else {**WORDS, **words}
    say = lambda key, **v: W[key].format(**v)  # noqa: E731
    x = [_operand_words(i, layer, maths, say) for i in o.inputs]
    c = dict(o.consts)
    k = o.kind
    if k == "rmsnorm":
        over = "" if c["over"] == "D" else say("per_head") if c["over"] == "Dh" else say("over_whole", axis=c["over"])
        gamma = say("gamma_1w") if c["gamma"] not in ("w", "none") else ""
        g = "" if c["gamma"] == "none" else " · γ"  # "none": no scale (Gemma 4's norm of the values)
        if " " in x[0]:  # an operand said in words: name it x
            return f"{name} = x / √(mean(x²) + {c['eps']:g}){g}{gamma}{over}, x = {x[0]}"
        return f"{name} = {x[0]} / √(mean({x[0]}²) + {c['eps']:g}){g}{gamma}{over}"
    if k == "rope":
        if c.get("rotation") == "none":
            return say("no_rotation", name=name, x=x[0])
        dr = c["rotary_dim"]
        part = say("rope_part", dr=dr, dh=c["head_dim"]) if dr != c["head_dim"] else ""
        kind = (c.get("scaling") or {}).get("rope_type")
        scaled = say("rope_scaled", kind=kind) if kind and kind != "default" else ""
        factor = say("rope_factor", f=f"{c['attention_factor']:.4g}") if c.get("attention_factor") not in (None, 1.0) else ""
        if c.get("pairs") == "adjacent":  # DeepSeek's layout: neighbours (x_2i, x_2i+1) share an angle
            return (f"{name}: pairs ({x[0]}_2i, {x[0]}_2i+1) turned by pos·θ_i, θ_i = {_n(c['base'])}^(−2i/{dr})"
                    + part + scaled + factor)
        return say("rope", name=name, x=x[0], half=dr // 2, base=_n(c["base"]), dr=dr) + part + scaled + factor
    if k == "scores":
        s = f"{x[0]} · {x[1]}ᵀ · {c['scale']:.4g} ({c['scale_label']})"
        if c.get("softcap"):
            s = f"{c['softcap']:g}·tanh({s} / {c['softcap']:g})"
        return f"{name} = {s}" + _mask_words(c, say)
    if k == "softcap":
        return f"{name} = {c['cap']:g} · tanh({x[0]} / {c['cap']:g})" + _mask_words(c, say)
    if k == "softmax":
        if c.get("take") == "sink":  # gpt-oss: the sink's column of the same softmax, the share no key gets
            return say("sink_share", name=name, x=x[0], w=o.weights[0])
        return say("softmax_sink", name=name, x=x[0], w=o.weights[0]) if c.get("sink") else say("softmax", name=name, x=x[0])
    if k == "glu":
        if c.get("clamp") is not None:
            lim = c["clamp"]
            return (f"{name} = g·σ({c['alpha']:g}·g) · (u + {c.get('up_offset', 0):g}), g = min({x[0]}, {lim:g}), "
                    f"u = clamp({x[1]}, −{lim:g}, {lim:g}) ({glu_name(o)})")
        return f"{name} = {c['act']}({x[0]}) ⊙ {x[1]} ({glu_name(o)})"
    if k == "matmul":
        split = say("split_" + c["split"]) if c.get("split") in ("H", "Hkv") else ""
        rows = f"[{c['rows'][0]}:{c['rows'][1]}]" if c.get("rows") else ""
        arg = say("merge", x=x[0]) if c.get("merge") else x[0]
        bias = " + b" if len(o.weights) > 1 else ""
        if c.get("blocks"):  # each head's rows are n blocks of its width; this point is one of them
            rows += f" (block {c['blocks'][1] + 1} of each head's {c['blocks'][0]})"
        return f"{name} = {arg} · {_w(o)}{rows}ᵀ{bias}{split}"
    if k in STATE_OPS:  # (English only for now: not in WORDS)
        return STATE_OPS[k](name, x, c, o)
    if k in MLA_OPS:  # (English only for now: not in WORDS)
        return MLA_OPS[k](name, x, c, o)
    if k == "router":
        order = say(ORDERS.get(c.get("order"), "order_softmax_topk"))
        return (say("router", name=name, order=order, k=c.get("k"), x=x[0])
                + (say("router_bias", w=o.weights[0]) if o.weights else "")
                + (say("router_groups", used=c["groups_used"], n=c["groups"],
                       how="its best two, summed" if c.get("group_score") == "top2_sum" else "its best")
                   if c.get("groups") else "")
                + (say("router_norm") if c.get("renormalise") else "")
                + (say("router_scale", scale=c["scale"]) if c.get("scale") else "") + say("router_rest"))
    return {
        "lookup": lambda: say("lookup", name=name, w=o.weights[0] if o.weights else "E"),
        "scale": lambda: (f"{name} = {x[0]} × {_w(o) if '.' in o.weights[0] else o.weights[0]}" if o.weights else
                          f"{name} = {x[0]} × {c.get('label', '')} = {x[0]} × {c.get('factor', 0):.6g}"),
        "cache_write": lambda: say("cache_write", x=", ".join(x)),
        "repeat_kv": lambda: say("repeat_kv", name=name, x=x[0], g=c.get("group")),
        "weighted_sum": lambda: say("weighted_sum", name=name, x=x[0], v=x[1], g=c.get("group")),
        "add": lambda: f"{name} = {x[0]} + {x[1]}",
        "select_last": lambda: say("select_last", name=name, x=x[0]),
        "expert_matmul": lambda: say("expert_matmul_bias" if len(o.weights) > 1 else "expert_matmul", name=name,
                                     x=x[0], w=_w(o)),
        "expert_mix": lambda: f"{name} = Σ_e weight_e · ({x[0]}_e · W_down[e]ᵀ)",
        "stream": lambda: f"{name} = {x[0]}",
    }.get(k, lambda: OPS[k])()


def _carried(c: dict, ref: str) -> str:
    return f"{ref} before this pass" if ref in (c.get("carried") or ()) else ref


def _delta_words(name: str, x: list, c: dict) -> str:
    q, k, v, alpha, beta, state = x
    reads = "j mod Hk" if c.get("v_order") == "tiled" else f"j // {c.get('group')}"
    out = f"; {name}_t = Sᵀ{q}" if c.get("output") == "o" else "; the last S"
    return (f"{name}: from S = {_carried(c, state)}, for each token S ← {alpha}·S + {k} ⊗ {beta}·({v} − "
            f"({alpha}·S)ᵀ{k}){out} (value head j reads key head {reads})")


def _conv_words(name: str, x: list, c: dict, o) -> str:
    kc = c["kernel"]
    if c.get("output") == "state":
        return f"{name} = the last {kc - 1} inputs of ({_carried(c, x[1])}, then {x[0]})"
    total = f"Σ_j w_conv,j · {x[0]}_(t−{kc - 1}+j){' + b_conv' * (len(o.weights) > 1)}"
    return (f"{name}_t = {c['act']}({total})" if c.get("act") else f"{name}_t = {total}") + \
        f", per channel, the earlier inputs from {_carried(c, x[1])}"


STATE_OPS = {  # the words of linear attention's operations (Qwen3.5's Gated DeltaNet)
    "conv1d": lambda name, x, c, o: _conv_words(name, x, c, o),
    "l2norm": lambda name, x, c, o: (f"{name} = v / √(Σv² + {c['eps']:g})" + (f" · {c['scale']:.4g} ({c['scale_label']})"
                                     if c.get("scale", 1) != 1 else "") + f", v = {x[0]}[{c['cols'][0]}:{c['cols'][1]}] "
                                     f"per {c['split']} head"),
    "slice": lambda name, x, c, o: f"{name} = {x[0]}[{c['cols'][0]}:{c['cols'][1]}], split into {c['split']} heads",
    "sigmoid": lambda name, x, c, o: f"{name} = σ({x[0]})",
    "decay": lambda name, x, c, o: f"{name} = exp(A · softplus({x[0]} + dt_bias)), A = −exp(A_log) < 0",
    "delta_rule": lambda name, x, c, o: _delta_words(name, x, c),
    "gated_rmsnorm": lambda name, x, c, o: (f"{name} = {x[0]} / √(mean({x[0]}²) + {c['eps']:g}) · γ · silu({x[1]}), "
                                            f"per head (γ = w)"),
    "gate": lambda name, x, c, o: f"{name} = {x[0]} · σ({x[1]})",
    # Mamba2
    "softplus": lambda name, x, c, o: f"{name} = softplus({x[0]} + dt_bias)" + (
        f", clamped to [{c['limit'][0]:g}, {c['limit'][1]:g}]" if c.get("limit") else ""),
    "ssm_decay": lambda name, x, c, o: f"{name} = exp({x[0]} · A), A = −exp(A_log) < 0",
    "ssm_scan": lambda name, x, c, o: _scan_words(name, x, c),
    "group_gated_rmsnorm": lambda name, x, c, o: (
        f"{name} = g / √(mean(g²) + {c['eps']:g}) · γ over each group of {c['group']}, g = {x[0]} · silu({x[1]})"),
    "mul": lambda name, x, c, o: f"{name} = {x[0]} ⊙ {x[1]}",
}


MLA_OPS = {  # the words of multi-head latent attention's operations (DeepSeek V2/V3)
    "latent_up": lambda name, x, c, o: (f"{name}_h = {_cached(c, x[0])} · {_w(o)}_h"
                                        + ("ᵀ" if c.get("stored") == "out_in" else "") + ", per head"),
    "mla_scores": lambda name, x, c, o: (f"{name} = ({x[0]} · {x[1]}ᵀ + {x[2]} · {_cached(c, x[3])}ᵀ) · "
                                         f"{c['scale']:.4g} ({c['scale_label']})" + (
                                             "; −∞ at later keys" if c.get("mask") else "")),
}


def _cached(c: dict, ref: str) -> str:
    return f"{ref} of every cached slot" if ref in (c.get("cached") or ()) else ref


def _scan_words(name: str, x: list, c: dict) -> str:
    xs, b, cc, dt, a, state = x
    out = f"; {name}_t = {cc}·h + D·{xs}" if c.get("output") == "y" else "; the last h"
    return (f"{name}: from h = {_carried(c, state)}, for each token h ← {a}·h + {dt}·{xs}⊗{b}{out} (head j reads "
            f"group j // {c.get('group')} of {b} and {cc})")


def _operand_words(ref: str, layer: Optional[int], maths: Optional["Maths"], say) -> str:
    if ref.startswith(OF_LAYER):
        j, _, name = ref[len(OF_LAYER):].partition(":")
        return say("prev_n", name=name, n=j)
    if not ref.startswith(PREV):
        return ref
    name = ref[len(PREV):]
    first = maths.stream_in if maths is not None else "embed"
    if layer is None:
        return say("prev_last", name=name)
    if layer < 0:  # any layer of a kind: said for all of them
        return say("prev_any", name=name, first=first)
    return first if layer == 0 else say("prev_n", name=name, n=layer - 1)


def _mask_words(c: dict, say) -> str:
    if not c.get("mask"):
        return say("before_mask")
    return say("mask_window", w=f"{c['window']:,}") if c.get("window") else say("mask")
