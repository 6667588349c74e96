"""generate --save-tensors and llmtrace diff: two saved runs compared, with their tensors or with what the traces hold."""

import json
import shutil

import pytest

from helpers import SPEC, check_against_schema, fails, perturbed_copy, run_cli, save_hf, undeclared_fields
from tiny import PROMPT, make_hf_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    return save_hf(root / "a", make_hf_model(SPEC)), save_hf(root / "b", perturbed_copy(1, "mlp.down_proj.weight"))


def saved_run(capsys, model, where, name, *extra, prompt=PROMPT):
    trace, tensors = where / f"{name}.json", where / f"{name}.safetensors"
    code, _, err = run_cli(capsys, "generate", prompt, "-m", model, "-n", "3", "--trace", "full", "--json", trace,
                           "--save-tensors", tensors, *extra)
    assert code == 0, err
    return trace, tensors


def test_saved_tensors_are_the_recorded_values_tied_to_the_trace(dirs, tmp_path, capsys):
    from safetensors import safe_open

    trace, tensors = saved_run(capsys, dirs[0], tmp_path, "a")
    events = json.loads(trace.read_text())["events"]
    run = events[0]
    assert run["tensors"]["file"] == str(tensors) and len(run["tensors"]["key"]) == 32
    assert undeclared_fields(events) == []
    with safe_open(str(tensors), framework="pt") as f:
        assert f.metadata()["key"] == run["tensors"]["key"]
        names = set(f.keys())
        q = f.get_tensor("0/1/q")
    n_prompt = events[1]["count"]
    assert q.shape == (n_prompt, SPEC.n_heads, SPEC.d_model // SPEC.n_heads)
    assert {"0/model/embed", "0/model/logits", "2/2/resid_post", "0/0/probs"} <= names
    assert not any(n.endswith(("/kv_write", "/k_repeated")) for n in names)
    # the statistics the trace holds are those of the stored values
    ev = next(e for e in events if e["event"] == "tensor" and (e["step"], e["layer"], e["name"]) == (0, 1, "q"))
    assert ev["stats"]["norm"] == pytest.approx(q.double().norm().item(), rel=1e-5)


def test_diff_of_a_run_and_its_repeat_agrees(dirs, tmp_path, capsys):
    a, _ = saved_run(capsys, dirs[0], tmp_path, "a")
    b, _ = saved_run(capsys, dirs[0], tmp_path, "b")
    out = tmp_path / "d.json"
    code, stdout, err = run_cli(capsys, "diff", a, b, "--json", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["source"] == "diff" and doc["first_divergence"] is None
    assert doc["kld_max"] == 0 and doc["same_top"] == 1
    assert stdout.startswith("runs agree within 0.0001")


def test_diff_with_tensors_finds_the_perturbed_matrix_as_compare_does(dirs, tmp_path, capsys):
    from llmtrace.run.compare import compare
    from llmtrace.run.diff import diff_traces

    a, _ = saved_run(capsys, dirs[0], tmp_path, "a")
    b, _ = saved_run(capsys, dirs[1], tmp_path, "b")
    d = diff_traces(str(a), str(b))
    fd = d.first_divergence
    assert (fd["layer"], fd["point"]) == (1, "down")
    assert all(lay["added_rel_err"] is None for lay in d.layers)  # that needs B's layer on A's input: compare only
    # the prompt's positions: the same per-position errors compare computes with both models loaded
    c = compare(str(dirs[0]), str(dirs[1]), PROMPT)
    n = c.n_prompt
    for lay_d, lay_c in zip(d.layers, c.layers):
        pd = {p["point"]: p for p in lay_d["points"]}
        for pc in lay_c["points"]:
            got = pd[pc["point"]]["per_position"]["rel_err"][:n]
            assert got == pytest.approx(pc["per_position"]["rel_err"], rel=1e-2, abs=1e-6), (lay_c["layer"], pc["point"])
    # KLD where the logits were recorded: the last position of each pass
    assert sum(p["kld"] is not None for p in d.positions) == 3
    assert d.kld_max > 0
    from llmtrace.trace.comparison import jsonl_events

    check_against_schema(d.to_json(), jsonl_events(d.to_json()))


def test_diff_without_tensors_compares_what_the_traces_hold(dirs, tmp_path, capsys):
    a, _ = saved_run(capsys, dirs[0], tmp_path, "a")
    b, _ = saved_run(capsys, dirs[1], tmp_path, "b")
    out = tmp_path / "d.json"
    code, stdout, err = run_cli(capsys, "diff", a, b, "--no-tensors", "--json", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    held = doc["diff"]
    assert held["tokens"]["a"] and "first_different_step" in held["tokens"]
    assert held["statistics"]["compared"] > 0
    fd = doc["first_divergence"]
    # a norm is a lower bound of the error: the first point it shows is at or after the perturbed one, never before
    assert fd["basis"] == "norm" and fd["layer"] is not None and fd["layer"] >= 1
    before = [p for p in held["statistics"]["points"] if p["step"] == 0 and p["layer"] in (None, 0)
              and p["point"] not in ("final_norm", "logits", "last")]
    assert before and all(p["norm_rel_diff"] == 0 for p in before)
    assert doc["kld_mean"] is None and doc["same_top"] is not None
    assert [s["step"] for s in held["steps"]] == [0, 1, 2]
    assert "tokens:" in stdout and "statistics:" in stdout


def test_diff_refuses_different_prompts(dirs, tmp_path, capsys):
    a, _ = saved_run(capsys, dirs[0], tmp_path, "a")
    b, _ = saved_run(capsys, dirs[0], tmp_path, "b", prompt="Hello world")
    fails(capsys, 1, "diff", a, b, says=("different prompts",))


def test_diff_refuses_a_tensors_file_of_another_run(dirs, tmp_path, capsys):
    a, ta = saved_run(capsys, dirs[0], tmp_path, "a")
    b, tb = saved_run(capsys, dirs[0], tmp_path, "b")
    shutil.copy(tb, ta)  # B's tensors where A's trace expects its own
    fails(capsys, 1, "diff", a, b, says=("does not belong to", str(a)))
    ta.unlink()
    fails(capsys, 1, "diff", a, b, says=("not there",))
    ta.write_bytes(b"not a safetensors file")
    fails(capsys, 1, "diff", a, b, says=("not a safetensors file",))


def test_diff_refuses_traces_without_common_points(dirs, tmp_path, capsys):
    traces = []
    for name, layers in (("a", "0"), ("b", "1")):
        t = tmp_path / f"{name}.json"
        code, _, err = run_cli(capsys, "generate", PROMPT, "-m", dirs[0], "-n", "1", "--layers", layers, "--json", t)
        assert code == 0, err
        traces.append(t)
    fails(capsys, 1, "diff", *traces, says=("no recorded point in common",))


def test_save_tensors_bad_input(dirs, tmp_path, capsys):
    fails(capsys, 2, "generate", "Hi", "--save-tensors", tmp_path / "t.pt", "--json", tmp_path / "t.json",
          says=(".safetensors",))
    fails(capsys, 2, "generate", "Hi", "--save-tensors", tmp_path / "t.safetensors", says=("--json FILE",))
    fails(capsys, 2, "generate", "-p", "a", "-p", "b", "--save-tensors", tmp_path / "t.safetensors", "--json",
          tmp_path / "t.json", says=("batch",))
    fails(capsys, 2, "diff", "a.json", "b.json", "--tolerance", "-1", says=("--tolerance",))
    fails(capsys, 1, "diff", tmp_path / "nothing.json", tmp_path / "nothing.json", says=("nothing.json",))


def test_diff_of_partial_traces_names_the_layers_not_recorded(dirs, tmp_path, capsys):
    from llmtrace.run.diff import diff_traces

    a, _ = saved_run(capsys, dirs[0], tmp_path, "a", "--layers", "0,-1")
    b, _ = saved_run(capsys, dirs[1], tmp_path, "b", "--layers", "0,-1")
    d = diff_traces(str(a), str(b))
    assert (d.first_divergence["layer"], d.first_divergence["point"]) == (2, "attn_norm")  # layer 1 was not recorded
    assert any("not recorded by both runs (1)" in n for n in d.notes)
    assert d.layers[1]["points"] == [] and d.layers[1]["rel_err"] is None


@pytest.mark.parametrize("tensors", [True, False], ids=["tensors", "no-tensors"])
def test_diff_html_writes_the_comparison_page(dirs, tmp_path, capsys, tensors):
    """`diff --html` (the README's example) writes the comparison page, with or without --no-tensors."""
    a, _ = saved_run(capsys, dirs[0], tmp_path, "a")
    b, _ = saved_run(capsys, dirs[1], tmp_path, "b")
    page, doc_path = tmp_path / "diff.html", tmp_path / "diff.json"
    code, stdout, err = run_cli(capsys, "diff", a, b, "--html", page, "--json", doc_path,
                                *([] if tensors else ["--no-tensors"]))
    assert code == 0 and "Traceback" not in err, err
    assert f"wrote {page}" in err
    html = page.read_text()
    doc = json.loads(doc_path.read_text())
    from llmtrace.run.compare import summary_line

    assert html.startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    import html as html_lib

    answer = html.split('id="answer">')[1].split("</p>")[0]
    assert html_lib.unescape(answer) == summary_line(doc)
    assert " ".join(stdout.split()).startswith(summary_line(doc))
    assert ('id="heat-svg"' in html) == tensors  # the heat strip needs per-point tensors


def test_diff_without_tensors_says_what_came_before_within_the_tolerance(dirs, tmp_path, capsys):
    """When points before the first over the tolerance differ by less than it, the line says so and gives the
    largest difference before it, never "identical"."""
    from llmtrace.run.diff import diff_traces

    a, _ = saved_run(capsys, dirs[0], tmp_path, "a")
    b, _ = saved_run(capsys, dirs[1], tmp_path, "b")
    tiny = diff_traces(str(a), str(b), tolerance=1e-12, tensors=False)
    points = tiny.diff["statistics"]["points"]
    first = tiny.first_divergence
    at = next(i for i, p in enumerate(points) if (p["step"], p["layer"], p["point"]) ==
              (first["step"], first["layer"], first["point"]))
    # a tolerance just above the first difference: the divergence moves later, and what came before differs
    loose = diff_traces(str(a), str(b), tolerance=first["rel_err"] * 1.01, tensors=False)
    fd = loose.first_divergence
    later = next(i for i, p in enumerate(points) if (p["step"], p["layer"], p["point"]) ==
                 (fd["step"], fd["layer"], fd["point"]))
    assert later > at
    largest = max(p["norm_rel_diff"] for p in points[:later] if p["step"] <= fd["step"])
    assert largest > 0 and loose.to_json()["max_rel_err_before"] == pytest.approx(largest, rel=1e-3)
    line = loose.summary_line()
    assert "identical" not in line and "the same" not in line
    assert line.endswith(f"every norm before it within the tolerance (largest difference {largest:.1e})"
                         .replace("e-0", "e-"))
    # and with nothing before it, the same norms are said to be the same, not the tensors identical
    assert tiny.summary_line().endswith("every norm before it the same")
