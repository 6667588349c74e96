"""OLMo 2 (model/families/olmo2.py) on the tiny checkpoint of tests/families.py, against transformers: from the HF
directory and from the GGUF llama.cpp's converter writes from it (which transformers cannot load: the reference is
the converter undone by hand, families.hf_model_via_state_dict), prompt ids identical, fp32 logits within 8x their
own float32 error at every position, greedy tokens identical through the KV cache; its norms are points of the trace
where the maths has them."""

import pytest
import torch

from families import FAMILIES, PROMPT_IDS, hf_model_via_state_dict, prompt_ids
from helpers import fails, logits_tol

PROMPT = "The quick brown fox"
N_NEW = 8


@pytest.fixture(scope="module")
def olmo(loaded):
    """The OLMo 2 fixture loaded from its HF directory or GGUF: olmo("hf" | "gguf")."""
    return lambda fmt: loaded("olmo2", fmt)


@pytest.fixture(scope="module")
def reference(families):
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            cache[fmt] = families.model("olmo2") if fmt == "hf" else hf_model_via_state_dict(families.gguf("olmo2"),
                                                                                              FAMILIES["olmo2"])
        return cache[fmt]

    return get


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_equal_transformers(olmo, reference, fmt):
    lm, ref = olmo(fmt), reference(fmt)
    assert lm.config.family == "olmo2" and lm.config.head_dim == 16
    with torch.no_grad():
        ours, theirs = lm.model(prompt_ids())[0], ref(prompt_ids()).logits[0]
    diff, tol = float((ours - theirs).abs().max()), logits_tol(lm, PROMPT_IDS)  # 8x the pass's float32 error
    assert diff <= tol, f"olmo2 {fmt}: logits differ by {diff:.3g}, over {tol:.3g}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_prompt_ids_and_greedy_tokens_equal_transformers(families, olmo, reference, fmt):
    import transformers

    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    lm, ref = olmo(fmt), reference(fmt)
    ids = lm.tokenizer.encode(PROMPT)
    assert ids == transformers.AutoTokenizer.from_pretrained(str(families.hf_dir("olmo2"))).encode(PROMPT)
    ours = list(generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), N_NEW, (), True,
                         None).tokens)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    assert ours == theirs[0, len(ids):].tolist()


def test_the_gguf_has_post_norms_and_whole_width_q_k_norms(families):
    from families import gguf_tensor_shapes

    shapes = gguf_tensor_shapes(families.gguf("olmo2"))
    assert shapes["blk.0.attn_q_norm.weight"][1] == (64,) and shapes["blk.0.attn_k_norm.weight"][1] == (64,)
    assert "blk.0.post_attention_norm.weight" in shapes and "blk.0.post_ffw_norm.weight" in shapes
    assert "blk.0.attn_norm.weight" not in shapes and "blk.0.ffn_norm.weight" not in shapes


def test_what_olmo2_changes_is_said_with_its_numbers(olmo):
    from llmtrace.model.family import describe_changes

    said = describe_changes(olmo("gguf").config)
    assert said == ["q/k RMSNorm over the whole projection (width 64 for q, 64 for k), before the split into heads",
                    "no norm before attention: the stream goes in as it is; attention's output is RMS-normed, then added",
                    "no norm before the feed-forward: its output is RMS-normed, then added"]


def test_olmo2s_norms_are_points_of_the_trace(families):
    """q_norm and k_norm over the whole width (T, H*Dh) between the projection and RoPE; post_attn_norm at s6.6 and
    post_ffn_norm at s6.7 before their residual adds; no attn_norm or ffn_norm."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("olmo2")), device="cpu")
    run = model.generate(PROMPT, max_new_tokens=1, trace="full")
    shapes = [p for p in next(e for e in run.events if e["event"] == "shapes")["points"] if p["layer"] == 0]
    names = [p["name"] for p in shapes]
    assert "attn_norm" not in names and "ffn_norm" not in names
    assert names.index("v") < names.index("q_norm") < names.index("k_norm") < names.index("q_rope")
    assert names.index("o_proj") < names.index("post_attn_norm") < names.index("resid_mid")
    assert names.index("down") < names.index("post_ffn_norm") < names.index("resid_post")
    by = {p["name"]: p for p in shapes}
    assert by["q_norm"]["axes"] == ["T", "H*Dh"] and by["q_norm"]["shape"][1] == 64
    assert by["k_norm"]["axes"] == ["T", "Hkv*Dh"]
    assert by["post_attn_norm"]["seed_step"] == "s6.6" and by["post_ffn_norm"]["seed_step"] == "s6.7"


@torch.no_grad()
def test_the_points_are_the_maths(olmo, reference):
    """What the points hold is transformers' OLMo 2, step by step: q_norm is q_norm(q_proj(x)) over the whole width,
    post_attn_norm the normed attention output, resid_mid the stream plus it."""
    lm, ref = olmo("hf"), reference("hf")
    seen = {}
    with lm.model.hooked(lambda layer, name, x: seen.__setitem__(name, x.clone()), layers=[0]):
        lm.model(prompt_ids())
    x = ref.model.embed_tokens(prompt_ids())
    attn = ref.model.layers[0].self_attn
    assert torch.allclose(seen["q_norm"], attn.q_norm(attn.q_proj(x)), atol=1e-5)
    assert torch.allclose(seen["k_norm"], attn.k_norm(attn.k_proj(x)), atol=1e-5)
    assert torch.allclose(seen["post_attn_norm"], ref.model.layers[0].post_attention_layernorm(seen["o_proj"]),
                          atol=1e-5)
    assert torch.equal(seen["resid_mid"], seen["resid_pre"] + seen["post_attn_norm"])
    assert torch.equal(seen["resid_post"], seen["resid_mid"] + seen["post_ffn_norm"])


def test_attention_bias_is_refused_by_field(capsys, families, tmp_path):
    import json
    import shutil

    d = tmp_path / "olmo2"
    shutil.copytree(families.hf_dir("olmo2"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"attention_bias": True}))
    fails(capsys, 1, "generate", "hi", "-m", d, "-n", "1", says=("attention_bias True is not supported",))

