"""llmtrace compare: two runs side by side, layer by layer.

Tiny random models with one matrix perturbed: the first divergence and the only layer with added error must be that
matrix's layer and point. The real default model against itself in bfloat16 and with --keep-quantized. KLD, same top
and Δp checked against a computation of our own on transformers' logits. Bad input: one line each.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import SPEC, check_against_schema, fails, perturbed_copy, run_cli, save_hf, undeclared_fields
from tiny import PROMPT, make_hf_model, tiny_tokenizer

# HF parameter of layer i -> the point where a change to it first shows
PERTURBED = [
    ("input_layernorm.weight", "attn_norm"),
    ("self_attn.q_proj.weight", "q"),
    ("self_attn.k_proj.weight", "k"),
    ("self_attn.v_proj.weight", "v"),
    ("self_attn.o_proj.weight", "o_proj"),
    ("post_attention_layernorm.weight", "ffn_norm"),
    ("mlp.gate_proj.weight", "gate"),
    ("mlp.up_proj.weight", "up"),
    ("mlp.down_proj.weight", "down"),
]
@pytest.fixture(scope="module")
def tiny_a(tmp_path_factory):
    path = save_hf(tmp_path_factory.mktemp("cmp") / "a", make_hf_model(SPEC))
    from llmtrace.checkpoint.load import load_model

    return path, load_model(str(path), device="cpu", dtype="float32")


def load(path, **kw):
    from llmtrace.checkpoint.load import load_model

    return load_model(str(path), device="cpu", **({"dtype": "float32"} | kw))


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("param,point", PERTURBED, ids=[p for _, p in PERTURBED])
def test_one_perturbed_matrix_is_found_at_its_layer_and_point(tiny_a, tmp_path, layer, param, point):
    from llmtrace.run.compare import compare

    _, lm_a = tiny_a
    lm_b = load(save_hf(tmp_path / "b", perturbed_copy(layer, param)))
    r = compare(lm_a, lm_b, PROMPT, max_new_tokens=2)
    fd = r.first_divergence
    assert (fd["layer"], fd["point"]) == (layer, point), fd
    assert fd["rel_err"] > r.tolerance
    assert r.max_rel_err_before == 0  # every point before it identical (same weights, same maths, same input)
    # the added error: exactly zero in every other layer, at the head, and before the point in this layer
    for lay in r.layers:
        if lay["layer"] != layer:
            assert lay["added_rel_err"] == 0 and lay["max_added_rel_err"] == 0, lay["layer"]
        else:
            assert lay["added_rel_err"] > 0
            first_added = next(p["point"] for p in lay["points"] if p["added_rel_err"])
            assert first_added == point
    assert r.model_points["final_norm"]["added_rel_err"] == 0 and r.model_points["logits"]["added_rel_err"] == 0
    # later layers carry the error forward (accumulated) without adding to it
    assert all(lay["rel_err"] > 0 for lay in r.layers[layer:])
    assert all(lay["rel_err"] == 0 for lay in r.layers[:layer])
    assert f"layer {layer}, {point} " in r.summary_line()


def test_a_model_against_itself_agrees_everywhere(tiny_a):
    from llmtrace.run.compare import compare

    _, lm = tiny_a
    r = compare(lm, lm, PROMPT, max_new_tokens=3)
    assert r.first_divergence is None and r.max_rel_err_before == 0
    assert r.kld_mean == 0 and r.kld_max == 0 and r.same_top == 1 and r.dp_mean_abs == 0
    assert len(r.positions) == r.n_prompt + 3
    assert all(p["cos_min"] == 1 for lay in r.layers for p in lay["points"])
    assert "agree" in r.summary_line()


def test_side_by_side_pieces_are_the_models_own_forward(tiny_a):
    """The layer-by-layer run uses forward's own pieces: A's logits are bit for bit those of an observed forward pass
    (observed layers spell attention out, as every layer of a compared run is observed)."""
    from llmtrace.run.compare import run_side_by_side

    _, lm = tiny_a
    ids = lm.tokenizer.encode(PROMPT)
    la, lb = run_side_by_side(lm, lm, ids, {})
    with torch.inference_mode(), lm.model.hooked(lambda *_: None):
        ref = lm.model(torch.tensor([ids]))[0]
    assert torch.equal(la, ref) and torch.equal(lb, ref)
    with torch.inference_mode():
        fused = lm.model(torch.tensor([ids]))[0]  # the unobserved pass: the fused attention kernel
    torch.testing.assert_close(la, fused, rtol=1e-5, atol=1e-5)


def test_decode_positions_are_as_greedy_generation(tiny_a):
    """-n N: the compared sequence is the prompt followed by A's own greedy tokens, as generate picks them."""
    from llmtrace.run.compare import compare
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    _, lm = tiny_a
    r = compare(lm, lm, PROMPT, max_new_tokens=4)
    ids = lm.tokenizer.encode(PROMPT)
    got = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), 4, ignore_eos=True)
    assert r.ids == ids + list(got.tokens)
    assert [p["phase"] for p in r.positions].count("decode") == 4


