"""Interventions: ablate, scale, patch and steer the forward pass, and read llama.cpp's control vectors.

An intervention is a small frozen dataclass (`Ablate`, `Scale`, `Patch`, `Steer`, `ControlVector`, and `Hook`, a
researcher's own function); a run takes a plain list of them (`generate(..., interventions=[Ablate(3, head=2)])`,
explain, lens, a compare Side). `prepare` checks them against the model and the prompts, runs the texts some of them
need (each alone, without interventions), turns each into hooks (`hooks_of`: named functions fn(x, point) at points)
and returns an `Edits`, the editor that `Transformer.hooked` attaches to the model's points (llmtrace.model.transformer):
the one hook, for the built-in interventions and a researcher's alike. `parse_*` turn the
command line's strings into the same objects, in one place, with one-line errors.

Definitions (tests/test_interventions.py checks each one against forward hooks on transformers' Llama):
    Ablate(L, head=h)          head h's slice of the concatenated head outputs (the input of Wo, s6.6) is zero, at every
                               position, in the prompt's pass and in every decode step
    Ablate(L, part="attn"|"ffn") that sub-layer's output (after Wo, after W_down) is zero: it adds nothing to the stream
    Ablate(L, expert=K)        a mixture of experts: expert K of layer L is removed from the choice (its router score
                               is -inf, so its probability is 0 and each token's next best expert runs in its place)
    Ablate(L, head=h, mean=True) head h's output is replaced by its mean over the prompt's positions (each row its own)
    Scale(L, α, head=h | part=)  the same outputs multiplied by α
    Scale(L, α, expert=K)      expert K's output multiplied by α wherever it runs (its routing weight × α; the choice
                               of experts is unchanged)
    Patch(L, point, P, source)   `source` runs alone; its activation at layer L, `point` (resid_pre, resid_mid,
                               resid_post or head h's output), position P replaces the run's at the same place, in
                               the prompt's pass. P counts from 0; negative P from the end of each prompt (and of
                               the source)
    Steer(L, toward, away, α)  v = layer L's output (resid_post) at the last token of `toward` minus the same for
                               `away`, each run alone; α·v is added to layer L's output at every position, in every pass
    Hook(name, fn)             a researcher's own function at a point ("3.attn_out"), called as fn(x, point) in every
                               pass: None observes, a tensor replaces x at an editable point (run.hookpoints). The
                               trace names the function and says that llmtrace cannot replay it
    ControlVector(path, scale) llama.cpp's control-vector GGUF: tensor `direction.N` (N ≥ 1, float32, one per layer) is
                               added, times scale, to the output of layer N (0-based), as llama.cpp's build_cvec adds
                               it after the layer's FFN residual; several files add up. Layer 0 has no direction

Texts an intervention runs (--from, --toward, --away-from) are encoded as plain text (the tokenizer's own BOS), never in
the chat template. A run with interventions prefills its prompt in one pass (no chunks), so that a patch position and a
mean over the prompt see the whole prompt at once, and does not use the compiled decode step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.model.moe_points import expert_points
from llmtrace.units import plural

PARTS = ("head", "attn", "ffn", "expert")


def resid_points(points) -> tuple[str, ...]:
    """The residual stream's points a Patch may name, as the model declares them (model.points.Points)."""
    return points.names(layer=True, residual=True, editable=True)


def part_point(points, part: str) -> str:
    """Where the output of a part is edited, from the model's declaration: a head's output is the editable attention
    point of P·V's step (s6.5) with a head axis and a head width (each head's P·V, before Wo; q, k, v and the
    probabilities are editable too, at other steps or without Dh); the attention sub-layer's and the feed-forward's
    outputs are the last editable point each reports."""
    if part == "head":
        return next(p.name for p in points.layer if p.where == "attn" and p.editable and p.step == "s6.5"
                    and "H" in p.axes and "Dh" in p.axes)
    return [p.name for p in points.layer if p.where == part and p.editable][-1]


