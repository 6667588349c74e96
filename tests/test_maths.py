"""The maths declaration's own truth (model.maths): every point's declared operation, applied in float64 to the
recorded inputs of a real pass (model.recompute), reproduces the recorded output, for every family fixture, in a
prefill past every window and in a decode step; and the plan says what each layer does."""

import pytest
import torch

from families import FAMILIES, PROMPT_IDS
from llmtrace.model.capture import capture
from llmtrace.model.maths import Maths, op_kinds
from llmtrace.model.recompute import apply, max_error

NAMES = list(FAMILIES)
REL, ABS = 1e-4, 1e-5


def _check_pass(model, ids, cache=None, start=0, history=None):
    """Every declared operation of one pass recomputed from the pass's own tensors: {(layer, point): (abs, rel)}.
    `history`: each earlier pass's tensors, for the operands that span the cache (an operation's `cached`)."""
    maths = model.maths()
    with torch.no_grad(), capture(model, spell_out=True) as seen:
        model(ids, cache, start, last_only=True)
    if history is not None:
        history.append(dict(seen))
    positions = torch.arange(start, start + ids.size(1))
    errors, unchecked = {}, []
    for layer in [None] + list(range(model.config.n_layers)):
        table = maths.model if layer is None else maths.layers[layer]
        for name, o in table.items():
            if (layer, name) not in seen:
                continue
            args = []
            for ref in o.inputs:
                if ref == "ids":
                    args.append(ids)
                    continue
                where = maths.operand(layer, ref)
                if ref in (o.const("carried") or ()):  # a recurrent state as the pass before left it (or none)
                    args.append(history[-2][where] if history and len(history) > 1 else None)
                    continue
                if where not in seen:
                    break
                if ref in (o.const("cached") or ()) and history:  # every slot: the earlier passes', then this one's
                    args.append(torch.cat([h[where] for h in history], dim=1))
                    continue
                args.append(seen[where])
            else:
                weights = [model.get_parameter(("" if layer is None else f"layers.{layer}.") + w) for w in o.weights]
                out = seen[(layer, name)]
                if name == "k_repeated":
                    out = out.reshape(out.size(0), -1, *out.shape[-2:])  # (B, H, S, Dh)
                got = apply(o, args, weights, tuple(out.shape), positions=positions)
                if got is None:
                    continue
                errors[(layer, name)] = max_error(got, out)
                continue
            unchecked.append((layer, name))
    return errors, unchecked


@pytest.mark.parametrize("name", NAMES)
def test_every_declared_operation_reproduces_the_recorded_point(loaded, name):
    lm = loaded(name, "hf")
    model = lm.model
    ids = torch.tensor([PROMPT_IDS])
    cache = model.new_cache(len(PROMPT_IDS) + 2)
    history = []
    errors, unchecked = _check_pass(model, ids, cache, history=history)  # the prefill: 14 tokens, past every window
    step, _ = _check_pass(model, torch.tensor([[PROMPT_IDS[3]]]), cache, len(PROMPT_IDS), history)  # a decode step
    bad = {k: e for k, e in {**errors, **{("decode",) + k: e for k, e in step.items()}}.items()
           if not (e[0] <= ABS or e[1] <= REL)}
    assert not bad, bad
    # everything the pass reported with a declared operation was checked, but the cache's slots and the decode
    # step's repeated keys (their operand is the whole cache, not this pass's k_rope)
    assert not [u for u in unchecked if u[1] != "kv_write"], unchecked
    declared = {(l, n) for l in range(model.config.n_layers) for n in model.maths().layers[l]}
    assert {k for k in errors if k[0] is not None} >= {k for k in declared if model.maths().op(*k).kind not in
                                                       ("cache_write", "stream")} - {(l, "resid_pre") for l in range(9)}


@pytest.mark.parametrize("name", NAMES)
def test_every_point_declares_an_operation_of_the_vocabulary(loaded, name):
    model = loaded(name, "hf").model
    maths = model.maths()
    points = model.declared_points()
    for layer in range(model.config.n_layers):
        for p in points.layer:
            o = maths.op(layer, p.name)
            if o is None:  # a layer that reports a subset of the declared points: a dense layer of a family with
                # experts (Qwen3-MoE's mlp_only_layers, a dense Granite 4.0-H), or a hybrid model's layer of one mixer
                # kind (Qwen3.5: linear attention or attention; LFM2: a short convolution or attention)
                hybrid = len({type(block.attn) for block in model.layers}) > 1
                optional = getattr(model.layers[layer].attn, "OPTIONAL", ())  # points only some configs have
                experts = any(q.where == "ffn" and "E" in q.axes for q in points.layer)
                assert ((experts and p.where == "ffn") or (hybrid and p.where == "attn")
                        or p.name in optional), (layer, p.name)
                continue
            assert o.kind in op_kinds()
    for p in points.model:
        assert maths.op(None, p.name) is not None, p.name
    assert Maths.from_record(maths.record()) == maths  # the trace's record reads back to the same declaration


