"""GGUF weights kept in their quantized blocks (`--keep-quantized`), dequantized in torch when a matrix is used.

A GGUF matrix is stored row by row; each row is a run of fixed-size blocks, and each block holds `block` weights in
`type_size` bytes (scales plus packed integers). `dequantize(raw, kind)` turns the bytes (rows, bytes per row) back
into float32 (rows, columns) with the same operations, in the same order, as the gguf package's numpy reference, so
the values are bit for bit those of `gguf.quants.dequantize` (tests/test_scale.py checks every type).

`QuantLinear` and `QuantEmbedding` replace the model's Linear and Embedding modules after the load (the loader swaps
them in; the forward pass does not know). A fused matrix (QKV, gate/up) may mix types (Q4_K_M files keep V in Q6_K),
so a QuantLinear holds row segments, each in its own type.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

QK_K = 256  # weights per super-block of the K-quants
BAND_WEIGHTS = 1 << 20  # QuantLinear dequantizes at most this many weights at a time (4 MiB as float32)

# type name -> (weights per block, bytes per block)
BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
    "MXFP4": (32, 17),
}  # fmt: skip


def bytes_per_weight(kind: str) -> float:
    block, size = BLOCKS[kind]
    return size / block


# ----------------------------------------------------------------------------------------------------------------
# one function per block type: blocks (n, bytes per block) uint8 -> (n, weights per block) float32


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes per row (n, 2) -> their float16 value as float32, (n, 1)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., m) packed bytes -> (..., 2m): the low nibbles of all m bytes, then the high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """(..., m) bytes -> (..., count, m): field k holds bits [k*width, (k+1)*width) of every byte."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts[:, None]) & ((1 << width) - 1)


def _q4_0(b):
    d, q = _f16(b[:, :2]), _nibbles(b[:, 2:])  # (n, 1), (n, 32)
    return d * (q.to(torch.int8) - 8).float()


def _q4_1(b):
    d, m, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:])
    return (d * q.float()) + m


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes, a little-endian 32-bit mask -> (n, 32): bit j for weight j."""
    return _bits(qh, 1, 8).transpose(1, 2).reshape(qh.size(0), 32)


def _q5_0(b):
    d, qh, q = _f16(b[:, :2]), _high_bits_32(b[:, 2:6]), _nibbles(b[:, 6:])
    return d * ((q | (qh << 4)).to(torch.int8) - 16).float()


def _q5_1(b):
    d, m, qh, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _high_bits_32(b[:, 4:8]), _nibbles(b[:, 8:])
    return (d * (q | (qh << 4)).float()) + m


def _q8_0(b):
    d, x = _f16(b[:, :2]), b[:, 2:].contiguous().view(torch.int8)
    return x.float() * d


def _q2_k(b):
    n = b.size(0)
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).float()  # 2 halves x 4 shifts x 32 bytes
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.size(0)
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _bits(sc[:, :8], 4, 2).reshape(n, 16)  # scale j: low 4 bits from byte j % 8, nibble j // 8
    high = _bits(sc[:, 8:12], 2, 4).reshape(n, 16)  # high 2 bits from byte 8 + j % 4, pair j // 4
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()  # 6-bit signed
    dl = (d * scales).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    qh = _bits(hmask, 1, 8).reshape(n, 16, 16) ^ 1  # a clear mask bit means "subtract 4"
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins, (n, 8) each."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q4_k(b):
    n = b.size(0)
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    q = _bits(b[:, 16:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b):
    n = b.size(0)
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    qh = _bits(b[:, 16:48], 1, 8).reshape(n, 8, 32)
    ql = _bits(b[:, 48:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    return (dl * (ql | (qh << 4)).float() - ml).reshape(n, QK_K)


def _q6_k(b):
    n = b.size(0)
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _bits(ql.reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    high = _bits(qh.reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1's 16 values, × 2


def _mxfp4(b):
    """gpt-oss's experts: an e8m0 exponent e, then 32 4-bit e2m1 codes (byte j: element j low, j + 16 high); w =
    code's value × 2^(e − 127), computed as ggml does: the doubled value × 2^(e − 128) (a float built from bits)."""
    e = b[:, :1].to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    d = bits.view(torch.float32)  # (n, 1): 2^(e − 128)
    lut = torch.tensor(_E2M1_DOUBLED, dtype=torch.float32, device=b.device)
    return d * lut[_nibbles(b[:, 1:]).long()]


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """raw (rows, bytes per row) uint8 in GGUF type `kind` -> (rows, columns) float32."""
    rows = raw.size(0)
    if kind in _FLOATS:
        return raw.contiguous().view(_FLOATS[kind]).float()
    block, size = BLOCKS[kind]
    blocks = raw.reshape(-1, size)  # (rows * blocks per row, bytes per block)
    return _DEQUANT[kind](blocks).reshape(rows, -1)


