"""Qwen3.5 (dense), from its HF directory and from the GGUF llama.cpp's converter writes (arch qwen35), against
transformers: three Gated DeltaNet layers, whose memory is a fixed-size state, then a gated full-attention layer.

The reference is transformers' Qwen3_5ForCausalLM. Its prefill runs the chunked form of the delta rule and its decode
steps the recurrent one (torch_recurrent_gated_delta_rule), which llmtrace runs everywhere: the logits are compared
with both, at every position (fed token by token through transformers' cache, every position is the recurrent form).
The GGUF holds the same float32 numbers, its value heads in llama.cpp's tiled order, which llmtrace reads in that
order: it is checked against the same transformers model."""

import pytest
import torch
from helpers import check_run, float64_twin, greedy_hf, greedy_ours, rounding_tol, stepwise_hf

from families import PROMPT_IDS

NAMES = ["qwen3_5", "qwen3_5_tied"]




def _exact(lm, ids: list[int]):
    """llmtrace's pass on ids in float64 (helpers.float64_twin): its logits, and the cache it leaves."""
    twin = float64_twin(lm)
    cache = twin.new_cache(len(ids))
    with torch.no_grad():
        return twin(torch.tensor([ids]), cache, 0)[0], cache


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_at_every_position_and_greedy_match_transformers(families, loaded, name, fmt):
    lm = loaded(name, fmt)
    reference = families.model(name)
    assert lm.config.family == "qwen3_5"
    assert lm.config.layer_types == ["linear", "linear", "linear", "full"]
    assert lm.config.parts["linear_attention"]["v_order"] == ("grouped" if fmt == "hf" else "tiled")
    assert lm.config.rotary_dim == 4 and lm.config.tie_embeddings == (name == "qwen3_5_tied")
    stepwise, _ = stepwise_hf(reference, PROMPT_IDS)
    with torch.no_grad():
        ours, prefill = lm.model(torch.tensor([PROMPT_IDS]))[0], reference(torch.tensor([PROMPT_IDS])).logits[0]
    tol = rounding_tol(ours, _exact(lm, PROMPT_IDS)[0])  # 8x the pass's own float32 error (helpers.ROUNDING_MARGIN)
    assert float((ours - stepwise).abs().max()) <= tol  # the recurrent form, as transformers decodes
    assert float((ours - prefill).abs().max()) <= tol  # transformers' chunked prefill
    if name == "qwen3_5":
        check_run(lm, reference, PROMPT_IDS, tol)  # and 8 greedy tokens through both caches
    else:
        assert greedy_ours(lm, PROMPT_IDS, 8) == greedy_hf(reference, PROMPT_IDS, 8)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ids_are_transformers(families, loaded, name):
    import transformers

    expected = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(name))).encode("The quick brown fox")
    for fmt in ("hf", "gguf"):
        assert loaded(name, fmt).tokenizer.encode("The quick brown fox") == expected


@pytest.mark.parametrize("name", NAMES)
def test_the_state_after_the_prompt_is_transformers_cache_state(families, loaded, name):
    """S of every linear layer after the prompt, and the convolution's last inputs, equal what transformers' cache
    holds (recurrent_states, conv_states) after the same prompt fed token by token; the attention layer's keys are
    the cache's."""
    lm = loaded(name, "hf")
    _, theirs = stepwise_hf(families.model(name), PROMPT_IDS)
    cache = lm.model.new_cache(len(PROMPT_IDS))
    with torch.no_grad():
        lm.model(torch.tensor([PROMPT_IDS]), cache, 0)
    _, exact = _exact(lm, PROMPT_IDS)  # each tolerance: 8x that value's own float32 error (helpers.ROUNDING_MARGIN)
    assert cache.state_layers == [0, 1, 2]
    for i in cache.state_layers:
        S, mine = theirs.get_recurrent_state(i, state_idx=0), cache.layers[i]["state"]  # (1, Hv, Dk, Dv)
        assert S.shape == mine.shape and float(S.abs().max()) > 0.1
        assert float((mine - S).abs().max()) <= rounding_tol(mine, exact.layers[i]["state"])
        conv = theirs.get_conv_state(i, state_idx=0)  # (1, C, Kc): it keeps one input more than the kernel needs
        kc, mine = lm.config.parts["linear_attention"]["conv_kernel"], cache.layers[i]["conv"]
        assert float((mine - conv[..., -(kc - 1):]).abs().max()) <= rounding_tol(mine, exact.layers[i]["conv"])
    keys, T = theirs.layers[3].keys, len(PROMPT_IDS)  # (1, Hkv, T, Dh)
    mine = cache.layers[3].k[:, :, :T]
    assert float((mine - keys).abs().max()) <= rounding_tol(mine, exact.layers[3].k[:, :, :T])


