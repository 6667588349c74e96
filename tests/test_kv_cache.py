"""The KV cache: a prefill plus one-token decode steps must give, at every step, the logits a full recompute of the
whole sequence gives. Also: chunked prefill (a prompt fed in pieces at start > 0), what the cache holds, the
spelled-out attention of an observed layer against the fused SDPA kernel, and rows side by side (B > 1), padded on the
left with an attention mask and per-row positions, as a batch of prompts will be.
"""

import contextlib

import pytest
import torch

from llmtrace.run.generate import prefill
from llmtrace.checkpoint.load import load_model
from tiny import TinySpec, token_ids, write_hf_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv")
    write_hf_dir(path, TinySpec(seed=30))  # GQA: 4 query heads over 2 KV heads
    return load_model(str(path), device="cpu", dtype="float32")


def attention(model, spelled_out: bool):
    """Observed layers spell attention out (scores, softmax, P·V); unobserved ones use the fused SDPA kernel."""
    return model.hooked(lambda layer, name, x: None) if spelled_out else contextlib.nullcontext()


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of the last position, recomputed from scratch over the whole sequence, no cache."""
    return model(torch.tensor([ids]))[0, -1]


@torch.no_grad()
def decode_vs_recompute(model, prompt: list[int], steps: int, per_step: bool = True) -> tuple[list[int], float]:
    """Greedy decode with the cache and compare the logits of every step with a recompute without cache.
    per_step=True recomputes the whole sequence from scratch after every step; per_step=False runs one cache-free
    forward over the final sequence and takes its rows (row t of a causal forward is the recompute of ids[:t+1]),
    which is the same check at a fraction of the cost for the real model. Returns (new tokens, max abs diff)."""
    cache = model.new_cache(len(prompt) + steps)
    ids = list(prompt)
    cached = []
    logits = model(torch.tensor([prompt]), cache, 0, last_only=True)[0]  # prefill
    for step in range(steps):
        cached.append(logits)
        token = int(logits.argmax())
        ids.append(token)
        logits = model(torch.tensor([[token]]), cache, len(ids) - 1, last_only=True)[0]  # decode one token
        assert cache.seq_len == len(ids)
    if per_step:
        recomputed = [full_logits(model, ids[: len(prompt) + s]) for s in range(steps)]
    else:
        rows = model(torch.tensor([ids]))[0]  # (len(ids), V)
        recomputed = [rows[len(prompt) - 1 + s] for s in range(steps)]
    worst = 0.0
    for step, (a, b) in enumerate(zip(cached, recomputed)):
        worst = max(worst, float((a - b).abs().max()))
        assert int(a.argmax()) == int(b.argmax()), f"step {step}: cached and recomputed argmax differ"
    return ids[len(prompt):], worst


@pytest.mark.parametrize("spelled_out", [True, False], ids=["eager", "sdpa"])
def test_decode_equals_full_recompute_tiny(tiny, spelled_out):
    prompt = token_ids(12, seed=31)[0].tolist()
    with attention(tiny.model, spelled_out):
        tokens, worst = decode_vs_recompute(tiny.model, prompt, steps=16)
    assert worst <= 1e-5, worst
    assert len(set(tokens)) > 1  # a degenerate model repeating one token would hide position bugs


@pytest.mark.parametrize("spelled_out", [True, False], ids=["eager", "sdpa"])
@torch.no_grad()
def test_chunked_prefill(tiny, spelled_out):
    """Prompt fed as 5 + 5 + 5 + 3 tokens (the causal mask offset by `start`) equals one full forward."""
    model = tiny.model
    idx = token_ids(18, seed=32)
    with attention(model, spelled_out):
        ref = model(idx)  # (1, 18, V)
        cache = model.new_cache(32)
        parts = [model(idx[:, s : s + 5], cache, s) for s in range(0, 18, 5)]
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_generation_prefill_in_chunks_observes_the_last_chunk(tiny):
    """generate's prefill: a prompt longer than a chunk runs in passes; only the last is observed, its logits are the
    full forward's last row, and progress is reported after each pass."""
    model = tiny.model
    idx = token_ids(23, seed=36)
    seen, progress = [], []
    cache = model.new_cache(23)
    logits = prefill(model, idx, cache, lambda: model.hooked(lambda lay, name, x: seen.append((name, x.shape))),
                     on_progress=lambda done, total: progress.append((done, total)), chunk=8)
    torch.testing.assert_close(logits, model(idx)[:, -1], atol=1e-5, rtol=1e-4)
    assert cache.seq_len == 23
    assert progress == [(8, 23), (16, 23), (23, 23)]
    scores = [shape for name, shape in seen if name == "scores"]
    assert scores and all(s == (1, tiny.config.n_heads, 7, 23) for s in scores)  # the last pass: 7 queries, 23 keys
    assert all(b.attn.hook is None for b in model.layers)  # the scope closed


