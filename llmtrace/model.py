"""The LLaMA-family decoder, written out so it can be read beside the seed table (s4-s9).

Notation, used in every shape comment:
    B  batch (always 1 in llmtrace, kept for clarity)
    T  tokens in this forward call (the prompt during prefill, 1 during decode)
    S  tokens in the KV cache after this call (T_kv)
    D  model width (d_model)          H    query heads         Hkv  key/value heads (GQA when Hkv < H)
    Dh head width (D / H usually)     F    FFN width            V    vocabulary size

Observable points. The forward pass names what it computes with `self.tap(name, tensor)`. A tap costs one attribute
check when nothing observes the model; `Transformer.observe(observer)` attaches an observer (see llmtrace.trace) only
for the duration of a traced call. The model never formats, stores or prints anything itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# An observer is called as observer(layer, name, tensor); layer is None outside the decoder layers.
Observer = Callable[[Optional[int], str, torch.Tensor], None]


@dataclass
class ModelConfig:
    arch: str = "llama"  # source architecture name (llama, mistral, qwen2), for display
    n_layers: int = 30  # L: number of decoder layers
    d_model: int = 576  # D: width of the residual stream
    n_heads: int = 9  # H: query heads
    n_kv_heads: int = 3  # Hkv: key/value heads; H % Hkv == 0, H // Hkv query heads share one KV head
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
        """Query heads per KV head."""
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
# RoPE: rotate each (i, i + Dh/2) pair of q and k by the angle pos * theta_i


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


def rope_table(config: ModelConfig, n_pos: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [0, n_pos), each (n_pos, Dh), float32."""
    inv_freq = rope_inv_freq(config).to(device)
    angles = torch.outer(torch.arange(n_pos, device=device, dtype=torch.float32), inv_freq)  # (n_pos, Dh/2)
    angles = torch.cat([angles, angles], dim=-1)  # (n_pos, Dh): pair i and i + Dh/2 share an angle
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, nh, Dh); cos, sin: (T, Dh). Rotates pairs (x_i, x_{i+Dh/2})."""
    cos = cos[:, None, :].to(x.dtype)  # (T, 1, Dh), broadcast over heads
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------------------------
# KV cache: preallocated buffers, written at the positions being computed (s6.8)


class LayerKV:
    """One layer's cached keys and values: two preallocated buffers of (B, Hkv, S_max, Dh)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, Dh) at positions [start, start+T); return all valid keys and values (B, Hkv, S, Dh)."""
        end = start + k.size(2)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Preallocated keys and values for every layer: positions [0, seq_len) hold valid entries."""

    def __init__(self, n_layers: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (1, n_kv_heads, max_len, head_dim)  # (B, Hkv, S_max, Dh) per layer
        # One buffer per layer, handed to the layer itself: the layer's code needs no layer index, and the compiled
        # step (Transformer.compile_decode) gets separate inputs rather than views into one shared tensor.
        self.layers = [LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(n_layers)]
        self.max_len = max_len
        self.seq_len = 0  # positions [0, seq_len) hold valid keys and values

    @property
    def element_size(self) -> int:
        return self.layers[0].k.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position takes across all layers: 2 (K and V) * L * Hkv * Dh * element size."""
        B, Hkv, _, Dh = self.layers[0].k.shape
        return 2 * len(self.layers) * B * Hkv * Dh * self.element_size

    @property
    def bytes_allocated(self) -> int:
        return sum(kv.k.nbytes + kv.v.nbytes for kv in self.layers)


# ----------------------------------------------------------------------------------------------------------------
# The decoder layer


