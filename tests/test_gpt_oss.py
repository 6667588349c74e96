"""gpt-oss (model/families/gpt_oss.py) on the tiny checkpoint of tests/families.py (2 layers, a window of 4 on layer
0, sinks, YaRN, 4 experts with biases, top 2), against transformers. From the HF directory (experts as HF stores
them: gate_up_proj (E, D, 2F), gate and up interleaved) and from the GGUF llama.cpp's converter writes from it,
prompt longer than the window: fp32 logits within 8x their own float32 error at every position, greedy tokens
identical through the KV cache, and every layer's chosen experts and weights equal transformers' router. The GGUF's
YaRN ramp is rounded to whole pairs, as llama.cpp does (the reference is transformers with truncate true; the
converter undone by hand, as transformers cannot load this file)."""

import pytest
import torch
from helpers import check_run

from families import FAMILIES, PROMPT_IDS, hf_model_via_state_dict

from llmtrace.model.capture import capture

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reference(families):
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            if fmt == "hf":
                cache[fmt] = families.model("gpt_oss")
            else:
                yarn = dict(FAMILIES["gpt_oss"].config["rope_parameters"], truncate=True)  # llama.cpp's ramp
                cache[fmt] = hf_model_via_state_dict(families.gguf("gpt_oss"), FAMILIES["gpt_oss"],
                                                     rope_parameters=yarn)
        return cache[fmt]

    return get


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_runs_as_transformers(families, loaded, reference, fmt):
    import transformers

    lm = loaded("gpt_oss", fmt)
    c = lm.config
    assert c.family == "gpt_oss" and c.n_experts == 4 and c.n_experts_used == 2 and c.attn_bias
    assert c.sliding_window == 4 < len(PROMPT_IDS) and c.layer_types == ["sliding", "full"]
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] == (fmt == "gguf")
    ids = lm.tokenizer.encode(PROMPT)
    assert ids == transformers.AutoTokenizer.from_pretrained(str(families.hf_dir("gpt_oss"))).encode(PROMPT)
    check_run(lm, reference(fmt), PROMPT_IDS)


def their_routing(model, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' router of each layer: {layer: (experts (T, K), weights (T, K))} from its own outputs."""
    out, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.router.register_forward_hook(
            lambda m, args, res, i=i: out.__setitem__(i, (res[2].detach(), res[1].detach()))))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return out


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_every_layers_router_chooses_as_transformers(loaded, reference, fmt):
    lm = loaded("gpt_oss", fmt)
    with torch.no_grad(), capture(lm.model, lambda layer, name: name in ("router_probs", "expert_weights")) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    theirs = their_routing(reference(fmt), PROMPT_IDS)
    assert sorted(theirs) == [0, 1]
    for i, (experts, weights) in theirs.items():
        probs, ours = kept[(i, "router_probs")][0], kept[(i, "expert_weights")][0]  # (T, E) each
        chosen = probs.topk(2, dim=-1).indices
        assert torch.equal(chosen, experts), f"layer {i}: the chosen experts differ"
        assert float((ours.gather(-1, chosen) - weights).abs().max()) <= 1e-6, f"layer {i}: the weights differ"
        assert int((probs > 0).sum(dim=-1).max()) == 2  # a softmax over the chosen K only: 0 elsewhere
        assert torch.allclose(probs.sum(-1), torch.ones(len(PROMPT_IDS)))


def test_the_sink_takes_its_share_of_every_softmax_row(loaded, reference):
    lm = loaded("gpt_oss", "hf")
    with torch.no_grad(), capture(lm.model, lambda layer, name: name in ("scores", "probs", "sink")) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    with torch.no_grad():
        theirs = reference("hf")(torch.tensor([PROMPT_IDS]), output_attentions=True).attentions
    for layer in (0, 1):
        scores, probs, sink = kept[(layer, "scores")][0], kept[(layer, "probs")][0], kept[(layer, "sink")][0]
        total = probs.sum(-1)  # (H, T)
        assert float(total.max()) < 1 and float(sink.min()) > 0
        assert float((1 - total - sink).abs().max()) <= 1e-6  # the sink's share is what the row lacks
        # the sink only rescales each row: probs = softmax(scores) · (1 − sink)
        assert float((torch.softmax(scores, -1) * (1 - sink)[..., None] - probs).abs().max()) <= 1e-6
        assert float((probs - theirs[layer][0]).abs().max()) <= 1e-6  # transformers' attention weights
    window = scores[:, -1]  # layer 1 is global: every key scored; layer 0's window of 4 masks the rest
    assert torch.isfinite(window).all() and int(torch.isfinite(kept[(0, "scores")][0][:, -1]).sum(-1)[0]) == 4


