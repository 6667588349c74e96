"""GGUF files written the way llama.cpp's converter writes them: metadata, a gpt2 tokenizer, q/k rows in llama.cpp's
interleaved order, tensors quantized with the gguf package (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16, F32).

References: transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`), `gguf.quants.dequantize`, and,
for a float32 file, the transformers model the file was written from.
"""

import numpy as np
import pytest
import torch

from llmtrace.checkpoint.gguf_file import open_gguf
from llmtrace.checkpoint.gguf_checkpoint import config_from_gguf, read_gguf_weights
from llmtrace.checkpoint.load import load_model
from tiny import (PROMPT, TinySpec, gguf_tensors, llama3_rope_freqs, make_hf_model, permute_rope_rows, tiny_tokenizer,
                  token_ids, write_gguf)

# Every type gguf.quants can write in numpy (the K-quants and IQ types it can only read).
WRITABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
T = 40

pytestmark = pytest.mark.usefixtures("fresh_home")  # GGUF conversions are cached: each test gets an empty cache


def hf_from_gguf(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def uniform(kind):
    """A quantization plan: every matrix as `kind`, vectors (norms) F32."""
    return lambda name, a: None if a.ndim == 1 or kind == "F32" else kind


@pytest.fixture(scope="module")
def gqa_model():
    return make_hf_model(TinySpec(seed=20))


@torch.no_grad()
def test_mixed_quantization_matches_transformers(tmp_path, gqa_model):
    """One file holding every writable type (tiny.mixed_plan); untied LM head (output.weight, Q4_1)."""
    path = tmp_path / "tiny-mixed.gguf"
    written = write_gguf(path, gqa_model)
    assert {kind for kind, _ in written.values()} == set(WRITABLE)
    lm = load_model(str(path), device="cpu", dtype="float32")
    assert lm.source == "gguf" and lm.converted
    idx = token_ids(T, seed=21)
    ref = hf_from_gguf(path)(idx).logits
    ours = lm.model(idx)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # quantization really happened: the file's model is measurably not the float32 one it was made from
    assert (ours - gqa_model(idx).logits).abs().max() > 1e-3


@pytest.mark.parametrize("kind", WRITABLE)
@torch.no_grad()
def test_each_type_matches_transformers(tmp_path, gqa_model, kind):
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(path, gqa_model, plan=uniform(kind))
    lm = load_model(str(path), device="cpu", dtype="float32")
    idx = token_ids(T, seed=22)
    torch.testing.assert_close(lm.model(idx), hf_from_gguf(path)(idx).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", WRITABLE)
def test_dequantized_values_are_the_gguf_packages(tmp_path, gqa_model, kind):
    """Every tensor read_gguf_weights returns equals gguf.quants.dequantize of what was written, bit for bit, with
    q/k rows put back in HF order (the inverse of llama.cpp's permutation, computed here from an index array)."""
    path = tmp_path / f"tiny-{kind}.gguf"
    written = write_gguf(path, gqa_model, plan=uniform(kind))
    reader = open_gguf(path)
    config = config_from_gguf(reader, str(path))
    ours = read_gguf_weights(reader, config, str(path))  # under the file's own names
    assert len(ours) == len(written)
    originals = gguf_tensors(gqa_model)  # float32, file row order
    for gname, (wkind, values) in written.items():
        name = gname
        expected = values
        heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}.get(gname.split(".")[-2])
        if heads is not None:
            order = permute_rope_rows(np.arange(values.shape[0]), heads)  # file row r holds HF row order[r]
            expected = np.empty_like(values)
            expected[order] = values
            assert not np.array_equal(order, np.arange(values.shape[0]))
        assert wkind == ("F32" if values.ndim == 1 else kind)
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=f"{gname} ({wkind})")
        if values.ndim == 2 and kind != "F32":  # the file really holds the lossy format, not the float32 source
            assert not np.array_equal(values, originals[gname])


@torch.no_grad()
def test_tied_mha_gguf(tmp_path):
    """No output.weight in the file: the LM head is the embedding (transformers decides the same way)."""
    hf = make_hf_model(TinySpec(n_kv_heads=4, tie=True, seed=23))
    path = tmp_path / "tiny-tied.gguf"
    written = write_gguf(path, hf)
    assert "output.weight" not in written
    lm = load_model(str(path), device="cpu", dtype="float32")
    assert lm.config.tie_embeddings and lm.config.n_kv_heads == 4
    assert lm.model.lm_head.weight.data_ptr() == lm.model.embed.weight.data_ptr()
    idx = token_ids(T, seed=24)
    torch.testing.assert_close(lm.model(idx), hf_from_gguf(path)(idx).logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_float32_gguf_equals_the_source_model_with_llama3_rope_freqs(tmp_path):
    """A float32 GGUF with llama3 scaling stored as llama.cpp stores it (rope_freqs.weight, one divisor per
    frequency) gives the logits of the HF model it was written from, whose config has rope_type llama3."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    hf = make_hf_model(TinySpec(rope_scaling=scaling, seed=25))
    freqs = llama3_rope_freqs(hf.config.head_dim, hf.config.rope_parameters["rope_theta"], scaling)
    assert 1.0 in freqs and 8.0 in freqs and ((freqs > 1) & (freqs < 8)).any()  # all three bands are exercised
    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(path, hf, plan=uniform("F32"), rope_freqs=freqs)
    lm = load_model(str(path), device="cpu", dtype="float32")
    assert lm.config.rope_scaling["rope_type"] == "freq_factors"
    idx = token_ids(T, seed=26)
    torch.testing.assert_close(lm.model(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_conversion_is_cached(tmp_path, gqa_model):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, gqa_model)
    first = load_model(str(path), device="cpu", dtype="float32")
    second = load_model(str(path), device="cpu", dtype="float32")
    assert first.converted and not second.converted
    idx = token_ids(T, seed=27)
    assert torch.equal(first.model(idx), second.model(idx))
    assert second.config == first.config
    assert second.tokenizer.encode(PROMPT) == first.tokenizer.encode(PROMPT)


def test_gguf_metadata_and_tokenizer(tmp_path, gqa_model):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, gqa_model)
    lm = load_model(str(path), device="cpu", dtype="float32")
    c = lm.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == (
        "llama", 2, 64, 4, 2, 16, 128, 320)
    assert c.max_seq_len == 128 and c.rope_theta == 10000.0 and not c.tie_embeddings
    assert abs(c.rms_eps - 1e-5) < 1e-10
    # the gpt2-style vocabulary in the GGUF tokenizes like the tokenizer.json it was made from
    ref = tiny_tokenizer()
    assert lm.tokenizer.encode(PROMPT) == ref.encode(PROMPT).ids
    assert lm.tokenizer.decode(ref.encode(PROMPT).ids) == PROMPT
    assert lm.tokenizer.bos_id == 1 and lm.tokenizer.eos_ids[:1] == [2]
    assert lm.tokenizer.encode("<|im_start|>hi", add_special_tokens=False)[0] == 1