def test_the_states_match_transformers_prefill_too(families, loaded):
    """transformers' own prefill (the chunked form) leaves the same state, within 8x the state's own float32 error."""
    lm, model = loaded("qwen3_5", "hf"), families.model("qwen3_5")
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT_IDS]), use_cache=True).past_key_values
        cache = lm.model.new_cache(len(PROMPT_IDS))
        lm.model(torch.tensor([PROMPT_IDS]), cache, 0)
    _, exact = _exact(lm, PROMPT_IDS)
    for i in cache.state_layers:
        mine = cache.layers[i]["state"]
        assert float((mine - theirs.get_recurrent_state(i, state_idx=0)).abs().max()) <= rounding_tol(
            mine, exact.layers[i]["state"])


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_decoding_token_by_token_equals_a_prefill_of_the_whole_sequence(loaded, fmt):
    """The state carried in the caller's cache: one token at a time gives the logits and the state of one pass."""
    lm = loaded("qwen3_5", fmt)
    ids = torch.tensor([PROMPT_IDS])
    whole, steps = lm.model.new_cache(len(PROMPT_IDS)), lm.model.new_cache(len(PROMPT_IDS))
    with torch.no_grad():
        at_once = lm.model(ids, whole, 0)[0]
        one_by_one = torch.stack([lm.model(ids[:, t : t + 1], steps, t)[0, -1] for t in range(len(PROMPT_IDS))])
    logits, exact = _exact(lm, PROMPT_IDS)  # each tolerance: 8x that value's own float32 error
    assert float((at_once - one_by_one).abs().max()) <= rounding_tol(at_once, logits)
    for i in whole.state_layers:
        for part in ("state", "conv"):
            mine = whole.layers[i][part]
            assert float((mine - steps.layers[i][part]).abs().max()) <= rounding_tol(mine, exact.layers[i][part])


def test_without_its_state_a_decode_step_is_wrong(loaded):
    """The state is the layer's memory: a decode step from a zeroed state gives other logits."""
    lm = loaded("qwen3_5", "hf")
    ids = torch.tensor([PROMPT_IDS])
    cache = lm.model.new_cache(len(PROMPT_IDS) + 1)
    with torch.no_grad():
        lm.model(ids, cache, 0)
        saved = [cache.layers[i]["state"].clone() for i in cache.state_layers]
        right = lm.model(ids[:, -1:], cache, len(PROMPT_IDS))[0, -1]
        for i, s in zip(cache.state_layers, saved):  # back to the state after the prompt, then zeroed
            cache.layers[i].write("state", s)
            cache.layers[i]["state"].zero_()
        wrong = lm.model(ids[:, -1:], cache, len(PROMPT_IDS))[0, -1]
    assert float((right - wrong).abs().max()) > 1e-2


