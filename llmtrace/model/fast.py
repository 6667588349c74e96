"""The fast path (`--fast`): a GGUF file's matrices run straight from their blocks on torch's own weight-only
kernels, activations in bfloat16. Approximate, and it says so: a trace of it is marked `"exact": false`.

Each matrix runs on one of four kernels (KERNELS), chosen per matrix shape by measuring them on this machine
(checkpoint.fast.kernel_choice: a short probe at load, cached per CPU, torch version and thread count). Each kernel
states what it multiplies by (CLAIMS; tests/test_fast.py checks every claim):
  - `int4`: torch's int4 kernel, for the types whose weights come in groups of 32 with one scale and one offset
    (quant.affine_groups: w = s*u + z), 4-bit (Q4_0, Q4_1, Q4_K): q = u, scale = s, zero = z + 8s, as the kernel's
    groups compute w = (q - 8) * scale + zero. The file's values, scale and zero rounded to bfloat16.
  - `int4x2`: the same kernel for the 5- and 8-bit group types (Q5_0, Q5_1, Q5_K, Q8_0): u = 16h + l is split into
    its two nibbles, each its own int4 matrix side by side along K: l with (s, z + 8s) and h with (16s, 128s); the
    input is given twice, [x, x], so the one product sums both halves: (l - 8)s + z + 8s + (h - 8)16s + 128s =
    s(16h + l) + z. The file's values, scale and zero rounded to bfloat16.
  - `int8`: torch's int8 weight-only kernel, W requantized per row: W ~ q * s, q int8 in [-127, 127], s one bfloat16
    a row (the row's largest |w| / 127, rounded up): every weight within s/2 of the file's. Any block type (the K-quants
    with groups of 16 too), not float matrices.
  - `bf16`: the matrix dequantized once to bfloat16, on F.linear: every weight rounded to bfloat16.
Every product accumulates in float32. The token embedding stays in its blocks (quant.QuantEmbedding; a lookup
dequantizes its rows: the 262,144-row table of Gemma 3 costs one row a token), vectors are bfloat16.

`FastLinear` replaces the model's nn.Linear modules at build time (checkpoint.fast loads a GGUF file this way), as
quant.QuantLinear does for --keep-quantized; the forward pass does not know. Its RMSNorm modules likewise take
FastRMSNorm's forward (one layer norm, three aten calls instead of ~30). RMSNorm and softmax keep their statistics in
float32 (the layer norm and the attention kernels accumulate in float32 for bfloat16 inputs; the spelled-out softmax
of an observed layer asks for it).
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.quant import BLOCKS, GROUP_KINDS, Segment, affine_groups, dequantize
from llmtrace.model.transformer import RMSNorm

COMPUTE = torch.bfloat16  # the fast path's activations and dense weights
GROUP = 32  # weights per int4 group: the GGUF block (or K-quant sub-block)
PACK_ROWS = 256  # rows packed at a time (a multiple of the CPU packing's 64-row tiles): bounds the load's scratch

INT4_CPU = "int4pack_mm_for_cpu"  # kernel names, as the trace records them
INT4_CUDA = "int4pack_mm"
INT8_CPU = "int8pack_mm (int8 rows)"
DENSE = "bf16 linear"

KERNELS = ("int4", "int4x2", "int8", "bf16")  # the kernels a matrix may run on (see the module's docstring)
CLAIMS = {  # what each kernel multiplies by, against the file's values
    "int4": "the file's values; each group's scale and zero rounded to bfloat16",
    "int4x2": "the file's values; each group's scale and zero rounded to bfloat16 (two nibbles)",
    "int8": "requantized per row: every weight within half a step (the row's largest |w| / 127) of the file's",
    "bf16": "every weight rounded to bfloat16",
}
INT8_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # not floats, not MXFP4


# ----------------------------------------------------------------------------------------------------------------
# the mapping: GGUF blocks -> int4 groups


class Int4Groups(NamedTuple):
    """A matrix as torch's int4 groups: w = (q - 8) * scale + zero over each group of 32 along K'. `split`: K' = 2K,
    the low nibbles' matrix then the high nibbles' (the input must be [x, x])."""

    q: torch.Tensor  # (N, K') int32 in [0, 16)
    scale: torch.Tensor  # (N, K' / 32) float32
    zero: torch.Tensor  # (N, K' / 32) float32
    split: bool


def int4_groups(raw: torch.Tensor, kind: str) -> Int4Groups:
    """raw (N, bytes per row) uint8 of a type in GROUP_KINDS -> its Int4Groups (see the module's docstring)."""
    g = affine_groups(raw, kind)
    if g.bits <= 4:
        return Int4Groups(g.u.to(torch.int32), g.scale, g.zero + 8 * g.scale, split=False)
    low, high = (g.u & 0x0F).to(torch.int32), (g.u >> 4).to(torch.int32)
    return Int4Groups(torch.cat([low, high], dim=1), torch.cat([g.scale, 16 * g.scale], dim=1),
                      torch.cat([g.zero + 8 * g.scale, 128 * g.scale], dim=1), split=True)


def int4_reference(groups: Int4Groups, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
    """The (N, K) float32 matrix the kernel multiplies by: each group's scale and zero rounded to `dtype` first."""
    s = groups.scale.to(dtype).float().repeat_interleave(GROUP, dim=1)
    z = groups.zero.to(dtype).float().repeat_interleave(GROUP, dim=1)
    w = (groups.q.float() - 8) * s + z
    if groups.split:
        low, high = w.chunk(2, dim=1)
        return low + high
    return w


def pack_int4(groups: Int4Groups, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Groups -> (packed weight, scales_and_zeros (K'/32, N, 2)) as the device's int4 kernel takes them."""
    n = groups.q.size(0)
    sz = torch.stack([groups.scale, groups.zero], dim=-1).transpose(0, 1).to(COMPUTE).contiguous()  # (K'/32, N, 2)
    if device.type == "cuda":
        q = groups.q.to(device)
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8),
                                                            _inner_k_tiles(q.size(1)))
        return packed, sz.to(device)
    bands = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q[r : r + PACK_ROWS].contiguous(), 1)
             for r in range(0, n, PACK_ROWS)]
    return (bands[0] if len(bands) == 1 else torch.cat(bands)), sz


def _inner_k_tiles(k: int) -> int:
    """The CUDA packing's inner K tiles: the largest of 8, 4, 2 whose tile (16 * tiles) divides K' (gpt-fast uses 8)."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), 2)


# ----------------------------------------------------------------------------------------------------------------
# modules


class Int4Packer:
    """Packs the row blocks of one matrix (of one split kind) as they come, PACK_ROWS rows at a time, into one tensor
    allocated for all `rows` at the first band, so that neither the unpacked int32 copy of a big matrix (the LM head)
    nor a second packed copy (stacking bands) ever exists whole: the load's peak is the packed matrix plus one band's
    scratch. `finish()` packs the rest, its rows padded to a multiple of 16 with zeros (the packing's unit)."""

    def __init__(self, split: bool, device: torch.device, rows: int):
        self.split, self.device, self.total = split, device, rows
        self.packed: Optional[torch.Tensor] = None
        self.sz: Optional[torch.Tensor] = None
        self.pending: list[Int4Groups] = []
        self.rows = 0  # rows added
        self.done = 0  # rows packed

    def add(self, g: Int4Groups) -> None:
        self.pending.append(g)
        self.rows += g.q.size(0)
        while sum(p.q.size(0) for p in self.pending) >= PACK_ROWS:
            rows = self._joined()
            self._pack(Int4Groups(rows.q[:PACK_ROWS], rows.scale[:PACK_ROWS], rows.zero[:PACK_ROWS], self.split))
            rest = Int4Groups(rows.q[PACK_ROWS:], rows.scale[PACK_ROWS:], rows.zero[PACK_ROWS:], self.split)
            self.pending = [rest] if rest.q.size(0) else []

    def _joined(self) -> Int4Groups:
        if len(self.pending) == 1:
            return self.pending[0]
        return Int4Groups(*(torch.cat([getattr(p, f) for p in self.pending]) for f in ("q", "scale", "zero")),
                          self.split)

    def _pack(self, g: Int4Groups) -> None:
        w, sz = pack_int4(g, self.device)
        n = g.q.size(0)
        if self.packed is None:  # both layouts (CPU (N, K'/2), CUDA (N/8, ...)) grow along dim 0 with the rows
            padded = self.total + (-self.total % 16)
            self.packed = w.new_empty((padded * w.size(0) // n, *w.shape[1:]))
            self.sz = sz.new_empty((sz.size(0), padded, 2))
        at = self.done * w.size(0) // n
        self.packed[at : at + w.size(0)].copy_(w)
        self.sz[:, self.done : self.done + n].copy_(sz)
        self.done += n

    def finish(self) -> "Int4Matmul":
        if self.rows != self.total:
            raise ValueError(f"Int4Packer: {self.rows} rows added, {self.total} announced")
        if self.pending:
            g = self._joined()
            pad = -g.q.size(0) % 16  # the packing takes rows in multiples of 16: padded rows are zeros
            if pad:
                g = Int4Groups(F.pad(g.q, (0, 0, 0, pad), value=8), F.pad(g.scale, (0, 0, 0, pad)),
                               F.pad(g.zero, (0, 0, 0, pad)), self.split)
            self._pack(g)
            self.pending = []
        return Int4Matmul(self.packed, self.sz, self.rows, self.split, self.device)


class Int4Matmul(nn.Module):
    """y = x W^T on torch's int4 kernel: W as packed int4 (Int4Packer) with scales and zeros (K'/32, N, 2) in bf16."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int, split: bool,
                 device: torch.device):
        super().__init__()
        # Parameters that nothing trains, not buffers: TorchDynamo, told to skip its guard checks between the compiled
        # decode steps of one run (model.compiled.CompiledDecode), still checks every tensor input that is not a
        # parameter (its "diff guards"): ~490 a step, 0.3-1.5 ms of it on an AMD EPYC (benchmarks/RESULTS.md)
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.scales_zeros = nn.Parameter(scales_zeros, requires_grad=False)
        self.out_features, self.split = out_features, split
        self.kernel = INT4_CUDA if device.type == "cuda" else INT4_CPU
        ops = torch.ops.aten
        self._mm = ops._weight_int4pack_mm if device.type == "cuda" else ops._weight_int4pack_mm_for_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 4 times a layer: it is kept to the ops it needs (each costs microseconds in eager).
        x2 = x.reshape(-1, x.size(-1))  # (M, K)
        if self.split:
            x2 = torch.cat([x2, x2], dim=-1)  # (M, 2K): the low and the high nibbles' halves of W
        elif torch.compiler.is_compiling():  # see compiled.DenseInputLinear: a stride-0 size-1 dim makes a copy
            x2 = x2.contiguous().as_strided(x2.shape, (x2.size(1), 1))
        y = self._mm(x2, self.packed, GROUP, self.scales_zeros)  # (M, N)
        if y.size(-1) != self.out_features:  # rows padded by the packing
            y = y[:, : self.out_features]
        return y.view(*x.shape[:-1], self.out_features)

    def stored_bytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float32 -> (q (N, K) int8, s (N,) bfloat16) with w ~ q * s: s is the row's largest |w| / 127 rounded
    up to a bfloat16 (so that no q leaves [-127, 127]), and q = round(w / s): every weight within s/2 of w."""
    exact = w.abs().amax(dim=1).clamp_min(1e-30) / 127  # (N,)
    s = exact.to(COMPUTE)
    s = torch.where(s.float() < exact, (exact * (1 + 2**-7)).to(COMPUTE), s)  # rounded down: one bf16 step up
    q = torch.round(w / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


class Int8Matmul(nn.Module):
    """y = x W^T on torch's int8 weight-only kernel: W as int8 rows q (N, K) with one bfloat16 scale a row (int8_rows)."""

    kernel = INT8_CPU

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.q = nn.Parameter(q, requires_grad=False)  # parameters, as Int4Matmul's storage (its comment says why)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.out_features = q.size(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.size(-1))  # (M, K)
        if torch.compiler.is_compiling():  # see Int4Matmul.forward
            x2 = x2.contiguous().as_strided(x2.shape, (x2.size(1), 1))
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features)

    def stored_bytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class DenseMatmul(nn.Module):
    """y = x W^T with W dequantized once to bfloat16."""

    kernel = DENSE

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # a parameter, as Int4Matmul's storage
        self.out_features = weight.size(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def stored_bytes(self) -> int:
        return self.weight.nbytes


class FastLinear(nn.Module):
    """y = x W^T (+ b) for a matrix of one or more row segments (fused QKV, gate/up), each run by the kernel its
    type maps onto; neighbouring segments with the same kernel are one product."""

    def __init__(self, parts: list[nn.Module], segments: list[Segment], in_features: int,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._parts = tuple(parts)  # the same modules, for forward (a ModuleList's indexing is slow Python)
        self.segments = segments
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parts' forward is called directly (no hooks are set on them): a module call costs microseconds, and a
        # decode step makes four of these products a layer.
        parts = self._parts
        if len(parts) == 1:
            y = parts[0].forward(x)
        else:
            y = torch.cat([p.forward(x) for p in parts], dim=-1)
        return y if self.bias is None else y + self.bias

    @property
    def kernel(self) -> str:
        return "+".join(dict.fromkeys(_kernel_name(p) for p in self.parts))

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in with W's shape, dtype and device, holding no data (as quant.QuantLinear.weight)."""
        buf = next(self.parts[0].parameters())
        return torch.zeros((), dtype=COMPUTE, device=buf.device).expand(self.out_features, self.in_features)

    def stored_bytes(self) -> int:
        return sum(p.stored_bytes() for p in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(s.kind for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={kinds}, kernel={self.kernel}"


class FastExperts(FastLinear):
    """E matrices of one GGUF tensor (a mixture of experts' stack (E, out, in)), each packed on its own kernel, used
    one expert at a time as model.moe.ExpertMatrices is: y = x W_eᵀ."""

    def __init__(self, parts: list[nn.Module], segment: Segment, shape: tuple[int, int, int],
                 bias: Optional[torch.Tensor] = None):
        super().__init__(parts, [segment], shape[2], bias)  # bias (E, out): gpt-oss's experts have one
        self.n_experts, self.out_features = shape[0], shape[1]

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        y = self._parts[e].forward(x)
        return y if self.bias is None else y + self.bias[e]

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in of (E, out, in), holding no data."""
        buf = next(self.parts[0].parameters())
        return torch.zeros((), dtype=COMPUTE, device=buf.device).expand(self.n_experts, self.out_features,
                                                                         self.in_features)


def fast_experts(raw: torch.Tensor, segment: Segment, shape: tuple[int, int, int], device: torch.device,
                 choice: dict, bias: Optional[torch.Tensor] = None) -> FastExperts:
    """A FastExperts of a stack's blocks, raw (E·out, bytes per row): expert e is rows [e·out, (e+1)·out)."""
    E, out, in_features = shape
    parts = [fast_linear([raw[e * out : (e + 1) * out]], [segment], in_features, device, choice).parts[0]
             for e in range(E)]
    return FastExperts(parts, segment, shape, bias)


def candidates(kind: str, device: torch.device) -> tuple[str, ...]:
    """The kernels a segment of GGUF type `kind` may run on (KERNELS; on CUDA the int4 kernel or bf16)."""
    out: tuple[str, ...] = ()
    if kind in GROUP_KINDS:
        out += ("int4" if affine_groups(torch.zeros(1, BLOCKS[kind][1], dtype=torch.uint8), kind).bits <= 4
                else "int4x2",)
    if kind in INT8_KINDS and device.type == "cpu":
        out += ("int8",)
    return out + ("bf16",)


REQUANTIZED_GAIN = 0.9  # int8 replaces the int4 kernel's exact mapping only if measured at most 0.9x its time


def kernel_for(choice: dict, kind: str, n: int, k: int, device: torch.device) -> str:
    """The kernel of a segment of type `kind` in a matrix (n, k): the fastest of its candidates in the choice's
    measurements for that shape ("ms"), else the first of them in the choice's order ("order"). Where the int4
    kernel maps the type exactly, the requantized int8 kernel must be clearly faster (REQUANTIZED_GAIN), so that the
    noise of a busy machine's probe does not trade exact values for nothing."""
    allowed = candidates(kind, device)
    ms = choice.get("ms", {}).get(shape_key(n, k))
    if not ms:
        return next((c for c in choice.get("order", KERNELS) if c in allowed), "bf16")
    cost = {c: ms.get(c, float("inf")) for c in allowed}
    if "int8" in cost and allowed[0] in ("int4", "int4x2"):
        cost["int8"] /= REQUANTIZED_GAIN
    return min(allowed, key=cost.__getitem__)


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def _kernel_name(part: nn.Module) -> str:
    if isinstance(part, Int4Matmul):
        return part.kernel + (" (two nibbles)" if part.split else "")
    return part.kernel


def fast_linear(raws: list[torch.Tensor], segments: list[Segment], in_features: int, device: torch.device,
                choice: dict, bias: Optional[torch.Tensor] = None) -> FastLinear:
    """A FastLinear of a matrix's row segments (raw GGUF bytes on the CPU: tensors, or anything whose `size(0)` is
    its rows and whose row slices are tensors, such as a reader of the file's rows), each segment on the kernel the
    choice gives its type at the matrix's shape (kernel_for). Each part is allocated once, for its rows, and filled a
    band of PACK_ROWS rows at a time: the load's scratch is one band, whatever the matrix's size."""
    parts: list[nn.Module] = []
    n = sum(r.size(0) for r in raws)
    keys = [kernel_for(choice, seg.kind, n, in_features, device) for seg in segments]
    i = 0
    while i < len(segments):  # a run of neighbouring segments with one kernel is one part
        run = next((j for j in range(i, len(keys)) if keys[j] != keys[i]), len(keys))
        rows, key, at = sum(r.size(0) for r in raws[i:run]), keys[i], 0
        if key == "bf16":
            dense = torch.empty((rows, in_features), dtype=COMPUTE)
        elif key == "int8":
            q, scale = torch.empty((rows, in_features), dtype=torch.int8), torch.empty(rows, dtype=COMPUTE)
        else:
            packer = Int4Packer(key == "int4x2", device, rows)
        for raw, seg in zip(raws[i:run], segments[i:run]):
            for r in range(0, raw.size(0), PACK_ROWS):  # a band at a time: the unpacked int32 copy stays small
                band = raw[r : r + PACK_ROWS]
                m = band.size(0)
                if key == "bf16":
                    dense[at : at + m] = dequantize(band, seg.kind)
                elif key == "int8":
                    q[at : at + m], scale[at : at + m] = int8_rows(dequantize(band, seg.kind))
                else:
                    packer.add(int4_groups(band, seg.kind))
                at += m
        parts.append(DenseMatmul(dense.to(device)) if key == "bf16" else Int8Matmul(q, scale) if key == "int8"
                     else packer.finish())
        i = run
    return FastLinear(parts, segments, in_features, bias)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm in fewer calls


class FastRMSNorm(RMSNorm):
    """RMSNorm as one layer norm over [x, −x]: that vector's mean is 0 and its variance is mean(x²), so its first half,
    normed and scaled by [γ, 0], is x / sqrt(mean(x²) + eps) · γ. Three aten calls (neg, cat, layer_norm: one native
    kernel that keeps its statistics in float32) where F.rms_norm on the CPU is a composite of ~30: 8 against 14.5 µs
    a call on a (1, 1, 576) bfloat16 vector (benchmarks/RESULTS.md), with the same rounding (one, to bfloat16, after
    the float32 maths: 1,000 random rows gave the same bits as F.rms_norm but for 7 values in 576,000, each one
    bfloat16 step apart). A decode step of SmolLM2 calls it 61 times. Eager only: a compiled step fuses F.rms_norm
    itself. [γ, 0] is a buffer, not a parameter (the model's parameters are the checkpoint's), and the parameter γ is
    a view of its first half, so that a change made to γ in place is the norm's in both forms. The half is made
    contiguous (a copy where T > 1; nothing for one token), as the int4 kernel takes only contiguous inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().forward(x)
        d = x.size(-1)
        return F.layer_norm(torch.cat([x, x.neg()], dim=-1), (2 * d,), self.gamma_zeros, None, self.eps)[..., :d].contiguous()


_FAST_NORMS: dict[type, type] = {}


def use_fast_norms(model: nn.Module) -> int:
    """Give each RMSNorm of `model` that computes Llama's norm (its class keeps RMSNorm.forward: Gemma's 1 + w, held
    as γ, included; gated or grouped norms, which override forward, not) FastRMSNorm's forward, in a subclass of its
    own class (its declarations unchanged). Returns how many."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if not isinstance(m, RMSNorm) or cls.forward is not RMSNorm.forward:
            continue
        if cls not in _FAST_NORMS:
            _FAST_NORMS[cls] = type(cls.__name__, (FastRMSNorm, cls), {"__doc__": cls.__doc__})
        m.__class__ = _FAST_NORMS[cls]
        both = torch.cat([m.weight.detach(), torch.zeros_like(m.weight)])  # [γ, 0]
        m.register_buffer("gamma_zeros", both, persistent=False)
        m.weight = nn.Parameter(both[: both.numel() // 2], requires_grad=m.weight.requires_grad)  # γ, a view of it
        n += 1
    return n


# ----------------------------------------------------------------------------------------------------------------
# the kernel choice


PROBE_ROWS = 8192  # a taller matrix is timed on this many rows and scaled: GEMV time grows with the rows


def measure_kernels(shapes: list[tuple[int, int]], cold_bytes: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds of one (1, K) x (N, K)^T product on each kernel of KERNELS, for each shape: {"NxK": {kernel: ms}}.

    As in a decode step, where a model's matrices do not fit the CPU's caches, each product reads its weights from
    memory: a kernel is timed over copies of its matrix (random values: the speed does not depend on them) that
    together fill `cold_bytes` (twice the last-level cache), one call on each in turn. A call is timed in the
    process's CPU time over torch's threads (on a quiet machine its wall time; on a busy one the time other
    processes hold the cores is left out, and a wall-clock probe there measured nonsense: 1.1 s for a 262,144-row
    GEMV). A pass's figure is the median of its calls, the result the best of `rounds` passes; the kernels alternate
    within a round."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    out = {}
    for n, k in shapes:
        rows = min(n, PROBE_ROWS)
        rows += -rows % 64  # the CPU packing's tile
        x = torch.randn(1, k, generator=gen).to(COMPUTE)
        # the int4 forms read whole groups of 32 along K: a matrix whose width is no multiple of it (stored unblocked
        # in the file: a tiny model's) is timed on the others only
        runnable = [key for key in KERNELS if k % GROUP == 0 or key not in ("int4", "int4x2")]
        bases = {key: _random_part(key, rows, k, gen) for key in runnable}
        best = dict.fromkeys(runnable, float("inf"))
        for _ in range(rounds):
            for key, base in bases.items():
                copies = [base] + [_copy(base) for _ in range(max(1, min(512, cold_bytes // base.stored_bytes())) - 1)]
                base(x)  # its first call (the kernel's own set-up)
                calls = []
                for m in copies:
                    t = time.process_time()
                    m(x)
                    calls.append(time.process_time() - t)
                best[key] = min(best[key], statistics.median(calls) / threads)
                del copies
        out[shape_key(n, k)] = {key: round(v * 1e3 * n / rows, 4) for key, v in best.items()}
    return out


def _random_part(key: str, n: int, k: int, gen: torch.Generator) -> nn.Module:
    if key == "bf16":
        return DenseMatmul((torch.randn(n, k, generator=gen) * 0.02).to(COMPUTE))
    if key == "int8":
        return Int8Matmul(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                          torch.full((n,), 1e-3, dtype=COMPUTE))
    kk = 2 * k if key == "int4x2" else k
    g = Int4Groups(torch.randint(0, 16, (n, kk), dtype=torch.int32, generator=gen), torch.full((n, kk // GROUP), 1e-2),
                   torch.zeros(n, kk // GROUP), split=key == "int4x2")
    packer = Int4Packer(g.split, torch.device("cpu"), n)
    packer.add(g)
    return packer.finish()


def _copy(part: nn.Module) -> nn.Module:
    """The same kernel on its own copy of the storage (another place in memory)."""
    if isinstance(part, DenseMatmul):
        return DenseMatmul(part.weight.detach().clone())
    if isinstance(part, Int8Matmul):
        return Int8Matmul(part.q.detach().clone(), part.scale.detach())
    return Int4Matmul(part.packed.detach().clone(), part.scales_zeros.detach(), part.out_features, part.split,
                      torch.device("cpu"))


def kernel_counts(model: nn.Module) -> dict[str, int]:
    """How many matrices (parts of one kernel: a fused matrix may have two) run on each kernel, by kernel name."""
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, FastLinear):
            for p in m.parts:
                out[_kernel_name(p)] = out.get(_kernel_name(p), 0) + 1
    return out


def kernel_table(model: nn.Module) -> dict[str, str]:
    """Each matrix's kernel on the fast path, by module name (empty for a model without FastLinear modules)."""
    return {n: m.kernel for n, m in model.named_modules() if isinstance(m, FastLinear)}
