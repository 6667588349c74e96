"""`llmtrace explain` and `llmtrace lens`: every section's numbers recomputed by hand, and checked against transformers.

Two models: a tiny random GQA LLaMA written as an HF safetensors directory (with linear RoPE scaling and an untied LM
head), and the real SmolLM2-135M. transformers' eager attention is the reference for hidden states and probabilities.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import model_param

from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.model.gqa import gqa_groups
from llmtrace.run.explain import (NEAR_ZERO, attention_sections, bin_edges, capture, explain_events,
                                  lens_events, lens_logits, parse_positions, resolve_layer)

PROMPT = "The capital of France is"
LONG = ("Quantum mechanics is a fundamental theory in physics that describes the behavior of nature at and below the "
        "scale of atoms. It is the foundation of all quantum physics, which includes quantum chemistry, quantum field "
        "theory, quantum technology, and quantum information science.")
LAYER = 3


# ----------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm, smollm_path):
    """(llmtrace's load, transformers' load) of a tiny random GQA LLaMA: 3 layers, D 64, 4 q heads on 2 KV heads."""
    transformers = pytest.importorskip("transformers")
    from llmtrace.registry.cache import converted_dir
    from llmtrace.checkpoint.load import load_model

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so that γ is visible in the checks
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted_dir(smollm_path) / "tokenizer" / f, path / f)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return load_model(str(path), device="cpu", dtype="float32"), hf, path


def _ids(lm, text=PROMPT):
    return lm.tokenizer.encode(text)


@pytest.fixture(scope="module", params=model_param())
def explained(request):
    """(model, (capture, events)) of layer 3 on PROMPT: the tiny model of the quick suite, and SmolLM2 (slow)."""
    lm = request.getfixturevalue(request.param)
    ids = _ids(lm)
    return lm, (capture(lm.model, ids, LAYER), explain_events(lm, ids, LAYER, prompt=PROMPT))


def smol(lm) -> bool:
    """Whether `lm` is SmolLM2-135M, whose own numbers some checks also hold it to."""
    return lm.config.n_layers == 30 and lm.config.d_model == 576


@pytest.fixture(scope="module")
def real(smollm):
    """SmolLM2 on PROMPT, layer 3: the capture and the events."""
    ids = _ids(smollm)
    return capture(smollm.model, ids, LAYER), explain_events(smollm, ids, LAYER, prompt=PROMPT)


def _section(events, name):
    found = [e for e in events if e["event"] == "explain" and e["section"] == name]
    assert found, name
    return found if name in ("rmsnorm", "attention_head") else found[0]


@pytest.fixture(scope="module")
def validator():
    """The shipped schema, which holds the explain and lens records."""
    jsonschema = pytest.importorskip("jsonschema")
    from llmtrace.trace.events import schema_path

    schema = json.loads(schema_path().read_text())
    assert {"explain", "lens"} <= set(schema["$defs"])
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# ----------------------------------------------------------------------------------------------------------------
# the forward pass against transformers


def _hf_run(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", pytest.param("smollm", marks=pytest.mark.slow)])
def test_layer_output_and_probs_equal_transformers(which, request):
    if which == "tiny":
        lm, hf, _ = request.getfixturevalue("tiny")
        layers = range(lm.config.n_layers)
    else:
        lm, hf = request.getfixturevalue("smollm"), request.getfixturevalue("hf_smollm")
        layers = (0, LAYER, 29)
    ids = _ids(lm)
    ref = _hf_run(hf, ids)
    L = lm.config.n_layers
    for n in layers:
        cap = capture(lm.model, ids, n)
        out = cap.resid_post[n] if n < L - 1 else lm.model.norm(cap.resid_post[n])  # HF's last entry is normed
        torch.testing.assert_close(out, ref.hidden_states[n + 1][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cap.points["probs"], ref.attentions[n][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cap.logits, ref.logits[0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("which", ["tiny", pytest.param("smollm", marks=pytest.mark.slow)])
def test_lens_after_the_last_layer_is_the_real_output(which, request):
    # the quick suite's tiny model (the `tiny` fixture reads SmolLM2's tokenizer, so it is the slow suite's)
    lm = request.getfixturevalue("tiny_lm" if which == "tiny" else "smollm")
    ids = _ids(lm)
    cap = capture(lm.model, ids)
    L = lm.config.n_layers
    torch.testing.assert_close(lens_logits(lm.model, cap.resid_post[L - 1]), cap.logits.float(), atol=1e-5, rtol=1e-4)
    events = lens_events(lm, ids, list(range(len(ids))), top=3)
    last = {e["position"]: e for e in events if e["event"] == "lens" and e["layer"] == L - 1}
    for p, ev in last.items():
        assert ev["topk"][0]["id"] == int(cap.logits[p].argmax())


def test_capture_leaves_the_model_as_it_was(smollm):
    m = smollm.model
    ids = _ids(smollm)
    cap = capture(m, ids, LAYER)
    assert all(mod.hook is None for mod in m.modules() if hasattr(mod, "point"))
    assert "scores" in cap.points and "probs" in cap.points  # the chosen layer's attention was spelled out
    assert cap.points["k_repeated"].shape == (m.config.n_heads, len(ids), m.config.head_dim)  # as generate records it
    with torch.no_grad():
        torch.testing.assert_close(m(torch.tensor([ids]))[0], cap.logits, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# one value per section


def test_1_parameters_and_flops(explained):
    smollm, (_, events) = explained  # SmolLM2 or the tiny model
    ev = _section(events, "layer")
    block = smollm.model.layers[LAYER]
    c = smollm.config
    D, H, Hkv, Dh, Fd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
    assert ev["layer_params"] == sum(p.numel() for p in block.parameters())
    by = {p["name"]: p for p in ev["params"]}
    assert by["Wq"]["shape"] == [D, H * Dh] and by["Wq"]["numel"] == D * H * Dh
    assert by["Wk"]["numel"] == by["Wv"]["numel"] == D * Hkv * Dh
    assert by["W_down"]["shape"] == [Fd, D]
    assert ev["model_params"] == smollm.model.num_params()
    assert ev["share"] == pytest.approx(ev["layer_params"] / ev["model_params"], rel=1e-5)
    T = len(_ids(smollm))
    linear = sum(p["numel"] for p in ev["params"] if p["name"].startswith("W"))
    assert ev["flops"]["total"] == 2 * T * linear + 4 * H * T * T * Dh  # every weight once per token, plus QKᵀ and PV


def test_2_rmsnorm_by_hand(explained):
    smollm, (cap, events) = explained  # SmolLM2 or the tiny model
    x = cap.resid_post[LAYER - 1]  # the input of layer 3 is the output of layer 2
    rms = x.pow(2).mean(-1).sqrt()
    a, f = _section(events, "rmsnorm")
    assert a["norm"] == "attn_norm" and f["norm"] == "ffn_norm"
    assert [t["rms"] for t in a["tokens"]] == pytest.approx(rms.tolist(), rel=1e-5)
    g = smollm.model.layers[LAYER].attn_norm.weight
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + a["eps"]) * g
    torch.testing.assert_close(y, cap.points["attn_norm"], atol=1e-5, rtol=1e-4)
    assert [t["norm_out"] for t in a["tokens"]] == pytest.approx(y.norm(dim=-1).tolist(), rel=1e-5)
    assert all(t["norm_unit"] == pytest.approx(math.sqrt(smollm.config.d_model), rel=1e-3) for t in a["tokens"])
    assert a["check_max_abs_diff"] <= 1e-5 and f["check_max_abs_diff"] <= 1e-5


def test_3_gqa_groups_and_cache_saving(explained):
    lm, (_, events) = explained
    c = lm.config
    G = c.n_heads // c.n_kv_heads
    ev = _section(events, "qkv")
    assert ev["groups"] == gqa_groups(c.n_heads, c.n_kv_heads) == [list(range(g * G, g * G + G))
                                                                   for g in range(c.n_kv_heads)]
    assert ev["group_size"] == G
    assert ev["cache"]["bytes_per_position_layer"] == 2 * c.n_kv_heads * c.head_dim * 4
    assert ev["cache"]["saving"] == G
    q = next(s for s in ev["shapes"] if s["name"].startswith("Q"))
    assert q["split"] == q["captured"] == [len(_ids_for(events)), c.n_heads, c.head_dim]
    if smol(lm):
        assert ev["groups"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] == gqa_groups(9, 3)
        assert ev["group_size"] == 3
        assert ev["cache"]["bytes_per_position_layer"] == 2 * 3 * 64 * 4
        assert ev["cache"]["saving"] == 3
        assert q["split"] == q["captured"] == [len(_ids_for(events)), 9, 64]


def _ids_for(events):
    return next(e for e in events if e["event"] == "tokens")["tokens"]


def test_4_rope_relative_distance_and_angles(smollm, real, tiny):
    _, events = real
    ev = _section(events, "rope")
    rel = ev["relative"]
    assert rel["max_deviation"] <= 1e-4
    scores = torch.tensor(rel["scores"])
    assert (scores[:, 0].max() - scores[:, 0].min()) > 1e-3  # a different distance gives a different score
    assert ev["theta"] == pytest.approx(1e5)
    p1 = next(p for p in ev["pairs"] if p["i"] == 1)
    assert p1["theta_i"] == pytest.approx(1e5 ** (-2 / 64), rel=1e-5)
    assert p1["angles"][3] == pytest.approx(3 * 1e5 ** (-2 / 64), rel=1e-5)
    assert ev["check_q_rope_max_abs_diff"] <= 1e-5 and ev["check_k_rope_max_abs_diff"] <= 1e-5
    # linear scaling (the tiny model, factor 2) halves every frequency
    lm = tiny[0]
    t_ev = _section(explain_events(lm, _ids(lm), 1), "rope")
    assert t_ev["scaling"]["rope_type"] == "linear"
    assert t_ev["pairs"][1]["theta_i"] == pytest.approx(1e4 ** (-2 / 16) / 2, rel=1e-5)
    assert t_ev["relative"]["max_deviation"] <= 1e-4


def test_5_attention_argmax_mask_and_map(smollm, real):
    cap, events = real
    probs = cap.points["probs"]
    H, T, _ = probs.shape
    att = _section(events, "attention")
    assert att["masked"] == H * T * (T - 1) // 2
    for ev in _section(events, "attention_head"):
        h = ev["head"]
        assert ev["argmax"] == probs[h].argmax(-1).tolist()
        assert ev["weight"] == pytest.approx(probs[h].max(-1).values.tolist(), abs=1e-4)
        assert ev["kv_head"] == h // 3
    amap = _section(events, "attention_map")
    assert amap["head"] is None and not amap["binned"]
    assert torch.tensor(amap["matrix"]) == pytest.approx(probs.mean(0), abs=1e-4)
    # the example: scores above the diagonal are masked (None in JSON), the rest equal the captured scores
    ex = att["example"]
    assert ex["masked_scores"][0][1] is None and ex["scores"][0][1] is not None
    assert ex["masked_scores"][2][1] == pytest.approx(float(cap.points["scores"][0, 2, 1]), abs=1e-3)
    # --head picks one head's map
    picked = [e for e in attention_sections(cap, smollm.config, head=8, maths=smollm.maths)
              if e["section"] == "attention_map"][0]
    assert torch.tensor(picked["matrix"]) == pytest.approx(probs[8], abs=1e-4)


def test_5_long_prompts_are_binned(smollm):
    ids = _ids(smollm, LONG)
    assert len(ids) > 40
    amap = _section(explain_events(smollm, ids, 0, head=2), "attention_map")
    assert amap["binned"] and len(amap["bins"]) == 40 and amap["bins"][-1][1] == len(ids)
    assert [sum(r) for r in amap["matrix"]] == pytest.approx([1.0] * 40, abs=1e-3)  # keys summed: rows still sum to 1
    assert bin_edges(10) == [(i, i + 1) for i in range(10)]


def test_6_residual_cosine_by_hand(explained):
    _, (cap, events) = explained
    ev = _section(events, "residual")
    x, mid, post = cap.resid_post[LAYER - 1], cap.resid_mid[LAYER], cap.resid_post[LAYER]
    for t, row in enumerate(ev["tokens"]):
        cos = float(x[t] @ post[t] / (x[t].norm() * post[t].norm()))
        assert row["cos_layer"] == pytest.approx(cos, abs=1e-5)
        assert row["rel_change_layer"] == pytest.approx(float((post[t] - x[t]).norm() / x[t].norm()), rel=1e-4)
        assert row["norm_attn"] == pytest.approx(float(cap.points["o_proj"][t].norm()), rel=1e-5)
        assert row["rel_change_attn"] == pytest.approx(float((mid[t] - x[t]).norm() / x[t].norm()), rel=1e-4)


def test_7_ffn_near_zero_fraction_and_top_units(explained):
    lm, (cap, events) = explained
    ev = _section(events, "ffn")
    s = F.silu(cap.points["gate"])
    assert ev["near_zero_threshold"] == NEAR_ZERO
    assert ev["near_zero_fraction"] == pytest.approx(float((s.abs() < NEAR_ZERO).float().mean()), abs=1e-6)
    assert ev["tokens"][-1]["near_zero_fraction"] == pytest.approx(float((s[-1].abs() < NEAR_ZERO).float().mean()), abs=1e-6)
    act = cap.points["act"][-1]
    assert [u["unit"] for u in ev["top_units"]["units"]] == act.abs().topk(len(ev["top_units"]["units"])).indices.tolist()
    assert ev["shapes"][1]["shape"] == [len(cap.ids), lm.config.ffn_dim]
    assert lm.config.ffn_dim == 1536 or not smol(lm)
    assert ev["check_act_max_abs_diff"] <= 1e-6


def test_8_kv_bytes(explained):
    lm, (cap, events) = explained
    c = lm.config
    ev = _section(events, "kv_cache")
    T = len(cap.ids)
    assert ev["bytes"] == 2 * T * c.n_kv_heads * c.head_dim * 4
    assert ev["positions"] == [0, T - 1] and ev["n_positions"] == T
    assert ev["mha_bytes"] == c.n_heads // c.n_kv_heads * ev["bytes"]
    if smol(lm):
        assert ev["bytes"] == 2 * T * 3 * 64 * 4
        assert ev["mha_bytes"] == 3 * ev["bytes"]


def test_9_lens_at_the_layer_and_final(explained):
    smollm, (cap, events) = explained  # SmolLM2 or the tiny model
    lens = {e["stage"]: e for e in events if e["event"] == "lens"}
    assert set(lens) == {"resid_mid", "resid_post", "logits"}
    final = lens["logits"]["topk"]
    assert final[0]["id"] == int(cap.logits[-1].argmax()) and (final[0]["text"] == " Paris" or not smol(smollm))
    manual = lens_logits(smollm.model, cap.resid_mid[LAYER][-1:])[0]
    assert lens["resid_mid"]["topk"][0]["id"] == int(manual.argmax())
    probs = torch.softmax(manual, -1)
    assert lens["resid_mid"]["topk"][0]["prob"] == pytest.approx(float(probs.max()), rel=1e-4)
    # at the last layer, the lens after the FFN is the real output
    last = explain_events(smollm, cap.ids, -1)
    post = next(e for e in last if e["event"] == "lens" and e["stage"] == "resid_post")
    assert [c["id"] for c in post["topk"]] == [c["id"] for c in final]


def test_10_lens_table_rows_and_columns(smollm):
    ids = _ids(smollm, LONG)
    cols = parse_positions(None, len(ids))
    assert cols == list(range(len(ids) - 12, len(ids)))
    events = lens_events(smollm, ids, cols, top=5)
    cells = [e for e in events if e["event"] == "lens" and e["stage"] == "resid_post"]
    assert len(cells) == 30 * 12 and {e["layer"] for e in cells} == set(range(30))
    cap = capture(smollm.model, ids)
    some = next(e for e in cells if e["layer"] == 12 and e["position"] == cols[3])
    assert some["topk"][0]["id"] == int(lens_logits(smollm.model, cap.resid_post[12][cols[3]][None])[0].argmax())
    assert parse_positions("0,2-4,-1", 10) == [0, 2, 3, 4, 9]
    assert parse_positions("all", 3) == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------------
# argument errors


def test_layer_and_prompt_errors(smollm):
    assert resolve_layer(-1, 30) == 29 and resolve_layer(0, 30) == 0
    with pytest.raises(UsageError, match="30 layers"):
        resolve_layer(30, 30)
    with pytest.raises(UsageError):
        resolve_layer(-31, 30)
    with pytest.raises(LlmtraceError, match="empty"):
        explain_events(smollm, [], 0)
    with pytest.raises(UsageError, match="head"):
        explain_events(smollm, _ids(smollm), 0, head=9)
    with pytest.raises(UsageError, match="position"):
        parse_positions("12", 5)


def test_too_long_prompt_is_refused(tiny):
    lm = tiny[0]
    with pytest.raises(LlmtraceError, match="context window"):
        explain_events(lm, [1] * (lm.config.max_seq_len + 1), 0)


def test_a_prompt_of_the_whole_window_is_prefilled_but_leaves_no_room_to_generate(tiny):
    """One rule for every command: explain, lens and generate -n 0 take max_seq_len tokens; generating needs room."""
    from llmtrace.run.generate import check_context

    lm = tiny[0]
    ctx = lm.config.max_seq_len
    ids = [1] * ctx
    assert _section(explain_events(lm, ids, 0), "model")["n_tokens"] == ctx
    assert check_context(lm, ctx, 0) == 0 and check_context(lm, ctx - 1, 5) == 1
    with pytest.raises(LlmtraceError, match="context window"):
        check_context(lm, ctx, 1)


def test_chat_template_is_applied(smollm):
    text, ids = smollm.tokenizer.encode_prompt("Hi", chat=True, system="Be brief.")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[0] == smollm.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    assert smollm.tokenizer.encode_prompt("Hi") == ("Hi", smollm.tokenizer.encode("Hi"))


# ----------------------------------------------------------------------------------------------------------------
# the command line


def _cli(*args, stdin=None):
    env = dict(os.environ, LLMTRACE_THREADS="2", NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "llmtrace", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=300)


def test_cli_explain_json_validates(smollm_path, validator):
    r = _cli("explain", PROMPT, "--layer", "3", "-m", str(smollm_path), "--json", "-")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validator.validate(doc)
    events = doc["events"]
    for ev in events:
        validator.validate(ev)
    tensors = [e for e in events if e["event"] == "tensor"]
    assert len(tensors) == 19 and all(e["layer"] == 3 and e["step"] == 0 for e in tensors)
    assert {e["section"] for e in events if e["event"] == "explain"} == {
        "model", "layer", "steps", "rmsnorm", "qkv", "rope", "attention", "attention_head", "attention_map", "residual", "ffn",
        "kv_cache"}
    assert [e["stage"] for e in events if e["event"] == "lens"] == ["resid_mid", "resid_post", "logits"]


@pytest.mark.slow
def test_cli_lens_jsonl_validates_and_explain_renders(tiny, validator):
    _, _, path = tiny
    r = _cli("lens", PROMPT, "-m", str(path), "--positions", "0,-1", "--top", "3", "--jsonl", "-")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    for ev in events:
        validator.validate(ev)
    cells = [e for e in events if e["event"] == "lens"]
    assert len(cells) == 3 * 2 + 2 and all(len(e["topk"]) == 3 for e in cells)
    r = _cli("explain", "-m", str(path), "--layer", "-1", "--head", "3", "--chat", stdin="Hello there")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "KV head 1 ← query heads 2, 3" in out and "layer 2 of 0..2" in out and "head 3" in out
    assert "rope_type=linear" in out


@pytest.mark.slow
def test_cli_errors_are_one_line(smollm_path, tiny):
    r = _cli("explain", PROMPT, "--layer", "30", "-m", str(smollm_path))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "30 layers" in r.stderr and r.stderr.startswith("error:")
    r = _cli("explain", "", "-m", str(tiny[2]))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "empty" in r.stderr
    r = _cli("lens", PROMPT, "-m", str(tiny[2]), "--positions", "99")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "out of range" in r.stderr


def test_cli_help_has_examples():
    for cmd in ("explain", "lens"):
        r = _cli(cmd, "--help")
        assert r.returncode == 0 and "Examples" in r.stdout and f"llmtrace {cmd}" in r.stdout
