"""One decoder layer taken apart (`llmtrace explain`), and the logit lens over every layer (`llmtrace lens`).

Everything comes from ONE forward pass over the prompt: the prefill that `generate` runs, on the same model and the same
KV-cache path. An observer clones the chosen layer's named points and the residual stream after each sub-layer of every
layer; the chosen layer's attention is observed, so it is spelled out and its scores and probabilities exist.

The functions here compute and return plain dicts (the `explain` and `lens` events of the trace schema); they never
print. The terminal view (llmtrace.render.explain) renders those events, so the screen and `--json` show the same facts.

Notation as in llmtrace.model: T tokens, D model width, H query heads, Hkv KV heads, Dh head width, F FFN width,
V vocabulary, L layers. Tensors keep the model's dtype while captured; every statistic is computed in float32 or above.

Sections, in the order of the seed table (s6.1-s6.8, then s8-s9 applied early):
    layer      where the layer sits: parameters by matrix, share of the model, FLOPs for this prompt
    rmsnorm    y = x / sqrt(mean(x²) + eps) ⊙ γ for the two norms of the layer
    qkv        projections, head split, which query heads share each KV head (GQA), what that saves in the cache
    rope       rotation angles, and a numerical check that q·k depends only on the distance m − n
    attention  scores before/after the causal mask, softmax, what each position attends to, one head as a map
    residual   attention output against the residual stream; how far the layer moved each token's vector
    ffn        SwiGLU shapes, gate statistics, the units most active for the last token, the residual update
    router     (a mixture-of-experts layer, instead of ffn) every token's router: all E probabilities, the K experts
               it ran and their weights, the cut; the layer's expert load (run/explain_router.py)
    kv_cache   the positions and bytes this layer writes
    lens       the final norm and LM head applied after attention and after the FFN (top-k, beside the real output)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from llmtrace.model.gqa import gqa_groups
from llmtrace.model.moe_points import moe_layers
from llmtrace.errors import BadValue
from llmtrace.trace.indices import parse_indices
from llmtrace.run.generate import check_context
from llmtrace.run.interventions import prepare, record
from llmtrace.run.explain_state import delta_rule_section, state_cache_section, state_op
from llmtrace.run.explain_router import moe_costs, router_section
from llmtrace.model.capture import capture as capture_points
from llmtrace.model.llama_points import (ACT, ATTENTION_LINE, ATTN_OUT, DOWN, EMBED, GATE, K, K_REPEATED, K_ROPE,
                                         KV_WRITE, LOGITS, O_PROJ, PROBS, Q, Q_ROPE, RESID_MID, RESID_POST, RESID_PRE,
                                         SCORES, UP, V)
from llmtrace.model.points import SEED_STEPS
from llmtrace.model.maths import attention_words, formula, glu_name, op_kind, rope_words
from llmtrace.model.recompute import ACTS, apply, max_error
from llmtrace.model.points import Points
from llmtrace.model.transformer import ModelConfig, Transformer, apply_rope, kv_bytes_per_position, rope_angles
from llmtrace.trace.records import (SIGNIFICANT_DIGITS, batch_event, candidate_records, dtype_name, explain_model_record,
                                    rounded, tensor_event, tokens_event)
from llmtrace.trace.stats import tensor_stats
from llmtrace.units import plural

NEAR_ZERO = 0.05  # |silu(gate)| below this counts as a unit that is (nearly) switched off
MAP_CELLS = 40  # an attention map wider than this many positions is summarised in bins


# ----------------------------------------------------------------------------------------------------------------
# argument checks (cheap, before any forward pass)


def resolve_layer(layer: int, n_layers: int) -> int:
    """Layer N, with negative N counting from the end (-1 is the last layer)."""
    if not -n_layers <= layer < n_layers:
        raise BadValue("layer", f" {layer} is out of range: this model has {plural(n_layers, 'layer')} "
                       f"(0..{n_layers - 1}, or -1..-{n_layers} from the end)")
    return layer % n_layers


def resolve_head(head: Optional[int], n_heads: int) -> Optional[int]:
    if head is None:
        return None
    if not -n_heads <= head < n_heads:
        raise BadValue("head", f" {head} is out of range: this model has {n_heads} query heads (0..{n_heads - 1})")
    return head % n_heads


def parse_positions(spec: Optional[str], n_tokens: int, last: int = 12) -> list[int]:
    """Prompt positions for the lens columns: 'all', '0,3,-1', '2-5'; None means the last `last` positions."""
    if last < 1:
        raise BadValue("last", " must be ≥ 1")
    if spec is None:
        return list(range(max(0, n_tokens - last), n_tokens))
    if spec.strip() == "all":
        return list(range(n_tokens))
    return parse_indices(spec, n_tokens, "positions", "position", "the prompt has")


# ----------------------------------------------------------------------------------------------------------------
# the one forward pass


@dataclass
class Capture:
    """What one prefill pass left behind. Batch dimension dropped everywhere."""

    ids: list[int]
    layer: Optional[int]  # the layer taken apart (None for the lens alone)
    points: dict[str, torch.Tensor]  # that layer's named points, e.g. points[Q.name] (T, H, Dh), probs (H, T, T)
    embed: torch.Tensor  # (T, D) the stream entering layer 0 (the model's declared stream_in)
    resid_mid: list[torch.Tensor]  # L × (T, D) the stream after each layer's attention
    resid_post: list[torch.Tensor]  # L × (T, D) the stream after each layer's FFN (the layer's output)
    logits: torch.Tensor  # (T, V) the model's own output
    kv_element_size: int  # bytes per cached number
    declared: Optional[Points] = None  # the model's declared points (model.points.Points)
    # the points of other layers the chosen layer's operations read ((layer, name) -> tensor): a KV-shared layer's
    # keys and values, which an earlier layer computed and cached
    read: dict = field(default_factory=dict)

    @property
    def x_in(self) -> torch.Tensor:
        """(T, D) the residual stream entering the chosen layer."""
        return self.points[RESID_PRE.name]


@torch.inference_mode()
def capture(model: Transformer, ids: list[int], layer: Optional[int] = None, edits=None) -> Capture:
    """Run the prefill over `ids` once, as `generate` does (a fresh KV cache, start 0), and keep what explain needs:
    the embedding, every layer's residual stream, and every point of `layer`, whose attention is spelled out.
    `edits` (llmtrace.run.interventions.prepare): the interventions of this pass, or None."""
    L = model.config.n_layers
    streams = (RESID_MID.name, RESID_POST.name)
    maths = model.maths() if layer is not None else None
    read = {maths.operand(layer, ref) for o in maths.layers[layer].values() for ref in o.inputs} if maths else set()
    read = {(j, name) for j, name in read if j is not None and j != layer}  # another layer's point: kept too
    stream_in = model.STREAM_IN  # the model point entering layer 0 (the embedding, or Gemma's embedding × √D)
    idx = torch.tensor([ids], dtype=torch.long, device=model.embed.weight.device)  # (1, T)
    cache = model.new_cache(len(ids))
    with contextlib.ExitStack() as held:
        if edits is not None:
            held.enter_context(model.hooked(edits, edits.layers, spell_out=edits.spell_out))
        kept = held.enter_context(capture_points(
            model, lambda lay, name: (lay is None and name in (EMBED.name, stream_in) or lay == layer or name in streams
                                      or (lay, name) in read),
            layers=range(L), attention=[] if layer is None else sorted({layer, *(j for j, _ in read)}),
            spell_out=True))
        logits = model(idx, cache, 0)[0]  # (T, V)
    points = {name: (x if name == KV_WRITE.name else x[0]) for (lay, name), x in kept.items() if lay == layer}
    if K_REPEATED.name in points:  # (Hkv, G, S, Dh) -> (H, S, Dh), as `generate` records it
        points[K_REPEATED.name] = points[K_REPEATED.name].flatten(0, 1)
    return Capture(ids=list(ids), layer=layer, points=points, embed=kept[(None, stream_in)][0],
                   resid_mid=[kept[(i, RESID_MID.name)][0] for i in range(L)],
                   resid_post=[kept[(i, RESID_POST.name)][0] for i in range(L)],
                   logits=logits, kv_element_size=cache.element_size, declared=model.declared_points(),
                   read={(j, name): kept[(j, name)][0] for j, name in read if (j, name) in kept})


# ----------------------------------------------------------------------------------------------------------------
# small helpers


def _r(x, digits: int = SIGNIFICANT_DIGITS):
    """A number (a float, or a one-element tensor) for JSON, by the trace's one rounding rule (records.rounded)."""
    return rounded(float(x), digits)


