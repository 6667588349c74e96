"""The activation-patching sweep on the real default model: every cell equals the single patched run at that layer
and position (llmtrace.run.interventions.Patch, the --patch of generate), and the metrics are the runs' own."""

import pytest
import torch

from llmtrace.errors import BadValue, LlmtraceError
from llmtrace.run.interventions import Patch, prepare
from llmtrace.run.patching import patch_sweep

pytestmark = pytest.mark.slow  # the real model, L·T patched runs to compare with

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
ANSWER, AGAINST = " Paris", " Rome"


@pytest.fixture(scope="module")
def sweeps(smollm):
    return {at: patch_sweep(smollm, CLEAN, CORRUPT, ANSWER, AGAINST, at=at) for at in ("resid_post", "resid_mid")}


@torch.inference_mode()
def single_metric(lm, ids, interventions, a, b):
    edits = prepare(lm, interventions, [len(ids)])
    with lm.model.hooked(edits, edits.layers, spell_out=False) if edits else torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), last_only=True)[0].float()
    return (logits[a] - logits[b]).item()


@pytest.mark.parametrize("at", ["resid_post", "resid_mid"])
def test_every_cell_equals_the_single_patch_run(smollm, sweeps, at):
    """Every cell at resid_post; at resid_mid (the same code, another edit point) every layer at the last position and
    every position at layer 10, to keep the test's minutes down."""
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
        if at != "resid_post" and cell["position"] != T - 1 and cell["layer"] != 10:
            continue
        single = single_metric(smollm, ids, [Patch(cell["layer"], at, cell["position"], CLEAN)], a, b)
        worst = max(worst, abs(cell["metric"] - single))
        rec = (single - sw["corrupt_metric"]) / (sw["clean_metric"] - sw["corrupt_metric"])
        assert cell["recovery"] == pytest.approx(rec, abs=1e-4)
    assert worst < 1e-4


def test_the_sweep_shows_the_known_pattern(sweeps):
    """Causal tracing's picture: patching the subject token early recovers the answer; at the last layers only the
    last position does; a position where the prompts agree and nothing has been patched before recovers nothing."""
    sw = sweeps["resid_post"]
    T, L = sw["n_positions"], sw["n_layers"]
    cell = {(c["layer"], c["position"]): c["recovery"] for c in sw["cells"]}
    assert cell[(L - 1, T - 1)] == pytest.approx(1.0, abs=1e-3)  # the last layer's last position is the clean run's
    assert abs(cell[(0, 0)]) < 1e-4  # position 0 (BOS-less "The") is the same token in both prompts
    diff = [p for p in range(T) if sw["clean_tokens"][p] != sw["corrupt_tokens"][p]]
    assert max(cell[(0, p)] for p in diff) > 0.5


def test_bad_input(smollm):
    with pytest.raises(BadValue, match=r"' Parisian' must be one token; it is 2: ' Paris', 'ian'"):
        patch_sweep(smollm, CLEAN, CORRUPT, " Parisian", AGAINST)
    with pytest.raises(LlmtraceError, match="clean prompt has 9 tokens and the corrupt prompt 4"):
        patch_sweep(smollm, CLEAN, "The city of Rome", ANSWER, AGAINST)
    with pytest.raises(BadValue, match="not a residual-stream point"):
        patch_sweep(smollm, CLEAN, CORRUPT, ANSWER, AGAINST, at="attn")