def test_the_clamped_glu_is_transformers(families, loaded):
    """Values far past the limit of 7, where the clamp bites, through our GLU and transformers' _apply_gate."""
    lm = loaded("gpt_oss", "hf")
    experts = families.model("gpt_oss").model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    gate, up = 8 * torch.randn(50, 32, generator=gen), 8 * torch.randn(50, 32, generator=gen)
    assert (gate > 7).any() and (up.abs() > 7).any()
    theirs = experts._apply_gate(torch.stack([gate, up], dim=-1).flatten(-2))  # interleaved g0 u0 g1 u1 ...
    ours = lm.model.layers[0].ffn.glu(gate, up)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_frequencies_and_factor_are_transformers(truncate, head_dim):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmtrace.model.families.gpt_oss import yarn_attention_factor
    from llmtrace.model.transformer import ModelConfig, rope_inv_freq

    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}
    hf = transformers.GptOssConfig(head_dim=head_dim, hidden_size=head_dim * 4, num_attention_heads=4,
                                   rope_parameters=dict(yarn))
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    scaling = {k: v for k, v in yarn.items() if k != "rope_theta"}
    ours = rope_inv_freq(ModelConfig(head_dim=head_dim, rope_theta=150000.0, rope_scaling=scaling))
    assert torch.equal(ours, theirs) and yarn_attention_factor(scaling) == factor
    plain = rope_inv_freq(ModelConfig(head_dim=head_dim, rope_theta=150000.0))
    assert (ours < plain).any() and (ours == plain).any()  # the slow pairs slowed, the fast ones kept


def test_what_it_changes_is_said(loaded):
    from llmtrace.model.family import describe_changes

    said = describe_changes(loaded("gpt_oss", "hf").config)
    assert any("sinks" in line for line in said) and any("top 2 of the raw router logits" in line for line in said)
    assert any("gate ≤ 7" in line and "σ(1.702·gate)" in line for line in said)
    assert any("YaRN" in line and "× 1.3466" in line for line in said)


# ----------------------------------------------------------------------------------------------------------------
# MXFP4: the experts as the released checkpoints store them


