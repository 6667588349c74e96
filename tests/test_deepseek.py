"""DeepSeek V2 and V3 (model/families/deepseek.py: multi-head latent attention, model/kinds/mla.py, and a mixture of
experts with shared experts, model/moe.py) on the tiny checkpoints of tests/families.py, against transformers 5.25:

- V3: q through a low-rank code, sigmoid router with a random choice bias, the best 2 of 4 groups, × 2.5, renormalised;
- V2: q projected directly, softmax router, greedy top 2 of 4, × 1.5, not renormalised, YaRN (scores × mscale²).

From the HF directory and from the GGUF llama.cpp's converter writes: prompt ids identical, fp32 logits within 1e-4 at
every position, greedy tokens identical through the cache, every MoE layer's chosen experts and weights equal to
transformers' router. The cache holds kv_lora_rank + qk_rope_head_dim numbers a token a layer, and a wrong latent
(one step perturbed) breaks the parity."""

import pytest
import torch
from helpers import check_run

from families import FAMILIES, PROMPT_IDS

from llmtrace.model.capture import capture

PROMPT = "The quick brown fox"
NAMES = ["deepseek_v3", "deepseek_v2"]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_runs_as_transformers(families, loaded, name, fmt):
    import transformers

    lm = loaded(name, fmt)
    c, m = lm.config, lm.config.parts["mla"]
    assert c.family == "deepseek" and (m["q_lora_rank"] is not None) == (name == "deepseek_v3")
    assert (m["kv_lora_rank"], m["rope"], m["nope"]) == (16, 8, 8) and c.dense_layers == [0]
    ids = lm.tokenizer.encode(PROMPT)
    assert ids == transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(name))).encode(PROMPT)
    check_run(lm, families.model(name), PROMPT_IDS)


def their_routing(model, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' router of each MoE layer: {layer: (experts (T, K), weights (T, K))}, from its own outputs."""
    out, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):
            handles.append(gate.register_forward_hook(
                lambda mod, args, res, i=i: out.__setitem__(i, (res[2].detach(), res[1].detach()))))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return out


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_every_layers_router_chooses_as_transformers(families, loaded, name, fmt):
    lm = loaded(name, fmt)
    with torch.no_grad(), capture(lm.model, lambda layer, n: n == "expert_weights") as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    theirs = their_routing(families.model(name), PROMPT_IDS)
    assert sorted(theirs) == [1, 2]  # layer 0 is dense (first_k_dense_replace 1)
    for i, (experts, weights) in theirs.items():
        ours = kept[(i, "expert_weights")][0]  # (T, E), 0 where not chosen
        mine = ours.topk(2, dim=-1).indices
        assert torch.equal(mine.sort(-1).values, experts.sort(-1).values), f"layer {i}: the chosen experts differ"
        assert float((ours.gather(-1, experts) - weights).abs().max()) <= 1e-6, f"layer {i}: the weights differ"


def test_v3s_choice_bias_chooses_and_does_not_weigh(loaded):
    """Without its correction bias the V3 router chooses other experts for some tokens; the chosen weights are the
    sigmoid scores themselves (renormalised, × 2.5), never score + bias."""
    lm = loaded("deepseek_v3", "hf")
    ffn = lm.model.layers[1].ffn
    with torch.no_grad(), capture(lm.model, lambda layer, n: layer == 1 and n in ("router_probs", "expert_weights")) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    probs, weights = kept[(1, "router_probs")][0], kept[(1, "expert_weights")][0]
    chosen = weights > 0
    w = torch.where(chosen, probs, torch.zeros_like(probs))
    assert torch.allclose(weights, 2.5 * w / w.sum(-1, keepdim=True), atol=1e-6)
    assert float(ffn.choice_bias.abs().max()) > 0
    unbiased = probs.topk(2, dim=-1).indices
    assert not torch.equal(torch.zeros_like(probs, dtype=torch.bool).scatter(-1, unbiased, True), chosen)


def test_the_cache_holds_the_latent_and_the_rope_key_only(loaded):
    """kv_lora_rank + qk_rope_head_dim numbers a token a layer: the cache's buffers, its byte count and the run
    event's memory record say so, beside what full multi-head attention would keep."""
    from llmtrace.trace.records import model_record

    lm = loaded("deepseek_v3", "gguf")
    c, m = lm.config, lm.config.parts["mla"]
    cache = lm.model.new_cache(32)
    per_token = m["kv_lora_rank"] + m["rope"]  # 16 + 8
    for layer in cache.layers:
        assert {n: tuple(b.shape) for n, b in layer.buffers.items()} == {"c_kv": (1, 32, 16), "k_pe": (1, 32, 8)}
    assert cache.bytes_per_token == c.n_layers * per_token * 4
    mha = c.n_heads * (m["nope"] + m["rope"] + m["v"])  # 4 · (8 + 8 + 12)
    assert cache.mha_bytes_per_token == c.n_layers * mha * 4
    record = model_record(lm)["memory"]
    assert [r["kind"] for r in record] == ["latent"] * 3
    assert all(r["per_token"] == {"c_kv": [16], "k_pe": [8]} and r["per_token_bytes"] == per_token * 4
               and r["mha_per_token_bytes"] == mha * 4 for r in record)


