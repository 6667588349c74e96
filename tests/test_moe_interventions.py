"""Interventions on experts (run/interventions.py), each against the same operation done by hand on transformers'
model: --ablate L.eK sets expert K's router score to -inf before the softmax (the next best expert runs; with
norm_topk_prob false the other probabilities change too), --scale L.eK=α multiplies its output (by hand: its W_down
times α). Logits within 1e-4 at every position and greedy tokens identical."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from families import PROMPT_IDS

from llmtrace.checkpoint.load import load_model
from llmtrace.model.capture import capture
from llmtrace.run.interventions import Ablate, Scale, parse_ablate, parse_scale, prepare, record
from llmtrace.run.generate import generate
from llmtrace.run.sampler import Sampler, SamplerConfig

TOL = 1e-4


def ablated_router(router, expert: int, renormalise: bool):
    """transformers' router (MixtralTopKRouter, Qwen3MoeTopKRouter), its forward written out with expert's score
    set to -inf before the softmax."""
    def forward(hidden):
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        logits[:, expert] = float("-inf")
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        if renormalise:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx
    return forward


def busiest_expert(lm, layer: int) -> int:
    """The expert layer `layer` runs most often over PROMPT_IDS: ablating it changes something."""
    with torch.no_grad(), capture(lm.model, [(layer, "router_probs")]) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    chosen = kept[(layer, "router_probs")][0].topk(lm.config.n_experts_used, dim=-1).indices
    return int(torch.bincount(chosen.flatten(), minlength=lm.config.n_experts).argmax())


def ours(lm, interventions, n_new: int = 8):
    """llmtrace's logits (T, V) over PROMPT_IDS and its greedy tokens, with the interventions."""
    edits = prepare(lm, interventions, [len(PROMPT_IDS)])
    with torch.no_grad(), lm.model.hooked(edits or (lambda *a: None), edits.layers if edits else [], spell_out=False):
        logits = lm.model(torch.tensor([PROMPT_IDS]))[0]
    sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
    tokens = generate(lm, PROMPT_IDS, sampler, n_new, (), True, None, interventions=interventions).tokens
    return logits, list(tokens)


def theirs(model, n_new: int = 8):
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0]
        out = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    return logits, out[0, len(PROMPT_IDS):].tolist()


def check(lm, model, interventions):
    (a, tokens_a), (b, tokens_b) = ours(lm, interventions), theirs(model)
    assert float((a - b).abs().max()) <= TOL
    assert tokens_a == tokens_b


@pytest.mark.parametrize("name, layer", [("mixtral", 1), ("qwen3_moe_raw", 0)])
def test_ablating_an_expert_is_its_router_score_at_minus_infinity(families, name, layer):
    lm = load_model(str(families.hf_dir(name)), device="cpu", dtype="float32")
    expert = busiest_expert(lm, layer)
    model = copy.deepcopy(families.model(name))
    router = model.model.layers[layer].mlp.gate
    router.forward = ablated_router(router, expert, renormalise=lm.config.norm_topk_prob)
    before, _ = ours(lm, [])
    check(lm, model, [Ablate(layer, expert=expert)])
    after, _ = ours(lm, [Ablate(layer, expert=expert)])
    assert float((before - after).abs().max()) > 1e-2  # the ablation bites
    with torch.no_grad(), capture(lm.model, [(layer, "router_probs")]) as kept:  # and the expert is never chosen
        edits = prepare(lm, [Ablate(layer, expert=expert)], [len(PROMPT_IDS)])
        with lm.model.hooked(edits, edits.layers, spell_out=False):
            lm.model(torch.tensor([PROMPT_IDS]))
    probs = kept[(layer, "router_probs")][0]
    assert float(probs[:, expert].abs().max()) == 0.0
    assert expert not in probs.topk(lm.config.n_experts_used, dim=-1).indices.flatten().tolist()


@pytest.mark.parametrize("name, layer, factor", [("mixtral", 0, 2.5), ("qwen3_moe", 1, 0.0)])
def test_scaling_an_expert_scales_its_output(families, name, layer, factor):
    lm = load_model(str(families.hf_dir(name)), device="cpu", dtype="float32")
    expert = busiest_expert(lm, layer)
    model = copy.deepcopy(families.model(name))
    with torch.no_grad():
        model.model.layers[layer].mlp.experts.down_proj[expert] *= factor  # W_down of that expert, by hand
    check(lm, model, [Scale(layer, factor, expert=expert)])


def test_an_expert_from_the_command_line_and_in_the_run_facts():
    a, s = parse_ablate("3.e5"), parse_scale("-1.e0=0.5")
    assert (a.layer, a.part, a.expert, a.spec) == (3, "expert", 5, "3.e5")
    assert (s.layer, s.part, s.expert, s.factor, s.spec) == (-1, "expert", 0, 0.5, "-1.e0=0.5")
    assert record(a) == {"kind": "ablate", "spec": "3.e5", "label": "ablate 3.e5", "layer": 3, "head": None,
                         "part": "expert", "mean": False, "expert": 5}
    assert "expert" not in record(parse_ablate("3.h2"))


@pytest.mark.parametrize("argv, says", [
    (["--ablate", "1.e4"], ("1.e4", "expert 4 is out of range", "4 experts (0..3)")),
    (["--scale", "0.e9=2"], ("0.e9=2", "expert 9 is out of range")),
    (["--ablate", "1.e0", "--ablate", "1.e1", "--ablate", "1.e2"], ("at most 2 may be ablated",)),
    (["--ablate", "2.e0"], ("layer 2 is out of range",)),
])
def test_a_bad_expert_is_one_line(capsys, families, argv, says):
    from helpers import fails

    fails(capsys, 2, "generate", "hi", "-m", families.hf_dir("mixtral"), "-n", "1", *argv, says=says)


def test_an_expert_of_a_dense_layer_or_model_is_refused(capsys, families, tmp_path):
    from helpers import fails

    fails(capsys, 2, "generate", "hi", "-m", families.hf_dir("qwen3_moe_dense"), "-n", "1", "--ablate", "1.e0",
          says=("layer 1 has a dense feed-forward",))
    fails(capsys, 2, "generate", "hi", "-m", families.hf_dir("qwen3"), "-n", "1", "--scale", "0.e0=2",
          says=("this model has no experts",))


def test_the_trace_and_the_api_say_the_expert_intervention(families):
    import llmtrace

    lm = llmtrace.load(str(families.hf_dir("mixtral")), device="cpu", dtype="float32")
    run = lm.generate("The quick brown fox", max_new_tokens=2, trace="layers", interventions=[Ablate(1, expert=2)])
    facts = next(e for e in run.events if e["event"] == "run")["interventions"]
    assert facts == [record(Ablate(1, expert=2))]
    jsonschema = pytest.importorskip("jsonschema")
    from llmtrace.trace.events import schema_path

    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    assert not list(validator.iter_errors(json.loads(json.dumps(run.events[0]))))
    assert all(2 not in chosen for e in run.events if e["event"] == "routing" and e["layer"] == 1
               for chosen in e["experts"])
