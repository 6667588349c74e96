"""Where a model runs: the device (cuda, mps or cpu), the dtype, and how many CPU threads torch uses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from llmtrace.checkpoint.choices import DTYPE_NAMES, check_device, check_dtype, thread_setting
from llmtrace.errors import FieldError

DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}


def pick_device(requested: Optional[str] = None) -> torch.device:
    """CUDA if available, else MPS, else CPU; `requested` overrides and is checked."""
    if requested is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    check_device(requested)  # the spelling (LoadOptions checked it already; a direct caller may not have)
    name = requested.lower()
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise FieldError("device", " cuda was asked for, but this machine has no CUDA (or torch is a CPU build); "
                         "use device cpu", also=("device",))
    if kind == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise FieldError("device", " mps was asked for, but MPS is not available here; use device cpu",
                         also=("device",))
    return torch.device(name)


def pick_dtype(requested: Optional[str], device: torch.device) -> torch.dtype:
    if requested is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    check_dtype(requested)
    return DTYPES[requested.lower()]


def physical_cores() -> int:
    """The physical cores this process may run on: hyperthread siblings count once, as they share one core's FPUs.

    Linux: the (package, core) ids in /sys of the CPUs in our affinity set, else /proc/cpuinfo; elsewhere psutil when
    it is installed; else every logical CPU.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = set()
    for cpu in allowed or ():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.clear()
            break
    if not cores and allowed:
        try:
            cores = cpuinfo_cores(Path("/proc/cpuinfo").read_text(), set(allowed))
        except OSError:
            pass
    if cores:
        return len(cores)
    logical = len(allowed) if allowed else os.cpu_count() or 1
    try:
        import psutil

        n = psutil.cpu_count(logical=False)  # the whole machine's cores, so capped by the CPUs we may use
    except ImportError:
        n = None
    return min(n, logical) if n else logical


def cpuinfo_cores(text: str, allowed: set[int]) -> set[tuple[str, str]]:
    """(physical id, core id) of each allowed CPU in the text of /proc/cpuinfo; empty when it does not say."""
    cores = set()
    for block in text.split("\n\n"):
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
        if fields.get("processor", "").isdigit() and "core id" in fields and int(fields["processor"]) in allowed:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return cores


def thread_count(n: Optional[int] = None) -> int:
    """The CPU threads to use: `n` (threads=), else $LLMTRACE_THREADS, else the physical cores."""
    n = thread_setting(n)
    return n if n is not None else physical_cores()


def set_threads(n: Optional[int] = None) -> int:
    """Pin torch's CPU threads to thread_count(n) and return that number.

    Physical cores, not logical CPUs, by default: two threads on one core's hyperthreads, or more threads than the
    cores left free by a busy machine, make every matrix product wait for the slowest thread.
    """
    n = thread_count(n)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
