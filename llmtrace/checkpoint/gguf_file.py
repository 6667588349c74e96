"""A GGUF file's metadata and tensor directory, read with `struct` from one memory map (no torch)."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

from llmtrace.errors import LlmtraceError, one_line


class GGUFField(NamedTuple):
    """One metadata value; `contents()` as in the gguf package's reader (tokenizer.from_gguf reads either)."""

    value: Any

    def contents(self) -> Any:
        return self.value


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: "GGMLQuantizationType"  # noqa: F821
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data: Any  # numpy view of the file's bytes: typed for float types, (rows..., bytes per row) uint8 for quantized
    file_offset: int = 0  # where its bytes start in the file
    nbytes: int = 0


class GGUFFile:
    """The metadata and tensor directory of a GGUF file, read with `struct` from one memory map.

    The layout (little-endian): magic "GGUF", version (u32), tensor count (u64), metadata count (u64); then each
    metadata entry as key (u64 length + UTF-8), value type (u32), value; then each tensor as name, n_dims (u32),
    dims (u64 each, innermost first), type (u32), offset (u64); then, aligned to `general.alignment`, the data.
    The gguf package's own reader builds numpy views of every metadata element, which takes seconds for a
    50,000-entry vocabulary; this reads the same values directly. Dequantization stays with the gguf package.
    """

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: Path):
        import mmap

        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = Path(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, self._pos = self._map, 0
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian or unknown; versions 2 and 3 are read)")
        self._pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = GGUFField(self._value(self._u32()))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        align = int(self.fields.get("general.alignment", GGUFField(32)).value)
        data_start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            n = math.prod(dims)
            block, type_size = GGML_QUANT_SIZES[kind]
            np_shape = tuple(reversed(dims))
            float_types = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
            if kind.name in float_types:
                dtype, count = float_types[kind.name], n
            else:
                dtype, count, np_shape = "<u1", n * type_size // block, quant_shape_to_byte_shape(np_shape, kind)
            start = data_start + offset
            if start + n * type_size // block > len(buf):
                raise ValueError(f"tensor {name} ends past the end of the file")
            data = np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(np_shape)
            self.tensors.append(GGUFTensor(name, kind, dims, data, start, n * type_size // block))

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._map, self._pos)
        self._pos += 4
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start, self._pos = self._pos + 8, self._pos + 8 + n
        if self._pos > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return str(self._map[start : self._pos], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == self._STRING:
            return self._string()
        if kind == self._ARRAY:
            item, count = struct.unpack_from("<IQ", self._map, self._pos)
            self._pos += 12
            if item == self._STRING:
                return [self._string() for _ in range(count)]
            if item in self._NUMPY:  # numbers: one numpy read for the whole array
                import numpy as np

                arr = np.frombuffer(self._map, dtype=self._NUMPY[item], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        fmt = self._SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:  # struct.error, ValueError, KeyError, IndexError, ... on bad files
        raise LlmtraceError(f"{path}: not a readable GGUF file ({one_line(e)}); it may be truncated or corrupt: "
                            f"download it again") from None