def test_the_three_mxfp4_dequantizers_agree_on_random_blocks():
    """Random HF blocks and scales: llmtrace's HF reader, transformers' convert_moe_packed_tensors, and gguf's
    dequantizer of the same blocks repacked by llama.cpp's converter (and llmtrace's torch copy of it, which
    --keep-quantized runs) give the same float32 values, bit for bit."""
    import numpy as np
    from conversion.gpt_oss import GptOssModel
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llmtrace.checkpoint.weights import mxfp4_dequantize
    from llmtrace.model.quant import dequantize

    gen = torch.Generator().manual_seed(3)
    E, out, G = 3, 8, 4  # (E, out, in/32) blocks of 32
    blocks = torch.randint(0, 256, (E, out, G, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (E, out, G), generator=gen, dtype=torch.uint8)
    ours = mxfp4_dequantize(blocks, scales)  # (E, out, in)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # back to (E, out, in)
    assert torch.equal(ours, theirs)
    ggml = torch.cat([scales[..., None], GptOssModel.transform_nibble_layout(None, blocks)], dim=-1)  # (E, out, G, 17)
    raw = ggml.reshape(E * out, G * 17)
    reference = torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType.MXFP4).astype(np.float32))
    assert torch.equal(reference.reshape(E, out, G * 32), ours)
    assert torch.equal(dequantize(raw, "MXFP4").reshape(E, out, G * 32), ours)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_mxfp4_experts_run_as_transformers(families, loaded, fmt):
    from families import gguf_tensor_shapes

    if fmt == "hf":
        from safetensors import safe_open

        with safe_open(str(families.hf_dir("gpt_oss_mxfp4") / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in keys and \
            "model.layers.0.mlp.experts.gate_up_proj" not in keys
        reference = families.model("gpt_oss_mxfp4")  # its experts hold the values the blocks stand for
    else:
        kinds = gguf_tensor_shapes(families.gguf("gpt_oss_mxfp4"))
        assert kinds["blk.0.ffn_gate_exps.weight"][0] == "MXFP4" and kinds["blk.1.ffn_down_exps.weight"][0] == "MXFP4"
        yarn = dict(FAMILIES["gpt_oss_mxfp4"].config["rope_parameters"], truncate=True)
        reference = hf_model_via_state_dict(families.gguf("gpt_oss_mxfp4"), FAMILIES["gpt_oss_mxfp4"],
                                            rope_parameters=yarn)
    check_run(loaded("gpt_oss_mxfp4", fmt), reference, PROMPT_IDS)


def test_mxfp4_kept_quantized_is_the_exact_path(families, loaded):
    from llmtrace.checkpoint.load import load_model
    from llmtrace.model.quant import QuantExperts, storage_table

    exact = loaded("gpt_oss_mxfp4", "gguf")
    kept = load_model(str(families.gguf("gpt_oss_mxfp4")), device="cpu", dtype="float32", keep_quantized=True)
    stack = kept.model.layers[1].ffn.w_up
    assert isinstance(stack, QuantExperts) and stack.bias is not None
    assert stack.stored_bytes() == 4 * 32 * 64 * 17 // 32  # E·Fe·D weights, 17 bytes a block of 32
    rows = {r["name"]: r for r in storage_table(kept.model)}
    assert rows["layers.1.ffn.w_up"]["type"] == "MXFP4"
    idx = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        assert torch.equal(kept.model(idx), exact.model(idx))


def test_mxfp4_under_fast_is_stated_and_holds_the_exact_values(families, loaded):
    """--fast runs an MXFP4 stack as dense bfloat16 (every MXFP4 value is a bfloat16 one), and says so."""
    from llmtrace.checkpoint.load import load_model

    exact = loaded("gpt_oss_mxfp4", "gguf")
    fast = load_model(str(families.gguf("gpt_oss_mxfp4")), device="cpu", fast=True)
    assert "layers.0.ffn.w_gate" in fast.config.extra["fast"]["bf16_matrices"]
    stack = fast.model.layers[0].ffn.w_gate
    for e in range(4):
        assert torch.equal(stack.parts[e].weight, exact.model.layers[0].ffn.w_gate.weight[e].to(torch.bfloat16))
        assert torch.equal(stack.bias[e], exact.model.layers[0].ffn.w_gate.bias[e].to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------------
# the o200k split


TEXTS = ["The quick brown fox", "HelloWorld isn't CamelCASEWords", "12345 678 9/10/2024", "a //b\n/c  d\n\n e",
         "naïve CAFÉ's ÉCOLE", "x = foo(bar)/baz!?"]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_o200k_split_gives_transformers_ids(families, loaded, fmt):
    """The fixture's tokenizer.json splits the o200k way; its GGUF says `gpt-4o`, which llmtrace reads as the same
    split: every text's pieces and ids are transformers' (texts where o200k and GPT-2 cut differently)."""
    import transformers
    from tokenizers import Tokenizer, pre_tokenizers

    lm = loaded("gpt_oss", fmt)
    theirs = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir("gpt_oss")))
    gpt2 = Tokenizer.from_str(theirs.backend_tokenizer.to_str())  # the same vocabulary, split the GPT-2 way
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    differs = 0
    for text in TEXTS:
        ids = lm.tokenizer.encode(text)
        assert ids == theirs.encode(text), text
        differs += ids != gpt2.encode(text).ids
    assert differs >= 2  # the texts and the vocabulary test the o200k split: GPT-2's would give other ids


def test_the_gguf_names_the_o200k_split(families):
    from families import gguf_metadata

    assert gguf_metadata(families.gguf("gpt_oss"))["tokenizer.ggml.pre"] == "gpt-4o"


# ----------------------------------------------------------------------------------------------------------------
# the router ledger, expert interventions and compare's routing flip, as for Mixtral


def _ours(lm, interventions, n_new: int = 6):
    from llmtrace.run.generate import generate
    from llmtrace.run.interventions import prepare
    from llmtrace.run.sampler import Sampler, SamplerConfig

    edits = prepare(lm, interventions, [len(PROMPT_IDS)])
    with torch.no_grad(), lm.model.hooked(edits or (lambda *a: None), edits.layers if edits else [], spell_out=False):
        logits = lm.model(torch.tensor([PROMPT_IDS]))[0]
    sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
    return logits, list(generate(lm, PROMPT_IDS, sampler, n_new, (), True, None, interventions=interventions).tokens)


def _theirs(model, n_new: int = 6):
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0]
        out = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    return logits, out[0, len(PROMPT_IDS):].tolist()


