"""The KV cache: a prefill plus one-token decode steps must give, at every step, the logits a full recompute of the
whole sequence gives. Also: chunked prefill (a prompt fed in pieces at start > 0), what the cache holds, and the
spelled-out (eager) attention against the fused SDPA kernel, with and without the cache.
"""

import contextlib

import pytest
import torch

from llmtrace.loader import load_model
from tiny import TinySpec, token_ids, write_hf_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv")
    write_hf_dir(path, TinySpec(seed=30))  # GQA: 4 query heads over 2 KV heads
    return load_model(str(path), device="cpu", dtype="float32")


@contextlib.contextmanager
def attention(model, eager: bool):
    """Switch every layer to the eager or the SDPA path for the duration (the fixtures are shared)."""
    saved = [b.attn.eager for b in model.layers]
    for b in model.layers:
        b.attn.eager = eager
    try:
        yield
    finally:
        for b, e in zip(model.layers, saved):
            b.attn.eager = e


@contextlib.contextmanager
def no_cache(model):
    saved, model.cache = model.cache, None
    try:
        yield
    finally:
        model.cache = saved


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of the last position, recomputed from scratch over the whole sequence, no cache."""
    with no_cache(model):
        return model(torch.tensor([ids]))[0, -1]


@torch.no_grad()
def decode_vs_recompute(model, prompt: list[int], steps: int, per_step: bool = True) -> tuple[list[int], float]:
    """Greedy decode with the cache and compare the logits of every step with a recompute without cache.
    per_step=True recomputes the whole sequence from scratch after every step; per_step=False runs one cache-free
    forward over the final sequence and takes its rows (row t of a causal forward is the recompute of ids[:t+1]),
    which is the same check at a fraction of the cost for the real model. Returns (new tokens, max abs diff)."""
    saved = model.cache
    model.setup_cache(len(prompt) + steps)
    ids = list(prompt)
    cached = []
    try:
        logits = model(torch.tensor([prompt]), start=0, last_only=True)[0]  # prefill
        for step in range(steps):
            cached.append(logits)
            token = int(logits.argmax())
            ids.append(token)
            logits = model(torch.tensor([[token]]), start=len(ids) - 1, last_only=True)[0]  # decode one token
            assert model.cache.seq_len == len(ids)
    finally:
        model.cache = saved  # the model fixtures are shared between tests
    if per_step:
        recomputed = [full_logits(model, ids[: len(prompt) + s]) for s in range(steps)]
    else:
        with no_cache(model):
            rows = model(torch.tensor([ids]))[0]  # (len(ids), V)
        recomputed = [rows[len(prompt) - 1 + s] for s in range(steps)]
    worst = 0.0
    for step, (a, b) in enumerate(zip(cached, recomputed)):
        worst = max(worst, float((a - b).abs().max()))
        assert int(a.argmax()) == int(b.argmax()), f"step {step}: cached and recomputed argmax differ"
    return ids[len(prompt):], worst


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "sdpa"])
def test_decode_equals_full_recompute_tiny(tiny, eager):
    prompt = token_ids(12, seed=31)[0].tolist()
    with attention(tiny.model, eager):
        tokens, worst = decode_vs_recompute(tiny.model, prompt, steps=16)
    assert worst <= 1e-5, worst
    assert len(set(tokens)) > 1  # a degenerate model repeating one token would hide position bugs


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "sdpa"])
@torch.no_grad()
def test_chunked_prefill(tiny, eager):
    """Prompt fed as 5 + 5 + 5 + 3 tokens (the causal mask offset by `start`) equals one full forward."""
    model = tiny.model
    idx = token_ids(18, seed=32)
    with attention(model, eager):
        with no_cache(model):
            ref = model(idx)  # (1, 18, V)
        with no_cache(model):
            model.setup_cache(32)
            parts = [model(idx[:, s : s + 5], start=s) for s in range(0, 18, 5)]
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, atol=1e-5, rtol=0)


@torch.no_grad()
def test_cache_contents(tiny):
    """After a prefill of T tokens, positions [0, T) hold the keys and values, later ones are untouched zeros."""
    model, c = tiny.model, tiny.config
    with no_cache(model):
        cache = model.setup_cache(20)
        model(token_ids(7, seed=33))
    assert cache.seq_len == 7
    assert len(cache.layers) == c.n_layers
    k = torch.stack([kv.k for kv in cache.layers])  # (L, B, Hkv, S_max, Dh)
    v = torch.stack([kv.v for kv in cache.layers])
    assert k.shape == v.shape == (c.n_layers, 1, c.n_kv_heads, 20, c.head_dim)
    assert k[:, :, :, :7].abs().amax(dim=-1).gt(0).all()  # every layer, head and position written
    assert v[:, :, :, :7].abs().amax(dim=-1).gt(0).all()
    assert k[:, :, :, 7:].eq(0).all() and v[:, :, :, 7:].eq(0).all()
    assert cache.bytes_per_token == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    assert cache.bytes_allocated == 20 * cache.bytes_per_token


@torch.no_grad()
def test_eager_equals_sdpa_tiny(tiny):
    idx = token_ids(40, seed=34)
    with no_cache(tiny.model):
        with attention(tiny.model, True):
            a = tiny.model(idx)
        with attention(tiny.model, False):
            b = tiny.model(idx)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cpu_load_defaults_to_eager(tiny):
    assert all(b.attn.eager for b in tiny.model.layers)


# ----------------------------------------------------------------------------------------------------------------
# the real SmolLM2


@torch.no_grad()
def test_decode_equals_full_recompute_smollm(smollm):
    prompt = smollm.tokenizer.encode("The three primary colors are")
    tokens, worst = decode_vs_recompute(smollm.model, prompt, steps=8, per_step=False)
    assert worst <= 1e-4, worst
    assert len(set(tokens)) > 1


@torch.no_grad()
def test_eager_equals_sdpa_smollm(smollm):
    ids = smollm.tokenizer.encode("A KV cache stores the keys and values of earlier positions so that")
    model = smollm.model
    with no_cache(model):
        with attention(model, True):
            a = model(torch.tensor([ids]))
        with attention(model, False):
            b = model(torch.tensor([ids]))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # and the SDPA path through the cache: prefill then 4 single-token steps
    with attention(model, False):
        _, worst = decode_vs_recompute(model, ids, steps=4, per_step=False)
    assert worst <= 1e-4, worst
