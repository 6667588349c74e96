"""The compiled decode step (`generate --compile`): performance plumbing, kept beside the model and out of its maths.

`CompiledDecode(model)` captures `Transformer.forward` whole with torch.compile (TorchDynamo captures, Inductor fuses
it into a few kernels per layer), which removes most of eager PyTorch's per-op overhead (benchmarks/RESULTS.md). It
agrees with the eager pass to float rounding, not bit for bit. The generation loop uses it only for one-token passes
that nothing observes; the prefill and every observed pass run the model eagerly, taps and all.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn as nn

from llmtrace.model.transformer import KVCache, Transformer


class DenseInputLinear(nn.Linear):
    """nn.Linear, plus one detail for the compiled step.

    Inductor hands a one-token input to the matrix product as a (1, K) view whose size-1 dimension has stride 0, and
    the CPU matrix product copies such an input before it multiplies (91 copies per decode step here). Giving the
    input its dense strides explicitly while compiling removes the copies: the compiled step got 6.5% faster
    (benchmarks/RESULTS.md). Eager PyTorch does not take this branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.is_contiguous():
            x = x.as_strided(x.shape, _dense_strides(x.shape))
        return super().forward(x)


def _dense_strides(shape) -> tuple:
    """The strides of a contiguous tensor of this shape, size-1 dimensions included (row-major)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class CompiledDecode:
    """`step(idx, cache, start)`: the model's one-token pass (B, 1) at cache slot `start`, compiled; logits (B, V).

    `freeze`: compile the weights in as constants (Inductor's freezing), for a model whose weights nothing changes
    afterwards. The graph then takes only the token, the slot and the cache as inputs, not its ~500 weight tensors,
    and the Python work around each call (TorchDynamo and AOTAutograd handing those inputs over) falls from ~1.1 to
    ~0.45 ms a step in the fast path's decode on an Intel Xeon (benchmarks/RESULTS.md): steps 8% faster there, 23%
    on an AMD EPYC. TorchDynamo then guards on the weights' identity: another model's weights compile anew. Costs:
    AOTAutograd's cache does not take frozen graphs, so every run's compile takes 11-14 s longer (19-21 s instead of
    8 with Inductor's cache warm), and the process holds ~32-42 MiB more: it pays back after ~5,000-17,000 tokens, so
    it is asked for (`--freeze`), not the default. Only for the fast path on the CPU (its int4 tensors are handed to
    the kernel as they are; generate.check_freeze): the exact path keeps its weights as inputs, as its parity with
    eager was measured, and CUDA was never measured here."""

    def __init__(self, model: Transformer, freeze: bool = False):
        for m in model.modules():  # the same weights; only the compiled path reads the difference
            if type(m) is nn.Linear:
                m.__class__ = DenseInputLinear
        # On CPU, Inductor's C++ wrapper calls the kernels without a Python line per kernel (measured ~4% faster)
        options = {"cpp_wrapper": True} if model.embed.weight.device.type == "cpu" else {}
        self._fn = torch.compile(model.forward, dynamic=True, fullgraph=True, options=options)
        # Freezing is read by TorchDynamo while it traces (to guard on the weights), so it is set around the calls that
        # may compile, not in `options`. No weight prepacking: that would make Inductor keep a second, blocked copy of
        # every dense matrix.
        import torch._inductor.config as inductor_config  # loaded by torch.compile anyway; not at every import

        settings = {"freezing": True, "cpp.weight_prepack": False} if freeze else {}
        self._inductor_settings = inductor_config.patch(settings)
        self._guards_passed = False
        self.compile_s = 0.0  # seconds the first (compiling) call took, set by generate.compile_decode

    def __call__(self, idx: torch.Tensor, cache: KVCache, start: int, *, next_of_same_run: bool = False) -> torch.Tensor:
        """`next_of_same_run`: the caller vouches that this pass follows the previous one in the same generation (same
        cache, slot one further, only the token differs). If that previous pass was compiled too, TorchDynamo's guard
        check (its assumptions about every input, re-checked on each call: ~1 ms a step here) is not repeated."""
        if next_of_same_run and self._guards_passed:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._fn(idx, cache, start, last_only=True)
        # Python floats are constants of the model (eps, scales); treated as dynamic inputs, one of them made
        # TorchDynamo start over halfway, which doubled the compile time. Scoped to the calls that may compile.
        with torch._dynamo.config.patch(specialize_float=True), self._inductor_settings, warnings.catch_warnings():
            # Inductor's C++ codegen warns that the fast path's embedding lookup meets fp16 block scales in a bf16
            # graph: a note to its own developers, printed mid-run to the user; the values are what eager computes
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed", category=UserWarning)
            logits = self._fn(idx, cache, start, last_only=True)
        self._guards_passed = True
        return logits

    def forget_guards(self) -> None:
        """The next call checks its guards again (a pass ran outside the compiled step in between)."""
        self._guards_passed = False


def decode_step(model: Transformer, compiled: Optional[CompiledDecode], idx: torch.Tensor, cache: KVCache, start: int,
                *, next_of_same_run: bool = False) -> torch.Tensor:
    """The logits (B, V) of the last position of idx (B, T) at cache slot `start`: compiled when there is a compiled
    step and this is a one-token pass the cache is ready for, else the model's eager forward."""
    if compiled is None or idx.size(1) != 1 or model.cache_stale(cache, start, 1):
        if compiled is not None:
            compiled.forget_guards()
        return model(idx, cache, start, last_only=True)
    return compiled(idx, cache, start, next_of_same_run=next_of_same_run)