def _rl(t: torch.Tensor, digits: int = SIGNIFICANT_DIGITS) -> list:
    """A tensor as (nested) lists of rounded floats."""
    if t.dim() == 0:
        return _r(t.item(), digits)
    return [_rl(s, digits) for s in t] if t.dim() > 1 else [_r(v, digits) for v in t.tolist()]


def _stats(x: torch.Tensor) -> dict:
    return {k: _r(v) for k, v in tensor_stats(x).items()}


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of (T, D) tensors, float32."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# tensor events: the schema's record for each point of the chosen layer


def tensor_events(cap: Capture, points) -> list[dict]:
    """A tensor event for each traced point of the chosen layer (`points`: the model's declaration), as `generate`
    records them."""
    out = []
    for p in points.layer:
        x = cap.points.get(p.name)
        if x is None or not p.traced:
            continue
        ev = tensor_event(0, "prefill", cap.layer, p.name, p.step, list(x.shape), dtype_name(x.dtype))
        if p.name == KV_WRITE.name:
            ev["stats"] = _stats(x.double())
            ev["positions"] = [int(x[0]), int(x[-1])]
        else:
            ev["stats"] = _stats(x)
        if p.name == SCORES.name:
            ev["masked"] = int((~torch.isfinite(x)).sum())
        out.append(ev)
    return out


# ----------------------------------------------------------------------------------------------------------------
# 0. each step's maths, as the model declares it, checked on this pass


def _operand(cap: Capture, maths, ref: str) -> Optional[torch.Tensor]:
    """The captured tensor an operand of the chosen layer names (model.maths: "^x" is the layer before's x)."""
    layer, name = maths.operand(cap.layer, ref)
    if layer == cap.layer:
        return cap.points.get(name)
    if (layer, name) in cap.read:  # another layer's point this layer reads (a KV-shared layer's keys)
        return cap.read[(layer, name)]
    if layer is None:
        return cap.embed if name == maths.stream_in else None
    return {RESID_POST.name: cap.resid_post, RESID_MID.name: cap.resid_mid}.get(name, [None] * (layer + 1))[layer]


def _weight(model: Transformer, name: str) -> Optional[torch.Tensor]:
    """A declared weight as a float tensor, or None where the model holds it otherwise (quantized, packed)."""
    try:
        w = model.get_parameter(name)
    except AttributeError:
        return None
    return w.detach() if w.is_floating_point() else None


def step_check(cap: Capture, model: Transformer, maths, name: str, o) -> Optional[dict]:
    """The declared operation of point `name` recomputed in float64 from the pass's own operands, beside the value
    the pass reported: {"max_abs", "max_rel", "ok"}; None where the pass did not keep an operand or a weight."""
    out = cap.points.get(name)
    if out is None or op_kind(o.kind).evaluate is None or not torch.is_tensor(out):
        return None  # no tensor, or nothing to recompute (the slots a cache write names: the kind has no evaluator)
    carried = o.const("carried") or ()  # a recurrent state before this pass: none, the pass starts from an empty cache
    args = [None if ref in carried else _operand(cap, maths, ref) for ref in o.inputs]
    weights = [_weight(model, f"layers.{cap.layer}.{w}") for w in o.weights]
    if any(a is None and ref not in carried for a, ref in zip(args, o.inputs)) or any(w is None for w in weights):
        return None
    got = apply(o, [None if a is None else a[None] for a in args], [w.cpu() for w in weights], (1, *out.shape),
                positions=torch.arange(len(cap.ids)))
    if got is None:
        return None
    absolute, relative = max_error(got[0], out.cpu())
    return {"max_abs": _r(absolute, 3), "max_rel": _r(relative, 3), "ok": absolute <= 1e-5 or relative <= 1e-4}


