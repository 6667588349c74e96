"""Gradients through the researcher's API (issue 49 item 1): run_with_cache(grad=True) and run_with_hooks(bwd_hooks=...).

The reference is transformers' own autograd on the same weights: the gradient of one logit (the last position's
median one: the cap of Gemma 2's logits saturates the top ones, whose gradient is then 0) with respect to a layer's output (a forward hook on transformers' decoder layer) and to q (a
forward hook on its q_proj), on the families whose pass differs most from Llama's: Gemma 3 ((1 + w) norms, a
window, its own score scale), Gemma 2 (soft-caps on the scores and the logits that bite), gpt-oss (sinks, a mixture of experts routed through the chosen experts' weights, YaRN)
and Qwen3.5 (the delta rule's recurrence, a gated attention layer), from the HF directory and from the GGUF llama.cpp's
converter writes (read back for transformers as tests/test_gemma.py and tests/test_gpt_oss.py read it).

The tolerance is relative to the gradient's size: both sides compute the same float32 maths in another order, so they
agree to float32 rounding over a few layers (1e-4 of the largest entry, far above the ~1e-6 seen here, far below any
real difference: a missing term moves entries by their own size).
"""

import pytest
import torch

from families import FAMILIES, PROMPT_IDS, hf_model_via_state_dict
from llmtrace.api import Model
from llmtrace.errors import BadValue
from llmtrace.run.hookpoints import HookError

REL = 1e-4
GRAD_FAMILIES = ["llama", "gemma3", "gemma2", "gpt_oss", "qwen3_5"]
# the layer whose output and whose q each family's check differentiates: Qwen3.5's one attention layer is its last
# (3); its layer 1 is linear attention, so the gradient there has come back through the recurrence of layers 2 and 3
Q_LAYER = {"llama": 1, "gemma3": 5, "gemma2": 1, "gpt_oss": 1, "qwen3_5": 3}
OUT_LAYER = {"llama": 0, "gemma3": 2, "gemma2": 0, "gpt_oss": 0, "qwen3_5": 1}


@pytest.fixture(scope="module")
def reference(families):
    """transformers' model of what llmtrace reads from each family's HF directory or GGUF."""
    made = {}

    def get(name: str, fmt: str):
        if (name, fmt) not in made:
            if fmt == "hf" or name == "qwen3_5":  # the GGUF holds the same float32 numbers (tests/test_qwen35.py)
                made[(name, fmt)] = families.model(name)
            else:
                changes = {"gemma3": {"query_pre_attn_scalar": 16},  # llama.cpp's scale (tests/test_gemma.py)
                           "gemma2": {"query_pre_attn_scalar": 16},
                           "gpt_oss": {"rope_parameters": dict(FAMILIES["gpt_oss"].config["rope_parameters"],
                                                               truncate=True)}}.get(name, {})
                made[(name, fmt)] = hf_model_via_state_dict(families.gguf(name), FAMILIES[name], **changes)
        return made[(name, fmt)]

    return get