# ----------------------------------------------------------------------------------------------------------------
# the same blocks as groups of 32 affine integers, w = scale * u + zero (`--fast` packs these for torch's int4 kernel)


class AffineGroups(NamedTuple):
    """A matrix (rows, K) as w = scale * u + zero, with u an unsigned integer below 2**bits and one scale and one zero
    per group of 32 weights of a row (float32, (rows, K / 32) each)."""

    u: torch.Tensor  # (rows, K) uint8
    scale: torch.Tensor  # (rows, K / 32) float32
    zero: torch.Tensor  # (rows, K / 32) float32
    bits: int


def _g_q4_0(b):  # d * (q - 8)
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d, 4


def _g_q4_1(b):  # d * q + m
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 4


def _g_q5_0(b):  # d * (q - 16)
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:]) | (_high_bits_32(b[:, 2:6]) << 4), d, -16 * d, 5


def _g_q5_1(b):  # d * q + m
    return _nibbles(b[:, 8:]) | (_high_bits_32(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4]), 5


def _g_q8_0(b):  # d * x with x signed: d * (x + 128) - 128 d
    d = _f16(b[:, :2])
    return (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8), d, -128 * d, 8


def _g_q4_k(b):  # per sub-block of 32: (d * sc) * q - (dmin * mn)
    n = b.size(0)
    sc, mn = _k_scale_min(b[:, 4:16])
    u = _bits(b[:, 16:].reshape(n, 4, 32), 4, 2).reshape(n, 8 * 32)
    return u, _f16(b[:, :2]) * sc.float(), -(_f16(b[:, 2:4]) * mn.float()), 4


