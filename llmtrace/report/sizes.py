"""The size of things: every tensor of one pass drawn to scale (issue 50 item 7), the report's "sizes" section.

    data(d, w, ...)  the boxes of every kept step and recorded layer, from the trace's own shapes (its tensor events,
                     its declared points' axes, each layer's declared memory and the cache's length after each step)
    section(d, ...)  the section's controls and that data; assets/sizes.js draws the boxes to the page's width and
                     captions each (before any script runs, the pipeline section lists the same shapes)

A box is one tensor: its rows are the tensor's tokens (its T axis; S for the keys a layer reads; else its next-to-last
axis) and its columns everything else, so that `q` [T, H, Dh] is T rows of H·Dh and `scores` [H, T, S] is T rows of
H·S. Its area is its element count, at one scale for the whole section (every step, every layer), so a decode pass's
one row and the growing KV cache compare with the prefill. A box wider than the page folds into bands, like a line of
text; a box much taller than the layer's boxes (the logits over a large vocabulary) is drawn broken, with a button that
draws it whole: see docs/report.md.

Python decides what the section says: the shape with its named axes, the count, each box's role (a tensor of the pass,
the cache that grows by a row each token, a state of constant size); the script only lays the boxes out.
"""

from __future__ import annotations

import math
from typing import Optional

MEMORY_STEP = "s6.8"  # the seed table's step of what a layer keeps between passes (the KV cache, a state)


def seed_group(step: str) -> str:
    """The seed step a point is drawn under: its first ("s6.1/s6.2" sits at s6.1); s6 (the residual entering the layer)
    at s6.1."""
    first = (step or "").split("/")[0]
    return "s6.1" if first == "s6" else first


def grid(shape: list[int], axes: Optional[list[str]]) -> tuple[int, int, int]:
    """(rows, columns, split) of a box: rows the T axis (or S), columns the product of the others in order; `split`
    the number of slices across when the columns hold more than one axis (heads), else 1. A tensor without a token
    axis (a state) is laid wide: its next-to-last axis or the rest, whichever is shorter, down."""
    if not shape:
        return 1, 1, 1
    named = axes is not None and len(axes) == len(shape)
    r = axes.index("T") if named and "T" in axes else axes.index("S") if named and "S" in axes else None
    if r is None:
        if len(shape) == 1:  # a vector: one row
            return 1, shape[0], 1
        r = len(shape) - 2
        rest = math.prod(shape[:r] + shape[r + 1:])
        if shape[r] > rest:
            return rest, shape[r], 1
    across = shape[:r] + shape[r + 1:]
    cols = math.prod(across) if across else 1
    return shape[r], cols, across[0] if len(across) > 1 else 1


def shape_text(shape: list[int], axes: Optional[list[str]]) -> str:
    """[T=5, H=9, Dh=64] where the axes are named, else [5, 9, 64]."""
    if axes and len(axes) == len(shape):
        return "[" + ", ".join(f"{a}={n}" for a, n in zip(axes, shape)) + "]"
    return "[" + ", ".join(map(str, shape)) + "]"


def recorded(table: dict) -> dict[tuple[int, Optional[int]], list[tuple[str, list[int]]]]:
    """Every recorded shape: (step, layer) -> [(name, shape)], layer None outside the layers."""
    at: dict[tuple[int, Optional[int]], list[tuple[str, list[int]]]] = {}
    for name, rows in table.items():
        for r in rows:
            at.setdefault((r["step"], r["layer"]), []).append((name, r["shape"]))
    return at


def cache_slots(steps: list[dict]) -> dict[int, Optional[int]]:
    """The slots the cache holds after each step's pass: a batch's padded length (its tensors' S), else the row's."""
    return {s["step"]: (s.get("kv") or {}).get("batch_seq_len") or (s.get("kv") or {}).get("seq_len") for s in steps}


