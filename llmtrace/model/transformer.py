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
to the slots at or before its own that are not pad.

Observable points. The forward pass names what it computes with `self.tap(name, tensor)`; a tap costs one attribute
check when nothing observes the model. `with model.observed(observer, layers=...)` attaches an observer (see
llmtrace.trace) for the duration of a block. Observed layers spell attention out (scores, mask, softmax, P·V, with
the GQA repetition as its own step) so those tensors exist; unobserved ones use the fused kernel. The model never
formats, stores or prints anything itself, and holds no state between calls: the KV cache is passed in.

Edit points. Tracing observes and never steers; an intervention (llmtrace.run.interventions: ablate, scale, patch, steer)
is the one thing allowed to change a value, and only where the forward pass says so with `x = self.edit(name, x)`:
the concatenated head outputs before Wo (attn_out), the attention output after Wo (o_proj), the FFN's output (down)
and the residual stream entering, inside and leaving a layer (resid_pre, resid_mid, resid_post). Each returns x itself,
for one attribute check, unless `with model.edited(editor):` attached an editor for the block.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# An observer is called as observer(layer, name, tensor); layer is None outside the decoder layers.
Observer = Callable[[Optional[int], str, torch.Tensor], None]
# An editor is called as editor(layer, name, tensor) at an edit point and returns the tensor the pass goes on with.
Editor = Callable[[int, str, torch.Tensor], torch.Tensor]


@dataclass
class ModelConfig:
    arch: str = "llama"  # source architecture name (llama, mistral, qwen2), for display
    n_layers: int = 30  # L: number of decoder layers
    d_model: int = 576  # D: width of the residual stream
    n_heads: int = 9  # H: query heads
    n_kv_heads: int = 3  # Hkv: key/value heads; H % Hkv == 0, G = H // Hkv query heads share one KV head
    head_dim: int = 64  # Dh: width of one head
    ffn_dim: int = 1536  # F: hidden width of the SwiGLU feed-forward block
    vocab_size: int = 49152  # V
    max_seq_len: int = 8192  # context window the model was trained for
    rope_theta: float = 10000.0  # RoPE base: theta_i = base^(-2i/Dh)
    rope_scaling: Optional[dict] = None  # None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", ...}
    rms_eps: float = 1e-5  # epsilon inside RMSNorm
    tie_embeddings: bool = False  # LM head shares the embedding matrix
    attn_bias: bool = False  # Qwen2-style bias on the q/k/v projections
    extra: dict = field(default_factory=dict)  # facts kept for display only (source format, quantization, ...)

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.n_heads // self.n_kv_heads


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma, computed in float32 like the reference implementation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # gamma, (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call (its statistic is taken in float32); for float32 inputs the same bits as the formula spelled out
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


