"""`llmtrace diff TRACE_A TRACE_B`: two saved runs of one prompt, compared without a model.

With tensors (both runs saved with `generate --save-tensors`): the figures of `llmtrace compare` at every recorded
point and position, from the two files (run.compare's metrics, the same code). Step 0 (the prefill) covers the prompt's
positions, decode step k the position it fed. Decode steps are compared while both runs had generated the same tokens
(beyond that they read different inputs). KLD / same top / dp where the logits were recorded (the last position of
each pass: generation computes no other). What diff cannot give is the error a layer adds: that needs B's layer run on
A's input, so `added_rel_err` is null.

Without tensors: what the traces hold. The tokens (where they first differ), each step's top-k (same top-1, dp of A's
top token where B's top-k holds it), the sampler ledger (stages whose survivors differ) and the statistics of each
recorded point (mean, std, min, max, norm); the first divergence is then the first point, in forward order, whose
norm differs by more than the tolerance (| ||a|| - ||b|| | / ||a||, a lower bound of the relative error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from llmtrace.errors import LlmtraceError
from llmtrace.model.llama_points import LAST, LOGITS
from llmtrace.run.interventions import layer_output
from llmtrace.trace.reader import trace_points
from llmtrace.run.compare import (CompareResult, PointSums, answer_metrics, compared_points, position_axis,
                                  find_first_divergence, label_divergence, round_sig, summarize_answers)
from llmtrace.units import plural



def _forward(key: tuple, points) -> tuple:
    """A (step, layer, point) key's place in forward order: by step, then the model's points before the layers, each
    layer's in the order the model declares them, the model's points after the layers."""
    step, layer, name = key
    order = points.names()
    where = (-1 if name in points.names(layer=False)[: len(points.before)] else 10**6) if layer is None else layer
    return step, where, order.index(name) if name in order else len(order)


def diff_traces(trace_a: str, trace_b: str, *, tolerance: float = 1e-4, tensors: bool = True) -> CompareResult:
    """Compare two saved traces. `tensors=False` compares what the traces hold even when tensors were saved."""
    from llmtrace.trace.reader import load_trace

    ev_a, ev_b = load_trace(trace_a), load_trace(trace_b)
    run_a, run_b = _single_run(ev_a, trace_a), _single_run(ev_b, trace_b)
    ids_a, ids_b = _prompt_ids(ev_a, trace_a), _prompt_ids(ev_b, trace_b)
    if ids_a != ids_b:
        raise LlmtraceError(f"{trace_a} and {trace_b} are runs of different prompts ({run_a.get('prompt', '')!r} and "
                            f"{run_b.get('prompt', '')!r}); diff compares two runs of the same prompt")
    gen_a, gen_b = _generated(ev_a), _generated(ev_b)
    same_gen = 0
    while same_gen < min(len(gen_a), len(gen_b)) and gen_a[same_gen] == gen_b[same_gen]:
        same_gen += 1
    notes = []
    if gen_a != gen_b:
        notes.append(f"the generated tokens part at step {same_gen + 1}; later steps read different inputs and are "
                     f"compared only by what they chose")
    files = [_tensors_file(run_a, trace_a), _tensors_file(run_b, trace_b)] if tensors else [None, None]
    a, b = _side(run_a, trace_a, files[0]), _side(run_b, trace_b, files[1])
    for what, key in (("layers", "n_layers"), ("width (d_model)", "d_model"), ("vocabulary", "vocab_size")):
        if a[key] != b[key]:
            raise LlmtraceError(f"the runs cannot be compared point by point: their models' {what} differ "
                                f"(A {a[key]}, B {b[key]})")
    points = trace_points(ev_a)
    holds = _what_traces_hold(ev_a, ev_b, tolerance, gen_a, gen_b, same_gen, points)
    if files[0] and files[1]:
        from llmtrace.trace.tensors import read_tensors

        ta = read_tensors(files[0][0], files[0][1], trace_a)
        tb = read_tensors(files[1][0], files[1][1], trace_b)
        return _diff_tensors(ta, tb, a, b, run_a, ids_a, gen_a, same_gen, tolerance, holds, notes, points)
    if tensors and (files[0] or files[1]):
        notes.append(f"only {'A' if files[0] else 'B'} saved its tensors; comparing what the traces hold")
    return _diff_holdings(a, b, run_a, ids_a, gen_a, tolerance, holds, notes)


# ----------------------------------------------------------------------------------------------------------------
# reading the traces


def _side(run: dict, trace: str, tensors: Optional[tuple[Path, str]]) -> dict:
    """What the output says about one side: its run event's model, dtype and device, the trace and tensors files."""
    m = run["model"]
    return {"model": m["name"], "source": m.get("source", ""), "arch": m.get("arch", ""), "dtype": run.get("dtype", ""),
            "device": run.get("device", ""), "n_layers": m["n_layers"], "d_model": m["d_model"],
            "n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"], "vocab_size": m["vocab_size"], "trace": trace,
            "tensors": str(tensors[0]) if tensors else None}