def layer_output(points) -> str:
    """The layer's output: its last residual-stream point."""
    return resid_points(points)[-1]


# ----------------------------------------------------------------------------------------------------------------
# the interventions


def _target(layer: int, part: str, head: Optional[int], expert: Optional[int] = None) -> str:
    return f"{layer}.h{head}" if part == "head" else f"{layer}.e{expert}" if part == "expert" else f"{layer}.{part}"


def _part(obj, field_name: str) -> None:
    """Fill in `part` from `head` or `expert` (a head given means part "head", an expert "expert") and check it."""
    implied = "head" if obj.head is not None else "expert" if obj.expert is not None else None
    part = obj.part if obj.part is not None else implied
    if part not in PARTS:
        raise BadValue(field_name, f": part must be one of {', '.join(PARTS)} (a head needs head=H, an expert "
                                   f"expert=K), not {part!r}")
    for name, value in (("head", obj.head), ("expert", obj.expert)):
        if (part == name) != (value is not None):
            raise BadValue(field_name, f": part {part!r} {'needs' if part == name else 'takes no'} {name}")
    object.__setattr__(obj, "part", part)


@dataclass(frozen=True)
class Ablate:
    layer: int
    head: Optional[int] = None
    part: Optional[str] = None  # "head" (with head=), "attn", "ffn" or "expert" (with expert=)
    mean: bool = False  # a head's output replaced by its mean over the prompt's positions, not zero
    expert: Optional[int] = None  # a mixture of experts: this expert of the layer is never chosen

    def __post_init__(self):
        _part(self, "ablate")
        if self.mean and self.part != "head":
            raise BadValue("ablate", f" {self.spec}: =mean applies to a head (L.hH=mean)")

    kind = "ablate"

    @property
    def spec(self) -> str:
        return _target(self.layer, self.part, self.head, self.expert) + ("=mean" if self.mean else "")


@dataclass(frozen=True)
class Scale:
    layer: int
    factor: float
    head: Optional[int] = None
    part: Optional[str] = None
    expert: Optional[int] = None  # a mixture of experts: this expert's output, wherever it runs

    def __post_init__(self):
        _part(self, "scale")
        if not math.isfinite(self.factor):
            raise BadValue("scale", f" {self.spec}: the factor must be a finite number")

    kind = "scale"

    @property
    def spec(self) -> str:
        return f"{_target(self.layer, self.part, self.head, self.expert)}={self.factor:g}"


@dataclass(frozen=True)
class Patch:
    layer: int
    point: str  # a residual-stream point (resid_pre, resid_mid, resid_post in Llama), or "head" with head=
    position: int
    source: str  # the text whose activation is patched in
    head: Optional[int] = None

    def __post_init__(self):
        if self.point.startswith("h") and self.point[1:].isdigit():  # Patch(3, "h2", ...) reads as head 2
            object.__setattr__(self, "head", int(self.point[1:]))
            object.__setattr__(self, "point", "head")
        if (self.point == "head") != (self.head is not None):
            raise BadValue("patch", f": point 'head' needs head=H (or write the point as hH)")

    kind = "patch"

    @property
    def spec(self) -> str:
        where = f"h{self.head}" if self.point == "head" else self.point
        return f"{self.layer}.{where}@{self.position}"


@dataclass(frozen=True)
class Steer:
    layer: int
    toward: str
    away_from: str
    strength: float = 1.0

    kind = "steer"

    @property
    def spec(self) -> str:
        return str(self.layer)


@dataclass(frozen=True)
class ControlVector:
    path: str
    scale: float = 1.0

    kind = "control_vector"

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.scale:g}"


