"""Gemma 4's text model, from its HF directory and from the GGUF llama.cpp's converter writes (arch gemma4), against
transformers' Gemma4ForCausalLM: 4 sliding and 2 global layers (their own head width and KV heads, keys as values,
proportional RoPE), per-layer inputs, a learned scalar per layer, a soft-capped head, and two KV-shared layers that read
the keys and values of layers 3 and 2 from the cache and write none (model.kinds.shared_kv)."""

import pytest
import torch
from helpers import greedy_ours, greedy_hf_cached, stepwise_hf

from families import PROMPT_IDS

from llmtrace.model.kinds.shared_kv import SharedKVAttention

NAME = "gemma4"
TOL = 1e-4  # the logits reach ~27 under the cap of 30; float32 differences are ~4e-5






@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_at_every_position_and_greedy_match_transformers(families, loaded, fmt):
    lm = loaded(NAME, fmt)
    reference = families.model(NAME)
    c = lm.config
    assert c.family == "gemma4" and c.layer_types == ["sliding", "sliding", "full"] * 2 and c.head_dim == 16
    assert c.parts["global_attention"] == {"head_dim": 32, "kv_heads": 1, "k_eq_v": True, "rotary": 0.25}
    assert c.parts["shared_kv"] == {"reads": [None, None, None, None, 3, 2], "wide_ffn": True}
    assert c.ffn_dim == 128 and c.final_softcap == 30.0 and c.attn_scale == 1.0
    stepwise, _ = stepwise_hf(reference, PROMPT_IDS)  # transformers' decode path, position by position
    with torch.no_grad():
        ours, theirs = lm.model(torch.tensor([PROMPT_IDS]))[0], reference(torch.tensor([PROMPT_IDS])).logits[0]
    assert float(theirs.abs().max()) > 20  # the cap bends the logits without flattening them
    assert float((ours - theirs).abs().max()) <= TOL and float((ours - stepwise).abs().max()) <= TOL
    assert greedy_ours(lm, PROMPT_IDS, 8) == greedy_hf_cached(reference, PROMPT_IDS, 8)  # through both caches


def test_prompt_ids_are_transformers(families, loaded):
    import transformers

    expected = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(NAME))).encode("The quick brown fox")
    for fmt in ("hf", "gguf"):
        assert loaded(NAME, fmt).tokenizer.encode("The quick brown fox") == expected


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_cache_after_the_prompt_is_transformers_and_shared_layers_hold_no_buffers(families, loaded, fmt):
    """Layers 0-3 hold transformers' keys and values; layers 4 and 5 hold the same objects as layers 3 and 2 (nothing
    allocated), and their reading leaves those unchanged."""
    lm = loaded(NAME, fmt)
    _, theirs = stepwise_hf(families.model(NAME), PROMPT_IDS)
    cache = lm.model.new_cache(len(PROMPT_IDS))
    with torch.no_grad():
        lm.model(torch.tensor([PROMPT_IDS]), cache, 0)
    T = len(PROMPT_IDS)
    for i in range(4):
        k, v = theirs.layers[i].keys, theirs.layers[i].values  # (1, Hkv, T or the window, Dh)
        S = k.size(2)  # transformers keeps only the last W slots of a sliding layer
        assert float((cache.layers[i].k[:, :, T - S : T] - k).abs().max()) <= 1e-5 * float(k.abs().max())
        assert float((cache.layers[i].v[:, :, T - S : T] - v).abs().max()) <= 1e-5 * float(v.abs().max())
    assert cache.layers[4] is cache.layers[3] and cache.layers[5] is cache.layers[2]
    assert cache.layers[2].k.shape[1:] == (1, T, 32) and cache.layers[3].k.shape[1:] == (2, T, 16)
    assert cache.bytes_allocated == sum(cache.layers[i].nbytes for i in range(4))


def test_a_shared_layer_that_keeps_its_own_empty_cache_breaks_the_parity(families, loaded, monkeypatch):
    """The check can fail: a KV-shared layer given buffers of its own (as if it cached its own keys and values, which
    it never computes) reads zeros instead of layer j's keys, and the logits leave transformers'; one that reads the
    other kind's layer (4 reading 2, not 3) also does."""
    from llmtrace.model.memory import kv_memory

    lm = loaded(NAME, "hf")
    theirs = families.model(NAME)(torch.tensor([PROMPT_IDS])).logits[0].detach()

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return lm.model(torch.tensor([PROMPT_IDS]))[0]

    assert float((logits() - theirs).abs().max()) <= TOL
    with monkeypatch.context() as mp:
        mp.setattr(SharedKVAttention, "memory", lambda self: kv_memory(self.n_kv_heads, self.head_dim, self.n_heads))
        assert float((logits() - theirs).abs().max()) > 1e-2
    layer4 = lm.model.layers[4].attn
    with monkeypatch.context() as mp:
        mp.setattr(layer4, "reads", 0)  # another sliding layer's keys (its heads have the same shape)
        mp.setattr(SharedKVAttention, "memory", lambda self: __import__("llmtrace.model.memory", fromlist=["Memory"])
                   .Memory("shared", reads=self.reads))
        assert float((logits() - theirs).abs().max()) > 1e-2


