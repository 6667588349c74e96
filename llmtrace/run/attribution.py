"""Direct logit attribution (`model.attribute`, `llmtrace attribute`): a token's logit at one position split into what
each part of the model wrote into the residual stream.

The stream after the last layer is a sum: what entered layer 0 (the embedding; Gemma's × √D), then each layer's two
additions, attention's and the feed-forward's. Each addition is itself a sum of parts:
  - attention: one part per head, that head's output through its slice of the output projection (Wo's columns
    h·Dh .. (h+1)·Dh), `L.hN`; Qwen3.5's gated heads after their gate; a linear-attention layer's value heads after
    their gated norm (the norm works within each head, so the split is exact); a bias on Wo (gpt-oss) is its own
    part, `L.attn_bias`;
  - the feed-forward: one part, `L.ffn`; a mixture of experts one part per chosen expert, its output times its
    router weight, `L.expertE` (an expert's biases are in its part);
  - a sub-layer whose output is normed before the add (Gemma 2/3's sandwich norms, OLMo 2's post-norms): its parts go
    through that norm **with its scale frozen at this input's value** (x ↦ x · s · γ, s = 1/rms of the whole
    sub-layer output), which is linear, so the heads still split exactly and the parts sum to what was added.
The final norm is likewise frozen: logit = Σ_part (part · s_final · γ_final) · W_U[target], exactly linear in the
parts, so the parts sum to the logit (less the LM head's bias, which no family here has) to float rounding. With
`against`, the metric is logit(target) − logit(against) and each part's contribution is the difference. Gemma 2's
logits are soft-capped after the head: the attribution is of the logit before the cap (`logits_raw`), and the
result says so.

Frozen scales are the standard DLA convention (TransformerLens `apply_ln=True` with the cache's scale): a part's
number is its direct path only, with the norms' scales as this input made them, not the effect of removing it (which
also changes the scales and everything downstream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.model.llama_points import LOGITS, O_PROJ, RESID_POST
from llmtrace.model.moe_points import EXPERT_WEIGHTS
from llmtrace.run.patching import answer_token
from llmtrace.run.research import Prompt, encode, forward


@dataclass
class Attribution:
    """One direct logit attribution. `logit`: the model's own logit of `target` at `position` (minus `against`'s
    when given; Gemma 2: before the soft-cap); `parts`: each part's direct contribution, in forward order, summing to
    `logit`; `kinds`: what each part is (embed, head, attn_bias, linear_head, ffn, expert); `scale`: the final norm's
    frozen scale 1/rms; `notes`: how the sum was made to close, in words."""

    logit: float
    parts: dict[str, float]
    kinds: dict[str, str]
    target: dict
    against: Optional[dict]
    position: int
    tokens: list[str]
    scale: float
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """Σ parts: the logit, to float rounding."""
        return float(sum(self.parts.values()))

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The n parts of largest |contribution|, largest first."""
        return sorted(self.parts.items(), key=lambda kv: -abs(kv[1]))[:n]

    def by_layer(self) -> dict[str, float]:
        """The parts summed per layer and sub-layer ("3.attn", "3.ffn"), with "embed": a coarser view."""
        out: dict[str, float] = {}
        for name, value in self.parts.items():
            kind = self.kinds[name]
            key = name if kind == "embed" else name.split(".")[0] + (
                ".ffn" if kind in ("ffn", "expert") else ".attn")
            out[key] = out.get(key, 0.0) + value
        return out

    def record(self) -> dict:
        """The attribution as the `attribute` event (JSON-ready)."""
        return {"event": "attribute", "target": self.target, "against": self.against, "position": self.position,
                "tokens": self.tokens, "logit": _r(self.logit), "total": _r(self.total),
                "metric": "logit(target)" + (" - logit(against)" if self.against else ""),
                "final_norm_scale": _r(self.scale), "notes": self.notes,
                "parts": [{"name": n, "kind": self.kinds[n], "value": _r(v)} for n, v in self.parts.items()]}

    def __repr__(self) -> str:
        what = repr(self.target["text"]) + (f" − {self.against['text']!r}" if self.against else "")
        return f"Attribution({what}: logit {self.logit:.4f} = Σ {len(self.parts)} parts {self.total:.4f})"


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def _heads_point(attn: nn.Module) -> str:
    """The point an attention sub-layer hands its output projection: the one declared just before o_proj (attn_out,
    Qwen3.5's attn_gated, a linear layer's delta_norm): (B, T, heads, width)."""
    names = [p.name for p in type(attn).POINTS if not isinstance(p, str)]
    return names[names.index(O_PROJ.name) - 1]


