"""The fast path's load (`--fast`): a GGUF file's matrices become model.fast's FastLinear modules on the kernel
their block types map onto, the token embedding stays in its blocks (model.quant's QuantEmbedding), vectors (norms,
biases) are read in bfloat16.

Memory (issue 24: peak RSS within 1.3x the file): each matrix is read, packed and freed in turn, a band of rows at a
time (model.fast.fast_linear), and the heap's freed scratch is handed back after each (return_freed_memory), so the
load's scratch is about one band. On the CPU the embedding's blocks are not copied: they are a read-only view of the
file, mapped (MAP_PRIVATE, never written), so only the pages of the rows looked up become resident, and they are file
pages the kernel can drop and read again. A tied LM head is packed from the file's rows read a band at a time
(FileRows), so a tied embedding is held once, as the head's int4 copy, instead of twice (blocks and int4). The map
holds the file open: a file replaced by a new one (rename) is not seen; one truncated in place while a run uses it
ends the process with SIGBUS, as llama.cpp's mmap would. On CUDA the embedding's blocks are copied to the device."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import sys
from typing import Optional

import torch
import torch.nn as nn

from llmtrace.model.fast import (COMPUTE, DENSE, KERNELS, FastLinear, candidates, fast_experts, fast_linear, kernel_counts,
                                 measure_kernels, shape_key, use_fast_norms)
from llmtrace.model.quant import BLOCKS, QuantEmbedding, Segment
from llmtrace.checkpoint.quantized import is_matrix
from llmtrace.model.transformer import Attention




def load_gguf_fast(path, device: torch.device, choice: Optional[dict] = None):
    """Config, model and tokenizer of a GGUF file for the fast path: matrices on FastLinear, the embedding in its
    blocks, vectors in bfloat16. config.extra["fast"] records the kernel choice and the matrices that run in bf16."""
    from llmtrace.checkpoint.gguf_checkpoint import open_gguf_checkpoint
    from llmtrace.checkpoint.weights import build_model, declared, read_weights
    from llmtrace.errors import FieldError

    where = str(path)
    config, plan, tokenizer, facts = open_gguf_checkpoint(path)
    matrices = {name: parts for name, parts in plan.items() if is_matrix(name, parts)}
    for parts in matrices.values():
        for p in parts:
            if p.kind not in BLOCKS:
                raise FieldError("fast", f" cannot run tensor {p.key} of type {p.kind} (it runs {', '.join(BLOCKS)}); "
                                 f"leave out fast to dequantize the file once", also=("fast",), before=f"{where}: ")
    choice = choice or kernel_choice(device, matrix_shapes(matrices))
    sd = read_weights({n: ps for n, ps in plan.items() if n not in matrices}, COMPUTE, device)
    modules: dict[str, nn.Module] = {}
    tables = {w.param for w in declared(config) if w.weight.kind == "embedding"}  # looked up by row: the token table, a per-layer one
    for name, parts in matrices.items():
        module = name.removesuffix(".weight")
        segments = [Segment(p.kind, p.key) for p in parts]
        if name in tables:
            width = parts[0].shape[1]
            if device.type == "cpu":
                modules[module] = MappedEmbedding(parts[0], segments[0], width, COMPUTE)
            else:
                modules[module] = QuantEmbedding(parts[0].raw().to(device), segments[0], width, COMPUTE)
            if config.tie_embeddings and module == "embed":  # the head multiplies by the embedding's own blocks, on its own kernel
                modules["lm_head"] = fast_linear([FileRows(parts[0])], segments, config.d_model, device,
                                                 choice)
            return_freed_memory()
            continue
        if len(parts[0].shape) == 3:  # a mixture of experts' stack: each expert packed on its own
            modules[module] = fast_experts(parts[0].raw(), segments[0], parts[0].shape, device, choice,
                                           bias=sd.pop(module + ".bias", None))
            return_freed_memory()
            continue
        raws = [p.raw() for p in parts]  # one matrix's blocks at a time, freed once it is packed
        modules[module] = fast_linear(raws, segments, parts[0].shape[1], device, choice,
                                      bias=sd.pop(module + ".bias", None))
        del raws
        return_freed_memory()  # the band scratch just freed, before the next matrix allocates between it
    model = build_model(config, sd, device, COMPUTE, modules)
    use_fast_norms(model)  # RMSNorm in three calls instead of ~30 (model.fast.FastRMSNorm)
    for m in model.modules():  # decode attention as G query rows per KV head (model.transformer.Attention)
        if isinstance(m, Attention):
            m.fold_gqa_decode = True
    dense = [n for n, m in model.named_modules() if isinstance(m, FastLinear) and DENSE in m.kernel]
    counts = kernel_counts(model)
    choice = choice | {"int4": any(k.startswith(("int4", "int8")) for k in counts), "kernels": counts}
    config.extra = facts | {"fast": {"kernel_choice": choice, "bf16_matrices": dense}}
    return config, model, tokenizer


# ----------------------------------------------------------------------------------------------------------------
# the kernel choice: measured per machine, cached

ORDER_VAR = "LLMTRACE_FAST_KERNELS"  # a fixed order of preference instead of the measurement, e.g. "int4,int4x2,bf16"
PROBE_VERSION = 4  # bump when measure_kernels changes what it measures


def matrix_shapes(matrices: dict) -> list[tuple[int, int]]:
    """The (N, K) of each matrix a decode step multiplies by (an expert's for a stack; a tied embedding's as the
    head's), each once, in the plan's order."""
    out: dict[tuple[int, int], None] = {}
    for parts in matrices.values():
        shape = parts[0].shape
        n = shape[1] if len(shape) == 3 else sum(p.shape[0] for p in parts)
        out[(n, shape[-1])] = None
    return list(out)


def kernel_choice(device: torch.device, shapes: list[tuple[int, int]]) -> dict:
    """How each matrix's kernel is chosen: {"by": ..., "ms": {"NxK": {kernel: ms}}} or {"by": ..., "order": [...]}.

    CUDA: the int4 kernel where a type maps onto it, else bf16. $LLMTRACE_FAST_KERNELS: that order of preference.
    Otherwise a probe times every kernel on every shape (model.fast.measure_kernels, about a second for a small
    model), kept under the cache directory in a file named by this CPU (its model and flags), the torch version,
    the capability torch dispatches and the thread count: a later load on the same machine reads it."""
    if device.type == "cuda":
        return {"by": "cuda", "order": ["int4", "int4x2", "bf16"]}
    capability = torch.backends.cpu.get_cpu_capability()
    order = os.environ.get(ORDER_VAR, "").strip()
    if order:
        kernels = [k.strip() for k in order.split(",") if k.strip()]
        if not kernels or any(k not in KERNELS for k in kernels):
            from llmtrace.errors import LlmtraceError

            raise LlmtraceError(f"${ORDER_VAR} is {order!r}: give kernels from {', '.join(KERNELS)}, comma-separated")
        return {"by": f"${ORDER_VAR}", "capability": capability, "order": kernels + ["bf16"]}
    path = probe_file(capability)
    known = _read_probe(path)
    missing = [s for s in shapes if shape_key(*s) not in known]
    if missing:
        if sys.stderr.isatty():  # progress, as a conversion's: the first --fast load on a machine waits for this
            print(f"measuring the fast path's kernels on this CPU, once: {len(missing)} matrix shapes (kept in {path})",
                  file=sys.stderr, flush=True)
        known |= measure_kernels(missing, cold_bytes())
        _write_probe(path, known)
    by = "measured at load" if missing else "measured earlier on this machine"
    return {"by": by, "capability": capability, "threads": torch.get_num_threads(), "cache": str(path),
            "ms": {shape_key(*s): known[shape_key(*s)] for s in shapes}}


def probe_file(capability: str):
    """The probe's cache file for this machine, torch, capability and thread count."""
    from llmtrace.registry.cache import cache_dir

    cpu = ""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith(("model name", "flags")):
                cpu += line
            if line.strip() == "":
                break  # the first processor's lines say it
    except OSError:
        import platform

        cpu = platform.processor() or platform.machine()
    facts = f"{cpu}|{torch.__version__}|{capability}|{torch.get_num_threads()}|{PROBE_VERSION}"
    return cache_dir() / "kernels" / f"{hashlib.sha256(facts.encode()).hexdigest()[:16]}.json"


def cold_bytes() -> int:
    """Twice the last-level cache (what the probe's copies fill so that each product reads from memory): the CPU's
    L3 as Linux reports it, else 32 MiB; at most 256 MiB."""
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
        size = int(text.rstrip("KkMm")) << (20 if text[-1] in "Mm" else 10 if text[-1] in "Kk" else 0)
    except (OSError, ValueError, IndexError):
        size = 32 << 20
    return min(2 * size, 256 << 20)


def _read_probe(path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data["ms"] if isinstance(data.get("ms"), dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_probe(path, ms: dict) -> None:
    """Written whole to a temporary file, then renamed into place; a cache that cannot be written is skipped (the
    next load measures again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"torch": torch.__version__, "ms": ms}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


class MappedEmbedding(QuantEmbedding):
    """QuantEmbedding whose blocks are a read-only view of the GGUF file, mapped (MAP_PRIVATE; nothing writes it):
    the rows looked up are read from the page cache, and only their pages become the process's. The kernel maps up
    to 64 KiB around each page it faults in, so eager lookups hand the map's pages back (MADV_DONTNEED: they are
    read again from the page cache when needed) after every LOOKUP_ROWS rows, a long prompt a chunk at a time.
    Inside the compiled decode step there is no such call: the pages of its one row a step stay until an eager pass
    hands them back (at most the table's size). The values are those of QuantEmbedding on the same bytes."""

    LOOKUP_ROWS = 64

    def __init__(self, entry, segment: Segment, dim: int, compute: torch.dtype):
        if entry.heads is not None:
            raise ValueError(f"{entry.key}: its rows are reordered at load; map only tensors read as stored")
        with open(entry.path, "rb") as f:  # ACCESS_COPY: writable for torch, private, and nothing writes it
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        rows = math.prod(entry.shape[:-1])
        view = torch.frombuffer(self.map, dtype=torch.uint8, count=rows * entry.row_bytes, offset=entry.offset)
        start = entry.offset - entry.offset % mmap.PAGESIZE  # madvise takes whole pages
        self.pages = (start, entry.offset + rows * entry.row_bytes - start)
        super().__init__(view.view(rows, entry.row_bytes), segment, dim, compute)
        self.pending = 0  # rows looked up since the pages were last handed back

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().forward(idx)
        if idx.numel() <= self.LOOKUP_ROWS:
            out = super().forward(idx)
            self.pending += idx.numel()
            if self.pending >= self.LOOKUP_ROWS:
                self.release()
            return out
        flat = idx.reshape(-1)
        out = torch.empty((flat.numel(), self.embedding_dim), dtype=self.compute)
        for i in range(0, flat.numel(), self.LOOKUP_ROWS):
            out[i : i + self.LOOKUP_ROWS] = super().forward(flat[i : i + self.LOOKUP_ROWS])
            self.release()
        return out.view(*idx.shape, self.embedding_dim)

    def release(self) -> None:
        """Hand the map's resident pages back (a no-op where madvise is missing)."""
        self.pending = 0
        if hasattr(self.map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, *self.pages)


class FileRows:
    """A tensor's blocks (rows in file order), read from the file a slice of rows at a time (read(), no map: the pages
    read are the page cache's, not the process's): what model.fast.fast_linear packs the tied head from."""

    def __init__(self, entry):
        if entry.heads is not None:
            raise ValueError(f"{entry.key}: its rows are reordered at load; read it whole")
        self.entry, self.rows = entry, math.prod(entry.shape[:-1])

    def size(self, dim: int) -> int:
        return (self.rows, self.entry.row_bytes)[dim]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        from llmtrace.checkpoint.weights import read_bytes

        start, stop, _ = rows.indices(self.rows)
        out = torch.empty((max(stop - start, 0), self.entry.row_bytes), dtype=torch.uint8)
        read_bytes(self.entry.path, self.entry.offset + start * self.entry.row_bytes, out)
        return out


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Packing allocates
    each matrix between the scratch of the one before, and without this the freed scratch stays resident: measured
    18 MiB of the default model's load (benchmarks/RESULTS.md)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


def bf16_note(lm) -> Optional[str]:
    """One line naming the matrices that run in bfloat16 on the fast path, whole or in part, and why: their type has
    no quantized kernel (a float or MXFP4 matrix), or bfloat16 was measured the fastest of their kernels. None when
    none does, or when every matrix does (the header says that)."""
    fast = lm.config.extra.get("fast")
    if not fast or not fast["bf16_matrices"] or set(fast["kernel_choice"].get("kernels", {DENSE: 1})) == {DENSE}:
        return None
    model, names = lm.model, fast["bf16_matrices"]
    kinds = sorted({s.kind for n in names for s in model.get_submodule(n).segments
                    if candidates(s.kind, lm.device) == ("bf16",)})
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    why = (" and ".join(kinds) + (" have" if len(kinds) > 1 else " has") + " no int4 or int8 form" if kinds
           else "bfloat16 was measured the fastest of their kernels here")
    return (f"`fast=True`: {len(names)} matri{'x' if len(names) == 1 else 'ces'} ({shown}) run in bfloat16, whole or in "
            f"part: {why}")