def _single_run(events: list[dict], trace: str) -> dict:
    run = next((e for e in events if e["event"] == "run"), None)
    if run is None:
        raise LlmtraceError(f"{trace}: no run event; diff compares traces written by generate")
    if run.get("batch"):
        raise LlmtraceError(f"{trace} is a batch of {run['batch']} prompts; diff compares runs of one prompt")
    return run


def _prompt_ids(events: list[dict], trace: str) -> list[int]:
    tok = next((e for e in events if e["event"] == "tokens"), None)
    if tok is None:
        raise LlmtraceError(f"{trace}: no tokens event")
    return [t["id"] for t in tok["tokens"]]


def _generated(events: list[dict]) -> list[int]:
    return [e["token"]["id"] for e in events if e["event"] == "step"]


def _tensors_file(run: dict, trace: str) -> Optional[tuple[Path, str]]:
    """(the tensors file a trace names, its key), the file looked for beside the trace first; None without one."""
    rec = run.get("tensors")
    if not rec:
        return None
    named = Path(rec["file"])
    beside = Path(trace).parent / named.name
    path = named if named.is_absolute() and named.exists() else beside if beside.exists() else named
    return path, rec["key"]


# ----------------------------------------------------------------------------------------------------------------
# with tensors


def _diff_tensors(ta, tb, a, b, run_a, ids, gen, same_gen, tolerance, holds, notes, points) -> CompareResult:
    n_prompt = len(ids)
    max_step = same_gen  # decode step k reads generated token k (1-based): comparable while tokens 1..k agree
    acc, logits = _tensor_sums(ta, tb, n_prompt, max_step, points)
    order = sorted({p for sums in acc.values() for p in sums})  # every compared position, in sequence order
    index = {p: i for i, p in enumerate(order)}
    answers = _answers_from_logits(logits)
    positions = _tensor_positions(order, index, ids + gen, n_prompt, answers, logits[2])
    _texts(positions, holds)
    layers, model_points = _tensor_records(acc, index, len(order), a["n_layers"], points)
    unrecorded = [lay["layer"] for lay in layers if not lay["points"]]
    if unrecorded:
        notes.append(f"{len(unrecorded)} of {plural(a['n_layers'], 'layer')} "
                     f"{'was' if len(unrecorded) == 1 else 'were'} not recorded by both runs "
                     f"({_spans(unrecorded)}): the first divergence is the first among the recorded points")
    first, before = find_first_divergence(model_points, layers, tolerance)
    summary = summarize_answers(answers) if answers else {"kld_mean": None, "kld_max": None, "same_top": None,
                                                          "dp_mean_abs": None}
    if not answers:
        notes.append("no logits were saved (record them with `trace='full'` or `dump=['logits']`); KLD is not known")
    return CompareResult(a=a, b=b, prompt=run_a.get("prompt", ""), ids=(ids + gen)[: n_prompt + max_step],
                         n_prompt=n_prompt, tolerance=tolerance, layers=layers, model_points=model_points,
                         positions=positions, first_divergence=label_divergence(first, positions),
                         max_rel_err_before=before, source="diff", notes=notes, diff=holds, **summary)


