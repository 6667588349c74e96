"""The terminal view at 80, 100 and 200 columns, rendered from the events of real runs of the default model.

Each run is recorded once (module fixtures); the tests render its events again, as `llmtrace show` does, into a
console that is not a terminal, so $COLUMNS sets its width."""

import io
import json
import re

import pytest

from llmtrace.trace.events import schema_path
from llmtrace.run.generate import generate
from llmtrace.console import make_console
from llmtrace.render.generate import render_events, survivors_chain, visible
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.options import TraceOptions

PROMPT = "The capital of France is"
PARIS = 7042  # " Paris", the greedy first token after PROMPT


def record(lm, prompt=PROMPT, n=3, level="steps", dump=(), **sampling):
    events = []
    rec = Recorder(TraceOptions(level=level, dump=dump), [events.append], run_info={"prompt": prompt})
    cfg = SamplerConfig(**({"temperature": 0.0, "seed": 0} | sampling))
    result = generate(lm, lm.tokenizer.encode(prompt), Sampler(cfg, lm.config.vocab_size), n, ignore_eos=True,
                      observer=rec)
    return events, result


def render(events, columns, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    console = make_console(file=out)
    assert console.width == columns  # $COLUMNS is honoured when the output is not a terminal
    render_events(events, console)
    return out.getvalue()


def cut_numbers(text: str) -> list[str]:
    """Places where an ellipsis touches a digit: a number cut short."""
    return re.findall(r"\d…|…\d", text)


@pytest.fixture(scope="module")
def greedy_run(smollm):
    """12 greedy steps (so step numbers reach 10), one of them made to take 2,723 ms as a slow machine would."""
    events, _ = record(smollm, n=12)
    steps = [e for e in events if e["event"] == "step"]
    steps[3]["ms"] = 2723.456
    return events


@pytest.fixture(scope="module")
def sampling_run(smollm):
    events, _ = record(smollm, n=4, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=1)
    return events


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_step_table_fits_and_never_cuts_a_number(greedy_run, sampling_run, columns, monkeypatch):
    for events in (greedy_run, sampling_run):
        text = render(events, columns, monkeypatch)
        assert cut_numbers(text) == []
        assert all(len(line) <= columns for line in text.splitlines()), max(text.splitlines(), key=len)
        table = text[text.index("s7–s12"):text.index("output")]
        header = next(line for line in table.splitlines() if line.startswith("step"))
        assert header.split()[:2] == ["step", "pos"]
        for ev in (e for e in events if e["event"] == "step"):
            row = next(line for line in table.splitlines() if line.split()[:2] == [str(ev["step"]), str(ev["position"])])
            assert f"{visible(ev['topk'][0]['text'])}:{ev['topk'][0]['prob']:.2f}" in row
            if "ms" in header:
                assert f"{ev['ms']:.1f}" in row
    assert "2723.5" in render(greedy_run, 100, monkeypatch)  # the slow step's time, whole


def test_wide_console_shows_full_survivors_chain_and_top_candidates(sampling_run, monkeypatch):
    text = render(sampling_run, 200, monkeypatch)
    for ev in (e for e in sampling_run if e["event"] == "step"):
        chain = survivors_chain(ev["sampler"])
        assert chain.count("→") == len(ev["sampler"]) - 1 and "…" not in chain
        assert chain in text
        row = next(line for line in text.splitlines() if line.split()[:2] == [str(ev["step"]), str(ev["position"])])
        for c in ev["topk"][:5]:
            assert f"{visible(c['text'])}:{c['prob']:.2f}" in row


def test_narrow_output_drops_columns_and_says_which_in_words_that_fit_a_pipe(sampling_run, monkeypatch):
    text = render(sampling_run, 80, monkeypatch)  # a StringIO: no console is involved
    note = next(line for line in text.splitlines() if "left out" in line)
    assert note == "(left out to fit 80 columns: id, survivors, KV len, KV bytes; see --json)"
    assert "narrow console" not in text


def test_a_greedy_run_prints_no_seed(greedy_run, sampling_run, monkeypatch):
    assert " seed " not in " ".join(render(greedy_run, 100, monkeypatch).split())
    assert " seed 1 " in " ".join(render(sampling_run, 100, monkeypatch).split())


def test_header_lists_every_non_default_sampler_setting(sampling_run, monkeypatch):
    text = " ".join(render(sampling_run, 100, monkeypatch).split())
    for setting in ("temperature 0.7", "top-k 40", "top-p 0.9", "repetition-penalty 1.3", "seed 1"):
        assert setting in text


@pytest.mark.parametrize("how", ["ban", "logit_bias"])
def test_row_marked_when_the_sampler_changed_the_winner(smollm, how, monkeypatch):
    from llmtrace.run.sampler import banned_sequences

    plain, _ = record(smollm, n=1)
    assert next(e for e in plain if e["event"] == "step")["token"]["id"] == PARIS
    if how == "ban":
        events, result = record(smollm, n=2, ban=banned_sequences(smollm.tokenizer, [" Paris"]))
    else:
        events, result = record(smollm, n=2, logit_bias={PARIS: -100.0})
    assert result.tokens[0] != PARIS
    step = next(e for e in events if e["event"] == "step")
    assert [s["top"] for s in step["sampler"]] == [PARIS, result.tokens[0]]  # the ledger knows the winner moved
    text = render(events, 100, monkeypatch)
    assert f"* {how} changed the most likely token: ▁Paris (p 0.77) → " in text
    assert len(re.findall(r"changed the most likely token", text)) == 1  # only the step it happened in
    assert "changed the most likely token" not in render(plain, 100, monkeypatch)


def test_plurals_and_no_decode_rate_without_a_decode_step(smollm, monkeypatch):
    events, _ = record(smollm, prompt="Hello", n=1)
    assert len(next(e for e in events if e["event"] == "tokens")["tokens"]) == 1
    text = " ".join(render(events, 100, monkeypatch).split())
    assert "prompt → 1 token " in text and "1 prompt token ·" in text and "1 layers" not in text
    # no rate for a decode that never ran ("decode 0.0 tok/s" was the bug); the prefill's own rate may end in 0.0
    assert "decode – tok/s" in text and "decode 0.0 tok/s" not in text
    assert "1 positions" not in text


def test_full_trace_is_compact_on_the_terminal_and_whole_in_the_events(smollm, monkeypatch):
    n = 3
    events, result = record(smollm, n=n, level="full")
    L = smollm.config.n_layers
    tensors = [e for e in events if e["event"] == "tensor"]
    assert len(tensors) == n * (19 * L + 4)  # every point of every layer, every step: the JSON keeps them all
    text = render(events, 100, monkeypatch)
    assert len(text.splitlines()) <= 2 * L * n + 80  # about one line per layer per step, not one per point
    post = {e["layer"]: e["stats"]["norm"] for e in tensors if e["name"] == "resid_post" and e["step"] == n - 1}
    lines = text[text.index(f"step {n - 1}: one line per layer"):].splitlines()
    for layer, norm in post.items():
        row = next(line for line in lines if line.split()[:1] == [str(layer)])
        assert f"{norm:.4g}" in row.split()


def test_dump_without_a_file_prints_values_compactly_and_says_where_they_are(smollm, monkeypatch):
    events, _ = record(smollm, n=1, dump=("logits",))
    text = " ".join(render(events, 100, monkeypatch).split())
    assert f"all {smollm.config.vocab_size:,} values are in --json/--jsonl" in text
    first = next(e for e in events if e["event"] == "tensor" and e["name"] == "logits")["values"][0]
    assert f"[{first:.4g}," in text


def test_dump_under_trace_none_is_recorded_and_shown_after_the_text(smollm, monkeypatch):
    events, _ = record(smollm, n=2, level="none", dump=("logits",))
    dumps = [e for e in events if e["event"] == "tensor" and e["name"] == "logits"]
    assert [e["step"] for e in dumps] == [0, 1] and len(dumps[0]["values"]) == smollm.config.vocab_size
    monkeypatch.setenv("COLUMNS", "100")
    out = io.StringIO()
    from llmtrace.render.generate import TerminalRenderer

    view = TerminalRenderer(make_console(file=out), show_steps=False, stream_text=True)
    for ev in events:
        view(ev)
    assert f"all {smollm.config.vocab_size:,} values are in --json/--jsonl" in " ".join(out.getvalue().split())


def test_batch_summary_says_when_nothing_was_decoded(monkeypatch):
    summary = {"event": "summary", "prompt_tokens": 5, "generated_tokens": 1, "tokens": [7], "text": " x",
               "stop_reason": "max_tokens", "ttft_ms": 10.0, "prefill_tok_s": 50.0, "decode_tok_s": 0.0,
               "interrupted": True, "batch": 2,
               "rows": [{"row": r, "prompt_tokens": 5, "tokens": [7], "text": " x", "stop_reason": "max_tokens"}
                        for r in range(2)]}
    text = " ".join(render([summary], 100, monkeypatch).split())
    assert "decode – tok/s" in text and "decode 0.0" not in text and "interrupted (Ctrl-C)" in text


def test_piece_and_text_columns_follow_tokenize(greedy_run, monkeypatch):
    text = render(greedy_run, 100, monkeypatch)
    row = next(line for line in text.splitlines() if line.split()[:2] == ["1", "3575"])
    assert row.split()[2:] == ["▁capital", '"', 'capital"']  # piece made visible, text as a JSON string


def test_schema_says_what_the_statistics_are_computed_over(smollm):
    schema = json.loads(schema_path().read_text())
    stats = schema["$defs"]["tensor"]["properties"]["stats"]["description"]
    for words in ("all elements", "n−1", "float64", "−inf", "float32"):
        assert words in stats
    assert "top" in schema["$defs"]["step"]["properties"]["sampler"]["items"]["properties"]


def test_explain_and_lens_views_keep_numbers_whole_at_80_columns(smollm, greedy_run, monkeypatch):
    from llmtrace.render.explain import render_explain, render_lens
    from llmtrace.run.explain import explain_events, lens_events

    ids = smollm.tokenizer.encode(PROMPT)
    explained = explain_events(smollm, ids, 3, top=5, prompt=PROMPT, chat=False)
    lensed = lens_events(smollm, ids, list(range(len(ids))), None, top=5, prompt=PROMPT, chat=False)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    for events, render_view in ((explained, render_explain), (lensed, render_lens)):
        out = io.StringIO()
        render_view(events, make_console(file=out))
        assert cut_numbers(out.getvalue()) == []
    # k_repeated has one shape in both commands: (H, S, Dh), repeat_kv's keys, one copy per query head
    shape = next(e["shape"] for e in explained if e["event"] == "tensor" and e["name"] == "k_repeated")
    shapes = next(e for e in greedy_run if e["event"] == "shapes")["points"]
    assert shape == next(p["shape"] for p in shapes if p["name"] == "k_repeated") == [9, len(ids), 64]


@pytest.mark.parametrize("level", ["layers", "full"])
def test_the_per_layer_legend_explains_exactly_the_columns_shown_and_names_those_left_out(smollm, monkeypatch, level):
    events, _ = record(smollm, n=1, level=level)  # every layer: one line per layer
    for columns in (80, 200):
        lines = render(events, columns, monkeypatch).splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("layer ") and "‖x''‖ out" in line)
        headers = re.split(r"\s{2,}", lines[at].strip())[1:]
        legend_at = next(i for i in range(at, len(lines)) if lines[i].startswith("‖"))
        legend = " ".join(lines[legend_at:legend_at + 4])
        explained = {"‖attn‖ s6.6": "‖attn‖:", "‖x'‖": "‖x'‖:", "‖ffn‖ s6.7": "‖ffn‖:", "‖x''‖ out": "‖x''‖:",
                     "max|x''|": "max|x''|:", "score max": "score max:", "attn p max": "attn p max:"}
        for header, term in explained.items():
            assert (term in legend) == (header in headers), (level, columns, header)
        wanted = ["‖x'‖", "‖x''‖ out", "max|x''|"] + (["‖attn‖ s6.6", "‖ffn‖ s6.7", "score max", "attn p max"]
                                                     if level == "full" else [])
        missing = [h for h in wanted if h not in headers]
        if missing:  # said in the note under the legend
            assert any(line.startswith("(left out to fit") and all(h in line for h in missing) for line in lines)


