"""Direct logit attribution (issue 49 item 3): `model.attribute` and `llmtrace attribute`.

On every family fixture (tests/families.py, HF directories; some GGUF files too) the parts sum to the model's own
logit within 1e-4 of its size. A head's part is checked against a real pass: the head zeroed at its hookable output,
every later sub-layer's addition held at its clean value (so only the head's direct path changes), the post-norms and
the final norm at their clean scales (the frozen scales the parts are defined with): the logit moves by minus the
head's part.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from families import FAMILIES, PROMPT_IDS
from llmtrace.api import Model
from llmtrace.errors import BadValue
from llmtrace.run.attribution import attribute

TOL = 1e-4
TARGET, AGAINST = "e", "a"  # one token each in the fixtures' byte-level BPE (tests/tiny.py)


def closes(r) -> None:
    assert abs(r.total - r.logit) <= TOL * max(1.0, abs(r.logit)), (r.logit, r.total)


# The kinds of part each family's layers add (besides the embedding), from what its layers are: the test fails when a
# kind of layer is not split as its block declares it.
KINDS = {"llama": {"head", "ffn"}, "olmo2": {"head", "ffn"}, "gemma2": {"head", "ffn"}, "mixtral": {"head", "expert"},
         "gpt_oss": {"head", "attn_bias", "expert"}, "qwen3_5": {"linear_head", "head", "ffn"},
         "deepseek_v2": {"head", "ffn", "expert", "shared_experts"},
         "deepseek_v3": {"head", "ffn", "expert", "shared_experts"},
         "granite_hybrid": {"mamba2", "head", "expert", "shared_experts"}, "granite_hybrid_dense": {"mamba2", "head", "ffn"},
         "lfm2": {"short_conv", "head", "ffn"}, "gemma4": {"head", "ffn", "ple"}}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_parts_sum_to_the_logit_on_every_family(loaded, name):
    lm = loaded(name, "hf")
    r = attribute(lm, PROMPT_IDS, TARGET)
    closes(r)
    logits = Model(lm).run_with_hooks(PROMPT_IDS)[0, -1]
    if lm.config.final_softcap is None:  # the model's own logit, the one the parts add up to (Granite's ÷ its scaling)
        assert abs(r.logit - float(logits[r.target["id"]])) <= TOL
    assert list(r.parts)[0] == "embed"
    if name in KINDS:
        assert set(r.kinds.values()) == KINDS[name] | {"embed"}
    layers = {k.split(".")[0] for k in r.by_layer() if k != "embed"}
    assert layers == {str(i) for i in range(lm.config.n_layers)}  # every layer adds parts
    if lm.config.n_experts:
        assert any(k == "expert" for k in r.kinds.values())
    diff = attribute(lm, PROMPT_IDS, TARGET, against=AGAINST)
    closes(diff)
    one = attribute(lm, PROMPT_IDS, AGAINST)
    for n in r.parts:  # a difference of two logits is the difference of their attributions, part by part
        assert diff.parts[n] == pytest.approx(r.parts[n] - one.parts[n], abs=TOL)


def test_the_notes_say_what_was_frozen_and_scaled(loaded):
    """Gemma 4: post-norms frozen, the layer scalar, the soft-cap; Granite: the multipliers and the logits' scale."""
    notes = " ".join(attribute(loaded("gemma4", "hf"), PROMPT_IDS, TARGET).notes)
    assert "post-norms" in notes and "layer scalar" in notes and "soft-cap (logits_raw)" in notes
    notes = " ".join(attribute(loaded("granite_hybrid", "hf"), PROMPT_IDS, TARGET).notes)
    assert "residual multiplier" in notes and "× 0.25" in notes and "post-norms" not in notes


@pytest.mark.parametrize("name", ["llama", "qwen3", "olmo2", "mixtral", "qwen3_moe", "phi3", "qwen3_5", "deepseek_v3",
                                  "granite_hybrid", "lfm2", "gemma4"])
def test_the_parts_sum_to_the_logit_from_a_gguf(loaded, name):
    closes(attribute(loaded(name, "gguf"), PROMPT_IDS, TARGET, against=AGAINST))


def clean_run(model, ids) -> dict:
    """Every point of every layer (and the model's own) in a plain pass, cloned."""
    out: dict = {}
    with torch.no_grad(), model.hooked(lambda i, name, x: out.__setitem__((i, name), x.clone()), spell_out=False):
        model(ids)
    return out


