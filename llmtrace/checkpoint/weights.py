"""Checkpoint tensors read one by one into the tensors that hold them (no second copy of the weights), and the
layout that turns renamed tensors into a Transformer (q/k/v and gate/up fused, shapes checked)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn

from llmtrace.errors import LlmtraceError, one_line
from llmtrace.model.family import build as build_family, family_named
from llmtrace.model.points import DeclaredWeight
from llmtrace.model.transformer import ModelConfig, Transformer

# ----------------------------------------------------------------------------------------------------------------
# tensor by tensor: a checkpoint tensor is an entry that knows its shape and reads itself into a tensor it is given,
# so a load never holds a second copy of the weights. Files are read with readinto, not memory-mapped: the pages of
# a mapping count towards the process's resident memory for as long as it stays mapped.

CHUNK_BYTES = 16 << 20  # a conversion (bfloat16 -> float32, dequantization) handles at most this much at a time
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_bytes(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` at [offset, offset + out.nbytes)."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    done = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < len(view):  # one read() returns at most ~2 GiB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise LlmtraceError(f"{path}: the file ends inside a tensor; it is truncated: download it again")
            done += n


class FileTensor(NamedTuple):
    """One tensor of a safetensors file, not yet read."""

    path: Path
    key: str
    dtype: Optional[torch.dtype]  # None: a dtype llmtrace does not load (named in the error if it is needed)
    dtype_name: str
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file

    def read_into(self, out: torch.Tensor) -> None:
        """Write the tensor's values into `out` (same shape, any float dtype, any device), converting a chunk at a time."""
        if self.dtype is None:
            raise LlmtraceError(f"{self.path}: tensor {self.key} has dtype {self.dtype_name}, which llmtrace does not load")
        if out.dtype == self.dtype and out.device.type == "cpu":
            read_bytes(self.path, self.offset, out)  # straight into place: no copy at all
            return
        flat, size = out.view(-1), self.dtype.itemsize
        step = max(1, CHUNK_BYTES // size)
        buf = torch.empty(min(step, flat.numel()), dtype=self.dtype)
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            read_bytes(self.path, self.offset + i * size, buf[:n])
            flat[i : i + n].copy_(buf[:n])


def safetensors_entries(f: Path) -> dict[str, FileTensor]:
    """The tensor directory of one safetensors file: an 8-byte header length, a JSON header, then the data."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("the file ends inside the header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError("the file ends inside the header")
            header = json.loads(fh.read(n))
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            shape = tuple(int(x) for x in info["shape"])
            dtype = ST_DTYPES.get(info["dtype"])
            if 8 + n + end > size:
                raise ValueError(f"tensor {key} ends past the end of the file")
            if dtype is not None and end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {key} has {end - start} bytes for shape {list(shape)}")
            out[key] = FileTensor(f, key, dtype, info["dtype"], shape, 8 + n + start)
        return out
    except (ValueError, KeyError, TypeError, OSError, struct.error) as e:
        raise LlmtraceError(f"{f}: cannot read safetensors file ({one_line(e)}); it may be truncated or corrupt: "
                            f"download it again") from None


def read_weights(plan: dict[str, list], dtype: torch.dtype, device: torch.device, progress=None) -> dict[str, torch.Tensor]:
    """Each of the model's tensors, allocated once in the run dtype on its device and filled part by part."""
    out: dict[str, torch.Tensor] = {}
    for n, (name, parts) in enumerate(plan.items()):
        t = torch.empty(_Stacked(parts).shape, dtype=dtype, device=device)
        r = 0
        for part in parts:
            part.read_into(t[r : r + part.shape[0]])
            r += part.shape[0]
        out[name] = t
        if progress is not None:
            progress(n + 1, len(plan))
    return out


def write_safetensors(plan: dict[str, list], path: Path, progress=None) -> None:
    """Write the planned tensors as one float32 safetensors file, a part at a time (the header first: every shape
    is known before anything is read)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, parts in plan.items():
        shape = _Stacked(parts).shape
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for n, parts in enumerate(plan.values()):
            for part in parts:
                t = torch.empty(part.shape, dtype=torch.float32)
                part.read_into(t)
                f.write(memoryview(t.view(-1).numpy()))
                del t
            if progress is not None:
                progress(n + 1, len(plan))


# ----------------------------------------------------------------------------------------------------------------
# from renamed tensors to a model


def declared(config: ModelConfig) -> list[DeclaredWeight]:
    """The weights the model of this config declares (model.transformer's `weights()`), from a skeleton on the meta
    device: shapes only, nothing allocated."""
    with torch.device("meta"), _skip_weight_init():  # (random initialisation would import torch's compiler)
        return build_family(config).declared_weights()


def plan_weights(entries: dict[str, Any], config: ModelConfig, fmt: str, where: str) -> dict[str, list[Any]]:
    """Which checkpoint tensors make each of the model's parameters, as the model declares them: {parameter: its
    parts, stacked along the first axis} (q, k and v into wqkv). `entries` maps the file's own keys to objects with a
    `.shape` (fmt "hf": safetensors entries; "gguf": GGUF entries, whose q/k rows are put back in HF order where the
    arch was converted with llama.cpp's permutation). Every declared tensor must be there with the shape the config
    implies, and nothing else, before anything is read."""
    sd = dict(entries)
    permuted = fmt == "gguf" and family_named(config.family).gguf_archs.get(config.arch, False)
    out: dict[str, list[Any]] = {}
    taken: dict[str, Any] = {}  # tensors already planned: two sources may read one (gpt-oss's interleaved gate/up)
    for w in declared(config):
        parts = []
        for src in w.sources:
            key = src.hf if fmt == "hf" else src.gguf
            if key is not None and "{e}" in key:  # one tensor per expert (an HF directory's), stacked into E
                parts.append(ExpertStack.of(sd, key, w, src, where))
                continue
            if fmt == "hf" and key is not None and key not in sd and key not in taken:
                MXFP4Entry.take(sd, key, where)  # an HF MXFP4 tensor: its _blocks and _scales, read as the tensor
            if key is None or (key not in sd and key not in taken):
                raise LlmtraceError(f"{where}: tensor {key or src.math} ({_what(w.param, src.math)}) is missing from "
                                    f"the checkpoint; download it again")
            part = taken[key] = sd.pop(key) if key in sd else taken[key]
            if fmt == "hf" and src.hf_transform:
                part = Transformed(part, src.hf_transform)
            if fmt == "gguf" and len(w.shape) == 1 and len(part.shape) > 1 and math.prod(part.shape) == w.shape[0]:
                part = AsVector(part)  # a vector llama.cpp's converter stores reshaped (Mamba2's A, D, grouped norm)
            check_shape(where, key, part, (src.rows, *w.shape[1:]))
            if permuted and src.permuted_heads:
                part = part._replace(heads=src.permuted_heads)
            if fmt == "hf" and src.hf_add:
                part = Offset(part, src.hf_add)
            parts.append(part)
        out[w.param] = parts
    if sd:
        raise LlmtraceError(f"{where}: unexpected tensor {next(iter(sd))} ({_why_unexpected(next(iter(sd)), config)}); "
                            f"the config and the weights do not belong together")
    return out


def _why_unexpected(key: str, config: ModelConfig) -> str:
    """Why a file's tensor has no parameter: a layer past the config's count, or nothing of this model reads it."""
    m = re.search(r"(?:^|\.)(?:layers|blk)\.(\d+)\.", key)
    if m and int(m.group(1)) >= config.n_layers:
        return f"layer {m.group(1)}, but the config says {config.n_layers} layer{'s' * (config.n_layers != 1)}"
    return f"no weight of a {config.family} model with this config is read from it"


def tied_head(entries: dict[str, Any], config: ModelConfig, where: str) -> tuple[ModelConfig, Optional[str]]:
    """A config that ties the LM head to the embedding (tie_word_embeddings) in an HF directory that stores the head
    as well, as many do: equal tensors are one matrix, the stored copy left out of `entries` and nothing said. A
    head that differs is kept as the head, untied, as transformers (5.x) loads it: the config returned unties it, and
    the note (one line) says so. Other configs and directories come back as they are, with no note."""
    if not config.tie_embeddings:
        return config, None
    untied = dataclasses.replace(config, tie_embeddings=False)
    keys = {w.param: w.sources[0].hf for w in declared(untied) if w.param in ("embed.weight", "lm_head.weight")}
    head, embed = entries.get(keys["lm_head.weight"]), entries.get(keys["embed.weight"])
    if head is None or embed is None:
        return config, None
    if same_values(head, embed):
        del entries[keys["lm_head.weight"]]
        return config, None
    return untied, (f"note: {where}: config.json ties the LM head to the embedding (tie_word_embeddings), but the "
                    f"checkpoint's {head.key} differs from {embed.key}; the stored head is used, as transformers does")


def same_values(a: FileTensor, b: FileTensor) -> bool:
    """Whether two safetensors tensors hold the same values (same shape, every element equal), read a band of rows
    at a time."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype is None or b.dtype is None or not a.shape:
        return False
    per_row = math.prod(a.shape[1:])
    step = max(1, CHUNK_BYTES // max(1, per_row * max(a.dtype.itemsize, b.dtype.itemsize)))
    common = a.dtype if a.dtype == b.dtype else torch.float64
    for r in range(0, a.shape[0], step):
        n = min(step, a.shape[0] - r)
        band = []
        for t in (a, b):
            x = torch.empty((n, per_row), dtype=t.dtype)
            read_bytes(t.path, t.offset + r * per_row * t.dtype.itemsize, x)
            band.append(x.to(common))
        if not torch.equal(*band):
            return False
    return True


def _what(param: str, math_name: str) -> str:
    """'layer 1's W_up' for layers.1.ffn.w_gate_up.weight, W_up; 'norm.weight' outside the layers."""
    head, _, rest = param.partition(".")
    if head == "layers":
        return f"layer {rest.partition('.')[0]}'s {math_name or rest.partition('.')[2]}"
    return f"{param}, {math_name}" if math_name else param


class AsVector(NamedTuple):
    """A GGUF tensor holding a vector in another shape ((H, 1), (G, I/G)): read as the vector, values in order."""

    entry: Any

    @property
    def shape(self):
        return (math.prod(self.entry.shape),)

    @property
    def key(self):
        return self.entry.key

    def read_into(self, out: torch.Tensor) -> None:
        self.entry.read_into(out.view(self.entry.shape))


class Offset(NamedTuple):
    """A checkpoint tensor read with a constant added: an HF Gemma norm stores w and multiplies by 1 + w."""

    entry: Any
    add: float

    @property
    def shape(self):
        return self.entry.shape

    @property
    def key(self):
        return self.entry.key

    def read_into(self, out: torch.Tensor) -> None:
        self.entry.read_into(out)
        out.add_(self.add)


def _even(t: torch.Tensor) -> torch.Tensor:
    return t[:, 0::2]


def _odd(t: torch.Tensor) -> torch.Tensor:
    return t[:, 1::2]


def _head_rows(t: torch.Tensor, n: int, a: int, b: int) -> torch.Tensor:
    """(n·w, in) -> (n, b − a, in): rows [a, b) of each of n heads' blocks of w rows."""
    return t.view(n, t.size(0) // n, *t.shape[1:])[:, a:b]


# The load transforms a weight's Source may name (model.points.TRANSFORMS says what each does): each takes the
# tensor as read and returns a view of it in the model's layout. A name may carry whole-number arguments after
# colons ("head_rows:16:0:128"), the sizes the declaring module knows.
TRANSFORMS = {"transpose": lambda t: t.transpose(-1, -2), "even": _even, "odd": _odd,
              "squeeze1": lambda t: t.squeeze(1), "neg_exp": lambda t: -t.exp(), "head_rows": _head_rows,
              "gate_half": lambda t: t.narrow(-2, 0, t.size(-2) // 2),
              "up_half": lambda t: t.narrow(-2, t.size(-2) // 2, t.size(-2) // 2)}


class Transformed(NamedTuple):
    """A checkpoint tensor read through named load transforms (Source.hf_transform): read whole in float32, changed in
    layout (a view), then copied into its place."""

    entry: Any
    transforms: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._apply(torch.empty(self.entry.shape, device="meta")).shape)

    @property
    def key(self):
        return self.entry.key

    def _apply(self, t: torch.Tensor) -> torch.Tensor:
        for spec in self.transforms:
            name, *args = spec.split(":")
            t = TRANSFORMS[name](t, *map(int, args))
        return t

    def read_into(self, out: torch.Tensor) -> None:
        whole = torch.empty(self.entry.shape, dtype=torch.float32)
        self.entry.read_into(whole)
        out.copy_(self._apply(whole))


# transformers' MXFP4 (gpt-oss): a parameter P (E, in, out) is stored as P_blocks (E, out, in/32, 16) uint8, two
# 4-bit e2m1 codes a byte (low nibble first), and P_scales (E, out, in/32) uint8, an e8m0 exponent biased by 127 for
# each block of 32; P = (code's value · 2^(scale − 127)), transposed back to (E, in, out).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF MXFP4 blocks (..., G, 16) uint8 and scales (..., G) uint8 -> float32 (..., G·32): each byte's low nibble,
    then its high one, times 2^(scale − 127)."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # (..., G, 32)
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2)  # (..., G·32)


class MXFP4Entry(NamedTuple):
    """An HF MXFP4 parameter (its _blocks and _scales FileTensors), read as the float tensor it stands for."""

    key: str
    blocks: Any
    scales: Any

    @classmethod
    def take(cls, sd: dict, key: str, where: str) -> None:
        """Put KEY in sd as an MXFP4Entry when the directory holds KEY_blocks and KEY_scales (else leave sd as is)."""
        b, s = sd.get(key + "_blocks"), sd.get(key + "_scales")
        if b is None or s is None:
            return
        if b.dtype_name != "U8" or s.dtype_name != "U8" or tuple(b.shape[:-1]) != tuple(s.shape) or b.shape[-1] != 16 \
                or len(b.shape) != 4:
            raise LlmtraceError(f"{where}: tensors {key}_blocks {list(b.shape)} and {key}_scales {list(s.shape)} are "
                                f"not MXFP4 blocks (uint8, (E, out, in/32, 16) and (E, out, in/32))")
        sd[key] = cls(key, sd.pop(key + "_blocks"), sd.pop(key + "_scales"))

    @property
    def shape(self) -> tuple[int, ...]:
        E, out, groups, _ = self.blocks.shape
        return (E, groups * 32, out)

    @staticmethod
    def raw(entry) -> torch.Tensor:
        t = torch.empty(entry.shape, dtype=torch.uint8)
        read_bytes(entry.path, entry.offset, t)
        return t

    def read_into(self, out: torch.Tensor) -> None:
        blocks, scales = self.raw(self.blocks), self.raw(self.scales)  # 17 bytes for 32 weights
        for e in range(blocks.shape[0]):  # dequantized an expert at a time
            out[e].copy_(mxfp4_dequantize(blocks[e], scales[e]).transpose(0, 1))


class ExpertStack(NamedTuple):
    """E checkpoint tensors of one shape, one per expert, read as the (E, ...) stack a Weight of kind "experts" is."""

    parts: list

    @classmethod
    def of(cls, sd: dict, template: str, w: DeclaredWeight, src, where: str) -> "ExpertStack":
        """Take expert 0..E-1's tensors (`template` with {e}) out of `sd`, each checked against one expert's shape."""
        parts = []
        for e in range(src.rows):
            key = template.format(e=e)
            if key not in sd:
                raise LlmtraceError(f"{where}: tensor {key} ({_what(w.param, src.math)} of expert {e}) is missing "
                                    f"from the checkpoint; download it again")
            parts.append(sd.pop(key))
            check_shape(where, key, parts[-1], w.shape[1:])
        return cls(parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def key(self) -> str:
        return self.parts[0].key

    def read_into(self, out: torch.Tensor) -> None:
        for e, part in enumerate(self.parts):
            part.read_into(out[e])


class _Stacked(NamedTuple):
    """The shape of parts stacked by rows."""

    parts: list

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter the checkpoint provides and its shape (a tied head is the embedding)."""
    return {w.param: w.shape for w in declared(c)}


def check_shape(where, key, t, shape):
    if tuple(t.shape) != tuple(shape):
        raise LlmtraceError(f"{where}: tensor {key} has shape {list(t.shape)} but the config implies {list(shape)}; the "
                        f"config and the weights do not belong together")


@contextlib.contextmanager
def _skip_weight_init():
    """Construct modules with uninitialised (never touched, so never paged in) parameters: they are replaced at once.

    Random initialisation of 135M parameters would cost seconds; the meta device would cost a slow first import."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(config: ModelConfig, sd: dict[str, torch.Tensor], device: Optional[torch.device], dtype: torch.dtype,
                modules: Optional[dict[str, nn.Module]] = None) -> Transformer:
    """Create the model without initialising random weights, then adopt the given tensors. `modules` replace the
    model's own by name first (--keep-quantized: llmtrace.model.quant's modules for the matrices); `sd` holds the rest.
    device None: leave every tensor where it is (llmtrace.placement)."""
    modules = modules or {}
    with _skip_weight_init():
        model = build_family(config)
    for name, m in modules.items():
        model.set_submodule(name, m)
    sd = {k: v.to(dtype=dtype) for k, v in sd.items()}  # read_weights put each on its device already
    tied = config.tie_embeddings and "lm_head" not in modules
    if tied:
        sd["lm_head.weight"] = sd["embed.weight"]
    missing, unexpected = model.load_state_dict(sd, assign=True, strict=not modules)
    if any(not k.startswith(tuple(n + "." for n in modules)) for k in [*missing, *unexpected]):
        raise RuntimeError(f"weights left unset: {missing + unexpected}")  # a bug, not bad input
    if tied:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval().requires_grad_(False)  # .to: the RoPE frequencies, the one buffer