def test_an_invisible_character_is_shown_by_its_code_point(smollm, monkeypatch):
    from llmtrace.tokens.token_facts import visible_text

    assert visible(" a\u00a0b\u200b\n") == "▁a<U+00A0>b<U+200B>\\n"
    assert smollm.tokenizer.visible_piece(15442) == "<U+00A0>"  # the no-break space, a token of its own
    assert visible_text("é".encode()) == "é"


def test_piped_lens_marks_hits_with_a_star_and_names_no_colour(smollm, monkeypatch):
    from llmtrace.render.explain import render_lens
    from llmtrace.run.explain import lens_events

    ids = smollm.tokenizer.encode(PROMPT)
    events = json.loads(json.dumps(lens_events(smollm, ids, list(range(len(ids))), [27, 28, 29], prompt=PROMPT)))
    monkeypatch.setenv("COLUMNS", "100")
    out = io.StringIO()
    render_lens(events, make_console(file=out))
    text = out.getvalue()
    assert "underline" not in text and "colour" not in text.replace("without colour", "")
    assert "*: the top-1 token is already the prompt's next token (without colour the probabilities are" in text
    hits = {(e["layer"], e["position"]) for e in events if e["event"] == "lens" and e["stage"] != "logits"
            and e["position"] + 1 < len(ids) and e["topk"][0]["id"] == ids[e["position"] + 1]}
    rows = {int(line.split()[0]): line for line in text.splitlines() if line.split() and line.split()[0] in ("27", "28", "29")}
    for layer, line in rows.items():
        assert line.count("*") == sum(1 for (l, _) in hits if l == layer)


