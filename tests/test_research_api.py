"""The researcher's API (issue 42): model.points(), run_with_cache, run_with_hooks, model.hooks and llmtrace.Hook.

The cache is checked against transformers on every family fixture (tests/families.py), from the HF directory and from
the GGUF llama.cpp's converter writes: each layer's resid_post is transformers' hidden_states[i + 1] (the last one,
which transformers takes after the final norm, is our final_norm), the logits agree within 1e-4, and q, k, v are what
forward hooks on transformers' projections see. A researcher's hook is checked against the built-in interventions it
re-expresses (Ablate, Steer), and its failures against the contract: a clear error naming the point, the model left
unhooked. The real default model is used only for the memory check (slow).
"""

import runpy
import sys
from pathlib import Path

import pytest
import torch

import llmtrace
from families import FAMILIES, PROMPT_IDS, hf_model_via_state_dict
from llmtrace.api import Model
from llmtrace.errors import BadValue
from llmtrace.run.interventions import Ablate, Hook, Steer

TOL = 1e-4
# Qwen3.5's fixtures are checked in tests/test_qwen35.py: three of its four layers have no q/k/v projections (linear
# attention), its q_proj holds a gate beside the queries, and its tied fixture's logits reach ~60
# the families whose attention projects q, k and v per head as Llama's does (Qwen3.5's linear layers, DeepSeek's
# latent and Granite's Mamba2 layers have their own tests: test_qwen35.py, test_deepseek.py, test_mamba2.py)
HF_NAMES = sorted(n for n, f in FAMILIES.items()
                  if f.model_type not in ("qwen3_5_text", "deepseek_v2", "deepseek_v3", "granitemoehybrid", "lfm2",
                                          "gemma4_text"))
# the converter's GGUF files, each against transformers on the weights read back from it (tests/families.py), with
# what the file does not carry: Mistral's and Qwen3's windows are dropped (the file runs without one, as llama.cpp
# runs it). Not here: Gemma's files lack the layer pattern and the score scale, qwen3_moe_raw's lacks norm_topk_prob,
# and no qwen3moe file holds a dense layer
GGUF_NAMES = ["llama", "qwen3", "qwen3_tied", "phi3", "olmo2", "mixtral", "qwen3_moe", "mistral", "qwen3_swa"]
WINDOWLESS = {"mistral": {"sliding_window": None},
              "qwen3_swa": {"sliding_window": None, "use_sliding_window": False,
                            "layer_types": ["full_attention", "full_attention"]}}


def projections(hf, layer: int, ids: list[int]) -> dict[str, torch.Tensor]:
    """What forward hooks on transformers' q/k/v projections of `layer` see over ids, split into heads: (1, T, heads,
    Dh) each. A fused qkv_proj (Phi-3) is split into its three row blocks."""
    c = hf.config
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    Dh = getattr(c, "head_dim", None) or c.hidden_size // H
    attn = hf.model.layers[layer].self_attn
    got: dict[str, torch.Tensor] = {}
    keep = lambda name: lambda _m, _a, out: got.__setitem__(name, out.detach().clone())  # noqa: E731
    mods = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj} if hasattr(attn, "q_proj") else {"qkv": attn.qkv_proj}
    handles = [m.register_forward_hook(keep(n)) for n, m in mods.items()]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    if "qkv" in got:
        got["q"], got["k"], got["v"] = got.pop("qkv").split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    return {n: got[n].view(1, len(ids), -1, Dh) for n in ("q", "k", "v")}


