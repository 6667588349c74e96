"""The model's declarations (model/points.py) against the model itself: the points each family's forward pass reports
are the ones it declares, in that order; the weights it declares are its parameters, with their shapes; a trace
carries the declaration, and a trace written before it did is read with Llama's."""

import json
import pytest
import torch

from llmtrace.model.family import families
from llmtrace.model.llama_points import llama_points
from llmtrace.model.transformer import ModelConfig, Transformer

TINY = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=64, max_seq_len=64,
            layer_types=["linear", "conv"])  # read by the hybrid families only: Qwen3.5 "linear", LFM2 "conv"
EXPERTS = {"experts": dict(n=4, k=2, width=24)}  # the experts' config part: read by the mixture-of-experts families only
# the config parts of a family's kinds (ModelConfig.parts), given to that family only: their axis names are the
# kind's own (MLA's Dv is its value head width, not linear attention's)
PARTS = {"deepseek": dict(mla=dict(q_lora_rank=16, kv_lora_rank=12, nope=8, rope=4, v=6, scale=12 ** -0.5,
                                   axes=dict(Rq=16, R=12, Dn=8, Dr=4, Dq=12, Dv=6)),
                          router=dict(score="sigmoid", choice_bias=True, groups=2, groups_used=1, scale=2.0),
                          shared_experts=dict(n=1, axes=dict(Fs=24))),
         # Gemma 4: 4 per-layer input numbers a layer, layer 1 reading layer 0's keys and values
         "gemma4": {"per_layer_input": {"width": 4}, "shared_kv": {"reads": [None, 0]}},
         # Qwen3.5: its linear-attention layer's sizes
         "qwen3_5": {"linear_attention": dict(k_heads=2, v_heads=4, k_dim=8, v_dim=4, conv_kernel=4, v_order="grouped",
                                              axes=dict(Hk=2, Hv=4, Dk=8, Dv=4, Kc=4, C=48))}}


def tiny_model(family) -> Transformer:
    torch.manual_seed(0)
    return family.model(ModelConfig(family=family.name, parts=EXPERTS | PARTS.get(family.name, {}), **TINY)).eval()


def test_the_legacy_declaration_is_llamas():
    assert llama_points() == Transformer.declared_points()


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
@torch.no_grad()
def test_the_forward_pass_reports_what_it_declares_in_order(family):
    model = tiny_model(family)
    seen = []
    with model.hooked(lambda layer, name, x: seen.append((layer, name)), layers=[0, 1]):
        model(torch.tensor([[1, 2, 3, 4, 5]]), model.new_cache(8), 0, last_only=True)
    points, maths = model.declared_points(), model.maths()
    for layer in (0, 1):  # each layer reports the declared points its maths has (a hybrid's layer: its kind's)
        layer_seen = [n for lay, n in seen if lay == layer]
        assert layer_seen == [n for n in points.names(layer=True) if n in maths.layers[layer]]
    if len({plan.attention for plan in maths.plan}) == 1 and not model.config.n_experts:
        assert [n for lay, n in seen if lay == 1] == list(points.names(layer=True))  # one kind: every point
    assert [n for lay, n in seen if lay is None] == list(points.names(layer=False))


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_declared_weights_are_the_parameters(family):
    model = tiny_model(family)
    params = dict(model.named_parameters())
    declared = {w.param: w.shape for w in model.declared_weights()}
    assert declared == {name: tuple(p.shape) for name, p in params.items()}
    for w in model.declared_weights():  # the sources stack into the parameter
        assert sum(s.rows for s in w.sources) == w.shape[0], w.param
        assert all(s.hf and s.gguf for s in w.sources), w.param


@torch.no_grad()
def test_a_hook_may_replace_only_an_editable_point():
    model = tiny_model(families()[0])
    idx = torch.tensor([[1, 2, 3]])
    with model.hooked(lambda layer, name, x: x * 0 if name == "q_rope" else None, layers=[0]):
        with pytest.raises(ValueError, match="not editable"):
            model(idx)
    with model.hooked(lambda layer, name, x: x * 0 if name == "resid_post" else None, layers=[1]):
        assert torch.equal(model(idx)[0, :, :], model.head(torch.zeros(1, 3, TINY["d_model"]))[0])


def test_a_cached_conversion_written_before_config_parts_still_loads():
    """A GGUF conversion cached by an older llmtrace keeps the fields that are now a kind's config part
    (ModelConfig.parts): they move into their part rather than fail the load (and discard the cache)."""
    from dataclasses import asdict

    from llmtrace.checkpoint.conversion import _config_from_json, _config_to_json

    old = asdict(ModelConfig()) | {"attn_softcap": 50.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
    c = _config_from_json(json.dumps(old))
    assert c.parts == {"softcap": {"cap": 50.0}, "glu_clamp": {"alpha": 1.702, "limit": 7.0}}
    assert _config_from_json(_config_to_json(c)) == c  # and a new one reads back as written
    assert _config_from_json(json.dumps(asdict(ModelConfig()) | {"attn_softcap": None})).parts == {}


def test_a_cached_conversion_of_experts_still_loads():
    """A conversion cached when a mixture of experts' numbers were ModelConfig fields (n_experts, ...) reads them into
    the experts' config part, which its declaration (model.moe) reads; a dense model's old fields (0 experts,
    renormalise true) say nothing and make no part."""
    from dataclasses import asdict

    from llmtrace.checkpoint.conversion import _config_from_json, _config_to_json

    fields = {"n_experts": 8, "n_experts_used": 2, "expert_ffn_dim": 96, "norm_topk_prob": False, "dense_layers": [0]}
    c = _config_from_json(json.dumps(asdict(ModelConfig()) | fields))
    assert c.parts == {"experts": {"n": 8, "k": 2, "width": 96, "renormalise": False, "dense_layers": [0]}}
    assert (c.n_experts, c.n_experts_used, c.expert_ffn_dim, c.norm_topk_prob, c.dense_layers) == (8, 2, 96, False, [0])
    assert _config_from_json(_config_to_json(c)) == c
    dense = {"n_experts": 0, "n_experts_used": 0, "expert_ffn_dim": None, "norm_topk_prob": True, "dense_layers": None}
    assert _config_from_json(json.dumps(asdict(ModelConfig()) | dense)).parts == {}
