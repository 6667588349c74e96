"""`llmtrace show`: every trace the schema accepts renders, in any JSON layout; a stream cut off mid-line shows what is
complete; anything else is one line naming the place and the field.

The traces are real: `generate`, `explain` and `lens` runs of the default model, written by the CLI.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest

from llmtrace.cli.main import main
from llmtrace.errors import LlmtraceError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def traces(smollm, tmp_path_factory) -> dict[str, Path]:
    """JSONL and JSON traces of the commands that write them, from the session's model."""
    out = tmp_path_factory.mktemp("traces")
    runs = {
        "steps": ["generate", PROMPT, "-n", "4", "--temperature", "0.8", "--top-k", "40", "--seed", "1"],
        "full": ["generate", PROMPT, "-n", "2", "--trace", "full", "--layers", "0", "--dump", "logits"],
        "explain": ["explain", PROMPT, "--layer", "1"],
        "lens": ["lens", PROMPT, "--last", "3", "--layers", "0,-1"],
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("llmtrace.checkpoint.load.load_model", lambda *a, **k: smollm)
        mp.setattr("llmtrace.checkpoint.devices.set_threads", lambda n: None)
        for name, argv in runs.items():
            main(argv + ["--jsonl", str(out / f"{name}.jsonl"), "--json", str(out / f"{name}.json")])  # exit 0: returns
    return {name: out / name for name in runs}


def show(capsys, path) -> tuple[int, str, str]:
    code = 0
    try:
        main(["show", str(path)])
    except SystemExit as e:
        code = e.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def flat(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------------------------------------------
# any layout of a valid trace


@pytest.mark.parametrize("name", ["steps", "full", "explain", "lens"])
def test_pretty_printed_document_renders_as_the_stream_does(capsys, traces, name, tmp_path):
    """`jq . run.json > pretty.json`: the same document over many lines renders exactly as the stream does."""
    base = traces[name]
    doc = json.loads(base.with_suffix(".json").read_text())
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    code, shown, err = show(capsys, pretty)
    assert code == 0 and err == ""
    code, streamed, err = show(capsys, base.with_suffix(".jsonl"))
    assert code == 0 and err == ""
    assert shown == streamed and len(shown.splitlines()) > 5


def test_a_document_with_the_keys_in_another_order_and_a_single_event_stream(capsys, traces, tmp_path):
    doc = json.loads(traces["steps"].with_suffix(".json").read_text())
    reordered = tmp_path / "reordered.json"
    reordered.write_text(json.dumps({"events": doc["events"], "schema": doc["schema"]}))
    assert show(capsys, reordered)[0] == 0
    one = tmp_path / "one.jsonl"
    one.write_text("\n\n" + json.dumps(doc["events"][-1]))  # a summary alone, after blank lines, no final newline
    code, out, err = show(capsys, one)
    assert code == 0 and err == "" and "stop:" in out


# ----------------------------------------------------------------------------------------------------------------
# a stream cut off


def test_truncated_stream_renders_the_complete_lines_and_names_the_cut_one(capsys, traces, tmp_path):
    lines = traces["steps"].with_suffix(".jsonl").read_bytes().splitlines(keepends=True)
    steps = [i for i, line in enumerate(lines) if b'"event":"step"' in line]
    cut_at = steps[2]  # cut inside the third step's line: two steps are whole
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:cut_at]) + lines[cut_at][: len(lines[cut_at]) // 2])
    code, out, err = show(capsys, cut)
    assert code == 0
    assert err == f"warning: {cut} line {cut_at + 1} is cut off; showing the {cut_at} complete events before it\n"
    first_two = [json.loads(lines[i])["token"]["id"] for i in steps[:2]]
    rows = [line.split() for line in out.splitlines()]
    assert [int(r[3]) for r in rows if len(r) > 3 and r[0] in ("0", "1", "2") and r[3].isdigit()] == first_two


def test_a_stream_cut_at_a_line_boundary_says_it_is_incomplete(capsys, traces, tmp_path):
    """Every line whole, but no summary: a run killed between two writes. The warning says so; the steps show."""
    lines = traces["steps"].with_suffix(".jsonl").read_bytes().splitlines(keepends=True)
    steps = [i for i, line in enumerate(lines) if b'"event":"step"' in line]
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[: steps[2]]))
    code, out, err = show(capsys, cut)
    assert code == 0
    assert err == (f"warning: {cut} ends after {steps[2]} events without a summary: the trace is incomplete (the run "
                   f"was killed, or the file was cut); showing what it has\n")
    code, _, err = show(capsys, traces["steps"].with_suffix(".jsonl"))  # the whole stream: no warning
    assert code == 0 and err == ""


