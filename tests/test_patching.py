"""The activation-patching sweep on the real default model, and on a tiny one in the quick suite: every cell equals
the single patched run at that layer and position (llmtrace.run.interventions.Patch, the --patch of generate), and the
metrics are the runs' own."""

import pytest
import torch

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.run.interventions import Patch, prepare
from llmtrace.run.patching import patch_sweep

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
ANSWER, AGAINST = " Paris", " Rome"
# the tiny model's pair: one character apart, as many tokens; its answers are what each prompt predicts (below)
TINY_CLEAN, TINY_CORRUPT = "The quick brown fox", "The Quick brown fox"


@pytest.fixture(scope="module", params=["tiny_lm", pytest.param("smollm", marks=pytest.mark.slow)])
def case(request):
    """(model, clean, corrupt, answer, against, {at: sweep}): SmolLM2 on its prompts (slow: L·T patched runs to
    compare with), and the tiny model on a pair whose answers are each prompt's own top token (quick)."""
    lm = request.getfixturevalue(request.param)
    prompts = (CLEAN, CORRUPT, ANSWER, AGAINST) if request.param == "smollm" else (
        TINY_CLEAN, TINY_CORRUPT, *(one_token_top(lm, text) for text in (TINY_CLEAN, TINY_CORRUPT)))
    return (lm, *prompts, {at: patch_sweep(lm, *prompts, at=at) for at in ("resid_post", "resid_mid")})


@pytest.fixture(scope="module")
def sweeps(case):
    return case[-1]


def one_token_top(lm, text: str) -> str:
    """The most likely next token after `text` whose text encodes back to that one token."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([lm.tokenizer.encode(text)]), last_only=True)[0]
    for i in logits.topk(20).indices.tolist():
        piece = lm.tokenizer.decode([i])
        if lm.tokenizer.encode(piece, add_special_tokens=False) == [i]:
            return piece
    raise AssertionError("no top token of the tiny model encodes back to itself")


@torch.inference_mode()
def single_metric(lm, ids, interventions, a, b):
    edits = prepare(lm, interventions, [len(ids)])
    with lm.model.hooked(edits, edits.layers, spell_out=False) if edits else torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), last_only=True)[0].float()
    return (logits[a] - logits[b]).item()


@pytest.mark.parametrize("at", ["resid_post", "resid_mid"])
def test_every_cell_equals_the_single_patch_run(case, at):
    """Every cell at resid_post; at resid_mid (the same code, another edit point) every layer at the last position and
    every position at layer 10 (the tiny model: layer 1), to keep the test's minutes down."""
    smollm, CLEAN, CORRUPT, *_, sweeps = case  # the model: SmolLM2 or the tiny one
    mid = 10 if smollm.config.n_layers > 10 else 1
    sw = sweeps[at]
    ids = smollm.tokenizer.encode(CORRUPT)
    a, b = sw["answer"]["id"], sw["against"]["id"]
    assert len(ids) == sw["n_positions"] and len(sw["cells"]) == sw["n_layers"] * len(ids)
    assert sw["clean_metric"] == pytest.approx(single_metric(smollm, smollm.tokenizer.encode(CLEAN), [], a, b), abs=1e-4)
    assert sw["corrupt_metric"] == pytest.approx(single_metric(smollm, ids, [], a, b), abs=1e-4)
    assert sw["clean_metric"] > 0 > sw["corrupt_metric"]  # the prompts do what the sweep needs
    worst = 0.0
    T = sw["n_positions"]
    for cell in sw["cells"]:
        if at != "resid_post" and cell["position"] != T - 1 and cell["layer"] != mid:
            continue
        single = single_metric(smollm, ids, [Patch(cell["layer"], at, cell["position"], CLEAN)], a, b)
        worst = max(worst, abs(cell["metric"] - single))
        rec = (single - sw["corrupt_metric"]) / (sw["clean_metric"] - sw["corrupt_metric"])
        assert cell["recovery"] == pytest.approx(rec, abs=1e-4)
    assert worst < 1e-4


def test_the_sweep_shows_the_known_pattern(case, sweeps):
    """Causal tracing's picture: patching the subject token early recovers the answer; at the last layers only the
    last position does; a position where the prompts agree and nothing has been patched before recovers nothing.
    (The tiny model's random weights make no picture of a subject: it checks the last two.)"""
    sw = sweeps["resid_post"]
    T, L = sw["n_positions"], sw["n_layers"]
    cell = {(c["layer"], c["position"]): c["recovery"] for c in sw["cells"]}
    assert cell[(L - 1, T - 1)] == pytest.approx(1.0, abs=1e-3)  # the last layer's last position is the clean run's
    assert abs(cell[(0, 0)]) < 1e-4  # position 0 (BOS-less "The") is the same token in both prompts
    diff = [p for p in range(T) if sw["clean_tokens"][p] != sw["corrupt_tokens"][p]]
    if case[0].config.n_layers == 30:
        assert max(cell[(0, p)] for p in diff) > 0.5


@pytest.mark.slow
def test_bad_input(smollm):
    with pytest.raises(BadValue, match=r"' Parisian' must be one token; it is 2: ' Paris', 'ian'"):
        patch_sweep(smollm, CLEAN, CORRUPT, " Parisian", AGAINST)
    with pytest.raises(LlmtraceError, match="clean prompt has 9 tokens and the corrupt prompt 4"):
        patch_sweep(smollm, CLEAN, "The city of Rome", ANSWER, AGAINST)
    with pytest.raises(BadValue, match="not a residual-stream point"):
        patch_sweep(smollm, CLEAN, CORRUPT, ANSWER, AGAINST, at="attn")
