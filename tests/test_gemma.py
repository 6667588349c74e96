"""Gemma 2 and Gemma 3 (model/families/gemma2.py, gemma3.py) on the tiny checkpoints of tests/families.py, against
transformers: from the HF directory and from the GGUF llama.cpp's converter writes from it, prompt ids identical,
fp32 logits within 8x their own float32 error at every position of a prompt longer than the window, greedy tokens
identical through the KV cache; every Gemma step a declared point the trace shows; configs with what llmtrace does
not run refused by field."""

import json
from dataclasses import replace

import pytest
import torch

from families import FAMILIES, PROMPT_IDS, hf_model_from_gguf, hf_model_via_state_dict, prompt_ids
from helpers import fails, logits_tol, run_cli
from llmtrace.model.families.gemma2 import score_cap

GEMMAS = ["gemma3", "gemma2"]
PROMPT = "The quick brown fox jumps over the lazy dog"  # more tokens than the window (4)
N_NEW = 10
# what llama.cpp and llmtrace take as the score scale of a Gemma GGUF: 1/sqrt(key_length) (the file has no
# query_pre_attn_scalar); the gemma3 fixture's HF config says 24, so its GGUF computes a different model
GGUF_SCALAR = {"gemma3": 16, "gemma2": 16}


def _reference(families, name: str, fmt: str):
    """transformers' model of what llmtrace reads: the HF model itself, or the GGUF read back with llama.cpp's scale."""
    if fmt == "hf":
        return families.model(name)
    return hf_model_via_state_dict(families.gguf(name), FAMILIES[name], query_pre_attn_scalar=GGUF_SCALAR[name])


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens by full recomputation (no cache, no EOS stop)."""
    x = torch.tensor([ids])
    for _ in range(n):
        x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[0, len(ids):].tolist()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", GEMMAS)
def test_logits_equal_transformers_past_the_window(families, loaded, name, fmt):
    lm = loaded(name, fmt)
    ref = _reference(families, name, fmt)
    with torch.no_grad():
        ours, theirs = lm.model(prompt_ids())[0], ref(prompt_ids()).logits[0]  # (T, V), T = 14 > the window 4
    assert len(PROMPT_IDS) > lm.config.sliding_window + 2
    diff, tol = float((ours - theirs).abs().max()), logits_tol(lm, PROMPT_IDS)  # 8x the pass's float32 error
    assert diff <= tol, f"{name} {fmt}: logits differ by {diff:.3g}, over {tol:.3g}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", GEMMAS)
def test_prompt_ids_and_greedy_tokens_equal_transformers(families, loaded, name, fmt):
    """Through generate's KV-cache path: the prompt's ids as transformers' tokenizer gives them, then N_NEW greedy
    tokens, the sliding-window layers reading only their last 4 slots at every decode step."""
    import transformers

    import llmtrace.api as api

    lm = loaded(name, fmt)
    expected_ids = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(name))).encode(PROMPT)
    _, ids = lm.tokenizer.encode_prompt(PROMPT)
    assert ids == expected_ids and len(ids) > lm.config.sliding_window
    run = api.Model(lm).generate(PROMPT, max_new_tokens=N_NEW, temperature=0, ignore_eos=True, trace="none")
    assert run.tokens == _hf_greedy(_reference(families, name, fmt), ids, N_NEW)


def test_gemma3_gguf_scale_is_llama_cpps(families, loaded):
    """The converter drops query_pre_attn_scalar (24 in the fixture): the GGUF runs with 1/sqrt(key_length), as
    llama.cpp does, which here is another model than the HF directory's; transformers' own GGUF loader given the
    same scalar agrees with llmtrace; the run header says where the scale came from."""
    hf, gguf = loaded("gemma3", "hf"), loaded("gemma3", "gguf")
    assert hf.config.attn_scale == pytest.approx(24 ** -0.5) and gguf.config.attn_scale == pytest.approx(16 ** -0.5)
    loader = hf_model_from_gguf(families.gguf("gemma3"),
                                replace(FAMILIES["gemma3"], transformers_needs={"query_pre_attn_scalar": 16}))
    with torch.no_grad():
        ours, theirs = gguf.model(prompt_ids())[0], loader(prompt_ids()).logits[0]
        other = hf.model(prompt_ids())[0]
    assert float((ours - theirs).abs().max()) <= logits_tol(gguf, PROMPT_IDS)
    assert float((ours - other).abs().max()) > 1e-2  # the scalar matters
    from llmtrace.model.family import describe_changes

    said = " ".join(describe_changes(gguf.config))
    assert "no query_pre_attn_scalar" in said and "llama.cpp" in said
    assert "1/√24" in " ".join(describe_changes(hf.config))


def test_gemma3_config_reads_as_transformers(loaded):
    c = loaded("gemma3", "gguf").config
    h = loaded("gemma3", "hf").config
    for config in (c, h):
        assert config.layer_types == ["sliding"] * 5 + ["full"] and config.sliding_window == 4
        assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
        assert config.ffn_act == "gelu_tanh" and config.tie_embeddings and config.head_dim == 16
        assert score_cap(config) is None and config.final_softcap is None


def test_gemma2_config_reads_the_caps(loaded):
    for fmt in ("hf", "gguf"):
        c = loaded("gemma2", fmt).config
        assert (score_cap(c), c.final_softcap) == (10.0, 5.0)
        assert c.parts == {"softcap": {"cap": 10.0}}  # its own config part, read by its own attention
        assert c.layer_types == ["sliding", "full"] and c.sliding_window == 4


@pytest.mark.parametrize("name", GEMMAS)
def test_norms_add_one_in_hf_not_in_gguf(families, loaded, name):
    """HF stores w, the GGUF 1 + w: both load as 1 + w (applying the 1 twice is the classic bug)."""
    w = families.model(name).state_dict()["model.layers.0.post_feedforward_layernorm.weight"]
    for fmt in ("hf", "gguf"):
        assert torch.equal(loaded(name, fmt).model.layers[0].post_ffn_norm.weight, w + 1)


# ----------------------------------------------------------------------------------------------------------------
# every step visible


GEMMA3_STEPS = {"embed_scaled": "s4", "q_norm": "s6.2", "k_norm": "s6.2", "post_attn_norm": "s6.6",
                "post_ffn_norm": "s6.7"}
GEMMA2_STEPS = {"embed_scaled": "s4", "scores_raw": "s6.4", "post_attn_norm": "s6.6", "post_ffn_norm": "s6.7",
                "logits_raw": "s9"}


@pytest.mark.parametrize("name, steps", [("gemma3", GEMMA3_STEPS), ("gemma2", GEMMA2_STEPS)])
def test_every_gemma_step_is_a_point_in_the_full_trace(families, capsys, tmp_path, name, steps):
    out = tmp_path / "trace.jsonl"
    code, stdout, err = run_cli(capsys, "generate", PROMPT, "-m", families.hf_dir(name), "-n", "2", "--trace",
                                "full", "--jsonl", out, "--temperature", "0")
    assert code == 0, err
    events = [json.loads(line) for line in out.read_text().splitlines()]
    run = next(e for e in events if e["event"] == "run")
    declared = {p["name"]: p["seed_step"] for p in run["points"]}
    assert {k: declared.get(k) for k in steps} == steps
    seen = {(e["phase"], e["name"]) for e in events if e["event"] == "tensor"}
    for point in steps:
        assert ("prefill", point) in seen and ("decode", point) in seen, point
    for point in steps:  # the prefill's shape table names each step
        assert point in stdout, point
    assert "what it changes from Llama" in stdout


@torch.no_grad()
def test_gemma2_caps_are_what_the_points_show(loaded):
    """scores = cap·tanh(scores_raw / cap) where not masked, logits = cap·tanh(logits_raw / cap), each |x| ≤ cap (tanh saturates at 1 in float32)."""
    from llmtrace.model.capture import capture

    lm = loaded("gemma2", "hf")
    with capture(lm.model, lambda layer, name: name in ("scores_raw", "scores", "logits_raw", "logits"),
                 layers=[0], attention=[0], spell_out=True) as kept:
        lm.model(prompt_ids())
    raw, capped = kept[(0, "scores_raw")], kept[(0, "scores")]
    seen = torch.isfinite(capped)
    assert torch.allclose(capped[seen], (10 * torch.tanh(raw / 10))[seen])
    assert float(raw.abs().max()) > 10 > float(capped[seen].abs().max())  # the cap bit
    assert torch.allclose(kept[(None, "logits")], 5 * torch.tanh(kept[(None, "logits_raw")] / 5))
    assert float(kept[(None, "logits_raw")].abs().max()) > 5 >= float(kept[(None, "logits")].abs().max())


@torch.no_grad()
def test_embedding_scale_rounds_in_the_model_dtype():
    from llmtrace.model.families.gemma2 import embed_scale

    assert float(embed_scale(640, torch.float32)) == pytest.approx(640 ** 0.5, rel=1e-7)
    assert float(embed_scale(3072, torch.bfloat16)) == 55.5  # transformers' comment: sqrt(3072) = 55.4256 -> 55.5


@pytest.mark.parametrize("name", GEMMAS)
@torch.no_grad()
def test_the_forward_pass_captures_whole_for_the_compiled_step(loaded, name):
    """--compile captures Transformer.forward in one graph (fullgraph): Gemma's steps add no graph break. TorchDynamo
    only (backend "eager": no code generated), the decode step's shape with a KV cache, against the eager pass."""
    model = loaded(name, "hf").model
    ids = torch.tensor([PROMPT_IDS])
    cache_a, cache_b = model.new_cache(len(PROMPT_IDS) + 1), model.new_cache(len(PROMPT_IDS) + 1)
    model(ids, cache_a, 0), model(ids, cache_b, 0)
    step = torch.compile(model.forward, fullgraph=True, backend="eager")
    nxt = torch.tensor([[5]])
    got = step(nxt, cache_a, len(PROMPT_IDS), last_only=True)
    assert torch.equal(got, model(nxt, cache_b, len(PROMPT_IDS), last_only=True))


