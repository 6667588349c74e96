"""LFM2, from its HF directory and from the GGUF llama.cpp's converter writes (arch lfm2), against transformers'
Lfm2ForCausalLM: three short gated convolutions around one attention layer. A convolution layer's memory is the last
Lc−1 gated inputs of each channel (model.kinds.short_conv); the tests check that window against transformers' cache,
and that a window taken one token off makes the decode step wrong."""

import pytest
import torch
from helpers import greedy_ours, greedy_hf_cached, stepwise_hf

from families import FAMILIES, PROMPT_IDS, hf_model_from_gguf

from llmtrace.model.kinds.short_conv import ShortConv

NAME = "lfm2"
TOL = 1e-4  # the logits reach ~40; float32 differences are ~1e-5






@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_at_every_position_and_greedy_match_transformers(families, loaded, fmt):
    lm = loaded(NAME, fmt)
    reference = families.model(NAME)
    assert lm.config.family == "lfm2" and lm.config.layer_types == ["conv", "conv", "full", "conv"]
    assert lm.config.ffn_dim == 96 and lm.config.tie_embeddings and lm.config.parts == {"short_conv": {"kernel": 3}}
    stepwise, _ = stepwise_hf(reference, PROMPT_IDS)  # transformers' decode path (its conv update), position by position
    with torch.no_grad():
        ours, theirs = lm.model(torch.tensor([PROMPT_IDS]))[0], reference(torch.tensor([PROMPT_IDS])).logits[0]
    assert float((ours - theirs).abs().max()) <= TOL and float((ours - stepwise).abs().max()) <= TOL
    assert greedy_ours(lm, PROMPT_IDS, 8) == greedy_hf_cached(reference, PROMPT_IDS, 8)  # through both caches


def test_the_gguf_is_transformers_reading_of_it(families, loaded):
    """transformers' own GGUF loader on the converter's file gives the model llmtrace reads from it."""
    theirs = hf_model_from_gguf(families.gguf(NAME), FAMILIES[NAME])
    lm = loaded(NAME, "gguf")
    with torch.no_grad():
        a, b = lm.model(torch.tensor([PROMPT_IDS]))[0], theirs(torch.tensor([PROMPT_IDS])).logits[0]
    assert float((a - b).abs().max()) <= TOL
    assert greedy_ours(lm, PROMPT_IDS, 6) == greedy_hf_cached(theirs, PROMPT_IDS, 6)


def test_prompt_ids_are_transformers(families, loaded):
    import transformers

    expected = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(NAME))).encode("The quick brown fox")
    for fmt in ("hf", "gguf"):
        assert loaded(NAME, fmt).tokenizer.encode("The quick brown fox") == expected


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_window_after_the_prompt_is_transformers_conv_state(families, loaded, fmt):
    """Each convolution layer's window after the prompt is the last Lc−1 inputs of transformers' conv state (it keeps
    Lc); the attention layer's keys are its cache's keys; nothing else is kept."""
    lm = loaded(NAME, fmt)
    _, theirs = stepwise_hf(families.model(NAME), PROMPT_IDS)
    cache = lm.model.new_cache(len(PROMPT_IDS))
    with torch.no_grad():
        lm.model(torch.tensor([PROMPT_IDS]), cache, 0)
    assert cache.state_layers == [0, 1, 3]
    for i in cache.state_layers:
        conv = theirs.get_conv_state(i, state_idx=0)  # (1, D, Lc)
        ours = cache.layers[i]["conv"]  # (1, D, Lc-1)
        assert ours.shape == (1, 64, 2) and float(conv.abs().max()) > 0.1
        assert float((ours - conv[..., 1:]).abs().max()) <= 1e-5 * float(conv.abs().max())
    keys = theirs.layers[2].keys  # (1, Hkv, T, Dh)
    assert float((cache.layers[2].k[:, :, : len(PROMPT_IDS)] - keys).abs().max()) <= 1e-5 * float(keys.abs().max())