def test_answers_match_our_own_computation_on_transformers_logits(tiny_a, tmp_path):
    """KLD, same top and Δp per position, from transformers' logits of both models over the same ids."""
    from llmtrace.run.compare import compare

    path_a, lm_a = tiny_a
    hf_b = perturbed_copy(1, "mlp.down_proj.weight", amount=3.0)
    lm_b = load(save_hf(tmp_path / "b", hf_b))
    hf_a = make_hf_model(SPEC)
    r = compare(lm_a, lm_b, PROMPT, max_new_tokens=3)
    ids = torch.tensor([r.ids])
    with torch.no_grad():
        la = hf_a(ids).logits[0].double()
        lb = hf_b.eval()(ids).logits[0].double()
    kld = F.kl_div(F.log_softmax(lb, -1), F.log_softmax(la, -1), log_target=True, reduction="none").sum(-1)
    pa, pb = F.softmax(la, -1), F.softmax(lb, -1)
    top_a, top_b = la.argmax(-1), lb.argmax(-1)
    dp = pb.gather(1, top_a[:, None])[:, 0] - pa.gather(1, top_a[:, None])[:, 0]
    assert kld.max() > 1e-4  # the perturbation matters to the answers
    for i, p in enumerate(r.positions):
        assert p["kld"] == pytest.approx(kld[i].item(), rel=2e-2, abs=1e-7)
        assert p["dp"] == pytest.approx(dp[i].item(), rel=2e-2, abs=1e-6)
        assert p["same_top"] == bool(top_a[i] == top_b[i])
        assert p["top_a"]["id"] == int(top_a[i]) and p["top_b"]["id"] == int(top_b[i])
    assert r.kld_mean == pytest.approx(kld.mean().item(), rel=2e-2)
    assert r.kld_max == pytest.approx(kld.max().item(), rel=2e-2)
    assert r.same_top == pytest.approx((top_a == top_b).double().mean().item())
    assert r.dp_mean_abs == pytest.approx(dp.abs().mean().item(), rel=2e-2)


def test_several_prompts_are_summarized_together(tiny_a, tmp_path):
    from llmtrace.run.compare import compare

    _, lm_a = tiny_a
    lm_b = load(save_hf(tmp_path / "b", perturbed_copy(1, "mlp.up_proj.weight")))
    r = compare(lm_a, lm_b, ["Hello world", "The quick brown fox"], max_new_tokens=1)
    n = [len(lm_a.tokenizer.encode(t)) + 1 for t in ("Hello world", "The quick brown fox")]
    assert len(r.positions) == sum(n) and {p["prompt"] for p in r.positions} == {0, 1}
    assert [p["index"] for p in r.positions] == list(range(sum(n)))
    assert all(len(p["per_position"]["rel_err"]) == sum(n) for lay in r.layers for p in lay["points"])
    assert (r.first_divergence["layer"], r.first_divergence["point"]) == (1, "up")
    assert r.first_divergence["prompt"] in (0, 1)


def earliest_and_worst(r) -> tuple[tuple, tuple]:
    """((prompt, position) of the earliest position over the tolerance at the first divergence's point, and of its
    largest error), worked out here from the point's per-position errors."""
    fd = r.first_divergence
    point = next(p for lay in r.layers if lay["layer"] == fd["layer"] for p in lay["points"] if p["point"] == fd["point"])
    rel = point["per_position"]["rel_err"]
    over = [i for i, x in enumerate(rel) if x > r.tolerance]
    worst = max(range(len(rel)), key=rel.__getitem__)
    label = lambda i: (r.positions[i].get("prompt"), r.positions[i]["position"])  # noqa: E731
    return label(over[0]), label(worst)