# ----------------------------------------------------------------------------------------------------------------
# s5 RoPE: rotate each (i, i + Dh/2) pair of q and k by the angle pos * theta_i (applied inside attention, s6.3)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """theta_i = base^(-2i/Dh) for i in [0, Dh/2), with the checkpoint's scaling applied. Shape (Dh/2,), float32."""
    dh = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # GGUF stores llama3 scaling as one divisor per frequency
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
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


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of pos * theta_i for each position: positions (...,) -> two (..., Dh) float32 tensors."""
    angles = positions.float()[..., None] * inv_freq  # (..., Dh/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., Dh): pair i and i + Dh/2 share an angle
    return angles.cos(), angles.sin()


def rope_table(config: ModelConfig, n_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [0, n_pos), each (n_pos, Dh), float32."""
    return rope_angles(rope_inv_freq(config).to(device), torch.arange(n_pos, device=device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, Dh), any number of heads (q's H and k's Hkv side by side); cos, sin: (T, Dh), or (B, T, Dh)
    for per-row positions. Rotates pairs (x_i, x_{i+Dh/2})."""
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


def allowed_keys(T: int, start: int, padding: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """Which keys each query may attend: (B or 1, 1, T, S) bool, True where allowed; None when every query sees every
    key (one new token and no padding). Causal over slots: the query in slot start+i sees slots <= start+i. `padding`
    (B, S) is False at pad slots; a pad query still sees its own slot, so that no softmax row is empty."""
    if padding is None and T == 1:
        return None
    S = start + T
    q_slot = torch.arange(start, S, device=device)[:, None]  # (T, 1)
    k_slot = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = k_slot <= q_slot  # (T, S)
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


def kv_bytes_per_position(config: ModelConfig, element_size: int, n_heads: Optional[int] = None) -> int:
    """Bytes the cache takes for one position of one row in one layer: K and V, 2 · Hkv · Dh · element size. With
    `n_heads` (the query heads) instead: what the same cache would take without GQA, one K and V per query head. The
    one home of this figure: the cache, the trace's events and `explain` all take it from here."""
    return 2 * (n_heads or config.n_kv_heads) * config.head_dim * element_size


class KVCache:
    """Preallocated keys and values of B rows for every layer; slots [0, seq_len) hold valid entries.

    The caller owns it and passes it to `Transformer.forward`; a forward without one is a plain pass from position 0.
    Every row has the same slots; which of a row's slots are padding is the caller's `attention_mask`."""

    def __init__(self, config: ModelConfig, max_len: int, batch: int = 1, dtype=torch.float32, device=None):
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)  # (B, Hkv, S_max, Dh) per layer
        # One buffer per layer, handed to the layer itself: the layer's code needs no layer index, and a compiled step
        # gets separate inputs rather than views into one shared tensor. `device` may name one device per layer.
        devices = device if isinstance(device, (list, tuple)) else [device] * config.n_layers
        self.layers = [LayerKV(torch.zeros(shape, dtype=dtype, device=d), torch.zeros(shape, dtype=dtype, device=d))
                       for d in devices]
        self.config = config
        self.batch = batch
        self.max_len = max_len
        self.seq_len = 0  # slots [0, seq_len) hold valid keys and values

    @property
    def element_size(self) -> int:
        return self.layers[0].k.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position of one row takes across all layers: 2 (K and V) * L * Hkv * Dh * element size."""
        return len(self.layers) * kv_bytes_per_position(self.config, self.element_size)

    @property
    def mha_bytes_per_token(self) -> int:
        """The same for a cache without GQA (one K and V per query head): what grouped-query attention saves."""
        return len(self.layers) * kv_bytes_per_position(self.config, self.element_size, self.config.n_heads)

    @property
    def bytes_allocated(self) -> int:
        return sum(kv.k.nbytes + kv.v.nbytes for kv in self.layers)


# ----------------------------------------------------------------------------------------------------------------
# The decoder layer


class Tappable(nn.Module):
    """A module with named observable points. `observer` is None unless `Transformer.observed` attached one."""

    layer: Optional[int] = None

    def __init__(self):
        super().__init__()
        # an attribute of every instance, so that attaching and detaching changes its value only (a compiled step
        # guards on it)
        self.observer: Optional[Observer] = None
        self.editor: Optional[Editor] = None  # the same for `Transformer.edited`

    def tap(self, name: str, x: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(self.layer, name, x)

    def edit(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x if self.editor is None else self.editor(self.layer, name, x)


class Attention(Tappable):
    # One query per row and nothing masked (a decode step): the fused kernel may take GQA as G query rows of each KV
    # head, (B, Hkv, G, Dh), instead of its enable_gqa path, which lays K and V out per query head first (~50 us a
    # call at 75 cached slots here). The same softmax(QK^T/sqrt(Dh))V to rounding, not bit for bit, so the exact path
    # keeps the call its parity was measured with; the fast path (checkpoint.fast) turns it on.
    fold_gqa_decode = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        # Wq, Wk, Wv as one matrix: one matmul instead of three. Rows [0, q_dim) are Wq, then Wk, then Wv.
        self.wqkv = nn.Linear(config.d_model, q_dim + 2 * kv_dim, bias=config.attn_bias)  # (H*Dh + 2*Hkv*Dh, D)
        self.wo = nn.Linear(q_dim, config.d_model, bias=False)  # (D, H*Dh)

    def forward(self, x, cos, sin, cache: Optional[LayerKV], start: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        # s6.1 project: Q = X Wq, K = X Wk, V = X Wv
        qk, v = self.wqkv(x).split_with_sizes([(H + Hkv) * Dh, Hkv * Dh], dim=-1)
        # s6.2 split heads. q's and k's heads stay side by side, so that RoPE turns them in one go.
        qk = qk.view(B, T, H + Hkv, Dh)  # (B, T, H+Hkv, Dh)
        v = v.view(B, T, Hkv, Dh)  # (B, T, Hkv, Dh)
        q, k = qk.split_with_sizes([H, Hkv], dim=2)  # (B, T, H, Dh), (B, T, Hkv, Dh)
        self.tap("q", q)
        self.tap("k", k)
        self.tap("v", v)
        # s6.3 RoPE on q and k (v carries no position)
        q, k = apply_rope(qk, cos, sin).split_with_sizes([H, Hkv], dim=2)
        self.tap("q_rope", q)
        self.tap("k_rope", k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, Dh), (B, Hkv, T, Dh) twice
        # s6.8 write this call's keys and values into the cache; attend over every filled slot
        if cache is not None:
            k, v = cache.update(start, k, v)  # (B, Hkv, S, Dh)
            if self.observer is not None:
                self.tap("kv_write", torch.arange(start, start + T))  # the slots written
        if self.observer is not None:
            y = self._attention_spelled_out(q, k, v, mask)
        elif self.fold_gqa_decode and T == 1 and mask is None:
            y = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, Dh), k, v).view(B, H, T, Dh)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=True)
        y = self.edit("attn_out", y.transpose(1, 2))  # (B, T, H, Dh): head h's output is y[:, :, h]
        self.tap("attn_out", y)
        # s6.6 concatenate heads and project back to D
        out = self.edit("o_proj", self.wo(y.reshape(B, T, H * Dh)))  # (B, T, D)
        self.tap("o_proj", out)
        return out

    def _attention_spelled_out(self, q, k, v, mask):
        """softmax(Q K^T / sqrt(Dh) + mask) V, step by step (s6.4, s6.5): the path an observed layer takes."""
        B, H, T, Dh = q.shape
        Hkv, S = k.size(1), k.size(2)
        k_groups = expand_kv(k, H // Hkv)  # (B, Hkv, G, S, Dh): GQA, query head h reads KV head h // G
        self.tap("k_repeated", k_groups)  # recorded as the (H, S, Dh) it lays out, without a copy
        k, v = k_groups.reshape(B, H, S, Dh), expand_kv(v, H // Hkv).reshape(B, H, S, Dh)  # (B, H, S, Dh) each
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(Dh)  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # (B, H, T, S): -inf where a key is not attended
        self.tap("scores", scores)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, T, S), each row sums to 1
        self.tap("probs", probs)
        return probs @ v  # (B, H, T, Dh)


class FeedForward(Tappable):
    """SwiGLU: down(silu(x W_gate) * (x W_up)) (s6.7)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ffn_dim = config.ffn_dim
        self.w_gate_up = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=False)  # (2F, D): W_gate rows, then W_up
        self.w_down = nn.Linear(config.ffn_dim, config.d_model, bias=False)  # (D, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split_with_sizes([self.ffn_dim, self.ffn_dim], dim=-1)  # (B, T, F) each
        self.tap("gate", gate)
        self.tap("up", up)
        act = F.silu(gate) * up  # (B, T, F)
        self.tap("act", act)
        down = self.edit("down", self.w_down(act))  # (B, T, D)
        self.tap("down", down)
        return down


