"""Granite 4.0-H (a Mamba2 hybrid), from its HF directory and from the GGUF llama.cpp's converter writes (arch
granitehybrid), against transformers' GraniteMoeHybridForCausalLM: Mamba2 layers whose memory is a fixed-size state,
attention layers without RoPE, a shared MLP beside the experts, µP multipliers.

transformers' prefill runs the chunked form of the scan and its decode steps the recurrence, which llmtrace runs
everywhere: the logits are compared with both, at every position (fed token by token through transformers' cache,
every position is the recurrent form). The GGUF holds the same float32 numbers (A stored as −exp(A_log), q/k rows
permuted, gate and up split), checked against the same transformers model."""

import pytest
import torch
from helpers import check_run, greedy_hf, greedy_ours, stepwise_hf

from families import PROMPT_IDS

NAMES = ["granite_hybrid", "granite_hybrid_dense"]
TOL = 1e-4




def _tol(logits: torch.Tensor) -> float:
    """1e-4, relative to the logits' size past 10 (the tied fixture's head is the N(0, 1) embedding)."""
    return TOL * max(1.0, float(logits.abs().max()) / 10)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_at_every_position_and_greedy_match_transformers(families, loaded, name, fmt):
    lm = loaded(name, fmt)
    reference = families.model(name)
    assert lm.config.family == "granite_hybrid"
    assert lm.config.layer_types == (["mamba", "mamba", "full", "mamba"] if name == "granite_hybrid"
                                     else ["mamba", "full", "mamba"])
    assert lm.config.no_rope_layers == list(range(lm.config.n_layers))  # no RoPE anywhere, as in HF and llama.cpp
    stepwise, _ = stepwise_hf(reference, PROMPT_IDS)
    with torch.no_grad():
        ours, prefill = lm.model(torch.tensor([PROMPT_IDS]))[0], reference(torch.tensor([PROMPT_IDS])).logits[0]
    assert float((ours - stepwise).abs().max()) <= _tol(stepwise)  # the recurrence, as transformers decodes
    assert float((ours - prefill).abs().max()) <= _tol(prefill)  # transformers' chunked prefill
    if name == "granite_hybrid":
        check_run(lm, reference, PROMPT_IDS)  # 1e-4 absolute, and 8 greedy tokens through both caches
    else:
        assert greedy_ours(lm, PROMPT_IDS, 8) == greedy_hf(reference, PROMPT_IDS, 8)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ids_are_transformers(families, loaded, name):
    import transformers

    expected = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(name))).encode("The quick brown fox")
    for fmt in ("hf", "gguf"):
        assert loaded(name, fmt).tokenizer.encode("The quick brown fox") == expected


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_state_after_the_prompt_is_transformers_cache_state(families, loaded, fmt):
    """h of every Mamba2 layer after the prompt, and the convolution's last inputs, equal what transformers' cache
    holds after the same prompt fed token by token (and after its chunked prefill); the attention layer's keys are
    the cache's."""
    lm = loaded("granite_hybrid", fmt)
    model = families.model("granite_hybrid")
    _, stepped = stepwise_hf(model, PROMPT_IDS)
    with torch.no_grad():
        prefilled = model(torch.tensor([PROMPT_IDS]), use_cache=True).past_key_values
        cache = lm.model.new_cache(len(PROMPT_IDS))
        lm.model(torch.tensor([PROMPT_IDS]), cache, 0)
    assert cache.state_layers == [0, 1, 3]
    kc = lm.config.parts["mamba2"]["conv_kernel"]
    for theirs in (stepped, prefilled):
        for i in cache.state_layers:
            h = theirs.get_recurrent_state(i, state_idx=0)  # (1, Hs, P, N)
            assert h.shape == cache.layers[i]["ssm"].shape and float(h.abs().max()) > 0.1
            assert float((cache.layers[i]["ssm"] - h).abs().max()) <= 1e-5 * max(1.0, float(h.abs().max()))
            conv = theirs.get_conv_state(i, state_idx=0)  # (1, Cs, Kc): one input more than the kernel needs
            assert float((cache.layers[i]["conv"] - conv[..., -(kc - 1):]).abs().max()) <= 1e-5
    keys = stepped.layers[2].keys  # (1, Hkv, T, Dh); the GGUF's q/k rows were put back in HF order
    assert float((cache.layers[2].k[:, :, : len(PROMPT_IDS)] - keys).abs().max()) <= 1e-5 * float(keys.abs().max())


