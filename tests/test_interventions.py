"""Interventions on the real default model, and on a tiny random one of as many layers and heads as the checks
name (the quick suite), against the same operation done with forward hooks on transformers' Llama.

Each case runs llmtrace's generation loop with one intervention (or two combined) and transformers' `generate` with
hooks that do what the definition says (llmtrace.interventions' docstring): a pre-hook on o_proj for a head, a hook on
self_attn / mlp for a sub-layer, a hook on the decoder layer's output for steering and control vectors. Greedy tokens
must be identical and every step's top-5 logits within 1e-4; so must the prompt pass's logits at every position.
"""

import contextlib

import numpy as np
import pytest
import torch

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.run.generate import generate
from llmtrace.run.interventions import (Ablate, ControlVector, Patch, Scale, Steer, parse_ablate, parse_interventions,
                                    parse_patch, parse_scale, prepare)
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.options import TraceOptions
from llmtrace.checkpoint.load import load_model
from tiny import TinySpec, write_hf_dir

PROMPT = "The capital of France is"
SOURCE = "The capital of Italy is"
N = 6
# the tiny model of the quick suite: 13 layers and 8 query heads (on 4 KV heads), so that every layer and head the
# checks name (up to layer 12, head 7, chosen on SmolLM2) exists in it too
TINY = TinySpec(n_layers=13, n_heads=8, n_kv_heads=4, seed=13)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """(llmtrace's load, transformers' eager load) of one checkpoint: the tiny one (quick), SmolLM2 (slow: it
    compares with transformers for minutes on a small CPU)."""
    if request.param == "smollm":
        return request.getfixturevalue("smollm"), request.getfixturevalue("hf_smollm")
    import transformers

    path = tmp_path_factory.mktemp("interventions")
    write_hf_dir(path, TINY)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return load_model(str(path), device="cpu", dtype="float32"), hf.eval()


# ----------------------------------------------------------------------------------------------------------------
# both sides


def ours(lm, interventions, prompt=PROMPT, n=N):
    """(tokens, per-step top-5 [(id, logit)], prompt-pass logits (T, V)) of llmtrace with the interventions."""
    ids = lm.tokenizer.encode(prompt)
    events = []
    rec = Recorder(TraceOptions(level="steps", topk=5), [events.append])
    result = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), n, ignore_eos=True,
                      observer=rec, interventions=interventions)
    tops = [[(c["id"], c["logit"]) for c in e["topk"]] for e in events if e["event"] == "step"]
    edits = prepare(lm, interventions, [len(ids)])
    # the prompt pass with attention spelled out (observed), in transformers' eager order: the comparison is then of
    # the intervention, not of two attention kernels' rounding
    edited = lm.model.hooked(edits, edits.layers, spell_out=False) if edits else contextlib.nullcontext()
    with torch.inference_mode(), edited, lm.model.hooked(lambda *a: None):
        full = lm.model(torch.tensor([ids]))[0]
    return result.tokens, tops, full


@torch.no_grad()
def theirs(hf, tok, hooks, prompt=PROMPT, n=N):
    """The same with transformers, `hooks` a list of (module, kind, fn) registered for the run only."""
    ids = torch.tensor([tok.encode(prompt)])
    handles = []
    for module, kind, fn in hooks:
        if kind == "pre":
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(fn))
    try:
        full = hf(ids).logits[0]
        out = hf.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    tokens = out.sequences[0, ids.size(1):].tolist()
    tops = [[(int(i), float(lg[0, i])) for i in lg[0].topk(5).indices] for lg in out.logits]
    return tokens, tops, full


