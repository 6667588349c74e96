"""Mixtures of experts (model/moe.py; families mixtral, qwen3_moe) against transformers, from the HF directory and
from the GGUF llama.cpp's converter writes: prompt ids identical, fp32 logits within 8x their own float32 error at
every position, greedy tokens identical, and the router's choice (the K experts of every token in every MoE layer, in
order) identical to transformers' router, with weights within 1e-5. A Qwen3-MoE GGUF renormalises the top-K weights
whatever the model's config said (llama.cpp does; the converter does not write norm_topk_prob), so its reference is
transformers with norm_topk_prob true; Mixtral's file is Llama's arch with experts, which transformers cannot read:
its reference is the converter undone by hand (families.hf_model_via_state_dict)."""

import pytest
import torch
from helpers import check_run

from families import FAMILIES, PROMPT_IDS, hf_model_from_gguf, hf_model_via_state_dict

from llmtrace.checkpoint.load import load_model
from llmtrace.model.capture import capture
from llmtrace.model.moe_points import moe_layers

HF_NAMES = ["mixtral", "qwen3_moe", "qwen3_moe_raw", "qwen3_moe_dense"]
GGUF_NAMES = ["mixtral", "qwen3_moe", "qwen3_moe_raw"]
WEIGHT_TOL = 1e-5
TOL = 1e-4


def gguf_reference(families, name):
    """transformers' model of the GGUF: renormalised top-K (the file's semantics), the converter undone by hand."""
    if name == "mixtral":
        return hf_model_via_state_dict(families.gguf(name), FAMILIES[name])
    return hf_model_via_state_dict(families.gguf(name), FAMILIES[name], norm_topk_prob=True)