@dataclass(frozen=True)
class Hook:
    """A researcher's function at one point: `name` as a hook sees it ("3.attn_out", "-1.resid_post", "embed"),
    `fn(x, point)` returning None (it observed) or, at an editable point, the tensor the pass goes on with. It runs on
    the same hook as the others, in every pass; a trace records its name, and says that llmtrace cannot replay it."""

    name: str
    fn: Callable

    kind = "hook"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise BadValue("hook", f": the point's name must be a text such as '3.attn_out', not {self.name!r}")
        if not callable(self.fn):
            raise BadValue("hook", f" {self.name}: fn must be a function fn(x, point), not {type(self.fn).__name__}")

    @property
    def spec(self) -> str:
        return self.name

    @property
    def layer(self) -> Optional[int]:
        head, dot, _ = self.name.partition(".")
        return int(head) if dot and head.lstrip("-").isdigit() else None


Intervention = Union[Ablate, Scale, Patch, Steer, ControlVector, Hook]


def record(iv: Intervention) -> dict:
    """The intervention as the `run` event lists it (the schema's `intervention`): kind, spec (its command-line
    spelling), label (the terminal's line), then its fields."""
    out = {"kind": iv.kind, "spec": iv.spec, "label": label(iv)}
    if isinstance(iv, Hook):
        from llmtrace.run.hookpoints import function_name

        layer = {"layer": iv.layer} if iv.layer is not None else {}
        return out | layer | {"at": iv.name, "function": function_name(iv.fn), "replayable": False}
    for name in ("layer", "head", "part", "mean", "factor", "point", "position", "source", "toward", "away_from",
                 "strength", "path", "scale", "expert"):
        if name == "expert" and getattr(iv, name, None) is None:
            continue  # only an expert's intervention says it
        if hasattr(iv, name):
            out[name] = getattr(iv, name)
    return out


def label(iv: Intervention) -> str:
    """One short line for the terminal header: 'ablate 3.h2', 'patch 5.resid_post@-1 from "…"'."""
    if isinstance(iv, Patch):
        return f"patch {iv.spec} from {_quote(iv.source)}"
    if isinstance(iv, Steer):
        return f"steer {iv.layer} {iv.strength:+g}·({_quote(iv.toward)} − {_quote(iv.away_from)})"
    if isinstance(iv, Hook):
        from llmtrace.run.hookpoints import function_name

        return f"hook {function_name(iv.fn)} at {iv.name} (your function: llmtrace cannot replay it)"
    if isinstance(iv, ControlVector):
        return f"control vector {Path(iv.path).name} ×{iv.scale:g}"
    return f"{iv.kind} {iv.spec}"


def _quote(text: str, width: int = 24) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[: width - 1] + "…")


# ----------------------------------------------------------------------------------------------------------------
# the command line's spellings


_TARGET = re.compile(r"^(-?\d+)\.(?:h(\d+)|e(\d+)|(attn|ffn))$")


def _parse_target(field_name: str, text: str) -> tuple[int, Optional[int], Optional[int], str]:
    """'3.h2' -> (3, 2, None, "head"); '3.e5' -> (3, None, 5, "expert"); '3.ffn' -> (3, None, None, "ffn")."""
    m = _TARGET.match(text.strip())
    if not m:
        raise BadValue(field_name, f" {text!r}: expected L.hH (a head), L.eK (an expert), L.attn or L.ffn, e.g. 3.h2")
    layer, head, expert, part = int(m[1]), m[2], m[3], m[4]
    part = part or ("head" if head is not None else "expert")
    return layer, (int(head) if head is not None else None), (int(expert) if expert is not None else None), part


def parse_ablate(text: str) -> Ablate:
    """'3.h2', '3.attn', '3.ffn', '3.h2=mean', '3.e5'."""
    target, eq, how = text.partition("=")
    if eq and how.strip() != "mean":
        raise BadValue("ablate", f" {text!r}: the only value after '=' is mean (L.hH=mean)")
    layer, head, expert, part = _parse_target("ablate", target)
    return Ablate(layer, head=head, part=part, mean=bool(eq), expert=expert)