def test_the_trace_reports_the_state_beside_the_kv_cache(families):
    """Each step event: the KV cache's bytes grow by one position of the one attention layer, the state's stay the
    same (three layers of Hv·Dk·Dv + C·(Kc-1) float32 numbers); the state is a declared point of kind state."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("qwen3_5")), device="cpu")
    run = model.generate("The quick brown fox", max_new_tokens=3, trace="full")
    kv = [e["kv_cache"] for e in run.events if e["event"] == "step"]
    la = model.config.parts["linear_attention"]
    per_layer = 4 * (la["v_heads"] * la["k_dim"] * la["v_dim"] + (2 * la["k_heads"] * la["k_dim"] + la["v_heads"]
                                                                   * la["v_dim"]) * (la["conv_kernel"] - 1))
    c = model.config
    assert [k["bytes_per_token"] for k in kv] == [2 * c.n_kv_heads * c.head_dim * 4] * 3  # one attention layer
    assert [k["bytes_used"] for k in kv] == [k["seq_len"] * k["bytes_per_token"] for k in kv]
    assert kv[1]["bytes_used"] > kv[0]["bytes_used"]
    assert all(k["state"] == {"layers": [0, 1, 2], "bytes_per_layer": per_layer, "bytes": 3 * per_layer} for k in kv)
    assert all(k["total_bytes_used"] == k["bytes_used"] + 3 * per_layer for k in kv)
    declared = next(e for e in run.events if e["event"] == "run")["points"]
    assert {p["name"] for p in declared if p.get("state")} == {"delta_state", "conv_state"}
    shapes = {p["name"]: p for p in next(e for e in run.events if e["event"] == "shapes")["points"]}
    assert shapes["delta_state"]["shape"] == [la["v_heads"], la["k_dim"], la["v_dim"]]
    assert shapes["delta_state"]["layer"] == 0 and shapes["q_rope"]["layer"] == 3


def test_what_qwen35_changes_is_said_with_its_numbers(loaded):
    from llmtrace.model.family import describe_changes

    said = describe_changes(loaded("qwen3_5", "gguf").config)
    assert said[0].startswith("3 of 4 layers are linear attention (Gated DeltaNet): a state S of 4 × 16 × 8 = 512")
    assert any("RoPE on 4 of 16 dims" in line for line in said)
    assert any("tiled order" in line for line in said)


def test_a_vision_checkpoint_runs_its_text_model(tmp_path, families, loaded):
    """Qwen3_5ForConditionalGeneration (model_type qwen3_5: the text model's config under text_config, its tensors
    under model.language_model., a vision encoder under model.visual., MTP layers under mtp.): llmtrace runs the text
    model, exactly the text model's logits, and leaves the rest; without a text_config, one line."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from llmtrace.checkpoint.load import load_model
    from llmtrace.errors import LlmtraceError
    from llmtrace.model.family import describe_changes

    src, vl = families.hf_dir("qwen3_5"), tmp_path / "vl"
    shutil.copytree(src, vl)
    tensors = load_file(str(src / "model.safetensors"))
    wrapped = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    wrapped |= {"model.visual.patch_embed.proj.weight": torch.ones(8, 3), "mtp.fc.weight": torch.ones(4, 4)}
    (vl / "model.safetensors").unlink()
    save_file(wrapped, str(vl / "model.safetensors"))
    text = json.loads((src / "config.json").read_text())
    del text["model_type"]  # a real one names it; the wrapper's family says which it is either way
    (vl / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
        "vision_config": {"depth": 2}, "tie_word_embeddings": False}))
    lm = load_model(str(vl), device="cpu", dtype="float32")
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        assert torch.equal(lm.model(ids), loaded("qwen3_5", "hf").model(ids))
    assert any("Qwen3_5ForConditionalGeneration checkpoint: its vision encoder" in s for s in describe_changes(lm.config))
    (vl / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "vision_config": {}}))
    with pytest.raises(LlmtraceError) as e:
        load_model(str(vl), device="cpu")
    assert "\n" not in str(e.value) and "lacks its text_config" in str(e.value)