def their_routing(model, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """transformers' router of each MoE layer over ids: {layer: (logits (T, E), experts (T, K), weights (T, K))}, read
    from the router modules' own outputs (the logits also come back as output_router_logits)."""
    out, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        router = getattr(getattr(layer, "mlp", None), "gate", None) or getattr(
            getattr(layer, "block_sparse_moe", None), "gate", None)
        if router is None or not hasattr(router, "top_k"):
            continue
        handles.append(router.register_forward_hook(
            lambda m, args, res, i=i: out.__setitem__(i, (res[0].detach(), res[2].detach(), res[1].detach()))))
    try:
        with torch.no_grad():
            result = model(torch.tensor([ids]), output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    for logits, i in zip(result.router_logits, sorted(out)):  # one (T, E) per MoE layer, in layer order
        assert torch.equal(logits, out[i][0])
    return out


def our_routing(lm, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The same from llmtrace's points: router_logits, and the K experts and weights of expert_weights."""
    K = lm.config.n_experts_used
    with torch.no_grad(), capture(lm.model, lambda layer, name: name in ("router_logits", "router_probs",
                                                                         "expert_weights")) as kept:
        lm.model(torch.tensor([ids]))
    out = {}
    for i in moe_layers(lm.config):
        probs, weights = kept[(i, "router_probs")][0], kept[(i, "expert_weights")][0]
        experts = probs.topk(K, dim=-1).indices  # (T, K), most probable first
        out[i] = (kept[(i, "router_logits")][0], experts, weights.gather(-1, experts))
    return out


def check_routing(lm, reference, ids) -> None:
    ours, theirs = our_routing(lm, ids), their_routing(reference, ids)
    assert sorted(ours) == sorted(theirs) and ours
    for i in ours:
        assert float((ours[i][0] - theirs[i][0]).abs().max()) <= 1e-4, f"layer {i}: router logits differ"
        assert torch.equal(ours[i][1], theirs[i][1]), f"layer {i}: the chosen experts differ"
        assert float((ours[i][2] - theirs[i][2]).abs().max()) <= WEIGHT_TOL, f"layer {i}: the weights differ"


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_dir_runs_and_routes_as_transformers(families, name):
    lm = load_model(str(families.hf_dir(name)), device="cpu", dtype="float32")
    assert lm.config.family == ("mixtral" if name == "mixtral" else "qwen3_moe")
    reference = families.model(name)
    assert lm.config.norm_topk_prob == (True if name == "mixtral" else reference.config.norm_topk_prob)
    check_run(lm, reference, PROMPT_IDS)
    check_routing(lm, reference, PROMPT_IDS)


@pytest.mark.parametrize("name", GGUF_NAMES)
def test_converter_gguf_runs_and_routes_as_transformers(families, name):
    lm = load_model(str(families.gguf(name)), device="cpu", dtype="float32")
    expected = ("mixtral", "llama") if name == "mixtral" else ("qwen3_moe", "qwen3moe")
    assert (lm.config.family, lm.config.arch) == expected
    assert lm.config.norm_topk_prob  # llama.cpp renormalises in both archs
    reference = gguf_reference(families, name)
    check_run(lm, reference, PROMPT_IDS)
    check_routing(lm, reference, PROMPT_IDS)


def test_transformers_own_gguf_loader_agrees_on_qwen3_moe(families):
    """A second reference for qwen3moe files: transformers reads them itself."""
    lm = load_model(str(families.gguf("qwen3_moe")), device="cpu", dtype="float32")
    reference = hf_model_from_gguf(families.gguf("qwen3_moe"), FAMILIES["qwen3_moe"])
    assert reference.config.norm_topk_prob
    check_run(lm, reference, PROMPT_IDS)
    check_routing(lm, reference, PROMPT_IDS)


def test_prompt_ids_are_transformers(families):
    """The tokenizer of each format encodes as transformers' tokenizer of the HF directory."""
    from transformers import AutoTokenizer

    text = "The quick brown fox jumps over 13 lazy dogs."
    theirs = AutoTokenizer.from_pretrained(str(families.hf_dir("qwen3_moe"))).encode(text)
    for path in (families.hf_dir("qwen3_moe"), families.gguf("qwen3_moe"), families.gguf("mixtral")):
        lm = load_model(str(path), device="cpu", dtype="float32")
        assert lm.tokenizer.encode_prompt(text)[1] == theirs, path.name


def test_a_dense_layer_of_a_moe_model(families):
    """mlp_only_layers [1]: layer 1 runs a dense SwiGLU of width intermediate_size and reports Llama's four points,
    a subset of the declared ones; the layers around it route."""
    lm = load_model(str(families.hf_dir("qwen3_moe_dense")), device="cpu", dtype="float32")
    assert lm.config.dense_layers == [1] and moe_layers(lm.config) == [0, 2]
    seen = []
    hook = lambda layer, name, x: seen.append((layer, name, tuple(x.shape)))  # noqa: E731
    with torch.no_grad(), lm.model.hooked(hook, layers=[0, 1]):
        lm.model(torch.tensor([PROMPT_IDS[:5]]))
    ffn = lambda layer: [(n, s) for lay, n, s in seen if lay == layer and n in lm.points.names("ffn")]  # noqa: E731
    assert ffn(1) == [("gate", (1, 5, 96)), ("up", (1, 5, 96)), ("act", (1, 5, 96)), ("down", (1, 5, 64))]
    assert [n for n, _ in ffn(0)] == list(lm.points.names("ffn"))
    assert dict(ffn(0))["gate"] == (1, 5, 2, 32)  # T, K, Fe


def test_expert_weights_are_3d_and_counted(families):
    lm = load_model(str(families.gguf("qwen3_moe")), device="cpu", dtype="float32")
    from llmtrace.checkpoint.placement import weight_count
    from llmtrace.checkpoint.weights import declared
    from llmtrace.model.moe import active_weights

    experts = [w for w in declared(lm.config) if w.weight.kind == "experts"]
    assert [w.shape for w in experts[:3]] == [(8, 32, 64), (8, 32, 64), (8, 64, 32)]
    assert [s.gguf for w in experts[:3] for s in w.sources] == [
        "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"]
    active, total = active_weights(lm.config, declared(lm.config))
    assert total == lm.model.num_params() == weight_count(lm.config)  # what the fit check counts
    assert total - active == 2 * 3 * 8 * 32 * 64 * 6 // 8  # each layer's 3 stacks: 6 of 8 experts idle per token


# ----------------------------------------------------------------------------------------------------------------
# what is refused


@pytest.mark.parametrize("model_type, says", [("qwen2_moe", "shared expert")])
def test_a_moe_we_do_not_run_is_refused_naming_the_feature(capsys, tmp_path, model_type, says):
    import json

    from helpers import fails

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    fails(capsys, 1, "generate", "hi", "-m", tmp_path, "-n", "1", says=(model_type, says, "not supported yet"))


def test_a_qwen2moe_gguf_is_refused_naming_the_shared_expert(capsys, tmp_path):
    import gguf

    from helpers import fails

    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fails(capsys, 1, "generate", "hi", "-m", path, "-n", "1", says=("qwen2moe", "shared expert"))


def test_a_llama_gguf_without_experts_stays_llama(families):
    from llmtrace.checkpoint.gguf_checkpoint import config_from_gguf
    from llmtrace.checkpoint.gguf_file import open_gguf

    assert config_from_gguf(open_gguf(families.gguf("llama")), "x").family == "llama"
    assert config_from_gguf(open_gguf(families.gguf("mixtral")), "x").family == "mixtral"


# ----------------------------------------------------------------------------------------------------------------
# memory: the expert stacks held in their blocks, counted by their weights


def test_keep_quantized_holds_each_expert_stack_in_its_blocks(families):
    from llmtrace.model.quant import QuantExperts, storage_table

    path = families.gguf("mixtral", "q8_0")
    exact = load_model(str(path), device="cpu", dtype="float32")
    kept = load_model(str(path), device="cpu", dtype="float32", keep_quantized=True)
    stack = kept.model.layers[1].ffn.w_down
    assert isinstance(stack, QuantExperts) and stack.raw0.dtype == torch.uint8
    assert stack.stored_bytes() == 4 * 64 * 96 * 34 // 32  # E·D·Fe weights, Q8_0's 34 bytes a block of 32
    rows = {r["name"]: r for r in storage_table(kept.model)}
    assert rows["layers.1.ffn.w_down"]["type"] == "Q8_0" and rows["layers.1.ffn.router"]["type"] == "F32"
    assert kept.model.num_params() == exact.model.num_params()
    idx = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        torch.testing.assert_close(kept.model(idx), exact.model(idx), rtol=1e-4, atol=1e-5)


def test_fast_packs_each_expert_on_its_kernel(families):
    from llmtrace.model.fast import FastExperts, fast_linear
    from llmtrace.model.quant import Segment

    path = families.gguf("qwen3_moe", "q8_0")
    exact = load_model(str(path), device="cpu", dtype="float32")
    fast = load_model(str(path), device="cpu", fast=True)
    stack = fast.model.layers[0].ffn.w_gate
    assert isinstance(stack, FastExperts) and stack.weight.shape == (8, 32, 64)
    assert fast.model.num_params() == exact.model.num_params()
    entry = next(p for p in _gguf_plan(path)["layers.0.ffn.w_gate.weight"])
    x = torch.randn(3, 64).to(torch.bfloat16)
    for e in (0, 5):  # expert e is its own rows of the file's one tensor, packed as one matrix would be
        alone = fast_linear([entry.raw()[e * 32 : (e + 1) * 32]], [Segment(entry.kind, entry.key)], 64,
                            torch.device("cpu"), fast.config.extra["fast"]["kernel_choice"])
        assert torch.equal(stack(x, e), alone(x))
    idx = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        a, b = exact.model(idx)[0], fast.model(idx)[0].float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def _gguf_plan(path):
    from llmtrace.checkpoint.gguf_checkpoint import open_gguf_checkpoint

    return open_gguf_checkpoint(path).plan


def test_compile_is_refused_for_a_mixture_of_experts(capsys, families):
    from helpers import fails

    fails(capsys, 2, "generate", "hi", "-m", families.hf_dir("mixtral"), "-n", "2", "--trace", "none", "--compile",
          says=("--compile", "mixture of experts"))
