"""Recording a trace: the events of one run, as plain dicts following the schema `llmtrace.trace/1`.

`Recorder` is both observers at once:
- the model's observer (`with model.hooked(recorder, ...)`, opened by the generation loop), called at each named
  point of the forward pass; it keeps the shape, dtype and summary statistics of the points it was asked for.
  Statistics stay on the device until the pass ends and then cross to the host in one transfer;
- the generation loop's observer, which turns each step (token, sampler ledger, KV cache, timing) into an event.

At --trace full a pass's events are made in the recorder's worker thread while the model runs the next pass
(after_forward), and reach the sinks from the loop's thread a pass later, in order (the backlog, _drain). At the other
levels a pass's events are out before the next pass begins (tests/test_interrupt.py: a reader following the file
sees each step as it ends).

Events go to sinks (the JSONL stream and JSON document of `writers.py`, the terminal renderer). Renderers never see the
model, only events, so a saved trace can be shown again without it (`llmtrace show`).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import orjson
import torch

from llmtrace.model.llama_points import KV_WRITE, SCORES, llama_points
from llmtrace.model.moe_points import EXPERT_WEIGHTS, ROUTER_PROBS
from llmtrace.trace.growing import Growing, combine, gather
from llmtrace.trace.packed import pack_bytes
from llmtrace.trace.cards import Cards
from llmtrace.trace.worked import SAMPLE_WIDTH, sample_index
from llmtrace.version import __version__
from llmtrace.trace.events import SCHEMA_ID, summary_event
from llmtrace.trace.records import (batch_event, candidate_records, model_record, path_record, rounded as _round,
                                    tensor_event, tokens_event)
from llmtrace.trace.writers import ORJSON_OPTIONS as _ORJSON
from llmtrace.trace.stats import (rounded_floats, rounded_rows as _rounded_rows, stat_rows as _stat_rows,
                                  summaries as _summaries)
from llmtrace.trace.options import TraceOptions
from llmtrace.trace.routing import ExpertLoad, routing_event, routing_tables

ROUTING = (ROUTER_PROBS.name, EXPERT_WEIGHTS.name)  # what a routing event is made of (trace.routing)
# Set (to anything) to make each observed pass's events in the generation loop's own thread, as it ends, rather than
# in the recorder's worker while the next pass runs: the same bytes, one pass sooner, without the overlap.
INLINE_ENV = "LLMTRACE_TRACE_INLINE"
# While the worker runs, Python hands its lock between the two threads at least this often (its default: 5 ms), so
# that the loop, back from a matrix product, does not wait a whole interval behind the worker's Python
# (benchmarks/RESULTS.md)
SWITCH_S = 0.001



@functools.cache
def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _unbroadcast(x: torch.Tensor) -> tuple[torch.Size, torch.Tensor, int]:
    """A point may be tapped as a broadcast view: a stride-0 dimension that repeats the entries of the dimension before
    it, as GQA's repeated keys (B, Hkv, G, S, Dh) do (repeat_kv's expand). Such a view is recorded as the tensor it
    stands for, each broadcast dimension merged into the one before it ((B, H, S, Dh) for the keys). Its
    statistics are taken over its distinct entries, each counted as often as it repeats, so nothing is copied.

    Returns (the recorded shape, the distinct entries as a view, how often each repeats): (x.shape, x, 1) for a
    tensor without broadcast dimensions.
    """
    if 0 not in x.stride()[1:]:
        return x.shape, x, 1
    sizes, kept_sizes, kept_strides, count = [x.size(0)], [x.size(0)], [x.stride(0)], 1
    for n, st in zip(x.shape[1:], x.stride()[1:]):
        if st == 0 and n > 1:
            sizes[-1] *= n
            count *= n
        else:
            sizes.append(n)
            kept_sizes.append(n)
            kept_strides.append(st)
    return torch.Size(sizes), x.as_strided(kept_sizes, kept_strides), count


# ----------------------------------------------------------------------------------------------------------------
# the recorder


class TensorEvent(dict):
    """A tensor event: a plain dict to every sink, which also carries its own JSON text.

    A full trace writes 574 of them per step. The recorder writes every tensor event's line itself once it is whole
    (trace.writers.dumps_bytes: UTF-8 bytes, as a file receives them); `line` holds it, and the JSONL sink and the
    server write it as it is (tests/test_trace.py parses every line of a full trace back to its event). `line` is
    unset until the recorder has made it, and must not be set on an event that is changed afterwards."""

    __slots__ = ("line",)  # no per-event __dict__; unset until the recorder makes the line (getattr(ev, "line", None))


class _Pass:
    """One observed pass as the recorder keeps it: what the model's observer was told (`taps`: (layer, name, tensor,
    dumped, row or None), `routes`, the prefill's `shape_table`, the cards' `cards`: trace.cards.CardPass), and what
    reducing it makes (`pending`: (tensor event without its stats, stat index, extra fields or None); `stats`: (n, 5)
    blocks of reduced statistics and `stat_order` the stat index of each row; `samples` (_sample_group); `written`:
    layer -> [first, last] slot written; `layouts`: see _layout). A pass is reduced and finished in the worker while
    the next one, a new _Pass, fills."""

    __slots__ = ("step", "phase", "start", "n_tokens", "taps", "queued", "routes", "shape_table", "cards", "pending",
                 "stats", "stat_order", "n_stats", "samples", "written", "layouts")

    def __init__(self, step: int, phase: str, start: int, n_tokens: int):
        self.step, self.phase, self.start, self.n_tokens = step, phase, start, n_tokens
        self.taps: list[tuple] = []
        self.queued = 0  # elements in taps
        self.routes: dict[int, dict[str, torch.Tensor]] = {}  # MoE layer -> its router_probs, expert weights
        self.shape_table: Optional[list[dict]] = None
        self.cards = None
        self.pending: list[tuple[TensorEvent, int, Optional[dict]]] = []
        self.stats: list[torch.Tensor] = []
        self.stat_order: list[int] = []
        self.n_stats = 0
        self.samples: list[tuple[list[int], list[int], torch.Tensor, Optional[torch.Tensor]]] = []
        self.written: dict[Optional[int], tuple[int, int]] = {}
        self.layouts: dict[tuple, tuple] = {}


class _Many:
    """Events that go to the sinks together (Recorder.emit_many)."""

    __slots__ = ("events",)

    def __init__(self, events: list[dict]):
        self.events = events


class Recorder:
    """Records one generation run as events and passes each event to the sinks as it happens. A pure observer: the
    generation loop opens the observation scope it asks for (`observation`) and hands it every fact it reports."""

    def __init__(self, options: TraceOptions, sinks: list[Callable[[dict], None]], run_info: Optional[dict] = None,
                 tensors=None):
        self.options = options
        self.tensors = tensors  # a trace.tensors.TensorStore keeping the full values (--save-tensors), or None
        self.sinks = sinks
        self.run_info = run_info or {}
        self.step = 0
        self.phase = "prefill"
        self._wanted_memo: dict[bool, dict] = {True: {}, False: {}}  # is prefill -> {(layer, name): (wanted, dumped)}
        self._memo = self._wanted_memo[True]  # this pass's (before_forward)
        self._index: dict[tuple, tuple[list[int], torch.Tensor]] = {}  # (row width, device) -> a sample's entries
        self._pass = _Pass(0, "prefill", 0, 0)  # the pass the model is running (before_forward makes each)
        self._worker: Optional[ThreadPoolExecutor] = None  # where a pass is finished while the next one runs
        self._switch = sys.getswitchinterval()  # Python's, restored when the worker stops
        self._backlog: deque = deque()  # what waits to reach the sinks, in order: a pass's Future, or an event
        self._config = None  # the model's config, from on_start
        self._declare(llama_points())  # the model's own declaration replaces Llama's at on_start
        self._rows = 1  # rows of the batch (on_start): with more than one, every tensor is recorded per row
        self._pads = [0]  # each row's pad slots (on_batch), so that a routing event gives each row's own positions
        self._load = ExpertLoad()  # tokens per expert of each MoE layer, for the summary
        self._batched = False  # on_start was told of a batch (generate_batch): on_end gets a BatchResult
        self._cards = None  # at --trace full, the worked cards computed by the one evaluator (trace/cards.py)
        self._ids: list[list[int]] = [[]]  # each row's token ids so far (the embedding's operand, for the cards)
        self._positions: list[list[int]] = [[]]  # each row's positions so far (a batch row counts from its first token)
        self._mask: list[list[int]] = [[]]  # each row's attention mask so far (0 at a pad slot)
        self._growing = Growing()  # the KV cache's broadcast views, reduced by the slots each pass adds (growing.py)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _declare(self, points) -> None:
        """What the recorder reads of the model's declared points (model.points.Points)."""
        self._points = points
        self._step_of = {p.name: p.step for p in points}  # point name -> its seed step
        self._traced = set(points.names(traced=True))  # what a trace records (resid_pre repeats the layer before's)
        self._stored = set(points.names(stored=True))  # whose full values --save-tensors keeps
        self._residual = set(points.names(residual=True))  # the residual stream's points (--trace layers)
        self._axes = {p.name: list(p.axes) for p in points}

    def emit(self, event: dict) -> None:
        """One event to every sink, after whatever waits before it (a pass the worker is finishing: _drain)."""
        if self._backlog:
            self._backlog.append(event)
        else:
            self._send(event)

    def _send(self, event: dict) -> None:
        for sink in self.sinks:
            sink(event)

    def emit_many(self, events: list[dict]) -> None:
        """Events in order, to each sink in turn: a sink with a `many` method (the JSONL sink) takes the whole list at
        once (a pass's 574 tensor events at --trace full), any other sink one event at a time. Only for events
        that end nothing (no step, no summary): a sink writes what it holds at the event that follows."""
        if self._backlog:
            self._backlog.append(_Many(events))
        else:
            self._send_many(events)

    def _send_many(self, events: list[dict]) -> None:
        for sink in self.sinks:
            many = getattr(sink, "many", None)
            if many is not None:
                many(events)
            else:
                for event in events:
                    sink(event)

    def wants_ledger(self) -> bool:
        return self.options.level.records

    def _layer_selected(self, layer: int) -> bool:
        return self.options.layers is None or layer in self.options.layers

    def _wanted(self, layer: Optional[int], name: str) -> bool:
        """Are statistics of this point recorded in the current pass?"""
        level = self.options.level
        if self._dumped(layer, name):
            return True
        if name not in self._traced:  # a point that repeats another (resid_pre is the layer before's resid_post)
            return False
        if level.full:
            return layer is None or self._layer_selected(layer)
        if level.every_pass:  # layers: the residual stream at every pass
            return layer is None or (name in self._residual and self._layer_selected(layer))
        if level.records:  # steps  # per-layer detail only for the prefill, and only if --layers narrowed it
            return self.step == 0 and layer is not None and self.options.layers is not None and self._layer_selected(layer)
        return False

    def _dumped(self, layer: Optional[int], name: str) -> bool:
        n_layers = self.run_info.get("n_layers", 0)
        return any(d.point == name and (d.layer is None or (layer is not None and d.layer_index(n_layers) == layer))
                   for d in self.options.dumps)

    # -- the model's observer ------------------------------------------------------------------------------------

    # A pass keeps the tensors it records and reduces them in batches: at the end of the pass, or sooner once they
    # hold this many elements (which bounds the memory they keep alive).
    QUEUE_ELEMENTS = 1 << 22

    def __call__(self, layer: Optional[int], name: str, x: torch.Tensor) -> None:
        # Called at every named point of every observed pass (574 per step at --trace full): it only keeps the tensor.
        # Shapes, events and statistics are made for the whole batch in _reduce_queue.
        p = self._pass
        key = (layer, name)
        wanted = self._memo.get(key)
        if wanted is None:
            wanted = self._memo[key] = self._decide(layer, name)
        if wanted[3]:  # the router ledger: a routing event per MoE layer per pass
            p.routes.setdefault(layer, {})[name] = x
        if p.shape_table is not None:
            self._note_shape(p, layer, name, x)
        if wanted[2] and p.cards is not None:  # the card layers' points and the operands they read (trace.cards)
            p.cards.seen[key] = x
        if not wanted[0]:
            return  # the common case of a point nobody asked for: a dictionary look-up
        if self.tensors is not None and name in self._stored:
            self.tensors.keep(self.step, layer, name, x)
        if self._rows > 1:  # a batch: one event per row (kv_write's positions are the same slots for every row)
            for r in range(self._rows):
                p.taps.append((layer, name, x if name == KV_WRITE.name else x[r : r + 1], wanted[1], r))
        else:
            p.taps.append((layer, name, x, wanted[1], None))
        p.queued += x.numel()
        if p.queued >= self.QUEUE_ELEMENTS:  # (a long prefill) reduced here, once the worker has no pass of its own
            self._settle()
            self._reduce_queue(p)

    def _decide(self, layer: Optional[int], name: str) -> tuple[bool, bool, bool, bool]:
        """What a pass does with a point, worked out once: (its statistics are recorded, its values dumped, the cards
        read it, it is routing's)."""
        return (self._wanted(layer, name), self._dumped(layer, name),
                self._cards is not None and (layer, name) in self._cards.need,
                name in ROUTING and layer is not None and self.options.level.every_pass and self._layer_selected(layer))

    def _note_shape(self, p: "_Pass", layer: Optional[int], name: str, x: torch.Tensor) -> None:
        """The prefill's shape table: each point once, from the model-level points and the first layer that reports
        it (layer 0, or in a hybrid model the first layer of its kind)."""
        if name in self._traced and not any(r["name"] == name and (r["layer"] is None) == (layer is None)
                                            for r in p.shape_table):
            p.shape_table.append({"layer": layer, "name": name, "shape": list(self._layout(p, name, x)[0]),
                                  "dtype": _dtype_name(x.dtype)})

    def _layout(self, p: "_Pass", name: str, x: torch.Tensor) -> tuple:
        """What a point's tensor layout means for the trace, worked out once per pass for all the layers that share it:
        (recorded shape, the view of its distinct entries or None, how often each repeats, statistics group key, dtype
        name). The recorded shape drops the batch dimension, except for kv_write (its tensor is the positions
        written). The key is the one _reduce_queue looks up first."""
        key = (name, x.shape, x.stride(), x.dtype)
        layout = p.layouts.get(key)
        if layout is None:
            full_shape, distinct, repeats = _unbroadcast(x)
            shape = list(full_shape[1:]) if name != KV_WRITE.name else list(full_shape)
            view = None if distinct is x else (distinct.shape, distinct.stride())
            # tensors of one shape are stacked and reduced together; scores leave out their masked (-inf) entries
            group = (distinct.shape, x.dtype, x.device, name == SCORES.name)
            layout = p.layouts[key] = (shape, view, repeats, group, _dtype_name(x.dtype))
        return layout

    def _reduce_queue(self, p: "_Pass") -> None:
        """Events and statistics of every tensor kept since the last call. Tensors of one shape are stacked into a
        matrix and reduced along its rows, so a pass costs a few reductions per distinct shape (about ten) rather than
        a few per tensor (hundreds)."""
        if not p.taps:
            return  # a pass nothing recorded (every pass of --trace none and most of --trace steps)
        groups: dict[tuple, list[tuple]] = {}  # key -> [(stat index, distinct entries, repeats, growing key or None)]
        step, phase, layouts, step_of, pending = p.step, p.phase, p.layouts, self._step_of, p.pending
        i = p.n_stats
        grown: list[tuple] = []  # (stat index, the slots this pass wrote, repeats, key, whole view, last pass's row)
        for layer, name, x, dumped, row in p.taps:  # 574 a decode step at --trace full: kept lean
            layout = layouts.get((name, x.shape, x.stride(), x.dtype))
            shape, view, repeats, group, dtype = layout if layout is not None else self._layout(p, name, x)
            distinct = x if view is None else x.as_strided(*view)
            if repeats == 1:
                groups.setdefault(group, []).append((i, distinct, repeats, None))
            else:  # a broadcast view of the KV cache (k_repeated): reduce only what this pass wrote (trace.growing)
                key = (layer, name, row)
                split = None if group[3] else self._growing.split(key, distinct, p.written.get(layer))
                if split is None:
                    groups.setdefault(group, []).append((i, distinct, repeats, key))
                else:
                    grown.append((i, split[1], repeats, key, distinct, split[0]))
            extra = None
            if name == KV_WRITE.name:
                positions = x.tolist()
                extra = {"positions": [positions[0], positions[-1]] if positions else []}
                if positions and positions[-1] - positions[0] + 1 == len(positions):
                    p.written[layer] = (positions[0], positions[-1])
            if dumped:
                values = x if repeats == 1 else x.reshape(x.size(0), *shape)  # a dump holds every entry, repeats included
                extra = (extra or {}) | {"values": (values[0] if name != KV_WRITE.name else values).detach().float().cpu()}
            event = tensor_event(step, phase, layer, name, step_of.get(name), list(shape), dtype, cls=TensorEvent)
            if row is not None:
                event["row"] = row
            pending.append((event, i, extra))
            i += 1
        p.n_stats = i
        p.taps.clear()
        p.queued = 0
        with torch.no_grad():  # the statistics are observations, never part of a graph
            for (_, _, _, finite_only), members in groups.items():
                m = torch.stack([x for _, x, _, _ in members])
                rows = _stat_rows(m.view(len(members), -1), finite_only)
                if any(c != 1 for _, _, c, _ in members):  # broadcast views: every distinct element stands for c
                    for j, (_, x, _, key) in enumerate(members):
                        if key is not None:
                            self._growing.keep(key, x, rows, j)
                    rows = self._repeated(rows, [c for _, _, c, _ in members])
                p.stats.append(rows)
                p.stat_order.extend(i for i, _, _, _ in members)
                if self.options.level.full:
                    self._sample_group(p, members, m)
            by_shape: dict[tuple, list] = {}  # the growing views of one shape (a model's layers may differ: Gemma 4)
            for g in grown:
                by_shape.setdefault(tuple(g[1].shape), []).append(g)
            for same in by_shape.values():
                new = _stat_rows(torch.stack([part for _, part, _, _, _, _ in same]).view(len(same), -1), False)
                rows = combine(gather([before for *_, before in same]), new)
                for j, (_, _, _, key, x, _) in enumerate(same):
                    self._growing.keep(key, x, rows, j)
                p.stats.append(self._repeated(rows, [c for _, _, c, _, _, _ in same]))
                p.stat_order.extend(i for i, *_ in same)

    @staticmethod
    def _repeated(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Statistics rows of distinct entries -> those of the view where each stands for `counts` of them: the sum,
        sum of squares and count scale; min and max do not."""
        scale = torch.tensor([[c, c, 1, 1, c] for c in counts], dtype=rows.dtype, device=rows.device)
        return rows * scale

    # A few values of every point at --trace full, for the report's walk-through (generic: no point is named): along
    # the last axis of the recorded shape, the whole row when it has at most SAMPLE_WIDTH entries, else the first
    # SAMPLE_WIDTH/2 entries of each half (a rotate-half RoPE pairs entry i with i + n/2); and every row's L2 norm. Only
    # for tensors of at most SAMPLE_ROWS rows (the product of the other axes).
    SAMPLE_WIDTH = SAMPLE_WIDTH
    SAMPLE_ROWS = 2048

    def _sample_group(self, p: "_Pass", members: list[tuple], m: torch.Tensor) -> None:
        """Keep the sample of every member of one statistics group (m: the members stacked), to be moved to the host
        with the pass's statistics. A broadcast view (repeats > 1) or an integer tensor has none."""
        if not m.is_floating_point() or m.dim() < 2 or any(c != 1 for _, _, c, _ in members):
            return
        last = m.shape[-1]
        rows = m[0].numel() // last if last else 0
        if not rows or rows > self.SAMPLE_ROWS:
            return
        got = self._index.get((last, m.device))
        if got is None:
            index = sample_index(last, self.SAMPLE_WIDTH)
            got = self._index[(last, m.device)] = (index, torch.tensor(index, device=m.device))
        index, at = got
        flat = m.reshape(len(members), rows, last)
        # the norms are kept as float32 (trace.packed), so they are taken in float32 (a float64 copy of the group cost
        # more than the rest of the sample); bfloat16 and float16 are widened first
        wide = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
        # a tensor of one row (a decode step's hidden states, most of a full trace's points) has no norms: its
        # statistics hold that row's norm
        p.samples.append(([i for i, _, _, _ in members], index, flat.index_select(-1, at),
                              torch.linalg.vector_norm(wide, dim=-1) if rows > 1 else None))

    def _take_samples(self, p: "_Pass") -> dict[int, dict]:
        """The pass's samples, by stat index: {"index", "values" (rows × entries)[, "norms"]}, each packed as
        float32 (trace.packed); "norms" only for more than one row. Every group's values cross to the host together,
        as one float32 array whose slices are the members' packed bytes: a few calls a pass, nothing per float."""
        parts = [t.reshape(-1) for _, _, values, norms in p.samples for t in (values, norms) if t is not None]
        data = memoryview(torch.cat(parts).float().cpu().numpy().astype("<f4", copy=False).tobytes())
        offset = 0

        def take(t: torch.Tensor, n_members: int) -> list[str]:
            nonlocal offset
            each = 4 * (t.numel() // n_members)  # bytes a member
            if each % 3 == 0:  # base64 of the whole group splits into the members' at every 4 * each / 3 characters
                text, width = pack_bytes(data[offset: offset + each * n_members]), 4 * each // 3
                out = [text[k * width: (k + 1) * width] for k in range(n_members)]
            else:
                out = [pack_bytes(data[offset + k * each: offset + (k + 1) * each]) for k in range(n_members)]
            offset += each * n_members
            return out

        out = {}
        for members, index, values, norms in p.samples:
            vals = take(values, len(members))
            if norms is None:
                out.update({i: {"index": index, "values": v} for i, v in zip(members, vals)})
                continue
            nrm = take(norms, len(members))
            for k, i in enumerate(members):
                out[i] = {"index": index, "values": vals[k], "norms": nrm[k]}
        p.samples.clear()
        return out

    # -- the generation loop's observer ------------------------------------------------------------------------

    def observation(self, phase: str) -> Optional[dict]:
        """Which passes and layers the generation loop should let this recorder observe (`Transformer.hooked`'s
        keyword arguments), or None. The prefill is observed for its shape table (model-level points and layer 0);
        decode passes only at --trace layers/full or with --dump (which records at every level, none included)."""
        o = self.options
        every = o.level.every_pass
        if (not o.level.records and not o.dump) or (phase == "decode" and not every and not o.dump):
            return None
        if every:
            layers = None if o.layers is None else set(o.layers)
        else:  # steps: layer detail only in the prefill, and only where --layers asked for it
            layers = set(o.layers or ()) if phase == "prefill" else set()
        if phase == "prefill" and layers is not None:
            layers.add(0)  # the shape table's layer
        dumped = self._dump_layers(o.dumps)
        layers = None if layers is None or dumped is None else sorted(layers | dumped)
        if phase == "prefill" or o.level.full:
            return {"layers": layers}  # attention too: spelled out where observed
        # decode at --trace layers/steps: the residual stream, and the attention of layers whose attention is dumped
        attention = self._dump_layers([d for d in o.dumps if d.point in self._points.names("attn")])
        return {"layers": layers, "attention": attention if attention is None else sorted(attention)}

    def _dump_layers(self, dumps) -> Optional[set[int]]:
        """The layers a list of --dump points names; None: every layer (a layer point named without a layer)."""
        out = set()
        for d in dumps:
            if d.layer is not None:
                out.add(d.layer_index(self.run_info.get("n_layers", 0)))
            elif d.point in self._points.names(layer=True):
                return None
        return out

    def on_start(self, lm, prompt_ids: list[int], sampler, batch: Optional[list[list[int]]] = None,
                 samplers: Optional[list] = None) -> None:
        """The run's facts: read once, nothing kept but the config and the tokenizer (for token pieces). A batch
        (`batch`: every row's prompt ids, `samplers` their samplers) gets one tokens event per row, with "row"."""
        c = self._config = lm.config
        self._declare(lm.points)
        if self.options.level.full:
            self._cards = Cards(lm, self.options.layers)
        if self.options.level.full and self._worker is None and not os.environ.get(INLINE_ENV):
            threads = torch.get_num_threads()  # torch's setting is the calling thread's: the worker takes the same
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="llmtrace-trace",
                                              initializer=torch.set_num_threads, initargs=(threads,))
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch, SWITCH_S))
        self._rows = len(batch) if batch is not None else 1
        self._ids = [list(p) for p in batch] if batch is not None else [list(prompt_ids)]
        self._positions = [list(range(len(p))) for p in self._ids]
        self._mask = [[1] * len(p) for p in self._ids]
        self._batched = batch is not None
        self.run_info["n_layers"] = c.n_layers
        self._tok = lm.tokenizer
        self.emit({
            "event": "run",
            "schema": SCHEMA_ID,
            "llmtrace_version": __version__,
            "model": model_record(lm),
            "points": self._points.records(),
            "maths": lm.maths.record(),
            "device": str(lm.device),
            "dtype": _dtype_name(lm.dtype),
            **path_record(lm),  # "exact", and on the fast path what it computes with
            "threads": self.run_info.get("threads"),  # torch's CPU threads, as the CLI set them
            "sampling": sampler.config.to_dict() | {"seed": sampler.seed},
            "prompt": self.run_info.get("prompt", ""),
            "chat": self.run_info.get("chat", False),
            "compiled": self.run_info.get("compiled", {"decode_step": False}),
            "trace": {"level": self.options.level.value, "layers": self.options.layers, "dump": list(self.options.dump)},
        } | ({"interventions": self.run_info["interventions"]} if self.run_info.get("interventions") else {}) | ({"tensors": self.tensors.begin(lm.name, prompt_ids)} if self.tensors is not None else {}) | ({"batch": self._rows, "prompts": self.run_info.get("prompts") or [lm.tokenizer.decode(p) for p in batch],
              "row_seeds": [s.seed for s in samplers]} if batch is not None else {}))
        for row, ids in enumerate(batch) if batch is not None else [(None, prompt_ids)]:
            self.emit(tokens_event(self._tok, ids) | ({} if row is None else {"row": row}))

    def on_batch(self, layout) -> None:
        """s3: the padded batch as the first pass sees it (generate.BatchLayout)."""
        self._pads = [row.count(0) for row in layout.attention_mask]
        self._ids = [list(r) for r in layout.ids]
        self._positions = [list(r) for r in layout.position_ids]
        self._mask = [list(r) for r in layout.attention_mask]
        self.emit(batch_event(self._tok, layout))

    def before_forward(self, step: int, phase: str, start: int, n_tokens: int) -> None:
        self.step, self.phase = step, phase
        self._memo = self._wanted_memo[step == 0]
        p = self._pass = _Pass(step, phase, start, n_tokens)
        if step == 0 and self.options.level.records:
            p.shape_table = []
        if self._cards is not None:  # the pass's ids, positions and mask, as the model sees them
            for r in range(len(self._positions)):  # a finished row of a batch still runs: its slots go on
                while len(self._positions[r]) < start + n_tokens:
                    self._positions[r].append(self._positions[r][-1] + 1 if self._positions[r] else 0)
                    self._mask[r].append(1)
            ids = [r[start: start + n_tokens] for r in self._ids]
            p.cards = self._cards.begin(torch.tensor(ids) if all(len(r) == n_tokens for r in ids) else None,
                                        torch.tensor([r[start: start + n_tokens] for r in self._positions]),
                                        torch.tensor([r[: start + n_tokens] for r in self._mask]).bool()
                                        if self._rows > 1 else None, start)

    def after_forward(self, step: int) -> None:
        """The pass is over: its events are made (statistics, samples, worked cards) and reach the sinks. With a
        worker (`_worker`) they are made there while the model runs the next pass, and reach the sinks, in order,
        when the pass after this one is over (or at the end of the run): a step's events come a pass later, never
        out of order, and byte for byte what the pass makes inline (LLMTRACE_TRACE_INLINE=1)."""
        p, self._pass = self._pass, _Pass(step, self.phase, 0, 0)
        if self._worker is None:
            self._settle()
            self._deliver(self._finish(p))
            return
        mode = torch.is_inference_mode_enabled()
        job = self._worker.submit(self._in_mode, mode, lambda: self._finish(p))
        self._backlog.append(job)
        self._drain(until=job)  # the pass before's events, while the worker makes this one's

    @staticmethod
    def _in_mode(inference: bool, make: Callable[[], list]) -> list:
        with torch.inference_mode(inference):  # the worker's thread does not inherit the loop's mode
            return make()

    def _finish(self, p: "_Pass") -> list:
        """A pass's events, in order, made whole: its tensor events (their lines written), its routing events and its
        shape table, as [events of emit_many, event, ...]."""
        self._reduce_queue(p)
        values: list = [None] * p.n_stats  # (mean, std, min, max, norm, count) of each recorded tensor
        if p.stats:  # one transfer for the whole pass, then rounded in one batch
            for i, row in zip(p.stat_order, _rounded_rows(_summaries(torch.cat(p.stats)))):
                values[i] = row
        samples = self._take_samples(p) if p.samples else {}
        cards = self._cards if p.cards is not None else None
        for ev, stat_index, extra in p.pending:
            mean, std, lo, hi, norm, count = values[stat_index]
            ev["stats"] = {"mean": mean, "std": std, "min": lo, "max": hi, "norm": norm}
            if stat_index in samples:
                ev["sample"] = samples[stat_index]
                if cards is not None and cards.wants(ev["layer"]):  # the worked card's values (trace.cards)
                    got = cards.sampled(p.cards, ev["layer"], ev["name"], ev["sample"]["index"], ev.get("row"))
                    if got is not None:
                        ev["sample"]["computed"] = got
            if ev["name"] == SCORES.name:
                ev["masked"] = int(math.prod(ev["shape"]) - count)
            if extra is not None:
                if "positions" in extra:
                    ev["positions"] = extra["positions"]
                if "values" in extra:
                    ev["values"] = extra["values"].tolist()
            ev.line = orjson.dumps(ev, option=_ORJSON)  # trace.writers.dumps_bytes, inlined: 574 a step
        if cards is not None:
            cards.end(p.cards)
        out: list = [_Many([ev for ev, _, _ in p.pending])] if p.pending else []
        out.extend(self._routing(p))
        if p.shape_table is not None:
            out.append({"event": "shapes", "step": p.step, "phase": p.phase, "n_tokens": p.n_tokens,
                        "n_layers": self._config.n_layers, "points": [self._shape_entry(r) for r in p.shape_table]})
        return out

    def _deliver(self, out: list) -> None:
        """A pass's events (_finish) to the sinks, now."""
        for item in out:
            if isinstance(item, _Many):
                self._send_many(item.events)
            else:
                self._send(item)

    def _drain(self, until=None) -> None:
        """What waits in the backlog to the sinks, in order, up to `until` (a pass's job; None: all of it), waiting
        for the worker where it must. An exception the worker raised is raised here, as the pass inline would."""
        backlog = self._backlog
        while backlog and backlog[0] is not until:
            item = backlog[0]
            if isinstance(item, Future):
                try:
                    out = item.result()  # a Ctrl-C while waiting leaves the pass in the backlog: on_end sends it
                except KeyboardInterrupt:
                    raise
                except BaseException:
                    backlog.popleft()
                    raise
                backlog.popleft()
                self._deliver(out)
            else:
                backlog.popleft()
                self._deliver([item])

    def abandon(self) -> None:
        """The run failed (an exception out of the generation loop): what the worker made before it reaches the sinks,
        in order, as the inline recorder would have sent it; nothing more is raised."""
        try:
            self._drain()
        except Exception:  # the failure itself, or a pass that failed with it: it is the caller's to report
            self._backlog.clear()
        finally:
            self._stop_worker()

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)  # nothing is left in it: the backlog is empty
            self._worker = None
            sys.setswitchinterval(self._switch)

    def _settle(self) -> None:
        """Every pass the worker holds made and delivered: the worker and the backlog are empty."""
        self._drain()

    def _routing(self, p: "_Pass") -> list[dict]:
        """One routing event per MoE layer observed in pass `p` (and per row of a batch), its positions each row's
        own (a row's pad slots left out); each counts towards the summary's expert load."""
        routes = p.routes
        layers = [layer for layer in sorted(routes) if len(routes[layer]) == len(ROUTING)]
        if not layers:
            return []
        c = self._config
        out = []
        with torch.no_grad():  # every layer's (B, T, E) stacked: one pass over them all (trace.routing)
            probs = torch.stack([routes[layer][ROUTER_PROBS.name] for layer in layers])
            weights = torch.stack([routes[layer][EXPERT_WEIGHTS.name] for layer in layers])
            tables = routing_tables(probs, weights, c.n_experts_used)  # [layer][row] -> tables
        T = probs.size(2)
        for i, layer in enumerate(layers):
            for r in range(probs.size(1)):
                pad = self._pads[r] if r < len(self._pads) else 0
                first = max(0, pad - p.start)  # slots of this pass before the row's first real token
                positions = list(range(p.start + first - pad, p.start + T - pad))
                mine = {key: value[first:] for key, value in tables[i][r].items()}
                ev = routing_event(p.step, p.phase, layer, positions, mine, c.n_experts_used, c.n_experts,
                                   c.norm_topk_prob, row=r if self._rows > 1 else None)
                self._load.add(ev)
                out.append(ev)
        return out

    def _shape_entry(self, r: dict) -> dict:
        """A shape table row with its seed step and, where they describe it, its axes (kv_write's slots, the logits
        of every position in a pass that keeps them, have a shape of their own)."""
        axes = self._axes.get(r["name"], [])
        return dict(r, seed_step=self._step_of.get(r["name"])) | ({"axes": axes} if len(axes) == len(r["shape"]) else {})

    def _topk(self, led) -> list[dict]:
        return candidate_records(self._tok, led.topk[: self.options.topk])

    def _detail(self, d: Any) -> Any:
        """A sampler stage's ledger detail as the event writes it: floats rounded, and every token named by its id
        ({"id": ...}) also given its text."""
        if isinstance(d, dict):
            out = {k: self._detail(v) for k, v in d.items()}
            if isinstance(d.get("id"), int):
                out["text"] = self._tok.decode([d["id"]])
            return out
        if isinstance(d, list):
            return [self._detail(v) for v in d]
        return _round(d)

    def _kv_event(self, kv, row_len: Optional[int] = None) -> dict:
        """The step event's kv_cache record, from the facts the generation loop handed over. In a batch (row_len:
        the row's real tokens cached) bytes_used counts that row's real tokens, and batch_bytes_used every row's
        slots, pads included (bytes_allocated is the whole batch's). The per-token figures are the cache's own
        (model.transformer.kv_bytes_per_position); the event carries them so that no view works them out again."""
        n = kv.seq_len if row_len is None else row_len
        ev = {"seq_len": n, "bytes_per_token": kv.bytes_per_token, "bytes_used": n * kv.bytes_per_token,
              "bytes_allocated": kv.bytes_allocated, "capacity": kv.capacity, "element_size": kv.element_size,
              "mha_bytes_per_token": kv.mha_bytes_per_token, "mha_bytes_used": n * kv.mha_bytes_per_token}
        if row_len is not None:
            ev.update(batch=self._rows, batch_seq_len=kv.seq_len, batch_bytes_used=self._rows * kv.seq_len * kv.bytes_per_token)
        layers = list(getattr(kv, "state_layers", ()))
        if layers:  # layers whose memory is a fixed-size state (linear attention): constant, where K and V grow
            per = kv.state_bytes_per_layer
            total = getattr(kv, "state_bytes", 0) or per * len(layers)  # layers of several kinds differ in size
            ev["state"] = {"layers": layers, "bytes_per_layer": per, "bytes": total}
            ev["total_bytes_used"] = ev["bytes_used"] + total
        return ev

    def on_step(self, rec, row: Optional[int] = None) -> None:
        r = row or 0
        if self._cards is not None and r < len(self._ids):  # the token the next pass reads, at the next position
            self._ids[r].append(rec.token)
            self._positions[r].append(self._positions[r][-1] + 1 if self._positions[r] else 0)
            self._mask[r].append(1)
        if self._worker is not None and self._backlog:  # made in the worker too (its ledger's logits: ~1 ms)
            mode = torch.is_inference_mode_enabled()
            self._backlog.append(self._worker.submit(self._in_mode, mode, lambda: [self._step_event(rec, row)]))
        else:
            self.emit(self._step_event(rec, row))

    def _step_event(self, rec, row: Optional[int]) -> dict:
        """A step's event (a StepRecord, and the row of a batch): its token, the sampler's ledger, the KV cache."""
        tok = self._tok
        ev: dict[str, Any] = {
            "event": "step", "step": rec.step, "phase": rec.phase, "position": rec.position,
            **({} if row is None else {"row": row}),
            "token": {"id": rec.token, "piece": tok.piece(rec.token), "text": tok.decode([rec.token]),
                      "special": tok.is_special(rec.token)},
        }
        led = rec.ledger
        if led is not None:
            ev["topk"] = self._topk(led)
            ev["sampler"] = [{"stage": s.stage, "survivors": s.survivors, "pick_prob": _round(s.pick_prob), "top": s.top,
                              **({} if s.detail is None else {"detail": self._detail(s.detail)})} for s in led.stages]
            ev["rng"] = {"seed": led.seed, "draw": _round(led.draw) if led.draw is not None else None,
                         "greedy": led.greedy}
            if led.slice is not None:  # where the chosen token's slice of [0, 1) lies, in id order
                ev["rng"]["slice"] = [_round(led.slice[0]), _round(led.slice[1])]
            if self.options.logits_top and led.raw is not None:
                ev["logits"] = logits_record(led.raw, self.options.logits_top)
        ev["kv_cache"] = self._kv_event(rec.kv, rec.position if row is not None else None)
        ev["ms"] = round(rec.ms, 3)
        return ev

    def on_prediction(self, ledger, position: int, kv, row: Optional[int] = None) -> None:
        """A prefill-only run (-n 0): what the model would predict at `position`; no token was taken."""
        self.emit({"event": "prediction", "step": 0, "phase": "prefill", "position": position,
                   **({} if row is None else {"row": row}),
                   "topk": self._topk(ledger), "kv_cache": self._kv_event(kv, position if row is not None else None)})

    def on_end(self, result) -> None:
        self._settle()  # every pass's events before the summary
        self._stop_worker()
        self._growing.clear()  # nothing of the run's cache is held after it
        ev = batch_summary_event(result) if self._batched else summary_event(result)
        loads = self._load.records()
        if loads:  # a mixture of experts traced at --trace layers or full: each layer's expert load
            ev["routing"] = loads
        self.emit(ev)