def test_a_wrong_state_update_fails_the_comparison(families, loaded, monkeypatch):
    """The comparison above can fail: one step of the recurrence done wrong (the decay applied after the write,
    h ← a·(h + Δ·x⊗B), a plausible slip) moves the logits far past the tolerance, and so does dropping D·x."""
    from llmtrace.model.kinds import mamba2

    lm, reference = loaded("granite_hybrid", "hf"), families.model("granite_hybrid")
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        theirs = reference(ids).logits[0]

        def diff() -> float:
            return float((lm.model(ids)[0] - theirs).abs().max())

        assert diff() <= TOL
        right = mamba2.ssm_scan

        def decay_after_write(x, B, C, dt, decay, D, h, group):
            Bh, Ch = B.repeat_interleave(group, dim=2), C.repeat_interleave(group, dim=2)
            ys = []
            for t in range(x.size(1)):
                h = (h + (dt[:, t, :, None] * Bh[:, t])[:, :, None, :] * x[:, t, :, :, None]) * decay[:, t, :, None, None]
                ys.append((h @ Ch[:, t, :, :, None]).squeeze(-1) + x[:, t] * D[:, None])
            return torch.stack(ys, dim=1), h

        monkeypatch.setattr(mamba2, "ssm_scan", decay_after_write)
        assert diff() > 100 * TOL
        monkeypatch.setattr(mamba2, "ssm_scan", lambda x, B, C, dt, decay, D, h, group: right(
            x, B, C, dt, decay, torch.zeros_like(D), h, group))
        assert diff() > 100 * TOL


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_decoding_token_by_token_equals_a_prefill_of_the_whole_sequence(loaded, fmt):
    """The state carried in the caller's cache: one token at a time gives the logits and the state of one pass."""
    lm = loaded("granite_hybrid", fmt)
    ids = torch.tensor([PROMPT_IDS])
    whole, steps = lm.model.new_cache(len(PROMPT_IDS)), lm.model.new_cache(len(PROMPT_IDS))
    with torch.no_grad():
        at_once = lm.model(ids, whole, 0)[0]
        one_by_one = torch.stack([lm.model(ids[:, t : t + 1], steps, t)[0, -1] for t in range(len(PROMPT_IDS))])
    assert float((at_once - one_by_one).abs().max()) <= TOL
    for i in whole.state_layers:
        for name in ("ssm", "conv"):
            assert float((whole.layers[i][name] - steps.layers[i][name]).abs().max()) <= 1e-5


def test_without_its_state_a_decode_step_is_wrong(loaded):
    """The state is the layer's memory: a decode step from a zeroed state gives other logits."""
    lm = loaded("granite_hybrid", "hf")
    ids = torch.tensor([PROMPT_IDS])
    cache = lm.model.new_cache(len(PROMPT_IDS) + 1)
    with torch.no_grad():
        lm.model(ids, cache, 0)
        saved = [cache.layers[i]["ssm"].clone() for i in cache.state_layers]
        right = lm.model(ids[:, -1:], cache, len(PROMPT_IDS))[0, -1]
        for i, h in zip(cache.state_layers, saved):
            cache.layers[i].write("ssm", h)
            cache.layers[i]["ssm"].zero_()
        wrong = lm.model(ids[:, -1:], cache, len(PROMPT_IDS))[0, -1]
    assert float((right - wrong).abs().max()) > 1e-2