def test_a_cut_inside_a_multibyte_character_is_still_a_cut(capsys, tmp_path):
    """The cut can fall inside a UTF-8 character; only the last line is affected."""
    summary = {"event": "summary", "prompt_tokens": 1, "generated_tokens": 0, "text": "", "stop_reason": "eos",
               "ttft_ms": 1.0, "prefill_tok_s": 1.0, "decode_tok_s": 0.0, "interrupted": False}
    text = (json.dumps(summary) + "\n" + json.dumps(dict(summary, text="été"), ensure_ascii=False)).encode()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(text[: text.index("é".encode()) + 1])  # half of the é
    code, _, err = show(capsys, cut)
    assert code == 0 and "line 2 is cut off" in err


def test_damage_before_the_last_line_is_an_error_with_its_line(capsys, traces, tmp_path):
    lines = traces["steps"].with_suffix(".jsonl").read_text().splitlines()
    lines[4] = lines[4][:-10]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    code, out, err = show(capsys, bad)
    assert code == 1 and out == ""
    assert err.startswith(f"error: {bad} line 5: not valid JSON (column ") and err.count("\n") == 1


def test_a_damaged_pretty_document_names_its_line(capsys, traces, tmp_path):
    doc = json.loads(traces["steps"].with_suffix(".json").read_text())
    text = json.dumps(doc, indent=1)
    bad = tmp_path / "bad.json"
    bad.write_text(text[: len(text) // 2])
    code, _, err = show(capsys, bad)
    assert code == 1 and err.startswith(f"error: {bad}: not valid JSON (line ") and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------------------------
# malformed events: one line, the place and the field


NOT_OURS = "not a file llmtrace reads back (it reads the traces that generate, explain, lens, compare, diff and patch"


@pytest.mark.parametrize("text, code, says", [
    ('{"event":"step"}\n', 1, 'line 1: the "step" event lacks "step"'),
    ('\n{"event":"summary","prompt_tokens":1,"interrupted":false}\n', 1,
     'line 2: the "summary" event lacks "generated_tokens"'),
    ('{"event":"summary","command":"generate","prompt_tokens":1,"interrupted":false}', 1, 'lacks "generated_tokens"'),
    ('{"event":"summary","command":"explain","prompt_tokens":1}', 1, 'the "summary" event lacks "interrupted"'),
    ('{"event":"tokens","tokens":[{"index":0,"id":5,"piece":"a"}]}\n', 1, 'lacks "tokens[0].text"'),
    ('{"event":"tokens","tokens":[{"index":0,"id":"5","piece":"a","text":"a"}]}\n', 1,
     'has "tokens[0].id" as a string, not integer'),
    ('{"schema":"llmtrace.trace/9","events":[]}', 1, "a trace of schema 'llmtrace.trace/9'"),
    ('{"schema":"llmtrace.trace/1","events":[{"event":"step"}]}', 1, 'event 1: the "step" event lacks "step"'),
    ("  \n", 1, "the trace is empty"),
    ('{"event":"summary","prompt', 1, "no complete event (line 1 is cut off)"),
    ('{"schema":"llmtrace.compare/9","first_divergence":null}', 1, "a comparison of schema 'llmtrace.compare/9'"),
    ('{"schema":"llmtrace.compare/1","first_divergence":null}', 1, 'the comparison lacks "tolerance"'),
    # not a file llmtrace writes: exit 2
    ('[1, 2]\n{"event":"step"}\n', 2, "line 1: a list, not an event"),
    ('{"step": 1}\n{"event":"step"}\n', 2, 'line 1: an object without "event"'),
    ('{"step": 1}', 2, "valid JSON; " + NOT_OURS),
    ('"just a string"', 2, "valid JSON; " + NOT_OURS),
    ("null", 2, "valid JSON; " + NOT_OURS),
    ('{"event": "bogus"}', 2, 'line 1: an event of kind "bogus", which llmtrace does not write; ' + NOT_OURS),
    ('{"schema":"llmtrace.trace/1","events":[{"event":"bogus"}]}', 2, 'event 1: an event of kind "bogus"'),
    ('{"model": "x", "tokens": [{"id": 1}]}', 2, NOT_OURS),  # tokenize --json
    ("hello\n", 2, "line 1 is not valid JSON; " + NOT_OURS),  # show notamodel.txt
    ("<!doctype html>\n<html><body>a report</body></html>\n", 2, "line 1 is not valid JSON; " + NOT_OURS),  # a page
    ("\n\nname,value\na,1\n", 2, "line 3 is not valid JSON; " + NOT_OURS),
    ('{"event":"compare_layer","layer":0,"rel_err":0,"added_rel_err":0,"points":[]}', 2,
     "its events (compare_layer) are not a whole file of any command"),
])
def test_a_malformed_trace_is_one_line(capsys, tmp_path, text, code, says):
    """A damaged file of llmtrace's is exit 1, naming the place; anything llmtrace does not write is exit 2."""
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    got, out, err = show(capsys, path)
    assert got == code and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err


def test_a_missing_field_deep_in_a_real_trace_names_line_and_field(capsys, traces, tmp_path):
    lines = traces["steps"].with_suffix(".jsonl").read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if '"event":"step"' in line and '"step":2' in line)
    ev = json.loads(lines[n])
    del ev["kv_cache"]["bytes_used"]
    lines[n] = json.dumps(ev)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    code, _, err = show(capsys, bad)
    assert code == 1 and err == f'error: {bad} line {n + 1}: the "step" event lacks "kv_cache.bytes_used"\n'


# ----------------------------------------------------------------------------------------------------------------
# the schema is the contract between the writers, the reader and the renderers


def schema() -> dict:
    from llmtrace.trace.events import schema_path

    return json.loads(schema_path().read_text())


def test_the_reader_understands_every_keyword_the_schema_uses():
    from llmtrace.trace.reader import IGNORED, KEYWORDS

    used = set()

    def walk(node, is_properties=False):
        if isinstance(node, dict):
            for key, value in node.items():
                if not is_properties:
                    used.add(key)
                walk(value, is_properties=key in ("properties", "$defs") and not is_properties)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema())
    assert used <= KEYWORDS | IGNORED, used - KEYWORDS - IGNORED