def test_a_wrong_latent_breaks_the_parity(families, loaded):
    """The parity can fail where the latent is wrong: c_kv moved by 1 % in one layer (the cache keeps the moved one),
    and, in a decode step, one earlier slot of the cached latent moved: the logits leave transformers' by far more
    than the tolerance."""
    lm = loaded("deepseek_v2", "hf")
    reference = families.model("deepseek_v2")
    idx = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        theirs = reference(idx).logits[0]
        with lm.model.hooked(lambda layer, n, x: x * 1.01 if (layer, n) == (1, "c_kv") else None, layers=[1]):
            moved = lm.model(idx)[0]
        assert float((moved - theirs).abs().max()) > 1e-2
        # decode: the step reads the earlier slots' latents from the cache, not from the tokens again
        cache = lm.model.new_cache(len(PROMPT_IDS) + 1)
        lm.model(idx[:, :-1], cache)
        step = lm.model(idx[:, -1:], cache, len(PROMPT_IDS) - 1)[0, -1]
        assert float((step - theirs[-1]).abs().max()) <= 1e-4
        cache = lm.model.new_cache(len(PROMPT_IDS) + 1)
        lm.model(idx[:, :-1], cache)
        cache.layers[2].buffers["c_kv"][:, 3] *= 1.05
        step = lm.model(idx[:, -1:], cache, len(PROMPT_IDS) - 1)[0, -1]
        assert float((step - theirs[-1]).abs().max()) > 1e-3


def test_the_absorbed_form_gives_the_same_scores(loaded):
    """What the docstring teaches: q_nope · (W_kb c) = (W_kb·q_nope) · c, so the scores can be computed from the
    cached latent without any key; the recorded scores agree with the absorbed form's."""
    lm = loaded("deepseek_v3", "hf")
    attn = lm.model.layers[1].attn
    with torch.no_grad(), capture(lm.model, lambda layer, n: layer == 1) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    q_nope, q_rope = kept[(1, "q_nope")][0].double(), kept[(1, "q_rope")][0].double()  # (T, H, Dn), (T, H, Dr)
    c, k_rope = kept[(1, "c_kv")][0].double(), kept[(1, "k_rope")][0].double()  # (S, R), (S, Dr)
    q_latent = torch.einsum("thn,hrn->thr", q_nope, attn.w_kb.weight.double())  # each query in latent space
    scores = (torch.einsum("thr,sr->hts", q_latent, c) + torch.einsum("thd,sd->hts", q_rope, k_rope)) * attn.scale
    recorded = kept[(1, "scores")][0].double()
    finite = torch.isfinite(recorded)
    assert float((scores[finite] - recorded[finite]).abs().max()) <= 1e-4


def test_the_family_says_what_it_changes(loaded):
    from llmtrace.model.family import describe_changes

    text = " ".join(describe_changes(loaded("deepseek_v3", "hf").config))
    assert "latent of 16" in text and "24 numbers a token a layer" in text and "112" in text
    assert "best 2 of 4 groups" in text and "× 2.5" in text and "1 shared expert" in text
    v2 = " ".join(describe_changes(loaded("deepseek_v2", "gguf").config))
    assert "q projected directly" in v2 and "softmax scores" in v2 and "not renormalised" in v2 and "YaRN" in v2


def test_the_tools_run_on_it(families, loaded, isolated, capsys):
    """explain on an MLA layer says what the layer keeps; --keep-quantized computes the same logits from the GGUF's
    F32 blocks (W_kb and W_vb read through their per-head call); --fast runs and says it is approximate."""
    import llmtrace
    from helpers import run_cli

    path = families.gguf("deepseek_v3")
    code, out, err = run_cli(capsys, "explain", PROMPT, "-m", path, "--layer", "1")
    assert code == 0, err
    assert "keeps c_kv [16] and k_pe [8]" in out and "would keep" in out
    exact = loaded("deepseek_v3", "gguf")
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        want = exact.model(ids)[0]
        kept = llmtrace.load(str(path), keep_quantized=True).loaded.model(ids)[0]
    assert float((kept - want).abs().max()) <= 1e-5
    code, out, err = run_cli(capsys, "generate", PROMPT, "-m", path, "-n", "2", "--fast", "--trace", "none")
    assert code == 0, err
    assert "--fast (approximate)" in out + err


def test_the_pages_memory_chart_names_the_latent_not_gqa(families, capsys, tmp_path):
    """The KV section's chart of a DeepSeek run: its own line is the latent cache (MLA), beside full multi-head
    attention's, never called GQA (it was: the title was Llama's)."""
    import html

    from helpers import run_cli

    page = tmp_path / "page.html"
    code, _, err = run_cli(capsys, "generate", "hello there", "-m", families.hf_dir("deepseek_v3"), "-n", "2",
                           "--html", page)
    assert code == 0, err
    text = html.unescape(page.read_text())
    assert "this model's cache: a compressed latent, one entry a token (MLA)" in text
    assert "full multi-head attention would need" in text and "(GQA)" not in text