def test_first_divergence_is_the_earliest_position_over_the_tolerance(tiny_a, tmp_path):
    """At the first point over the tolerance, `position` is the earliest position over it (every position reads
    the perturbed matrix, so position 0 already is), `worst_position` the largest; the line says both."""
    from llmtrace.run.compare import compare

    _, lm_a = tiny_a
    lm_b = load(save_hf(tmp_path / "b", perturbed_copy(1, "mlp.up_proj.weight")))
    r = compare(lm_a, lm_b, PROMPT)
    fd = r.first_divergence
    (_, first), (_, worst) = earliest_and_worst(r)
    assert (fd["position"], fd["worst_position"]) == (first, worst) and first == 0 and worst != first
    point = next(p for p in r.layers[1]["points"] if p["point"] == "up")
    assert fd["rel_err"] == point["max_rel_err"]
    assert fd["position_rel_err"] == point["per_position"]["rel_err"][first] > r.tolerance
    assert f"layer 1, up ({fd['seed_step']}), from position 0; largest at {worst}: rel. error " in r.summary_line()


def test_first_divergence_of_several_prompts_names_the_earliest_prompt(tiny_a, tmp_path):
    from llmtrace.run.compare import compare

    _, lm_a = tiny_a
    lm_b = load(save_hf(tmp_path / "b", perturbed_copy(1, "mlp.up_proj.weight")))
    r = compare(lm_a, lm_b, ["One", "Two words and more of them"])
    fd = r.first_divergence
    (prompt, first), (worst_prompt, worst) = earliest_and_worst(r)
    assert (fd["prompt"], fd["position"]) == (prompt, first) == (0, 0)
    assert (fd["worst_prompt"], fd["worst_position"]) == (worst_prompt, worst) and worst_prompt == 1
    assert f"from prompt 0, position 0; largest at prompt 1, position {worst}: " in r.summary_line()


def test_a_file_written_before_worst_position_still_reads():
    """A comparison saved before the field existed named the largest error's position in `position`."""
    from llmtrace.run.compare import summary_line

    old = {"first_divergence": {"layer": 3, "point": "attn_out", "seed_step": "s6.5", "position": 2, "rel_err": 0.372},
           "tolerance": 1e-4, "max_rel_err_before": 0.0}
    assert summary_line(old) == ("runs part at layer 3, attn_out (s6.5), position 2: rel. error 3.7e-1; everything "
                                 "before it identical")
    old["first_divergence"]["prompt"] = 1
    assert "attn_out (s6.5), prompt 1, position 2: rel. error" in summary_line(old)


# ----------------------------------------------------------------------------------------------------------------
# the command


def test_cli_json_jsonl_and_view(tiny_a, tmp_path, capsys):
    from llmtrace.trace.comparison import COMPARE_SCHEMA

    path_a, _ = tiny_a
    path_b = save_hf(tmp_path / "b", perturbed_copy(2, "self_attn.v_proj.weight"))
    out, lines = tmp_path / "c.json", tmp_path / "c.jsonl"
    code, stdout, err = run_cli(capsys, "compare", PROMPT, "-m", path_a, "-m", path_b, "-n", "2", "--json", out,
                                "--jsonl", lines, "--threads", "1")
    assert code == 0, err
    doc = json.loads(out.read_text())
    for key in ("first_divergence", "tolerance", "kld_mean", "kld_max", "same_top", "positions", "layers"):
        assert key in doc
    assert doc["schema"] == COMPARE_SCHEMA and doc["tolerance"] == 1e-4
    assert doc["first_divergence"]["layer"] == 2 and doc["first_divergence"]["point"] == "v"
    assert set(doc["first_divergence"]) >= {"layer", "point", "position", "rel_err"}
    assert [lay["layer"] for lay in doc["layers"]] == [0, 1, 2]
    assert all({"layer", "rel_err", "added_rel_err", "points"} <= set(lay) for lay in doc["layers"])
    # the view: the first line answers the question; the matrix fits 80 columns
    first = stdout.splitlines()[0]
    fd = doc["first_divergence"]
    assert first.startswith(f"runs part at layer 2, v (s6.1/s6.2), from position {fd['position']}; largest at "
                            f"{fd['worst_position']}: ")
    # the stream holds the same content, and the schema declares every field of both forms
    events = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [e["event"] for e in events].count("compare_layer") == 3
    assert events[0]["event"] == "compare" and events[0]["first_divergence"] == doc["first_divergence"]
    assert undeclared_fields(events) == []
    check_against_schema(doc, events)