def test_a_mamba2_layers_memory_is_constant_while_attentions_grows(families):
    """From the declarations: KVCache gives each Mamba2 layer Hs·P·N + Cs·(Kc−1) float32 numbers whatever the
    length, the attention layer 2·Hkv·Dh a token; the run event's model.memory says the same, and each step's
    kv_cache grows by the attention layer's bytes only."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("granite_hybrid")), device="cpu")
    c = model.config
    p = c.parts["mamba2"]
    channels = p["heads"] * p["head_dim"] + 2 * p["groups"] * p["state"]
    per_layer = 4 * (p["heads"] * p["head_dim"] * p["state"] + channels * (p["conv_kernel"] - 1))
    assert per_layer == 4 * (8 * 16 * 16 + 192 * 3)
    for length in (4, 40):
        cache = model.loaded.model.new_cache(length)
        assert cache.state_layers == [0, 1, 3] and cache.state_bytes == 3 * per_layer
        assert cache.bytes_per_token == 2 * c.n_kv_heads * c.head_dim * 4 and cache.kv_layers == 1
    run = model.generate("The quick brown fox", max_new_tokens=3, trace="full")
    layers = next(e for e in run.events if e["event"] == "run")["model"]["memory"]
    assert [m["kind"] for m in layers] == ["state", "state", "kv", "state"]
    assert [m["constant_bytes"] for m in layers] == [per_layer, per_layer, 0, per_layer]
    assert [m["per_token_bytes"] for m in layers] == [0, 0, 2 * c.n_kv_heads * c.head_dim * 4, 0]
    kv = [e["kv_cache"] for e in run.events if e["event"] == "step"]
    assert [k["bytes_used"] for k in kv] == [k["seq_len"] * k["bytes_per_token"] for k in kv]
    assert kv[1]["bytes_used"] > kv[0]["bytes_used"]
    assert all(k["state"]["bytes"] == 3 * per_layer for k in kv)  # the same at every step


def test_what_granite_changes_is_said_with_its_numbers(loaded):
    from llmtrace.model.family import describe_changes

    said = describe_changes(loaded("granite_hybrid", "gguf").config)
    assert said[0].startswith("3 of 4 layers are Mamba2: a state h of 8 heads × 16 × 16 = 2,048 numbers per layer")
    assert any("attention_multiplier 0.4" in line and "no RoPE" in line for line in said)
    assert any("embedding × 12" in line and "residual_multiplier 0.22" in line and "logits ÷ 4" in line for line in said)
    assert any("4 SwiGLU experts" in line and "shared" in line for line in said)


def test_explain_on_a_mamba2_layer_checks_every_step_under_its_own_headings(families):
    """explain --layer 0 (Mamba2): every declared step recomputed from the recorded inputs agrees with the pass, the
    layer's headings are Mamba2's (not attention's), and its memory is the state's fixed bytes."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("granite_hybrid")), device="cpu")
    events = [e for e in model.explain("The quick brown fox", layer=0).events if e["event"] == "explain"]
    by = {e["section"]: e for e in events}
    assert "attention" not in by and "kv_cache" not in by and "rope" not in by
    steps = by["steps"]["steps"]
    assert all(r["check"] is not None and r["check"]["ok"] for r in steps if r["op"] != "stream"), steps
    ops = {r["point"]: r["op"] for r in steps}
    assert ops["ssm_state"] == "ssm_scan" and ops["ssm_conv"] == "conv1d" and ops["ssm_norm"] == "group_gated_rmsnorm"
    assert ops["attn_scaled"] == "scale" and ops["ffn_out"] == "add"
    plan = by["model"]["maths"]["kinds"][by["model"]["maths"]["layer_kind"][0]]["plan"]
    assert plan["mixer"] == "mamba2" and plan["headings"]["s6.5"][0].startswith("the selective scan")
    d = by["state_update"]  # one update of head 0's state at the last token, worked out in float64
    assert d["check_state_max_abs_diff"] <= 1e-5 and d["check_out_max_abs_diff"] <= 1e-5
    assert 0 < d["a"] < 1 and d["dt"] > 0 and d["group"] == 0
    assert d["h_before"] != d["h_after"] and d["write"] != [[0.0] * 4] * 4  # the token moved the state
    s = by["state_cache"]
    assert s["state"] == {"ssm_conv_state": [192, 3], "ssm_state": [8, 16, 16]}
    assert s["state_bytes"] == 4 * (192 * 3 + 8 * 16 * 16) and s["attention_layers"] == [2]
    assert "h ← ssm_decay·h + ssm_dt·ssm_x⊗ssm_B" in s["updates"]["ssm_state"]
    last = {e["section"]: e for e in model.explain("The quick brown fox", layer=3, head=3).events
            if e["event"] == "explain"}["state_update"]
    assert last["head"] == 3 and last["group"] == 0  # heads 0-3 read the first group of B and C, 4-7 the second
    assert last["check_state_max_abs_diff"] <= 1e-5 and last["check_out_max_abs_diff"] <= 1e-5


def test_explain_renders_a_mamba2_layer(families, capsys, monkeypatch):
    """The terminal view of a Mamba2 layer: the update worked out and checked, under its own heading, and why no
    cache grows."""
    from helpers import run_cli

    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = run_cli(capsys, "explain", "-m", families.hf_dir("granite_hybrid"), "The quick brown fox",
                             "--layer", "1")
    assert code == 0, err
    assert "the selective scan, head 0 (B and C of group 0)" in out and "no KV cache grows here" in out
    assert "h computed in float64 vs the state the pass left ✓" in out
    assert "the delta rule" not in out and "α·S" not in out  # nothing of linear attention's lesson


@pytest.mark.parametrize("name", NAMES)
def test_run_with_cache_is_transformers_hidden_states(loaded, families, name):
    """The research API's cache: every layer's resid_post is transformers' hidden state (within 1e-4 relative to its
    size), and each Mamba2 layer's state is recorded."""
    from llmtrace.api import Model

    lm, hf = loaded(name, "hf"), families.model(name)
    logits, cache = Model(lm).run_with_cache(PROMPT_IDS, names=["*.resid_post", "*.ssm_state"])
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT_IDS]), output_hidden_states=True)
    assert float((logits - out.logits).abs().max()) <= _tol(out.logits)
    for i in range(lm.config.n_layers - 1):
        h = out.hidden_states[i + 1]
        assert float((cache[f"{i}.resid_post"] - h).abs().max()) <= 1e-4 * max(1.0, float(h.abs().max()))
    mamba = [i for i, t in enumerate(lm.config.layer_types) if t == "mamba"]
    assert [k for k in cache.keys() if k.endswith("ssm_state")] == [f"{i}.ssm_state" for i in mamba]