@torch.no_grad()
def test_cache_contents(tiny):
    """After a prefill of T tokens, positions [0, T) hold the keys and values, later ones are untouched zeros."""
    model, c = tiny.model, tiny.config
    cache = model.new_cache(20)
    model(token_ids(7, seed=33), cache)
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
    with attention(tiny.model, True):
        a = tiny.model(idx)
    b = tiny.model(idx)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_observed_scope_spells_out_the_chosen_layers_and_restores(tiny):
    """`observed` reports only the chosen layers (their attention spelled out: k_repeated, each KV head expanded for
    its G query heads as repeat_kv does) and leaves every observer as it was; a pass without it reports nothing."""
    model, c = tiny.model, tiny.config
    seen = []
    with model.hooked(lambda lay, name, x: seen.append((lay, name, tuple(x.shape))), layers=[1]):
        model(token_ids(6, seed=35))
    assert {lay for lay, _, _ in seen} == {None, 1}
    assert (1, "k_repeated", (1, c.n_kv_heads, c.n_heads // c.n_kv_heads, 6, c.head_dim)) in seen
    assert (1, "scores", (1, c.n_heads, 6, 6)) in seen
    seen.clear()
    with model.hooked(lambda lay, name, x: seen.append((lay, name)), layers=[0], attention=[]):
        model(token_ids(6, seed=35))
    assert (0, "resid_mid") in seen and not any(name in ("q", "scores") for _, name in seen)
    assert all(m.hook is None for m in model.modules() if hasattr(m, "point"))
    seen.clear()
    model(token_ids(6, seed=35))
    assert seen == []


# ----------------------------------------------------------------------------------------------------------------
# rows side by side (B > 1)


@pytest.mark.parametrize("spelled_out", [True, False], ids=["eager", "sdpa"])
@torch.no_grad()
def test_batch_rows_equal_each_row_alone(tiny, spelled_out):
    idx = torch.cat([token_ids(9, seed=40), token_ids(9, seed=41), token_ids(9, seed=42)])  # (3, 9)
    with attention(tiny.model, spelled_out):
        batch = tiny.model(idx)  # (3, 9, V)
        for r in range(3):
            torch.testing.assert_close(batch[r], tiny.model(idx[r : r + 1])[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("spelled_out", [True, False], ids=["eager", "sdpa"])
@torch.no_grad()
def test_left_padded_rows_with_mask_and_positions_equal_each_row_alone(tiny, spelled_out):
    """Rows of 10, 4 and 1 real tokens, left-padded to 10 (pad slots masked out, positions from 0 at each row's first
    real token), prefilled into one cache and decoded 3 steps: each row's logits are its unpadded run's."""
    model = tiny.model
    lengths, steps, T = [10, 4, 1], 3, 10
    rows = [token_ids(n, seed=50 + i)[0].tolist() for i, n in enumerate(lengths)]
    idx = torch.tensor([[0] * (T - len(r)) + r for r in rows])  # (B, T), pad id 0
    mask = torch.tensor([[False] * (T - len(r)) + [True] * len(r) for r in rows])  # (B, T)
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, T): 0 at each row's first real token
    with attention(model, spelled_out):
        cache = model.new_cache(T + steps, batch=len(rows))
        logits = model(idx, cache, 0, input_pos=pos, attention_mask=mask, last_only=True)  # (B, V)
        got = [logits]
        for s in range(steps):
            nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
            pos = pos[:, -1:] + 1
            idx = torch.cat([idx, nxt], dim=1)
            logits = model(nxt, cache, T + s, input_pos=pos, attention_mask=mask, last_only=True)
            got.append(logits)
        for r, row in enumerate(rows):
            alone = model(torch.tensor([row + idx[r, T:].tolist()]))[0]  # (len + steps, V)
            for s, lg in enumerate(got):
                torch.testing.assert_close(lg[r], alone[len(row) - 1 + s], atol=1e-5, rtol=1e-4)
    assert torch.isfinite(torch.stack(got)).all()


# ----------------------------------------------------------------------------------------------------------------
# the real SmolLM2


@pytest.mark.slow
@torch.no_grad()
def test_decode_equals_full_recompute_smollm(smollm):
    prompt = smollm.tokenizer.encode("The three primary colors are")
    tokens, worst = decode_vs_recompute(smollm.model, prompt, steps=8, per_step=False)
    assert worst <= 1e-4, worst
    assert len(set(tokens)) > 1


@pytest.mark.slow
@torch.no_grad()
def test_eager_equals_sdpa_smollm(smollm):
    ids = smollm.tokenizer.encode("A KV cache stores the keys and values of earlier positions so that")
    model = smollm.model
    with attention(model, True):
        a = model(torch.tensor([ids]))
    b = model(torch.tensor([ids]))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # and the spelled-out path through the cache: prefill then 4 single-token steps
    with attention(model, True):
        _, worst = decode_vs_recompute(model, ids, steps=4, per_step=False)
    assert worst <= 1e-4, worst