def parse_scale(text: str) -> Scale:
    """'3.h2=0.5', '3.attn=2', '3.ffn=0', '3.e5=2'."""
    target, eq, factor = text.partition("=")
    try:
        value = float(factor)
    except ValueError:
        raise BadValue("scale", f" {text!r}: expected L.hH=α, L.eK=α, L.attn=α or L.ffn=α with a number α, e.g. "
                                f"3.h2=0.5") from None
    layer, head, expert, part = _parse_target("scale", target)
    return Scale(layer, value, head=head, part=part, expert=expert)


_PATCH = re.compile(r"^(-?\d+)\.([a-z_]+|h\d+)@(-?\d+)$")


def parse_patch(text: str, source: Optional[str]) -> Patch:
    """'5.resid_post@-1', '3.h2@4', with the text of --from."""
    m = _PATCH.match(text.strip())
    if not m:
        raise BadValue("patch", f" {text!r}: expected L.POINT@P, e.g. 5.resid_post@-1 or 3.h2@4 "
                                f"(a residual-stream point of the layer, or hH)")
    if not m[2].startswith("h"):  # no torch: every family keeps Llama's residual-stream points
        from llmtrace.model.llama_points import llama_points

        known = llama_points().names(layer=True, residual=True, editable=True)
        if m[2] not in known:
            raise BadValue("patch", f" {text}: unknown point {m[2]!r}; points: {', '.join(known)} or hH (a head)")
    if source is None:
        raise BadValue("patch", f" {text}: needs source, the text whose activation is patched in", also=("source",))
    return Patch(int(m[1]), m[2], int(m[3]), source)


def parse_steer(layer: Optional[int], toward: Optional[str], away_from: Optional[str], strength: float) -> Optional[Steer]:
    """--steer L --toward TEXT --away-from TEXT --strength α; None when none of them is given."""
    if layer is None and toward is None and away_from is None:
        return None
    if layer is None:
        raise BadValue("steer", " is missing: toward and away_from steer the output of one layer, steer L",
                       also=("toward", "away_from", "steer"))
    if toward is None or away_from is None:
        missing = " and ".join(n for n, v in (("toward", toward), ("away_from", away_from)) if v is None)
        raise BadValue("steer", f" {layer} needs both texts: {missing} missing (v = layer output for toward − "
                                f"for away_from)", also=("toward", "away_from"))
    if not math.isfinite(strength):
        raise BadValue("strength", " must be a finite number")
    return Steer(layer, toward, away_from, strength)


def parse_control_vector(text: str) -> ControlVector:
    """'FILE' or 'FILE:SCALE' (a suffix that is not a number belongs to the file name)."""
    path, colon, scale = text.rpartition(":")
    if colon:
        try:
            return ControlVector(path, float(scale))
        except ValueError:
            pass
    return ControlVector(text, 1.0)


def parse_interventions(ablate=(), scale=(), patch=(), source: Optional[str] = None, steer: Optional[int] = None,
                        toward: Optional[str] = None, away_from: Optional[str] = None, strength: float = 1.0,
                        control_vector=()) -> list[Intervention]:
    """The interventions of a command line, in one list: ablations, scalings, patches, the steer, control vectors."""
    if source is not None and not patch:
        raise BadValue("source", " is the text a patch takes its activations from; give patch L.POINT@P too",
                       also=("patch",))
    out: list[Intervention] = [parse_ablate(a) for a in ablate or ()]
    out += [parse_scale(s) for s in scale or ()]
    out += [parse_patch(p, source) for p in patch or ()]
    st = parse_steer(steer, toward, away_from, strength)
    out += [st] if st is not None else []
    out += [parse_control_vector(c) for c in control_vector or ()]
    for cv in out:
        if isinstance(cv, ControlVector) and not Path(cv.path).is_file():
            raise BadValue("control_vector", f" {cv.path}: no such file")
    return out


# ----------------------------------------------------------------------------------------------------------------
# checks against the model


def _layer(field_name: str, iv, layer: int, n_layers: int) -> int:
    if not -n_layers <= layer < n_layers:
        raise BadValue(field_name, f" {iv.spec}: layer {layer} is out of range; "
                                   f"this model has {plural(n_layers, 'layer')} "
                                   f"(0..{n_layers - 1}, or -1..-{n_layers} from the end)")
    return layer % n_layers