def check_against_transformers(lm, hf) -> None:
    """run_with_cache's resid_post, final_norm, logits and q/k/v against transformers over PROMPT_IDS."""
    L = lm.config.n_layers
    logits, cache = Model(lm).run_with_cache(PROMPT_IDS, names=["*.resid_post", "final_norm", "*.q", "*.k", "*.v"])
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT_IDS]), output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == L + 1
    torch.testing.assert_close(logits, out.logits, atol=TOL, rtol=0)
    for i in range(L - 1):
        torch.testing.assert_close(cache[f"{i}.resid_post"], hs[i + 1], atol=TOL, rtol=0)
    torch.testing.assert_close(cache["final_norm"], hs[L], atol=TOL, rtol=0)  # transformers' last: after the norm
    with torch.no_grad():
        normed = lm.model.norm(cache[f"{L - 1}.resid_post"])
    torch.testing.assert_close(normed, hs[L], atol=TOL, rtol=0)
    for i in range(L):
        theirs = projections(hf, i, PROMPT_IDS)
        for n in ("q", "k", "v"):
            assert cache.axes(f"{i}.{n}") == ("B", "T", "H" if n == "q" else "Hkv", "Dh")
            torch.testing.assert_close(cache[f"{i}.{n}"], theirs[n], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", HF_NAMES)
def test_cache_of_an_hf_directory_is_transformers_hidden_states_logits_and_projections(loaded, families, name):
    check_against_transformers(loaded(name, "hf"), families.model(name))


@pytest.mark.parametrize("name", GGUF_NAMES)
def test_cache_of_a_gguf_is_transformers_on_the_same_weights(loaded, families, name):
    reference = hf_model_via_state_dict(families.gguf(name), FAMILIES[name], **WINDOWLESS.get(name, {}))
    check_against_transformers(loaded(name, "gguf"), reference)


# ----------------------------------------------------------------------------------------------------------------
# the points


def test_points_are_the_declaration_in_forward_order_with_the_names_hooks_see(tiny_lm):
    model = Model(tiny_lm)
    pts = model.points()
    L = tiny_lm.config.n_layers
    names = [p.name for p in pts]
    assert names[0] == "embed" and names[-1] == "logits" and names.index("0.resid_pre") < names.index("0.q_rope")
    assert names.index(f"{L - 1}.resid_post") < names.index("final_norm")
    assert len(names) == len(set(names)) == len(tiny_lm.points.before) + L * len(tiny_lm.points.layer) + \
        len(tiny_lm.points.after)
    q_rope = next(p for p in pts if p.name == "3.q_rope")
    assert (q_rope.layer, q_rope.point, q_rope.step, q_rope.axes, q_rope.editable) == \
        (3, "q_rope", "s6.3", ("B", "T", "H", "Dh"), False)
    assert next(p for p in pts if p.name == "logits").axes == ("B", "T", "V")  # a pass over every position
    assert [p.name for p in model.points(layer=-1, step="s6.5")] == [f"{L - 1}.probs", f"{L - 1}.attn_out"]
    assert {p.name for p in pts if p.editable} >= {"2.attn_out", "2.resid_post", "2.o_proj", "2.down"}
    ops = {p.name: p.op for p in pts}  # each point's declared operation (model.maths), this layer's constants
    assert ops["3.q_rope"].kind == "rope" and ops["3.q_rope"].const("base") == tiny_lm.config.rope_theta
    assert ops["3.act"].kind == "glu" and ops["logits"].kind == "matmul" and ops["0.resid_mid"].kind == "add"
    assert all(p.op is not None for p in pts if p.point not in ("last",) or p.layer is None)
    with pytest.raises(BadValue, match="layer"):
        model.points(layer=L)


def test_a_dense_layer_of_a_mixture_of_experts_lists_its_own_points(loaded):
    """qwen3_moe_dense's layer 1 is a dense SwiGLU: its points are gate/up/act of width F, not the experts'."""
    pts = Model(loaded("qwen3_moe_dense", "hf")).points()
    by = {p.name: p for p in pts}
    assert "0.router_logits" in by and "1.router_logits" not in by
    assert by["1.gate"].axes == ("B", "T", "F") and by["0.gate"].axes == ("B", "T", "K", "Fe")
    _, cache = Model(loaded("qwen3_moe_dense", "hf")).run_with_cache(PROMPT_IDS, layers=[1])
    assert tuple(cache["1.gate"].shape) == (1, len(PROMPT_IDS), loaded("qwen3_moe_dense", "hf").config.ffn_dim)


# ----------------------------------------------------------------------------------------------------------------
# run_with_cache


def test_cache_holds_exactly_what_names_pick_with_their_axes(tiny_lm):
    model = Model(tiny_lm)
    L = tiny_lm.config.n_layers
    logits, cache = model.run_with_cache("The quick brown fox", names="*.resid_post")
    assert cache.names() == [f"{i}.resid_post" for i in range(L)]
    assert cache.axes("2.resid_post") == ("B", "T", "D") and cache["2.resid_post"].dtype == torch.float32
    assert cache["-1.resid_post"] is cache[f"{L - 1}.resid_post"]
    _, one = model.run_with_cache("The quick brown fox", names=lambda n: n.endswith(".probs"), layers=[1])
    assert one.names() == ["1.probs"] and one.axes("1.probs") == ("B", "H", "T", "S")
    rows = one["1.probs"][0].sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))  # the softmax, spelled out for this layer
    _, kr = model.run_with_cache("The quick brown fox", names=["0.k_repeated", "0.k_rope"], remove_batch_dim=True)
    H, Hkv = tiny_lm.config.n_heads, tiny_lm.config.n_kv_heads
    assert kr.axes("0.k_repeated") == ("H", "S", "Dh") and kr["0.k_repeated"].shape[0] == H
    torch.testing.assert_close(kr["0.k_repeated"][:: H // Hkv], kr["0.k_rope"].transpose(0, 1))  # GQA laid out
    with pytest.raises(KeyError, match="not in this cache"):
        cache["1.q_rope"]
    _, half = model.run_with_cache("The quick", names=["0.resid_mid"], dtype="bfloat16")
    assert half["0.resid_mid"].dtype == torch.bfloat16
    assert not cache.approximate


@pytest.mark.parametrize("names, says", [(["3.no_such"], "layer 3's points"), ("*.nothing", "matches no point"),
                                         (["99.resid_post"], "out of range"),
                                         (["blocks.3.attn.hook_result"], "does not compute: each head's output"),
                                         (["3.prob"], "did you mean 3.probs")])
def test_a_name_that_is_not_a_point_names_the_keyword(tiny_lm, names, says):
    with pytest.raises(BadValue, match=says) as e:
        Model(tiny_lm).run_with_cache("The quick", names=names)
    assert e.value.field == "names"


def test_a_padded_batch_names_its_pads_and_each_row_is_its_prompt_alone(tiny_lm):
    model = Model(tiny_lm)
    texts = ["The quick brown fox jumps", "Hi"]
    logits, cache = model.run_with_cache(texts, names=["*.resid_post", "0.probs"])
    T = cache.ids.size(1)
    short = len(tiny_lm.tokenizer.encode_prompt("Hi")[1])
    assert cache.pads == [0, T - short] and cache.attention_mask[1].tolist() == [False] * (T - short) + [True] * short
    with pytest.raises(BadValue, match="batch of 2"):
        model.run_with_cache(texts, remove_batch_dim=True)
    alone_logits, alone = model.run_with_cache("Hi", names=["*.resid_post"])
    pad = cache.pads[1]
    for i in range(tiny_lm.config.n_layers):
        torch.testing.assert_close(cache[f"{i}.resid_post"][1, pad:], alone[f"{i}.resid_post"][0], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1, pad:], alone_logits[0], atol=TOL, rtol=0)
    assert float(cache["0.probs"][1, :, pad:, :pad].abs().max()) == 0.0  # no real token attends a pad slot


@pytest.mark.parametrize("name", [n for n in HF_NAMES if n != "phi3_longrope"])
def test_each_row_of_a_padded_batch_is_its_prompt_alone_in_every_family(loaded, name):
    """A batch of PROMPT_IDS and a 5-token prompt (9 pads), every family (windows, soft-caps, experts): the short
    row's stream and logits from its first real token are those of its pass alone. (LongRoPE picks its factors by the
    batch's length, so a padded row of a long batch is not its short prompt alone; it is left out.)"""
    model = Model(loaded(name, "hf"))
    short = PROMPT_IDS[:5]
    logits, cache = model.run_with_cache([PROMPT_IDS, short], names="*.resid_post")
    alone_logits, alone = model.run_with_cache(short, names="*.resid_post")
    pad = cache.pads[1]
    assert cache.pads == [0, len(PROMPT_IDS) - 5]
    for i in range(model.config.n_layers):
        torch.testing.assert_close(cache[f"{i}.resid_post"][1, pad:], alone[f"{i}.resid_post"][0], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1, pad:], alone_logits[0], atol=TOL, rtol=0)