def zeroed_output(lm, clean: dict, layer: int, path, part: str, kind: str) -> torch.Tensor:
    """The output of addition `path` of `layer` (B, T, D) with one part taken out, by a real pass: a head zeroed at its
    merged heads' point (or the point before it, where that one is not editable: the per-head norm of zero is zero),
    an expert's router weight set to 0; a part that is its addition's whole output (a mixer without heads, a dense
    feed-forward, Gemma 4's per-layer input) leaves nothing; the shared experts leave the routed ones."""
    model = lm.model
    module = getattr(model.layers[layer], path.part, None)
    if kind in ("head", "linear_head"):
        points = {p.name: p for p in type(module).declared_points()}
        point = points[module.HEADS[0]]
        point = point if point.editable else points[point.input]
        where = (slice(None), slice(None), int(part.split(".h")[1]))
    elif kind == "expert":
        point = next(p for p in type(module).declared_points() if p.name == "expert_weights")
        where = (Ellipsis, int(part.split(".expert")[1]))
    elif kind == "shared_experts":
        return clean[(layer, path.output)] - clean[(layer, module.shared.output_point())]
    else:
        return torch.zeros_like(clean[(layer, path.output)])
    got: dict = {}

    def edit(i, name, x):
        if i == layer and name == point.name:
            x = x.clone()
            x[where] = 0
            return x
        if i == layer and name == path.output:
            got["out"] = x.clone()
        return None

    with torch.no_grad(), model.hooked(edit, layers=[layer], spell_out=False):
        model(torch.tensor([PROMPT_IDS]))
    return got["out"]


def direct_path_change(lm, clean: dict, layer: int, path, part: str, kind: str, target: int) -> float:
    """The target's logit at the last position with one part of `layer`'s addition `path` taken out (a real pass,
    zeroed_output), every addition to the stream held at its clean value from there on (so that only the part's direct
    path changes; the model's own rescales of the stream still run), the addition's post-norm and the final norm at
    their clean scales (the frozen scales the parts are defined with); minus the clean logit."""
    model = lm.model
    add = path.addition
    delta = zeroed_output(lm, clean, layer, path, part, kind) - clean[(layer, path.output)]  # (1, T, D)
    if add.post_norm:  # through the post-norm, frozen at the clean output's scale
        norm, y = model.norm_of(layer, add.post_norm), clean[(layer, path.output)]
        delta = delta * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    delta = delta * path.factor
    stream: dict = {}

    def held(i, name, x):
        if i is None or i < layer:
            return None
        block = model.layers[i]
        before, prev = {"resid_pre": None}, "resid_pre"
        for a in block.WIRING:  # each addition's total and the stream point before it
            before[a.total], prev = prev, a.total
        if name not in before:
            if block.RESCALE and name == block.RESCALE.total:
                stream["x"] = x  # the model's own rescale of the held stream
            return None
        if before[name] is None:
            stream["x"] = x
            return None
        x = stream["x"] + clean[(i, name)] - clean[(i, before[name])]  # the clean addition
        if i == layer and name == add.total:
            x = x + delta
        stream["x"] = x
        return x

    with torch.no_grad(), model.hooked(held, spell_out=False):
        model(torch.tensor([PROMPT_IDS]))
    x_clean = clean[(lm.config.n_layers - 1, model.wiring()[-1].output)]
    s = torch.rsqrt(x_clean.pow(2).mean(-1, keepdim=True) + model.norm.eps)  # the final norm, frozen
    _, factor = model.logit_path()

    def logit(x):
        return float(F.linear(x * s * model.norm.weight, model.lm_head.weight)[0, -1, target]) * factor

    return logit(stream["x"]) - logit(x_clean)


# the fixtures that differ from another only in what DLA does not see (a tied head, a window, a GGUF's layout)
SAME_PARTS = {"gpt_oss_mxfp4", "qwen3_tied", "qwen3_swa", "phi3_longrope", "qwen3_moe_raw", "qwen3_moe_dense",
              "qwen3_5_tied"}


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - SAME_PARTS))
def test_taking_a_part_out_moves_the_logit_by_its_part(loaded, name):
    """In every layer, the largest part of each kind (a head, an expert, the shared experts, a mixer without heads, a
    dense feed-forward, Gemma 4's per-layer input) taken out of its addition by a real pass: the logit moves by minus
    its part (same tolerance, the norms' scales frozen)."""
    lm = loaded(name, "hf")
    r = attribute(lm, PROMPT_IDS, TARGET)
    clean = clean_run(lm.model, torch.tensor([PROMPT_IDS]))
    largest: dict[str, float] = {}  # each kind's largest part checked
    for layer, wiring in enumerate(lm.model.wiring()):
        for path in wiring.paths:
            mine = [n for n in r.parts if r.sublayers[n] == f"{layer}.{path.part}" and r.kinds[n] != "attn_bias"]
            for kind in sorted({r.kinds[n] for n in mine}):
                part = max((n for n in mine if r.kinds[n] == kind), key=lambda n: abs(r.parts[n]))
                change = direct_path_change(lm, clean, layer, path, part, kind, r.target["id"])
                assert change == pytest.approx(-r.parts[part], abs=TOL), (part, r.parts[part], change)
                largest[kind] = max(largest.get(kind, 0.0), abs(r.parts[part]))
    assert all(v > 10 * TOL for v in largest.values()), largest  # parts that could have been wrong
    assert set(largest) & {"head", "linear_head", "mamba2", "short_conv"}
    assert ("expert" in largest) == bool(lm.config.n_experts)