def _head(field_name: str, iv, head: int, n_heads: int) -> int:
    if not 0 <= head < n_heads:
        raise BadValue(field_name, f" {iv.spec}: head {head} is out of range; this model has {n_heads} query heads "
                                   f"(0..{n_heads - 1})")
    return head


def _expert(field_name: str, iv, config) -> None:
    """An expert's intervention: its layer must be a mixture of experts, and K one of its E experts."""
    from llmtrace.model.moe_points import moe_layers

    layer = iv.layer % config.n_layers
    if layer not in moe_layers(config):
        what = (f"layer {layer} has a dense feed-forward (no experts)" if config.n_experts else
                "this model has no experts (its feed-forward is dense)")
        raise BadValue(field_name, f" {iv.spec}: {what}; L.eK names an expert of a mixture-of-experts layer")
    if not 0 <= iv.expert < config.n_experts:
        raise BadValue(field_name, f" {iv.spec}: expert {iv.expert} is out of range; layer {layer} has "
                                   f"{plural(config.n_experts, 'expert')} (0..{config.n_experts - 1})")


def _enough_experts(interventions, config) -> None:
    """Ablated experts leave each token at least K to run."""
    ablated: dict[int, set] = {}
    for iv in interventions:
        if isinstance(iv, Ablate) and iv.part == "expert":
            ablated.setdefault(iv.layer % config.n_layers, set()).add(iv.expert)
    for layer, gone in ablated.items():
        if config.n_experts - len(gone) < config.n_experts_used:
            most = config.n_experts - config.n_experts_used
            raise BadValue("ablate", f" removes {len(gone)} of layer {layer}'s {config.n_experts} experts, but each "
                                     f"token runs {config.n_experts_used}: at most {most} may be ablated")


def position_slot(field_name: str, iv, position: int, n_tokens: int, what: str, also: tuple[str, ...] = ()) -> int:
    """Position P (negative: from the end) of a text of n_tokens as 0-based, or a one-line error naming the range
    (`also`: the fields `what` names)."""
    if not -n_tokens <= position < n_tokens:
        raise BadValue(field_name, f" {iv.spec}: position {position} is out of range; "
                                   f"{what} has {plural(n_tokens, 'token')}"
                                   f" (0..{n_tokens - 1}, or -1..-{n_tokens} from the end)",
                       also=also)
    return position % n_tokens


def check(interventions: Sequence[Intervention], config, prompt_lengths: Sequence[int] = ()) -> None:
    """Layers, heads, points and positions against the model (its config and declared points) and the prompts, one
    line each; files are read in `prepare`."""
    from llmtrace.model.family import points_of

    resid = resid_points(points_of(config))
    for iv in interventions:
        name = iv.kind
        if isinstance(iv, ControlVector):
            continue
        if isinstance(iv, Hook):
            _hook_point(iv, config)
            continue
        _layer(name, iv, iv.layer, config.n_layers)
        if getattr(iv, "head", None) is not None:
            _head(name, iv, iv.head, config.n_heads)
        if getattr(iv, "expert", None) is not None:
            _expert(name, iv, config)
        if isinstance(iv, Patch):
            if iv.point != "head" and iv.point not in resid:
                raise BadValue(name, f" {iv.spec}: unknown point {iv.point!r}; points: {', '.join(resid)} or hH (a head)")
            for r, n in enumerate(prompt_lengths):
                position_slot(name, iv, iv.position, n, "the prompt" if len(prompt_lengths) == 1 else f"prompt {r + 1}")
    _enough_experts(interventions, config)