@torch.no_grad()
def test_each_layer_reports_its_kinds_points_in_declared_order(loaded):
    """A Mamba2 layer reports Mamba2's points and the attention layer attention's, each in the declared order, with
    the multiplier's points between each sub-layer and its add."""
    lm = loaded("granite_hybrid", "hf")
    seen = []
    with lm.model.hooked(lambda layer, name, x: seen.append((layer, name))):
        lm.model(torch.tensor([PROMPT_IDS[:5]]), lm.model.new_cache(8), 0, last_only=True)
    points, maths = lm.model.declared_points(), lm.model.maths()
    for layer in range(lm.config.n_layers):
        names = [n for lay, n in seen if lay == layer]
        assert names == [n for n in points.names(layer=True) if n in maths.layers[layer]]
        assert ("ssm_state" in names) == (layer != 2) and ("scores" in names) == (layer == 2)
        assert names.index("attn_scaled") == names.index("o_proj") + 1 and names[-2:] == ["ffn_scaled", "resid_post"]
    assert [n for lay, n in seen if lay is None] == ["embed", "embed_scaled", "final_norm", "last", "logits_raw",
                                                     "logits"]


def test_compare_eval_and_the_quantized_paths_run_on_the_tiny_gguf(families, loaded, capsys, tmp_path, monkeypatch):
    """compare of the HF directory against its GGUF finds them identical; eval scores a text from the GGUF;
    --keep-quantized holds a q8_0 file's matrices in their blocks and computes what the dequantized file computes; the
    fast path runs a Mamba2 layer as it is, its logits those of the exact path within bfloat16's rounding."""
    from helpers import run_cli

    from llmtrace.checkpoint.load import load_model

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    hf, gguf = families.hf_dir("granite_hybrid"), families.gguf("granite_hybrid")
    code, out, err = run_cli(capsys, "compare", "-m", hf, "-m", gguf, "The quick brown fox")
    assert code == 0, err
    assert "runs agree within 0.0001 at every point and position (identical)" in out
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    code, out, err = run_cli(capsys, "eval", str(text), "-m", gguf, "--ctx", "32", "--chunks", "2")
    assert code == 0, err
    assert "PPL = " in out
    q8 = families.gguf("granite_hybrid", "q8_0")
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        kept = load_model(str(q8), device="cpu", dtype="float32", keep_quantized=True)
        plain = load_model(str(q8), device="cpu", dtype="float32")
        assert float((kept.model(ids) - plain.model(ids)).abs().max()) <= 1e-4
        exact = loaded("granite_hybrid", "gguf").model(ids)[0].float()
        fast = load_model(str(gguf), device="cpu", fast=True).model(ids)[0].float()
    cos = torch.nn.functional.cosine_similarity(exact.flatten(), fast.flatten(), dim=0)
    assert float(cos) > 0.99 and float((fast - exact).abs().max()) < 0.1 * float(exact.abs().max())


@pytest.mark.parametrize("name", NAMES)
def test_each_row_of_a_padded_batch_is_its_prompt_alone(loaded, name):
    """A batch of PROMPT_IDS and a 5-token prompt (9 pads on the left): the short row's stream and logits from its
    first real token are those of its pass alone. A pad's input is zero, so it writes nothing into the state (x and B
    are 0) and leaves zeros in the convolution's window, as no token at all would."""
    from llmtrace.api import Model

    model = Model(loaded(name, "hf"))
    short = PROMPT_IDS[:5]
    logits, cache = model.run_with_cache([PROMPT_IDS, short], names=["*.resid_post", "*.ssm_state"])
    alone_logits, alone = model.run_with_cache(short, names=["*.resid_post", "*.ssm_state"])
    pad = cache.pads[1]
    assert cache.pads == [0, len(PROMPT_IDS) - 5]
    for i in range(model.config.n_layers):
        torch.testing.assert_close(cache[f"{i}.resid_post"][1, pad:], alone[f"{i}.resid_post"][0], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1, pad:], alone_logits[0], atol=TOL, rtol=0)
    state = next(k for k in alone.keys() if k.endswith("ssm_state"))
    torch.testing.assert_close(cache[state][1], alone[state][0], atol=1e-5, rtol=0)
