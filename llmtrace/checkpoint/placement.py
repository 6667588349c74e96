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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from llmtrace.checkpoint.choices import max_memory_entry, parse_size
from llmtrace.errors import BadValue, FieldError, UsageError
from llmtrace.units import human_bytes, plural
from llmtrace.words import say

BASELINE_BYTES = 300 << 20  # Python, torch and the tokenizer, before any weight
FP32_SHARE = 0.70  # float32 weights may take this share of available memory before bfloat16 is chosen instead
AVAILABLE_ENV = "LLMTRACE_AVAILABLE_MEMORY"  # for tests and what-ifs: pretend this much memory is available


# ----------------------------------------------------------------------------------------------------------------
# sizes


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
    from llmtrace.checkpoint.weights import expected_shapes

    return sum(math.prod(s) for s in expected_shapes(config).values())


# ----------------------------------------------------------------------------------------------------------------
# what fits


def check_fits(name: str, need: int, what: str, device: torch.device) -> None:
    """Refuse, before loading, weights that cannot fit in the CPU's available memory."""
    if device.type != "cpu":
        return
    have = available_memory()
    if need + BASELINE_BYTES > have:
        raise FieldError("dtype", " bfloat16 (2 bytes a weight), keep_quantized (a GGUF file stays at its size), "
                         "device_map auto with max_memory cpu=SIZE (layers that do not fit go to disk)",
                         also=("keep_quantized", "device_map", "max_memory"),
                         before=f"{name} needs {human_bytes(need)} for {what} (+ {human_bytes(BASELINE_BYTES)} for "
                                f"Python and torch) but {human_bytes(have)} is available; options: ")


def choose_dtype(requested: Optional[str], device: torch.device, name: str, n_weights: int,
                 placement: Optional["Placement"] = None) -> torch.dtype:
    """The run dtype: as asked, else the device's default, except that on the CPU float32 weights that would take more
    than 70% of available memory give way to bfloat16 (said on stderr). Weights that fit in no dtype are refused."""
    from llmtrace.checkpoint.devices import pick_dtype

    dtype = pick_dtype(requested, device)
    if placement is not None:  # accelerate places what does not fit
        return dtype
    note = None
    if requested is None and device.type == "cpu" and dtype == torch.float32:
        have = available_memory()
        if 4 * n_weights + BASELINE_BYTES > FP32_SHARE * have:
            dtype = torch.bfloat16
            note = (f"float32 weights would take {human_bytes(4 * n_weights)} of {human_bytes(have)} available; "
                    f"loading in bfloat16 ({human_bytes(2 * n_weights)}) instead (`dtype='float32'` overrides)")
    check_fits(name, n_weights * dtype.itemsize, f"its weights in {str(dtype).replace('torch.', '')}", device)
    if note:
        say(note)
    return dtype


# ----------------------------------------------------------------------------------------------------------------
# placement over devices and disk (accelerate)