TAIL_BINS = 128


def logits_record(raw: torch.Tensor, n: int) -> dict:
    """A step's raw logits, kept for the report's what-if sampler: the n largest (ids and values, largest first) and
    the other V - n as a histogram of TAIL_BINS equal bins between their least and largest value (each bin's count and
    mean), so that a page can take softmax(z / T) over the whole vocabulary at any temperature: the tail's share is
    Σ count · exp(mean / T), within (bin width / T)² / 24 of exact."""
    z = raw.detach().float().reshape(-1).cpu()
    all_finite = math.isfinite(float(z.sum(dtype=torch.float64)))  # a finite sum has no inf or nan in it
    finite = None if all_finite else torch.isfinite(z)
    n_finite = z.numel() if all_finite else int(finite.sum())
    k = min(n, n_finite)
    zf = z if all_finite else torch.where(finite, z, -torch.inf)
    top, ids = torch.topk(zf, k)
    out = {"ids": ids.tolist(), "values": rounded_floats(top.double().numpy()), "vocab": z.numel(), "tail": None}
    if n_finite > k:  # the histogram of the tail, over the whole vocabulary: the top k and any non-finite logit are
        #               put in an extra bin that is dropped (no gather of the tail: a third of the time)
        rest = zf.clone()
        rest[ids] = -torch.inf
        lo = float(zf.min() if all_finite else torch.where(finite, z, torch.inf).min())
        hi = float(rest.max())
        zd = z.double()
        edges = torch.clamp(((zd - lo) / max(hi - lo, 1e-12) * TAIL_BINS).long(), 0, TAIL_BINS - 1)
        edges[ids] = TAIL_BINS
        if not all_finite:
            edges[~finite] = TAIL_BINS
        counts = torch.bincount(edges, minlength=TAIL_BINS + 1)[:TAIL_BINS]
        sums = torch.zeros(TAIL_BINS + 1, dtype=torch.float64).index_add_(0, edges, zd)[:TAIL_BINS]
        keep = counts > 0
        out["tail"] = {"counts": counts[keep].tolist(), "means": rounded_floats((sums[keep] / counts[keep]).numpy())}
    return out


def batch_summary_event(result) -> dict:
    """The summary of a batch (generate.BatchResult): the fields of a one-prompt summary describe row 0, except the
    speeds, which are the whole batch's; "rows" has every row's tokens, text and stop reason."""
    ev = summary_event(result.rows[0])
    n_prompt = sum(len(r.prompt_ids) for r in result.rows)
    ev.update(
        prefill_tok_s=round(n_prompt / result.prefill_s, 3) if result.prefill_s > 0 else 0.0,
        decode_tok_s=round(result.decode_tok_s, 3), interrupted=result.interrupted, batch=len(result.rows),
        rows=[{"row": r, "prompt_tokens": len(x.prompt_ids), "tokens": list(x.tokens), "text": x.text,
               "stop_reason": x.stop_reason} for r, x in enumerate(result.rows)])
    return ev