def steps_section(cap: Capture, lm) -> dict:
    """Every point of the chosen layer with the operation the model declares for it (model.maths), its formula with
    this layer's constants, and the check: the formula applied in float64 to this pass's operands, beside the pass's
    own value. The layer's plan (its attention, its RoPE or none, dense or experts) comes with it."""
    maths = lm.maths
    plan = maths.plan[cap.layer]
    rows = []
    table = maths.layers[cap.layer]
    for name in [p.name for p in lm.points.layer if p.name in table]:  # forward order, as the model declares it
        o = table[name]
        sid = lm.points.get(name).step.split("/")[0]
        rows.append({"point": name, "op": o.kind, "formula": formula(o, name, cap.layer, maths), "inputs": list(o.inputs),
                     "weights": list(o.weights), "check": step_check(cap, lm.model, maths, name, o),
                     "seed_step": sid, "heading": plan.heading(sid) or SEED_STEPS.get(sid, "")})
    return {"event": "explain", "section": "steps", "layer": cap.layer, "seed_step": "s6",
            "plan": plan.record() | {"rope_words": rope_words(plan), "attention_words": attention_words(plan)},
            "steps": rows}


# ----------------------------------------------------------------------------------------------------------------
# 1. where the layer sits


def layer_params(model: Transformer, layer: int) -> list[dict]:
    """Each weight of the layer in the orientation of the math (X @ W: [in, out]), as the model declares them: a
    fused matrix (Wq Wk Wv, W_gate W_up) is split into the parts the maths has. nn.Linear stores the transpose,
    [out, in]; a norm's scale is γ."""
    prefix = f"layers.{layer}."
    rows = []
    for w in model.declared_weights():
        if not w.param.startswith(prefix):
            continue
        owner = w.param[len(prefix):].rpartition(".")[0]  # the module: attn_norm, attn.q_norm, attn.wqkv
        for src in w.sources:
            math_name = src.math or w.weight.math
            name = f"{owner}.{math_name}" if w.weight.kind == "vector" and math_name == "γ" else math_name
            shape = [w.shape[1], src.rows] if w.weight.kind == "matrix" else [src.rows, *w.shape[1:]]
            rows.append({"name": name, "seed_step": w.weight.step, "shape": shape,
                         "numel": src.rows * math.prod(w.shape[1:])})
    return rows


def layer_section(model: Transformer, layer: int, n_tokens: int) -> dict:
    """Where the layer sits: its parameters, their share of the model, its FLOPs over the prompt; in a
    mixture-of-experts layer also the weights one token uses (router.moe_costs)."""
    c = model.config
    params = layer_params(model, layer)
    n_layer = sum(p["numel"] for p in params)
    n_model = model.num_params()
    declared = model.declared_weights()
    n_embed = sum(math.prod(w.shape) for w in declared if w.weight.kind == "embedding" or w.weight.step == "s9")
    n_layers_all = sum(math.prod(w.shape) for w in declared if w.param.startswith("layers."))
    out = {
        "event": "explain", "section": "layer", "layer": layer, "n_layers": c.n_layers, "seed_step": "s6",
        "params": params, "layer_params": n_layer, "model_params": n_model, "embedding_params": n_embed,
        "share": _r(n_layer / n_model), "share_of_layers": _r(n_layer / n_layers_all),
        "n_tokens": n_tokens, "flops": model.layer_flops(layer, n_tokens),  # as the layer's kinds declare them
    }
    if layer in moe_layers(c):  # a mixture of experts: a token runs K of E experts
        out |= moe_costs(model, layer, n_tokens)
    return out


# ----------------------------------------------------------------------------------------------------------------
# 2. RMSNorm