def test_cli_one_view_at_80_columns(tiny_a, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    path_a, _ = tiny_a
    path_b = save_hf(tmp_path / "b", perturbed_copy(1, "mlp.gate_proj.weight", amount=2.0))
    code, stdout, err = run_cli(capsys, "compare", PROMPT, "-m", path_a, "-m", path_b, "-n", "3")
    assert code == 0, err
    lines = stdout.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("      an q  k  v"))
    matrix = lines[top + 1: next(i for i, line in enumerate(lines) if line.startswith("after the layers"))]
    assert [line.split()[0] for line in matrix] == ["emb", "0", "1", "2"]
    assert all(len(line) <= 80 for line in lines[top:top + 5])
    assert "answers: KLD mean" in stdout
    assert "compare: loading A" in err  # progress on stderr


def test_b_options_override_a(tiny_a, tmp_path, capsys):
    path_a, _ = tiny_a
    out = tmp_path / "c.json"
    code, _, err = run_cli(capsys, "compare", "Hello world", "-m", path_a, "--b-dtype", "bfloat16", "--json", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert (doc["a"]["dtype"], doc["b"]["dtype"]) == ("float32", "bfloat16")
    assert doc["first_divergence"] is not None


def test_side_changes_are_one_dataclass():
    from llmtrace.run.compare import Side

    a = Side(model="x.gguf", dtype="float32", keep_quantized=True)
    b = a.with_changes(dtype="bfloat16", keep_quantized=None, device=None)
    assert b == Side(model="x.gguf", dtype="bfloat16", keep_quantized=True)
    assert a.with_changes(keep_quantized=False).keep_quantized is False
    with pytest.raises(TypeError):
        a.with_changes(colour="red")


# ----------------------------------------------------------------------------------------------------------------
# bad input


def test_a_single_model_is_refused_before_loading(capsys):
    fails(capsys, 2, "compare", "Hi", "-m", "/nonexistent/model.gguf", says=("two sides", "second -m"))
    fails(capsys, 2, "compare", "Hi", says=("two sides",))
    fails(capsys, 2, "compare", "Hi", "-m", "a", "-m", "b", "-m", "c", says=("two models", "3"))


def test_bad_values_are_refused_before_loading(capsys):
    nowhere = "/nonexistent/model.gguf"
    fails(capsys, 2, "compare", "Hi", "-m", nowhere, "-m", nowhere, "--tolerance", "0", says=("--tolerance",))
    fails(capsys, 2, "compare", "Hi", "-m", nowhere, "-m", nowhere, "-n", "-1", says=("--max-new-tokens",))
    fails(capsys, 2, "compare", "Hi", "-m", nowhere, "-m", nowhere, "--ids-from", "b", says=("--ids-from",))
    fails(capsys, 2, "compare", "Hi", "-m", nowhere, "--b-dtype", "float8", says=("float8",))


def test_different_tokenization_is_refused_unless_ids_from_a(tiny_a, tmp_path, capsys):
    path_a, _ = tiny_a
    path_b = save_hf(tmp_path / "b", make_hf_model(SPEC), tokenizer=tiny_tokenizer(300))  # fewer merges
    fails(capsys, 1, "compare", PROMPT, "-m", path_a, "-m", path_b, says=("different ids", "--ids-from a"))
    out = tmp_path / "c.json"
    code, _, err = run_cli(capsys, "compare", PROMPT, "-m", path_a, "-m", path_b, "--ids-from", "a", "--json", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["first_divergence"] is None  # the same weights, fed the same ids
    assert any("--ids-from a" in n for n in doc["notes"])


@pytest.mark.parametrize("change,says", [({"n_layers": 2}, "layers differ (A 3, B 2)"),
                                         ({"d_model": 96, "n_heads": 6, "n_kv_heads": 3}, "width (d_model) differ"),
                                         ({"n_kv_heads": 4}, "key/value heads differ"),
                                         ({"ffn_dim": 96}, "FFN width differ")])
def test_incomparable_shapes_name_the_first_mismatch(tiny_a, tmp_path, capsys, change, says):
    from dataclasses import replace

    path_a, _ = tiny_a
    path_b = save_hf(tmp_path / "b", make_hf_model(replace(SPEC, **change)))
    fails(capsys, 1, "compare", "Hello", "-m", path_a, "-m", path_b, says=("cannot be compared", says))


# ----------------------------------------------------------------------------------------------------------------
# the real default model


@pytest.fixture(scope="module")
def smollm_bf16(smollm_path):
    from llmtrace.checkpoint.load import load_model

    return load_model(str(smollm_path), device="cpu", dtype="bfloat16")


REAL_PROMPT = "The capital of France is Paris, and the capital of Germany is"


@pytest.mark.slow
def test_real_model_against_itself_in_bfloat16(smollm, smollm_bf16):
    from llmtrace.run.compare import compare

    r = compare(smollm, smollm_bf16, REAL_PROMPT, max_new_tokens=4)
    # bfloat16 keeps 8 bits of mantissa: rounding the embedding table alone is an error of about 2^-9 relative
    fd = r.first_divergence
    assert (fd["layer"], fd["point"]) == (None, "embed") and 1e-4 < fd["rel_err"] < 1e-2
    assert all(lay["added_rel_err"] > 1e-4 for lay in r.layers)  # every layer adds its own rounding
    assert all(lay["added_rel_err"] < 5e-2 and lay["rel_err"] < 1e-1 for lay in r.layers)
    assert 0 < r.kld_mean < 2e-2 and r.same_top >= 0.75
    assert r.model_points["logits"]["rel_err"] < 0.2


@pytest.mark.slow
def test_real_model_against_its_quantized_blocks(smollm, smollm_path):
    """--keep-quantized dequantizes the same Q4_1 blocks at each use: float32 against float32, the runs agree."""
    from llmtrace.run.compare import compare
    from llmtrace.checkpoint.load import load_model

    quantized = load_model(str(smollm_path), device="cpu", dtype="float32", keep_quantized=True)
    r = compare(smollm, quantized, REAL_PROMPT, max_new_tokens=2)
    assert r.b["keep_quantized"] is True
    assert r.first_divergence is None, r.summary_line()
    assert r.same_top == 1 and r.kld_max < 1e-8


# ----------------------------------------------------------------------------------------------------------------
# side B under an intervention: compare shows what it changed, and only where


def test_an_ablated_head_on_side_b_adds_error_at_its_layer_only(tiny_a):
    from llmtrace import compare
    from llmtrace.run.compare import Side
    from llmtrace.run.interventions import Ablate

    path, _ = tiny_a
    side_b = Side(model=str(path), interventions=(Ablate(1, head=0),))
    doc = compare(str(path), side_b, PROMPT).to_json()
    first = doc["first_divergence"]
    assert (first["layer"], first["point"]) == (1, "attn_out")
    added = [lay["added_rel_err"] for lay in doc["layers"]]
    assert added[1] > 1e-3 and added[0] == 0 and added[2] == 0, added
    assert doc["b"]["interventions"][0]["spec"] == "1.h0"


def test_cli_compare_b_ablate_names_the_intervention(capsys, tiny_a, tmp_path):
    out = tmp_path / "c.json"
    code, _, err = run_cli(capsys, "compare", PROMPT, "-m", tiny_a[0], "--b-ablate", "2.ffn", "--json", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert (doc["first_divergence"]["layer"], doc["first_divergence"]["point"]) == (2, "down")
    assert [lay["added_rel_err"] > 0 for lay in doc["layers"]] == [False, False, True]


def test_compare_mean_ablation_with_decode_steps_is_refused(capsys, tiny_a):
    fails(capsys, 2, "compare", PROMPT, "-m", tiny_a[0], "--b-ablate", "1.h0=mean", "-n", "2", says=("mean", "-n 0"))


@pytest.mark.parametrize("argv, says", [
    (["--b-ablate", "9.h0"], ("--b-ablate 9.h0", "out of range", "3 layers")),
    (["--b-patch", "1.resid_post@0"], ("--b-patch", "needs --b-from")),
    (["--b-steer", "1", "--b-toward", "a"], ("--b-steer", "--b-away-from")),
])
def test_compare_side_b_intervention_errors_name_compare_flags(capsys, tiny_a, argv, says):
    """One line naming compare's own flag, said from B's config before any weight is read."""
    fails(capsys, 2, "compare", PROMPT, "-m", tiny_a[0], *argv, says=says)