def _tensor_sums(ta, tb, n_prompt: int, max_step: int, points) -> tuple[dict, tuple[list, list, list]]:
    """The per-position sums of every point both runs saved, {(layer, point): {position: (d2, a2, b2, dot, max_abs)}}
    in forward order, and the logits of the last position of each pass: (A's, B's, their positions)."""
    from llmtrace.trace.tensors import parse_tensor_name

    common = sorted((parse_tensor_name(k) for k in ta if k in tb and parse_tensor_name(k)[0] <= max_step),
                    key=lambda t: _forward(t, points))
    if not common:
        raise LlmtraceError("the two runs' tensors have no point in common (compare the trace levels and layers they "
                            "recorded)")
    acc: dict = {}
    compared = compared_points(points)
    logits_a, logits_b, logit_pos = [], [], []
    for step, layer, point in common:
        name = f"{step}/{'model' if layer is None else layer}/{point}"
        xa, xb = ta[name], tb[name]
        if xa.shape != xb.shape:
            raise LlmtraceError(f"the tensors of {point} (layer {layer}, step {step}) have different shapes: "
                                f"A {list(xa.shape)}, B {list(xb.shape)}")
        pos = list(range(n_prompt)) if step == 0 else [n_prompt + step - 1]  # the positions the pass read
        if point in (LAST.name, LOGITS.name) and xa.dim() == 1:  # the step's last position only (generation's last_only)
            pos, xa, xb = pos[-1:], xa[None], xb[None]
            if point == LOGITS.name:
                logits_a.append(xa[0])
                logits_b.append(xb[0])
                logit_pos.append(pos[0])
        if point not in compared or point == LAST.name:
            continue  # last is the logits' input, kv_write and k_repeated are no activations of their own
        axis = position_axis(points, point) - 1  # the stored tensors have no batch dimension
        got = PointSums().add(xa, xb, axis)
        sums = acc.setdefault((layer, point), {})
        for j, p in enumerate(pos):
            sums[p] = (got.d2[j], got.a2[j], got.b2[j], got.dot[j], got.max_abs[j])
    return acc, (logits_a, logits_b, logit_pos)


def _answers_from_logits(logits: tuple[list, list, list]) -> dict:
    import torch

    logits_a, logits_b, _ = logits
    return answer_metrics(torch.stack(logits_a), torch.stack(logits_b)) if logits_a else {}


def _tensor_positions(order: list[int], index: dict, seq: list[int], n_prompt: int, answers: dict,
                      logit_pos: list[int]) -> list[dict]:
    """A record per compared position, with the answers where the logits were saved."""
    by_pos = {p: j for j, p in enumerate(logit_pos)}
    positions = []
    for p in order:
        j = by_pos.get(p)
        rec = {"index": index[p], "position": p, "phase": "prompt" if p < n_prompt else "decode",
               "token": seq[p] if p < len(seq) else None, "text": "", "kld": None, "same_top": None}
        if j is not None:
            rec.update(kld=round_sig(max(answers["kld"][j], 0.0)), same_top=answers["top_a"][j] == answers["top_b"][j],
                       top_a={"id": answers["top_a"][j], "text": ""}, top_b={"id": answers["top_b"][j], "text": ""},
                       p_a=round_sig(answers["p_a"][j]), p_b=round_sig(answers["p_b"][j]), dp=round_sig(answers["dp"][j]))
        positions.append(rec)
    return positions