def test_explain_on_a_linear_layer_works_one_delta_rule_update(families):
    """explain --layer 0 (linear attention): every declared step checks against the pass, one update of S at the last
    token recomputed from the earlier tokens agrees with the state the pass left, and the layer's memory is its
    state's fixed bytes, not a cache; layer 3 (attention) keeps the attention sections, with its partial RoPE."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("qwen3_5")), device="cpu")
    by = {e["section"]: e for e in model.explain("The quick brown fox", layer=0).events if e["event"] == "explain"}
    assert "attention" not in by and "kv_cache" not in by and "rope" not in by
    assert all(r["check"] is not None and r["check"]["ok"] for r in by["steps"]["steps"]
               if r["op"] not in ("stream",)), by["steps"]["steps"]
    ops = {r["point"]: r["op"] for r in by["steps"]["steps"]}
    assert ops["delta_state"] == "delta_rule" and ops["delta_conv"] == "conv1d" and ops["delta_norm"] == "gated_rmsnorm"
    d = by["delta_rule"]
    assert d["check_state_max_abs_diff"] <= 1e-5 and d["check_out_max_abs_diff"] <= 1e-5
    assert 0 < d["alpha"] < 1 and 0 < d["beta"] < 1 and abs(d["norm_k"] - 1) < 1e-5
    assert d["S_before"] != d["S_after"]  # the token moved the state
    s = by["state_cache"]
    assert s["state"] == {"conv_state": [96, 3], "delta_state": [4, 16, 8]}
    assert s["state_bytes"] == 4 * (96 * 3 + 4 * 16 * 8) and s["attention_layers"] == [3]
    assert s["kv_bytes_now"] == s["kv_bytes_per_token"] * s["n_tokens"]
    by3 = {e["section"]: e for e in model.explain("The quick brown fox", layer=3).events if e["event"] == "explain"}
    assert by3["rope"]["rotary_dim"] == 4 and by3["kv_cache"]["kv_layers"] == 1
    assert {r["point"]: r["op"] for r in by3["steps"]["steps"]}["attn_gated"] == "gate"


def test_explain_renders_a_linear_layer(families, capsys, monkeypatch):
    """The terminal view of a linear layer: the update worked out, checked, and why no cache grows."""
    from helpers import run_cli

    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = run_cli(capsys, "explain", "-m", families.hf_dir("qwen3_5"), "The quick brown fox", "--layer", "1")
    assert code == 0, err
    assert "the delta rule, value head 0" in out and "no KV cache grows here" in out
    assert "S computed in float64 vs the state the pass left ✓" in out


def test_the_patching_sweep_runs_each_cell_from_the_corrupt_state_at_its_position(loaded):
    """The sweep reuses the corrupt run's memory before each patched position: for a linear layer, the state after
    those positions (not the cache of the whole prompt). Every cell equals the single patched run."""
    from llmtrace.run.interventions import Patch, prepare
    from llmtrace.run.patching import patch_sweep

    lm = loaded("qwen3_5", "hf")
    clean, corrupt = "ab cd ef", "ab ce ef"  # 7 tokens each, position 4 differs
    sweep = patch_sweep(lm, clean, corrupt, "a", "b", at="resid_post")
    ids = lm.tokenizer.encode(corrupt)
    a, b = sweep["answer"]["id"], sweep["against"]["id"]

    def single(interventions) -> float:
        edits = prepare(lm, interventions, [len(ids)])
        with torch.inference_mode(), lm.model.hooked(edits, edits.layers, spell_out=False):
            logits = lm.model(torch.tensor([ids]), last_only=True)[0].float()
        return (logits[a] - logits[b]).item()

    worst = max(abs(c["metric"] - single([Patch(c["layer"], "resid_post", c["position"], clean)]))
                for c in sweep["cells"])
    assert worst < 1e-4
    assert len({round(c["metric"], 3) for c in sweep["cells"]}) > 2  # the cells differ: the test can fail


def test_the_reports_kv_chart_shows_the_state_and_the_sum(families):
    """The page's KV-cache chart: the cache's line grows, the states' line is flat, and a third line is their sum;
    the state layers' boxes are marked, and the per-token figure counts the one attention layer."""
    import re

    import llmtrace

    run = llmtrace.load(str(families.hf_dir("qwen3_5")), device="cpu").generate("The quick brown fox",
                                                                               max_new_tokens=4, trace="full")
    page = run.html()
    lines = {cls: [float(p.split(",")[1]) for p in pts.split()]
             for pts, cls in re.findall(r'<polyline points="([^"]+)" class="(gqa|state|total)"', page)}
    assert len(set(lines["state"])) == 1 and lines["gqa"][0] > lines["gqa"][-1]  # flat; growing (y points down)
    assert all(t < g and t < s for t, g, s in zip(lines["total"], lines["gqa"], lines["state"]))  # the sum, above
    assert page.count('data-kind="state"') == 3
    assert "3 layers × 3,200 bytes = 9.38 KiB, the same at every step" in page
    assert "= the layers whose memory grows: 1 × 256 B (K and V, one entry a token)" in page