def test_tokenize_and_detokenize_show_the_no_break_space(capsys, monkeypatch, smollm_path):
    from helpers import run_cli

    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = run_cli(capsys, "detokenize", "15442")
    row = next(line for line in out.splitlines() if "15442" in line)
    assert "<U+00A0>" in row and '"\\u00a0"' in row and "c2 a0" in row
    code, out, _ = run_cli(capsys, "tokenize", "a\u00a0b")
    assert code == 0 and "<U+00A0>" in out and "\u00a0" not in out


def test_sampler_notes_wrap_onto_indented_lines_at_80_columns(smollm, monkeypatch):
    """A stage's note under a step row (top-nσ's numbers) and a header part wider than the console (mirostat's) wrap
    between words onto lines indented past the labels, never back to column 0, and nothing is lost."""
    events, _ = record(smollm, n=1, temperature=1.5, top_n_sigma=1.0, seed=1)
    lines = render(events, 80, monkeypatch).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  top-nσ: kept"))
    assert lines[at + 1].startswith("    ") and not lines[at + 1].startswith("     ")
    note = " ".join(line.strip() for line in lines[at:at + 2])
    assert note.endswith("logits; the same tokens at any temperature)") and "(σ of 49,152 logits" in note
    assert all(len(line) <= 80 for line in lines[at:at + 2])
    events, _ = record(smollm, n=1, temperature=1.0, mirostat=2, seed=1)
    lines = render(events, 80, monkeypatch).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  mirostat 2 ("))
    assert lines[at + 1].startswith("    ") and "llama.cpp" in lines[at] + lines[at + 1]
    assert all(len(line) <= 80 for line in lines[at:at + 2])