def test_decoding_token_by_token_equals_one_pass(loaded):
    lm = loaded(NAME, "hf")
    ids = torch.tensor([PROMPT_IDS])
    whole, steps = lm.model.new_cache(len(PROMPT_IDS)), lm.model.new_cache(len(PROMPT_IDS))
    with torch.no_grad():
        at_once = lm.model(ids, whole, 0)[0]
        one_by_one = torch.stack([lm.model(ids[:, t : t + 1], steps, t)[0, -1] for t in range(len(PROMPT_IDS))])
    assert float((at_once - one_by_one).abs().max()) <= TOL
    for i in whole.state_layers:
        assert torch.allclose(whole.layers[i]["conv"], steps.layers[i]["conv"], atol=1e-5)


def test_a_window_one_token_off_breaks_the_parity(families, loaded, monkeypatch):
    """The check can fail: a convolution that keeps the window one token too early (the Lc−1 inputs before the last,
    not the last Lc−1) computes the prompt's pass alike but every decode step wrong, against transformers."""
    lm = loaded(NAME, "hf")
    reference = families.model(NAME)
    stepwise, _ = stepwise_hf(reference, PROMPT_IDS)

    def decoded(model) -> torch.Tensor:
        cache = model.new_cache(len(PROMPT_IDS))
        with torch.no_grad():
            return torch.stack([model(torch.tensor([[t]]), cache, i)[0, -1] for i, t in enumerate(PROMPT_IDS)])

    assert float((decoded(lm.model) - stepwise).abs().max()) <= TOL
    right = ShortConv.convolve

    def shifted(self, v, io):
        out = right(self, v, io)
        if io.cache is not None and v.size(1) == 1:  # keep the window one token back: drop the newest input
            w = io.cache["conv"]
            io.cache.write("conv", torch.cat([w.new_zeros(w.shape[:-1] + (1,)), w[..., :-1]], dim=-1))
        return out

    monkeypatch.setattr(ShortConv, "convolve", shifted)
    with torch.no_grad():
        one_pass = lm.model(torch.tensor([PROMPT_IDS]))[0]
    assert float((one_pass - stepwise).abs().max()) <= TOL  # no cache, no window: the pass is still right
    assert float((decoded(lm.model) - stepwise).abs().max()) > 1e-2


def test_the_run_event_and_each_step_count_the_window(families):
    """The run event's model.memory: each layer's kind and bytes (three windows of D × (Lc−1) float32 numbers, one
    attention layer's K and V per token); each step's cache column counts the windows beside the growing cache, as
    KVCache's own totals do."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir(NAME)), device="cpu")
    run = model.generate("The quick brown fox", max_new_tokens=3, trace="full")
    record = next(e for e in run.events if e["event"] == "run")["model"]["memory"]
    c = model.config
    window, per_token = 4 * c.d_model * 2, 2 * c.n_kv_heads * c.head_dim * 4
    assert [m["kind"] for m in record] == ["window", "window", "kv", "window"]
    assert [m["constant_bytes"] for m in record] == [window, window, 0, window]
    assert [m["per_token_bytes"] for m in record] == [0, 0, per_token, 0]
    assert record[0]["constant"] == {"conv": [c.d_model, 2]}
    steps = [e["kv_cache"] for e in run.events if e["event"] == "step"]
    cache = model.loaded.model.new_cache(8)
    assert cache.state_bytes == 3 * window and cache.bytes_per_token == per_token
    for k in steps:
        assert k["bytes_per_token"] == per_token and k["state"]["bytes"] == cache.state_bytes
        assert k["total_bytes_used"] == k["seq_len"] * per_token + cache.state_bytes


def test_what_lfm2_changes_is_said_with_its_numbers(loaded):
    from llmtrace.model.family import describe_changes

    said = describe_changes(loaded(NAME, "gguf").config)
    assert said[0].startswith("3 of 4 layers are short gated convolutions")
    assert "64 × 2 = 128 numbers, the same at every step" in said[1]
    assert "the other 1 layers (2)" in said[2]


def test_explain_runs_on_a_convolution_layer(families):
    """explain --layer 0 (a convolution): every declared step checks against the pass (the input gate, the window, the
    convolution, the output gate), no attention section, and the layer's memory is its window's fixed bytes; layer 2
    keeps the attention sections."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir(NAME)), device="cpu")
    by = {e["section"]: e for e in model.explain("The quick brown fox", layer=0).events if e["event"] == "explain"}
    assert "attention" not in by and "kv_cache" not in by and "rope" not in by and "qkv" not in by
    steps = {r["point"]: r for r in by["steps"]["steps"]}
    assert {steps[p]["op"] for p in ("conv_bx", "conv_gated")} == {"mul"} and steps["conv_out"]["op"] == "conv1d"
    assert all(r["check"] is not None and r["check"]["ok"] for r in steps.values() if r["op"] != "stream"), steps
    assert by["state_cache"]["state"] == {"conv_window": [64, 2]} and by["state_cache"]["attention_layers"] == [2]
    assert "scores" not in by["layer"]["flops"] and by["layer"]["flops"]["conv"] == 2 * by["layer"]["n_tokens"] * 64 * 3
    by2 = {e["section"]: e for e in model.explain("The quick brown fox", layer=2).events if e["event"] == "explain"}
    assert by2["kv_cache"]["kv_layers"] == 1 and "attention" in by2