def test_a_wrong_declaration_is_caught(loaded):
    """The check can fail: the same pass against a declaration with Llama's RoPE base on Gemma 3's local layers."""
    from dataclasses import replace

    model = loaded("gemma3", "hf").model
    maths = model.maths()
    o = maths.layers[0]["q_rope"]
    wrong_rope = replace(maths.plan[5].rope and o, consts=tuple(
        (k, maths.layers[5]["q_rope"].const("inv_freq") if k == "inv_freq" else v) for k, v in o.consts))
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad(), capture(model, [(0, "q_norm"), (0, "q_rope")]) as seen:
        model(ids)
    got = apply(wrong_rope, [seen[(0, "q_norm")]], [], tuple(seen[(0, "q_rope")].shape),
                positions=torch.arange(len(PROMPT_IDS)))
    assert max_error(got, seen[(0, "q_rope")])[1] > 1e-2
    right = apply(o, [seen[(0, "q_norm")]], [], tuple(seen[(0, "q_rope")].shape), positions=torch.arange(14))
    assert max_error(right, seen[(0, "q_rope")])[1] < REL


def test_gemma3s_plan_gives_each_layer_its_own_rope_and_window(loaded):
    maths = loaded("gemma3", "hf").model.maths()
    plans = maths.plan
    assert [p.attention for p in plans] == ["window"] * 5 + ["global"]
    assert [p.window for p in plans] == [4] * 5 + [None]
    assert [p.rope["base"] for p in plans] == [10_000.0] * 5 + [1_000_000.0]
    assert plans[0].norms == ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")
    assert maths.op(0, "act").const("act") == "gelu_tanh"
    assert maths.op(0, "attn_norm").const("gamma") == "1 + w"
    assert maths.op(None, "embed_scaled").kind == "scale"
    assert maths.operand(0, "^resid_post") == (None, "embed_scaled")  # layer 0 reads the scaled embedding
    assert maths.op(0, "q_rope").inputs == ("q_norm",)
    record = maths.record()
    assert len(record["kinds"]) == 2 and record["layer_kind"] == [0] * 5 + [1]


def test_each_operation_kind_is_declared_once_with_its_words_and_its_evaluator():
    """One home per operation kind (model.maths.OpKind, in one registry): its key, its formula line with its words in
    English and Chinese, its float64 evaluator. The trace schema does not list the kinds (a second list to keep
    equal); the cache's write is the one kind with nothing to recompute. The generic kinds live in model/ops.py, a kind
    only one kind of layer uses in that layer's file."""
    import json

    from llmtrace.errors import LlmtraceError
    from llmtrace.model.maths import LANGS, SHARED_WORDS, Op, OpKind, declare, words_in
    from llmtrace.trace.events import schema_path

    kinds = op_kinds()
    assert {"rmsnorm", "matmul", "ssm_scan", "latent_up", "delta_rule", "mul"} <= set(kinds)
    assert {k for k, d in kinds.items() if d.evaluate is None} == {"cache_write"}
    assert kinds["ssm_scan"].module == "llmtrace.model.kinds.mamba2" and kinds["rmsnorm"].module == "llmtrace.model.ops"
    assert kinds["latent_up"].module == "llmtrace.model.kinds.mla"
    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    assert "enum" not in schema["$defs"]["op_decl"]["properties"]["op"]  # the registry is the one list
    en, zh = (words_in(lang) for lang in LANGS)
    assert en.keys() == zh.keys() >= set(SHARED_WORDS) and all(en[w] != zh[w] or "{" in en[w] for w in en)
    with pytest.raises(LlmtraceError, match="names an operation 'sqrt' that no kind"):  # a trace read back
        Maths.from_record({"model": {"x": {"op": "sqrt"}}, "kinds": [], "layer_kind": []})
    with pytest.raises(ValueError, match="unknown operation 'sqrt'"):  # a model's own declaration
        Op("sqrt")
    with pytest.raises(ValueError, match="declared in llmtrace.model.ops and in"):
        declare("elsewhere", OpKind("rmsnorm", "y = x", lambda *a: ""))
    with pytest.raises(ValueError, match="need an English and a Chinese text"):
        OpKind("probe", "y = x", lambda *a: "", {"probe": ("only English",)})


@pytest.mark.parametrize("name", NAMES)
def test_every_formula_is_said_in_chinese(loaded, name):
    """The zh page's formulas come from the declarations' own Chinese words: no state, MLA or Mamba2 line falls back
    to English (a line may still carry a constant a family writes, such as a scale's label)."""
    import re

    from llmtrace.model.maths import formula, words_in

    maths = loaded(name, "hf").model.maths()
    zh = words_in("zh")
    english = re.compile(r"\b(of|the|per|each|from|for|before|split|into|pairs|turned|row|chosen|elsewhere)\b")
    said = {n: formula(o, n, layer, maths, zh) for layer in range(len(maths.layers))
            for n, o in maths.layers[layer].items()} | {n: formula(o, n, None, maths, zh) for n, o in maths.model.items()}
    labels = {str(o.const("scale_label")) for t in maths.layers for o in t.values() if o.const("scale_label")}
    left = {n: s for n, s in said.items() if english.search(re.sub("|".join(map(re.escape, labels)) or "^$", "", s))}
    assert not left, left
