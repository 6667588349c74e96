"""Where the weights go: what fits in memory before loading, and layers spread over devices and disk by accelerate.

Before a single weight is read, `choose_dtype` compares the bytes the weights need with the memory available: on the
CPU, float32 weights taking more than 70% of it are loaded in bfloat16 instead (said in one line on stderr), and
weights that fit in no dtype are refused with the numbers and the options.

`--device-map auto` hands placement to accelerate's big-model inference (infer_auto_device_map, dispatch_model, disk
offload) on llmtrace's own Transformer; llmtrace only reads each tensor into the place accelerate chose.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from llmtrace.errors import LlmtraceError, UsageError

BASELINE_BYTES = 300 << 20  # Python, torch and the tokenizer, before any weight
FP32_SHARE = 0.70  # float32 weights may take this share of available memory before bfloat16 is chosen instead
AVAILABLE_ENV = "LLMTRACE_AVAILABLE_MEMORY"  # for tests and what-ifs: pretend this much memory is available


# ----------------------------------------------------------------------------------------------------------------
# sizes


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """'20GiB', '512MB', '1.5gb' or a plain number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 512MiB, 20GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def available_memory() -> int:
    """Bytes this process may still use: $LLMTRACE_AVAILABLE_MEMORY if set (tests), else the smaller of the kernel's
    MemAvailable and what the cgroup limit leaves."""
    env = os.environ.get(AVAILABLE_ENV)
    if env:
        try:
            return parse_size(env)
        except ValueError as e:
            raise UsageError(f"${AVAILABLE_ENV}: {e}") from None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else 1 << 62


def weight_count(config) -> int:
    """Weights the model holds (a tied embedding once), from the config alone."""
    from llmtrace.loader import expected_shapes

    return sum(math.prod(s) for s in expected_shapes(config).values())


# ----------------------------------------------------------------------------------------------------------------
# what fits


def _options() -> str:
    return ("options: --dtype bfloat16 (2 bytes a weight), --keep-quantized (a GGUF file stays at its size), "
            "--device-map auto --max-memory cpu=SIZE (layers that do not fit go to disk)")


def check_fits(name: str, need: int, what: str, device: torch.device) -> None:
    """Refuse, before loading, weights that cannot fit in the CPU's available memory."""
    if device.type != "cpu":
        return
    have = available_memory()
    if need + BASELINE_BYTES > have:
        raise LlmtraceError(f"{name} needs {human(need)} for {what} (+ {human(BASELINE_BYTES)} for Python and torch) "
                            f"but {human(have)} is available; {_options()}")


def choose_dtype(requested: Optional[str], device: torch.device, name: str, n_weights: int,
                 placement: Optional["Placement"] = None) -> torch.dtype:
    """The run dtype: as asked, else the device's default, except that on the CPU float32 weights that would take more
    than 70% of available memory give way to bfloat16 (said on stderr). Weights that fit in no dtype are refused."""
    from llmtrace.loader import pick_dtype

    dtype = pick_dtype(requested, device)
    if placement is not None:  # accelerate places what does not fit
        return dtype
    if requested is None and device.type == "cpu" and dtype == torch.float32:
        have = available_memory()
        if 4 * n_weights + BASELINE_BYTES > FP32_SHARE * have:
            dtype = torch.bfloat16
            print(f"note: float32 weights would take {human(4 * n_weights)} of {human(have)} available; loading "
                  f"in bfloat16 ({human(2 * n_weights)}) instead (--dtype float32 overrides)", file=sys.stderr)
    check_fits(name, n_weights * dtype.itemsize, f"its weights in {str(dtype).replace('torch.', '')}", device)
    return dtype


# ----------------------------------------------------------------------------------------------------------------
# placement over devices and disk (accelerate)


@dataclass
class Placement:
    """--device-map auto: the memory each device may hold, and where layers that fit nowhere are written."""

    max_memory: dict = field(default_factory=dict)  # accelerate's keys: GPU index, "mps", "cpu"
    offload_dir: Optional[Path] = None
    main_device: torch.device = torch.device("cpu")
