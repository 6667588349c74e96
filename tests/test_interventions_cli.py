"""Interventions and the patching sweep on the command line: one `error:` line for each bad input, and the run event
and header list what was applied."""

import json

import pytest

from helpers import fails, run_cli, undeclared_fields

P = "The capital of France is"


@pytest.mark.parametrize("argv, says", [
    (["--patch", "8.resid_post@-1"], ("--patch 8.resid_post@-1", "needs --from")),
    (["--patch", "8.resid@0", "--from", "x"], ("--patch 8.resid@0", "unknown point 'resid'", "resid_post")),
    (["--from", "x"], ("--from", "--patch")),
    (["--steer", "3", "--toward", "x"], ("--steer 3", "--away-from missing")),
    (["--toward", "x", "--away-from", "y"], ("--steer",)),
    (["--ablate", "3.mlp"], ("--ablate", "'3.mlp'", "L.hH")),
    (["--ablate", "3.h2=zero"], ("--ablate", "mean")),
    (["--scale", "3.h2=big"], ("--scale", "number")),
    (["--control-vector", "missing.gguf:0.5"], ("--control-vector", "missing.gguf", "no such file")),
])
@pytest.mark.parametrize("command", ["generate", "lens"])
def test_bad_intervention_before_the_load(capsys, command, argv, says):
    fails(capsys, 2, command, P, *argv, "-m", "no-such-model-is-loaded", says=says)


def test_compile_with_interventions(capsys):
    fails(capsys, 2, "generate", P, "--compile", "--ablate", "3.h2", "-m", "nothing", says=("--compile", "interventions"))


def test_patch_bad_at_before_the_load(capsys):
    fails(capsys, 2, "patch", "--clean", "a", "--corrupt", "b", "--answer", "x", "--against", "y", "--at", "attn_out",
          "-m", "nothing", says=("--at 'attn_out'", "resid_pre, resid_mid, resid_post"))


@pytest.mark.slow
@pytest.mark.parametrize("argv, says", [
    (["--ablate", "3.h9"], ("--ablate 3.h9", "head 9 is out of range", "9 query heads (0..8)")),
    (["--ablate", "30.ffn"], ("--ablate 30.ffn", "layer 30 is out of range", "30 layers (0..29")),
    (["--patch", "8.resid_post@5", "--from", "x"], ("--patch 8.resid_post@5", "position 5", "5 tokens (0..4")),
    (["--patch", "8.h2@3", "--from", "Hi"], ("--patch 8.h2@3", "position 3", "--from text has 1 token (0..0")),
    (["--steer", "31", "--toward", "a", "--away-from", "b"], ("--steer 31", "layer 31 is out of range")),
])
def test_bad_intervention_after_the_load(capsys, argv, says):
    fails(capsys, 2, "generate", P, "-n", "1", *argv, says=says)


@pytest.mark.slow
def test_patch_bad_tokens(capsys):
    fails(capsys, 2, "patch", "--clean", "The Eiffel Tower is in", "--corrupt", "The Colosseum is in", "--answer",
          " Parisian", "--against", " Rome", says=("--answer ' Parisian' must be one token", "' Paris', 'ian'"))
    fails(capsys, 1, "patch", "--clean", "The Eiffel Tower is in Paris", "--corrupt", "Rome", "--answer", " Paris",
          "--against", " Rome", says=("clean prompt has 7 tokens", "corrupt prompt 1"))


@pytest.mark.slow
def test_run_event_and_header_list_the_interventions(capsys, tmp_path):
    out = tmp_path / "t.json"
    code, stdout, err = run_cli(capsys, "generate", P, "-n", "2", "--ablate", "3.h2", "--scale", "4.attn=0.5",
                                "--json", out)
    assert code == 0, err
    assert "interventions · ablate 3.h2 · scale 4.attn=0.5" in stdout
    events = json.loads(out.read_text())["events"]
    run = events[0]
    assert [iv["spec"] for iv in run["interventions"]] == ["3.h2", "4.attn=0.5"]
    assert run["interventions"][0] | {"label": None} == {"kind": "ablate", "spec": "3.h2", "label": None, "layer": 3,
                                                          "head": 2, "part": "head", "mean": False}
    assert not undeclared_fields(events)
    from llmtrace.report.write import build

    page = build(events, None)  # the report names the intervened layers and heads in the run's facts
    assert "ablate 3.h2 · scale 4.attn=0.5 (changes layer 3 head 2, layer 4)" in page


@pytest.mark.slow
def test_patch_command(capsys, tmp_path):
    out, page = tmp_path / "sweep.json", tmp_path / "sweep.html"
    code, stdout, err = run_cli(capsys, "patch", "--clean", "The Eiffel Tower is in", "--corrupt", "The Colosseum is in",
                                "--answer", " Paris", "--against", " Rome", "--json", out, "--html", page)
    assert code == 0, err
    ev = json.loads(out.read_text())["events"][0]
    assert ev["event"] == "patch" and len(ev["cells"]) == ev["n_layers"] * ev["n_positions"]
    assert set(ev["cells"][0]) == {"layer", "position", "metric", "recovery"}
    assert not undeclared_fields([ev])
    assert all(len(line) <= 100 for line in stdout.splitlines())  # the tests' console is 100 wide (make_console)
    assert "L29" in stdout and "Col" in stdout
    html = page.read_text()
    assert "<script" not in html and "http" not in html.replace("http-equiv", "")
    assert html.count("<td style") == len(ev["cells"])


@pytest.mark.slow
def test_lens_takes_interventions(capsys, tmp_path):
    """lens with layer 0's attention ablated: the model section lists it and the last layer's prediction changes."""
    plain, ablated = tmp_path / "plain.json", tmp_path / "ablated.json"
    assert run_cli(capsys, "lens", P, "--layers", "29", "--json", plain)[0] == 0
    code, stdout, err = run_cli(capsys, "lens", P, "--layers", "29", "--ablate", "0.attn", "--json", ablated)
    assert code == 0, err
    events = json.loads(ablated.read_text())["events"]
    assert events[0]["interventions"][0]["spec"] == "0.attn"

    def last_top(path):
        evs = json.loads(path.read_text())["events"]
        return [e["topk"][0]["text"] for e in evs if e["event"] == "lens" and e["stage"] == "logits"][-1]
    assert last_top(plain) == " Paris" and last_top(ablated) != " Paris"