def _hook_point(iv: Hook, config) -> None:
    """A Hook's point against the model's declaration: a point of the model, or L.NAME with L one of its layers; a
    glob matches at least one point."""
    from llmtrace.model.family import points_of

    if any(c in iv.name for c in "*?["):
        return  # a glob ("*.resid_post"): matched against the built model's points when the run is prepared
    points = points_of(config)
    head, dot, rest = iv.name.partition(".")
    if dot and head.lstrip("-").isdigit():
        _layer("hook", iv, int(head), config.n_layers)
        known = points.names(layer=True)
    else:
        rest, known = iv.name, points.names(layer=False)
    if rest not in known:
        raise BadValue("hook", f" {iv.name}: {rest!r} is not a point of this model; the model's own: "
                               f"{', '.join(points.names(layer=False))}; a layer's: L.NAME with NAME one of "
                               f"{', '.join(points.names(layer=True))}")


def read_control_vector(path, d_model: int, n_layers: int) -> dict[int, "object"]:
    """llama.cpp's control-vector GGUF -> {layer: direction (D,) float32 numpy}. As llama.cpp's loader
    (common_control_vector_load_one) reads it: every tensor is `direction.N` with N ≥ 1, float32, one dimension, all of
    one width. That width must be the model's D, and N a layer of the model (llama.cpp ignores N ≥ its layer count;
    here that is an error: the file was made for another model)."""
    import numpy as np

    p = Path(path)
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(p))
    except Exception as e:  # a file gguf cannot read: one line
        raise LlmtraceError(f"control vector {p}: not a readable GGUF file ({' '.join(str(e).split())[:120]})") from None
    out: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"direction\.(\d+)", t.name)
        if not m or int(m[1]) == 0:
            raise LlmtraceError(f"control vector {p}: tensor {t.name!r} is not a direction.N with N ≥ 1 "
                                f"(the names llama-cvector-generator writes)")
        data = np.asarray(t.data)
        if t.tensor_type.name != "F32" or data.ndim != 1:
            raise LlmtraceError(f"control vector {p}: {t.name} must be one float32 vector, not {t.tensor_type.name} "
                                f"of shape {list(data.shape)}")
        out[int(m[1])] = data.astype(np.float32)
    if not out:
        raise LlmtraceError(f"control vector {p}: no direction.N tensors in the file")
    widths = sorted({v.shape[0] for v in out.values()})
    if widths != [d_model]:
        raise LlmtraceError(f"control vector {p} has directions of width {', '.join(map(str, widths))}, but this "
                            f"model's width is {d_model}; it was made for another model")
    top = max(out)
    if top >= n_layers:
        raise LlmtraceError(f"control vector {p} has directions up to direction.{top} ({plural(top, 'layer')}), "
                            f"but this model has {plural(n_layers, 'layer')} (directions 1..{n_layers - 1}); "
                            "it was made for another model")
    return out


# ----------------------------------------------------------------------------------------------------------------
# applying them: the editor of the model's edit points


class Edits:
    """The editor that `Transformer.hooked` attaches: for each (layer, edit point), the edits made there, in the
    order the interventions were given. The generation loop tells it of each pass (`begin_pass`): whether it is the
    prompt's pass (patches apply there only; a mean ablation takes its mean there) and each row's pad slots (a left-
    padded batch), so that position P of a row is slot pads[row] + P."""

    def __init__(self, interventions: Sequence[Intervention]):
        self.interventions = list(interventions)
        self.ops: dict[tuple[int, str], list[Callable]] = {}
        self.prompt_pass = True
        self.pads: list[int] = [0]
        self.spell_out = False  # a hook observes a step that exists only where attention is spelled out

    @property
    def layers(self) -> list[int]:
        """The layers whose points it edits or observes (the model's own points are always hooked)."""
        return sorted({layer for layer, _ in self.ops if layer is not None})

    def add(self, layer: int, point: str, op: Callable) -> None:
        self.ops.setdefault((layer, point), []).append(op)

    def begin_pass(self, prompt: bool, pads: Optional[Sequence[int]] = None) -> None:
        self.prompt_pass = prompt
        self.pads = list(pads) if pads is not None else [0]

    def __call__(self, layer: int, name: str, x):
        for op in self.ops.get((layer, name), ()):
            x = op(x)
        return x

    def slots(self, position: int, T: int) -> list[int]:
        """Each row's slot of prompt position P (P ≥ 0 after its pads; negative P from the end, where rows align)."""
        return [T + position if position < 0 else pad + position for pad in self.pads]


