"""The vocabulary a model uses to declare itself: observable points, weights and the seed table's steps.

No torch here: a saved trace is read and drawn with these declarations alone (`llmtrace show`, the report).

A *point* is a named tensor of the forward pass, reported to a hook (`Module.point(name, x)` in model.transformer).
Each module class declares its points in forward order (`POINTS`), and the model puts them together into one
declaration (`Transformer.declared_points()`): the trace, the terminal, the report, compare and the interventions
iterate over it and never spell a point name. A new point is one line in the module that computes it.

A *weight* is one parameter of a module, with the checkpoint tensors it is read from (HF and GGUF keys, stacked along
its first axis when there are several: q, k, v into one fused matrix). The loaders, the quantized and fast paths, the
memory check and `explain`'s parameter counts read these declarations.

Axes are named in the model file's notation (model.transformer's docstring):
    B batch rows   T tokens of this call   S key/value slots   D width   H query heads   Hkv key/value heads
    G query heads per KV head   Dh head width   F feed-forward width   V vocabulary   E experts   K experts chosen
    Fe one expert's feed-forward width
  and, in a linear-attention layer (Qwen3.5's Gated DeltaNet):
    Hk key heads   Hv value heads   Dk key head width   Dv value head width   C conv channels   Kc conv kernel
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

# The seed table (seeds/001): each step's title, as the trace and the views show it. A point names its step.
SEED_STEPS = {
    "s1": "tokenize", "s2": "token ids", "s3": "padding and attention mask", "s4": "embedding",
    "s5": "position (RoPE)", "s6": "decoder layers", "s6.1": "pre-norm and Q/K/V projections",
    "s6.2": "split into heads", "s6.3": "RoPE on Q and K", "s6.4": "scores QKᵀ/√d + mask",
    "s6.5": "softmax, then P·V", "s6.6": "output projection + residual", "s6.7": "feed-forward + residual",
    "s6.8": "K/V written to the cache", "s7": "last position", "s8": "final norm", "s9": "LM head → logits",
    "s10": "temperature, penalties, bias", "s11": "truncation (top-k, top-p, min-p, ...)", "s12": "sample, detokenize",
}

AXES = {
    "B": "batch rows", "T": "tokens in this pass", "S": "key/value slots attended", "D": "model width",
    "H": "query heads", "Hkv": "key/value heads", "G": "query heads per KV head", "Dh": "head width",
    "F": "feed-forward width", "V": "vocabulary", "E": "experts", "K": "experts chosen per token",
    "Fe": "one expert's feed-forward width", "Hk": "linear attention's key heads",
    "Hv": "linear attention's value heads", "Dk": "a key head's width", "Dv": "a value head's width",
    "C": "the short convolution's channels (q, k and v)", "Kc": "the short convolution's kernel",
}


@dataclass(frozen=True)
class Point:
    """One observable point of the forward pass.

    `axes` name the dimensions of the tensor as the trace records it: the batch axis dropped, and a broadcast view
    recorded as the tensor it stands for (GQA's repeated keys: H, S, Dh). `where` is the part of the model that
    reports it: "model" (outside the layers), "block" (a layer's residual stream and norms), "attn" (the attention
    sub-layer: observing any of its points observes that sub-layer) or "ffn". `editable`: a hook may return a tensor
    that replaces the value (interventions); otherwise what a hook returns is an error. `traced`: recorded in a
    trace when its layer is (False for a point that repeats another: resid_pre is the previous layer's resid_post).
    `stored`: its full values can be kept (--save-tensors; False for a view or a list of slots). `residual`: the
    residual stream itself (what --trace layers records of each layer). `state`: a layer's recurrent state after the
    pass, the fixed-size memory a linear-attention layer carries from step to step (what the KV cache is to
    attention): its size is the same at every step."""

    name: str
    step: str  # seed step, e.g. "s6.3"
    axes: tuple[str, ...]
    where: str = "block"
    editable: bool = False
    traced: bool = True
    stored: bool = True
    residual: bool = False
    about: str = ""  # one line: what the tensor is
    input: str = ""  # the point of the same layer this one is computed from, where one step makes it (a norm's input)
    state: bool = False

    def record(self) -> dict:
        """The point as a trace's `run` event lists it."""
        return {"name": self.name, "seed_step": self.step, "axes": list(self.axes), "where": self.where,
                "editable": self.editable, "traced": self.traced, "stored": self.stored, "residual": self.residual,
                "about": self.about, "input": self.input} | ({"state": True} if self.state else {})


def point_from_record(r: dict) -> Point:
    return Point(r["name"], r.get("seed_step") or "", tuple(r.get("axes") or ()), r.get("where", "block"),
                 bool(r.get("editable")), bool(r.get("traced", True)), bool(r.get("stored", True)),
                 bool(r.get("residual")), r.get("about", ""), r.get("input", ""), bool(r.get("state")))


@dataclass(frozen=True)
class Points:
    """A model's declared points, in forward order: `model` outside the layers (before and after them), `layer` the
    points of one decoder layer."""

    before: tuple[Point, ...]  # model points before the layers (the embedding)
    layer: tuple[Point, ...]
    after: tuple[Point, ...]  # model points after the layers (final norm, last position, logits)

    def __iter__(self):
        return iter(self.before + self.layer + self.after)

    @property
    def model(self) -> tuple[Point, ...]:
        return self.before + self.after

    def names(self, where: Optional[Iterable[str]] = None, *, layer: Optional[bool] = None,
              traced: Optional[bool] = None, editable: Optional[bool] = None, stored: Optional[bool] = None,
              residual: Optional[bool] = None) -> tuple[str, ...]:
        """Point names in forward order, filtered: `layer` True for layer points, False for model points; `where`
        the parts reporting them; the others by those flags."""
        pts = {None: tuple(self), True: self.layer, False: self.model}[layer]
        where = None if where is None else set([where] if isinstance(where, str) else where)
        flags = {"traced": traced, "editable": editable, "stored": stored, "residual": residual}
        return tuple(p.name for p in pts if (where is None or p.where in where)
                     and all(v is None or getattr(p, k) == v for k, v in flags.items()))

    def get(self, name: str) -> Optional[Point]:
        return next((p for p in self if p.name == name), None)

    def step_of(self, name: str) -> Optional[str]:
        p = self.get(name)
        return p.step if p is not None else None

    def records(self) -> list[dict]:
        return [p.record() | {"layer": p in self.layer} for p in self]

    @classmethod
    def from_records(cls, records: list[dict]) -> "Points":
        """The declaration a trace carries (its `run` event's `points`)."""
        before, layer, after = [], [], []
        for r in records:
            p = point_from_record(r)
            (layer if r.get("layer") else (after if layer else before)).append(p)
        return cls(tuple(before), tuple(layer), tuple(after))


def splice(points: tuple, parts: dict[str, tuple[Point, ...]]) -> tuple[Point, ...]:
    """A block's POINTS, whose entries are Points or the name of a sub-module ("attn", "ffn") whose own points go
    there, made into one tuple of points in forward order."""
    out: list[Point] = []
    for p in points:
        out.extend(parts[p] if isinstance(p, str) else (p,))
    return tuple(out)


def inserted(points: tuple, after: str, *new: Point) -> tuple:
    """A module's POINTS with `new` placed right after the point (or sub-module) named `after`: how a family's module
    adds its steps to the one it changes."""
    i = next(k for k, p in enumerate(points) if (p if isinstance(p, str) else p.name) == after)
    return points[: i + 1] + tuple(new) + points[i + 1 :]


def with_where(points: Iterable[Point], where: str) -> tuple[Point, ...]:
    return tuple(replace(p, where=where) for p in points)


# ----------------------------------------------------------------------------------------------------------------
# weights


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor a weight is read from. Keys are relative to the module's own prefixes (an HF key such
    as "q_proj.weight" under "model.layers.3.self_attn."; a GGUF key such as "attn_q.weight" under "blk.3."); None
    where the format has no such tensor. `rows` is the tensor's first dimension as axes ("H*Dh"); `math` its name in
    the maths (Wq); `permuted`: llama.cpp's converter reorders this tensor's rows for its RoPE pairing, per head of
    this many heads ("H" or "Hkv") in the archs that do so (model.families); `hf_add`: a constant the HF tensor is
    stored without (Gemma's norms multiply by 1 + w; llama.cpp's converter adds the 1, so a GGUF stores it). An HF key
    with `{e}` in it is one tensor per expert (experts.{e}.w1.weight), `rows` of them ("E") stacked along a new first
    axis; a GGUF holds the same stack as one 3-D tensor. `hf_transform`: the load transforms (TRANSFORMS' names, in
    order) that turn the HF tensor into this part, where HF stores it in another layout (gpt-oss's experts: x·W as
    (E, in, out), gate and up interleaved in one tensor that two sources then share; Qwen3.5's convolution as
    (C, 1, Kc)) or as another quantity (Qwen3.5's A_log, whose −exp a GGUF stores)."""

    hf: Optional[str]
    gguf: Optional[str]
    rows: str = ""
    math: str = ""
    permuted: Optional[str] = None
    hf_add: float = 0.0
    hf_transform: tuple[str, ...] = ()


# The load transforms a Source may name: small, named changes of layout, applied by the loader in the order given
# (checkpoint.weights.TRANSFORMS holds their code). Each keeps the values but neg_exp, which reads a quantity stored
# as its log, as llama.cpp's converter writes it.
TRANSFORMS = {
    "transpose": "the last two axes swapped: a stack stored for x·W, (E, in, out), held as (E, out, in)",
    "even": "the even entries of the axis after the first (gate of an interleaved gate/up: g0 u0 g1 u1 ...)",
    "odd": "the odd entries of the axis after the first (up of an interleaved gate/up)",
    "squeeze1": "the axis of size 1 after the first dropped: a depthwise convolution's (C, 1, Kc) held as (C, Kc)",
    "head_rows": "head_rows:n:a:b, rows [a, b) of each of n heads' blocks of rows, as (n, b − a, in): one part of "
                 "a per-head fused matrix (MLA's kv_b_proj: each head's k_nope rows, then its v rows)",
    "gate_half": "the first half of the second-to-last axis (gate of a [gate; up] stack: Granite's input_linear)",
    "up_half": "the second half of the second-to-last axis (up of a [gate; up] stack)",
    "neg_exp": "x -> −exp(x): a decay rate stored as its log (A_log), held as the negative rate A = −exp(A_log), "
               "computed in float32 as transformers computes it",
}


@dataclass(frozen=True)
class Weight:
    """One parameter: its name in the module ("wqkv.weight"), its shape as axes (in storage order: nn.Linear holds
    (out, in)), its seed step, its kind ("matrix" is used as x @ W^T, "vector" is a norm's scale or a bias,
    "embedding" is looked up by row, "experts" is a stack of E matrices), and the checkpoint tensors it is made of,
    stacked along its first axis."""

    name: str
    shape: tuple[str, ...]
    step: str
    kind: str
    sources: tuple[Source, ...]
    math: str = ""  # how explain names it (Wq Wk Wv, γ)

    def dims(self, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(axis_size(a, dims) for a in self.shape)


def axis_size(expr: str, dims: dict[str, int]) -> int:
    """'H*Dh' with H = 9, Dh = 64 -> 576; '2*F' -> 2F; '(H+2*Hkv)*Dh' is written as a sum of products 'H*Dh+2*Hkv*Dh'."""
    total = 0
    for term in expr.split("+"):
        total += math.prod(int(f) if f.isdigit() else dims[f] for f in term.split("*"))
    return total


@dataclass(frozen=True)
class DeclaredWeight:
    """A weight of the built model, every key absolute: the parameter's full name, its shape in numbers, and each
    source with its full HF and GGUF keys and its row count."""

    param: str
    weight: Weight
    shape: tuple[int, ...]
    sources: tuple["DeclaredSource", ...]


@dataclass(frozen=True)
class DeclaredSource:
    hf: Optional[str]
    gguf: Optional[str]
    rows: int
    math: str
    permuted_heads: Optional[int]  # heads whose rows llama.cpp reorders for its RoPE, in the archs it does so
    hf_add: float
    hf_transform: tuple[str, ...] = ()

