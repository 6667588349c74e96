"""Every point a researcher edits (issue 49 item 2), TransformerLens's names (issue 49 item 7, issue 52 item 8), and an
observed pass that computes what an unobserved one computes.

Each newly editable point is edited by a hook and the result checked against what the edit must give, computed by
hand from the same pass's other tensors: q of a head zeroed makes its attention uniform (each position's output the
running mean of the values), k likewise for the query heads that read it, v all ones makes every output one, a
probability row moved to the first key makes the output that key's value, act zeroed makes the feed-forward add
nothing, an embedding row replaced is the pass over the other token, the router's logits choose the experts, the
experts' weights given to an expert not chosen run that expert, Qwen3.5's gated head output zeroed adds nothing, and
its states edited are what the next pass reads.
"""

import pytest
import torch

from families import PROMPT_IDS
from llmtrace.api import Model
from llmtrace.errors import BadValue
from llmtrace.run.hookpoints import from_transformer_lens, needs_spelled_attention
from llmtrace.run.interventions import Ablate
from llmtrace.run.research import hooks_attached

PROMPT = "The quick brown fox jumps"
ATOL = 1e-5  # float32 sums of a few dozen terms of size ~1


def edited(model, hooks, names, prompt=PROMPT):
    with model.hooks(hooks):
        return model.run_with_cache(prompt, names=names)


def running_mean(v: torch.Tensor) -> torch.Tensor:
    """(T, Dh) -> each position's mean over the positions up to it: uniform causal attention's output."""
    return v.cumsum(0) / torch.arange(1, v.size(0) + 1, dtype=v.dtype)[:, None]


def setting(head: int, value: float = 0.0, axis: int = 2):
    def edit(x, point):
        x = x.clone()
        x.select(axis, head).fill_(value)
        return x
    return edit