def mutations(ev: dict):
    """(description, mutated copy) for each field of the event, nested objects and first list items included: the
    field removed, and the field given a value of the wrong kind."""

    def paths(node, prefix=()):
        if isinstance(node, dict):
            for key, value in node.items():
                yield prefix + (key,)
                yield from paths(value, prefix + (key,))
        elif isinstance(node, list) and node and isinstance(node[0], (dict, list)):
            yield from paths(node[0], prefix + (0,))

    for path in paths(ev):
        if path == ("event",):
            continue
        for how in ("removed", "wrong kind"):
            mutated = copy.deepcopy(ev)
            parent = mutated
            for part in path[:-1]:
                parent = parent[part]
            if how == "removed":
                del parent[path[-1]]
            else:
                parent[path[-1]] = 7 if isinstance(parent[path[-1]], str) else "x"
            yield f"{'.'.join(map(str, path))} {how}", mutated


def samples(events: list[dict]) -> list[int]:
    """The index of the first event of each kind (and explain section)."""
    seen, out = set(), []
    for i, ev in enumerate(events):
        key = (ev["event"], ev.get("section"), ev.get("name") == "scores")
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


@pytest.mark.parametrize("name", ["steps", "full", "explain", "lens"])
def test_what_the_reader_accepts_renders_and_agrees_with_jsonschema(traces, name):
    """Each field of a real event is removed or given the wrong kind of value. The reader accepts the result exactly
    when the jsonschema package does, names the field when it refuses, and whatever it accepts renders."""
    jsonschema = pytest.importorskip("jsonschema")
    from rich.console import Console

    from llmtrace.render.explain import render_explain, render_lens
    from llmtrace.trace.reader import _checked
    from llmtrace.render.generate import render_events

    validator = jsonschema.Draft202012Validator(schema())
    render = {"explain": render_explain, "lens": render_lens}.get(name, render_events)
    events = json.loads(traces[name].with_suffix(".json").read_text())["events"]
    if name == "full":  # a few events of each kind are enough, and rendering all of them for each mutation is slow
        events = [events[i] for i in samples(events)] + [ev for ev in events if ev["event"] in ("step", "summary")]
    checked, failures = 0, []
    for i in samples(events):
        for what, mutated in mutations(events[i]):
            try:
                _checked(mutated, "here")
                problem = None
            except LlmtraceError as e:
                problem = str(e)
            assert (problem is None) == validator.is_valid(mutated), (what, problem)
            if problem is not None:
                field = what.rsplit(" ", 2)[0] if " wrong kind" in what else what.rsplit(" ", 1)[0]
                if (events[i]["event"], what) == ("summary", "command removed"):
                    # a summary without `command` is generate's, so the reader names what generate's lacks
                    assert 'the "summary" event lacks "generated_tokens"' in problem, problem
                    continue
                assert field.split(".")[-1] in problem, (what, problem)
                continue
            trial = events[:i] + [mutated] + events[i + 1:]
            try:
                render(trial, Console(file=io.StringIO(), width=100))
            except Exception as e:  # noqa: BLE001 (every failure is collected and reported together)
                failures.append(f"{events[i]['event']} {what}: {type(e).__name__} {e}")
            checked += 1
    assert not failures, "\n".join(failures)
    assert checked > 0  # optional fields exist, and rendering was exercised
