"""The family fixtures of tests/families.py are right: each HF directory and the GGUF llama.cpp's converter writes from
it hold the same model (logits within 1e-4 in transformers), the GGUF says what tests/families.py and
the families note say it says, and each fixture exercises its family's difference (a window that changes the
logits, caps that bite, a dense layer among MoE ones)."""

import pytest
import torch

from families import (FAMILIES, PROMPT_IDS, convert_to_gguf, gguf_metadata, gguf_tensor_shapes, hf_model_from_gguf,
                      hf_model_via_state_dict, prompt_ids, state_dict_from_gguf, write_hf_dir)

CONVERTED = [name for name, family in FAMILIES.items() if family.converts]
TOL = 1e-4


def _logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return model(prompt_ids() if ids is None else ids).logits[0]


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = float((a - b).abs().max())
    assert diff <= TOL, f"{what}: logits differ by {diff:.3g}"
    assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{what}: greedy tokens differ"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_dir_loads_back_as_the_model(families, name):
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(families.hf_dir(name)), dtype=torch.float32, attn_implementation="eager"
    )
    assert type(loaded).__name__ == transformers.AutoModelForCausalLM._model_mapping[type(loaded.config)].__name__
    _assert_same(_logits(families.model(name)), _logits(loaded.eval()), f"{name} HF dir")


@pytest.mark.parametrize("name", CONVERTED)
def test_gguf_holds_the_same_model(families, name):
    """transformers' GGUF loader (given what it cannot read from the file), or for the files it cannot load at all
    (olmo2, mixtral, mistral) the converter undone by hand, builds the model of the HF directory."""
    family = FAMILIES[name]
    reference = _logits(families.model(name))
    path = families.gguf(name)
    _assert_same(reference, _logits(hf_model_via_state_dict(path, family)), f"{name} GGUF, read back by hand")
    if family.transformers_reads_gguf:
        _assert_same(reference, _logits(hf_model_from_gguf(path, family)), f"{name} GGUF, transformers' loader")


@pytest.mark.parametrize("name", CONVERTED)
def test_the_tiny_vocabulary_survives_every_format(families, name):
    """The byte-level BPE of tests/tiny.py tokenizes alike from the HF directory (transformers), from the GGUF
    (llmtrace) and from the GGUF (transformers)."""
    import gguf
    import transformers

    from llmtrace.tokens.tokenizer import TextTokenizer

    text = "The quick brown fox: café, 日本, tabs\tand  spaces\n<|im_start|>"
    path = families.gguf(name)
    expected = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(name))).encode(text)
    assert TextTokenizer.from_gguf(gguf.GGUFReader(str(path))).encode(text, add_special_tokens=False) == expected
    assert TextTokenizer.from_hf_dir(families.hf_dir(name)).encode(text, add_special_tokens=False) == expected
    if FAMILIES[name].transformers_reads_gguf:
        from_gguf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        assert from_gguf.encode(text, add_special_tokens=False) == expected


# ----------------------------------------------------------------------------------------------------------------
# each fixture shows its family's difference


@pytest.mark.parametrize("name, window, windowed_layers", [
    ("mistral", 4, "all"), ("qwen3_swa", 4, [1]), ("gemma3", 4, [0, 1, 2, 3, 4]), ("gemma2", 4, [0]),
])  # fmt: skip
def test_the_window_changes_what_later_positions_see(families, name, window, windowed_layers):
    """Without its window the model gives the same logits up to position W-1 and different ones after: PROMPT_IDS
    reaches past the window, so a reader that ignores it fails the parity tests."""
    model = families.model(name)
    layer_types = getattr(model.config, "layer_types", None)
    if windowed_layers != "all":
        assert [i for i, t in enumerate(layer_types) if t == "sliding_attention"] == windowed_layers
    assert len(PROMPT_IDS) > window + 2
    # a window wider than the prompt: the model without it
    unwindowed = hf_model_via_state_dict(families.gguf(name), FAMILIES[name], sliding_window=1000)
    a, b = _logits(model), _logits(unwindowed)
    assert float((a[:window] - b[:window]).abs().max()) <= TOL
    assert float((a[window:] - b[window:]).abs().max(-1).values.min()) > 1e-3


def test_mistral_gguf_has_no_window(families):
    """llama.cpp's converter writes Mistral as 'llama' and drops sliding_window; llama.cpp runs it without one."""
    meta = gguf_metadata(families.gguf("mistral"))
    assert meta["general.architecture"] == "llama"
    assert not [k for k in meta if "sliding" in k or "window" in k]


def test_gemma3_gguf_facts(families):
    """What the converter writes for Gemma 3 (families-gguf.md): the window, both RoPE bases, head_dim as
    key_length, no query_pre_attn_scalar and no layer pattern, norms stored as 1 + w, no output.weight."""
    path = families.gguf("gemma3")
    meta = gguf_metadata(path)
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.attention.sliding_window"] == 4
    assert meta["gemma3.rope.freq_base"] == 1_000_000.0 and meta["gemma3.rope.freq_base_swa"] == 10_000.0
    assert meta["gemma3.attention.key_length"] == meta["gemma3.attention.value_length"] == 16
    assert not [k for k in meta if "pre_attn" in k or "scalar" in k or "pattern" in k or "layer_types" in k]
    shapes = gguf_tensor_shapes(path)
    assert "output.weight" not in shapes
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.post_attention_norm.weight",
            "blk.0.ffn_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_norm.weight"} <= set(shapes)
    hf = families.model("gemma3").state_dict()
    stored = _raw_tensors(path)
    assert torch.equal(stored["blk.0.attn_q_norm.weight"], hf["model.layers.0.self_attn.q_norm.weight"] + 1)
    assert torch.equal(stored["output_norm.weight"], hf["model.norm.weight"] + 1)