def rmsnorm_parts(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """x (T, D) -> the pieces of y = x / sqrt(mean(x²) + eps) ⊙ γ, by hand, float32."""
    x = x.float()
    ms = x.pow(2).mean(-1)  # (T,) mean of squares
    rms = ms.sqrt()  # (T,) RMS(x), without eps
    unit = x * torch.rsqrt(ms + eps)[:, None]  # (T, D) x / sqrt(mean(x²) + eps): RMS 1, norm ≈ sqrt(D)
    y = gamma.float() * unit  # (T, D)
    return {"rms": rms, "unit": unit, "y": y}


def rmsnorm_section(cap: Capture, model: Transformer, point, maths=None) -> dict:
    """One of the layer's RMSNorms, taken apart: `point` is the point it computes (model.points.Point); its input is
    the operand its declared operation names (attn_norm: the layer's input; Gemma's post_attn_norm: o_proj)."""
    norm = model.norm_of(cap.layer, point.name)
    o = (maths or model.maths()).op(cap.layer, point.name)
    x = _operand(cap, maths or model.maths(), o.inputs[0])  # (T, D)
    parts = rmsnorm_parts(x, norm.weight, norm.eps)
    y_model = cap.points[point.name].float()  # what the forward pass produced
    gamma = norm.weight.float()
    top = gamma.abs().topk(min(5, gamma.numel()))
    n_in, n_unit, n_out = x.float().norm(dim=-1), parts["unit"].norm(dim=-1), parts["y"].norm(dim=-1)
    return {
        "event": "explain", "section": "rmsnorm", "layer": cap.layer, "norm": point.name,
        "seed_step": point.step, "formula": formula(o, point.name), "eps": _r(norm.eps), "input": o.inputs[0],
        "d_model": x.size(-1),
        "gamma": _stats(gamma) | {"top_dims": top.indices.tolist(), "top_values": _rl(gamma[top.indices])},
        "tokens": [{"position": t, "rms": _r(parts["rms"][t]), "norm_in": _r(n_in[t]), "norm_unit": _r(n_unit[t]),
                    "norm_out": _r(n_out[t]), "gamma_gain": _r(n_out[t] / n_unit[t])} for t in range(x.size(0))],
        "check_max_abs_diff": _r((parts["y"] - y_model).abs().max()),
    }


# ----------------------------------------------------------------------------------------------------------------
# 3. Q, K, V and grouped-query attention



def qkv_section(cap: Capture, config: ModelConfig) -> dict:
    c = config
    T = len(cap.ids)
    H, Hkv, Dh, D = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
    es = cap.kv_element_size
    per_pos_gqa = kv_bytes_per_position(c, es)  # K and V of one position in one layer
    per_pos_mha = kv_bytes_per_position(c, es, n_heads=H)  # the same if every query head had its own K and V
    return {
        "event": "explain", "section": "qkv", "layer": cap.layer, "seed_step": "s6.1-s6.2",
        "shapes": [
            {"name": "x̂ = attn_norm(x)", "shape": [T, D]},
            {"name": "Q = x̂ Wq", "shape": [T, H * Dh], "split": [T, H, Dh], "heads_first": [H, T, Dh],
             "captured": list(cap.points[Q.name].shape)},
            {"name": "K = x̂ Wk", "shape": [T, Hkv * Dh], "split": [T, Hkv, Dh], "heads_first": [Hkv, T, Dh],
             "captured": list(cap.points[K.name].shape)},
            {"name": "V = x̂ Wv", "shape": [T, Hkv * Dh], "split": [T, Hkv, Dh], "heads_first": [Hkv, T, Dh],
             "captured": list(cap.points[V.name].shape)},
        ],
        "n_heads": H, "n_kv_heads": Hkv, "head_dim": Dh, "group_size": H // Hkv, "groups": gqa_groups(H, Hkv),
        "cache": {"element_size": es, "bytes_per_position_layer": per_pos_gqa, "mha_bytes_per_position_layer": per_pos_mha,
                  "bytes_per_position_model": per_pos_gqa * c.n_layers, "saving": _r(per_pos_mha / per_pos_gqa),
                  "bytes_prompt_model": per_pos_gqa * c.n_layers * T, "mha_bytes_prompt_model": per_pos_mha * c.n_layers * T},
    }


# ----------------------------------------------------------------------------------------------------------------
# 4. RoPE


def rope_pairs(head_dim: int) -> list[int]:
    """A few dimension pairs to show: the fastest, the next, two in between, the slowest."""
    half = head_dim // 2
    return sorted({0, 1, half // 4, half // 2, half - 1})


def rope_relative_check(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, distances: list[int],
                        shifts: list[int]) -> torch.Tensor:
    """Scores q'·k'/sqrt(Dh) with q rotated to position n + d and k to position n, for n in `shifts`.

    q, k: (Dh,) vectors before RoPE. Returns (len(distances), len(shifts)). If the score depends only on the distance
    d = m − n, every row is constant. Computed in float64 so that the check shows the math, not float32 rounding."""
    q, k, inv = q.double(), k.double(), inv_freq.double()
    Dh = q.numel()
    out = torch.empty(len(distances), len(shifts), dtype=torch.float64)
    for i, d in enumerate(distances):
        for j, n in enumerate(shifts):
            pos = torch.tensor([n + d, n], dtype=torch.float64)
            ang = torch.outer(pos, inv)  # (2, Dh/2)
            ang = torch.cat([ang, ang], dim=-1)  # (2, Dh): pair i and i + Dh/2 share an angle
            cos, sin = ang.cos(), ang.sin()
            x = torch.stack([q, k]).view(1, 2, 1, Dh)  # (B, T, nh, Dh): q and k as two positions of one head
            rot = apply_rope(x, cos, sin)[0, :, 0]  # (2, Dh)
            out[i, j] = rot[0].dot(rot[1]) / math.sqrt(Dh)
    return out


def rope_section(cap: Capture, config: ModelConfig, head: int = 0, model: Optional[Transformer] = None,
                 maths=None) -> dict:
    """s6.3 in this layer's terms, from its declared plan: the base, the rotary width and θ_i the layer uses (Gemma 3's
    local layers their own base), or, in a layer without RoPE, what that means."""
    c = config
    maths = maths if maths is not None else model.maths()
    plan, rope_op = maths.plan[cap.layer], maths.op(cap.layer, Q_ROPE.name)
    if not plan.rope:
        return {"event": "explain", "section": "rope", "layer": cap.layer, "seed_step": "s6.3", "rotation": "none",
                "formula": formula(rope_op, Q_ROPE.name),
                "why": "this layer turns neither q nor k: a query's score against a key depends only on what the two "
                       "tokens are (their content), not on how far apart they are. The layers with RoPE carry position "
                       "into the stream; this one attends by content alone.",
                "check_q_rope_max_abs_diff": _r((cap.points[Q_ROPE.name].float() - cap.points[rope_op.inputs[0]]
                                                 .float().reshape(cap.points[Q_ROPE.name].shape)).abs().max())}
    q_in, k_in = rope_op.inputs[0], maths.op(cap.layer, K_ROPE.name).inputs[0]
    T, Dh = len(cap.ids), plan.rope.get("head_dim", c.head_dim)  # this layer's head width (Gemma 4's global: its own)
    Dr = plan.rope["rotary_dim"]  # the dims RoPE turns (Phi-3: the first partial_rotary_factor·Dh)
    table, theta = plan.rope.get("table", "global"), plan.rope["base"]
    inv_freq = torch.tensor(plan.rope["inv_freq"], dtype=torch.float32)  # (Dr/2,) θ_i of this layer, as declared
    pairs = rope_pairs(Dr)
    positions = torch.arange(T, dtype=torch.float32)
    # the model's own tables (this layer's, where layers differ or the sequence's length decides: Gemma 3, LongRoPE)
    # reproduce the captured q_rope / k_rope
    device = cap.points[Q.name].device
    if model is None:
        cos, sin = rope_angles(inv_freq.to(device), torch.arange(T, device=device))
    else:
        io = model.layer_inputs(torch.zeros((1, T), dtype=torch.long, device=device), dtype=torch.float32)[cap.layer]
        cos, sin = io.cos, io.sin
    q_pre = cap.points[q_in].reshape(cap.points[Q_ROPE.name].shape)  # (T, H, Dh): OLMo 2 norms q before the split
    k_pre = cap.points[k_in].reshape(cap.points[K_ROPE.name].shape)
    q_err = (apply_rope(q_pre[None], cos, sin)[0] - cap.points[Q_ROPE.name]).abs().max()
    k_err = (apply_rope(k_pre[None], cos, sin)[0] - cap.points[K_ROPE.name]).abs().max()
    # relative-distance check on real vectors: the last token's query (this head), the first token's key (its KV head)
    kv_head = head // c.group_size
    q_vec = q_pre[T - 1, head].float().cpu()
    k_vec = k_pre[0, kv_head].float().cpu()
    distances = [d for d in (0, 1, 2, 4, 8, 16) if d < max(T, 5)]
    shifts = [s for s in (0, 1, 7, 100, 1000) if s + distances[-1] < c.max_seq_len]
    scores = rope_relative_check(q_vec, k_vec, inv_freq, distances, shifts)
    deviation = (scores - scores[:, :1]).abs().max(dim=1).values  # per distance: spread over shifts
    return {
        "event": "explain", "section": "rope", "layer": cap.layer, "seed_step": "s6.3",
        "theta": theta, "rope_table": table, "scaling": _scaling_info(plan.rope.get("scaling")),
        "head_dim": Dh, "rotary_dim": Dr, "rotation": "rope",
        "formula": formula(rope_op, Q_ROPE.name),
        "pairs": [{"i": i, "dims": [i, i + Dr // 2], "theta_i": _r(inv_freq[i]),
                   # None for a pair that does not turn (θ_i = 0: Gemma 4's proportional RoPE)
                   "wavelength": _r(2 * math.pi / inv_freq[i].item()) if inv_freq[i].item() > 0 else None,
                   "angles": _rl(positions * inv_freq[i])} for i in pairs],
        "check_q_rope_max_abs_diff": _r(q_err), "check_k_rope_max_abs_diff": _r(k_err),
        "relative": {"head": head, "kv_head": kv_head, "q_position": T - 1, "k_position": 0,
                     "distances": distances, "shifts": shifts, "scores": _rl(scores, 10),
                     "max_deviation": _r(deviation.max(), 3), "deviation_by_distance": _rl(deviation, 3)},
    }


def _scaling_info(scaling: Optional[dict]):
    if not scaling:
        return None
    # one number per frequency (llama3 scaling read from a GGUF, LongRoPE's two sets), summarised
    return {k: {"count": len(v), "min": _r(min(v)), "max": _r(max(v))} if isinstance(v, list) and v else
            _r(v) if isinstance(v, float) else v for k, v in scaling.items()}


# ----------------------------------------------------------------------------------------------------------------
# 5. attention


def scores_before_mask(cap: Capture, config: ModelConfig, attn=None) -> torch.Tensor:
    """Q K^T / sqrt(Dh) from the captured rotated q and k, before the causal mask: (H, T, T), float32. `attn`: the
    layer's attention module, whose own `scores` step computes them instead (a family's scale, a soft-cap)."""
    q = cap.points[Q_ROPE.name].float().transpose(0, 1)  # (H, T, Dh)
    k = cap.points[K_ROPE.name].float().transpose(0, 1)  # (Hkv, T, Dh)
    k = k.repeat_interleave(config.group_size, dim=0)  # (H, T, Dh): repeat_kv, one copy per query head of the group
    if attn is not None:
        return attn.scores(q[None], k[None])[0].float()  # (H, T, T)
    return q @ k.transpose(-2, -1) / math.sqrt(config.head_dim)  # (H, T, T)


def attention_formula(maths, layer: int) -> str:
    """The attention of `layer` as the model declares it: its scores (scale, soft-cap, mask, window), its softmax
    (a sink where the family has one), P·V."""
    return "; ".join(formula(maths.op(layer, n), n) for n in ATTENTION_LINE if maths.op(layer, n) is not None)


def bin_edges(n: int, max_cells: int = MAP_CELLS) -> list[tuple[int, int]]:
    """[lo, hi) position ranges: single positions when n <= max_cells, else max_cells near-equal bins."""
    if n <= max_cells:
        return [(i, i + 1) for i in range(n)]
    cuts = [round(i * n / max_cells) for i in range(max_cells + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(max_cells)]


def binned_map(probs: torch.Tensor, edges: list[tuple[int, int]]) -> torch.Tensor:
    """(T, T) -> (B, B): keys summed within a bin (rows still sum to 1), queries averaged."""
    rows = torch.stack([probs[lo:hi].mean(0) for lo, hi in edges])  # (B, T)
    return torch.stack([rows[:, lo:hi].sum(-1) for lo, hi in edges], dim=-1)  # (B, B)


def attention_sections(cap: Capture, config: ModelConfig, head: Optional[int] = None,
                       example: int = 6, attn=None, maths=None) -> list[dict]:
    """The attention summary, one record per head, and one map (`head`, or the mean over heads). `attn`: the layer's
    attention module (see scores_before_mask); `maths`: the model's declaration (its window and formula)."""
    c = config
    T = len(cap.ids)
    window = maths.plan[cap.layer].window
    pre = scores_before_mask(cap, c, attn)  # (H, T, T)
    post = cap.points[SCORES.name].float()  # (H, T, T), -inf above the diagonal
    probs = cap.points[PROBS.name].float()  # (H, T, T)
    finite = torch.isfinite(post)
    agree = (pre[finite] - post[finite]).abs().max() if finite.any() else torch.tensor(0.0)
    eh = head if head is not None else 0
    n = min(T, example)
    out = [{
        "event": "explain", "section": "attention", "layer": cap.layer, "seed_step": "s6.4-s6.5",
        "formula": attention_formula(maths, cap.layer), "window": window,
        "shape": [c.n_heads, T, T], "masked": int((~finite).sum()), "pre_mask": _stats(pre), "post_mask": _stats(post),
        "probs": _stats(probs), "row_sum_max_error": _r((probs.sum(-1) - 1).abs().max()),
        "check_scores_max_abs_diff": _r(agree),
        "example": {"head": eh, "positions": n, "scores": _rl(pre[eh, :n, :n], 4),
                    "masked_scores": _rl(post[eh, :n, :n], 4), "probs": _rl(probs[eh, :n, :n], 4)},
    }]
    weight, arg = probs.max(dim=-1)  # (H, T) each: the key each query position attends to most
    entropy = (-(probs * probs.clamp_min(1e-30).log()).sum(-1)).clamp_min(0)  # (H, T) nats
    for h in range(c.n_heads):
        out.append({"event": "explain", "section": "attention_head", "layer": cap.layer, "head": h,
                    "kv_head": h // c.group_size, "argmax": arg[h].tolist(), "weight": _rl(weight[h], 4),
                    "entropy": _rl(entropy[h], 4), "first_token_weight": _r(probs[h, :, 0].mean(), 4)})
    chosen = probs[head] if head is not None else probs.mean(0)  # (T, T)
    edges = bin_edges(T)
    out.append({"event": "explain", "section": "attention_map", "layer": cap.layer, "head": head,
                "what": f"head {head}" if head is not None else "mean over heads", "n_tokens": T,
                "binned": len(edges) < T, "bins": [list(e) for e in edges],
                "matrix": _rl(binned_map(chosen, edges), 4), "window": window, "model_window": c.sliding_window})
    return out


# ----------------------------------------------------------------------------------------------------------------
# 6. output projection and residual


def post_norm_of(cap: Capture, name: str) -> Optional[str]:
    """The point that norms the sub-layer output `name` before the residual add (a family's post-norm), if any."""
    return next((p.name for p in (cap.declared.layer if cap.declared else ()) if p.input == name), None)


def residual_section(cap: Capture, maths=None) -> dict:
    x = cap.x_in.float()  # (T, D) entering the layer
    heads = ATTN_OUT.name if ATTN_OUT.name in cap.points or maths is None else maths.op(cap.layer, O_PROJ.name).inputs[0]
    post_norm = post_norm_of(cap, O_PROJ.name)
    o = cap.points[post_norm or O_PROJ.name].float()  # (T, D) what attention adds: o_proj, or o_proj normed again
    mid = cap.resid_mid[cap.layer].float()  # x + o
    post = cap.resid_post[cap.layer].float()  # the layer's output
    nx, no = x.norm(dim=-1), o.norm(dim=-1)
    rel_attn = (mid - x).norm(dim=-1) / nx
    rel_layer = (post - x).norm(dim=-1) / nx
    cos_attn, cos_layer, cos_o = _cos(x, mid), _cos(x, post), _cos(x, o)
    return {
        "event": "explain", "section": "residual", "layer": cap.layer, "seed_step": "s6.6",
        "formula": (f"x' = x + {post_norm}(concat(heads) Wo)" if post_norm else "x' = x + concat(heads) Wo")
                   + "; the layer's output x'' = x' + FFN(x')",
        "shapes": {heads: list(cap.points[heads].shape), O_PROJ.name: list(o.shape)},
        "tokens": [{"position": t, "norm_in": _r(nx[t]), "norm_attn": _r(no[t]), "attn_to_stream": _r(no[t] / nx[t]),
                    "cos_attn_stream": _r(cos_o[t]), "rel_change_attn": _r(rel_attn[t]), "cos_attn": _r(cos_attn[t]),
                    "norm_out": _r(post[t].norm()), "rel_change_layer": _r(rel_layer[t]), "cos_layer": _r(cos_layer[t])}
                   for t in range(x.size(0))],
    }


# ----------------------------------------------------------------------------------------------------------------
# 7. SwiGLU feed-forward


ACT_DEFINED = {"silu": "silu(g) = g·sigmoid(g)", "gelu_tanh": "gelu_tanh(g) = g·Φ(g), tanh approximation"}


def ffn_section(cap: Capture, config: ModelConfig, near_zero: float = NEAR_ZERO, top: int = 8, maths=None) -> dict:
    """s6.7 as the layer declares it: its gated activation's name and function come from the `act` point's op."""
    T, D, Fd = len(cap.ids), config.d_model, config.ffn_dim
    glu = maths.op(cap.layer, ACT.name)
    fn, kind = glu.const("act"), glu_name(glu)
    defined = ACT_DEFINED.get(fn, fn)
    gate, up = cap.points[GATE.name].float(), cap.points[UP.name].float()  # (T, F)
    act = cap.points[ACT.name].float()  # (T, F) act(gate) * up, as the model computed it
    s = ACTS[fn](gate)  # (T, F)
    off = s.abs() < near_zero  # (T, F) units (nearly) switched off by the gate
    mid, post = cap.resid_mid[cap.layer].float(), cap.resid_post[cap.layer].float()
    down = cap.points[post_norm_of(cap, DOWN.name) or DOWN.name].float()  # (T, D) what the FFN adds
    last = T - 1
    units = act[last].abs().topk(min(top, Fd)).indices
    return {
        "event": "explain", "section": "ffn", "layer": cap.layer, "seed_step": "s6.7",
        "formula": f"FFN(x) = W_down ({fn}(x W_gate) ⊙ (x W_up)), {defined}", "kind": kind, "activation": fn,
        "declared": formula(glu, ACT.name),
        "shapes": [{"name": "x̂ = ffn_norm(x')", "shape": [T, D]}, {"name": "gate = x̂ W_gate", "shape": [T, Fd]},
                   {"name": "up = x̂ W_up", "shape": [T, Fd]}, {"name": f"act = {fn}(gate) ⊙ up", "shape": [T, Fd]},
                   {"name": "down = act W_down", "shape": [T, D]}],
        "near_zero_threshold": near_zero,
        "near_zero_fraction": _r(off.float().mean()),
        "negative_gate_fraction": _r((gate < 0).float().mean()),
        "silu_gate": _stats(s),
        "check_act_max_abs_diff": _r((s * up - act).abs().max()),
        "tokens": [{"position": t, "near_zero_fraction": _r(off[t].float().mean()), "norm_act": _r(act[t].norm()),
                    "norm_down": _r(down[t].norm()), "rel_change": _r(down[t].norm() / mid[t].norm()),
                    "cos": _r(_cos(mid[t:t + 1], post[t:t + 1])[0])} for t in range(T)],
        "top_units": {"position": last, "units": [
            {"unit": int(u), "gate": _r(gate[last, u]), "silu_gate": _r(s[last, u]), "up": _r(up[last, u]),
             "act": _r(act[last, u])} for u in units]},
    }


# ----------------------------------------------------------------------------------------------------------------
# 8. KV cache write


def kv_section(cap: Capture, config: ModelConfig, memory: list) -> dict:
    c = config
    kv_layers = sum(bool(m.per_token) and m.reads is None for m in memory)  # the layers that write K and V
    pos = cap.points[KV_WRITE.name]
    T = int(pos.numel())
    es = cap.kv_element_size
    per_pos = kv_bytes_per_position(c, es)
    return {
        "event": "explain", "section": "kv_cache", "layer": cap.layer, "seed_step": "s6.8",
        "positions": [int(pos[0]), int(pos[-1])], "n_positions": T, "shape_k": [c.n_kv_heads, T, c.head_dim],
        "shape_v": [c.n_kv_heads, T, c.head_dim], "element_size": es, "bytes_per_position": per_pos,
        "bytes": per_pos * T, "mha_bytes": kv_bytes_per_position(c, es, n_heads=c.n_heads) * T,
        "all_layers_bytes": per_pos * T * kv_layers, "kv_layers": kv_layers,
    }


def memory_section(model: Transformer, layer: int, n_positions: int, element_size: int) -> dict:
    """s6.8 what the layer keeps for this pass's positions, as its kind declares it (model.memory): each per-token
    buffer's shape, the bytes, and what full multi-head attention with the same heads would keep."""
    memory = model.memory()
    m = memory[layer].record(element_size)
    return {"event": "explain", "section": "memory", "layer": layer, "seed_step": "s6.8", "record": m,
            "n_positions": n_positions, "bytes": m["per_token_bytes"] * n_positions,
            "mha_bytes": m["mha_per_token_bytes"] * n_positions,
            "all_layers_bytes": sum(x.per_token_bytes(element_size) for x in memory) * n_positions}


# ----------------------------------------------------------------------------------------------------------------
# 9-10. logit lens


@torch.inference_mode()
def lens_logits(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    """The model's final norm and LM head applied to residual-stream rows h (P, D): what it would predict if it stopped
    here (s8, s9 applied early). (P, V), float32."""
    return model.head(h[None])[0].float()


def topk_candidates(tok, logits: torch.Tensor, k: int) -> list[dict]:
    """logits (V,) -> the k most likely tokens with probability and logit."""
    probs = torch.softmax(logits.float(), dim=-1)
    p, i = probs.topk(k)
    return candidate_records(tok, [(t, float(logits[t]), pv) for t, pv in zip(i.tolist(), p.tolist())])


def lens_event(tok, layer: Optional[int], stage: str, position: int, logits: torch.Tensor, k: int) -> dict:
    return {"event": "lens", "layer": layer, "stage": stage, "position": position, "topk": topk_candidates(tok, logits, k)}


def explain_lens(cap: Capture, model: Transformer, tok, k: int = 5) -> list[dict]:
    """Lens at the chosen layer for the last position: after attention, after the FFN, and the model's real output."""
    last = len(cap.ids) - 1
    rows = torch.stack([cap.resid_mid[cap.layer][last], cap.resid_post[cap.layer][last]])  # (2, D)
    lg = lens_logits(model, rows)
    return [lens_event(tok, cap.layer, RESID_MID.name, last, lg[0], k),
            lens_event(tok, cap.layer, RESID_POST.name, last, lg[1], k),
            lens_event(tok, None, LOGITS.name, last, cap.logits[last], k)]


def lens_table(cap: Capture, model: Transformer, tok, positions: list[int], layers: Optional[list[int]] = None,
               k: int = 5) -> list[dict]:
    """One `lens` event per (layer, position) after each layer (resid_post), then the model's real output per position."""
    L = model.config.n_layers
    out = []
    for layer in (layers if layers is not None else range(L)):
        lg = lens_logits(model, cap.resid_post[layer][positions])  # (P, V)
        out += [lens_event(tok, layer, RESID_POST.name, p, lg[j], k) for j, p in enumerate(positions)]
    out += [lens_event(tok, None, LOGITS.name, p, cap.logits[p], k) for p in positions]
    return out


# ----------------------------------------------------------------------------------------------------------------
# the two commands' event lists


def explain_events(lm, ids: list[int], layer: int, head: Optional[int] = None, top: int = 5, prompt: str = "",
                   chat: bool = False, interventions: Sequence = ()) -> list[dict]:
    """Every record `llmtrace explain` shows, from one forward pass. `layer` may be negative; `head` picks the map.
    `interventions` (llmtrace.run.interventions) apply to that pass."""
    return list(iter_explain_events(lm, ids, layer, head, top, prompt, chat, interventions))


def iter_explain_events(lm, ids: list[int], layer: int, head: Optional[int] = None, top: int = 5, prompt: str = "",
                        chat: bool = False, interventions: Sequence = ()) -> Iterator[dict]:
    """explain_events, each as it is made: the header and the prompt's tokens before the pass, then the sections.
    The values are checked when the first event is asked for, before any is made."""
    c = lm.config
    check_context(lm, len(ids), 0)
    layer = resolve_layer(layer, c.n_layers)
    head = resolve_head(head, c.n_heads)
    edits = prepare(lm, interventions, [len(ids)])
    maths = lm.maths
    yield ({"event": "explain", "section": "model", "command": "explain", "layer": layer, "head": head,
            "model": explain_model_record(lm), "points": lm.points.records(), "maths": maths.record(),
            "prompt": prompt, "chat": chat,
            "n_tokens": len(ids), "threads": torch.get_num_threads()} | _interventions(interventions))
    yield tokens_event(lm.tokenizer, ids)
    cap = capture(lm.model, ids, layer, edits)
    yield from tensor_events(cap, lm.points)
    yield layer_section(lm.model, layer, len(ids))
    yield steps_section(cap, lm)
    for name in lm.model.block.NORMS:  # the layer's RMSNorms, as its block declares them
        yield rmsnorm_section(cap, lm.model, lm.points.get(name), maths)
    mixer = lm.model.attention_of(layer)  # the layer's kind: its own sections, as it declares them (model.kinds)
    for key in mixer.EXPLAIN:
        yield from MIXER_SECTIONS.get(key, _own_section(mixer, key))(cap, lm, layer, head, maths)
    yield residual_section(cap, maths)
    if layer in moe_layers(c):
        yield router_section(cap.points, cap.resid_mid[layer], layer, c, maths=maths)
    else:
        yield ffn_section(cap, c, maths=maths)
    memory = lm.model.memory()
    yield MEMORY_SECTIONS.get(memory[layer].kind, _memory_section)(cap, lm, maths, memory)
    yield from explain_lens(cap, lm.model, lm.tokenizer, top)


def _attention_sections(cap, lm, layer, head, maths):
    c = lm.config
    yield qkv_section(cap, c)
    yield rope_section(cap, c, head if head is not None else 0, lm.model, maths)
    yield from attention_sections(cap, c, head, attn=lm.model.attention_of(layer), maths=maths)


def _delta_rule_sections(cap, lm, layer, head, maths):
    """One delta-rule update on this pass's numbers, in place of the attention sections."""
    mixer = lm.model.attention_of(layer)
    state = state_op(mixer, maths, layer, "o")[1]
    yield delta_rule_section(cap, mixer, maths, head if head is not None and head < cap.points[state.inputs[2]].size(1)
                             else 0)


# explain's sections of a layer's mixer, by the keys its kind declares (EXPLAIN); a kind with none of its own is
# taught by the generic sections (the steps table works every declared operation; the memory section below)
MIXER_SECTIONS = {"attention": _attention_sections, "delta_rule": _delta_rule_sections}


def _own_section(mixer, key: str):
    """A section a kind computes itself (its `explain(key, cap, model, maths, head)`, in its own file)."""
    def sections(cap, lm, layer, head, maths):
        section = mixer.explain(key, cap, lm.model, maths, head)
        if section is not None:
            yield section
    return sections


def _memory_section(cap, lm, maths, memory):
    return memory_section(lm.model, cap.layer, len(cap.ids), cap.kv_element_size)


# s6.8 by the kind of memory the layer declares (model.memory); any other kind: its declaration, generically
MEMORY_SECTIONS = {
    "kv": lambda cap, lm, maths, memory: kv_section(cap, lm.config, memory),
    "state": lambda cap, lm, maths, memory: state_cache_section(cap, maths, lm.config, cap.kv_element_size, memory),
    "window": lambda cap, lm, maths, memory: state_cache_section(cap, maths, lm.config, cap.kv_element_size, memory),
    "shared": lambda cap, lm, maths, memory: state_cache_section(cap, maths, lm.config, cap.kv_element_size, memory),
}


def lens_events(lm, ids: list[int], positions: list[int], layers: Optional[list[int]] = None, top: int = 5,
                prompt: str = "", chat: bool = False, interventions: Sequence = ()) -> list[dict]:
    """Every record `llmtrace lens` shows: the top-k after each layer at each chosen position, from one pass (with
    `interventions` applied to it)."""
    return list(iter_lens_events(lm, ids, positions, layers, top, prompt, chat, interventions))


def iter_lens_events(lm, ids: list[int], positions: list[int], layers: Optional[list[int]] = None, top: int = 5,
                     prompt: str = "", chat: bool = False, interventions: Sequence = ()) -> Iterator[dict]:
    """lens_events, each as it is made: the header and the prompt's tokens before the pass, then the lens."""
    check_context(lm, len(ids), 0)
    edits = prepare(lm, interventions, [len(ids)])
    yield ({"event": "explain", "section": "model", "command": "lens", "layer": None, "head": None,
            "model": explain_model_record(lm), "points": lm.points.records(), "prompt": prompt, "chat": chat,
            "n_tokens": len(ids), "threads": torch.get_num_threads(), "positions": positions,
            "layers": layers if layers is not None else list(range(lm.config.n_layers))}
           | _interventions(interventions))
    yield tokens_event(lm.tokenizer, ids)
    cap = capture(lm.model, ids, None, edits)
    yield from lens_table(cap, lm.model, lm.tokenizer, positions, layers, top)


def stream(events: Iterator[dict], command: str, n_tokens: int, emit: Callable[[dict], None],
           after_head: Optional[dict] = None) -> bool:
    """Hand each of a pass's events to `emit` as it is made (`after_head`, when given, right after the first), then
    the summary, as generate's stream ends: a Ctrl-C ends the events where they are and the summary says
    `interrupted`. Returns whether it was."""
    interrupted = False
    try:
        for i, ev in enumerate(events):
            emit(ev)
            if i == 0 and after_head is not None:
                emit(after_head)
    except KeyboardInterrupt:
        interrupted = True
    emit({"event": "summary", "command": command, "prompt_tokens": n_tokens, "interrupted": interrupted})
    return interrupted


def _interventions(interventions: Sequence) -> dict:
    """The model section's `interventions` field: present only when there are some."""
    return {"interventions": [record(iv) for iv in interventions]} if interventions else {}


def explain_batch_event(tok, prompts: list[list[int]], row: int) -> dict:
    """s3 for explain and lens given several prompts: the padded batch (generate.pad_batch) and, for every row, the
    combined causal and padding mask the model applies to it, (T, T) with 1 where query i may attend key j (the
    model's own `allowed_keys`). `row` is the row the other events explain: its prompt alone, which is what the
    padded row computes at its real positions."""
    from llmtrace.run.generate import pad_batch
    from llmtrace.model.transformer import allowed_keys

    layout = pad_batch(prompts, tok)
    T = len(layout.ids[0])
    padding = torch.tensor(layout.attention_mask, dtype=torch.bool)  # (B, T)
    combined = allowed_keys(T, 0, padding, None)[:, 0]  # (B, T, T)
    return batch_event(tok, layout) | {"combined_mask": combined.int().tolist(), "explained_row": row}
