"""The router ledger: at --trace layers and full each MoE layer emits a `routing` event per forward pass (the K
experts and weights of every position, the router's top probabilities before the cut, its entropy); the terminal
shows it under each step; the summary gives each layer's expert load. Checked against transformers' router on the
tiny Mixtral and Qwen3-MoE (tests/families.py)."""

import json
import math

import pytest
import torch

from families import PROMPT_IDS

import llmtrace
from helpers import undeclared_fields

TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def mixtral(families):
    return llmtrace.load(str(families.hf_dir("mixtral")), device="cpu", dtype="float32")


def routing(events):
    return [e for e in events if e["event"] == "routing"]


def transformers_choice(model, ids):
    """{layer: (experts (T, K), weights (T, K))} from transformers' router modules."""
    out = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, a, res, i=i: out.__setitem__(i, (res[2], res[1]))) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("level", ["layers", "full"])
def test_each_pass_has_a_routing_event_per_moe_layer_as_transformers_routes(families, mixtral, level):
    run = mixtral.generate(TEXT, max_new_tokens=3, trace=level, temperature=0)
    events = routing(run.events)
    assert [(e["step"], e["layer"]) for e in events] == [(s, layer) for s in range(3) for layer in range(2)]
    ids = next(e for e in run.events if e["event"] == "tokens")["tokens"]
    ids = [t["id"] for t in ids] + run.tokens[:2]  # every token a pass has run
    theirs = transformers_choice(families.model("mixtral"), ids)
    for e in events:
        assert e["k"] == 2 and e["n_experts"] == 4 and e["renormalised"]
        for p, chosen, weights, cand, probs, ent in zip(e["positions"], e["experts"], e["weights"], e["candidates"],
                                                         e["probs"], e["entropy"]):
            experts, w = theirs[e["layer"]]
            assert chosen == experts[p].tolist()
            assert max(abs(a - b) for a, b in zip(weights, w[p].tolist())) <= 1e-5
            assert cand[:2] == chosen and len(cand) == 4 and probs == sorted(probs, reverse=True)
            assert 0 <= ent <= math.log2(4) + 1e-6
    prefill = [e for e in events if e["step"] == 0]
    assert all(e["positions"] == list(range(len(ids) - 2)) for e in prefill)
    assert [e["positions"] for e in events if e["step"] == 2] == [[len(ids) - 1]] * 2


def test_the_summary_gives_each_layers_expert_load(mixtral):
    run = mixtral.generate(TEXT, max_new_tokens=4, trace="layers", temperature=0)
    summary = run.events[-1]
    loads = {r["layer"]: r for r in summary["routing"]}
    for layer, r in loads.items():
        counted = [0] * 4
        for e in routing(run.events):
            if e["layer"] == layer:
                for chosen in e["experts"]:
                    for x in chosen:
                        counted[x] += 1
        assert r["load"] == counted and sum(counted) == 2 * r["tokens"]
        assert r["tokens"] == summary["prompt_tokens"] + 3
        assert r["imbalance"] == pytest.approx(max(counted) / (r["tokens"] * 2 / 4), abs=1e-4)


def test_routing_is_not_recorded_at_trace_steps(mixtral):
    run = mixtral.generate(TEXT, max_new_tokens=2, trace="steps")
    assert routing(run.events) == [] and "routing" not in run.events[-1]