@dataclass
class Placement:
    """--device-map auto: the memory each device may hold, and where layers that fit nowhere are written."""

    max_memory: dict = field(default_factory=dict)  # accelerate's keys: GPU index, "mps", "cpu"
    offload_dir: Optional[Path] = None
    main_device: torch.device = torch.device("cpu")

    def load(self, config, plan: dict[str, list], dtype: torch.dtype):
        """The model with each tensor read straight to where accelerate's device map puts its module: a device, or
        the offload folder (disk). Then accelerate's hooks move inputs and offloaded weights at each call."""
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import offload_weight, save_offload_index

        from llmtrace.checkpoint.weights import build_model, read_weights
        from llmtrace.model.family import build as build_family

        with torch.device("meta"):  # shapes only, to size the layers
            skeleton = build_family(config).to(dtype)
        dmap = infer_auto_device_map(skeleton, max_memory=self.max_memory, no_split_module_classes=["Block"], dtype=dtype)
        main = _accelerate_name(self.main_device)
        # the embedding, the final norm and the head stay on the main device: the KV cache, the RoPE table and the
        # logits live there (and a tied head is the embedding)
        if "" in dmap:
            dmap = {name: dmap[""] for name, _ in skeleton.named_children()}
        for top in ("embed", "norm", "lm_head"):
            if _device_of(dmap, top) == "disk":
                dmap[top] = main
        self.device_map = dmap
        folder = self.offload_dir
        sd, index = {}, {}
        for name, parts in plan.items():
            where = _device_of(dmap, name)
            t = read_weights({name: parts}, dtype, torch.device("cpu" if where == "disk" else _torch_device(where)))[name]
            if where == "disk":
                offload_weight(t, name, str(folder), index=index)
                t = torch.empty(t.shape, dtype=dtype, device="meta")
            sd[name] = t
        if index:
            save_offload_index(index, str(folder))
        model = build_model(config, sd, None, dtype)  # None: every tensor stays where it was read to (meta: on disk)
        for name, buf in list(model.named_buffers(recurse=False)):  # the model's own (RoPE), on the main device
            setattr(model, name, buf.to(self.main_device))
        import logging

        logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)  # its note that offloaded weights are meta
        # each layer's KV cache sits where the layer runs (a layer on disk runs on the main device)
        model.layer_devices = [self.main_device if _device_of(dmap, f"layers.{i}") == "disk"
                               else _torch_device(_device_of(dmap, f"layers.{i}")) for i in range(config.n_layers)]
        return dispatch_model(model, device_map=dmap, main_device=main, offload_dir=str(folder) if index else None,
                              offload_index=index or None)

    def summary(self) -> dict:
        """Where each top-level part went, for the trace: {"embed": "cpu", "layers.0": "disk", ...}."""
        return {name: str(d) for name, d in getattr(self, "device_map", {}).items()}


def _device_of(dmap: dict, name: str):
    """The device a tensor's module was given: the entry for its longest prefix."""
    best = None
    for key, dev in dmap.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, dev)
    return best[1] if best else "disk"


def _accelerate_name(d: torch.device):
    return d.index or 0 if d.type == "cuda" else d.type


def _torch_device(d) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def parse_placement(device_map: Optional[str], max_memory: Optional[list[str]], offload_dir: Optional[Path],
                    model_key: str) -> Optional[Placement]:
    """device_map / max_memory / offload_dir -> a Placement, or None. Their spelling is choices.check_placement's
    (api.LoadOptions checked it when it was made, before torch was imported); this adds what only the machine can
    say: the devices max_memory names, and a writable offload folder."""
    if device_map is None and not max_memory:
        return None
    limits: dict = {}
    for item in max_memory or []:
        key, size = max_memory_entry(item)
        limits[_machine_has(key, item)] = size
    if not limits:  # accelerate's own defaults: every GPU's free memory, then the CPU's
        from accelerate.utils import get_max_memory

        limits = get_max_memory()
    if "cpu" not in limits:
        limits["cpu"] = available_memory()
    gpus = sorted(k for k in limits if isinstance(k, int))
    main = torch.device("cuda", gpus[0]) if gpus else torch.device("mps") if "mps" in limits else torch.device("cpu")
    return Placement(max_memory=limits, offload_dir=_offload_folder(offload_dir, model_key), main_device=main)


def _machine_has(key, item: str):
    """A max_memory key ('cpu', 'mps' or a CUDA index), checked against this machine."""
    dev = item.partition("=")[0].strip()
    if key == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise BadValue("max_memory", " names mps, but MPS is not available here")
    if isinstance(key, int) and key >= torch.cuda.device_count():
        have = torch.cuda.device_count()
        raise BadValue("max_memory", f" names {dev!r}, but this machine has {plural(have, 'CUDA device')}")
    return key


def _offload_folder(requested: Optional[Path], model_key: str) -> Path:
    """A fresh folder for the layers written to disk (removed at exit), inside --offload-dir or the user cache; checked
    writable before anything is loaded."""
    import atexit
    import shutil
    import tempfile

    from llmtrace.registry.cache import cache_dir

    parent = requested if requested is not None else cache_dir() / "offload"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"{model_key}-", dir=parent))
    except OSError as e:
        raise FieldError("offload_dir", f" {parent}: not a writable directory ({e.strerror or e}); choose another "
                         "with offload_dir", also=("offload_dir",)) from None
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