def test_q_k_and_v_are_editable_per_head(tiny_lm):
    model = Model(tiny_lm)
    G = tiny_lm.config.n_heads // tiny_lm.config.n_kv_heads
    _, c = edited(model, [("2.q", setting(1))], ["2.v", "2.attn_out"])  # head 1's scores all 0: uniform
    torch.testing.assert_close(c["2.attn_out"][0, :, 1], running_mean(c["2.v"][0, :, 1 // G]), atol=ATOL, rtol=0)
    _, plain = model.run_with_cache(PROMPT, names=["2.attn_out"])
    assert float((c["2.attn_out"][0, :, 1] - plain["2.attn_out"][0, :, 1]).abs().max()) > 1e-2
    torch.testing.assert_close(c["2.attn_out"][0, :, 0], plain["2.attn_out"][0, :, 0], atol=0, rtol=0)
    _, c = edited(model, [("2.k", setting(0))], ["2.v", "2.attn_out"])  # KV head 0: its G query heads uniform
    for h in range(G):
        torch.testing.assert_close(c["2.attn_out"][0, :, h], running_mean(c["2.v"][0, :, 0]), atol=ATOL, rtol=0)
    _, c = edited(model, [("2.v", lambda x, p: torch.ones_like(x))], ["2.attn_out"])  # rows sum to 1
    torch.testing.assert_close(c["2.attn_out"], torch.ones_like(c["2.attn_out"]), atol=ATOL, rtol=0)
    assert c.spelled_out == []  # q, k, v are edited on the fused path


def test_the_attention_pattern_is_editable_and_says_it_spelled_attention_out(tiny_lm):
    model = Model(tiny_lm)
    G = tiny_lm.config.n_heads // tiny_lm.config.n_kv_heads

    def first_key(x, point):  # (B, H, T, S): head 3 reads key 0 only
        x = x.clone()
        x[:, 3] = 0.0
        x[:, 3, :, 0] = 1.0
        return x

    _, c = edited(model, [("1.probs", first_key)], ["1.v", "1.attn_out"])
    T = c["1.v"].size(1)
    torch.testing.assert_close(c["1.attn_out"][0, :, 3], c["1.v"][0, 0, 3 // G].expand(T, -1), atol=ATOL, rtol=0)
    assert c.spelled_out == [1]


def test_the_glu_activation_and_the_embedding_are_editable(tiny_lm):
    model = Model(tiny_lm)
    _, c = edited(model, [("1.act", lambda x, p: torch.zeros_like(x))], ["1.down", "1.resid_mid", "1.resid_post"])
    assert float(c["1.down"].abs().max()) == 0.0 and torch.equal(c["1.resid_post"], c["1.resid_mid"])
    ids = tiny_lm.tokenizer.encode_prompt(PROMPT)[1]
    other = list(ids)
    other[2] = 77
    row = tiny_lm.model.embed.weight[77].detach()

    def swap(x, point):  # (B, T, D): position 2's row is token 77's
        x = x.clone()
        x[:, 2] = row
        return x

    swapped = model.run_with_hooks(ids, hooks=[("embed", swap)])
    torch.testing.assert_close(swapped, model.run_with_hooks(other), atol=1e-6, rtol=0)


def test_the_router_chooses_and_the_weights_run_the_experts_they_name(loaded):
    lm = loaded("qwen3_moe", "hf")
    model, ffn = Model(lm), lm.model.layers[0].ffn
    E = lm.config.n_experts

    def choose_3_and_5(x, point):  # (B, T, E)
        y = torch.full_like(x, -1e9)
        y[..., 3] = y[..., 5] = 0.0
        return y

    _, c = edited(model, [("0.router_logits", choose_3_and_5)], ["0.expert_weights"], PROMPT_IDS)
    w = c["0.expert_weights"][0]
    assert torch.equal(w[:, [3, 5]], torch.full((len(PROMPT_IDS), 2), 0.5)) and float(w.sum(-1).min()) == 1.0

    def all_on_last(x, point):  # every token's whole weight on the last expert, chosen or not
        return torch.zeros_like(x).index_fill_(-1, torch.tensor([E - 1]), 1.0)

    _, c = edited(model, [("0.expert_weights", all_on_last)], ["0.ffn_norm", "0.down"], PROMPT_IDS)
    with torch.no_grad():
        rows = c["0.ffn_norm"][0]  # (T, D)
        by_hand = ffn.w_down(ffn.expert_act(rows, E - 1), E - 1)  # (T, D)
    torch.testing.assert_close(c["0.down"][0], by_hand, atol=ATOL, rtol=0)


def test_an_experts_activation_is_editable(loaded):
    """Zeroing each token's second expert's act leaves the first expert's output times its weight."""
    lm = loaded("qwen3_moe", "hf")
    model, ffn = Model(lm), lm.model.layers[1].ffn

    def second_off(x, point):  # (B, T, K, Fe)
        return setting(1)(x, point)

    _, c = edited(model, [("1.act", second_off)], ["1.expert_weights", "1.act", "1.down"], PROMPT_IDS)
    weights, act = c["1.expert_weights"][0], c["1.act"][0]  # (T, E), (T, K, Fe)
    assert float(act[:, 1].abs().max()) == 0.0
    with torch.no_grad():
        first = weights.argmax(-1)  # each token's most probable expert: slot 0
        by_hand = torch.stack([ffn.w_down(act[t, :1], int(e))[0] * weights[t, e] for t, e in enumerate(first)])
    torch.testing.assert_close(c["1.down"][0], by_hand, atol=ATOL, rtol=0)


def test_qwen35_gated_head_output_and_linear_states_are_editable(loaded):
    lm = loaded("qwen3_5", "hf")
    model = Model(lm)
    _, c = edited(model, [("3.attn_gated", lambda x, p: torch.zeros_like(x))],
                  ["3.o_proj", "3.resid_pre", "3.resid_mid"], PROMPT_IDS)
    assert float(c["3.o_proj"].abs().max()) == 0.0 and torch.equal(c["3.resid_mid"], c["3.resid_pre"])
    ids = torch.tensor([PROMPT_IDS])
    T = ids.size(1)
    for point, buffer in (("delta_state", "state"), ("conv_state", "conv")):
        cache = lm.model.new_cache(T)
        with torch.no_grad():
            with hooks_attached(lm, [(f"0.{point}", lambda x, p: torch.zeros_like(x))]):
                lm.model(ids[:, :-1], cache, 0)  # the prompt's pass, its state edited
            after_edit = lm.model(ids[:, -1:], cache, T - 1)  # the next pass reads what the hook left
            by_hand = lm.model.new_cache(T)
            lm.model(ids[:, :-1], by_hand, 0)
            by_hand.layers[0].buffers[buffer].zero_()
            expected = lm.model(ids[:, -1:], by_hand, T - 1)
            plain = lm.model.new_cache(T)
            lm.model(ids[:, :-1], plain, 0)
            unedited = lm.model(ids[:, -1:], plain, T - 1)
        assert torch.equal(after_edit, expected), point
        assert float((after_edit - unedited).abs().max()) > 1e-3, point


# ----------------------------------------------------------------------------------------------------------------
# an observed pass computes what an unobserved one computes


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "qwen3_5", "qwen3_moe", "olmo2", "phi3"])
def test_observing_changes_nothing_unless_a_point_needs_attention_spelled_out(loaded, name):
    lm = loaded(name, "hf")
    model = Model(lm)
    plain = model.run_with_hooks(PROMPT_IDS)
    steps = [p.name for p in model.points() if not needs_spelled_attention(p)]
    for names in (steps, "embed", "*.resid_post"):
        logits, cache = model.run_with_cache(PROMPT_IDS, names=names)
        assert cache.spelled_out == [] and torch.equal(logits, plain), names
    logits, cache = model.run_with_cache(PROMPT_IDS)  # every point: the scores and the softmax exist only spelled out
    fused = [i for i, block in enumerate(lm.model.layers) if getattr(block.attn, "fused", False)]
    assert cache.spelled_out == fused  # where a family always spells attention out, observing it changes nothing
    if not fused:
        assert torch.equal(logits, plain)
    else:
        torch.testing.assert_close(logits, plain, atol=1e-4, rtol=0)
        assert f"spelled out in {len(fused)} layer" in repr(cache)


# ----------------------------------------------------------------------------------------------------------------
# TransformerLens's names


def test_transformer_lens_names_are_ours(tiny_lm, loaded):
    model = Model(tiny_lm)
    _, cache = model.run_with_cache(PROMPT)
    same = {"blocks.3.attn.hook_pattern": "3.probs", "blocks.3.attn.hook_z": "3.attn_out",
            "blocks.3.hook_resid_post": "3.resid_post", "blocks.3.hook_resid_pre": "3.resid_pre",
            "blocks.3.hook_resid_mid": "3.resid_mid", "hook_embed": "embed", "blocks.3.attn.hook_q": "3.q",
            "blocks.3.attn.hook_k": "3.k", "blocks.3.attn.hook_v": "3.v", "blocks.3.attn.hook_rot_q": "3.q_rope",
            "blocks.3.attn.hook_attn_scores": "3.scores", "blocks.3.hook_mlp_out": "3.down",
            "blocks.3.hook_attn_out": "3.o_proj", "blocks.3.mlp.hook_post": "3.act", "blocks.3.mlp.hook_pre": "3.gate",
            "blocks.3.ln1.hook_normalized": "3.attn_norm", "ln_final.hook_normalized": "final_norm",
            "blocks.-1.hook_resid_post": "3.resid_post"}
    for theirs, ours in same.items():
        assert cache[theirs] is cache[ours], theirs
        assert theirs in cache
    torch.testing.assert_close(cache["last"], cache["final_norm"][:, -1], atol=0, rtol=0)
    assert "last" in cache and cache.axes("last") == ("B", "D")
    # Gemma adds each sub-layer's output normed: what TransformerLens calls attn_out and mlp_out
    gemma = loaded("gemma3", "hf")
    table = Model(gemma).points()
    assert from_transformer_lens("blocks.2.hook_attn_out", table) == "2.post_attn_norm"
    assert from_transformer_lens("blocks.2.hook_mlp_out", table) == "2.post_ffn_norm"
    assert from_transformer_lens("blocks.*.hook_resid_post", table) == "*.resid_post"


def test_a_transformer_lens_name_not_kept_or_without_an_equivalent_is_said(tiny_lm):
    model = Model(tiny_lm)
    _, cache = model.run_with_cache(PROMPT, names="*.resid_post")
    with pytest.raises(KeyError, match="'blocks.3.attn.hook_pattern' \\(TransformerLens\\) is 3.probs, which is not"):
        cache["blocks.3.attn.hook_pattern"]
    with pytest.raises(KeyError, match="does not compute: each head's output after Wo"):
        cache["blocks.3.attn.hook_result"]
    with pytest.raises(KeyError, match="did you mean 3.resid_post"):
        cache["3.resid_pst"]
    with pytest.raises(KeyError, match="not held"):
        cache["3.probs"]


def test_names_filter_globs_and_hooks_take_transformer_lens_names(tiny_lm):
    model = Model(tiny_lm)
    L = tiny_lm.config.n_layers
    _, by_lambda = model.run_with_cache(PROMPT, names_filter=lambda n: n.endswith("hook_pattern"))
    _, by_list = model.run_with_cache(PROMPT, names_filter=["blocks.*.hook_resid_post", "hook_embed"])
    assert by_lambda.names() == [f"{i}.probs" for i in range(L)]
    assert by_list.names() == ["embed"] + [f"{i}.resid_post" for i in range(L)]
    with pytest.raises(BadValue, match="names_filter"):
        model.run_with_cache(PROMPT, names="embed", names_filter="embed")

    def zero_head_1(x, point):
        return setting(1)(x, point)

    mine = model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.2.attn.hook_z", zero_head_1)])
    torch.testing.assert_close(mine, model.run_with_hooks(PROMPT, hooks=[Ablate(2, head=1)]), atol=0, rtol=0)
    with pytest.raises(BadValue, match="hook_result"):
        model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.2.attn.hook_result", zero_head_1)])


def test_to_tokens_to_str_tokens_and_the_accumulated_residual_stream(tiny_lm):
    model = Model(tiny_lm)
    L = tiny_lm.config.n_layers
    logits, cache = model.run_with_cache(PROMPT, names="*.resid_*")
    tokens = model.to_tokens(PROMPT)
    assert torch.equal(tokens, cache.ids)
    pieces = model.to_str_tokens(PROMPT)
    assert len(pieces) == tokens.size(1) and "".join(pieces).endswith(PROMPT)
    assert model.to_str_tokens(tokens[0]) == pieces
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"{i}.resid_pre" for i in range(L)] + [f"{L - 1}.resid_post"]
    assert tuple(stack.shape) == (L + 1, *cache["0.resid_pre"].shape)
    lens = tiny_lm.model.lm_head(cache.accumulated_resid(apply_ln=True))  # the logit lens of every layer
    torch.testing.assert_close(lens[-1], logits, atol=ATOL, rtol=0)  # the last layer's is the model's output
    _, labels = cache.accumulated_resid(layer=2, incl_mid=True, return_labels=True)
    assert labels == ["0.resid_pre", "0.resid_mid", "1.resid_pre", "1.resid_mid", "2.resid_pre"]
    _, normed = model.run_with_cache(PROMPT, names=["2.attn_norm"])
    torch.testing.assert_close(cache.accumulated_resid(layer=2, apply_ln=True)[-1], normed["2.attn_norm"],
                               atol=ATOL, rtol=0)
    assert tuple(cache.accumulated_resid(pos_slice=-1).shape) == (L + 1, 1, tiny_lm.config.d_model)
    _, little = model.run_with_cache(PROMPT, names="*.resid_post")
    with pytest.raises(KeyError, match="resid_pre"):
        little.accumulated_resid()
