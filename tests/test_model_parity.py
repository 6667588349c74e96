"""llmtrace's forward pass against transformers on tiny random HF checkpoints (safetensors on disk).

Each case writes an HF directory with random weights (tests/tiny.py), loads it with `llmtrace.checkpoint.load.load_model` as a
user would, and compares the logits of every position, and the residual stream after every layer, with the
transformers model that holds the same weights (float32, eager attention). Cases: GQA and MHA and MQA, tied and untied
LM heads, default / linear / llama3 RoPE, head width != D/H, Mistral, Qwen2 (q/k/v bias), and a sharded checkpoint.
"""

import json

import pytest
import torch

from llmtrace.checkpoint.load import load_model
from tiny import PROMPT, TinySpec, token_ids, tiny_tokenizer, write_hf_dir

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip  # with Dh=16 the 8 wavelengths fall in all 3 bands

CASES = {
    "llama-gqa": TinySpec(),
    "llama-mha-tied": TinySpec(n_kv_heads=4, tie=True, seed=1),
    "llama-llama3-rope": TinySpec(rope_scaling=LLAMA3, rope_theta=500000.0, seed=2),
    "llama-linear-rope": TinySpec(rope_scaling={"rope_type": "linear", "factor": 4.0}, seed=3),
    "mistral-wide-heads": TinySpec(arch="mistral", head_dim=32, seed=4),  # H*Dh = 128 != D = 64
    "qwen2-mqa-bias": TinySpec(arch="qwen2", n_kv_heads=1, tie=True, seed=5),
}
T = 48  # positions compared; long enough that the RoPE scaling bands matter


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(spec, transformers model, llmtrace LoadedModel) for one case, written to disk and loaded back."""
    spec = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = write_hf_dir(path, spec)
    lm = load_model(str(path), device="cpu", dtype="float32")
    return spec, hf, lm


@torch.no_grad()
def test_logits_match_transformers(case):
    spec, hf, lm = case
    idx = token_ids(T, seed=spec.seed)
    ref = hf(idx).logits  # (1, T, V)
    with lm.model.hooked(lambda layer, name, x: None):  # attention spelled out, in transformers' eager order
        ours = lm.model(idx)
    assert ours.shape == (1, T, spec.vocab_size)
    assert ref.std() > 0.5  # the random weights give logits far from zero, so a match means something
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    # the fused kernel (unobserved layers) sums in another order: float32 rounding, grown through these large weights
    # to a few 1e-5, so it is held to the project's bound
    fused = lm.model(idx)
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
    # the last-position shortcut used by generation is the same row
    torch.testing.assert_close(lm.model(idx, last_only=True), fused[:, -1], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_hidden_states_match_transformers(case):
    spec, hf, lm = case
    idx = token_ids(T, seed=spec.seed + 10)
    ref = hf(idx, output_hidden_states=True).hidden_states  # L+1; transformers' last one is after the final norm
    ours = []  # the residual stream before layer 0 and after every layer: L+1 tensors of (1, T, D)
    grab = lambda layer, name, x: ours.append(x) if name in ("embed", "resid_post") else None  # noqa: E731
    with lm.model.hooked(grab, attention=[]):
        lm.model(idx)
    assert len(ours) == len(ref) == spec.n_layers + 1
    # The residual stream grows to |x| ~ 25, where one float32 ulp is 2e-6: allow a few ulps of summation order.
    for layer, (a, b) in enumerate(zip(ours[:-1], ref[:-1])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6, msg=lambda m: f"residual before layer {layer}: {m}")
    torch.testing.assert_close(lm.model.norm(ours[-1]), ref[-1], atol=1e-5, rtol=1e-6)
    assert (ours[-1] - ref[-1]).abs().max() > 1e-2  # ours is the raw residual stream, before the final norm


def test_config_read_from_config_json(case):
    spec, hf, lm = case
    c = lm.config
    assert c.arch == spec.arch
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads) == (spec.n_layers, spec.d_model, spec.n_heads,
                                                              spec.n_kv_heads)
    assert c.head_dim == (spec.head_dim or spec.d_model // spec.n_heads)
    assert c.tie_embeddings == spec.tie
    assert c.attn_bias == (spec.arch == "qwen2")
    assert (c.rope_scaling or {}).get("rope_type") == (spec.rope_scaling or {}).get("rope_type")
    assert lm.source == "hf" and lm.dtype == torch.float32
    if spec.tie:  # one matrix, not a copy
        assert lm.model.lm_head.weight.data_ptr() == lm.model.embed.weight.data_ptr()
    else:
        assert lm.model.lm_head.weight.data_ptr() != lm.model.embed.weight.data_ptr()


@torch.no_grad()
def test_rope_scaling_is_not_a_no_op(tmp_path):
    """The llama3 case above would pass vacuously if scaling changed nothing at these positions: check it does."""
    spec = CASES["llama-llama3-rope"]
    write_hf_dir(tmp_path / "scaled", spec)
    write_hf_dir(tmp_path / "plain", TinySpec(**{**spec.__dict__, "rope_scaling": None}))  # same seed, same weights
    scaled = load_model(str(tmp_path / "scaled"), device="cpu", dtype="float32")
    plain = load_model(str(tmp_path / "plain"), device="cpu", dtype="float32")
    idx = token_ids(T, seed=7)
    a, b = scaled.model(idx), plain.model(idx)
    torch.testing.assert_close(a[:, 0], b[:, 0], atol=1e-5, rtol=1e-4)  # position 0: no rotation either way
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-2


@torch.no_grad()
def test_sharded_checkpoint(tmp_path):
    """model.safetensors.index.json + several shards load to the same logits."""
    spec = TinySpec(seed=11)
    hf = write_hf_dir(tmp_path, spec, shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    lm = load_model(str(tmp_path), device="cpu", dtype="float32")
    idx = token_ids(T, seed=12)
    torch.testing.assert_close(lm.model(idx), hf(idx).logits, atol=1e-5, rtol=1e-4)


def test_tokenizer_read_from_the_directory(case):
    spec, hf, lm = case
    ref = tiny_tokenizer(spec.vocab_size)
    ids = lm.tokenizer.encode(PROMPT)
    assert ids == ref.encode(PROMPT).ids
    assert len(ids) < len(PROMPT.encode())  # merges were applied, not only bytes
    assert lm.tokenizer.decode(ids) == PROMPT
    assert lm.tokenizer.bos_id == 1 and 2 in lm.tokenizer.eos_ids