class Boxes:
    """One trace's boxes, worked out from its recorded shapes and declared memory: `entries` and `groups` are kept
    once, and each view (`of`) lists indices into them. `title(sid, kind)` is a seed step's group title under a kind
    of layer (None outside the layers)."""

    def __init__(self, d: dict, w, title):
        self.w, self.title = w, title
        self.at = recorded(d["tensors"]["points"])
        self.declared = {p["name"]: p for p in d["points"]}
        self.order = {p["name"]: i for i, p in enumerate(d["points"])}
        self.mem = d["run"]["model"].get("memory") or []
        self.layer_kind = ((d.get("maths") or {}).get("record") or {}).get("layer_kind") or []
        self.seq = cache_slots(d["steps"])
        self.entries: list[dict] = []
        self.groups: list[dict] = []
        self.entry_ix: dict[tuple, int] = {}
        self.group_ix: dict[tuple, int] = {}

    def entry(self, name: str, label: str, shape: list[int], axes: Optional[list[str]], role: str, model: bool) -> int:
        """The index of a box, kept once."""
        key = (name, label, tuple(shape), tuple(axes or ()), role, model)
        if key not in self.entry_ix:
            rows, cols, split = grid(shape, axes)
            n = math.prod(shape)
            self.entry_ix[key] = len(self.entries)
            self.entries.append({"name": name, "label": label, "shape": shape, "axes": axes, "n": n, "rows": rows,
                                 "cols": cols, "split": split, "text": shape_text(shape, axes),
                                 "count": self.w("sizes.count", n=f"{n:,}"), "role": role, "model": model,
                                 "note": self.w(f"sizes.role.{role}") if role else ""})
        return self.entry_ix[key]

    def kind(self, layer: Optional[int]) -> Optional[int]:
        """The kind of a layer in the maths record (None outside the layers or without one)."""
        return self.layer_kind[layer] if layer is not None and layer < len(self.layer_kind) else None

    def group(self, sid: str, layer: Optional[int]) -> int:
        """A seed step's group, titled as the layer's kind teaches it (a linear-attention layer's s6.3 is its
        convolution), else as the seed table does; kept once."""
        title = self.title(sid, self.kind(layer))
        key = (sid, title)
        if key not in self.group_ix:
            self.group_ix[key] = len(self.groups)
            self.groups.append({"id": sid, "title": title})
        return self.group_ix[key]

    def axes_for(self, name: str, shape: list[int]) -> Optional[list[str]]:
        axes = (self.declared.get(name) or {}).get("axes")
        return list(axes) if axes and len(axes) == len(shape) else None

    def of(self, step: int, layer: Optional[int]) -> list[tuple[str, int]]:
        """(seed group, entry) of one step's recorded points in a layer (or outside the layers), in forward order,
        then the layer's memory at s6.8 (`memory`)."""
        here = sorted(self.at.get((step, layer), []), key=lambda x: self.order.get(x[0], len(self.order)))
        m = self.mem[layer] if layer is not None and layer < len(self.mem) else None
        constants = {tuple(s): k for k, s in ((m or {}).get("constant") or {}).items()}
        out, seen_state = [], set()
        for name, shape in here:
            sid = seed_group((self.declared.get(name) or {}).get("step") or "")
            role = "state" if sid == MEMORY_STEP and tuple(shape) in constants else ""
            if role:
                seen_state.add(tuple(shape))
            out.append((sid, self.entry(name, name, shape, self.axes_for(name, shape), role, layer is None)))
        if m is not None and m.get("reads") is None:
            out += self.memory(m, self.seq.get(step), constants, seen_state)
        return out

    def memory(self, m: dict, slots: Optional[int], constants: dict, seen_state: set) -> list[tuple[str, int]]:
        """A layer's memory at s6.8: the cache it grows (its entries × the `slots` after this pass), and the constant
        state it keeps where no recorded point is that state."""
        out = []
        for key, per in (m.get("per_token") or {}).items():
            if slots is None:
                break
            own = (self.declared.get(key) or {}).get("axes") or []
            named = ["S"] + [a for a in own if a != "T"] if len(own) == len(per) + 1 else None
            out.append((MEMORY_STEP, self.entry(f"cache.{key}", self.w("sizes.cache", name=key), [slots, *per], named,
                                                "cache", False)))
        for shape, key in constants.items():
            if shape not in seen_state:
                out.append((MEMORY_STEP, self.entry(f"state.{key}", self.w("sizes.state", name=key), list(shape),
                                                    None, "state", False)))
        return out

    def views(self, steps: list[int], layers: list[int]) -> tuple[dict[str, dict], int]:
        """{"STEP/LAYER" ("m" for the model's without layers): {"g": [[group, [entry, ...]], ...] in the seed table's
        order, "max": its largest own entry}}, and the scale's measure: the most elements of one view's own boxes
        (its layer's; the model's without layers)."""
        from llmtrace.report.data import SEED_TABLE

        rank = {sid: i for i, sid in enumerate(SEED_TABLE)}
        views: dict[str, dict] = {}
        ref = 0
        for step in steps:
            model_boxes = self.of(step, None)
            for layer in layers or [None]:
                own = self.of(step, layer) if layer is not None else model_boxes
                by: dict[str, list[int]] = {}
                for sid, e in sorted(model_boxes + own if layer is not None else own,
                                     key=lambda b: rank.get(b[0], len(rank))):  # a stable sort: forward order kept
                    by.setdefault(sid, []).append(e)
                ref = max(ref, sum(self.entries[e]["n"] for _, e in own))
                views[f"{step}/{'m' if layer is None else layer}"] = {
                    "g": [[self.group(sid, layer), es] for sid, es in by.items()],
                    "max": max((e for _, e in own), key=lambda e: self.entries[e]["n"]) if own else None}
        return views, ref

    def layer_words(self, layers: list[int], kinds: list[str]) -> dict[str, str]:
        """Each layer's name in the select, with its kind's words where the model has layers of more than one kind."""
        lk = self.layer_kind
        return {str(lay): self.w("sizes.layer", layer=lay) + (
            f" · {kinds[lk[lay]]}" if lay < len(lk) and lk[lay] < len(kinds) and len(set(lk)) > 1 else "")
            for lay in layers}