def prepare(lm, interventions: Sequence[Intervention], prompt_lengths: Sequence[int],
            encode: Optional[Callable[[str], list[int]]] = None) -> Optional[Edits]:
    """Check the interventions against the model and the prompts, compute what they need (the source activations of
    patches, the steering vectors, the control vectors' directions) and return the editor; None for no intervention.
    `encode` turns a text an intervention runs into ids (default: the tokenizer's plain encoding). Every intervention
    becomes hooks (`hooks_of`): named functions fn(x, point) at points, as a researcher's own Hook is."""
    if not interventions:
        return None
    from llmtrace.model.capture import layer_points
    from llmtrace.run.hookpoints import point_table

    check(interventions, lm.config, prompt_lengths)
    encode = encode or (lambda text: lm.tokenizer.encode_prompt(text)[1])
    edits = Edits(interventions)
    table = point_table(lm.model, lambda i: layer_points(lm.model, i))
    for iv in interventions:
        for hook in hooks_of(lm, edits, iv, encode):
            _add_hook(lm, edits, hook, table)
    return edits


def hooks_of(lm, edits: Edits, iv: Intervention, encode: Callable[[str], list[int]]) -> list[Hook]:
    """The hooks an intervention is: a function fn(x, point) at each point it edits (Ablate and Scale at their part's
    output, or an expert's router score or weight; Patch and Steer at their point, with the activations they read
    computed here; a control vector at each layer's output it has a direction for; a Hook as it is)."""
    import torch

    if isinstance(iv, Hook):
        return [iv]
    c, points = lm.config, lm.points
    at = lambda layer, point: f"{layer % c.n_layers}.{point}"  # noqa: E731
    if isinstance(iv, (Ablate, Scale)) and iv.part == "expert":
        router, weights = expert_points(points)
        return [Hook(at(iv.layer, router if isinstance(iv, Ablate) else weights), _expert_edit(iv))]
    if isinstance(iv, (Ablate, Scale)):
        return [Hook(at(iv.layer, part_point(points, iv.part)), _ablate_or_scale(edits, iv))]
    if isinstance(iv, Patch):
        layer = iv.layer % c.n_layers
        point = part_point(points, "head") if iv.point == "head" else iv.point
        ids = _source_ids(iv, encode, "source", iv.source, c.max_seq_len)
        pos = position_slot("patch", iv, iv.position, len(ids), "the source text", also=("source",))
        acts = grab(lm.model, ids, [(layer, point)])[(layer, point)]  # (T_src, D) or (T_src, H, Dh)
        vec = acts[pos] if iv.head is None else acts[pos, iv.head]
        return [Hook(at(layer, point), _patch(edits, iv, vec))]
    out = layer_output(points)
    if isinstance(iv, Steer):
        v = steering_vector(lm, iv.layer % c.n_layers, _source_ids(iv, encode, "toward", iv.toward, c.max_seq_len),
                            _source_ids(iv, encode, "away_from", iv.away_from, c.max_seq_len))
        return [Hook(at(iv.layer, out), _add(iv.strength * v))]
    return [Hook(at(layer, out), _add(iv.scale * torch.from_numpy(direction).to(lm.device)))
            for layer, direction in read_control_vector(iv.path, c.d_model, c.n_layers).items()]


def _add_hook(lm, edits: Edits, iv: Hook, table) -> None:
    """A hook as one more edit of the one hook, at each point of the built model its name picks."""
    from llmtrace.run.hookpoints import canonical, hook_op, needs_spelled_attention, select

    for info in select(table, canonical(iv.name, lm.config.n_layers, "hook"), None, lm.config.n_layers, "hook"):
        edits.add(info.layer, info.point, hook_op(info, iv.fn, table))
        edits.spell_out = edits.spell_out or needs_spelled_attention(info)


