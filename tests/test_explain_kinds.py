"""explain's own sections for the kinds of layer whose memory is not Llama's K and V, on tiny random checkpoints
(tests/families.py): what each keeps per token against MHA and GQA, and the step it turns on, worked on the pass's
own numbers. A wrong latent is seen."""

from __future__ import annotations

import pytest

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    import llmtrace
    from families import FAMILIES, write_hf_dir

    path = tmp_path_factory.mktemp("explain-kinds") / "deepseek_v3"
    write_hf_dir(path, FAMILIES["deepseek_v3"])
    return llmtrace.load(str(path), threads=1)


def latent_of(events: list[dict]) -> dict:
    return next(e for e in events if e.get("section") == "latent_cache")


def test_an_mla_layer_shows_its_latent_beside_mha_and_gqa(deepseek):
    """deepseek_v3's fixture: R = 16, Dr = 8, H = 4 heads of Dn + Dr = 16 and Dv = 12 (tests/families.py)."""
    ev = latent_of(deepseek.explain(PROMPT, layer=1).events)
    z = ev["sizes"]
    assert (z["R"], z["Dr"], z["H"], z["Dn"] + z["Dr"], z["Dv"]) == (16, 8, 4, 16, 12)
    assert ev["latent_numbers"] == 24 and ev["latent_bytes"] == 24 * 4  # float32
    assert [(r["kv_heads"], r["numbers"]) for r in ev["cache_rows"]] == [(4, 112), (2, 56), (1, 28)]
    assert ev["form"] == "up_projected"


def test_the_absorbed_form_gives_the_pass_s_scores_and_output(deepseek):
    w = latent_of(deepseek.explain(PROMPT, layer=1, head=2).events)["worked"]
    assert w["slots"] == w["position"] + 1 and len(w["scores_up"]) == 6
    assert w["scores_diff"] <= 1e-9 * max(1.0, *map(abs, w["scores_up"]))  # the same scores, both in float64
    assert w["out_diff"] <= 1e-9 and w["out_pass_diff"] <= 1e-5  # the same output, and the pass's (float32)
    S, R, H = w["slots"], 16, 4
    assert w["flops_up"] == 2 * S * R * H * (8 + 12) and w["flops_absorbed"] == 2 * H * R * (8 + 12)


def test_a_wrong_latent_is_seen(deepseek):
    """The section's output, made from the captured latents, is checked against the pass's own output: a latent
    changed after the pass (one entry of one slot) no longer gives it."""
    from llmtrace.model.kinds.mla import C_KV
    from llmtrace.run.explain import capture
    from llmtrace.model.kinds.mla import latent_section

    lm = deepseek.loaded
    ids = lm.tokenizer.encode(PROMPT)
    cap = capture(lm.model, ids, 1)
    assert latent_section(cap, lm.model, lm.maths)["worked"]["out_pass_diff"] <= 1e-5
    cap.points[C_KV.name] = cap.points[C_KV.name].clone()
    cap.points[C_KV.name][0, 0] += 1.0
    assert latent_section(cap, lm.model, lm.maths)["worked"]["out_pass_diff"] > 1e-3


def test_explain_draws_the_latent_in_both_languages(deepseek):
    from llmtrace.report.explain_view import explain_blocks

    events = deepseek.explain(PROMPT, layer=1).events
    for lang, words in (("en", "why the up-projection can be absorbed"), ("zh", "为什么上投影可以被吸收")):
        text = "\n".join("".join(g["text"] for g in b["segments"]) for b in explain_blocks(events, lang)
                         if b["kind"] != "table" and b["kind"] != "grid")
        assert words in text and "✗" not in text, text


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    import llmtrace
    from families import FAMILIES, write_hf_dir

    path = tmp_path_factory.mktemp("explain-kinds") / "lfm2"
    write_hf_dir(path, FAMILIES["lfm2"])
    return llmtrace.load(str(path), threads=1)


def test_a_convolution_layer_is_worked_on_one_channel(lfm2):
    """lfm2's fixture: layer 0 a short convolution of 3 taps over D = 64 channels (tests/families.py)."""
    ev = next(e for e in lfm2.explain(PROMPT, layer=0).events if e.get("section") == "convolution")
    t, L = ev["position"], ev["kernel"]
    assert (L, ev["width"]) == (3, 64) and [r["position"] for r in ev["rows"]] == [t - 2, t - 1, t]
    assert abs(sum(r["product"] for r in ev["rows"]) - ev["sum"]) <= 1e-4 * max(1.0, abs(ev["sum"]))
    assert ev["check"] <= 1e-4 * max(1.0, abs(ev["sum"]))  # the pass's own conv_out
    assert abs(ev["gated"] - ev["gated_pass"]) <= 1e-4 * max(1.0, abs(ev["gated"]))
    assert ev["window"] == [r["input"] for r in ev["rows"][1:]] and ev["window_check"] == 0  # the last Lc−1 inputs


def test_a_wrong_convolution_input_is_seen(lfm2):
    from llmtrace.model.kinds.short_conv import CONV_BX
    from llmtrace.run.explain import capture
    from llmtrace.model.kinds.short_conv import conv_section

    lm = lfm2.loaded
    cap = capture(lm.model, lm.tokenizer.encode(PROMPT), 0)
    right = conv_section(cap, lm.model, lm.maths)
    assert right["check"] <= 1e-4 * max(1.0, abs(right["sum"]))
    cap.points[CONV_BX.name] = cap.points[CONV_BX.name].clone()
    cap.points[CONV_BX.name][right["position"] - 1, right["channel"]] += 1.0  # one input inside the kernel's reach
    wrong = conv_section(cap, lm.model, lm.maths, channel=right["channel"])
    assert wrong["check"] > 1e-3 and wrong["window_check"] > 0.5


def test_a_kv_shared_layer_is_checked_against_the_layer_it_reads(tmp_path):
    """gemma4's fixture: layer 4 computes no K or V and reads layer 3's (tests/families.py). explain keeps layer 3's
    cached keys and values, so the shared layer's keys and P·V are recomputed from them, not left unchecked."""
    import llmtrace
    from families import FAMILIES, write_hf_dir

    write_hf_dir(tmp_path / "gemma4", FAMILIES["gemma4"])
    events = llmtrace.load(str(tmp_path / "gemma4"), threads=1).explain(PROMPT, layer=4).events
    by = {e["section"]: e for e in events if e["event"] == "explain"}
    assert by["state_cache"]["reads"] == 3
    steps = {r["op"]: r for r in by["steps"]["steps"]}
    for op in ("repeat_kv", "weighted_sum"):  # keys from layer 3's k_rope, P·V from layer 3's values
        assert "of layer 3" in steps[op]["formula"] and steps[op]["check"] is not None and steps[op]["check"]["ok"]
    assert steps["repeat_kv"]["check"]["max_abs"] == 0  # the same numbers: read, not recomputed