class Block(Tappable):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU, each added to the residual stream."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.d_model, config.rms_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.rms_eps)
        self.ffn = FeedForward(config)
        self.attn.layer = self.ffn.layer = layer

    def forward(self, x, cos, sin, cache, start, mask) -> torch.Tensor:
        x = self.edit("resid_pre", x)  # (B, T, D)
        h = self.attn_norm(x)  # (B, T, D)
        self.tap("attn_norm", h)
        x = self.edit("resid_mid", x + self.attn(h, cos, sin, cache, start, mask))  # s6.6 residual 1
        self.tap("resid_mid", x)
        h = self.ffn_norm(x)
        self.tap("ffn_norm", h)
        x = self.edit("resid_post", x + self.ffn(h))  # s6.7 residual 2
        self.tap("resid_post", x)
        return x


# ----------------------------------------------------------------------------------------------------------------
# The model


class Transformer(Tappable):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)  # (V, D)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.rms_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)  # (V, D)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (Dh/2,) RoPE's theta_i
        self.layer_devices: Optional[list[torch.device]] = None  # where each layer runs, when placed over several

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` slots (prompt + new tokens), in the model's dtype.
        Each layer's keys and values sit where that layer runs."""
        p = self.embed.weight
        return KVCache(self.config, max_len, batch=batch, dtype=p.dtype, device=self.layer_devices or p.device)

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, cache: Optional[KVCache] = None, start: int = 0, *,
                input_pos: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                last_only: bool = False) -> torch.Tensor:
        """idx (B, T) token ids for cache slots [start, start+T) -> logits (B, T, V), or (B, V) with last_only.

        With a cache, keys and values are written to it and earlier slots are read from it; without one, this is a
        plain full-sequence pass (start 0). input_pos (B, T): each token's position, start + [0, T) by default.
        attention_mask (B, S): False at pad slots, None when no row is padded.
        """
        B, T = idx.shape
        if cache is None and start != 0:
            raise ValueError("start > 0 needs a KV cache holding slots [0, start)")
        cos, sin, mask = self.rope_and_mask(idx, start, input_pos, attention_mask)  # s5, and who attends to whom
        x = self.embed(idx)  # s4: (B, T, D)
        self.tap("embed", x)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # RoPE's tables in the activations' dtype, once for every layer
        caches = cache.layers if cache is not None else [None] * len(self.layers)
        for block, layer_cache in zip(self.layers, caches):  # s6: the layer loop
            x = block(x, cos, sin, layer_cache, start, mask)
        if cache is not None:
            cache.seq_len = start + T
        return self.head(x, last_only)  # s7-s9

    # The two pieces of forward around the layer loop, callable on their own by code that runs the layers one at a
    # time (llmtrace.compare runs two models side by side, layer by layer).

    def rope_and_mask(self, idx: torch.Tensor, start: int = 0, input_pos: Optional[torch.Tensor] = None,
                      attention_mask: Optional[torch.Tensor] = None):
        """What every layer of a forward call shares: RoPE's cos and sin, (T, Dh) or (B, T, Dh), and the allowed keys
        (B or 1, 1, T, S), or None."""
        T = idx.size(1)
        if input_pos is None:
            input_pos = torch.arange(start, start + T, device=idx.device)  # (T,): the same positions in every row
        cos, sin = rope_angles(self.inv_freq, input_pos)  # s5: RoPE's angles
        return cos, sin, allowed_keys(T, start, attention_mask, idx.device)

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """The residual stream after the last layer (B, T, D) -> logits (B, T, V), or (B, V) with last_only."""
        x = self.norm(x)  # s8: (B, T, D)
        self.tap("final_norm", x)
        if last_only:
            x = x[:, -1, :]  # s7: only the last position predicts the next token, (B, D)
            self.tap("last", x)
        logits = self.lm_head(x)  # s9: (B, V), or (B, T, V) for every position
        self.tap("logits", logits)
        return logits

    # -- observation -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def observed(self, observer: Observer, layers: Optional[Iterable[int]] = None,
                 attention: Optional[Iterable[int]] = None):
        """Report the model-level points and the points of `layers` (None: every layer) to `observer` within the
        block; on exit the model is as before. `attention` (None: the same layers) names the layers whose attention
        sub-layer is observed too: those spell attention out, so that their k_repeated, scores and probs exist. Every
        other layer keeps the fused kernel; a layer observed without its attention reports its norms, residual stream
        and feed-forward points."""
        layers = range(self.config.n_layers) if layers is None else list(layers)
        attention = layers if attention is None else attention
        modules = [self] + [m for i in layers for m in (self.layers[i], self.layers[i].ffn)]
        modules += [self.layers[i].attn for i in attention]
        with _attached(modules, "observer", observer):
            yield self

    @contextlib.contextmanager
    def edited(self, editor: Editor, layers: Optional[Iterable[int]] = None):
        """Pass the values at the edit points of `layers` (None: every layer) through `editor` within the block; on
        exit the model is as before. Used by interventions only (llmtrace.run.interventions)."""
        layers = range(self.config.n_layers) if layers is None else list(layers)
        modules = [m for i in layers for m in (self.layers[i], self.layers[i].attn, self.layers[i].ffn)]
        with _attached(modules, "editor", editor):
            yield self

    def num_params(self) -> int:
        """The weights, a matrix held as GGUF blocks or packed from them (--keep-quantized, --fast) counted by its
        weights, not by its storage's elements."""
        from llmtrace.model.quant import weight_count  # where the storage kinds are known

        return weight_count(self)


@contextlib.contextmanager
def _attached(modules: list[nn.Module], attr: str, value):
    """Set `attr` (observer or editor) on each module for the block; on exit every module has its value from before."""
    saved = [getattr(m, attr) for m in modules]
    for m in modules:
        setattr(m, attr, value)
    try:
        yield
    finally:
        for m, before in zip(modules, saved):
            setattr(m, attr, before)