def _source_ids(iv, encode, field_name: str, text: str, ctx: int) -> list[int]:
    """The ids of the text an intervention runs, given as `field_name` (source, toward, away_from)."""
    ids = encode(text)
    if not ids:
        raise BadValue(iv.kind, f" {iv.spec}: the {field_name} text is empty (it encodes to zero tokens)",
                       also=(field_name,))
    if len(ids) > ctx:
        raise BadValue(iv.kind, f" {iv.spec}: the {field_name} text has {plural(len(ids), 'token')}, "
                       "more than the context "
                       f"window ({ctx})", also=(field_name,))
    return ids


def grab(model, ids: list[int], points: Sequence[tuple[int, str]], logits: Optional[list] = None) -> dict:
    """The values at points (layer, name) of one pass over ids alone (no cache, no intervention), batch dimension
    dropped: {(layer, name): tensor}. `logits`, a list, receives the pass's last-position logits (V,)."""
    import torch

    from llmtrace.model.capture import capture

    idx = torch.tensor([ids], dtype=torch.long, device=model.embed.weight.device)
    with torch.inference_mode(), capture(model, points) as kept:
        last = model(idx, last_only=True)[0]
    if logits is not None:
        logits.append(last)
    return {key: x[0] for key, x in kept.items()}


def steering_vector(lm, layer: int, toward: list[int], away: list[int]):
    """v = layer's output (its last residual-stream point) at the last token of `toward` minus the same for `away`,
    each run alone. (D,)"""
    at = (layer, layer_output(lm.points))
    return grab(lm.model, toward, [at])[at][-1] - grab(lm.model, away, [at])[at][-1]


def _ablate_or_scale(edits: Edits, iv):
    """The hook function of Ablate / Scale at its part's output point."""
    import torch

    factor = 0.0 if isinstance(iv, Ablate) else iv.factor
    if iv.part != "head":  # o_proj or down, (B, T, D)
        def scale_output(x, point):
            return x * factor if factor != 0.0 else x.new_zeros(x.shape)
        return scale_output
    h = iv.head
    if not getattr(iv, "mean", False):
        def scale_head(x, point):  # (B, T, H, Dh)
            x = x.clone()
            x[:, :, h] = 0.0 if factor == 0.0 else x[:, :, h] * factor
            return x
        return scale_head
    means = {}  # the mean over the prompt's positions, (B, Dh), taken in the prompt's pass and kept for decode steps

    def mean_head(x, point):  # (B, T, H, Dh)
        if edits.prompt_pass:
            means["m"] = torch.stack([x[r, pad:, h].mean(0) for r, pad in enumerate(edits.pads)])
        x = x.clone()
        x[:, :, h] = means["m"][:, None]
        return x
    return mean_head


def _expert_edit(iv):
    """Ablate: expert K's router score is -inf (B, T, E), so the softmax gives it 0 and the top K pass it by. Scale:
    its routing weight (B, T, E) times α, which multiplies its output wherever it runs."""
    k = iv.expert

    def scale_expert(x, point):
        x = x.clone()
        if isinstance(iv, Ablate):
            x[..., k] = float("-inf")
        else:
            x[..., k] = x[..., k] * iv.factor
        return x
    return scale_expert


def _patch(edits: Edits, iv: Patch, vec):
    """Replace the value at prompt position P by `vec` (D,) or (Dh,) in the prompt's pass only."""
    head = iv.head

    def patch_position(x, point):  # (B, T, D), or (B, T, H, Dh) for a head
        if not edits.prompt_pass:
            return None
        x = x.clone()
        for r, slot in enumerate(edits.slots(iv.position, x.size(1))):
            if head is None:
                x[r, slot] = vec.to(x.dtype)
            else:
                x[r, slot, head] = vec.to(x.dtype)
        return x
    return patch_position


def _add(v):
    """Add v (D,) at every position of every pass."""
    def add_vector(x, point):
        return x + v.to(x.dtype)
    return add_vector