def test_gemma2_gguf_writes_the_caps(families):
    meta = gguf_metadata(families.gguf("gemma2"))
    assert meta["gemma2.attn_logit_softcapping"] == 10.0 and meta["gemma2.final_logit_softcapping"] == 5.0
    assert meta["gemma2.attention.sliding_window"] == 4
    # caps of 10 and 5 bite: without them the logits change
    uncapped = hf_model_via_state_dict(families.gguf("gemma2"), FAMILIES["gemma2"], attn_logit_softcapping=None,
                                       final_logit_softcapping=None)
    assert float((_logits(families.model("gemma2")) - _logits(uncapped)).abs().max()) > 1.0


def test_llama_arch_q_k_are_permuted_the_others_are_not(families):
    for name, permuted in (("llama", True), ("mixtral", True), ("qwen3", False), ("gemma3", False), ("olmo2", False)):
        stored = _raw_tensors(families.gguf(name))["blk.0.attn_q.weight"]
        hf = families.model(name).state_dict()["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(stored, hf) is not permuted, name
        assert torch.equal(state_dict_from_gguf(families.gguf(name), families.model(name))[
            "model.layers.0.self_attn.q_proj.weight"], hf), name


def test_phi3_gguf_fuses_and_stores_longrope_factors(families):
    path = families.gguf("phi3_longrope")
    meta, shapes, stored = gguf_metadata(path), gguf_tensor_shapes(path), _raw_tensors(path)
    assert meta["phi3.rope.dimension_count"] == 8  # partial_rotary_factor 0.5 of head_dim 16
    assert meta["phi3.rope.scaling.original_context_length"] == 8 and meta["phi3.context_length"] == 64
    assert abs(meta["phi3.rope.scaling.attn_factor"] - 2 ** 0.5) < 1e-6  # sqrt(1 + ln(64/8) / ln 8)
    assert stored["rope_factors_long.weight"].tolist() == [1.0, 2.0, 3.5, 5.0]
    assert stored["rope_factors_short.weight"].tolist() == pytest.approx([1.0, 1.1, 1.3, 1.6])
    assert shapes["blk.0.attn_qkv.weight"][1] == (192, 64) and shapes["blk.0.ffn_up.weight"][1] == (256, 64)
    assert "blk.0.ffn_gate.weight" not in shapes


def test_moe_gguf_expert_tensors(families):
    """Experts are stacked 3-D [E, out, in]; the router is ffn_gate_inp [E, D]; Mixtral is arch 'llama'."""
    mixtral = families.gguf("mixtral")
    meta, shapes = gguf_metadata(mixtral), gguf_tensor_shapes(mixtral)
    assert meta["general.architecture"] == "llama" and meta["llama.expert_count"] == 4
    assert meta["llama.expert_used_count"] == 2
    assert shapes["blk.0.ffn_gate_exps.weight"][1] == (4, 96, 64)
    assert shapes["blk.0.ffn_down_exps.weight"][1] == (4, 64, 96)
    assert shapes["blk.0.ffn_gate_inp.weight"][1] == (4, 64)
    qwen = gguf_metadata(families.gguf("qwen3_moe_raw"))
    assert qwen["qwen3moe.expert_count"] == 8 and qwen["qwen3moe.expert_feed_forward_length"] == 32
    assert not [k for k in qwen if "norm_topk" in k or "weights_norm" in k]  # norm_topk_prob is not written


def test_qwen3_moe_raw_weights_are_not_renormalised(families):
    """norm_topk_prob false matters: the same weights renormalised give other logits (what llama.cpp computes
    from this file, which cannot say false)."""
    renormalised = hf_model_via_state_dict(families.gguf("qwen3_moe_raw"), FAMILIES["qwen3_moe_raw"],
                                           norm_topk_prob=True)
    assert float((_logits(families.model("qwen3_moe_raw")) - _logits(renormalised)).abs().max()) > 1e-2


def test_qwen3_moe_dense_layer_is_hf_only(families, tmp_path):
    """mlp_only_layers makes layer 1 a dense SwiGLU; llama.cpp's converter cannot write that into a qwen3moe file."""
    model = families.model("qwen3_moe_dense")
    assert type(model.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    assert hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.model.layers[2].mlp, "experts")
    with pytest.raises(ValueError, match="Can not map tensor 'model.layers.1.mlp"):
        convert_to_gguf(families.hf_dir("qwen3_moe_dense"), tmp_path / "dense.gguf")


def test_gemma3_has_five_local_layers_to_one_global(families):
    config = families.model("gemma3").config
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.query_pre_attn_scalar != config.head_dim


def _raw_tensors(path) -> dict[str, torch.Tensor]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    return {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float() for t in reader.tensors}


def test_write_hf_dir_is_deterministic(tmp_path):
    """Fixed seeds: two builds of one family hold the same weights (the lead's tests can rebuild them)."""
    a = write_hf_dir(tmp_path / "a", FAMILIES["olmo2"])
    b = write_hf_dir(tmp_path / "b", FAMILIES["olmo2"])
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