def _out_proj(attn: nn.Module) -> nn.Module:
    return attn.wo if hasattr(attn, "wo") else attn.w_out


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) in float32: a plain Linear's weights upcast, anything else (GGUF blocks kept, --fast) called in its
    own dtype."""
    if type(module) is nn.Linear:
        b = None if module.bias is None else module.bias.float()
        return F.linear(x.float(), module.weight.float(), b)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    if hasattr(module, "compute"):
        dtype = module.compute
    return module(x.to(dtype)).float()


def _frozen_norm(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The RMSNorm `norm` at input x (D,), frozen: (s · γ (D,), s) with s = 1/√(mean(x²) + eps), so that the norm's
    output is x ⊙ (s · γ) and any part v of x maps to v ⊙ (s · γ)."""
    x = x.float()
    s = torch.rsqrt(x.pow(2).mean() + norm.eps)
    return s * norm.weight.float(), float(s)


def _unembed(model, parts: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """parts (N, D), already through the frozen final norm -> (N, len(ids)): each part's logit of each id, without the
    head's bias."""
    head = model.lm_head
    if type(head) is nn.Linear:
        return parts @ head.weight[ids].float().T
    out = []  # a head held as blocks (--keep-quantized) or packed (--fast): applied, then its bias taken off
    bias = _linear(head, torch.zeros(1, parts.size(1), device=parts.device))[0, ids]
    for chunk in parts.split(64):
        out.append(_linear(head, chunk)[:, ids] - bias)
    return torch.cat(out)


def attribute(lm, prompt: Prompt, target: str, against: Optional[str] = None, position: int = -1,
              chat: bool = False, system: Optional[str] = None) -> Attribution:
    """The direct logit attribution of `target`'s logit (one token) at `position` (default: the last) of one prompt;
    with `against` (one token), of logit(target) − logit(against). See the module's docstring."""
    model, tok = lm.model, lm.tokenizer
    if not isinstance(target, str) or target == "":
        raise BadValue("target", " is empty; give the token whose logit is split, e.g. ' Paris'")
    t_id = answer_token(tok, target, "target")
    a_id = None if against is None else answer_token(tok, against, "against")
    if a_id == t_id:
        raise BadValue("against", f" {against!r} is the same token as target; the difference would be 0",
                       also=("target",))
    batch = encode(lm, prompt, chat, system)
    if batch.ids.size(0) != 1:
        raise BadValue("prompt", " is a batch; attribution takes one prompt")
    T = batch.ids.size(1)
    if not -T <= position < T:
        raise BadValue("position", f" {position} is outside the prompt's {T} tokens")
    pos = position % T
    L = lm.config.n_layers
    head_op = model.maths().model.get(LOGITS.name)  # the logits as declared: the head's product, or a cap/scale of it
    raw_logits = LOGITS.name if head_op is None or head_op.weights else head_op.inputs[0]  # the head reads its weight

    wanted: dict[Optional[int], set[str]] = {None: {model.STREAM_IN, raw_logits}}
    for i, block in enumerate(model.layers):
        names = {_heads_point(block.attn), O_PROJ.name, "down", EXPERT_WEIGHTS.name}
        before = block.WIRING["ffn"][0]
        names.add(before or block.WIRING["attn"][2])  # what the feed-forward reads (its experts are run again on it)
        if i == L - 1:
            names.add(RESID_POST.name)
        wanted[i] = names
    kept: dict[tuple[Optional[int], str], torch.Tensor] = {}

    def keep(layer, name, x):
        if name in wanted.get(layer, ()) and x.dim() >= 2:
            kept[(layer, name)] = x[0, pos].detach().clone()

    kinds_here = sorted({getattr(b.attn, "KIND", "attention") for b in model.layers})
    refuse = f"direct logit attribution does not split this model's layers exactly yet (kinds: {', '.join(kinds_here)})"
    with torch.no_grad():
        with model.hooked(keep, spell_out=False):
            forward(lm, batch)
        try:
            vectors, kinds = _parts(model, kept, wanted)
        except (ValueError, KeyError, IndexError, AttributeError, RuntimeError) as e:  # a layer of a kind not split
            raise LlmtraceError(f"{refuse}: {type(e).__name__} taking its parts apart; nothing is reported") from None
        final = kept[(L - 1, RESID_POST.name)]
        gamma_s, s = _frozen_norm(model.norm, final)
        ids = [t_id] if a_id is None else [t_id, a_id]
        names = list(vectors)
        stacked = torch.stack([vectors[n] for n in names]) * gamma_s  # (N, D) through the frozen final norm
        per_id = _unembed(model, stacked, ids)  # (N, 1 or 2)
        values = per_id[:, 0] - (per_id[:, 1] if a_id is not None else 0.0)
        raw = kept[(None, raw_logits)].float()
        logit = float(raw[t_id] - (raw[a_id] if a_id is not None else 0.0))
    total = float(values.sum())
    if abs(total - logit) > 1e-3 * max(1.0, abs(logit)):  # parts that do not close are no attribution: say so
        raise LlmtraceError(f"{refuse}: its parts sum to {total:.4g}, not the logit {logit:.4g}; nothing is reported")
    notes = [f"the final norm's scale is frozen at this input's value (1/rms = {s:.6g}): each part's number is its "
             f"direct path to the logit"]
    if any(block.WIRING[p][1] for block in model.layers for p in ("attn", "ffn")):
        notes.append("the sub-layers' post-norms (normed before the residual add) are frozen the same way, at this "
                     "input's scale: their heads split exactly through them")
    if raw_logits != LOGITS.name:
        notes.append(f"the logit is the LM head's output before the family's cap or scale ({raw_logits}), which is not "
                     "linear")
    piece = lambda i, text: {"text": text, "id": i, "piece": tok.piece(i)}  # noqa: E731
    return Attribution(logit, {n: float(v) for n, v in zip(names, values.tolist())}, kinds, piece(t_id, target),
                       None if a_id is None else piece(a_id, against), pos,
                       [tok.decode([i]) for i in batch.ids[0].tolist()], s, notes)


def _parts(model, kept: dict, wanted: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each part's vector (D,) in float32, as it is added to the stream (through its sub-layer's frozen post-norm),
    in forward order, and its kind."""
    vectors: dict[str, torch.Tensor] = {"embed": kept[(None, model.STREAM_IN)].float()}
    kinds = {"embed": "embed"}
    for i, block in enumerate(model.layers):
        attn, ffn = block.attn, block.ffn
        linear = hasattr(attn, "state_shapes")  # a linear-attention layer (Gated DeltaNet)
        heads = kept[(i, _heads_point(attn))]  # (H, Dh)
        H, Dh = heads.shape
        proj = _out_proj(attn)
        spread = torch.zeros(H, H, Dh, device=heads.device, dtype=heads.dtype)
        spread[torch.arange(H), torch.arange(H)] = heads  # row h holds head h alone
        zero = _linear(proj, torch.zeros(1, H * Dh, device=heads.device))  # (1, D): Wo's bias, or 0
        own = {f"{i}.h{h}": v for h, v in enumerate(_linear(proj, spread.view(H, H * Dh)) - zero)}
        kind = {n: "linear_head" if linear else "head" for n in own}
        if zero.abs().max() > 0:
            own[f"{i}.attn_bias"], kind[f"{i}.attn_bias"] = zero[0], "attn_bias"
        _through_post_norm(block, "attn", kept[(i, O_PROJ.name)], own)
        vectors.update(own)
        kinds.update(kind)
        if hasattr(ffn, "n_experts"):
            own, kind = _experts(block, kept, i)
        else:
            own, kind = {f"{i}.ffn": kept[(i, "down")].float()}, {f"{i}.ffn": "ffn"}
        _through_post_norm(block, "ffn", kept[(i, "down")], own)
        vectors.update(own)
        kinds.update(kind)
    return vectors, kinds


def _through_post_norm(block, part: str, output: torch.Tensor, own: dict) -> None:
    """A sub-layer normed after it (WIRING's second entry): each of its parts through that norm, frozen at the
    sub-layer's whole output."""
    after = block.WIRING[part][1]
    if after:
        gamma_s, _ = _frozen_norm(getattr(block, block.NORMS[after]), output)
        for name in own:
            own[name] = own[name] * gamma_s


def _experts(block, kept: dict, i: int) -> tuple[dict, dict]:
    """Each chosen expert's output times its router weight, run again on the feed-forward's input: (D,) each."""
    ffn = block.ffn
    before = block.WIRING["ffn"][0]
    x = kept[(i, before or block.WIRING["attn"][2])][None]  # (1, D)
    weights = kept[(i, EXPERT_WEIGHTS.name)]  # (E,), 0 where not chosen
    own, kind = {}, {}
    for e in weights.nonzero()[:, 0].tolist():
        y = ffn.w_down(ffn.glu(ffn.w_gate(x, e), ffn.w_up(x, e)), e)  # (1, D)
        own[f"{i}.expert{e}"] = (y[0].float() * weights[e].float())
        kind[f"{i}.expert{e}"] = "expert"
    return own, kind
