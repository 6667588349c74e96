"""Attribution patching (issue 49 item 4): `llmtrace patch --method attribution`.

The estimate of each cell is the first-order term of patching it, (clean − corrupt) · ∂m/∂a at the corrupt run. On
families with the parts that make a gradient hard (Gemma 2's soft-caps and sandwich norms, Qwen3.5's recurrence,
Mixtral's and gpt-oss's routing, sinks), with the model in float64, each estimate equals the derivative of the truly
patched metric along that direction, by central differences: residual (layer, position) cells and (layer, head)
cells, every one. The full patches' exact effects (the sweep's, and each head patched alone) are checked against
the estimates in `agreement`, whose figures are what a user is shown.
"""

import copy
import json

import pytest
import torch

from llmtrace.run.attribution_patching import agreement, attribution_sweep, estimate
from llmtrace.run.patching import patch_sweep

CLEAN, CORRUPT = "the quick brown fox jumps", "the quick brown box jumps"  # the same number of tokens in tiny.py's BPE
ANSWER, AGAINST = "e", "a"
EPS = 1e-3
# The model is float64 but for what it keeps in float32 as transformers does (attention probabilities, router and
# sink softmaxes, Qwen3.5's recurrence): their rounding, ~1e-7 of a metric of ~10 over a step of 2·EPS, is ~1e-4 at
# most (measured: 7e-4 at EPS 1e-4, 7e-5 at 1e-3); the central difference's own error, EPS² times the third
# derivative along a direction as long as clean − corrupt, is 8e-3 at EPS 1e-2 and 1e-4 at 1e-3 on Qwen3.5's worst
# cell.
TOL = dict(abs=3e-4, rel=1e-3)
# A head patched at every position moves further than one cell, so its central differences are extrapolated
# (Richardson). A linear-attention head's output goes through an RMSNorm of its own (x/|x|, curving hard where |x| is
# small): measured on Qwen3.5's fixture, 11 of its 12 linear heads agree within 3e-4, the 12th within 1.2e-2
HEAD_TOL_LINEAR = dict(abs=3e-4, rel=2e-2)


def float64(lm):
    twin = copy.copy(lm)
    twin.model = copy.deepcopy(lm.model).double()
    return twin


def patched_metric(model, ids, answer, against, layer, point, where, delta) -> float:
    """The metric with `delta` added to `point` of `layer` at index `where` (a position, or (slice, head))."""
    def hook(i, name, x):
        if i == layer and name == point:
            x = x.clone()
            x[(slice(None),) + where] += delta
            return x
        return None

    with torch.no_grad(), model.hooked(hook, layers=[layer], spell_out=False):
        last = model(torch.tensor([ids]))[0, -1]
    return float(last[answer] - last[against])


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_5", "mixtral", "gpt_oss", "olmo2"])
def test_each_estimate_is_the_derivative_of_the_patched_metric(loaded, name):
    lm = float64(loaded(name, "hf"))
    tok, model = lm.tokenizer, lm.model
    clean, corrupt = tok.encode_prompt(CLEAN)[1], tok.encode_prompt(CORRUPT)[1]
    a, b = (tok.encode(t, add_special_tokens=False)[0] for t in (ANSWER, AGAINST))
    at = "resid_post"
    est = estimate(lm, clean, corrupt, a, b, at)
    acts = {}
    for ids, side in ((clean, "clean"), (corrupt, "corrupt")):
        with torch.no_grad(), model.hooked(lambda i, n, x, s=side: acts.__setitem__((s, i, n), x.clone())):
            model(torch.tensor([ids]))
    for layer in range(lm.config.n_layers):
        d = acts[("clean", layer, at)] - acts[("corrupt", layer, at)]  # (1, T, D)
        for p in range(len(corrupt)):
            f = lambda e: patched_metric(model, corrupt, a, b, layer, at, (p,), e * d[0, p])  # noqa: E731
            assert float(est["resid"][layer, p]) == pytest.approx((f(EPS) - f(-EPS)) / (2 * EPS), **TOL)
        point = model.heads_points()[layer]
        dz = acts[("clean", layer, point)] - acts[("corrupt", layer, point)]  # (1, T, H, Dh)
        for h in range(dz.size(2)):
            f = lambda e: patched_metric(model, corrupt, a, b, layer, point, (slice(None), h), e * dz[0, :, h])  # noqa
            d1, d2 = ((f(e) - f(-e)) / (2 * e) for e in (2 * EPS, EPS))
            tol = HEAD_TOL_LINEAR if point == "delta_out" else TOL
            assert float(est["heads"][layer, h]) == pytest.approx((4 * d2 - d1) / 3, **tol)  # Richardson: O(EPS⁴)