def test_attribute_refuses_what_it_cannot_split(loaded):
    lm = loaded("llama", "hf")
    with pytest.raises(BadValue, match="one token"):
        attribute(lm, PROMPT_IDS, "every")
    with pytest.raises(BadValue, match="same token"):
        attribute(lm, PROMPT_IDS, TARGET, against=TARGET)
    with pytest.raises(BadValue, match="batch"):
        attribute(lm, [PROMPT_IDS, PROMPT_IDS], TARGET)
    r = Model(lm).attribute(PROMPT_IDS, target=TARGET, position=3)
    assert r.position == 3
    closes(r)
    rec = json.loads(json.dumps(r.record()))
    assert rec["event"] == "attribute" and len(rec["parts"]) == len(r.parts)
    assert sum(r.by_layer().values()) == pytest.approx(r.total, abs=1e-5)


def test_the_command_writes_the_parts_as_json_and_a_page(families, capsys, tmp_path, monkeypatch):
    from helpers import assert_one_line_error, run_cli

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    model = str(families.hf_dir("llama"))
    out, page = tmp_path / "dla.json", tmp_path / "dla.html"
    code, _, err = run_cli(capsys, "attribute", "the quick", "-m", model, "--target", TARGET, "--against", AGAINST,
                           "--json", out, "--html", page, "--top", "3")
    assert code == 0, err
    ev = json.loads(out.read_text())
    assert ev["event"] == "attribute" and abs(ev["total"] - ev["logit"]) <= TOL
    assert sum(p["value"] for p in ev["parts"]) == pytest.approx(ev["logit"], abs=TOL)
    assert "0.h0" in page.read_text()
    code, _, err = run_cli(capsys, "attribute", "the quick", "-m", model)
    assert code == 2 and assert_one_line_error(err, "--target")
    code, _, err = run_cli(capsys, "attribute", "the quick", "-m", model, "--target", "every")
    assert code == 2 and assert_one_line_error(err, "--target", "one token")


def test_parallel_mixers_are_a_declaration(loaded):
    """A block whose feed-forward reads the layer's input beside attention (Falcon-H1's and GPT-J's parallel wiring:
    x + attn(norm(x)) + ffn(norm(x))) is two declared additions, the second reading resid_pre through the same norm:
    its forward pass is that formula, computed by hand from the same weights, and its direct logit attribution closes."""
    import copy

    from llmtrace.model.transformer import Block, Transformer
    from llmtrace.model.wiring import Addition

    class ParallelBlock(Block):
        WIRING = (Addition("attn", "resid_mid", norm="attn_norm"),
                  Addition("ffn", "resid_post", norm="attn_norm", reads="resid_pre"))

    class Parallel(Transformer):
        block = ParallelBlock

    llama = loaded("llama", "hf")
    lm = copy.copy(llama)
    lm.model = Parallel(lm.config).eval()
    lm.model.load_state_dict(llama.model.state_dict())
    x = torch.randn(1, len(PROMPT_IDS), lm.config.d_model, generator=torch.Generator().manual_seed(0))
    block = lm.model.layers[0]
    io = lm.model.layer_inputs(torch.tensor([PROMPT_IDS]))[0]
    with torch.no_grad():
        h = block.attn_norm(x)
        assert torch.allclose(block(x, io), x + block.attn(h, io) + block.ffn(h), atol=1e-5)
        assert not torch.allclose(block(x, io), llama.model.layers[0](x, io), atol=1e-3)  # not Llama's sequential add
    r = attribute(lm, PROMPT_IDS, TARGET)
    closes(r)
    assert {"0.attn", "0.ffn"} <= set(r.by_layer())