def transformers_grads(hf, layer: int, q_layer: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """transformers' gradient of the last position's median logit with respect to decoder layer `layer`'s output and to
    layer `q_layer`'s queries, (1, T, D) and (1, T, H, Dh): (the token, the two gradients)."""
    c = hf.config
    H = c.num_attention_heads
    Dh = getattr(c, "head_dim", None) or c.hidden_size // H
    seen = {}
    out_hook = hf.model.layers[layer].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("out", out[0] if isinstance(out, tuple) else out))
    q_hook = hf.model.layers[q_layer].self_attn.q_proj.register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("q", out))
    try:
        logits = hf(torch.tensor([PROMPT_IDS])).logits  # (1, T, V)
    finally:
        out_hook.remove()
        q_hook.remove()
    t = int(logits[0, -1].argsort()[logits.size(-1) // 2])  # a middling logit: Gemma 2's cap saturates the top one
    g_out, g_q = torch.autograd.grad(logits[0, -1, t], [seen["out"], seen["q"]])
    g_q = g_q.view(1, len(PROMPT_IDS), H, -1)
    if g_q.size(-1) == 2 * Dh:  # Qwen3.5: each head's Dh query rows, then its Dh gate rows
        g_q = g_q[..., :Dh]
    return t, g_out, g_q


def assert_close_relative(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = float(theirs.abs().max())
    diff = float((ours - theirs).abs().max())
    assert scale > 0 and diff <= REL * scale, f"{what}: {diff:.3g} against {REL} x {scale:.3g}"


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", GRAD_FAMILIES)
def test_gradients_of_a_logit_are_transformers_autograd(loaded, reference, name, fmt):
    lm = loaded(name, fmt)
    layer, q_layer = OUT_LAYER[name], Q_LAYER[name]
    t, g_out, g_q = transformers_grads(reference(name, fmt), layer, q_layer)
    logits, cache = Model(lm).run_with_cache(PROMPT_IDS, names=[f"{layer}.resid_post", f"{q_layer}.q"], grad=True)
    assert cache.grad and logits.requires_grad
    assert not any(p.requires_grad for p in lm.model.parameters())  # the weights stay frozen
    ours_out, ours_q = torch.autograd.grad(logits[0, -1, t], [cache[f"{layer}.resid_post"], cache[f"{q_layer}.q"]])
    assert_close_relative(ours_out, g_out, f"{name} {fmt}: d logit / d {layer}.resid_post")
    assert_close_relative(ours_q, g_q, f"{name} {fmt}: d logit / d {q_layer}.q")


def test_a_mixture_of_experts_routes_the_gradient_through_the_chosen_experts_weights(loaded):
    """gpt-oss: the gradient reaches the router's logits through the weights of the chosen experts only; with the
    weights detached (the routing held fixed) the router gets none."""
    model = Model(loaded("gpt_oss", "hf"))
    logits, cache = model.run_with_cache(PROMPT_IDS, names=["1.router_logits", "1.expert_weights"], grad=True)
    t = int(logits[0, -1].argmax())
    g_router, g_weights = torch.autograd.grad(logits[0, -1, t], [cache["1.router_logits"],
                                                                 cache["1.expert_weights"]])
    chosen = cache["1.expert_weights"].detach() != 0  # (1, T, E)
    assert float(g_router.abs().max()) > 0 and float(g_weights[chosen].abs().max()) > 0
    # top-K, then a softmax over the K: an expert not chosen has no logit in the softmax, so no gradient
    assert float(g_router[~chosen].abs().max()) == 0.0


def test_weights_stay_frozen_unless_asked_and_then_their_gradient_is_transformers(loaded, families):
    lm = loaded("llama", "hf")
    model = Model(lm)
    hf = families.model("llama")
    logits = hf(torch.tensor([PROMPT_IDS])).logits
    t = int(logits[0, -1].argmax())
    (theirs,) = torch.autograd.grad(logits[0, -1, t], [hf.model.layers[1].mlp.down_proj.weight])
    model.requires_grad_(True)
    try:
        ours_logits, _ = model.run_with_cache(PROMPT_IDS, names=[], grad=True)
        (ours,) = torch.autograd.grad(ours_logits[0, -1, t], [lm.model.layers[1].ffn.w_down.weight])
    finally:
        model.requires_grad_(False)
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert_close_relative(ours, theirs, "d logit / d W_down")


def test_a_quantized_model_gives_gradients_with_respect_to_activations(families):
    """keep_quantized: the matrices stay Q8_0 blocks, dequantized at each product; the gradient with respect to an
    activation is the dequantized float model's (the same products of the same values)."""
    import llmtrace

    path = str(families.gguf("llama", "q8_0"))
    grads = []
    for kept in (False, True):
        model = llmtrace.load(path, device="cpu", dtype="float32", keep_quantized=kept)
        logits, cache = model.run_with_cache(PROMPT_IDS, names=["0.resid_post", "1.v"], grad=True)
        grads.append(torch.autograd.grad(logits[0, -1, 7], [cache["0.resid_post"], cache["1.v"]]))
    for plain, kept in zip(*grads):
        assert_close_relative(kept, plain, "keep_quantized against the float path")


def test_a_backward_hook_sees_the_gradient_and_may_replace_it(tiny_lm):
    model = Model(tiny_lm)
    prompt = "The quick brown fox"
    logits, cache = model.run_with_cache(prompt, names=["1.resid_post", "0.resid_pre", "2.q"], grad=True)
    want = torch.autograd.grad(logits[0, -1, 5], [cache["1.resid_post"], cache["2.q"]])
    seen = {}
    logits = model.run_with_hooks(prompt, bwd_hooks=[("1.resid_post", lambda g, p: seen.__setitem__(p.name, g)),
                                                     ("blocks.2.attn.hook_q", lambda g, p: seen.__setitem__(p.name, g))])
    logits[0, -1, 5].backward()
    assert torch.equal(seen["1.resid_post"], want[0]) and torch.equal(seen["2.q"], want[1])
    # every path from the embedding to the logits goes through the stream at 1.resid_post: a zero gradient there
    # is a zero gradient at the start
    seen.clear()
    logits = model.run_with_hooks(prompt, bwd_hooks=[("1.resid_post", lambda g, p: torch.zeros_like(g)),
                                                     ("0.resid_pre", lambda g, p: seen.__setitem__("start", g))])
    logits[0, -1, 5].backward()
    assert float(seen["start"].abs().max()) == 0.0
    with pytest.raises(HookError, match="no gradient flows back through 1.k_repeated"):
        model.run_with_hooks(prompt, bwd_hooks=[("1.k_repeated", lambda g, p: None)])
    with pytest.raises(BadValue, match="bwd_hooks"):
        model.run_with_hooks(prompt, bwd_hooks=[("1.nope", lambda g, p: None)])


def test_a_point_the_logits_do_not_depend_on_is_held_detached(tiny_lm):
    logits, cache = Model(tiny_lm).run_with_cache("The quick", names=["1.k_repeated", "1.probs", "1.kv_write"],
                                                  grad=True)
    assert cache["1.probs"].requires_grad and not cache["1.k_repeated"].requires_grad
    with pytest.raises(BadValue, match="remove_batch_dim"):
        Model(tiny_lm).run_with_cache("The quick", grad=True, remove_batch_dim=True)
    with pytest.raises(BadValue, match="dtype"):
        Model(tiny_lm).run_with_cache("The quick", grad=True, dtype="bfloat16")