def test_the_report_page_draws_a_linear_layer_from_its_declaration(browser, loaded, tmp_path):
    """The page of a --trace full run (layers 0 and 3): no script error; the map of the pass has a block per declared
    point of the linear layer with its operation (the delta rule among them) and of the attention layer."""
    from helpers import Opened, embedded

    from llmtrace.api import Model

    lm = Model(loaded("qwen3_5", "hf"))
    trace = lm.generate("The quick brown fox", max_new_tokens=2, trace="full", layers="0,-1", for_report=True,
                        ignore_eos=True)
    o = Opened(browser, trace.report(tmp_path / "qwen35.html"))
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")], o.messages
    data = embedded(o.page.content())
    record = data["maths"]["record"]
    ops = record["kinds"][record["layer_kind"][0]]["ops"]
    blocks = dict(o.page.eval_on_selector_all("#passmap .mapblock", "bs => bs.map(b => [b.dataset.point, b.dataset.op])"))
    assert blocks["delta_state"] == "delta_rule" and blocks["delta_conv"] == "conv1d"
    assert {p: blocks[p] for p in ops if p in blocks} == {p: ops[p]["op"] for p in ops if p in blocks}
    o.page.click('#passmap .mapblock[data-point="delta_state"]')
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")], o.messages
    # the linear layer is taught under its kind's own headings, never attention's; the attention layer keeps them
    titles = lambda: o.page.eval_on_selector_all("#passmap .mapstep", "ls => ls.map(l => l.textContent)")  # noqa: E731
    assert "linear attention" in o.page.text_content("#passmap .note")
    layer0 = " ".join(titles())
    assert "causal convolution over the last Kc tokens" in layer0 and "the delta rule" in layer0
    assert "RoPE on Q and K" not in layer0 and "softmax" not in layer0
    o.page.select_option("#walk-layer", "3")
    layer3 = " ".join(titles())
    assert "RoPE on Q and K" in layer3 and "causal convolution" not in layer3
    o.page.close()


def test_the_memory_section_names_each_layers_kind_of_memory(families):
    """The KV section reads each layer's declared memory: no "every layer caches the same" on a hybrid, a box per
    layer with its kind and bytes, in both languages."""
    import llmtrace

    run = llmtrace.load(str(families.hf_dir("qwen3_5")), device="cpu").generate("The quick brown fox",
                                                                               max_new_tokens=2, trace="steps")
    en, zh = run.html(), run.html(lang="zh")
    assert "every layer caches the same" not in en and "每层缓存的大小相同" not in zh
    assert en.count('data-kind="state"') == 3 and en.count('data-kind="kv"') == 1
    assert "layer 0: a state of 3,200 bytes, the same at every step" in en
    assert "第 0 层：3,200 字节的状态，每一步都相同" in zh
    assert "Each step appends one position to the 1 of 4 layers whose memory grows; 3 keep" in en


@pytest.mark.parametrize("name", NAMES)
def test_run_with_cache_is_transformers_hidden_states(loaded, families, name):
    """The research API's cache of a hybrid model: every layer's resid_post is transformers' hidden state (within
    1e-4 relative to its size), the attention layer's q its query half of q_proj, and the linear layers' state the
    state the pass left."""
    from llmtrace.api import Model

    lm, hf = loaded(name, "hf"), families.model(name)
    L = lm.config.n_layers
    logits, cache = Model(lm).run_with_cache(PROMPT_IDS, names=["*.resid_post", "3.q", "*.delta_state"])
    seen = {}
    handle = hf.model.layers[3].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.update(q=out))
    try:
        with torch.no_grad():
            out = hf(torch.tensor([PROMPT_IDS]), output_hidden_states=True)
    finally:
        handle.remove()
    assert float((logits - out.logits).abs().max()) <= rounding_tol(logits, _exact(lm, PROMPT_IDS)[0][None])
    for i in range(L - 1):
        h = out.hidden_states[i + 1]
        assert float((cache[f"{i}.resid_post"] - h).abs().max()) <= 1e-4 * max(1.0, float(h.abs().max()))
    Dh = lm.config.head_dim
    q = seen["q"].view(1, len(PROMPT_IDS), -1, 2 * Dh)[..., :Dh]  # each head: Dh query dims, then Dh gate dims
    assert float((cache["3.q"] - q).abs().max()) <= 1e-4 * max(1.0, float(q.abs().max()))
    assert [k for k in cache.keys() if k.endswith("delta_state")] == ["0.delta_state", "1.delta_state", "2.delta_state"]


def test_the_events_validate_against_the_schema(families):
    """A traced run's events and explain's records of a linear and an attention layer follow the shipped schema."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    import llmtrace
    from llmtrace.trace.events import schema_path

    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    model = llmtrace.load(str(families.hf_dir("qwen3_5")), device="cpu")
    events = model.generate("The quick brown fox", max_new_tokens=2, trace="full").events
    for layer in (0, 3):
        events += model.explain("The quick brown fox", layer=layer).events
    for ev in json.loads(json.dumps(events)):
        validator.validate(ev)
    flops = next(e for e in events if e.get("section") == "layer")["flops"]
    assert "rows" in flops and "scores" not in flops  # layer 0: linear attention, no T×T scores
