"""The maths a model declares: for every point, the operation that computed it, and for every layer, its plan.

No torch here (the modules `op_kinds()` imports hold the evaluators, in torch): a saved trace carries this declaration (its `run` event's `maths`), and `show`, the report and explain
render each step's formula from it, never from a step name, a config field or Llama's defaults.

An *operation* (`Op`) names what made a point: its kind (a key of `op_kinds()`), its operands (`inputs`: point names), the
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

An *operation kind* (`OpKind`) is declared once, in one registry (`declare`, `op_kinds`): its key, its formula
line with its words in English and Chinese, and its float64 evaluator (model.recompute.apply calls it: the
declaration's own check). The kinds every model uses live in model.ops; a kind only one kind of layer uses is
declared in that layer's file (model.kinds.mamba2: the scan; model.kinds.mla: the latent's up-projection), and
`op_kinds()` imports every declarer, so that a trace read back knows each kind. A family that changes a step declares
that step's operation in its own file (model.families); a new kind of step is one `OpKind` beside the code that
needs it.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Callable, Optional

from llmtrace.errors import LlmtraceError

# ----------------------------------------------------------------------------------------------------------------
# the operation kinds: each declared once, in one registry


@dataclass(frozen=True)
class OpKind:
    """One kind of operation, declared once, beside the code that uses it: `key` (the protocol value an `Op` and a
    trace carry), `short` (its formula without operands, as the docs and a fallback write it), `line` (the formula
    with its operands and this layer's constants: `line(o, name, x, c, say)`, `x` the operands as said, `c` the
    constants, `say(word, **values)` one of the words in the reader's language), `words` ({word: (English, Chinese)}:
    every word `line` says), `evaluate` (the point in float64 from its operands' and weights' tensors:
    `evaluate(o, x, w, out_shape, positions=, padding=)`, model.recompute.apply calls it; None: nothing to recompute,
    as for the slots a cache write names), what its worked card reads beside that (trace.cards): `kept` (only the
    sampled outputs, from the weight rows they read: `kept(o, x, w, out_shape, index, memo)`, for a weight read a row
    at a time, so that a 262k-row head is never made float64), `dot` (one output per row as the dot product of the
    input row and the weight row: `dot(o, x, w, out_shape, first, memo)`) and `aux` (the numbers its card prints, per
    row: `aux(o, x, w, out_shape)`), and `module` (where it is declared).

    What the views read of a point of this kind, declared here so that no view compares a kind's key: `role` (what
    a view may ask a point to be, one of ROLES: ROTATION, the points that turn q and k by their positions, which the
    run's summary names; ACTIVATION, a gated activation, whose name, SwiGLU or GeGLU, the page's step title says;
    "" for none) and `card` (the numbers a worked card prints from the operation's constants alone, beside the
    recorded values: `card(o)` -> {...} or None; RoPE's, the unscaled θᵢ a scaled RoPE does not run)."""

    key: str
    short: str
    line: Callable[..., str]
    words: dict = field(default_factory=dict)
    evaluate: Optional[Callable[..., Any]] = None
    module: str = ""
    kept: Optional[Callable[..., Any]] = None
    dot: Optional[Callable[..., Any]] = None
    aux: Optional[Callable[..., Any]] = None
    role: str = ""
    card: Optional[Callable[..., Optional[dict]]] = None

    def __post_init__(self):
        bad = [w for w, said in self.words.items() if not (isinstance(said, tuple) and len(said) == 2 and all(said))]
        if bad:
            raise ValueError(f"operation {self.key!r}: words {bad} need an English and a Chinese text")
        if self.role not in ROLES:
            raise ValueError(f"operation {self.key!r}: role {self.role!r} is none of {ROLES}")


# The roles a view may ask an operation kind for (OpKind.role): the views read a role, never a kind's key.
ROTATION = "rotation"  # turns q and k by their positions (RoPE): the summary names the points that do
ACTIVATION = "activation"  # a gated activation: the page's step title names the model's (SwiGLU, GeGLU)
ROLES = ("", ROTATION, ACTIVATION)


OP_KINDS: dict[str, OpKind] = {}  # key -> its declaration (declare() fills it; op_kinds() imports every declarer)
# the modules that declare operation kinds: the generic ones, then every kind of layer's and family's own
DECLARERS = ("llmtrace.model.ops", "llmtrace.model.kinds", "llmtrace.model.families")


def declare(module: str, *kinds: OpKind) -> None:
    """Register operation kinds: `declare(__name__, OpKind(...), ...)`, once, at the declaring module's import. A key
    or a word declared twice with another meaning is an error: each has one home."""
    words = {w: said for k in OP_KINDS.values() for w, said in k.words.items()} | SHARED_WORDS
    for k in kinds:
        old = OP_KINDS.get(k.key)
        if old is not None and old.module != module:
            raise ValueError(f"operation {k.key!r} is declared in {old.module} and in {module}")
        clash = [w for w, said in k.words.items() if w in words and words[w] != said and old is None]
        if clash:
            raise ValueError(f"operation {k.key!r}: words {clash} are another declaration's")
        OP_KINDS[k.key] = replace(k, module=module)


@cache
def _imported() -> None:
    """Import every module that declares operation kinds (DECLARERS: a package's modules, each), once."""
    for name in DECLARERS:
        module = importlib.import_module(name)
        if hasattr(module, "__path__"):
            for m in pkgutil.iter_modules(module.__path__):
                importlib.import_module(f"{name}.{m.name}")


def op_kinds() -> dict[str, OpKind]:
    """Every declared operation kind, by key: a trace read back (show, report) knows each kind any layer declares."""
    _imported()
    return OP_KINDS


def op_kind(key: str) -> OpKind:
    """The declaration of one kind; ValueError for a key nothing declares."""
    found = OP_KINDS.get(key) or op_kinds().get(key)
    if found is None:
        raise ValueError(f"unknown operation {key!r}: the declared kinds are {', '.join(sorted(OP_KINDS))}")
    return found


def card_numbers(o: "Op") -> Optional[dict]:
    """The numbers the worked card of `o` prints from its constants alone (its kind's `card`), or None."""
    card = op_kind(o.kind).card
    return None if card is None else card(o)


def has_role(kind: str, role: str) -> bool:
    """Whether the operation kind `kind` (a key, as a record writes it) plays `role` (one of ROLES); False for a key
    no kind of this version declares."""
    declared = op_kinds().get(kind)
    return declared is not None and declared.role == role


PREV = "^"  # an operand of the layer before (see the module docstring)
OF_LAYER = "@"  # "@j:x", the point x of layer j: an earlier layer's keys and values that a KV-shared layer reads


@dataclass(frozen=True)
class Op:
    """One point's operation: `kind` (a key of op_kinds()), the points it reads, the weights it reads, its constants."""

    kind: str
    inputs: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    consts: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        op_kind(self.kind)  # a declared kind, or ValueError

    def const(self, key: str, default: Any = None) -> Any:
        return dict(self.consts).get(key, default)

    def record(self) -> dict:
        return {"op": self.kind, "inputs": list(self.inputs), "weights": list(self.weights),
                "consts": dict(self.consts), "role": op_kind(self.kind).role}  # (a view reads it without the registry)

    def prefixed(self, prefix: str) -> "Op":
        """The same operation with its weights named from a parent module ("attn." + "wqkv.weight")."""
        return Op(self.kind, self.inputs, tuple(prefix + w for w in self.weights), self.consts)


def op(kind: str, inputs=(), weights=(), **consts) -> Op:
    """Op(kind, ...) with its constants as keywords; None values are kept (a declared absence: no soft-cap)."""
    return Op(kind, tuple(inputs), tuple(weights), tuple(consts.items()))


def op_from_record(r: dict) -> Op:
    if r.get("op") not in op_kinds():  # a trace of another version: one line, not a traceback
        raise LlmtraceError(f"the trace's maths names an operation {r.get('op')!r} that no kind of this llmtrace "
                            "declares (a trace written by another version?)")
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
    """One line on this layer's RoPE: its base and rotary width, or none (in `words`' language: words_in)."""
    W = words_in("en") if not words else {**words_in("en"), **words}
    r = plan.rope
    if not r:
        return W["rope_none"]
    width = W["rope_width"].format(dr=r["rotary_dim"], dh=r["head_dim"]) if r.get("rotary_dim") != r.get("head_dim") else ""
    kind = (r.get("scaling") or {}).get("rope_type")
    return W["rope_base"].format(base=number(r["base"])) + width + (
        W["rope_scaled"].format(kind=kind) if kind and kind != "default" else "")


def number(x: float) -> str:
    """1,000,000 rather than 1e+06: a RoPE base as people write it."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,g}"


def attention_words(plan: LayerPlan) -> str:
    if plan.heading("summary"):  # a kind of layer other than attention says what it is
        return plan.heading("summary")
    if plan.attention == "window":
        return f"a window of {plan.window:,} keys"
    return "global: every earlier key" if plan.attention == "global" else plan.attention


def weight_name(o: Op) -> str:
    """A weight's short name: the last two parts of its parameter ("attn.wqkv.weight" -> "wqkv")."""
    return o.weights[0].split(".")[-2] if o.weights else "W"


# The words every formula may say (an operand of another layer, the mask, RoPE's plan), in English and Chinese; each
# operation kind declares its own (OpKind.words). {name} marks a value.
SHARED_WORDS = {
    "prev_last": ("{name} of the last layer", "最后一层的 {name}"),
    "prev_any": ("{name} of the layer before (in layer 0: {first})", "上一层的 {name}（第 0 层：{first}）"),
    "prev_n": ("{name} of layer {n}", "第 {n} 层的 {name}"),
    "before_mask": (" (before the mask)", "（掩码之前）"),
    "mask": ("; −∞ at later keys", "；之后的键为 −∞"),
    "mask_window": ("; −∞ at later keys and keys {w} or more back", "；之后的键以及 {w} 个或更早之前的键为 −∞"),
    "carried": ("{ref} before this pass", "本次前向之前的 {ref}"),
    "cached": ("{ref} of every cached slot", "缓存中每个槽位的 {ref}"),
    "rope_base": ("base θ = {base}", "基数 θ = {base}"),
    "rope_width": (", rotary width {dr} of {dh}", "，旋转宽度 {dr}/{dh}"),
    "rope_none": ("no rotation in this layer", "这一层不旋转"),
    "rope_scaled": (", {kind} scaling", "，{kind} 缩放"),
    "window_of": ("; a window of {w}", "；窗口 {w} 个键"),
}
LANGS = ("en", "zh")  # the languages every word is declared in, in the order of its pair


def words_in(lang: str = "en") -> dict[str, str]:
    """Every formula word in one language: the shared ones and each declared operation kind's (a page in Chinese
    passes words_in("zh") to formula(), and its catalogue reads them as "maths.<word>")."""
    return dict(_words(lang, len(op_kinds())))


@cache
def _words(lang: str, n_kinds: int) -> dict[str, str]:
    """words_in's table, made once per language and number of declared kinds."""
    i = LANGS.index(lang) if lang in LANGS else 0
    out = {w: said[i] for w, said in SHARED_WORDS.items()}
    for k in op_kinds().values():
        out.update((w, said[i]) for w, said in k.words.items())
    return out


# the router's `order`, a key (traces before keys wrote it as an English phrase)
LEGACY_ORDERS = {"softmax, then top-k": "softmax_topk", "top-k, then softmax": "topk_softmax",
                 "sigmoid, then top-k": "sigmoid_topk"}


def formula(o: Op, name: str, layer: Optional[int] = None, maths: Optional["Maths"] = None,
            words: Optional[dict] = None) -> str:
    """The declared operation as one line of maths with its operands and this layer's constants: what a view shows
    beside the point `name` of `layer` (None: outside the layers; −1: any layer of its kind). Each kind says its own
    line (OpKind.line); explain, the report and serve take them from here; `words` says them in another language
    (words_in)."""
    english = _words("en", len(op_kinds()))
    W = english if not words else {**english, **words}
    say = lambda key, **v: W[key].format(**v)  # noqa: E731
    x = [_operand_words(i, layer, maths, say) for i in o.inputs]
    return op_kind(o.kind).line(o, name, x, dict(o.consts), say)


def carried_words(c: dict, ref: str, say) -> str:
    """An operand as said: "S before this pass" where it is a carried state (the op's `carried` constant)."""
    return say("carried", ref=ref) if ref in (c.get("carried") or ()) else ref


def cached_words(c: dict, ref: str, say) -> str:
    """An operand as said: "c_kv of every cached slot" where it spans the cache (the op's `cached` constant)."""
    return say("cached", ref=ref) if ref in (c.get("cached") or ()) else ref


def mask_words(c: dict, say) -> str:
    """What the mask hides, after a formula of scores: later keys, and keys a window leaves out."""
    if not c.get("mask"):
        return say("before_mask")
    return say("mask_window", w=f"{c['window']:,}") if c.get("window") else say("mask")


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