def test_keep_quantized_is_exact_and_fast_says_approximate(families):
    """A Q8_0 GGUF: keep_quantized's cache is the dequantized float path's; fast's says it is approximate."""
    path = str(families.gguf("llama", "q8_0"))
    names = ["*.resid_post"]
    exact = llmtrace.load(path, device="cpu", dtype="float32")
    kept = llmtrace.load(path, device="cpu", keep_quantized=True)
    fast = llmtrace.load(path, device="cpu", fast=True)
    la, a = exact.run_with_cache(PROMPT_IDS, names=names)
    lb, b = kept.run_with_cache(PROMPT_IDS, names=names)
    lf, f = fast.run_with_cache(PROMPT_IDS, names=names)
    assert not a.approximate and not b.approximate and f.approximate
    torch.testing.assert_close(lb, la, atol=TOL, rtol=0)
    assert f["1.resid_post"].dtype == torch.float32 and f.names() == a.names()
    assert float((lf - la).abs().max()) < 0.5 * float(la.abs().max())  # approximate, not another model


@pytest.mark.slow
def test_one_name_keeps_one_tensor_on_the_default_model(smollm):
    """names=["10.resid_post"] on the real model (30 layers) keeps one (1, T, D) tensor, not thirty."""
    logits, cache = Model(smollm).run_with_cache("The capital of France is", names=["10.resid_post"])
    T = cache.ids.size(1)
    assert cache.names() == ["10.resid_post"] and len(cache) == 1
    assert tuple(cache["10.resid_post"].shape) == (1, T, smollm.config.d_model)
    assert cache.nbytes == T * smollm.config.d_model * 4
    with torch.no_grad():
        plain = smollm.model(cache.ids)
    torch.testing.assert_close(logits, plain.float(), atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# hooks


def zero_head(h: int):
    def zero(x, point):
        assert point.axes == ("B", "T", "H", "Dh")
        x = x.clone()
        x[:, :, h] = 0.0
        return x
    return zero


def test_a_hook_zeroing_a_head_is_ablate(tiny_lm):
    model = Model(tiny_lm)
    mine = model.run_with_hooks("The quick brown fox", hooks=[("2.attn_out", zero_head(1))])
    theirs = model.run_with_hooks("The quick brown fox", hooks=[Ablate(2, head=1)])
    plain = model.run_with_hooks("The quick brown fox")
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    assert float((mine - plain).abs().max()) > 1e-2  # it changed something
    run_a = model.generate("The quick", max_new_tokens=5, interventions=[Hook("2.attn_out", zero_head(1))])
    run_b = model.generate("The quick", max_new_tokens=5, interventions=[Ablate(2, head=1)])
    assert run_a.tokens == run_b.tokens
    said = next(e for e in run_a.events if e["event"] == "run")["interventions"][0]
    assert said["kind"] == "hook" and said["at"] == "2.attn_out" and said["replayable"] is False
    assert said["function"].endswith("zero_head.<locals>.zero") and "cannot replay" in said["label"]


def test_a_hook_adding_a_direction_to_resid_post_is_steer(tiny_lm):
    model = Model(tiny_lm)
    toward, away, alpha, L = "I love this", "I hate that", 3.0, 1
    _, a = model.run_with_cache(toward, names=[f"{L}.resid_post"])
    _, b = model.run_with_cache(away, names=[f"{L}.resid_post"])
    v = a[f"{L}.resid_post"][0, -1] - b[f"{L}.resid_post"][0, -1]
    mine = model.run_with_hooks("The movie was", hooks=[(f"{L}.resid_post", lambda x, p: x + alpha * v)])
    theirs = model.run_with_hooks("The movie was", hooks=[Steer(L, toward, away, alpha)])
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert float((mine - model.run_with_hooks("The movie was")).abs().max()) > 1e-2


def unhooked(lm) -> bool:
    return all(getattr(m, "hook", None) is None for m in lm.model.modules()) and \
        not any(getattr(m, "spell_out", False) for m in lm.model.modules())


def test_a_replacement_at_a_point_that_is_not_editable_names_the_editable_ones_near_it(tiny_lm):
    with pytest.raises(llmtrace.HookError) as e:
        Model(tiny_lm).run_with_hooks("The quick", hooks=[("1.q_rope", lambda x, p: x * 2)])
    said = str(e.value)
    assert "'1.q_rope'" in said and "not editable" in said and "1.probs (after it)" in said
    assert "1.v (before it)" in said and e.value.point == "1.q_rope"
    assert unhooked(tiny_lm)


def test_an_exception_in_a_hook_names_the_point_and_leaves_the_model_unhooked(tiny_lm):
    def broken(x, point):
        raise RuntimeError("my statistic failed")

    model = Model(tiny_lm)
    before = model.run_with_hooks("The quick")
    for name in ("2.probs", "logits", "0.resid_post"):
        with pytest.raises(llmtrace.HookError, match=f"at point '{name}' raised RuntimeError: my statistic failed") \
                as e:
            model.run_with_hooks("The quick", hooks=[(name, broken)])
        assert isinstance(e.value.__cause__, RuntimeError) and e.value.point == name
        assert unhooked(tiny_lm)
    with pytest.raises(llmtrace.HookError):
        with model.hooks([("1.resid_mid", broken)]):
            model.run_with_cache("The quick", names=["logits"])
    assert unhooked(tiny_lm)
    torch.testing.assert_close(model.run_with_hooks("The quick"), before, atol=0, rtol=0)


def test_hooks_as_a_block_observe_every_pass_and_a_wrong_shape_is_said(tiny_lm):
    model = Model(tiny_lm)
    seen = []
    with model.hooks([("*.probs", lambda x, p: seen.append((p.name, p.layer, p.step, tuple(x.shape))))]):
        model.run_with_cache("The quick", names=["logits"])
        model.run_with_hooks("The quick brown")
    L, H = tiny_lm.config.n_layers, tiny_lm.config.n_heads
    T1, T2 = (len(tiny_lm.tokenizer.encode_prompt(t)[1]) for t in ("The quick", "The quick brown"))
    assert seen == [(f"{i}.probs", i, "s6.5", (1, H, T, T)) for T in (T1, T2) for i in range(L)]
    assert unhooked(tiny_lm)
    with pytest.raises(llmtrace.HookError, match="shape"):
        model.run_with_hooks("The quick", hooks=[("0.resid_post", lambda x, p: x[:, :1])])
    with pytest.raises(BadValue, match="not a point"):
        model.run_with_hooks("The quick", hooks=[("0.nope", lambda x, p: None)])


def test_a_hook_is_a_side_of_compare(tiny_lm):
    """compare's side B with a Hook finds what it finds with the Ablate the hook re-expresses, and records the hook."""
    from llmtrace.run.compare import Side

    a = Side(loaded=tiny_lm)
    mine = llmtrace.compare(a, Side(loaded=tiny_lm, interventions=(Hook("1.attn_out", zero_head(0)),)), "The quick")
    theirs = llmtrace.compare(a, Side(loaded=tiny_lm, interventions=(Ablate(1, head=0),)), "The quick")
    doc_m, doc_t = mine.to_json(), theirs.to_json()
    assert doc_m["b"]["interventions"][0]["kind"] == "hook"
    assert mine.first_divergence == theirs.first_divergence
    assert abs(mine.kld_mean - theirs.kld_mean) <= 1e-6 and mine.kld_mean > 0


# ----------------------------------------------------------------------------------------------------------------
# the worked example of the docs, on a tiny model


def test_the_example_script_runs_on_a_tiny_model(tiny_lm, capsys, monkeypatch):
    script = Path(__file__).resolve().parents[1] / "examples" / "research_api.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(tiny_lm.path), "--prompt", "The quick brown fox"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "logit lens" in out and "head ablation" in out and "projection removed" in out
    assert out.count("  check: ") == 3  # each section checked itself (a failed check stops the script)
