"""The LLaMA-family decoder, written out so it can be read beside the seed table (s4-s9).

Notation, used in every shape comment:
    B   batch: rows run side by side (1 for a single prompt)
    T   tokens per row in this forward call (the prompt, or a chunk of it, during prefill; 1 during decode)
    S   key/value slots attended after this call: the cache's filled slots plus T (just T without a cache)
    D   model width (d_model)          V    vocabulary size        L   decoder layers
    H   query heads                    Hkv  key/value heads (GQA when Hkv < H)      G  = H / Hkv, query heads per KV head
    Dh  head width (D / H usually)     F    FFN width

Positions. A call writes cache slots [start, start+T) (the same slots for every row). Each token's position, which
RoPE turns into angles, is `input_pos` (B, T): by default start + [0, T) for every row; a left-padded batch gives each
row positions that start at 0 at its first real token. `attention_mask` (B, S) is False at pad slots; a query attends
to the slots at or before its own that are not pad (and, in a sliding-window layer, at most W slots back).

Declarations. Each module declares what it computes and what it is made of, so that nothing outside model/ has to
know this file: `POINTS`, the named tensors of its forward pass in order (model.points.Point: seed step, axes,
editable); `weights()`, its parameters with the checkpoint tensors they are read from (HF and GGUF keys); `CHILDREN`,
the key prefixes of its sub-modules. `Transformer.declared_points()` and `declared_weights()` put them together.

One hook. The forward pass names each point with `x = self.point(name, x)`, which costs one attribute check when
nothing is attached. `with model.hooked(hook, layers=...)` attaches a hook, called as hook(layer, name, x): it
observes (returns None) or, at an editable point, replaces the value (returns a tensor). The trace's recorder,
llmtrace's captures and the interventions are all such hooks. Hooked attention layers spell attention out (scores,
mask, softmax, P·V, with the GQA repetition as its own step) so those tensors exist; the rest use the fused kernel.
The model never formats, stores or prints anything itself, and holds no state between calls: the KV cache is passed.

Families. This file is Llama. A family (model/families/) is a small file of differences: subclasses of these modules
that change a step (Qwen3 norms q and k per head before RoPE), chosen through the class attributes `Transformer.block`,
`Block.attention`, `Block.feed_forward`, and `Block.WIRING`, how each part enters the residual stream (model.wiring:
pre-norm here; post-norms, sandwich norms, a residual multiplier, a rescale of the stream elsewhere); numbers (a score
scale, a window) come from the config.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.llama_points import (ACT, ATTN_NORM, ATTN_OUT, DOWN, EMBED, FFN_NORM, FINAL_NORM, GATE, K, K_REPEATED,
                                         K_ROPE, KV_WRITE, LAST, LOGITS, O_PROJ, PROBS, Q, Q_ROPE, RESID_MID, RESID_POST,
                                         RESID_PRE, SCORES, UP, V)
from llmtrace.model.maths import PREV, LayerPlan, Maths, Op, op
from llmtrace.model.memory import Memory, kv_memory
from llmtrace.model.memory import totals as memory_totals
from llmtrace.model.points import (DeclaredSource, DeclaredWeight, Point, Points, Source, Weight, axis_size, splice,
                                   with_where)
from llmtrace.model.wiring import Addition, LayerWiring, Path, Rescale, split_heads

# A hook is called as hook(layer, name, tensor), layer None outside the decoder layers, and returns None (it observed)
# or, at an editable point, the tensor the pass goes on with.
Hook = Callable[[Optional[int], str, torch.Tensor], Optional[torch.Tensor]]


# fields of an older ModelConfig that are now a config part: old field -> (part, key). A checkpoint's reader may
# still give a family's numbers by these names; ModelConfig.from_dict files each into its part.
EXPERTS = "experts"  # the config part of a mixture-of-experts feed-forward (model.moe), read by its declaration
MOVED_TO_PARTS = {"attn_softcap": ("softcap", "cap"), "swiglu_alpha": ("glu_clamp", "alpha"),
                  "swiglu_limit": ("glu_clamp", "limit"),
                  "n_experts": (EXPERTS, "n"), "n_experts_used": (EXPERTS, "k"), "expert_ffn_dim": (EXPERTS, "width"),
                  "norm_topk_prob": (EXPERTS, "renormalise"), "dense_layers": (EXPERTS, "dense_layers")}
# the values those fields had when they said nothing (a dense model's): not filed into a part
SAID_NOTHING = {"n_experts": 0, "n_experts_used": 0, "norm_topk_prob": True}


@dataclass
class ModelConfig:
    arch: str = "llama"  # source architecture name (llama, mistral, qwen2, qwen3, gemma3, ...), for display
    family: str = "llama"  # the family whose modules run it (model.families)
    n_layers: int = 30  # L: number of decoder layers
    d_model: int = 576  # D: width of the residual stream
    n_heads: int = 9  # H: query heads
    n_kv_heads: int = 3  # Hkv: key/value heads; H % Hkv == 0, G = H // Hkv query heads share one KV head
    head_dim: int = 64  # Dh: width of one head
    ffn_dim: int = 1536  # F: hidden width of the gated feed-forward block
    vocab_size: int = 49152  # V
    max_seq_len: int = 8192  # context window the model was trained for
    rope_theta: float = 10000.0  # RoPE base: theta_i = base^(-2i/Dh)
    rope_scaling: Optional[dict] = None  # None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", ...}
    rms_eps: float = 1e-5  # epsilon inside RMSNorm
    tie_embeddings: bool = False  # LM head shares the embedding matrix
    attn_bias: bool = False  # Qwen2-style bias on the q/k/v projections
    ffn_act: str = "silu"  # the gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    attn_scale: Optional[float] = None  # the scores' scale; None: 1/sqrt(Dh)
    sliding_window: Optional[int] = None  # W: a sliding-window layer's query sees at most the last W slots
    layer_types: Optional[list] = None  # per layer "full" or "sliding"; None: every layer full
    rope_local_theta: Optional[float] = None  # a separate RoPE base for the sliding-window layers (Gemma 3)
    rotary_dim: Optional[int] = None  # RoPE turns only the first rotary_dim dims of each head (Phi-3); None: all Dh
    final_softcap: Optional[float] = None  # the logits likewise (Gemma 2)
    no_rope_layers: Optional[list] = None  # layers that rotate nothing (SmolLM3's every 4th): q, k go on unturned
    # a kind's own config part, read by its own declaration (model.kinds): part name -> its fields, with "axes" the
    # sizes of the axis names its points and weights use ({"mla": {"axes": {"R": 512, ...}, ...}}); a mixture of
    # experts' is "experts" (model.moe: n, k, width, renormalise, dense_layers; the properties below read it)
    parts: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # facts kept for display only (source format, quantization, ...)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """A config as `asdict` wrote it, also by an older llmtrace (a cached GGUF conversion): fields that became a
        kind's own config part move into `parts`, None values dropped."""
        d, parts = dict(d), {name: dict(part) for name, part in (d.get("parts") or {}).items()}
        for old, (part, key) in MOVED_TO_PARTS.items():
            value = d.pop(old, None)
            if value is not None and not (old in SAID_NOTHING and value == SAID_NOTHING[old]):
                parts.setdefault(part, {})[key] = value
        return cls(**{**d, "parts": parts})

    # a mixture of experts' numbers, from its config part (EXPERTS; a dense feed-forward has none): E, K, Fe, whether
    # the K chosen weights are renormalised to sum to 1, the layers whose feed-forward stays dense

    @property
    def n_experts(self) -> int:
        return int(self.parts.get(EXPERTS, {}).get("n", 0))

    @property
    def n_experts_used(self) -> int:
        return int(self.parts.get(EXPERTS, {}).get("k", 0))

    @property
    def expert_ffn_dim(self) -> Optional[int]:
        return self.parts.get(EXPERTS, {}).get("width")

    @property
    def norm_topk_prob(self) -> bool:
        return bool(self.parts.get(EXPERTS, {}).get("renormalise", True))

    @property
    def dense_layers(self) -> Optional[list]:
        return self.parts.get(EXPERTS, {}).get("dense_layers")

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def dims(self) -> dict[str, int]:
        """The sizes the axis names of the declarations stand for."""
        out = {"D": self.d_model, "H": self.n_heads, "Hkv": self.n_kv_heads, "Dh": self.head_dim,
               "F": self.ffn_dim, "V": self.vocab_size, "G": self.group_size, "E": self.n_experts,
               "K": self.n_experts_used, "Fe": self.expert_ffn_dim or self.ffn_dim}
        for part in self.parts.values():
            out.update(part.get("axes", {}))
        return out

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full"

    def rotates(self, i: int) -> bool:
        """Whether layer i applies RoPE to q and k (False in a layer without positions: SmolLM3's NoPE layers)."""
        return i not in (self.no_rope_layers or ())