def _tensor_records(acc: dict, index: dict, n: int, n_layers: int, points) -> tuple[list[dict], dict]:
    """The layer records and the model-level point records, compare's, without the error a layer adds."""
    output = layer_output(points)
    layers = [{"layer": i, "points": []} for i in range(n_layers)]
    model_points = {}
    for (layer, point), sums in acc.items():
        rec = _scattered(point, sums, index, n, points.step_of(point))
        if layer is None:
            model_points[point] = rec
        else:
            layers[layer]["points"].append(rec)
    for lay in layers:
        out = next((p for p in lay["points"] if p["point"] == output), None)
        pts = lay.pop("points")
        lay.update(rel_err=out["rel_err"] if out else None, added_rel_err=None,
                   max_rel_err=max((p["max_rel_err"] or 0.0 for p in pts), default=None), max_added_rel_err=None,
                   points=pts)
    return layers, model_points


def _spans(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _scattered(point: str, sums: dict, index: dict, n: int, step=None) -> dict:
    """A point's record with its per-position lists laid over all n compared positions (None where not recorded)."""
    ps = PointSums()
    pos = sorted(sums)
    for p in pos:
        for lst, v in zip((ps.d2, ps.a2, ps.b2, ps.dot, ps.max_abs), sums[p]):
            lst.append(v)
    rec = ps.record(point, positions=[index[p] for p in pos], step=step)
    full = {k: [None] * n for k in rec["per_position"]}
    for k, vals in rec["per_position"].items():
        for p, v in zip(pos, vals):
            full[k][index[p]] = v
    rec["per_position"] = full
    return rec


def _texts(positions: list[dict], holds: dict) -> None:
    texts = holds.get("_texts", {})
    for p in positions:
        p["text"] = texts.get(p["token"], "")
        for side in ("top_a", "top_b"):
            if side in p:
                p[side]["text"] = texts.get(p[side]["id"], "")


# ----------------------------------------------------------------------------------------------------------------
# what the traces hold


def _what_traces_hold(ev_a, ev_b, tolerance, gen_a, gen_b, same_gen, declared) -> dict:
    steps_a = {e["step"]: e for e in ev_a if e["event"] in ("step", "prediction")}
    steps_b = {e["step"]: e for e in ev_b if e["event"] in ("step", "prediction")}
    texts = {}
    for ev in (ev_a, ev_b):
        for e in ev:
            if e["event"] == "tokens":
                texts.update({t["id"]: t.get("text", "") for t in e.get("tokens", []) if isinstance(t, dict)})
            for c in e.get("topk", []) if e["event"] in ("step", "prediction") else []:
                texts[c["id"]] = c.get("text", "")
            if e["event"] == "step":
                texts[e["token"]["id"]] = e["token"].get("text", "")
    steps = []
    for s in sorted(set(steps_a) & set(steps_b)):
        ea, eb = steps_a[s], steps_b[s]
        ka, kb = ea.get("topk") or [], eb.get("topk") or []
        rec = {"step": s, "position": ea.get("position"), "same_input": s <= same_gen,
               "token_a": ea.get("token", {}).get("id"), "token_b": eb.get("token", {}).get("id")}
        if ka and kb:
            b_prob = {c["id"]: c["prob"] for c in kb}
            rec.update(same_top=ka[0]["id"] == kb[0]["id"], top_a=ka[0]["id"], top_b=kb[0]["id"],
                       p_a=ka[0]["prob"], p_b=b_prob.get(ka[0]["id"]),
                       topk_overlap=len({c["id"] for c in ka} & set(b_prob)) / max(len(ka), 1))
            if rec["p_b"] is not None and rec["p_a"] is not None:
                rec["dp"] = round_sig(rec["p_b"] - rec["p_a"])
        la, lb = ea.get("sampler") or [], eb.get("sampler") or []
        differing = [{"stage": x["stage"], "survivors_a": x["survivors"], "survivors_b": y["survivors"]}
                     for x, y in zip(la, lb) if x["stage"] == y["stage"] and x["survivors"] != y["survivors"]]
        if la and lb:
            rec["sampler_differs"] = differing
        steps.append(rec)
    stats_a = {(e["step"], e["layer"], e["name"]): e["stats"] for e in ev_a if e["event"] == "tensor" and "row" not in e}
    stats_b = {(e["step"], e["layer"], e["name"]): e["stats"] for e in ev_b if e["event"] == "tensor" and "row" not in e}
    common = [k for k in stats_a if k in stats_b]
    if (stats_a or stats_b) and not common:
        raise LlmtraceError("the traces have no recorded point in common (compare the trace levels and layers they "
                            "recorded)")
    common.sort(key=lambda k: _forward(k, declared))
    points, first, before = [], None, 0.0  # before: the largest norm difference before the first over the tolerance
    for k in common:
        sa, sb = stats_a[k], stats_b[k]
        na, nb = sa.get("norm"), sb.get("norm")
        rel = (abs(na - nb) / na if na else abs(nb or 0)) if na is not None and nb is not None else None
        rec = {"step": k[0], "layer": k[1], "point": k[2], "seed_step": declared.step_of(k[2]), "norm_rel_diff": round_sig(rel),
               **{f"{s}_a": sa.get(s) for s in ("mean", "std", "min", "max", "norm")},
               **{f"{s}_b": sb.get(s) for s in ("mean", "std", "min", "max", "norm")}}
        points.append(rec)
        if first is None and rel is not None and k[0] <= same_gen:
            if rel > tolerance:
                first = {"layer": k[1], "point": k[2], "seed_step": declared.step_of(k[2]), "position": None,
                         "step": k[0], "rel_err": round_sig(rel), "basis": "norm"}
            else:
                before = max(before, rel)
    part = next((i for i, (x, y) in enumerate(zip(gen_a, gen_b)) if x != y), None)
    return {"tokens": {"a": gen_a, "b": gen_b, "first_different_step": None if part is None else part + 1,
                       "same": gen_a == gen_b},
            "steps": steps, "statistics": {"compared": len(common), "first_difference": first,
                                           "max_norm_diff_before": round_sig(before), "points": points},
            "_texts": texts}


def _diff_holdings(a, b, run_a, ids, gen, tolerance, holds, notes) -> CompareResult:
    """The comparison from what the traces hold: positions are the steps' (their top-k), no per-position tensors."""
    positions = []
    for s in holds["steps"]:
        if "same_top" not in s:
            continue
        positions.append({"index": len(positions), "position": s["position"] - 1 if s["position"] else 0,
                          "phase": "prompt" if s["step"] == 0 else "decode", "step": s["step"],
                          "token": (ids + gen)[s["position"] - 1] if s["position"] else ids[0], "text": "",
                          "kld": None, "same_top": s["same_top"], "top_a": {"id": s["top_a"], "text": ""},
                          "top_b": {"id": s["top_b"], "text": ""}, "p_a": s.get("p_a"), "p_b": s.get("p_b"),
                          "dp": s.get("dp")})
    _texts(positions, holds)
    n = len(positions)
    dps = [abs(p["dp"]) for p in positions if p.get("dp") is not None]
    first = holds["statistics"]["first_difference"]
    notes.append("no tensors: the first divergence is judged from each point's norm (a lower bound of its relative "
                 "error); KLD needs the full logits (`save_tensors`)")
    return CompareResult(a=a, b=b, prompt=run_a.get("prompt", ""), ids=ids + gen, n_prompt=len(ids),
                         tolerance=tolerance, layers=[], model_points={}, positions=positions, first_divergence=first,
                         max_rel_err_before=holds["statistics"]["max_norm_diff_before"], kld_mean=None, kld_max=None,
                         same_top=(sum(p["same_top"] for p in positions) / n) if n else None,
                         dp_mean_abs=(sum(dps) / len(dps)) if dps else None, source="diff", notes=notes, diff=holds)