def _g_q5_k(b):
    n = b.size(0)
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = _bits(b[:, 16:48], 1, 8).reshape(n, 8, 32)
    ql = _bits(b[:, 48:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    return (ql | (qh << 4)).reshape(n, 8 * 32), _f16(b[:, :2]) * sc.float(), -(_f16(b[:, 2:4]) * mn.float()), 5


_GROUPS = {"Q4_0": _g_q4_0, "Q4_1": _g_q4_1, "Q5_0": _g_q5_0, "Q5_1": _g_q5_1, "Q8_0": _g_q8_0, "Q4_K": _g_q4_k,
           "Q5_K": _g_q5_k}
GROUP_KINDS = tuple(_GROUPS)  # types whose blocks are groups of 32 (Q2_K, Q3_K, Q6_K have groups of 16)


def affine_groups(raw: torch.Tensor, kind: str) -> AffineGroups:
    """raw (rows, bytes per row) uint8 of a type in GROUP_KINDS -> its AffineGroups. scale * u + zero, in float32, is
    the value `dequantize` gives up to float rounding (the reference computes d * (q - 8) where this has d * q - 8d)."""
    rows = raw.size(0)
    u, scale, zero, bits = _GROUPS[kind](raw.reshape(-1, BLOCKS[kind][1]))
    return AffineGroups(u.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1), bits)


# ----------------------------------------------------------------------------------------------------------------
# modules


class Segment(NamedTuple):
    """A run of rows of one matrix, stored in one GGUF type."""

    kind: str  # GGUF type name, e.g. "Q4_K"
    source: str  # the GGUF tensor it came from, for display


class QuantLinear(nn.Module):
    """y = x W^T (+ b), with W kept as GGUF blocks and dequantized at each call (the reference values, bit for bit).

    W is one or more row segments (QKV, gate/up fused), each its own uint8 buffer of (rows, bytes per row). `compute`
    is the dtype of the product (the run dtype); dequantization itself is always float32 first, as in the reference."""

    def __init__(self, raws: list[torch.Tensor], segments: list[Segment], in_features: int, compute: torch.dtype,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.segments = segments
        self.in_features = in_features
        self.out_features = sum(r.size(0) for r in raws)
        self.compute = compute
        for i, r in enumerate(raws):
            self.register_buffer(f"raw{i}", r)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def raws(self) -> list[torch.Tensor]:
        return [getattr(self, f"raw{i}") for i in range(len(self.segments))]

    def dequantize(self) -> torch.Tensor:
        """The whole matrix W (out_features, in_features) in the compute dtype."""
        parts = [dequantize(r, s.kind) for r, s in zip(self.raws(), self.segments)]
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        return w.to(self.compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_on(x.device):
            y = torch.cat([fused_linear(s.kind)(x, r) for r, s in zip(self.raws(), self.segments)], dim=-1)
            return y if self.bias is None else y + self.bias
        # a band of rows at a time (BAND_WEIGHTS): the dequantized copy of a big matrix (the LM head) never exists
        # whole, which keeps the memory near the file's size; each output column depends on its own row only
        outs = []
        for raw, seg in zip(self.raws(), self.segments):
            step = max(1, BAND_WEIGHTS // self.in_features)
            for r in range(0, raw.size(0), step):
                outs.append(F.linear(x, dequantize(raw[r : r + step], seg.kind).to(self.compute)))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in for W with its shape, dtype and device, holding no data (an expanded scalar): code that asks a
        layer for its weight's shape or device keeps working. The values are in dequantize()."""
        return _stand_in(self.raw0, (self.out_features, self.in_features), self.compute)

    def stored_bytes(self) -> int:
        return sum(r.nbytes for r in self.raws())

    def extra_repr(self) -> str:
        kinds = "+".join(s.kind for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={kinds}"


class QuantEmbedding(nn.Module):
    """Token embedding kept as GGUF blocks: only the looked-up rows are dequantized (a row is whole blocks)."""

    def __init__(self, raw: torch.Tensor, segment: Segment, dim: int, compute: torch.dtype):
        super().__init__()
        self.segments = [segment]
        self.num_embeddings, self.embedding_dim, self.compute = raw.size(0), dim, compute
        self.register_buffer("raw0", raw)

    def raws(self) -> list[torch.Tensor]:
        return [self.raw0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = self.raw0[idx.reshape(-1)]  # (B*T, bytes per row)
        return dequantize(rows, self.segments[0].kind).to(self.compute).view(*idx.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """See QuantLinear.weight."""
        return _stand_in(self.raw0, (self.num_embeddings, self.embedding_dim), self.compute)

    def stored_bytes(self) -> int:
        return self.raw0.nbytes


class QuantExperts(nn.Module):
    """E matrices (E, out, in) kept as one GGUF tensor's blocks (a mixture of experts' ffn_*_exps), used one expert
    at a time as model.moe.ExpertMatrices is: y = x W_eᵀ, W_e dequantized from its rows [e·out, (e+1)·out) at each
    call (an expert's rows are whole blocks)."""

    def __init__(self, raw: torch.Tensor, segment: Segment, shape: tuple[int, int, int], compute: torch.dtype,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.segments = [segment]
        self.n_experts, self.out_features, self.in_features = shape
        self.compute = compute
        self.register_buffer("raw0", raw)  # (E * out, bytes per row)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # (E, out): gpt-oss's

    def raws(self) -> list[torch.Tensor]:
        return [self.raw0]

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        raw = self.raw0[e * self.out_features : (e + 1) * self.out_features]
        y = (fused_linear(self.segments[0].kind)(x, raw) if fused_on(x.device) else
             F.linear(x, dequantize(raw, self.segments[0].kind).to(self.compute)))
        return y if self.bias is None else y + self.bias[e]

    @property
    def weight(self) -> torch.Tensor:
        """See QuantLinear.weight: (E, out, in), no data."""
        return torch.zeros((), dtype=self.compute, device=self.raw0.device).expand(
            self.n_experts, self.out_features, self.in_features)

    def stored_bytes(self) -> int:
        return self.raw0.nbytes

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"stored={self.segments[0].kind}")


def fused_on(device: torch.device) -> bool:
    """Dequantization fused into the matrix product (torch.compile) on CUDA; elsewhere the plain path, whose values
    are the reference's exactly. (On the CPU Inductor's fused loop was not faster than dequantize-then-GEMM.)"""
    return device.type == "cuda"


_FUSED: dict[str, object] = {}


def fused_linear(kind: str):
    """x (..., K) @ dequantize(raw)^T as one compiled function per block type, as gpt-fast does for int8/int4
    weights: Inductor generates the dequantization inside the product's kernels instead of writing W to memory."""
    if kind not in _FUSED:
        def linear(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
            return F.linear(x, dequantize(raw, kind).to(x.dtype))

        _FUSED[kind] = torch.compile(linear, dynamic=True, fullgraph=True)
    return _FUSED[kind]


def _stand_in(like: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=like.device).expand(shape)


QUANT_MODULES = (QuantLinear, QuantEmbedding, QuantExperts)


def _blocks_module(m: nn.Module) -> bool:
    """A matrix held as GGUF blocks or packed from them: QuantLinear, QuantEmbedding, QuantExperts, fast.FastLinear
    (which marks itself with `segments` and `stored_bytes`; quant does not import the fast path)."""
    return isinstance(m, QUANT_MODULES) or (hasattr(m, "segments") and hasattr(m, "stored_bytes"))


def _tied_head(model: nn.Module, name: str, m: nn.Module) -> bool:
    """The LM head multiplies by the embedding's own storage (one row says both)."""
    embed = getattr(model, "embed", None)
    if name != "lm_head" or embed is None:
        return False
    if isinstance(m, QuantLinear) and isinstance(embed, QuantEmbedding):
        return m.raw0 is embed.raw0
    return isinstance(m, nn.Linear) and m.weight is embed.weight


def _expert_stack(m: nn.Module) -> bool:
    """A dense stack of E matrices (model.moe.ExpertMatrices: its weight a (E, out, in) parameter)."""
    w = getattr(m, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 3


def storage_table(model: nn.Module) -> list[dict]:
    """Each matrix's storage: name, GGUF type(s) and bytes per weight. Dense matrices appear with their dtype. On the
    fast path each matrix also names its kernel."""
    out = []
    for name, m in model.named_modules():
        if _tied_head(model, name, m):
            continue  # tied: the embedding's row already says it
        if _blocks_module(m):
            n = m.weight.numel()
            out.append({"name": name, "type": "+".join(dict.fromkeys(s.kind for s in m.segments)),
                        "bytes_per_weight": round(m.stored_bytes() / n, 4)}
                       | ({"kernel": m.kernel} if hasattr(m, "kernel") else {}))
        elif isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.dim() == 2 or _expert_stack(m):
            t = m.weight
            out.append({"name": name, "type": str(t.dtype).replace("torch.", ""), "bytes_per_weight": t.element_size()})
    return out


def weight_count(model: nn.Module) -> int:
    """Parameters, counting each quantized matrix by its weights (not its bytes), a tied matrix once."""
    seen: set[int] = set()
    # the fast path's storage (model.fast: packed int4, scales, bf16 copies) is held as parameters of a matrix's parts;
    # the matrix is counted below, by its weights
    stored = {id(p) for m in model.modules() if _blocks_module(m) for part in getattr(m, "parts", ())
              for p in part.parameters()}
    n = sum(p.numel() for p in model.parameters() if id(p) not in stored)
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    for name, m in model.named_modules():
        if not _blocks_module(m) or (tied and name == "lm_head"):
            continue  # a tied head (fast: a packed copy of the embedding's blocks) counts with the embedding
        key = id(m.raw0) if hasattr(m, "raw0") else id(m)
        if key not in seen:
            seen.add(key)
            n += m.weight.numel()
    return n
