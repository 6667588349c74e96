"""The Python API (llmtrace/api.py): the notebook example of docs/api.md, run as written, gives the CLI's tokens and
traces; its errors are the project's exceptions naming the keyword; `import llmtrace` stays light."""

import json
import subprocess
import sys

import pytest

import llmtrace
from helpers import run_cli

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(smollm_path):  # smollm_path: the real model is in the tests' cache (and these tests are marked slow)
    return llmtrace.load("smollm2-135m-instruct")  # as the example writes it: the registry's name


def kinds(events: list[dict]) -> list[tuple]:
    return [(e["event"], e.get("section"), e.get("step"), e.get("phase")) for e in events]


def test_the_example_runs_as_written_and_its_greedy_tokens_are_the_clis(model, capsys, tmp_path):
    run = model.generate("The capital of France is", max_new_tokens=8, temperature=0, trace="steps", layers=None)
    code, out, err = run_cli(capsys, "generate", PROMPT, "-n", "8", "--temperature", "0", "--json", "-")
    assert code == 0, err
    cli = json.loads(out)["events"]
    assert run.tokens == cli[-1]["tokens"] and len(run.tokens) == 8
    assert run.text == cli[-1]["text"] and run.text.strip()
    assert kinds(run.events) == kinds(cli)  # the same trace, event by event
    assert [e["topk"] for e in run.events if e["event"] == "step"] == [e["topk"] for e in cli if e["event"] == "step"]

    # saved either way, read back by the API and by `llmtrace show`
    for name in ("trace.jsonl", "trace.json"):
        path = run.save(tmp_path / name)
        back = llmtrace.read_trace(path)
        assert back.events == run.events and back.tokens == run.tokens
        code, out, err = run_cli(capsys, "show", path)
        assert code == 0 and run.text.strip().split()[0] in out, err
    page = run.report(tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html") and "Paris" in page
    inline = run._repr_html_()
    assert inline.startswith("<iframe") and "srcdoc=" in inline and "<script" not in inline  # escaped into srcdoc


def test_explain_and_lens_return_the_clis_traces(model, capsys):
    explained = model.explain("The capital of France is", layer=3)
    code, out, err = run_cli(capsys, "explain", PROMPT, "--layer", "3", "--json", "-")
    assert code == 0, err
    assert explained.events == json.loads(out)["events"] and explained.text is None
    lensed = model.lens("The capital of France is")
    code, out, err = run_cli(capsys, "lens", PROMPT, "--json", "-")
    assert code == 0, err
    assert lensed.events == json.loads(out)["events"]


def test_a_list_of_prompts_is_a_batch_whose_rows_are_the_single_runs(model):
    single = model.generate(PROMPT, max_new_tokens=4, trace="none")
    batch = model.generate([PROMPT, "Hi"], max_new_tokens=4, trace="none")
    assert [r["row"] for r in batch.rows] == [0, 1]
    assert batch.rows[0]["tokens"] == single.tokens == batch.tokens


@pytest.mark.parametrize("call, says", [
    (lambda m: m.generate(PROMPT, temperature=-1), "temperature must be >= 0"),
    (lambda m: m.generate(PROMPT, top_p=0), "top_p must be in (0, 1]"),
    (lambda m: m.generate(PROMPT, max_new_tokens=-1), "max_new_tokens must be ≥ 0"),
    (lambda m: m.generate(PROMPT, logit_bias={10**9: 1.0}), "outside the vocabulary"),
    (lambda m: m.generate(PROMPT, layers="0,99"), "99"),
    (lambda m: m.generate(PROMPT, system="be brief"), "system only applies with chat"),
    (lambda m: m.generate(PROMPT, temprature=0), "unknown keyword 'temprature'"),
    (lambda m: m.explain(PROMPT, top=0), "top must be between 1 and 100"),
    (lambda m: m.lens(PROMPT, row=2), "row"),
    (lambda m: m.generate(PROMPT).save("trace.txt"), "must end in .jsonl"),
])
def test_api_errors_are_the_projects_exceptions_naming_the_keyword(model, call, says):
    with pytest.raises(llmtrace.LlmtraceError) as info:
        call(model)
    assert says in str(info.value) and "--" not in str(info.value)


def test_import_llmtrace_stays_light():
    """The public names are looked up lazily: importing the package, or naming the API, imports no torch."""
    code = ("import sys, llmtrace\nllmtrace.load, llmtrace.read_trace, llmtrace.GenerateOptions\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint(llmtrace.__version__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == llmtrace.__version__, proc.stderr