def data(d: dict, w, titles: list[dict], step_title, kinds: list[str]) -> Optional[dict]:
    """The boxes the script draws: {"entries": [box, ...], "groups": [{id, title}], "views": {"STEP/LAYER": [[group,
    [entry, ...]], ...]}, "steps", "layers", "layer_words", "seq"}. A box is {name, label, shape, axes, n, rows, cols,
    split, text, count, role} (role "" a tensor of the pass, "cache" what grows a row each token, "state" what keeps
    its size); entries and groups are kept once and the views index them. None without recorded shapes. The page's
    words: `titles` the seed steps each kind of layer titles its own way, `step_title(sid)` the seed table's title
    and `kinds` each kind of layer's words (report.page's kind_titles, step_title and kind_words)."""
    if not d["tensors"]["points"]:
        return None

    def title(sid: str, kind: Optional[int]) -> str:
        return (titles[kind].get(sid) if kind is not None and kind < len(titles) else None) or (
            step_title(sid) if w.has(f"step.{sid}") else sid)

    boxes = Boxes(d, w, title)
    steps = sorted({s for s, _ in boxes.at})
    layers = sorted({lay for _, lay in boxes.at if lay is not None})
    views, ref = boxes.views(steps, layers)
    return {"entries": boxes.entries, "groups": boxes.groups, "views": views, "steps": steps, "layers": layers,
            "ref": ref, "layer_words": boxes.layer_words(layers, kinds),
            "seq": {str(k): v for k, v in boxes.seq.items()}}


SCRIPT_WORDS = ("scale", "step", "nearest", "broken", "whole", "break", "folded")


def packed(s: dict, w) -> dict:
    """The section's data as the script reads it: each box a list [name, label (0: its name), shape, rows, cols,
    split, text, role, 1 outside the layers] (a decode step adds a few boxes whose S grew: a 64-step page stays
    small), the counts and the roles' notes in the page's words."""
    boxes = [[e["name"], 0 if e["label"] == e["name"] else e["label"], e["shape"], e["rows"], e["cols"], e["split"],
              e["text"], e["role"], int(e["model"])] for e in s["entries"]]
    words = {k: w(f"sizes.js.{k}") for k in SCRIPT_WORDS}
    words.update({"count": w("sizes.count"), "cache": w("sizes.role.cache"), "state": w("sizes.role.state")})
    lists: list[dict] = []  # the layers of one kind draw the same boxes at a step: each distinct view kept once
    seen: dict[str, int] = {}
    views: list[list[int]] = []  # views[i][j]: the view of step steps[i] in layer layers[j] (or the model's)
    for step in s["steps"]:
        views.append([])
        for layer in s["layers"] or ["m"]:
            v = s["views"][f"{step}/{layer}"]
            k = seen.setdefault(repr(v), len(lists))
            if k == len(lists):
                lists.append(v)
            views[-1].append(k)
    out = {k: v for k, v in s.items() if k != "layer_words"}  # the layers' names are the select's, in the page
    return dict(out, entries=boxes, words=words, views=views, lists=lists)


def section(d: dict, *, kind_titles, kind_words, step_title, missing) -> Optional[dict]:
    """The section: its layer choice and the data the script draws from (its own <script>: the page's main data does
    not carry it). The script writes each box's caption (its name, shape and count), the text the drawing stands for;
    before any script runs, the pipeline section above lists the same shapes. The page passes in its own functions
    of the same names (report.page: its titles of the seed steps and of the kinds of layer, its note on what a trace
    lacks), so that this module does not import the page."""
    if d["kind"] != "generate":  # a generate page's section: explain and lens pages show a layer, not a pass
        return None
    w = d["w"]
    s = data(d, w, kind_titles(d, w.lang), lambda sid: step_title(w, sid, d), kind_words(d, w))
    if s is None:
        note = missing(d, "sizes", "`trace='layers'` or `trace='full'`")
        return {"only_missing": note} if note else None
    s["step_of"] = [[st["step"], w(f"phase.{st['phase']}") if w.has(f"phase.{st['phase']}") else st["phase"]]
                    for st in d["steps"]]  # the page's steps in the step bar's order (its event gives an index)
    batch = d.get("batch")
    return {"layers": [{"layer": lay, "label": s["layer_words"][str(lay)]} for lay in s["layers"]],
            "data": packed(s, w), "batch": w("sizes.batch", b=batch["rows"]) if batch else None}