class Linear(nn.Linear):
    """nn.Linear, plus one detail for the compiled decode step (Transformer.compile_decode).

    Inductor hands a one-token input to the matrix product as a (1, K) view whose size-1 dimension has stride 0, and
    the CPU matrix product copies such an input before it multiplies (91 copies per decode step here). Giving the
    input its dense strides explicitly while compiling removes the copies: the compiled step got 6.5% faster
    (benchmarks/RESULTS.md). Eager PyTorch does not take this branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.is_contiguous():
            x = x.as_strided(x.shape, _dense_strides(x.shape))
        return super().forward(x)


def _dense_strides(shape) -> tuple:
    """The strides of a contiguous tensor of this shape, size-1 dimensions included (row-major)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class Tappable(nn.Module):
    """A module with named observable points. `observer` is None unless a trace is being recorded."""

    observer: Optional[Observer] = None
    layer: Optional[int] = None

    def tap(self, name: str, x: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(self.layer, name, x)


class Attention(Tappable):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        # Wq, Wk, Wv as one matrix: one matmul instead of three. Rows [0, q_dim) are Wq, then Wk, then Wv.
        self.wqkv = Linear(config.d_model, q_dim + 2 * kv_dim, bias=config.attn_bias)  # (H*Dh + 2*Hkv*Dh, D)
        self.wo = Linear(q_dim, config.d_model, bias=False)  # (D, H*Dh)
        # True: scores, mask, softmax and P.V spelled out (and observable); False: the fused SDPA kernel
        self.eager = False

    def forward(self, x, cos, sin, cache: Optional[LayerKV], start: int) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        # s6.1 project: Q = X Wq, K = X Wk, V = X Wv
        qk, v = self.wqkv(x).split([(H + Hkv) * Dh, Hkv * Dh], dim=-1)
        # s6.2 split heads. q's and k's heads stay side by side, so that RoPE turns them in one go.
        qk = qk.view(B, T, H + Hkv, Dh)  # (B, T, H+Hkv, Dh)
        v = v.view(B, T, Hkv, Dh)  # (B, T, Hkv, Dh)
        q, k = qk.split([H, Hkv], dim=2)  # (B, T, H, Dh), (B, T, Hkv, Dh)
        self.tap("q", q)
        self.tap("k", k)
        self.tap("v", v)
        # s6.3 RoPE on q and k (v carries no position)
        q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=2)
        self.tap("q_rope", q)
        self.tap("k_rope", k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, Dh)
        # s6.8 write this call's keys and values into the cache; attend over everything cached so far
        if cache is not None:
            k, v = cache.update(start, k, v)  # (B, Hkv, S, Dh)
            if self.observer is not None:
                self.tap("kv_write", torch.arange(start, start + T))  # the positions written
        if self.eager:
            y = self._attention_eager(q, k, v, start)
        else:
            y = self._attention_sdpa(q, k, v, start)
        y = y.transpose(1, 2)  # (B, T, H, Dh)
        self.tap("attn_out", y)
        # s6.6 concatenate heads and project back to D
        out = self.wo(y.reshape(B, T, H * Dh))  # (B, T, D)
        self.tap("o_proj", out)
        return out

    def _attention_eager(self, q, k, v, start):
        """softmax(Q K^T / sqrt(Dh) + causal mask) V, step by step (s6.4, s6.5)."""
        B, H, T, Dh = q.shape
        Hkv, S = k.size(1), k.size(2)
        group = H // Hkv  # GQA: query heads [g*group, (g+1)*group) all read KV head g
        if self.observer is not None:  # the repeated keys exist only to be looked at; the math below groups instead
            # what repeat_interleave(group) would make, as a broadcast view of the cache: recorded as (B, S, H, Dh)
            self.tap("k_repeated", k.transpose(1, 2)[:, :, :, None].expand(B, S, Hkv, group, Dh))
        qg = q.reshape(B, Hkv, group * T, Dh)  # (B, Hkv, group*T, Dh): a KV head's query rows side by side
        scores = (qg @ k.transpose(-2, -1)).view(B, H, T, S) / math.sqrt(Dh)  # (B, H, T, S)
        # causal mask: the query at position start+i may see keys at positions <= start+i
        if T > 1:
            q_pos = torch.arange(start, start + T, device=q.device)[:, None]
            k_pos = torch.arange(S, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))  # (B, H, T, S)
        self.tap("scores", scores)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, T, S), each row sums to 1
        self.tap("probs", probs)
        y = probs.view(B, Hkv, group * T, S) @ v  # (B, Hkv, group*T, Dh)
        return y.view(B, H, T, Dh)

    def _attention_sdpa(self, q, k, v, start):
        """The same computation in one fused kernel."""
        T, S = q.size(2), k.size(2)
        if T == 1:  # one new token sees every cached position: no mask needed
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        q_pos = torch.arange(start, start + T, device=q.device)[:, None]
        mask = torch.arange(S, device=q.device)[None, :] <= q_pos  # (T, S), True where attention is allowed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class FeedForward(Tappable):
    """SwiGLU: down(silu(x W_gate) * (x W_up)) (s6.7)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ffn_dim = config.ffn_dim
        self.w_gate_up = Linear(config.d_model, 2 * config.ffn_dim, bias=False)  # (2F, D): W_gate rows, then W_up
        self.w_down = Linear(config.ffn_dim, config.d_model, bias=False)  # (D, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.ffn_dim, dim=-1)  # (B, T, F) each
        self.tap("gate", gate)
        self.tap("up", up)
        act = F.silu(gate) * up  # (B, T, F)
        self.tap("act", act)
        down = self.w_down(act)  # (B, T, D)
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

    def forward(self, x, cos, sin, cache, start) -> torch.Tensor:
        h = self.attn_norm(x)  # (B, T, D)
        self.tap("attn_norm", h)
        x = x + self.attn(h, cos, sin, cache, start)  # s6.6 residual 1
        self.tap("resid_mid", x)
        h = self.ffn_norm(x)
        self.tap("ffn_norm", h)
        x = x + self.ffn(h)  # s6.7 residual 2
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
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)  # (V, D)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.cache: Optional[KVCache] = None
        self._rope_len = 0
        self._compiled_step = None  # see compile_decode
        self._guards_passed = False

    # -- set-up ------------------------------------------------------------------------------------------------

    def setup_cache(self, max_len: int) -> KVCache:
        """Allocate a KV cache for `max_len` positions (prompt + new tokens)."""
        c = self.config
        p = self.embed.weight
        self.cache = KVCache(c.n_layers, c.n_kv_heads, max_len, c.head_dim, p.dtype, p.device)
        self._ensure_rope(max_len)
        return self.cache

    def _ensure_rope(self, n_pos: int) -> None:
        if n_pos > self._rope_len:
            # the table grows in powers of two from 4,096 positions, so its size (which a compiled step is specialised
            # on) is the same for every run of ordinary length; each row depends only on its own position
            n_pos = max(4096, 1 << (n_pos - 1).bit_length())
            cos, sin = rope_table(self.config, n_pos, self.embed.weight.device)
            self.register_buffer("rope_cos", cos, persistent=False)  # (n_pos, Dh)
            self.register_buffer("rope_sin", sin, persistent=False)
            self._rope_len = n_pos

    def observe(self, observer: Optional[Observer]) -> None:
        """Attach (or, with None, detach) an observer to every observable point."""
        if observer is self.observer:
            return  # already attached, or already detached: the generation loop asks once per step
        for m in self.modules():
            if isinstance(m, Tappable):
                m.observer = observer

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, start: int = 0, last_only: bool = False) -> torch.Tensor:
        """idx (B, T) token ids at positions [start, start+T) -> logits (B, T, V), or (B, V) with last_only.

        With a cache set up (setup_cache), keys and values are written to it and earlier positions are read from it;
        without one, this is a plain full-sequence forward from position 0.
        """
        B, T = idx.shape
        if self.cache is None and start != 0:
            raise ValueError("start > 0 needs a KV cache (call setup_cache first)")
        self._ensure_rope(start + T)
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]  # (T, Dh)
        x = self.embed(idx)  # s4: (B, T, D)
        self.tap("embed", x)
        caches = self.cache.layers if self.cache is not None else [None] * len(self.layers)
        for block, cache in zip(self.layers, caches):  # s6: the layer loop
            x = block(x, cos, sin, cache, start)
        if self.cache is not None:
            self.cache.seq_len = start + T
        x = self.norm(x)  # s8: (B, T, D)
        self.tap("final_norm", x)
        if last_only:
            x = x[:, -1, :]  # s7: only the last position predicts the next token, (B, D)
            self.tap("last", x)
        logits = self.lm_head(x)  # s9: (B, V), or (B, T, V) for every position
        self.tap("logits", logits)
        return logits

    # -- the compiled decode step ---------------------------------------------------------------------------------

    def compile_decode(self) -> None:
        """Compile the one-token decode step with torch.compile (TorchDynamo captures, Inductor fuses).

        forward() stays as written: what gets compiled is that same code, captured whole (all layers, `fullgraph`) and
        fused into a few kernels per layer, which removes most of eager PyTorch's per-op overhead (benchmarks/
        RESULTS.md). It agrees with eager to float rounding, not bit for bit. `step` uses it only for one-token passes
        that nothing observes; the prefill and every observed pass run eagerly, taps and all.
        """
        # On CPU, Inductor's C++ wrapper calls the kernels without a Python line per kernel (measured ~4% faster)
        options = {"cpp_wrapper": True} if self.embed.weight.device.type == "cpu" else {}
        # Python floats here are constants of the model (eps, scales); treated as dynamic inputs, one of them made
        # TorchDynamo start over halfway, which doubled the compile time
        torch._dynamo.config.specialize_float = True
        self._compiled_step = torch.compile(self.forward, dynamic=True, fullgraph=True, options=options)
        self._guards_passed = False

    def uncompile(self) -> None:
        self._compiled_step = None

    def step(self, idx: torch.Tensor, start: int, *, next_of_same_run: bool = False) -> torch.Tensor:
        """One generation pass over idx (B, T) at positions [start, start+T): logits (B, V) of the last position.

        Runs the compiled decode step (compile_decode) when there is one, the pass is one token, and nothing observes
        it. `next_of_same_run`: the caller vouches that this pass follows the previous one in the same generation
        (same cache, position one further, only the token differs). If that previous pass was compiled too, TorchDynamo's
        guard check (its assumptions about every input, re-checked on each call: ~1 ms a step here) is not repeated."""
        if self._compiled_step is None or idx.size(1) != 1 or self.observer is not None:
            self._guards_passed = False
            return self(idx, start=start, last_only=True)
        if next_of_same_run and self._guards_passed:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._compiled_step(idx, start, last_only=True)
        logits = self._compiled_step(idx, start, last_only=True)
        self._guards_passed = True
        return logits

    def hidden_states(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The residual stream before layer 0 and after every layer (L+1 tensors of (B, T, D)), no cache."""
        captured: list[torch.Tensor] = []

        def grab(layer, name, x):
            if name == "embed" or name == "resid_post":
                captured.append(x)

        saved_cache, self.cache = self.cache, None
        self.observe(grab)
        try:
            self.forward(idx)
        finally:
            self.observe(None)
            self.cache = saved_cache
        return captured

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
