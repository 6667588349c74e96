"""Several prompts as one batch (s3): left padding, the attention mask and per-row positions must leave every row
computing what it computes alone. On the real SmolLM2 model: greedy tokens against the prompt run alone and against
transformers' generate with left padding, logits of every row and step within 1e-4 of the unpadded run, a row that
ends early, seeded sampling per row, the s3 event's matrices, and the one-line errors of bad batch input.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import undeclared_fields
import torch

from llmtrace.run.generate import generate, generate_batch, pad_batch, row_seed
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.options import TraceOptions

# very different lengths, one of them a single token ("Hi")
TEXTS = ["The capital of France is", "Hi", "Once upon a time, in a small village by the sea, there lived an old"]
N_NEW = 6


def encode(lm, texts, chat=False):
    return [lm.tokenizer.encode_prompt(t, chat=chat, system=None)[1] for t in texts]


def samplers(lm, cfg, n):
    return [Sampler(replace(cfg, seed=row_seed(cfg.seed, r)), lm.config.vocab_size) for r in range(n)]


def recorded(lm, run, dump=("logits",)):
    """The events of `run(observer)` with the logits of every pass dumped."""
    events: list[dict] = []
    run(Recorder(TraceOptions(level="steps", dump=dump), [events.append]))
    return events


def logits_by_step(events, row=None):
    """{step: logits (V,)} of the tensor events of one row (row None: a one-prompt run)."""
    return {e["step"]: torch.tensor(e["values"]) for e in events
            if e["event"] == "tensor" and e["name"] == "logits" and e.get("row") == row}


GREEDY = SamplerConfig(temperature=0, seed=0)


@pytest.fixture(scope="module")
def batch_run(smollm):
    prompts = encode(smollm, TEXTS)
    holder = {}

    def run(obs):
        holder["result"] = generate_batch(smollm, prompts, samplers(smollm, GREEDY, len(prompts)), N_NEW, observer=obs)

    events = recorded(smollm, run)
    return prompts, holder["result"], events


def test_rows_equal_each_prompt_alone_tokens_and_logits(smollm, batch_run):
    prompts, result, events = batch_run
    assert [len(p) for p in prompts][1] == 1  # one row is a single token
    for r, p in enumerate(prompts):
        alone_events = recorded(smollm, lambda obs: generate(smollm, p, Sampler(GREEDY, smollm.config.vocab_size),
                                                             N_NEW, observer=obs))
        alone = next(e for e in alone_events if e["event"] == "summary")
        assert result.rows[r].tokens == alone["tokens"], f"row {r}"
        assert result.rows[r].text == alone["text"]
        mine, theirs = logits_by_step(events, r), logits_by_step(alone_events)
        assert sorted(mine) == sorted(theirs) == list(range(N_NEW))
        for step in theirs:
            diff = float((mine[step] - theirs[step]).abs().max())
            assert diff < 1e-4, f"row {r} step {step}: logits differ by {diff}"


def test_rows_equal_transformers_generate_with_left_padding(smollm, hf_smollm, hf_smollm_tokenizer, batch_run):
    prompts, result, _ = batch_run
    hf_tok = hf_smollm_tokenizer
    hf_tok.padding_side = "left"
    if hf_tok.pad_token is None:
        hf_tok.pad_token = hf_tok.eos_token
    enc = hf_tok(TEXTS, return_tensors="pt", padding=True)
    for r, p in enumerate(prompts):  # the same prompt ids on both sides
        assert enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist() == p
    with torch.no_grad():
        out = hf_smollm.generate(**enc, max_new_tokens=N_NEW, do_sample=False, pad_token_id=hf_tok.pad_token_id)
    T = enc["input_ids"].size(1)
    for r in range(len(prompts)):
        assert out[r, T:].tolist() == result.rows[r].tokens, f"row {r}"


def test_batch_event_holds_s3_matrices(smollm, batch_run):
    prompts, _, events = batch_run
    ev = next(e for e in events if e["event"] == "batch")
    T = max(len(p) for p in prompts)
    tok = smollm.tokenizer
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_ids[0]
    assert ev["pad_id"] == pad and ev["pad_source"] == ("pad" if tok.pad_id is not None else "eos")
    for r, p in enumerate(prompts):
        n_pad = T - len(p)
        assert ev["ids"][r] == [pad] * n_pad + p
        assert ev["attention_mask"][r] == [0] * n_pad + [1] * len(p)
        assert ev["position_ids"][r] == [0] * n_pad + list(range(len(p)))
    # each row's steps and its tokens event carry the row; the summary has one entry per row
    assert [e["row"] for e in events if e["event"] == "tokens"] == [0, 1, 2]
    steps = [e for e in events if e["event"] == "step"]
    assert {e["row"] for e in steps} == {0, 1, 2} and len(steps) == 3 * N_NEW
    assert [e["position"] for e in steps if e["row"] == 1] == list(range(1, 1 + N_NEW))
    summary = events[-1]
    assert [row["row"] for row in summary["rows"]] == [0, 1, 2]
    assert summary["tokens"] == summary["rows"][0]["tokens"]  # the one-prompt fields describe row 0


def test_batch_trace_is_valid_for_the_schema(batch_run):
    jsonschema = pytest.importorskip("jsonschema")
    from llmtrace.trace.events import schema_path

    _, _, events = batch_run
    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    for e in events:
        e = json.loads(json.dumps(e))
        assert not list(validator.iter_errors(e)), e["event"]
    assert undeclared_fields(events) == []  # every field written is documented


def test_row_that_ends_early_stops_while_others_continue(smollm):
    # chat: row 0's short answer ends with EOS after a few tokens; row 1 runs to the limit
    texts = ["What is 2+2? Answer with the number only.", "Say yes."]
    prompts = encode(smollm, texts, chat=True)
    events: list[dict] = []
    result = generate_batch(smollm, prompts, samplers(smollm, GREEDY, 2), 12,
                            observer=Recorder(TraceOptions(level="steps"), [events.append]))
    assert result.rows[0].stop_reason == "eos" and result.rows[1].stop_reason == "max_tokens"
    assert len(result.rows[0].tokens) < 12 == len(result.rows[1].tokens)
    for r, p in enumerate(prompts):
        alone = generate(smollm, p, Sampler(GREEDY, smollm.config.vocab_size), 12)
        assert (result.rows[r].tokens, result.rows[r].stop_reason) == (alone.tokens, alone.stop_reason)
    # a finished row emits nothing more
    assert sum(1 for e in events if e["event"] == "step" and e["row"] == 0) == len(result.rows[0].tokens)


def test_seeded_sampling_rows_equal_rows_alone_with_their_seeds(smollm):
    cfg = SamplerConfig(temperature=0.9, top_p=0.95, seed=7)
    prompts = encode(smollm, TEXTS)
    result = generate_batch(smollm, prompts, samplers(smollm, cfg, len(prompts)), 5)
    for r, p in enumerate(prompts):
        alone = generate(smollm, p, Sampler(replace(cfg, seed=7 + r), smollm.config.vocab_size), 5)
        assert result.rows[r].tokens == alone.tokens, f"row {r}"


def test_pad_batch_falls_back_to_eos():
    class NoPad:
        pad_id, eos_ids = None, [5]

    layout = pad_batch([[1, 2, 3], [4]], NoPad())
    assert (layout.pad_id, layout.pad_source) == (5, "eos")
    assert layout.ids == [[1, 2, 3], [5, 5, 4]]


# ----------------------------------------------------------------------------------------------------------------
# bad input: one line each


def cli(capsys, *argv):
    from llmtrace.cli.main import main

    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_error(capsys, *argv) -> str:
    code, _, err = cli(capsys, *argv)
    lines = err.splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_empty_prompt_in_the_list_is_named(capsys, tmp_path):
    assert "prompt 2" in one_error(capsys, "generate", "-p", "a", "-p", "", "-m", tmp_path / "never-loaded")
    f = tmp_path / "p.txt"
    f.write_text("one\n\nthree\n")
    assert "line 2" in one_error(capsys, "generate", "--prompts", f, "-m", tmp_path / "never-loaded")


def test_prompts_file_not_utf8_names_the_line(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"fine\nalso fine\nbad \xff here\n")
    msg = one_error(capsys, "generate", "--prompts", f, "-m", tmp_path / "never-loaded")
    assert "line 3" in msg and "UTF-8" in msg


def test_jsonl_prompts_file(tmp_path):
    from llmtrace.cli.batch_input import read_prompt_list

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"prompt": "c", "id": 2}\n')
    assert read_prompt_list(["x"], f, 64) == ["x", "a b", "c"]


def test_more_than_max_batch_rows(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("".join(f"prompt {i}\n" for i in range(65)))
    msg = one_error(capsys, "generate", "--prompts", f, "-m", tmp_path / "never-loaded")
    assert "65 prompts" in msg and "--max-batch" in msg


# ----------------------------------------------------------------------------------------------------------------
# -n cut by the context window: said in one note, stop reason "context", each row of a batch on its own (tiny model,
# a context window of 128 tokens)


@pytest.fixture(scope="module")
def tiny_ctx(tmp_path_factory):
    from tiny import TinySpec, write_hf_dir

    from llmtrace.checkpoint.load import load_model

    path = tmp_path_factory.mktemp("ctx") / "hf"
    write_hf_dir(path, TinySpec(seed=7))
    lm = load_model(str(path), device="cpu")
    assert lm.config.max_seq_len == 128
    words = "the quick brown fox jumps over the lazy dog " * 40
    long = next(words[:i] for i in range(len(words), 0, -1) if len(lm.tokenizer.encode(words[:i])) == 125)
    return path, lm, long


def summary_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()][-1]


def test_n_cut_by_the_context_window_is_said_and_is_the_stop_reason(capsys, tiny_ctx, tmp_path):
    from helpers import run_cli

    path, lm, long = tiny_ctx
    code, _, err = run_cli(capsys, "generate", long, "-m", path, "-n", 8, "--ignore-eos", "--trace", "none",
                           "--jsonl", tmp_path / "t.jsonl")
    assert code == 0, err
    assert err.splitlines() == [f"note: the prompt has 125 tokens and the context window of {lm.name} is 128: "
                                f"3 tokens fit, not 8 (stop reason: context)"]
    summary = summary_of(tmp_path / "t.jsonl")
    assert summary["generated_tokens"] == 3 and summary["stop_reason"] == "context"
    # -n that fits: no note, the usual stop reason
    code, _, err = run_cli(capsys, "generate", long, "-m", path, "-n", 3, "--ignore-eos", "--trace", "none",
                           "--jsonl", tmp_path / "u.jsonl")
    assert code == 0 and err == ""
    assert summary_of(tmp_path / "u.jsonl")["stop_reason"] == "max_tokens"


def test_each_row_of_a_batch_stops_at_the_context_window_as_it_would_alone(capsys, tiny_ctx, tmp_path):
    from helpers import run_cli

    path, lm, long = tiny_ctx
    code, _, err = run_cli(capsys, "generate", "-p", long, "-p", "Hello world", "-m", path, "-n", 8, "--ignore-eos",
                           "--trace", "none", "--jsonl", tmp_path / "b.jsonl")
    assert code == 0, err
    assert err.splitlines() == [f"note: the context window of {lm.name} (128 tokens) leaves fewer than 8 tokens to "
                                f"1 of 2 rows (row 0: 3); it stops there (stop reason: context)"]
    rows = summary_of(tmp_path / "b.jsonl")["rows"]
    assert [(len(r["tokens"]), r["stop_reason"]) for r in rows] == [(3, "context"), (8, "max_tokens")]
    for r, text in enumerate([long, "Hello world"]):
        alone = generate(lm, lm.tokenizer.encode(text), Sampler(GREEDY, lm.config.vocab_size), 8, ignore_eos=True)
        assert rows[r]["tokens"] == alone.tokens and rows[r]["stop_reason"] == alone.stop_reason


def test_a_prompt_that_fills_the_window_leaves_no_room(capsys, tiny_ctx):
    path, lm, long = tiny_ctx
    msg = one_error(capsys, "generate", "-p", long + " the lazy dog the lazy dog", "-p", "Hi", "-n", 1, "-m", path)
    assert msg.startswith("error: prompt 1 of the batch: the prompt has") and "context window" in msg


def test_rows_of_one_length_take_the_unmasked_path_and_still_match(smollm):
    prompts = encode(smollm, ["The capital of France is", "The capital of Spain is"])
    assert len(prompts[0]) == len(prompts[1])  # no pad slot: the batch runs without a mask
    result = generate_batch(smollm, prompts, samplers(smollm, GREEDY, 2), 4)
    for r, p in enumerate(prompts):
        assert result.rows[r].tokens == generate(smollm, p, Sampler(GREEDY, smollm.config.vocab_size), 4).tokens


def test_report_and_show_read_a_batch_trace(batch_run, tmp_path):
    from llmtrace.trace.reader import load_trace
    from llmtrace.report.data import extract

    _, result, events = batch_run
    for row in (0, 2):
        data = extract(events, row=row)
        assert data["run"]["prompt"] == TEXTS[row]
        assert data["run"]["batch"] == {"rows": len(TEXTS), "row": row}  # the page says "shows row N" (below)
        run = next(e for e in events if e["event"] == "run")
        assert data["run"]["sampling"]["seed"] == run["row_seeds"][row] == run["row_seeds"][0] + row  # the row's own
        assert [s["token"]["id"] for s in data["steps"]] == result.rows[row].tokens
    f = tmp_path / "batch.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert [e["event"] for e in load_trace(str(f))].count("step") == 3 * N_NEW


def test_a_short_rows_page_says_its_padding_at_s3(batch_run, tmp_path):
    """Row 1 ("Hi", 1 token) is padded to the longest row: its s3 says so instead of a bare "causal"."""
    from llmtrace.report.write import build

    prompts, _, events = batch_run
    slots = max(len(p) for p in prompts)
    page = build(json.loads(json.dumps(events)), row=1)
    s3 = page.split('data-stage="s3"')[1].split("</button>")[0]
    assert (f"causal + padding: this row is {slots - 1} pad slots then 1 token, {slots} slots like every row of the "
            f"batch (the shapes below are the padded ones)") in s3
    one = build(json.loads(json.dumps([e for e in events if e.get("row", 0) == 0 and e["event"] != "batch"])))
    detail = one.split('data-stage="s3"')[1].split("</button>")[0].split('class="detail">')[1]  # the step's own line
    assert "padding" not in detail and "pad slots" not in detail


def test_report_row_option_draws_the_chosen_row(batch_run, tmp_path, capsys):
    _, result, events = batch_run
    f = tmp_path / "batch.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in events))
    page = tmp_path / "row2.html"
    code, _, err = cli(capsys, "report", f, "-o", page, "--row", "2", "--no-merges")
    assert code == 0, err
    html = page.read_text()
    assert "shows row 2" in html and TEXTS[2] in html
    msg = one_error(capsys, "report", f, "-o", tmp_path / "x.html", "--row", "3", "--no-merges")
    assert "--row 3 is out of range" in msg and "3 rows" in msg
    assert not (tmp_path / "x.html").exists()


def test_terminal_shows_s3_with_pads_marked_and_a_row_column(batch_run):
    import io

    from rich.console import Console

    from llmtrace.render.generate import render_events

    prompts, _, events = batch_run
    out = io.StringIO()
    render_events(events, Console(file=out, width=200))  # wide enough for all 17 slots of 5-digit ids
    text = out.getvalue()
    T = max(len(p) for p in prompts)
    lines = text.splitlines()
    at = lines.index(next(x for x in lines if x.startswith(f"ids [3, {T}]")))
    for r, p in enumerate(prompts):  # the ids matrix: one line per row, each pad slot marked with ·
        assert lines[at + 1 + r].split()[:2] == ["row", str(r)]
        assert lines[at + 1 + r].count("·") == T - len(p)
    header = next(x for x in lines if x.lstrip().startswith("step") and "row" in x.split())
    assert header.split()[:3] == ["step", "row", "pos"]
    assert "batch of 3 rows" in text


def test_cli_batch_rows_use_seed_plus_row(capsys, smollm, monkeypatch, tmp_path):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", lambda *a, **k: smollm)
    common = ["-n", "3", "--temperature", "0.9", "--trace", "none"]

    def run(*argv):
        f = tmp_path / "t.jsonl"
        code, _, err = cli(capsys, "generate", *argv, *common, "--jsonl", f)
        assert code == 0, err
        return [json.loads(line) for line in f.read_text().splitlines()]

    batch = run("-p", "The capital of France is", "-p", "Once upon a time", "--seed", "5")
    assert batch[0]["row_seeds"] == [5, 6] and batch[0]["batch"] == 2
    alone = run("Once upon a time", "--seed", "6")
    assert batch[-1]["rows"][1]["tokens"] == alone[-1]["tokens"]
    one = run("-p", "Once upon a time", "--seed", "6")  # a single -p is the one-prompt run, row-free
    assert one[-1]["tokens"] == alone[-1]["tokens"]
    assert not any("row" in e or "rows" in e for e in one)


def test_lens_shows_each_rows_combined_causal_and_padding_mask(capsys, smollm, monkeypatch, tmp_path):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", lambda *a, **k: smollm)
    f = tmp_path / "lens.jsonl"
    code, out, err = cli(capsys, "lens", "-p", "The capital of France is", "-p", "Hi", "--row", "1", "--last", "1",
                         "--jsonl", f)
    assert code == 0, err
    events = [json.loads(line) for line in f.read_text().splitlines()]
    batch = next(e for e in events if e["event"] == "batch")
    assert batch["explained_row"] == 1
    for r, pad in enumerate(batch["attention_mask"]):
        T = len(pad)
        want = [[int((j <= i and pad[j] == 1) or i == j) for j in range(T)] for i in range(T)]
        assert batch["combined_mask"][r] == want
    assert next(e for e in events if e["event"] == "tokens")["count"] == 1  # row 1 ("Hi") is the one taken apart
    assert "row 1: 1 real token" in out and "░" in out


def test_a_batch_multiplies_on_packed_weights_and_leaves_the_model_as_it_was(smollm, batch_run):
    # model.packed: the batch's rows above (tokens and logits against each row alone) ran on these products
    import torch.nn as nn

    from llmtrace.model.packed import PackedProducts

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert isinstance(smollm.packed, PackedProducts)
    linears = [m for m in smollm.model.modules() if type(m) is nn.Linear]
    assert len(smollm.packed.linears) == len(linears) == 4 * smollm.config.n_layers + 1  # qkv, o, gate/up, down; head
    assert not any("forward" in m.__dict__ for m in linears)  # each back on torch's product after the run