# ----------------------------------------------------------------------------------------------------------------
# a module with named points


class Module(nn.Module):
    """A module that declares its points (POINTS, in forward order; WHERE says which part of the model reports them)
    and its weights (`weights()`, keys relative to CHILDREN's prefixes), and reports each point to its hook."""

    POINTS: tuple = ()
    WHERE = "block"
    CHILDREN: dict[str, tuple[str, str]] = {}  # attribute -> (HF key prefix, GGUF key prefix)
    NORMS: dict[str, str] = {}  # point -> the attribute of the RMSNorm that computes it
    layer: Optional[int] = None
    _editable: frozenset = frozenset()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._editable = frozenset(p.name for p in cls.POINTS if isinstance(p, Point) and p.editable)

    def __init__(self):
        super().__init__()
        # an attribute of every instance, so that attaching and detaching changes its value only (a compiled step
        # guards on it)
        self.hook: Optional[Hook] = None

    def point(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Report x as point `name`; the value the pass goes on with (x, unless a hook replaced it)."""
        if self.hook is None:
            return x
        y = self.hook(self.layer, name, x)
        if y is None or y is x:
            return x
        if name not in self._editable:
            raise ValueError(f"point {name!r} is not editable; a hook may only observe it")
        return y

    @classmethod
    def declared_points(cls) -> tuple[Point, ...]:
        return with_where((p for p in cls.POINTS if isinstance(p, Point)), cls.WHERE)

    def weights(self) -> tuple[Weight, ...]:
        return ()

    # -- its direct paths into the residual stream (model.wiring) ----------------------------------------------

    # (the point of its merged heads (T, heads, width), the attribute of the output projection that reads them) in an
    # attention-like sub-layer, whose output then splits by head; None: its output is one part
    HEADS: Optional[tuple[str, str]] = None
    HEAD_KIND = "head"  # what a head's part is called ("linear_head": a linear-attention layer's value heads)

    @classmethod
    def output_point(cls) -> str:
        """The point of what this sub-layer hands back: its last."""
        return cls.declared_points()[-1].name

    def direct_points(self) -> tuple[str, ...]:
        """The points `direct_parts` reads."""
        return (self.HEADS[0],) if self.HEADS else (self.output_point(),)

    def direct_parts(self, x: torch.Tensor, got: Callable[[str], torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
        """Its output at one position split into the parts that sum to it: {name: (kind, (D,) float32)}. `x` is
        its input (D,), `got(point)` a point's value at that position. By head where it declares HEADS; else one
        part, named by its kind."""
        if self.HEADS:
            point, proj = self.HEADS
            return {n: (self.HEAD_KIND if k == "head" else k, v)
                    for n, (k, v) in split_heads(getattr(self, proj), got(point)).items()}
        name = getattr(self, "KIND", None) or self.WHERE
        return {name: (name, got(self.output_point()).float())}

    @classmethod
    def heads_point(cls) -> Optional[str]:
        """The per-head output a head's patch replaces: the last editable point of (T, heads, width) before the
        output projection (attention's attn_out, Qwen3.5's gated heads, a linear layer's value heads, Mamba2's
        read-out); None where the sub-layer has none (a short convolution)."""
        points = list(cls.declared_points())
        names = [p.name for p in points]
        before = points[:names.index(O_PROJ.name)] if O_PROJ.name in names else points
        return next((p.name for p in reversed(before) if p.editable and len(p.axes) == 3 and p.axes[0] == "T"), None)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma, computed in float32 like the reference implementation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, axis: str = "D", step: str = "s6.1"):
        super().__init__()
        self.eps, self.axis, self.step = eps, axis, step
        self.weight = nn.Parameter(torch.ones(dim))  # gamma, (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call (its statistic is taken in float32); for float32 inputs the same bits as the formula spelled out
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("weight", (self.axis,), self.step, "vector", (Source("weight", "weight"),), math="γ"),)

    GAMMA = "w"  # what the parameter γ is: the stored w (Gemma's norms: 1 + w, the 1 added at load)

    def op(self, x: str, prefix: str) -> Op:
        """This norm as a declared operation on point x; `prefix`: where its γ is ("attn_norm.")."""
        return op("rmsnorm", [x], [prefix + "weight"], eps=self.eps, gamma=self.GAMMA, over=self.axis)


# ----------------------------------------------------------------------------------------------------------------
# s5 RoPE: rotate each (i, i + Dh/2) pair of q and k by the angle pos * theta_i (applied inside attention, s6.3)


def rope_inv_freq(config: ModelConfig, theta: Optional[float] = None, scaling: Optional[dict] = None) -> torch.Tensor:
    """theta_i = base^(-2i/Dr) for i in [0, Dr/2), with the checkpoint's scaling applied. Shape (Dr/2,), float32.
    Dr is the rotary width: Dh, or the config's rotary_dim (Phi-3's partial rotary). `theta` / `scaling`: another
    base and scaling than the config's (Gemma 3's local layers)."""
    dh = config.rotary_dim or config.head_dim
    base = config.rope_theta if theta is None else theta
    # computed on the CPU whatever the default device (a skeleton on the meta device still gets real frequencies)
    inv_freq = 1.0 / (base ** (torch.arange(0, dh, 2, dtype=torch.int64, device="cpu").float() / dh))
    scaling = (config.rope_scaling if theta is None else scaling) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # GGUF stores llama3 scaling as one divisor per frequency
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    elif kind == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, dh, base, scaling)
    elif kind == "llama3":
        # Llama 3.1+: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(is_medium, interpolated, inv_freq)
    return inv_freq


def yarn_inv_freq(inv_freq: torch.Tensor, dh: int, base: float, s: dict) -> torch.Tensor:
    """YaRN (gpt-oss, Qwen's long contexts): each frequency blended between itself (fast pairs, kept) and itself /
    factor (slow pairs, interpolated), by a linear ramp over the pair index between the pairs that turn beta_fast and
    beta_slow times within the original context. `truncate` rounds the ramp's ends outward to whole pairs
    (transformers' default, and llama.cpp's only rule); gpt-oss's config turns it off. The attention factor that
    scales cos and sin is the family's (model.families.gpt_oss)."""
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32.0), float(s.get("beta_slow") or 1.0)
    turn = lambda rotations: dh * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = turn(fast), turn(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dh - 1)
    pair = torch.arange(dh // 2, dtype=torch.float32, device="cpu")  # (Dr/2,)
    ramp = ((pair - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolation), 0: it is divided by the factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of pos * theta_i for each position: positions (...,) -> two (..., Dr) float32 tensors (Dr: the
    rotary width, 2 · inv_freq's length)."""
    angles = positions.float()[..., None] * inv_freq  # (..., Dh/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., Dh): pair i and i + Dh/2 share an angle
    return angles.cos(), angles.sin()


def rope_table(config: ModelConfig, n_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [0, n_pos), each (n_pos, Dh), float32."""
    return rope_angles(rope_inv_freq(config).to(device), torch.arange(n_pos, device=device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, Dh), any number of heads (q's H and k's Hkv side by side); cos, sin: (T, Dr), or (B, T, Dr)
    for per-row positions. Rotates pairs (x_i, x_{i+Dr/2}) of the first Dr dims; the rest (Dr < Dh: partial rotary)
    pass unchanged."""
    dr = cos.size(-1)
    if dr < x.size(-1):
        return torch.cat([apply_rope(x[..., :dr], cos, sin), x[..., dr:]], dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)  # (T, 1, Dh) or (B, T, 1, Dh): broadcast over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """GQA made explicit, HF's repeat_kv in two steps: (B, Hkv, S, Dh) -> (B, Hkv, G, S, Dh), KV head g seen by its
    G query heads [g*G, (g+1)*G). A view (nothing copied); `.reshape(B, H, S, Dh)` then lays the repeats out."""
    B, Hkv, S, Dh = x.shape
    return x[:, :, None].expand(B, Hkv, group, S, Dh)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b where a has H heads (B, H, T, X) and b has Hkv (B, Hkv, X, Y), H a multiple of Hkv: head h of a is
    multiplied by head h // G of b (G = H / Hkv), as if b were repeated (expand_kv) but without the copy: the G heads
    of a that share a head of b are stacked into one (B, Hkv, G·T, X) matrix. -> (B, H, T, Y)."""
    B, H, T, X = a.shape
    Hkv = b.size(1)
    return (a.reshape(B, Hkv, (H // Hkv) * T, X) @ b).view(B, H, T, b.size(-1))


def allowed_keys(T: int, start: int, padding: Optional[torch.Tensor], device,
                 window: Optional[int] = None) -> Optional[torch.Tensor]:
    """Which keys each query may attend: (B or 1, 1, T, S) bool, True where allowed; None when every query sees every
    key (one new token, no padding, nothing out of the window). Causal over slots: the query in slot start+i sees
    slots <= start+i, and with a `window` W only the slots less than W back. `padding` (B, S) is False at pad slots;
    a pad query still sees its own slot, so that no softmax row is empty."""
    S = start + T
    if padding is None and T == 1 and (window is None or S <= window):
        return None
    q_slot = torch.arange(start, S, device=device)[:, None]  # (T, 1)
    k_slot = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = k_slot <= q_slot  # (T, S)
    if window is not None:
        allowed = allowed & (q_slot - k_slot < window)  # the band: the last W slots
    if padding is not None:
        allowed = (allowed & padding[:, None, :S]) | (k_slot == q_slot)  # (B, T, S)
    return allowed.view(-1, 1, T, S)  # (B or 1, 1, T, S): broadcast over heads


# ----------------------------------------------------------------------------------------------------------------
# s6.8 KV cache: preallocated buffers, written at the slots being computed


class LayerKV:
    """One layer's cached keys and values: two preallocated buffers of (B, Hkv, S_max, Dh)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, Dh) at slots [start, start+T); return every filled slot's keys and values
        (B, Hkv, S, Dh)."""
        end = start + k.size(2)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, end) as they are, for a layer that reads this one's keys and values and writes none."""
        return self.k[:, :, :end], self.v[:, :, :end]

    def rows(self, n: int, end: int) -> "LayerKV":
        """A copy of slots [0, end) of row 0 for n rows (a patching sweep's batch of variants of one run)."""
        return LayerKV(self.k[:1, :, :end].expand(n, -1, -1, -1).clone(), self.v[:1, :, :end].expand(n, -1, -1, -1).clone())

    def joined(self, other: "LayerKV") -> "LayerKV":
        """These rows, then other's."""
        return LayerKV(torch.cat([self.k, other.k]), torch.cat([self.v, other.v]))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class LayerSlots:
    """One layer's per-token entries other than attention's K and V (an MLA layer's latent and its RoPE key): one
    preallocated (B, S_max, ...) buffer a name, written at the slots being computed."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self.buffers = buffers

    def update(self, start: int, **parts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write each part (B, T, ...) at slots [start, start+T); return every filled slot's entries (B, S, ...)."""
        out = {}
        for name, x in parts.items():
            end = start + x.size(1)
            self.buffers[name][:, start:end] = x
            out[name] = self.buffers[name][:, :end]
        return out

    def read(self, end: int) -> dict[str, torch.Tensor]:
        return {n: b[:, :end] for n, b in self.buffers.items()}

    def rows(self, n: int, end: int) -> "LayerSlots":
        return LayerSlots({k: b[:1, :end].expand(n, *b.shape[1:2], *b.shape[2:]).clone() for k, b in self.buffers.items()})

    def joined(self, other: "LayerSlots") -> "LayerSlots":
        return LayerSlots({k: torch.cat([b, other.buffers[k]]) for k, b in self.buffers.items()})

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class LayerState:
    """One layer's memory of a constant size: fixed-size tensors updated in place by each pass (linear attention's
    recurrent state, a convolution's last inputs). `buffers` maps a name to a (B, ...) tensor of the shape the layer
    declared; unlike a LayerKV it does not grow with the sequence: a pass reads it and writes it back."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self.buffers = buffers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def write(self, name: str, value: torch.Tensor) -> None:
        self.buffers[name].copy_(value)

    def rows(self, n: int, end: int = 0) -> "LayerState":
        """Row 0's state for n rows (its size does not depend on `end`)."""
        return LayerState({k: b[:1].expand(n, *b.shape[1:]).clone() for k, b in self.buffers.items()})

    def joined(self, other: "LayerState") -> "LayerState":
        return LayerState({k: torch.cat([b, other.buffers[k]]) for k, b in self.buffers.items()})

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


def kv_bytes_per_position(config: ModelConfig, element_size: int, n_heads: Optional[int] = None) -> int:
    """Bytes an attention layer of Llama's kind caches for one position of one row: K and V, 2 · Hkv · Dh · element
    size; with `n_heads` (the query heads) instead, what the same cache would take without GQA. A layer's own figure
    is its declared memory (model.memory); this is that declaration's value for Llama's attention."""
    return 2 * (n_heads or config.n_kv_heads) * config.head_dim * element_size


class KVCache:
    """Every layer's memory for B rows, allocated from what each layer declares (model.memory.Memory): preallocated
    keys and values (or other per-token entries) of up to S_max slots, fixed-size states, or nothing of its own where
    a layer reads an earlier layer's keys and values. Slots [0, seq_len) hold valid entries.

    The caller owns it and passes it to `Transformer.forward`; a forward without one is a plain pass from position 0.
    Every row has the same slots; which of a row's slots are padding is the caller's `attention_mask`. Every slot is
    kept, in sliding-window layers too (they read only the last W of them): the bytes it counts are the bytes held."""

    def __init__(self, config: ModelConfig, max_len: int, batch: int = 1, dtype=torch.float32, device=None,
                 memory: Optional[list[Memory]] = None):
        # One buffer per layer, handed to the layer itself: the layer's code needs no layer index, and a compiled step
        # gets separate inputs rather than views into one shared tensor. `device` may name one device per layer.
        devices = device if isinstance(device, (list, tuple)) else [device] * config.n_layers
        self.memory = memory or [kv_memory(config.n_kv_heads, config.head_dim, config.n_heads)] * config.n_layers
        self.layers: list = []
        for m, d in zip(self.memory, devices):
            if m.reads is not None:  # a KV-shared layer: the earlier layer's own buffers, nothing allocated
                self.layers.append(self.layers[m.reads])
                continue
            per = {n: (batch, *s[:-1], max_len, s[-1]) if set(m.per_token) == {"k", "v"} else (batch, max_len, *s)
                   for n, s in m.per_token.items()}  # K and V as (B, Hkv, S_max, Dh), the layout attention reads
            if set(m.per_token) == {"k", "v"}:
                self.layers.append(LayerKV(*(torch.zeros(per[n], dtype=dtype, device=d) for n in ("k", "v"))))
            elif m.per_token:
                self.layers.append(LayerSlots({n: torch.zeros(s, dtype=dtype, device=d) for n, s in per.items()}))
            elif m.constant:
                st = torch.float32 if m.constant_float32 else dtype
                self.layers.append(LayerState({n: torch.zeros((batch, *s), dtype=st, device=d)
                                               for n, s in m.constant.items()}))
            else:
                self.layers.append(None)
        self.dtype = dtype
        self.config = config
        self.batch = batch
        self.max_len = max_len
        self.seq_len = 0  # slots [0, seq_len) hold valid keys and values
        self._totals = memory_totals(self.memory, self.element_size)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_layers(self) -> int:
        """The layers whose memory grows with each token."""
        return len(self._totals["growing_layers"])

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position of one row takes across the layers, from each layer's declared memory (Llama:
        2 (K and V) · L · Hkv · Dh · element size)."""
        return self._totals["bytes_per_token"]

    @property
    def mha_bytes_per_token(self) -> int:
        """The same for full multi-head attention (one K and V per query head) in the layers that grow: what
        grouped-query attention, or a latent, saves."""
        return self._totals["mha_bytes_per_token"]

    @property
    def bytes_allocated(self) -> int:
        """The growing buffers, every row and slot (the constant-size memory is `state_bytes`)."""
        return sum(kv.nbytes for kv in self._distinct() if isinstance(kv, (LayerKV, LayerSlots)))

    @property
    def state_layers(self) -> list[int]:
        """The layers that keep a memory of constant size (a recurrent state, a convolution window)."""
        return list(self._totals["constant_layers"])

    @property
    def state_bytes_per_layer(self) -> int:
        """The largest such layer's memory, every row: the same at every step."""
        return max((kv.nbytes for kv in self.layers if isinstance(kv, LayerState)), default=0)

    @property
    def state_bytes(self) -> int:
        return sum(kv.nbytes for kv in self.layers if isinstance(kv, LayerState))

    def _distinct(self) -> list:
        seen, out = set(), []
        for kv in self.layers:
            if kv is not None and id(kv) not in seen:
                seen.add(id(kv))
                out.append(kv)
        return out


class LayerInput(NamedTuple):
    """What a layer needs besides the residual stream, for one forward call: RoPE's cos and sin ((T, Dh) or
    (B, T, Dh); None in a layer without RoPE), the keys each query may attend ((B or 1, 1, T, S) bool, or None: all),
    its cache and the first slot."""

    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    cache: Optional[LayerKV]  # or a LayerState, in a layer that keeps a recurrent state
    start: int
    padding: Optional[torch.Tensor] = None  # (B, T): False at this call's pad slots; None when no row is padded


# ----------------------------------------------------------------------------------------------------------------
# s6 the decoder layer: attention, feed-forward, and the block that adds them to the residual stream


class Attention(Module):
    """Grouped-query attention with RoPE: softmax(Q Kᵀ · scale + mask) V, then Wo (s6.1-s6.6, s6.8)."""

    WHERE = "attn"
    POINTS = (Q, K, V, Q_ROPE, K_ROPE, KV_WRITE, K_REPEATED, SCORES, PROBS, ATTN_OUT, O_PROJ)
    # One query per row and nothing masked (a decode step): the fused kernel may take GQA as G query rows of each KV
    # head, (B, Hkv, G, Dh), instead of its enable_gqa path, which lays K and V out per query head first (~50 us a
    # call at 75 cached slots here). The same softmax(QK^T/sqrt(Dh))V to rounding, not bit for bit, so the exact path
    # keeps the call its parity was measured with; the fast path (checkpoint.fast) turns it on.
    fold_gqa_decode = False
    # Whether this attention has a fused form (one scaled_dot_product_attention call) for the passes nothing observes
    # step by step: False where a family's softmax or scores have none (a sink, a soft-cap), which always spell out.
    fused = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.scale = config.attn_scale if config.attn_scale is not None else 1 / math.sqrt(config.head_dim)
        self.spell_out = False  # set while a hook that wants scores and probs is attached (Transformer.hooked)
        q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        # Wq, Wk, Wv as one matrix: one matmul instead of three. Rows [0, q_dim) are Wq, then Wk, then Wv.
        self.wqkv = nn.Linear(config.d_model, q_dim + 2 * kv_dim, bias=config.attn_bias)  # (H*Dh + 2*Hkv*Dh, D)
        self.wo = nn.Linear(q_dim, config.d_model, bias=False)  # (D, H*Dh)

    def weights(self) -> tuple[Weight, ...]:
        qkv_rows = ("H*Dh", "Hkv*Dh", "Hkv*Dh")
        out = [Weight("wqkv.weight", ("H*Dh+2*Hkv*Dh", "D"), "s6.1", "matrix", (
            Source("q_proj.weight", "attn_q.weight", qkv_rows[0], "Wq", permuted="H"),
            Source("k_proj.weight", "attn_k.weight", qkv_rows[1], "Wk", permuted="Hkv"),
            Source("v_proj.weight", "attn_v.weight", qkv_rows[2], "Wv")))]
        if self.config.attn_bias:
            out.append(Weight("wqkv.bias", ("H*Dh+2*Hkv*Dh",), "s6.1", "vector", (
                Source("q_proj.bias", "attn_q.bias", qkv_rows[0], "bq", permuted="H"),
                Source("k_proj.bias", "attn_k.bias", qkv_rows[1], "bk", permuted="Hkv"),
                Source("v_proj.bias", "attn_v.bias", qkv_rows[2], "bv"))))
        out.append(Weight("wo.weight", ("D", "H*Dh"), "s6.6", "matrix",
                          (Source("o_proj.weight", "attn_output.weight", "D", "Wo"),)))
        return tuple(out)

    # -- the kind, declared (model.kinds) -----------------------------------------------------------------------
    KIND = "attention"
    HEADS = (ATTN_OUT.name, "wo")  # its output splits by head: the heads' outputs through Wo's columns (model.wiring)
    HEADINGS: dict = {}  # s6.1-s6.8 as the seed table names them (model.points.SEED_STEPS)
    EXPLAIN = ("attention",)  # explain's sections for this kind (run.explain), besides the generic ones
    FLOPS_NOTE = ("the scores count the full T×T square the eager path computes (the causal mask then discards the upper half)",
                  "分数按 eager 路径计算的完整 T×T 方阵计数（因果掩码随后丢弃上半部分）")  # (English, Chinese), as HEADINGS

    def memory(self) -> Memory:
        """s6.8 what the layer keeps: K and V of each KV head, one entry a token."""
        return kv_memory(self.n_kv_heads, self.head_dim, self.n_heads)

    def flops(self, n_tokens: int) -> list[tuple]:
        """Its matrix products over a pass of T tokens, (key, label, formula, FLOPs), 2 per multiply-add; the label as
        explain says it, (English, Chinese)."""
        T, D, H, Hkv, Dh = n_tokens, self.config.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        return [("qkv", ("Q, K, V projections", "Q、K、V 投影"), "2·T·D·(H + 2·Hkv)·Dh", 2 * T * D * (H + 2 * Hkv) * Dh),
                ("scores", ("scores Q·Kᵀ", "分数 Q·Kᵀ"), "2·H·T·T·Dh", 2 * H * T * T * Dh),
                ("pv", ("weighted sum P·V", "加权求和 P·V"), "2·H·T·T·Dh", 2 * H * T * T * Dh),
                ("o", ("output projection", "输出投影"), "2·T·H·Dh·D", 2 * T * H * Dh * D)]

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.project(x)  # s6.1, s6.2: (B, T, H+Hkv, Dh), (B, T, Hkv, Dh)
        q, k = self.rotate(qk, io.cos, io.sin)  # s6.3: (B, T, H, Dh), (B, T, Hkv, Dh)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, Dh), (B, Hkv, T, Dh) twice
        # s6.8 write this call's keys and values into the cache; attend over every filled slot
        if io.cache is not None:
            k, v = io.cache.update(io.start, k, v)  # (B, Hkv, S, Dh)
            if self.hook is not None:
                self.point("kv_write", torch.arange(io.start, io.start + T))  # the slots written
        y = self.attend(q, k, v, io.mask)  # s6.4, s6.5: (B, H, T, Dh)
        y = self.point("attn_out", y.transpose(1, 2))  # (B, T, H, Dh): head h's output is y[:, :, h]
        # s6.6 concatenate heads and project back to D
        return self.point("o_proj", self.wo(y.reshape(B, T, H * Dh)))  # (B, T, D)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s6.1 Q = X Wq, K = X Wk, V = X Wv; s6.2 split into heads. q's and k's heads stay side by side in one
        tensor, (B, T, H+Hkv, Dh), so that RoPE turns them in one go."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split_with_sizes([(H + Hkv) * Dh, Hkv * Dh], dim=-1)
        qk = qk.view(B, T, H + Hkv, Dh)  # (B, T, H+Hkv, Dh)
        v = v.view(B, T, Hkv, Dh)  # (B, T, Hkv, Dh)
        if self.hook is not None:
            q, k = qk.split_with_sizes([H, Hkv], dim=2)  # (B, T, H, Dh), (B, T, Hkv, Dh)
            q_in, k_in, v = self.point("q", q), self.point("k", k), self.point("v", v)
            if q_in is not q or k_in is not k:  # a hook replaced q or k: the pass goes on from its tensors
                qk = torch.cat([q_in, k_in], dim=2)  # (B, T, H+Hkv, Dh)
        return qk, v

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s6.3 RoPE on q and k (v carries no position): (B, T, H+Hkv, Dh) -> q (B, T, H, Dh), k (B, T, Hkv, Dh)."""
        if cos is not None:  # a layer without RoPE (its plan says none) passes q and k on unturned
            qk = apply_rope(qk, cos, sin)
        q, k = qk.split_with_sizes([self.n_heads, self.n_kv_heads], dim=2)
        self.point("q_rope", q)
        self.point("k_rope", k)
        return q, k

    def attend(self, q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(Q Kᵀ · scale + mask) V: q (B, H, T, Dh), k and v (B, Hkv, S, Dh) -> (B, H, T, Dh)."""
        B, H, T, Dh = q.shape
        if self.spell_out or not self.fused:
            return self.attend_spelled_out(q, k, v, mask)
        if self.fold_gqa_decode and T == 1 and mask is None:
            return F.scaled_dot_product_attention(q.reshape(B, self.n_kv_heads, H // self.n_kv_heads, Dh), k, v,
                                                  scale=self.scale).view(B, H, T, Dh)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=True,
                                              scale=self.scale)

    def attend_spelled_out(self, q, k, v, mask):
        """softmax(Q K^T · scale + mask) V, step by step (s6.4, s6.5): the path a hooked layer takes."""
        B, H, T, Dh = q.shape
        Hkv = k.size(1)
        # GQA: query head h reads KV head h // G. Reported as the (B, Hkv, G, S, Dh) view it stands for (recorded as
        # (H, S, Dh), without a copy); the products read each KV head once for its G query heads (grouped_matmul)
        self.point("k_repeated", expand_kv(k, H // Hkv))
        scores = self.scores(q, k)  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # (B, H, T, S): -inf where a key is not attended
        self.point("scores", scores)
        probs = self.point("probs", self.softmax(scores).to(q.dtype))  # (B, H, T, S)
        return grouped_matmul(probs, v)  # (B, H, T, Dh)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """s6.5 each row of scores (B, H, T, S) into probabilities that sum to 1, in float32. The seam where a
        family changes the softmax (a sink: one more logit per head in each row's sum)."""
        return F.softmax(scores, dim=-1, dtype=torch.float32)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Q Kᵀ · scale: (B, H, T, Dh), (B, Hkv, S, Dh) -> (B, H, T, S), query head h reading KV head h // (H / Hkv)."""
        return grouped_matmul(q, k.transpose(-2, -1)) * self.scale

    # -- the maths, declared (model.maths) ---------------------------------------------------------------------

    ROTATED = ("q", "k")  # the points RoPE turns (Qwen3: its per-head norms' outputs)
    SCALE_LABEL = "1/√Dh"  # how the score scale is said (Gemma: query_pre_attn_scalar^-1/2)

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        """Each point's operation in a layer with this plan; x is the point attention reads."""
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q_end, k_end = H * Dh, (H + Hkv) * Dh
        w = ("wqkv.weight",) + (("wqkv.bias",) if self.config.attn_bias else ())
        rope = dict(plan.rope) if plan.rope else {"rotation": "none"}
        return {"q": op("matmul", [x], w, rows=[0, q_end], split="H"),
                "k": op("matmul", [x], w, rows=[q_end, k_end], split="Hkv"),
                "v": op("matmul", [x], w, rows=[k_end, k_end + Hkv * Dh], split="Hkv"),
                "q_rope": op("rope", [self.ROTATED[0]], **rope),
                "k_rope": op("rope", [self.ROTATED[1]], **rope),
                "kv_write": op("cache_write", ["k_rope", "v"]),
                "k_repeated": op("repeat_kv", ["k_rope"], group=H // Hkv, cached=["k_rope"]),
                "scores": op("scores", ["q_rope", "k_repeated"], scale=self.scale, scale_label=self.SCALE_LABEL,
                             softcap=None, mask="causal", window=plan.window),
                "probs": op("softmax", ["scores"], sink=None),
                "attn_out": op("weighted_sum", ["probs", "v"], group=H // Hkv, cached=["v"]),
                "o_proj": op("matmul", ["attn_out"], ["wo.weight"], merge="H")}


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FeedForward(Module):
    """The gated feed-forward block: down(act(x W_gate) * (x W_up)), act SiLU (SwiGLU) or GELU (GeGLU) (s6.7)."""

    WHERE = "ffn"
    POINTS = (GATE, UP, ACT, DOWN)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ffn_dim = config.ffn_dim
        self.act, self.act_name = ACTIVATIONS[config.ffn_act], config.ffn_act
        self.w_gate_up = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=False)  # (2F, D): W_gate rows, then W_up
        self.w_down = nn.Linear(config.ffn_dim, config.d_model, bias=False)  # (D, F)

    def weights(self) -> tuple[Weight, ...]:
        return (Weight("w_gate_up.weight", ("2*F", "D"), "s6.7", "matrix", (
                    Source("gate_proj.weight", "ffn_gate.weight", "F", "W_gate"),
                    Source("up_proj.weight", "ffn_up.weight", "F", "W_up"))),
                Weight("w_down.weight", ("D", "F"), "s6.7", "matrix",
                       (Source("down_proj.weight", "ffn_down.weight", "D", "W_down"),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split_with_sizes([self.ffn_dim, self.ffn_dim], dim=-1)  # (B, T, F) each
        self.point("gate", gate)
        self.point("up", up)
        act = self.point("act", self.glu(gate, up))  # (B, T, F)
        return self.point("down", self.w_down(act))  # (B, T, D)

    def flops(self, n_tokens: int) -> list[tuple]:
        """Its matrix products over T tokens: gate and up, then down."""
        T, D, Fd = n_tokens, self.w_down.out_features, self.ffn_dim
        return [("ffn", ("gated FFN", "门控前馈网络"), "2·T·D·2F + 2·T·F·D", 2 * T * D * 2 * Fd + 2 * T * Fd * D)]

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) ⊙ up: the seam where a family changes the gated activation (GeGLU, a clamped GLU)."""
        return self.act(gate) * up

    def maths(self, x: str, plan: LayerPlan) -> dict[str, Op]:
        F_ = self.ffn_dim
        return {"gate": op("matmul", [x], ["w_gate_up.weight"], rows=[0, F_]),
                "up": op("matmul", [x], ["w_gate_up.weight"], rows=[F_, 2 * F_]),
                "act": op("glu", ["gate", "up"], act=self.act_name, clamp=None),
                "down": op("matmul", ["act"], ["w_down.weight"])}


class Block(Module):
    """One decoder layer: pre-norm attention and pre-norm feed-forward, each added to the residual stream."""

    attention = Attention
    feed_forward = FeedForward
    POINTS = (RESID_PRE, ATTN_NORM, "attn", RESID_MID, FFN_NORM, "ffn", RESID_POST)
    CHILDREN = {"attn_norm": ("input_layernorm", "attn_norm"), "attn": ("self_attn", ""),
                "ffn_norm": ("post_attention_layernorm", "ffn_norm"), "ffn": ("mlp", "")}
    NORMS = {ATTN_NORM.name: "attn_norm", FFN_NORM.name: "ffn_norm"}  # point -> the RMSNorm that makes it
    # The residual wiring, declared (model.wiring): each addition to the stream in order, with its norms, its factor
    # and the point the stream has after it; and a rescale of the whole stream at the end (none in Llama). Llama norms
    # each sub-layer's input only; Gemma its input and its output; OLMo 2 its output only.
    WIRING: tuple[Addition, ...] = (Addition("attn", RESID_MID.name, norm=ATTN_NORM.name),
                                    Addition("ffn", RESID_POST.name, norm=FFN_NORM.name))
    RESCALE: Optional[Rescale] = None

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.d_model, config.rms_eps)
        self.attn = self.attention_of(config, layer)
        self.ffn_norm = RMSNorm(config.d_model, config.rms_eps, step="s6.7")
        self.ffn = self.feed_forward_of(config, layer)
        for m in self.modules():
            if isinstance(m, Module):
                m.layer = layer

    def attention_of(self, config: ModelConfig, layer: int) -> Module:
        """This layer's attention: `attention` in every layer of Llama (a hybrid family mixes kinds: model.hybrid)."""
        return self.attention(config)

    def feed_forward_of(self, config: ModelConfig, layer: int) -> Module:
        """This layer's feed-forward: `feed_forward` in every layer of Llama (a mixture-of-experts family keeps some
        layers dense; their points are a subset of the declared ones)."""
        return self.feed_forward(config)

    @classmethod
    def layer_points(cls) -> tuple[Point, ...]:
        """Every point of one layer, in forward order, the sub-layers' included."""
        own = {p.name: p for p in cls.declared_points()}
        return splice(tuple(own[p.name] if isinstance(p, Point) else p for p in cls.POINTS),
                      {"attn": cls.attention.declared_points(), "ffn": cls.feed_forward.declared_points()})

    def memory(self) -> Memory:
        """What this layer keeps between passes: its sequence mixer's declaration."""
        return self.attn.memory()

    def flops(self, n_tokens: int) -> dict:
        """The layer's FLOPs over a pass of T tokens, as its parts declare them: each part by its key, the rows as
        explain shows them, the total, and the mixer's note on what it counts."""
        rows = [*self.attn.flops(n_tokens), *self.ffn.flops(n_tokens)]
        return {**{r[0]: r[3] for r in rows}, "rows": [[k, list(label), f, n] for k, label, f, n in rows],  # as JSON
                "total": sum(r[3] for r in rows),
                "note": self.attn.FLOPS_NOTE[0], "note_words": list(self.attn.FLOPS_NOTE)}

    def forward(self, x: torch.Tensor, io: LayerInput) -> torch.Tensor:
        """The stream through each declared addition (s6.6 residual 1: x + attention; s6.7 residual 2: x +
        feed-forward), then the rescale where the block has one."""
        x = self.point(RESID_PRE.name, x)  # (B, T, D)
        seen = {RESID_PRE.name: x}  # the stream and the normed inputs so far, for a part that reads an earlier one
        for add in self.WIRING:
            h = seen[add.reads] if add.reads else x  # (B, T, D)
            if add.norm:
                h = seen[add.norm] if add.norm in seen else self.point(add.norm, getattr(self, self.NORMS[add.norm])(h))
                seen[add.norm] = h
            h = self.run(add.part, h, io)  # (B, T, D)
            if add.post_norm:
                h = self.point(add.post_norm, getattr(self, self.NORMS[add.post_norm])(h))
            if add.factor:
                h = self.point(add.scaled, h * getattr(self, add.factor))
            x = seen[add.total] = self.point(add.total, x + h)
        if self.RESCALE:
            x = self.point(self.RESCALE.total, x * getattr(self, self.RESCALE.factor))
        return x

    def run(self, part: str, h: torch.Tensor, io: LayerInput) -> torch.Tensor:
        """The sub-layer `part` on its input h (B, T, D): a sequence mixer also reads the layer's input (RoPE, the mask,
        its cache); a feed-forward works token by token. A family's step of its own is its override."""
        module = getattr(self, part)
        return module(h, io) if module.WHERE == "attn" else module(h)

    def part_maths(self, part: str, x: str, plan: LayerPlan) -> dict[str, Op]:
        """The operations of a step of the block's own (Addition.output: no module), reading point x."""
        raise NotImplementedError(f"{type(self).__name__} declares no maths for its part {part!r}")

    def maths(self, plan: LayerPlan) -> dict[str, Op]:
        """Every point of this layer with its operation: the stream, the norms, the sub-layers, the adds, each as
        WIRING declares them."""
        out = {RESID_PRE.name: op("stream", [PREV + RESID_POST.name])}
        x = RESID_PRE.name
        for add in self.WIRING:
            src = add.reads or x
            if add.norm and add.norm not in out:
                out[add.norm] = getattr(self, self.NORMS[add.norm]).op(src, self.NORMS[add.norm] + ".")
            module = getattr(self, add.part, None)
            if isinstance(module, Module):
                inner = module.maths(add.norm or src, plan)
                out.update({n: o.prefixed(add.part + ".") for n, o in inner.items()})
                h = module.output_point()
            else:
                out.update(self.part_maths(add.part, add.norm or src, plan))
                h = add.output
            if add.post_norm:
                out[add.post_norm] = getattr(self, self.NORMS[add.post_norm]).op(h, self.NORMS[add.post_norm] + ".")
                h = add.post_norm
            if add.factor:
                out[add.scaled] = op("scale", [h], factor=float(getattr(self, add.factor)), label=add.factor)
                h = add.scaled
            out[add.total] = op("add", [x, h])
            x = add.total
        if self.RESCALE:
            out[self.RESCALE.total] = op("scale", [x], [self.RESCALE.factor], label=self.RESCALE.factor)
        return out

    # -- its direct paths, for a direct logit attribution (model.wiring) ---------------------------------------

    def wiring(self) -> LayerWiring:
        """WIRING resolved for this layer: each addition's output point, the point it reads, the points its split
        reads, its factor as a number; the stream's rescale as a number."""
        paths, x = [], RESID_PRE.name
        for add in self.WIRING:
            module = getattr(self, add.part, None)
            sub = isinstance(module, Module)
            output = module.output_point() if sub else add.output
            capture = module.direct_points() if sub else (output,)
            factor = float(getattr(self, add.factor)) if add.factor else 1.0
            paths.append(Path(add, add.norm or add.reads or x, output, capture, factor))
            x = add.total
        rescale = float(getattr(self, self.RESCALE.factor)) if self.RESCALE else 1.0
        return LayerWiring(tuple(paths), self.RESCALE.total if self.RESCALE else x, rescale)

    def direct_parts(self, path: Path, got: Callable[[str], torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
        """The parts of one addition's output at one position (before its post-norm and factor), {name: (kind,
        (D,) float32)}: its sub-layer's split (Module.direct_parts), or one part for a step of the block's own."""
        module = getattr(self, path.part, None)
        if isinstance(module, Module):
            return module.direct_parts(got(path.input), got)
        return {path.part: (path.part, got(path.output).float())}

    def plan(self, config: ModelConfig, rope: Optional[dict]) -> LayerPlan:
        """This layer's plan, with the RoPE the model gives it."""
        sliding = config.layer_type(self.layer) == "sliding" and config.sliding_window is not None
        experts = getattr(self.ffn, "n_experts", 0)
        return LayerPlan("window" if sliding else "global", config.sliding_window if sliding else None, rope,
                         "experts" if experts else "dense", {"n": experts, "k": self.ffn.k} if experts else None,
                         mixer=self.attn.KIND, headings=dict(self.attn.HEADINGS) or None)


# ----------------------------------------------------------------------------------------------------------------
# The model


class Transformer(Module):
    block = Block
    WHERE = "model"
    POINTS = (EMBED, "layers", FINAL_NORM, LAST, LOGITS)
    CHILDREN = {"layers": ("model.layers.{i}", "blk.{i}"), "norm": ("model.norm", "output_norm")}
    NORMS = {FINAL_NORM.name: "norm"}

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)  # (V, D)
        self.layers = nn.ModuleList(self.block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.rms_eps, step="s8")
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)  # (V, D)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (Dh/2,) RoPE's theta_i
        if config.rope_local_theta is not None:  # the sliding-window layers' own base, unscaled
            self.register_buffer("inv_freq_local", rope_inv_freq(config, config.rope_local_theta), persistent=False)
        self.layer_devices: Optional[list[torch.device]] = None  # where each layer runs, when placed over several
        self.kinds = self.layer_kinds()  # each layer's (RoPE table, mask), worked out once from its plan

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` slots (prompt + new tokens), in the model's dtype.
        Each layer's keys and values sit where that layer runs."""
        p = self.embed.weight
        return KVCache(self.config, max_len, batch=batch, dtype=p.dtype, device=self.layer_devices or p.device,
                       memory=self.memory())

    def memory(self) -> list[Memory]:
        """Each layer's memory as its kind declares it (model.memory): what `new_cache` allocates and every byte count
        the views show."""
        return [layer.memory() for layer in self.layers]

    def cache_stale(self, cache: KVCache, start: int, n: int, input_pos: Optional[torch.Tensor] = None) -> bool:
        """Whether a pass of n tokens at slot `start` makes the cache's slots [0, start) out of date, so that the
        model's forward recomputes them first: never in Llama, whose keys do not depend on how long the sequence is
        (LongRoPE's do: model.families.phi3). The compiled decode step hands such a pass to the eager forward."""
        return False

    # -- declarations ------------------------------------------------------------------------------------------

    @classmethod
    def declared_points(cls) -> Points:
        """Every point of the model: before the layers, one layer's, after the layers; each in forward order."""
        own = super().declared_points()
        cut = cls.POINTS.index("layers")
        names = [p.name for p in cls.POINTS[:cut]]
        return Points(tuple(p for p in own if p.name in names), cls.block.layer_points(),
                      tuple(p for p in own if p.name not in names))

    def weights(self) -> tuple[Weight, ...]:
        out = [Weight("embed.weight", ("V", "D"), "s4", "embedding",
                      (Source("model.embed_tokens.weight", "token_embd.weight", "V", "E_tok"),))]
        if not self.config.tie_embeddings:
            out.append(Weight("lm_head.weight", ("V", "D"), "s9", "matrix",
                              (Source("lm_head.weight", "output.weight", "V", "W_head"),)))
        return tuple(out)

    def declared_weights(self) -> list[DeclaredWeight]:
        """Every parameter the checkpoint provides, with its full HF and GGUF keys and its shape in numbers, in the
        order of the model (the embedding, each layer's, the final norm, the head). A tied head is the embedding."""
        dims = self.config.dims()
        out: list[DeclaredWeight] = []

        def walk(module: nn.Module, param: str, hf: str, gguf: str) -> None:
            join = lambda *parts: ".".join(p for p in parts if p)  # noqa: E731
            for w in module.weights():
                sources = tuple(DeclaredSource(join(hf, s.hf) if s.hf else None, join(gguf, s.gguf) if s.gguf else None,
                                               _rows(s.rows, w, dims), s.math,
                                               dims[s.permuted] if s.permuted else None, s.hf_add, s.hf_transform)
                                for s in w.sources)
                out.append(DeclaredWeight(join(param, w.name), w, w.dims(dims), sources))
            for attr, (hf_sub, gguf_sub) in getattr(module, "CHILDREN", {}).items():
                child = getattr(module, attr)
                if isinstance(child, nn.ModuleList):
                    for i, m in enumerate(child):
                        walk(m, join(param, attr, str(i)), join(hf, hf_sub.format(i=i)), join(gguf, gguf_sub.format(i=i)))
                else:
                    walk(child, join(param, attr), join(hf, hf_sub), join(gguf, gguf_sub))

        walk(self, "", "", "")
        head = [w for w in out if w.param == "lm_head.weight"]  # the head last, after the final norm
        return [w for w in out if w.param != "lm_head.weight"] + head

    def norm_of(self, layer: Optional[int], point: str) -> RMSNorm:
        """The RMSNorm module that computes `point` in `layer` (None: the model's own), for code that takes a norm
        apart (explain); its input is the point the declaration names (Point.input)."""
        owner = self if layer is None else self.layers[layer]
        return getattr(owner, owner.NORMS[point])

    def wiring(self) -> tuple[LayerWiring, ...]:
        """Each layer's residual wiring as its block declares it (model.wiring): the additions, their points, norms and
        factors, and the stream's rescale. What a direct logit attribution iterates over."""
        return tuple(block.wiring() for block in self.layers)

    def direct_parts(self, layer: int, path: Path, got: Callable[[str], torch.Tensor]) -> dict[str, tuple]:
        """One addition of `layer` split into its parts at one position (Block.direct_parts): {name: (kind, (D,))}."""
        return self.layers[layer].direct_parts(path, got)

    def heads_points(self) -> list[Optional[str]]:
        """Each layer's per-head output a head's patch replaces (Module.heads_point), None where its mixer has none."""
        return [block.attn.heads_point() for block in self.layers]

    def attention_of(self, layer: int) -> Attention:
        """The attention sub-layer of `layer`, for code that reruns one of its steps on captured tensors (explain
        recomputes the scores with the layer's own `scores`: its scale, a family's soft-cap)."""
        return self.layers[layer].attn

    def layer_flops(self, layer: int, n_tokens: int) -> dict:
        """The FLOPs of `layer` over a pass of T tokens, as its kinds declare them (Block.flops)."""
        return self.layers[layer].flops(n_tokens)

    def layer_kinds(self) -> list[tuple[str, str]]:
        """Each layer's (RoPE table, mask), read from its plan: the table "global", "local" (the sliding-window
        layers' own base) or "none" (no rotation), and the mask "full" or "sliding"."""
        return [((p.rope or {}).get("table", "none"), "sliding" if p.attention == "window" else "full")
                for p in self.layer_plan()]

    def rope_plan(self, layer: int) -> Optional[dict]:
        """The RoPE of `layer`: its base, rotary width, scaling and the θ_i they give (`inv_freq`), and which of
        the model's tables it uses; None for a layer without RoPE. The sliding-window layers of a model with a local
        base use that base, unscaled (Gemma 3)."""
        c = self.config
        if not c.rotates(layer):
            return None
        local = (c.layer_type(layer) == "sliding" and c.sliding_window is not None and c.rope_local_theta is not None)
        base, scaling = (c.rope_local_theta, None) if local else (c.rope_theta, c.rope_scaling)
        return {"table": "local" if local else "global", "base": base, "rotary_dim": c.rotary_dim or c.head_dim,
                "head_dim": c.head_dim, "scaling": scaling, "pairs": "halves",
                "inv_freq": [float(f) for f in rope_inv_freq(c, base if local else None, scaling)]}

    def layer_plan(self) -> tuple[LayerPlan, ...]:
        """What differs between layers, each layer's plan: its attention (global or a window), its RoPE or none,
        a dense feed-forward or experts. The one home of these facts: the masks, the RoPE tables and every view
        read them from here (through `maths()` in a trace)."""
        return tuple(block.plan(self.config, self.rope_plan(i)) for i, block in enumerate(self.layers))

    def maths(self) -> Maths:
        """The model's maths, declared (model.maths): each point's operation, in every layer, and each plan."""
        plans, layers = [], []
        for block, plan in zip(self.layers, self.layer_plan()):
            table = block.maths(plan)
            plans.append(replace(plan, norms=tuple(n for n, o in table.items() if o.kind == "rmsnorm")))
            layers.append(table)
        return Maths(self.model_maths(), tuple(layers), tuple(plans), self.STREAM_IN)

    STREAM_IN = EMBED.name  # the model point that enters layer 0

    def model_maths(self) -> dict[str, Op]:
        """The operations outside the layers: s4 the embedding, s8 the final norm, s7 the last row, s9 the head."""
        head = "embed.weight" if self.config.tie_embeddings else "lm_head.weight"
        return {EMBED.name: op("lookup", ["ids"], ["embed.weight"]),
                FINAL_NORM.name: self.norm.op(PREV + RESID_POST.name, "norm."),
                LAST.name: op("select_last", [FINAL_NORM.name]),
                LOGITS.name: op("matmul", [LAST.name], [head], tied=self.config.tie_embeddings)}

    def logit_path(self) -> tuple[str, float]:
        """What a direct logit attribution splits: (the point that is the LM head's product times a constant, that
        constant). The logits themselves and 1 in Llama; Granite's logits and 1/logits_scaling (a scale is linear);
        the head's product before the family's soft-cap and 1 where what follows it is not linear (Gemma 2)."""
        head = self.model_maths()[LOGITS.name]
        if head.weights:
            return LOGITS.name, 1.0
        if head.kind == "scale":
            return LOGITS.name, float(head.const("factor"))
        return head.inputs[0], 1.0

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, cache: Optional[KVCache] = None, start: int = 0, *,
                input_pos: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                last_only: bool = False) -> torch.Tensor:
        """idx (B, T) token ids for cache slots [start, start+T) -> logits (B, T, V), or (B, V) with last_only.

        With a cache, keys and values are written to it and earlier slots are read from it; without one, this is a
        plain full-sequence pass (start 0). input_pos (B, T): each token's position, start + [0, T) by default.
        attention_mask (B, S): False at pad slots, None when no row is padded.
        """
        if cache is None and start != 0:
            raise ValueError("start > 0 needs a KV cache holding slots [0, start)")
        x = self.embed_tokens(idx)  # s4: (B, T, D)
        inputs = self.layer_inputs(idx, cache, start, input_pos, attention_mask, x.dtype)  # s5, who sees whom
        x = self.run_layers(x, inputs)  # s6
        if cache is not None:
            cache.seq_len = start + idx.size(1)
        return self.head(x, last_only)  # s7-s9

    # The pieces of forward, callable on their own by code that runs the layers one at a time (llmtrace.compare runs
    # two models side by side, layer by layer; the patching sweep lets rows join at later layers).

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """s4: token ids (B, T) -> their rows of the embedding matrix (B, T, D)."""
        return self.point("embed", self.embed(idx))

    def layer_inputs(self, idx: torch.Tensor, cache: Optional[KVCache] = None, start: int = 0,
                     input_pos: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                     dtype: Optional[torch.dtype] = None) -> list[LayerInput]:
        """What each layer of a forward call over idx (B, T) gets: RoPE's cos and sin (in `dtype`, once for every
        layer), the allowed keys, its cache. Layers of one kind share their tables."""
        T = idx.size(1)
        if input_pos is None:
            input_pos = torch.arange(start, start + T, device=idx.device)  # (T,): the same positions in every row
        tables = self.rope_tables(input_pos, dtype)  # s5: RoPE's angles
        kinds = self.kinds
        masks = {mk: allowed_keys(T, start, attention_mask, idx.device,
                                  self.config.sliding_window if mk == "sliding" else None) for mk in {m for _, m in kinds}}
        caches = cache.layers if cache is not None else [None] * len(self.layers)
        pad = attention_mask[:, start : start + T] if attention_mask is not None else None
        return [LayerInput(*tables[rk], masks[mk], kv, start, pad) for (rk, mk), kv in zip(kinds, caches)]

    def rope_tables(self, positions: torch.Tensor, dtype: Optional[torch.dtype]) -> dict[str, tuple]:
        """cos and sin ((T, Dh) or (B, T, Dh)) of each RoPE table the layers use, for these positions."""
        out = {"global": rope_angles(self.inv_freq, positions), "none": (None, None)}
        if self.config.rope_local_theta is not None:
            out["local"] = rope_angles(self.inv_freq_local, positions)
        return {k: (cos.to(dtype), sin.to(dtype)) if dtype is not None and cos is not None else (cos, sin)
                for k, (cos, sin) in out.items()}

    def run_layers(self, x: torch.Tensor, inputs: list[LayerInput], layers: Optional[Iterable[int]] = None) -> torch.Tensor:
        """s6, the layer loop: the residual stream (B, T, D) through `layers` (default: all, in order)."""
        for i in range(len(self.layers)) if layers is None else layers:
            x = self.layers[i](x, inputs[i])
        return x

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """The residual stream after the last layer (B, T, D) -> logits (B, T, V), or (B, V) with last_only."""
        x = self.point("final_norm", self.norm(x))  # s8: (B, T, D)
        if last_only:
            x = self.point("last", x[:, -1, :])  # s7: only the last position predicts the next token, (B, D)
        return self.point("logits", self.lm_head(x))  # s9: (B, V), or (B, T, V) for every position

    # -- the hook ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hooked(self, hook: Hook, layers: Optional[Iterable[int]] = None, attention: Optional[Iterable[int]] = None,
               spell_out: bool = True):
        """Report the model-level points and the points of `layers` (None: every layer) to `hook` within the block;
        on exit the model is as before. `attention` (None: the same layers) names the layers whose attention
        sub-layer reports too; with `spell_out` those spell attention out, so that their k_repeated, scores and
        probs exist (an editor that changes a head's output does not need them). A second hook attached inside the
        block runs after the first and sees the value the first returned."""
        layers = range(self.config.n_layers) if layers is None else list(layers)
        attention = set(layers if attention is None else attention)
        modules = [self] + [m for i in layers for m in self.layers[i].modules()
                            if isinstance(m, Module) and (m.WHERE != "attn" or i in attention)]
        spelled = [m for m in modules if isinstance(m, Attention)] if spell_out else []
        saved = [(m, m.hook) for m in modules]
        saved_spell = [(m, m.spell_out) for m in spelled]
        for m in modules:
            m.hook = hook if m.hook is None else _chain(m.hook, hook)
        for m in spelled:
            m.spell_out = True
        try:
            yield self
        finally:
            for m, before in saved:
                m.hook = before
            for m, before in saved_spell:
                m.spell_out = before

    @contextlib.contextmanager
    def unhooked(self):
        """A pass that no hook sees, inside a hooked block: one the model runs for its own sake (Phi-3's LongRoPE
        computes its cached slots again when a sequence passes the original context), which is not the pass an
        observer or an editor asked for. The hooks attached around the block are back on exit, as `hooked` leaves
        them: attaching and detaching are the model's, in this one place."""
        modules = [m for m in self.modules() if isinstance(m, Module) and m.hook is not None]
        saved = [(m, m.hook) for m in modules]
        for m in modules:
            m.hook = None
        try:
            yield self
        finally:
            for m, before in saved:
                m.hook = before

    def num_params(self) -> int:
        """The weights, a matrix held as GGUF blocks or packed from them (--keep-quantized, --fast) counted by its
        weights, not by its storage's elements."""
        from llmtrace.model.quant import weight_count  # where the storage kinds are known

        return weight_count(self)


def _rows(expr: str, w: Weight, dims: dict[str, int]) -> int:
    return axis_size(expr, dims) if expr else w.dims(dims)[0]


def _chain(first: Hook, second: Hook) -> Hook:
    """Two hooks as one: the second sees what the first returned."""

    def both(layer, name, x):
        y = first(layer, name, x)
        x = x if y is None else y
        z = second(layer, name, x)
        return x if z is None else z

    return both