def _busiest(lm, layer: int) -> int:
    with torch.no_grad(), capture(lm.model, [(layer, "expert_weights")]) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    return int((kept[(layer, "expert_weights")][0] > 0).sum(0).argmax())


def test_ablating_an_expert_is_its_raw_router_score_at_minus_infinity(families, loaded):
    """gpt-oss chooses on the raw logits: -inf there drops the expert before the top-k, as transformers' router
    written out by hand with that score at -inf."""
    import copy

    import torch.nn.functional as F

    from llmtrace.run.interventions import Ablate

    lm, layer = loaded("gpt_oss", "hf"), 1
    expert = _busiest(lm, layer)
    model = copy.deepcopy(families.model("gpt_oss"))
    router = model.model.layers[layer].mlp.router

    def forward(hidden):
        logits = F.linear(hidden.reshape(-1, router.hidden_dim), router.weight, router.bias)
        logits[:, expert] = float("-inf")
        top, idx = torch.topk(logits, router.top_k, dim=-1)
        return logits, F.softmax(top, dim=1, dtype=top.dtype), idx

    router.forward = forward
    (a, tokens_a), (b, tokens_b) = _ours(lm, [Ablate(layer, expert=expert)]), _theirs(model)
    assert float((a - b).abs().max()) <= 1e-4 and tokens_a == tokens_b
    assert float((a - _ours(lm, [])[0]).abs().max()) > 1e-2  # the ablation bites


def test_scaling_an_expert_scales_its_output_bias_and_all(families, loaded):
    import copy

    from llmtrace.run.interventions import Scale

    lm, layer, factor = loaded("gpt_oss", "hf"), 0, 2.5
    expert = _busiest(lm, layer)
    model = copy.deepcopy(families.model("gpt_oss"))
    with torch.no_grad():  # the expert's whole output, W_down·act + b_down, times the factor, by hand
        model.model.layers[layer].mlp.experts.down_proj[expert] *= factor
        model.model.layers[layer].mlp.experts.down_proj_bias[expert] *= factor
    (a, tokens_a), (b, tokens_b) = _ours(lm, [Scale(layer, factor, expert=expert)]), _theirs(model)
    assert float((a - b).abs().max()) <= 1e-4 and tokens_a == tokens_b


def test_the_router_ledger_is_transformers_choice(families):
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("gpt_oss")), device="cpu", dtype="float32")
    run = model.generate(PROMPT, max_new_tokens=2, trace="layers", temperature=0)
    events = [e for e in run.events if e["event"] == "routing"]
    assert [(e["step"], e["layer"]) for e in events] == [(s, layer) for s in range(2) for layer in range(2)]
    ids = [t["id"] for t in next(e for e in run.events if e["event"] == "tokens")["tokens"]] + run.tokens[:1]
    theirs = their_routing(families.model("gpt_oss"), ids)
    for e in events:
        assert e["k"] == 2 and e["n_experts"] == 4
        experts, weights = theirs[e["layer"]]
        for p, chosen, w in zip(e["positions"], e["experts"], e["weights"]):
            assert chosen == experts[p].tolist()
            assert max(abs(x - y) for x, y in zip(w, weights[p].tolist())) <= 1e-5