def test_the_sweep_reports_its_agreement_with_the_exact_grids(loaded):
    lm = loaded("llama", "hf")
    ev = attribution_sweep(lm, CLEAN, CORRUPT, ANSWER, AGAINST, check=True, top_k=5)
    exact = patch_sweep(lm, CLEAN, CORRUPT, ANSWER, AGAINST)
    L, T, H = lm.config.n_layers, ev["n_positions"], lm.config.n_heads
    assert ev["method"] == "attribution" and len(ev["cells"]) == L * T and len(ev["heads"]) == L * H
    assert ev["corrupt_metric"] == pytest.approx(exact["corrupt_metric"], abs=1e-5)
    for c, e in zip(ev["cells"], exact["cells"]):
        assert c["exact"] == pytest.approx(e["metric"] - exact["corrupt_metric"], abs=1e-4)
        assert c["metric"] == pytest.approx(ev["corrupt_metric"] + c["estimate"], abs=1e-4)
    for grid in ("resid", "heads"):
        got = ev["agreement"][grid]
        cells = ev["cells"] if grid == "resid" else ev["heads"]
        want = agreement(torch.tensor([c["estimate"] for c in cells]), torch.tensor([c["exact"] for c in cells]), 5)
        assert got["pearson"] == pytest.approx(want["pearson"], abs=1e-5)  # from the rounded cells here
        assert (got["overlap"], got["cells"]) == (want["overlap"], want["cells"]) and 0 <= got["overlap"] <= 5
    json.dumps(ev)



def test_the_figures_docs_report_on_the_real_gemma_3(gemma3_path):
    """docs/compare.md and docs/research-api.md give attribution patching's agreement on the real Gemma 3 270M (the
    suite's Q4_K_M GGUF in float32): these are its figures, to the digits the pages print."""
    from llmtrace.checkpoint.load import load_model

    lm = load_model(str(gemma3_path), device="cpu", dtype="float32")
    ev = attribution_sweep(lm, "The Eiffel Tower is in the city of", "The Colosseum is in the city of", " Paris",
                           " Rome", check=True)
    assert (ev["n_layers"], ev["n_positions"]) == (18, 9)
    assert (ev["clean_metric"], ev["corrupt_metric"]) == (pytest.approx(3.996, abs=5e-4),
                                                          pytest.approx(-11.032, abs=5e-4))
    resid, heads = ev["agreement"]["resid"], ev["agreement"]["heads"]
    assert (resid["cells"], heads["cells"]) == (162, 72)
    assert resid["pearson"] == pytest.approx(0.919, abs=5e-4) and resid["overlap"] == 7
    assert heads["pearson"] == pytest.approx(0.973, abs=5e-4) and heads["overlap"] == 9

def test_agreement_counts_what_it_says():
    x = torch.tensor([3.0, -2.0, 0.5, 0.1, float("nan")])
    assert agreement(x, 2 * x, 2) == {"pearson": 1.0, "top_k": 2, "overlap": 2, "cells": 4}
    assert agreement(x, -x, 1)["pearson"] == -1.0
    assert agreement(x, torch.tensor([0.1, 0.5, -2.0, 3.0, 1.0]), 2)["overlap"] == 0


def test_the_command(families, capsys, tmp_path, monkeypatch):
    from helpers import run_cli

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    out = tmp_path / "atp.json"
    code, out_text, err = run_cli(capsys, "patch", "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", ANSWER,
                                  "--against", AGAINST, "-m", families.hf_dir("llama"), "--method", "attribution",
                                  "--check", "--json", out)
    assert code == 0, err
    code, _, err = run_cli(capsys, "patch", "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", ANSWER, "--against",
                           AGAINST, "-m", families.hf_dir("llama"), "--check")
    assert code == 2 and "--method attribution" in err
    ev = json.loads(out.read_text())["events"][0]
    assert ev["method"] == "attribution" and set(ev["agreement"]) == {"resid", "heads"}
    assert "Pearson r" in out_text
