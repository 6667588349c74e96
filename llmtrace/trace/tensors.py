"""`generate --save-tensors FILE.safetensors`: the full values of the points a trace records, beside the trace.

The trace's run event names the file and a key, {"file", "key", "run_id"}; the file's safetensors metadata holds the
same key, so that `llmtrace diff` can refuse a tensors file that belongs to another run. The key is a hash of the
prompt's ids, the model and the run's random id: two runs never share one, even of the same prompt.

Tensors are named "STEP/LAYER/POINT" ("0/3/q", "2/model/logits"): step 0 is the prefill, LAYER is "model" for the
points outside the layers. Each is the recorded tensor without its batch dimension, in the run's dtype. kv_write
(the slots written) and k_repeated (k_rope laid out for the query heads, a view) are not stored. safetensors only,
never pickle.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Optional

import torch

from llmtrace.errors import FieldError, LlmtraceError

TENSORS_SCHEMA = "llmtrace.tensors/1"
def tensor_name(step: int, layer: Optional[int], point: str) -> str:
    return f"{step}/{'model' if layer is None else layer}/{point}"


def parse_tensor_name(name: str) -> tuple[int, Optional[int], str]:
    step, layer, point = name.split("/")
    return int(step), None if layer == "model" else int(layer), point


def run_key(prompt_ids: list[int], model: str, run_id: str) -> str:
    text = json.dumps({"ids": list(prompt_ids), "model": model, "run_id": run_id}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class TensorStore:
    """Keeps the recorded tensors of one run (on the CPU) and writes them, whole or not at all, at the end."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tensors: dict[str, torch.Tensor] = {}
        self.record: Optional[dict] = None
        self._ids: list[int] = []
        self._model = ""

    def begin(self, model_name: str, prompt_ids: list[int]) -> dict:
        """The run event's "tensors" record: the file (as given) and the key that ties it to this run."""
        run_id = uuid.uuid4().hex
        self._ids, self._model = list(prompt_ids), model_name
        self.record = {"file": str(self.path), "key": run_key(prompt_ids, model_name, run_id), "run_id": run_id}
        return self.record

    def keep(self, step: int, layer: Optional[int], point: str, x: torch.Tensor) -> None:
        """Keep x, the tensor of a point whose values can be stored (model.points.Point.stored; the recorder asks)."""
        name = tensor_name(step, layer, point)
        if name in self.tensors:
            raise FieldError("save_tensors", " keeps one pass per step; this prompt was prefilled in several chunks "
                             "(a prompt of more than 256 tokens); shorten it")
        self.tensors[name] = x[0].detach().to("cpu", copy=True).contiguous()

    def write(self) -> None:
        from safetensors.torch import save_file

        from llmtrace.fsutil import atomic_path

        meta = {"schema": TENSORS_SCHEMA, "key": self.record["key"], "run_id": self.record["run_id"],
                "model": self._model, "prompt_ids": json.dumps(self._ids)}
        with atomic_path(self.path) as tmp:
            save_file(self.tensors, str(tmp), metadata=meta)


def read_tensors(path: Path, key: str, trace: str) -> dict[str, torch.Tensor]:
    """The tensors of `path`, after checking that its key is the trace's. Errors name both files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise LlmtraceError(f"{path}: the tensors file that {trace} names is not there") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise LlmtraceError(f"{path}: not a safetensors file ({' '.join(str(e).split())[:120]})") from None
    if meta.get("schema") != TENSORS_SCHEMA:
        raise LlmtraceError(f"{path}: not a tensors file of llmtrace (its metadata names no schema {TENSORS_SCHEMA})")
    if meta.get("key") != key:
        raise LlmtraceError(f"{path} does not belong to {trace}: it was saved by another run (key {meta.get('key')}, "
                            f"the trace's is {key})")
    return load_file(str(path))
