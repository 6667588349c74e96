"""The load options' values that need no model and no torch: dtype and device names, the thread count, the
placement's spelling (device_map, max_memory, offload_dir) and which options combine.

`LoadOptions` (api.py) calls `check_load_values` when it is made, so that a bad value is refused at once, before
`import torch` (seconds) and the load. What only the machine can answer (is there a CUDA device, how many, is
accelerate installed) is checked where the load asks torch (devices.py, placement.py). Errors name the Python keyword
(`BadValue("dtype", ...)`); the CLI names the flag. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Optional, Sequence

from llmtrace.errors import BadValue, FieldError, UsageError

# the dtype names a user may give, and the dtype each means (torch's name; devices.py maps them to torch dtypes)
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}
DEVICE_KINDS = ("cuda", "mps", "cpu")
THREADS_ENV = "LLMTRACE_THREADS"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def check_dtype(dtype: Optional[str]) -> None:
    if dtype is not None and dtype.lower() not in DTYPE_NAMES:
        raise BadValue("dtype", f" {dtype!r} is unknown; choose float32, bfloat16 or float16")


def check_device(device: Optional[str]) -> None:
    """cuda, cuda:N, mps or cpu (any case); whether the machine has it is for devices.pick_device to say."""
    if device is None:
        return
    kind, colon, index = device.lower().partition(":")
    if kind not in DEVICE_KINDS:
        raise BadValue("device", f" {device!r} is unknown; choose cuda, mps or cpu")
    if colon and not index.isdigit():
        raise BadValue("device", f" {device!r} is malformed; write {kind} or {kind}:N (N a device index)")


def thread_setting(threads: Optional[int]) -> Optional[int]:
    """The thread count asked for: `threads`, else $LLMTRACE_THREADS, else None (devices.thread_count: the cores)."""
    if threads is None:
        env = os.environ.get(THREADS_ENV, "").strip()
        if env:
            if not env.isdigit() or int(env) < 1:
                raise UsageError(f"{THREADS_ENV} must be a whole number ≥ 1, not {env!r}")
            return int(env)
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise BadValue("threads", " must be ≥ 1")
    return threads


def parse_size(text: str) -> int:
    """'20GiB', '512MB', '1.5gb' or a plain number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 512MiB, 20GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def max_memory_entry(item: str) -> tuple[object, int]:
    """One max_memory entry, 'DEVICE=SIZE' -> (accelerate's key: 'cpu', 'mps' or a CUDA index, bytes), as written;
    whether the machine has that device is for placement.parse_placement to say."""
    dev, sep, size = item.partition("=")
    if not sep or not dev.strip() or not size.strip():
        raise BadValue("max_memory", f" {item!r}: write DEVICE=SIZE, e.g. cuda:0=20GiB or cpu=32GiB", before="bad ")
    name = dev.strip().lower()
    if name in ("cpu", "mps"):
        key: object = name
    else:
        m = re.fullmatch(r"(?:cuda:?)?(\d*)", name)
        if not m or (name != "cuda" and not m.group(1)):
            raise BadValue("max_memory", "; use cpu, mps, cuda or cuda:N", before=f"unknown device {dev.strip()!r} in ")
        key = int(m.group(1) or 0)
    try:
        return key, parse_size(size)
    except ValueError as e:
        raise BadValue("max_memory", f" {item!r}: {e}", before="bad ") from None


def check_placement(device_map: Optional[str], max_memory: Optional[Sequence[str]], offload_dir) -> None:
    if device_map is None and not max_memory:
        if offload_dir is not None:
            raise BadValue("offload_dir", " applies with device_map auto", also=("device_map",))
        return
    if device_map not in (None, "auto"):
        raise BadValue("device_map", f" {device_map!r}; only 'auto' is supported (accelerate places the layers)",
                       before="unknown ")
    for item in max_memory or ():
        max_memory_entry(item)
    if importlib.util.find_spec("accelerate") is None:  # found without importing it (it imports torch)
        from llmtrace.extras import install_hint

        raise FieldError("device_map", f" needs accelerate: {install_hint('big')} (or pip install accelerate)")


def check_load_values(device: Optional[str], dtype: Optional[str], keep_quantized: bool, device_map: Optional[str],
                      max_memory: Optional[Sequence[str]], offload_dir, threads: Optional[int], fast: bool) -> None:
    """Every load option that can be judged without torch, the machine or the model's files: one BadValue each."""
    check_dtype(dtype)
    check_device(device)
    thread_setting(threads)
    check_placement(device_map, max_memory, offload_dir)
    check_combination(device, dtype, keep_quantized, device_map is not None or bool(max_memory), fast)


def check_combination(device: Optional[str], dtype: Optional[str], keep_quantized: bool, placed: bool,
                      fast: bool) -> None:
    """The load options that do not combine (`placed`: device_map or max_memory given)."""
    if placed and device is not None:
        raise BadValue("device", " and device_map both place the model; give one (with device_map, max_memory "
                       "names the devices)", also=("device_map", "max_memory"))
    if fast:
        check_fast(keep_quantized, placed, dtype, device)
    elif keep_quantized and placed:
        raise BadValue("keep_quantized", " and device_map cannot be combined yet; choose one", also=("device_map",))


def check_fast(keep_quantized: bool, placed: bool, dtype: Optional[str], device: Optional[str]) -> None:
    """fast with the options it does not combine with."""
    if keep_quantized:
        raise BadValue("fast", " and keep_quantized do not combine: fast already runs from the quantized blocks "
                       "(approximately, on int4 kernels); keep_quantized gives the exact values; choose one",
                       also=("fast", "keep_quantized"))
    if placed:
        raise BadValue("fast", " and device_map do not combine yet: fast runs the whole model on one device; "
                       "choose one", also=("fast", "device_map"))
    if dtype is not None and DTYPE_NAMES.get(dtype.lower()) != "bfloat16":
        raise BadValue("fast", f" computes in bfloat16; leave out dtype {dtype}", also=("dtype",))
    if device is not None and device.lower().partition(":")[0] not in ("cpu", "cuda"):
        check_fast_device(device.lower().partition(":")[0])


def check_fast_device(kind: str) -> None:
    """fast runs on the CPU and CUDA (the int4 kernels torch has)."""
    if kind not in ("cpu", "cuda"):
        raise BadValue("fast", f" runs on cpu and cuda, not {kind}; leave out fast or give device cpu",
                       also=("fast", "device"))