def test_the_run_event_and_each_step_count_each_layers_memory(families):
    """model.memory: four layers keep K and V (the global ones 1 head of 32, the sliding ones 2 of 16), the two shared
    ones nothing per token and name the layer they read; each step's cache column grows by those four layers only."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir(NAME)), device="cpu")
    run = model.generate("The quick brown fox", max_new_tokens=3, trace="full")
    record = next(e for e in run.events if e["event"] == "run")["model"]["memory"]
    assert [m["kind"] for m in record] == ["kv"] * 4 + ["shared"] * 2
    assert [m["reads"] for m in record] == [None] * 4 + [3, 2]
    per = [m["per_token_bytes"] for m in record]
    assert per == [2 * 2 * 16 * 4, 2 * 2 * 16 * 4, 2 * 1 * 32 * 4, 2 * 2 * 16 * 4, 0, 0]
    steps = [e["kv_cache"] for e in run.events if e["event"] == "step"]
    cache = model.loaded.model.new_cache(8)
    assert cache.bytes_per_token == sum(per)
    assert all(k["bytes_per_token"] == sum(per) and k["bytes_used"] == k["seq_len"] * sum(per) for k in steps)
    assert all("state" not in k for k in steps)


def test_what_gemma4_changes_is_said_with_its_numbers(loaded):
    from llmtrace.model.family import describe_changes

    said = " | ".join(describe_changes(loaded(NAME, "gguf").config))
    assert "gives each token 8 numbers for each of the 6 layers" in said
    assert "2 of 6 layers are global: head width 32 (the sliding ones 16), 1 KV heads" in said
    assert "the key projection is also the values" in said
    assert "layer 4 reads layer 3's, layer 5 reads layer 2's from the cache and writes none" in said
    assert "30·tanh(logits / 30)" in said


def test_explain_runs_on_a_shared_and_a_global_layer(families, capsys, monkeypatch):
    """explain --layer 4 (KV-shared) and --layer 2 (global, keys as values): every step that can be recomputed from
    this layer's own tensors checks; the shared layer's memory is another layer's."""
    import llmtrace
    from helpers import run_cli

    model = llmtrace.load(str(families.hf_dir(NAME)), device="cpu")
    by = {e["section"]: e for e in model.explain("The quick brown fox", layer=4).events if e["event"] == "explain"}
    steps = {r["point"]: r for r in by["steps"]["steps"]}
    assert "k" not in steps and "kv_write" not in steps and steps["q_rope"]["check"]["ok"]
    assert all(r["check"] is None or r["check"]["ok"] for r in steps.values()), steps
    assert by["state_cache"]["memory_kind"] == "shared" and by["state_cache"]["reads"] == 3
    by2 = {e["section"]: e for e in model.explain("The quick brown fox", layer=2).events if e["event"] == "explain"}
    steps2 = {r["point"]: r for r in by2["steps"]["steps"]}
    assert steps2["v_norm"]["check"]["ok"] and steps2["ple_act"]["op"] == "glu"
    assert by2["kv_cache"]["kv_layers"] == 4
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run_cli(capsys, "explain", "-m", families.hf_dir(NAME), "The quick brown fox", "--layer", "5")
    assert code == 0, err
    assert "reads layer 2's keys and values" in out


def test_run_with_cache_is_transformers_hidden_states(loaded, families):
    from llmtrace.api import Model

    lm, hf = loaded(NAME, "hf"), families.model(NAME)
    logits, cache = Model(lm).run_with_cache(PROMPT_IDS, names=["*.resid_post", "ple"])
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT_IDS]), output_hidden_states=True)
    assert float((logits - out.logits).abs().max()) <= TOL
    for i in range(lm.config.n_layers - 1):
        h = out.hidden_states[i + 1]
        assert float((cache[f"{i}.resid_post"] - h).abs().max()) <= 1e-4 * max(1.0, float(h.abs().max()))
    with torch.no_grad():
        m = hf.model
        ids = torch.tensor([PROMPT_IDS])
        ple = m.project_per_layer_inputs(m.embed_tokens(ids), m.get_per_layer_inputs(ids))  # (1, T, L, P)
    assert float((cache["ple"] - ple.flatten(-2)).abs().max()) <= 1e-5


def test_the_events_validate_against_the_schema(families):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    import llmtrace
    from llmtrace.trace.events import schema_path

    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    model = llmtrace.load(str(families.hf_dir(NAME)), device="cpu")
    events = model.generate("The quick brown fox", max_new_tokens=2, trace="full").events
    for layer in (2, 4):
        events += model.explain("The quick brown fox", layer=layer).events
    for ev in json.loads(json.dumps(events)):
        validator.validate(ev)


def test_the_patching_sweep_reads_the_shared_keys_and_the_per_layer_inputs(loaded):
    """The sweep runs each layer on its own with copies of the corrupt cache: a KV-shared layer reads its earlier
    layer's copy, and every layer gets the per-layer inputs of the corrupt run's own ids. Every cell equals the single
    patched run."""
    from llmtrace.run.interventions import Patch, prepare
    from llmtrace.run.patching import patch_sweep

    lm = loaded(NAME, "hf")
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
    assert len({round(c["metric"], 3) for c in sweep["cells"]}) > 2


def test_the_report_page_draws_a_shared_layer_from_its_declaration(browser, loaded, tmp_path):
    """The page of a --trace full run (layers 0 and 5, the last one KV-shared): no script error; the map of the pass
    has the shared layer's blocks with their operations, and no K, V or cache write of its own."""
    from helpers import Opened, embedded

    from llmtrace.api import Model

    trace = Model(loaded(NAME, "hf")).generate("The quick brown fox", max_new_tokens=2, trace="full", layers="0,-1",
                                               for_report=True, ignore_eos=True)
    o = Opened(browser, trace.report(tmp_path / "gemma4.html"))
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")], o.messages
    record = embedded(o.page.content())["maths"]["record"]
    ops = record["kinds"][record["layer_kind"][5]]["ops"]
    assert "kv_write" not in ops and ops["k_repeated"]["inputs"] == ["@2:k_rope"]
    o.page.click('#passmap .mapblock[data-point="ple_act"]')
    assert not [m for m in o.messages if m[0] in ("error", "pageerror")], o.messages
    o.page.close()