def test_routing_events_follow_the_schema(mixtral, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from llmtrace.trace.events import schema_path

    run = mixtral.generate(TEXT, max_new_tokens=2, trace="layers")
    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    for e in run.events:
        assert not list(validator.iter_errors(json.loads(json.dumps(e)))), e["event"]
    assert undeclared_fields(run.events) == []


def test_a_batch_routes_each_row_at_its_own_positions(families):
    """Row 1 is left-padded: its routing starts at its own position 0, and equals the row run alone."""
    lm = llmtrace.load(str(families.hf_dir("qwen3_moe")), device="cpu", dtype="float32")
    long, short = TEXT + " jumps over", "A lazy dog"
    batch = routing(lm.generate([long, short], max_new_tokens=2, trace="layers", temperature=0).events)
    alone = routing(lm.generate(short, max_new_tokens=2, trace="layers", temperature=0).events)
    row1 = [e for e in batch if e.get("row") == 1]
    assert [e["positions"] for e in row1] == [e["positions"] for e in alone]
    assert row1[0]["positions"][0] == 0
    assert [e["experts"] for e in row1] == [e["experts"] for e in alone]


def test_the_terminal_shows_the_routing_under_each_step(capsys, families, tmp_path):
    from helpers import run_cli

    out_file = tmp_path / "t.jsonl"
    code, out, err = run_cli(capsys, "generate", TEXT, "-m", families.hf_dir("mixtral"), "-n", "2", "--trace",
                             "layers", "--jsonl", out_file)
    assert code == 0, err
    events = [json.loads(line) for line in out_file.read_text().splitlines()]
    last = [e for e in routing(events) if e["step"] == 1]
    line = "routing @{}: ".format(last[0]["positions"][-1]) + " · ".join(
        f"L{e['layer']} " + " ".join(f"e{x} {w:.2f}".replace(" 0.", " .") for x, w in zip(e["experts"][-1],
                                                                                        e["weights"][-1]))
        for e in last)
    assert line in out
    assert "expert load" in out and f"L0 {' '.join(map(str, events[-1]['routing'][0]['load']))}" in out
    code, shown, err = run_cli(capsys, "show", out_file)
    assert code == 0 and line in shown


# ----------------------------------------------------------------------------------------------------------------
# compare: the first routing flip beside the first diverging tensor


def test_compare_names_the_first_routing_flip(families, mixtral, capsys):
    from helpers import check_against_schema, run_cli
    from llmtrace.model.capture import capture
    from llmtrace.run.compare import Side, compare
    from llmtrace.run.interventions import Ablate, prepare

    text = "The quick brown fox jumps"
    side = Side(model=str(families.hf_dir("mixtral")), dtype="float32")
    result = compare(side, side.with_changes(interventions=(Ablate(1, expert=2),)), text, max_new_tokens=2)
    doc = result.to_json()
    routing = doc["routing"]
    ids = torch.tensor([doc["ids"]])
    lm = mixtral.loaded
    chosen = {}
    for name, ivs in (("a", []), ("b", [Ablate(1, expert=2)])):  # each side's layer-1 choice, by hand
        edits = prepare(lm, ivs, [doc["n_prompt"]])
        with torch.no_grad(), capture(lm.model, [(1, "router_probs")]) as kept, \
                lm.model.hooked(edits or (lambda *a: None), edits.layers if edits else [], spell_out=False):
            lm.model(ids)
        chosen[name] = kept[(1, "router_probs")][0].topk(2, dim=-1).indices.sort(-1).values.tolist()
    differ = [p for p, (x, y) in enumerate(zip(chosen["a"], chosen["b"])) if x != y]
    assert routing["first"] == {"layer": 1, "position": differ[0], "a": chosen["a"][differ[0]],
                                "b": chosen["b"][differ[0]]}
    assert routing["flips"] == len(differ) and routing["compared"] == 2 * len(doc["ids"])
    assert routing["layers"] == [{"layer": 0, "flips": 0}, {"layer": 1, "flips": len(differ)}]
    sets = lambda e: "{" + ",".join(map(str, e)) + "}"  # noqa: E731
    said = f"routing first flips at layer 1, position {differ[0]}: {sets(chosen['a'][differ[0]])} → " \
           f"{sets(chosen['b'][differ[0]])} ({len(differ)} of {routing['compared']} choices)"
    assert said in result.summary_line() and result.summary_line().startswith("runs part at layer 1, router_probs")
    check_against_schema(doc, result.to_jsonl_events())
    code, out, err = run_cli(capsys, "compare", text, "-m", families.hf_dir("mixtral"), "--b-ablate", "1.e2", "-n", "2")
    assert code == 0 and said in " ".join(out.split()), err


def test_compare_of_a_quantized_moe_says_whether_any_router_flipped(families):
    from llmtrace.run.compare import compare

    result = compare(str(families.gguf("qwen3_moe")), str(families.gguf("qwen3_moe", "q8_0")), "The quick brown fox")
    routing = result.to_json()["routing"]
    assert routing["compared"] == 2 * len(result.ids)
    assert ("routing first flips" in result.summary_line()) == (routing["flips"] > 0)
    assert ("every router chose the same experts" in result.summary_line()) == (routing["flips"] == 0)


# ----------------------------------------------------------------------------------------------------------------
# explain --layer N: the router table for every prompt token


def test_explain_shows_the_router_of_every_prompt_token(families, capsys, tmp_path):
    from helpers import run_cli

    out_file = tmp_path / "e.json"
    code, out, err = run_cli(capsys, "explain", TEXT, "-m", families.hf_dir("qwen3_moe"), "--layer", "1", "--json",
                             out_file)
    assert code == 0, err
    events = json.loads(out_file.read_text())["events"]
    router = next(e for e in events if e.get("section") == "router")
    assert not any(e.get("section") == "ffn" for e in events)  # the dense FFN's section is not there
    ids = [t["id"] for t in next(e for e in events if e["event"] == "tokens")["tokens"]]
    model = families.model("qwen3_moe")
    kept = {}
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, res: kept.update(r=res))
    with torch.no_grad():
        model(torch.tensor([ids]))
    hook.remove()
    logits, weights, experts = kept["r"]
    probs = torch.softmax(logits.float(), dim=-1)
    assert len(router["tokens"]) == len(ids) and (router["n_experts"], router["k"]) == (8, 2)
    for t, r in enumerate(router["tokens"]):
        assert max(abs(a - b) for a, b in zip(r["probs"], probs[t].tolist())) <= 1e-5
        assert r["experts"] == experts[t].tolist()
        assert max(abs(a - b) for a, b in zip(r["weights"], weights[t].tolist())) <= 1e-5
        assert r["cut"] == pytest.approx(sorted(r["probs"])[-2], abs=1e-6)
        assert r["next"] == pytest.approx(sorted(r["probs"])[-3], abs=1e-6)
    assert router["load"] == torch.bincount(experts.flatten(), minlength=8).tolist()
    assert router["check_weights_sum"] <= 1e-6
    layer = next(e for e in events if e.get("section") == "layer")
    lm = llmtrace.load(str(families.hf_dir("qwen3_moe")), device="cpu").loaded
    n_experts = sum(w.numel() for n, w in lm.model.named_parameters() if ".w_" in n)
    assert layer["model_active_params"] == layer["model_params"] - n_experts * 6 // 8
    assert layer["flops"]["router"] == 2 * len(ids) * 64 * 8
    assert layer["flops"]["ffn"] == 2 * 3 * (2 * len(ids) * 64 * 32)
    # the terminal: a row per token, every expert's probability, then the weights; show renders the same
    t = 12
    cells = [f"{p:.2f}".removeprefix("0") for p in router["tokens"][t]["probs"]]
    rows = [line.split() for line in out.splitlines() if line.split()]
    assert any(r[:1] == [str(t)] and r[2:10] == cells for r in rows)
    assert "the router: each token runs 2 of 8 experts" in out and "a token uses" in out
    code, shown, _ = run_cli(capsys, "show", out_file)
    assert code == 0 and "the router: each token runs 2 of 8 experts" in shown


def test_explain_of_a_dense_layer_of_a_moe_model_keeps_the_ffn_section(families):
    lm = llmtrace.load(str(families.hf_dir("qwen3_moe_dense")), device="cpu")
    events = lm.explain(TEXT, layer=1).events
    sections = [e.get("section") for e in events]
    assert "ffn" in sections and "router" not in sections