# ----------------------------------------------------------------------------------------------------------------
# bad input: a Gemma config llmtrace cannot run is refused, naming the field


def _config(families, name: str, tmp_path, **change):
    import shutil

    d = tmp_path / name
    shutil.copytree(families.hf_dir(name), d)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in change.items():
        if value is None and key.startswith("-"):
            cfg.pop(key[1:], None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name, change, field", [
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma3", {"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]}, "layer_types"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
])  # fmt: skip
def test_a_config_llmtrace_cannot_run_is_refused_by_field(families, capsys, tmp_path, name, change, field):
    path = _config(families, name, tmp_path, **change)
    line = fails(capsys, 1, "generate", "hi", "-m", path, "-n", "1", says=(field, "not supported"))
    assert "Traceback" not in line


def test_defaults_are_transformers_when_a_config_leaves_them_out(families, tmp_path):
    """A Gemma 2 config.json without caps, window or head_dim runs with transformers' defaults (50, 30, 4096, 256),
    not without them."""
    import transformers

    from llmtrace.checkpoint.hf_checkpoint import config_from_hf

    cfg = json.loads((families.hf_dir("gemma2") / "config.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types", "head_dim",
                "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings"):
        cfg.pop(key, None)
    ours = config_from_hf(cfg, "config.json")
    theirs = transformers.Gemma2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    assert (score_cap(ours), ours.final_softcap) == (theirs.attn_logit_softcapping, theirs.final_logit_softcapping)
    assert ours.sliding_window == theirs.sliding_window and ours.head_dim == theirs.head_dim
    assert ours.layer_types == [t.split("_")[0] for t in theirs.layer_types]
    assert ours.attn_scale == theirs.query_pre_attn_scalar ** -0.5 and ours.tie_embeddings is True


# ----------------------------------------------------------------------------------------------------------------
# explain: the band of a sliding-window layer, a global layer said to be global, each check on Gemma's own maths


def _explain(capsys, path, layer: int, tmp_path):
    out = tmp_path / f"explain-{layer}.jsonl"
    code, stdout, err = run_cli(capsys, "explain", PROMPT, "-m", path, "--layer", str(layer), "--jsonl", out)
    assert code == 0, err
    events = [json.loads(line) for line in out.read_text().splitlines()]
    return stdout, events, out


def _section(events, name):
    return next(e for e in events if e["event"] == "explain" and e.get("section") == name)


@pytest.mark.parametrize("name, layer, window, table, theta", [
    ("gemma3", 0, 4, "local", 10_000.0), ("gemma3", 5, None, "global", 1_000_000.0),
    ("gemma2", 0, 4, "global", 10_000.0), ("gemma2", 1, None, "global", 10_000.0),
])  # fmt: skip
def test_explain_draws_the_band_or_says_global(families, capsys, tmp_path, name, layer, window, table, theta):
    import jsonschema

    from llmtrace.trace.events import schema_path

    stdout, events, saved = _explain(capsys, families.hf_dir(name), layer, tmp_path)
    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    for ev in events:
        validator.validate(ev)
    amap, att, rope = _section(events, "attention_map"), _section(events, "attention"), _section(events, "rope")
    assert (amap["window"], amap["model_window"], att["window"]) == (window, 4, window)
    T = amap["n_tokens"]
    beyond = sum(1 for q in range(T) for k in range(q + 1) if window and q - k >= window)  # out of the band
    assert att["masked"] == 4 * (T * (T - 1) // 2 + beyond)  # H = 4 heads
    for q, row in enumerate(amap["matrix"]):  # no weight outside the band
        assert all(w == 0 for k, w in enumerate(row) if k > q or (window and q - k >= window))
    # RoPE on this layer's own table, from the q/k the layer rotates (Gemma 3: q_norm, k_norm)
    assert (rope["rope_table"], rope["theta"]) == (table, theta)
    assert rope["check_q_rope_max_abs_diff"] == 0 and rope["check_k_rope_max_abs_diff"] == 0
    assert att["check_scores_max_abs_diff"] <= 1e-5  # the layer's own scale (and soft-cap) reproduce its scores
    assert _section(events, "ffn")["check_act_max_abs_diff"] == 0 and _section(events, "ffn")["kind"] == "GeGLU"
    norms = [e["norm"] for e in events if e.get("section") == "rmsnorm"]
    assert norms == ["attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm"]
    assert all(e["check_max_abs_diff"] == 0 for e in events if e.get("section") == "rmsnorm")
    if window:
        assert "╳" in stdout and f"only the last {window} keys" in stdout
    else:
        assert "╳" not in stdout and "a global layer" in stdout
    code, shown, err = run_cli(capsys, "show", saved)  # the saved run draws the same view
    assert code == 0, err
    assert ("╳" in shown) == bool(window)


def test_a_gemma3_gguf_with_a_soft_cap_is_refused_by_key():
    """The converter writes final_logit_softcapping when a Gemma 3 config sets it; Gemma 3's points have no cap."""
    from llmtrace.errors import LlmtraceError
    from llmtrace.model.families.gemma3 import gguf_config

    meta = {"block_count": 6, "embedding_length": 64, "attention.head_count": 4, "attention.key_length": 16,
            "final_logit_softcapping": 30.0}
    with pytest.raises(LlmtraceError, match="gemma3.final_logit_softcapping 30.0 is not supported"):
        gguf_config(lambda key, default=None: meta.get(key, default))
    del meta["final_logit_softcapping"]
    got = gguf_config(lambda key, default=None: meta.get(key, default))
    assert got["attn_scale"] == 16 ** -0.5 and got["rope_local_theta"] == 10_000.0 and "sliding_window" not in got
    meta["block_count"], meta["attention.sliding_window"] = 62, 1024  # the 27B model: 1/sqrt(D/H), llama.cpp's rule
    got = gguf_config(lambda key, default=None: meta.get(key, default))
    assert got["attn_scale"] == 16 ** -0.5 and got["layer_types"][:6] == ["sliding"] * 5 + ["full"]


@torch.no_grad()
def test_gemma3_linear_rope_scaling_on_the_global_layers(tmp_path):
    """Gemma 3 4B-27B scale the global layers' RoPE linearly (factor 8) and leave the local ones: as transformers."""
    from families import make_model, write_hf_dir

    from llmtrace.checkpoint.load import load_model

    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    family = replace(FAMILIES["gemma3"], config={**FAMILIES["gemma3"].config, "rope_parameters": rope})
    model = make_model(family)
    write_hf_dir(tmp_path, family, model)
    lm = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert lm.config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    ours, theirs = lm.model(prompt_ids())[0], model(prompt_ids()).logits[0]
    assert float((ours - theirs).abs().max()) <= logits_tol(lm, PROMPT_IDS)
    unscaled = make_model(FAMILIES["gemma3"])  # the same weights (same seed), no scaling: another model
    assert float((unscaled(prompt_ids()).logits[0] - theirs).abs().max()) > 1e-3


@pytest.mark.parametrize("name", GEMMAS)
def test_a_padded_batch_row_runs_as_its_prompt_alone(loaded, name):
    """Left padding and the window together: the short row's keys are counted in slots, its pads never attended."""
    import llmtrace.api as api

    model = api.Model(loaded(name, "hf"))
    prompts = [PROMPT, "Hi there"]
    batch = model.generate(prompts, max_new_tokens=6, temperature=0, ignore_eos=True, trace="none")
    rows = {r["row"]: r["tokens"] for r in batch.events[-1]["rows"]}
    for r, prompt in enumerate(prompts):
        alone = model.generate(prompt, max_new_tokens=6, temperature=0, ignore_eos=True, trace="none")
        assert rows[r] == alone.tokens, prompt