def assert_same(mine, ref):
    tokens, tops, full = mine
    ref_tokens, ref_tops, ref_full = ref
    assert tokens == ref_tokens
    torch.testing.assert_close(full, ref_full, atol=1e-4, rtol=1e-4)
    for a, b in zip(tops, ref_tops):
        assert [i for i, _ in a] == [i for i, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4


def keep(store: dict, key: str, x: torch.Tensor) -> None:
    """Keep a copy of x; a hook that returns None changes nothing."""
    store[key] = x.clone()


@torch.no_grad()
def hf_layer_output(hf, tok, text, layer):
    """transformers' decoder layer `layer` output over `text` alone, (T, D)."""
    got = {}
    h = hf.model.layers[layer].register_forward_hook(lambda m, a, out: keep(got, "x", out[0]))
    try:
        hf(torch.tensor([tok.encode(text)]))
    finally:
        h.remove()
    return got["x"]


# hook builders: each returns (module, kind, fn)

def o_proj_head(hf, layer, head, fn):
    """A pre-hook on o_proj handing fn the (B, T, Dh) slice of head `head` to replace."""
    Dh = hf.config.head_dim

    def pre(mod, args, kwargs):
        x = args[0].clone()
        x[..., head * Dh:(head + 1) * Dh] = fn(x[..., head * Dh:(head + 1) * Dh])
        return (x,), kwargs
    return hf.model.layers[layer].self_attn.o_proj, "pre", pre


def sub_layer(hf, layer, part, fn):
    mod = hf.model.layers[layer].self_attn if part == "attn" else hf.model.layers[layer].mlp
    if part == "attn":
        return mod, "post", lambda m, a, out: (fn(out[0]),) + tuple(out[1:])
    return mod, "post", lambda m, a, out: fn(out)


def layer_out(hf, layer, fn):
    return hf.model.layers[layer], "post", lambda m, a, out: fn(out)


# ----------------------------------------------------------------------------------------------------------------
# the definitions, one by one


def test_ablate_head(pair):
    lm, hf = pair
    ref = theirs(hf, lm.tokenizer, [o_proj_head(hf, 3, 2, torch.zeros_like)])
    assert_same(ours(lm, [Ablate(3, head=2)]), ref)


def test_ablate_attn_and_ffn_combined(pair):
    lm, hf = pair
    hooks = [sub_layer(hf, 0, "attn", torch.zeros_like), sub_layer(hf, 5, "ffn", torch.zeros_like)]
    ref = theirs(hf, lm.tokenizer, hooks)
    mine = ours(lm, [Ablate(0, part="attn"), Ablate(5, part="ffn")])
    assert_same(mine, ref)
    assert mine[0] != ours(lm, [])[0]  # it changed the text


def test_ablate_head_mean(pair):
    lm, hf = pair
    kept = {}

    def mean(x):  # (B, T, Dh): the prompt's pass takes the mean over positions; decode steps reuse it
        if x.size(1) > 1:
            kept["m"] = x.mean(1, keepdim=True)
        return kept["m"].expand_as(x)
    ref = theirs(hf, lm.tokenizer, [o_proj_head(hf, 4, 7, mean)])
    assert_same(ours(lm, [Ablate(4, head=7, mean=True)]), ref)


def test_scale_head_attn_ffn(pair):
    lm, hf = pair
    hooks = [o_proj_head(hf, 2, 1, lambda s: s * 3.0), sub_layer(hf, 6, "attn", lambda o: o * 0.5),
             sub_layer(hf, 7, "ffn", lambda o: o * -1.0)]
    ref = theirs(hf, lm.tokenizer, hooks)
    assert_same(ours(lm, [Scale(2, 3.0, head=1), Scale(6, 0.5, part="attn"), Scale(7, -1.0, part="ffn")]), ref)


@pytest.mark.parametrize("position", [-1, 2])
def test_patch_resid_post(pair, position):
    lm, hf = pair
    tok = lm.tokenizer
    src = hf_layer_output(hf, tok, SOURCE, 8)[position]

    def patch(out):
        if out.size(1) > 1:  # the prompt's pass only
            out = out.clone()
            out[0, position] = src
        return out
    ref = theirs(hf, tok, [layer_out(hf, 8, patch)])
    mine = ours(lm, [Patch(8, "resid_post", position, SOURCE)])
    assert_same(mine, ref)


def test_patch_resid_pre_and_mid(pair):
    lm, hf = pair
    tok = lm.tokenizer
    pre_src = hf_layer_output(hf, tok, SOURCE, 9)[-1]  # resid_pre of layer 10 is layer 9's output
    mid_src = {}
    with torch.no_grad():  # resid_mid of layer 12 over SOURCE: layer input + attention output
        h1 = hf.model.layers[12].register_forward_pre_hook(
            lambda m, a, k: keep(mid_src, "x", a[0] if a else k["hidden_states"]), with_kwargs=True)
        h2 = hf.model.layers[12].self_attn.register_forward_hook(
            lambda m, a, out: keep(mid_src, "o", out[0]))
        hf(torch.tensor([tok.encode(SOURCE)]))
        h1.remove()
        h2.remove()
    mid = (mid_src["x"] + mid_src["o"])[0, 1]
    layer_in = {}

    def pre(mod, args, kwargs):  # resid_pre of layer 10 at the last position
        x = (args[0] if args else kwargs["hidden_states"])
        if x.size(1) > 1:
            x = x.clone()
            x[0, -1] = pre_src
            if args:
                args = (x,) + tuple(args[1:])
            else:
                kwargs["hidden_states"] = x
        return args, kwargs

    def keep_input(mod, args, kwargs):
        layer_in["x"] = args[0] if args else kwargs["hidden_states"]
        return args, kwargs

    def attn(m, a, out):  # resid_mid of layer 12 at position 1: the attention output makes x + o equal the source's
        o = out[0]
        if o.size(1) > 1:
            o = o.clone()
            o[0, 1] = mid - layer_in["x"][0, 1]
        return (o,) + tuple(out[1:])
    hooks = [(hf.model.layers[10], "pre", pre), (hf.model.layers[12], "pre", keep_input),
             (hf.model.layers[12].self_attn, "post", attn)]
    ref = theirs(hf, tok, hooks)
    assert_same(ours(lm, [Patch(10, "resid_pre", -1, SOURCE), Patch(12, "resid_mid", 1, SOURCE)]), ref)


def test_patch_head(pair):
    lm, hf = pair
    tok = lm.tokenizer
    got = {}
    with torch.no_grad():
        h = hf.model.layers[5].self_attn.o_proj.register_forward_pre_hook(
            lambda m, a: keep(got, "x", a[0][0, -1, 3 * hf.config.head_dim:4 * hf.config.head_dim]))
        hf(torch.tensor([tok.encode(SOURCE)]))
        h.remove()

    def replace(s):
        if s.size(1) > 1:
            s = s.clone()
            s[0, -1] = got["x"]
        return s
    ref = theirs(hf, tok, [o_proj_head(hf, 5, 3, replace)])
    assert_same(ours(lm, [Patch(5, "h3", -1, SOURCE)]), ref)


def test_steer(pair):
    lm, hf = pair
    tok = lm.tokenizer
    toward, away, alpha = "I love this, it is wonderful", "I hate this, it is terrible", 4.0
    v = hf_layer_output(hf, tok, toward, 6)[-1] - hf_layer_output(hf, tok, away, 6)[-1]
    ref = theirs(hf, tok, [layer_out(hf, 6, lambda out: out + alpha * v)], prompt="I think the movie was")
    mine = ours(lm, [Steer(6, toward, away, alpha)], prompt="I think the movie was")
    assert_same(mine, ref)
    assert mine[0] != ours(lm, [], prompt="I think the movie was")[0]  # strong enough to change the text


def write_control_vector(path, directions: dict, n_layers: int):
    """A control vector as llama-cvector-generator writes one (gguf's writer): arch controlvector, direction.N."""
    import gguf

    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_int32("controlvector.layer_count", n_layers - 1)
    for il, d in sorted(directions.items()):
        w.add_tensor(f"direction.{il}", np.asarray(d, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_control_vector(pair, tmp_path):
    lm, hf = pair
    L, D = lm.config.n_layers, lm.config.d_model
    rng = np.random.default_rng(0)
    dirs = {il: rng.standard_normal(D).astype(np.float32) * 0.3 for il in range(1, L)}
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_control_vector(a, dirs, L)
    write_control_vector(b, {3: dirs[3]}, L)
    hooks = [layer_out(hf, il, (lambda d: lambda out: out + d)(torch.from_numpy(d) * (1.5 + (il == 3) * -0.5)))
             for il, d in dirs.items()]  # a ×1.5 everywhere, plus b ×-0.5 at layer 3
    ref = theirs(hf, lm.tokenizer, hooks)
    mine = ours(lm, [ControlVector(str(a), 1.5), ControlVector(str(b), -0.5)])
    assert_same(mine, ref)
    assert mine[0] != ours(lm, [])[0]


def test_control_vector_of_another_model(pair, tmp_path):
    lm, _ = pair
    L, D = lm.config.n_layers, lm.config.d_model
    wide = tmp_path / "wide.gguf"
    write_control_vector(wide, {1: np.zeros(D + 8)}, L)
    with pytest.raises(LlmtraceError, match=f"width {D + 8}.*width is {D}"):
        prepare(lm, [ControlVector(str(wide))], [5])
    deep = tmp_path / "deep.gguf"
    write_control_vector(deep, {il: np.zeros(D) for il in range(1, L + 4)}, L + 4)
    with pytest.raises(LlmtraceError, match=f"direction.{L + 3}.*{L} layers"):
        prepare(lm, [ControlVector(str(deep))], [5])


def test_batch_rows_equal_runs_alone(pair):
    """A left-padded batch: each row with the interventions equals its prompt alone with them (positions per row)."""
    lm, _ = pair
    from llmtrace.run.generate import generate_batch

    ivs = [Ablate(3, head=2), Patch(8, "resid_post", 1, SOURCE), Ablate(4, head=7, mean=True)]
    prompts = ["The capital of France is", "Hello there"]
    ids = [lm.tokenizer.encode(p) for p in prompts]
    samplers = [Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size) for _ in prompts]
    batch = generate_batch(lm, ids, samplers, N, ignore_eos=True, interventions=ivs)
    for p, row in zip(prompts, batch.rows):
        assert row.tokens == ours(lm, ivs, prompt=p)[0]


def test_no_intervention_is_the_plain_run(pair):
    lm, _ = pair
    ids = lm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        plain = lm.model(torch.tensor([ids]))
        edits = prepare(lm, [Scale(3, 1.0, head=2), Patch(8, "resid_post", 0, PROMPT)], [len(ids)])
        with lm.model.hooked(edits, edits.layers, spell_out=False):
            same = lm.model(torch.tensor([ids]))
    assert torch.equal(plain, same)  # scale 1 and patching a prompt with its own activation change no bit


# ----------------------------------------------------------------------------------------------------------------
# parsing and range checks (no model needed beyond the config)


def test_parse():
    assert parse_ablate("3.h2") == Ablate(3, head=2)
    assert parse_ablate("3.h2=mean") == Ablate(3, head=2, mean=True)
    assert parse_ablate("-1.ffn") == Ablate(-1, part="ffn")
    assert parse_scale("3.attn=0.5") == Scale(3, 0.5, part="attn")
    assert parse_patch("5.resid_post@-1", "x") == Patch(5, "resid_post", -1, "x")
    assert parse_patch("5.h2@0", "x") == Patch(5, "head", 0, "x", head=2)
    for bad in ("3", "3.h", "x.h2", "3.mlp", "3.h2=zero"):
        with pytest.raises(BadValue):
            parse_ablate(bad)
    with pytest.raises(BadValue, match="unknown point 'resid'"):
        parse_patch("5.resid@0", "x")
    # the library names its keywords (issue 31); the CLI names the flags (`named` with flag_of), as it always said
    from llmtrace.cli.options import flag_of

    with pytest.raises(BadValue, match="needs source") as err:
        parse_patch("5.resid_post@0", None)
    assert "needs --from" in err.value.named(flag_of(err.value.field), flag_of)
    with pytest.raises(BadValue, match="away_from missing") as err:
        parse_interventions(steer=3, toward="a")
    assert "--away-from missing" in err.value.named(flag_of(err.value.field), flag_of)
    with pytest.raises(BadValue, match="give patch") as err:
        parse_interventions(source="text")
    assert "--patch" in err.value.named(flag_of(err.value.field), flag_of)