def test_explain_cli_on_a_convolution_layer(families, capsys, monkeypatch):
    from helpers import run_cli

    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run_cli(capsys, "explain", "-m", families.hf_dir(NAME), "The quick brown fox", "--layer", "1")
    assert code == 0, err
    assert "conv_out" in out and "Traceback" not in err


def test_run_with_cache_is_transformers_hidden_states(loaded, families):
    from llmtrace.api import Model

    lm, hf = loaded(NAME, "hf"), families.model(NAME)
    logits, cache = Model(lm).run_with_cache(PROMPT_IDS, names=["*.resid_post", "*.conv_window"])
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT_IDS]), output_hidden_states=True)
    assert float((logits - out.logits).abs().max()) <= TOL
    for i in range(lm.config.n_layers - 1):
        h = out.hidden_states[i + 1]
        assert float((cache[f"{i}.resid_post"] - h).abs().max()) <= 1e-4 * max(1.0, float(h.abs().max()))
    assert [k for k in cache.keys() if k.endswith("conv_window")] == ["0.conv_window", "1.conv_window", "3.conv_window"]


def test_the_events_validate_against_the_schema(families):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    import llmtrace
    from llmtrace.trace.events import schema_path

    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    model = llmtrace.load(str(families.hf_dir(NAME)), device="cpu")
    events = model.generate("The quick brown fox", max_new_tokens=2, trace="full").events
    for layer in (0, 2):
        events += model.explain("The quick brown fox", layer=layer).events
    for ev in json.loads(json.dumps(events)):
        validator.validate(ev)


def test_the_report_page_draws_a_convolution_layer_from_its_declaration(browser, loaded, tmp_path):
    """The page of a --trace full run (layers 0 and 3, both convolutions): no script error; the map of the pass has a
    block per declared point of the layer with its operation."""
    from helpers import Opened, embedded

    from llmtrace.api import Model

    trace = Model(loaded(NAME, "hf")).generate("The quick brown fox", max_new_tokens=2, trace="full", layers="0,-1",
                                               for_report=True, ignore_eos=True)
    o = Opened(browser, trace.report(tmp_path / "lfm2.html"))
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")], o.messages
    record = embedded(o.page.content())["maths"]["record"]
    ops = record["kinds"][record["layer_kind"][0]]["ops"]
    blocks = dict(o.page.eval_on_selector_all("#passmap .mapblock", "bs => bs.map(b => [b.dataset.point, b.dataset.op])"))
    assert blocks["conv_out"] == "conv1d" and blocks["conv_bx"] == "mul"
    assert {p: blocks[p] for p in ops if p in blocks} == {p: ops[p]["op"] for p in ops if p in blocks}
    o.page.click('#passmap .mapblock[data-point="conv_window"]')
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")], o.messages
    o.page.close()