def test_compare_names_the_first_routing_flip(families, loaded):
    from llmtrace.run.compare import Side, compare
    from llmtrace.run.interventions import Ablate

    lm = loaded("gpt_oss", "hf")
    expert = _busiest(lm, 1)
    side = Side(model=str(families.hf_dir("gpt_oss")), dtype="float32")
    result = compare(side, side.with_changes(interventions=(Ablate(1, expert=expert),)), PROMPT, max_new_tokens=1)
    routing = result.to_json()["routing"]
    assert routing["first"]["layer"] == 1 and routing["flips"] > 0
    assert routing["layers"][0] == {"layer": 0, "flips": 0}  # layer 0 routes as before: the ablation is in layer 1
    assert expert in routing["first"]["a"] and expert not in routing["first"]["b"]


def test_the_pages_sink_card_works_the_share_out_beside_the_trace(browser, families, tmp_path):
    """The walk-through's card of the `sink` point (the softmax's sink column) and of `probs`, at every token of the
    prompt and a decode step, in both layers: computed from the recorded scores' log-sum-exp and the sink logit,
    within 1e-5 of the trace."""
    import llmtrace
    from helpers import Opened

    model = llmtrace.load(str(families.hf_dir("gpt_oss")), device="cpu", dtype="float32")
    run = model.generate(PROMPT, max_new_tokens=2, trace="full", layers=[0, -1], temperature=0)
    path = tmp_path / "run.html"
    path.write_text(run.html(), encoding="utf-8")
    page = Opened(browser, path)
    assert [m for m in page.messages if m[0] in ("error", "pageerror")] == []
    p = page.page
    seen = set()
    tokens = p.eval_on_selector_all("#walk-token option", "els => els.map(e => e.value)")
    for token in tokens[:-1]:  # the last token sampled is never run through the model: no card
        for layer in ("0", "1"):
            p.select_option("#walk-token", token)
            p.select_option("#walk-layer", layer)
            for point in ("sink", "probs"):
                card = p.locator(f'.wpoint.card[data-point="{point}"]').first
                assert card.get_attribute("data-op") == "softmax"
                err, rel = float(card.get_attribute("data-max-error")), float(card.get_attribute("data-max-rel"))
                assert err <= 1e-5 or rel <= 1e-4, (token, layer, point, err, rel)
                seen.add(point)
    assert seen == {"sink", "probs"}


# ----------------------------------------------------------------------------------------------------------------
# the harmony chat format, in the sandbox


CHAT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_harmony_template_renders_as_transformers_renders_it(families, loaded, fmt):
    """The fixture's harmony template (namespace, strftime_now, raise_exception, as gpt-oss's own template uses them)
    in llmtrace's jinja2 sandbox, from tokenizer_config.json and from the GGUF's tokenizer.chat_template: the same
    text as transformers' apply_chat_template, and the same ids."""
    import transformers

    lm = loaded("gpt_oss", fmt)
    theirs = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir("gpt_oss")))
    text = lm.tokenizer.render_chat(CHAT, add_generation_prompt=True)
    assert text == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in one word.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>And grass?<|end|><|start|>assistant")
    assert "Reasoning: medium" in text and "Reasoning: high" in lm.tokenizer.render_chat(CHAT, reasoning_effort="high")
    ids = lm.tokenizer.encode_prompt("Sky colour?", chat=True, system="Be brief.")[1]
    assert ids == theirs.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Sky colour?"}],
                                             tokenize=True, add_generation_prompt=True, return_dict=False)


def test_a_role_harmony_does_not_know_is_one_line(loaded):
    from llmtrace.errors import LlmtraceError

    with pytest.raises(LlmtraceError, match="harmony has no role tool after the first message"):
        loaded("gpt_oss", "hf").tokenizer.render_chat([{"role": "user", "content": "hi"},
                                                      {"role": "tool", "content": "x"}])
