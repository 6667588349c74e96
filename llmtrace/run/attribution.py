"""Direct logit attribution (`model.attribute`, `llmtrace attribute`): a token's logit at one position split into what
each part of the model wrote into the residual stream.

The stream after the last layer is a sum: what entered layer 0 (the embedding; Gemma's × √D, Granite's ×
embedding_multiplier), then each layer's additions, as the layer's block declares them (model.wiring: `model.wiring()`
gives each layer's additions, their norms, factors and the stream's rescale; nothing here knows a family). Each
addition splits into parts (`model.direct_parts`):
  - an attention-like mixer (attention, MLA, a KV-shared layer, a linear-attention layer): one part per head, that
    head's output through its slice of the output projection, `L.hN`; Qwen3.5's gated heads after their gate; a
    linear-attention layer's value heads after their gated norm (the norm works within each head, so the split is
    exact); a bias on the projection (gpt-oss) is its own part, `L.attn_bias`;
  - a mixer without heads (Mamba2, a short convolution): one part, named by its kind, `L.mamba2`, `L.short_conv`;
  - the feed-forward: one part, `L.ffn`; a mixture of experts one part per chosen expert, its output times its router
    weight, `L.expertE` (an expert's biases are in its part), and its shared experts as one part, `L.shared`;
  - a step of the block's own (Gemma 4's per-layer input): one part, `L.ple`;
  - a factor on an addition (Granite's residual_multiplier) multiplies its parts; a rescale of the whole stream
    (Gemma 4's layer scalar) multiplies every part added before it;
  - an addition whose output is normed before the add (Gemma's sandwich norms, OLMo 2's post-norms, Gemma 4's
    per-layer input): the norm makes the part nonlinear in the sub-layer's output, so its parts are taken through
    that norm **with its scale frozen at this input's value** (x ↦ x · s · γ, s = 1/rms of the whole output), which is
    linear, so the heads still split exactly and the parts sum to what was added.
The final norm is likewise frozen: logit = Σ_part (part · s_final · γ_final) · W_U[target], exactly linear in the
parts, so the parts sum to the logit (less the LM head's bias, which no family here has) to float rounding. With
`against`, the metric is logit(target) − logit(against) and each part's contribution is the difference. Gemma 2's
and Gemma 4's logits are soft-capped after the head: the attribution is of the logit before the cap (`logits_raw`),
and the result says so; Granite's are divided by logits_scaling, which is linear: its parts are divided too.

Frozen scales are the standard DLA convention (TransformerLens `apply_ln=True` with the cache's scale): a part's
number is its direct path only, with the norms' scales as this input made them, not the effect of removing it (which
also changes the scales and everything downstream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.model.llama_points import FINAL_NORM, LOGITS
from llmtrace.model.wiring import linear32
from llmtrace.run.patching import answer_token
from llmtrace.run.research import Prompt, encode, forward


@dataclass
class Attribution:
    """One direct logit attribution. `logit`: the model's own logit of `target` at `position` (minus `against`'s
    when given; Gemma 2 and 4: before the soft-cap); `parts`: each part's direct contribution, in forward order,
    summing to `logit`; `kinds`: what each part is (embed, head, attn_bias, linear_head, the kind of a mixer without
    heads such as mamba2 or short_conv, ffn, expert, shared_experts, ple); `sublayers`: the addition each part belongs
    to ("3.attn", "3.ffn", Gemma 4's "3.ple"); `scale`: the final norm's frozen scale 1/rms; `notes`: how the sum was
    made to close, in words."""

    logit: float
    parts: dict[str, float]
    kinds: dict[str, str]
    target: dict
    against: Optional[dict]
    position: int
    tokens: list[str]
    scale: float
    notes: list[str] = field(default_factory=list)
    sublayers: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Σ parts: the logit, to float rounding."""
        return float(sum(self.parts.values()))

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The n parts of largest |contribution|, largest first."""
        return sorted(self.parts.items(), key=lambda kv: -abs(kv[1]))[:n]

    def by_layer(self) -> dict[str, float]:
        """The parts summed per layer and addition ("3.attn", "3.ffn"), with "embed": a coarser view."""
        out: dict[str, float] = {}
        for name, value in self.parts.items():
            key = self.sublayers.get(name, name)
            out[key] = out.get(key, 0.0) + value
        return out

    def record(self) -> dict:
        """The attribution as the `attribute` event (JSON-ready)."""
        return {"event": "attribute", "target": self.target, "against": self.against, "position": self.position,
                "tokens": self.tokens, "logit": _r(self.logit), "total": _r(self.total),
                "metric": "logit(target)" + (" - logit(against)" if self.against else ""),
                "final_norm_scale": _r(self.scale), "notes": self.notes,
                "parts": [{"name": n, "kind": self.kinds[n], "sublayer": self.sublayers.get(n, n), "value": _r(v)}
                          for n, v in self.parts.items()]}

    def __repr__(self) -> str:
        what = repr(self.target["text"]) + (f" − {self.against['text']!r}" if self.against else "")
        return f"Attribution({what}: logit {self.logit:.4f} = Σ {len(self.parts)} parts {self.total:.4f})"


def _r(x: float) -> float:
    return float(f"{x:.6g}")


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
    bias = linear32(head, torch.zeros(1, parts.size(1), device=parts.device))[0, ids]
    for chunk in parts.split(64):
        out.append(linear32(head, chunk)[:, ids] - bias)
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
    wiring = model.wiring()  # each layer's additions, as its block declares them
    logit_point, factor = model.logit_path()
    wanted: dict[Optional[int], set[str]] = {None: {model.STREAM_IN, logit_point}}
    for i, w in enumerate(wiring):
        wanted[i] = {w.output} | {n for p in w.paths for n in (p.input, p.output, *p.capture)}
    kept: dict[tuple[Optional[int], str], torch.Tensor] = {}

    def keep(layer, name, x):
        if name in wanted.get(layer, ()) and x.dim() >= 2:
            kept[(layer, name)] = x[0, pos].detach().clone()

    with torch.no_grad():
        with model.hooked(keep, spell_out=False):
            forward(lm, batch)
        vectors, kinds, sublayers = _parts(model, wiring, kept)
        gamma_s, s = _frozen_norm(model.norm_of(None, FINAL_NORM.name), kept[(len(wiring) - 1, wiring[-1].output)])
        ids = [t_id] if a_id is None else [t_id, a_id]
        names = list(vectors)
        stacked = torch.stack([vectors[n] for n in names]) * gamma_s  # (N, D) through the frozen final norm
        per_id = _unembed(model, stacked, ids) * factor  # (N, 1 or 2)
        values = per_id[:, 0] - (per_id[:, 1] if a_id is not None else 0.0)
        raw = kept[(None, logit_point)].float()
        logit = float(raw[t_id] - (raw[a_id] if a_id is not None else 0.0))
    total = float(values.sum())
    if abs(total - logit) > 1e-3 * max(1.0, abs(logit)):  # parts that do not close are no attribution: say so
        raise LlmtraceError(f"direct logit attribution does not close on this model: its parts sum to {total:.4g}, "
                            f"not the logit {logit:.4g}; nothing is reported")
    notes = [f"the final norm's scale is frozen at this input's value (1/rms = {s:.6g}): each part's number is its "
             f"direct path to the logit"]
    if any(p.post_norm for w in wiring for p in w.paths):
        notes.append("the sub-layers' post-norms (normed before the residual add) make their parts nonlinear; they are "
                     "frozen the same way, at this input's scale, so their heads split exactly through them")
    if any(p.factor != 1.0 for w in wiring for p in w.paths) or any(w.rescale != 1.0 for w in wiring):
        notes.append("each addition's factor (a residual multiplier) and each layer's rescale of the stream (a layer "
                     "scalar) multiply the parts they apply to")
    if logit_point != LOGITS.name:
        notes.append(f"the logit is the LM head's output before the family's soft-cap ({logit_point}), which is not "
                     "linear")
    elif factor != 1.0:
        notes.append(f"the logits are the LM head's output × {factor:.6g}, which is linear: every part is scaled by it")
    piece = lambda i, text: {"text": text, "id": i, "piece": tok.piece(i)}  # noqa: E731
    return Attribution(logit, {n: float(v) for n, v in zip(names, values.tolist())}, kinds, piece(t_id, target),
                       None if a_id is None else piece(a_id, against), pos,
                       [tok.decode([i]) for i in batch.ids[0].tolist()], s, notes, sublayers)


def _parts(model, wiring, kept: dict) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """Each part's vector (D,) in float32, as it reaches the stream after the last layer (through its post-norm,
    frozen, its factor and every later rescale), in forward order; its kind; the sub-layer it belongs to."""
    vectors: dict[str, torch.Tensor] = {"embed": kept[(None, model.STREAM_IN)].float()}
    kinds, sublayers = {"embed": "embed"}, {"embed": "embed"}
    for i, w in enumerate(wiring):
        got = lambda name, i=i: kept[(i, name)]  # noqa: E731
        for path in w.paths:
            gamma_s = None
            if path.post_norm:
                gamma_s, _ = _frozen_norm(model.norm_of(i, path.post_norm), got(path.output))
            for name, (kind, v) in model.direct_parts(i, path, got).items():
                v = v.float() if gamma_s is None else v.float() * gamma_s
                vectors[f"{i}.{name}"] = v * path.factor
                kinds[f"{i}.{name}"], sublayers[f"{i}.{name}"] = kind, f"{i}.{path.part}"
        if w.rescale != 1.0:  # the whole stream, every part added so far, × the layer's factor
            vectors = {n: v * w.rescale for n, v in vectors.items()}
    return vectors, kinds, sublayers
