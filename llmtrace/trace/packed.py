"""The packed numbers of a trace: a `--trace full` sample's values, as little-endian float32 in base64.

A full trace samples ~31,000 floats a decode step on SmolLM2 (the first entries of each half of every row of every
point, and each row's norm: what the report's walk-through reads). Written as decimal JSON numbers they cost more
than the step's whole model time to format; packed they cost a copy. float32 holds every value of a float32,
bfloat16 or float16 run exactly (the decimal form kept 7 digits), and -inf (a masked score) as itself. A trace written
before the packing holds lists of numbers (null for a non-finite one): `unpack` reads both. Torch-free.
"""

from __future__ import annotations

import binascii
from typing import Any

import numpy as np


def pack(values: Any) -> str:
    """Numbers (an array, or nested lists with None for a non-finite value) as little-endian float32, base64."""
    a = values if isinstance(values, np.ndarray) else unpack(values)
    return pack_bytes(np.ascontiguousarray(a, dtype="<f4").tobytes())


def pack_bytes(data) -> str:
    """Bytes that already are little-endian float32 (a slice of a pass's samples), as base64."""
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def unpack(value: Any, width: int = 0) -> np.ndarray:
    """A packed string (pack) or a list of numbers / rows of numbers (a trace written before the packing: None for a
    non-finite value) as a float64 array; with `width`, as rows of that many entries."""
    if isinstance(value, str):
        a = np.frombuffer(binascii.a2b_base64(value), dtype="<f4").astype(np.float64)
    else:
        flat = _flatten(value)
        a = np.array([np.nan if v is None else v for v in flat], dtype=np.float64)
    return a.reshape(-1, width) if width else a


def _flatten(value: Any) -> list:
    out: list = []
    for v in value:
        if isinstance(v, list):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out

