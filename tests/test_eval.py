"""llmtrace eval: perplexity as llama-perplexity chunks and scores a text, against transformers; two sides' KLD; the
top-K base file; resume; workers; bad input."""

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import fails, run_cli, undeclared_fields

PASSAGE = Path(__file__).resolve().parents[1] / "benchmarks" / "passage.txt"  # Pride and Prejudice (public domain)


@pytest.fixture(scope="module")
def text():
    return PASSAGE.read_text(encoding="utf-8").rstrip("\n")


def reference_ppl(hf_model, ids: list[int], ctx: int, n_chunks: int, bos, batch_rows: bool = False) -> tuple:
    """transformers' PPL over the same chunks: ctx ids each, the first replaced by BOS where one is added, positions
    ctx//2 … ctx−2 scored (float64 log-softmax of its float32 logits). Returns (PPL, tokens scored, NLLs)."""
    first, nlls = ctx // 2, []
    for i in range(n_chunks):
        row = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            row = [bos] + row[1:]
        with torch.no_grad():
            logits = hf_model(torch.tensor([row])).logits[0, first:ctx - 1].double()
        lp = torch.log_softmax(logits, -1)
        target = torch.tensor(ids[i * ctx + first + 1:(i + 1) * ctx])
        nlls += (-lp.gather(1, target[:, None])[:, 0]).tolist()
    return math.exp(sum(nlls) / len(nlls)), len(nlls), nlls


def _hf_of(lm):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()


def test_ppl_of_a_tiny_model_equals_transformers(tiny_lm, text):
    from llmtrace.run.eval import evaluate

    ctx, k = 32, 6
    r = evaluate(tiny_lm, text, ctx=ctx, chunks=k, batch=4)
    tok = tiny_lm.tokenizer
    ids = tok.encode(text)
    ref, n, nlls = reference_ppl(_hf_of(tiny_lm), ids, ctx, k, tok.bos_id if tok.add_bos else None)
    s = r.summary
    assert s["chunks"] == k and s["tokens_scored"] == n == k * (ctx - 1 - ctx // 2)
    assert s["ppl"]["value"] == pytest.approx(ref, rel=1e-4)
    # llama.cpp's uncertainty: PPL · sqrt((mean NLL² − mean NLL²) / (n − 1))
    m = sum(nlls) / n
    unc = ref * math.sqrt((sum(x * x for x in nlls) / n - m * m) / (n - 1))
    assert s["ppl"]["uncertainty"] == pytest.approx(unc, rel=1e-3)
    # a chunk's record is its own sums: the first chunk alone gives the first chunk's PPL
    first = r.chunks[0]
    assert math.exp(first["sums"]["nll"] / first["tokens_scored"]) == pytest.approx(
        math.exp(sum(nlls[:first["tokens_scored"]]) / first["tokens_scored"]), rel=1e-4)


def test_ppl_of_smollm_equals_transformers(smollm, hf_smollm, text):
    """The default model, the same GGUF in transformers (float32), the same chunks and scoring: within 1e-4."""
    from llmtrace.run.eval import evaluate

    ctx, k = 128, 4
    r = evaluate(smollm, text, ctx=ctx, chunks=k, batch=2)
    tok = smollm.tokenizer
    ref, n, _ = reference_ppl(hf_smollm, tok.encode(text), ctx, k, tok.bos_id if tok.add_bos else None)
    assert r.summary["tokens_scored"] == n
    assert r.summary["ppl"]["value"] == pytest.approx(ref, rel=1e-4)
    assert 5 < ref < 100  # a real model on real English


def test_batch_rows_give_the_figures_of_one_row_at_a_time(tiny_lm, text):
    from llmtrace.run.eval import evaluate

    one = evaluate(tiny_lm, text, ctx=32, chunks=5, batch=1).summary
    many = evaluate(tiny_lm, text, ctx=32, chunks=5, batch=5).summary
    assert many["ppl"]["value"] == pytest.approx(one["ppl"]["value"], rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# two sides


def test_two_sides_kld_dp_same_top_against_a_direct_computation(tiny_lm, text):
    from llmtrace.run.compare import Side
    from llmtrace.run.eval import evaluate
    from llmtrace.run.interventions import Ablate

    ctx, k = 32, 8
    b = Side(loaded=tiny_lm, interventions=(Ablate(1, head=0),))
    r = evaluate(tiny_lm, text, b=b, ctx=ctx, chunks=k, batch=4)
    s = r.summary
    # by hand: both sides' logits of every chunk, the ablation on B by forward hooks of transformers' copy
    hf = _hf_of(tiny_lm)
    ids = tiny_lm.tokenizer.encode(text)
    first, kl, dp, same, nll_a, nll_b = ctx // 2, [], [], [], [], []
    o_proj = hf.model.layers[1].self_attn.o_proj
    dh = tiny_lm.config.head_dim
    for i in range(k):
        row = torch.tensor([ids[i * ctx:(i + 1) * ctx]])
        tgt = torch.tensor(ids[i * ctx + first + 1:(i + 1) * ctx])
        with torch.no_grad():
            la = torch.log_softmax(hf(row).logits[0, first:-1].double(), -1)
            h = o_proj.register_forward_pre_hook(lambda m, a: (a[0].clone().index_fill_(-1, torch.arange(dh), 0.0),))
            lb = torch.log_softmax(hf(row).logits[0, first:-1].double(), -1)
            h.remove()
        kl += (la.exp() * (la - lb)).sum(-1).tolist()
        pa, pb = la.gather(1, tgt[:, None])[:, 0], lb.gather(1, tgt[:, None])[:, 0]
        dp += (pb.exp() - pa.exp()).tolist()
        same += (la.argmax(-1) == lb.argmax(-1)).tolist()
        nll_a += (-pa).tolist()
        nll_b += (-pb).tolist()
    n = len(kl)
    assert s["tokens_scored"] == n >= 100
    assert s["kld"]["mean"] == pytest.approx(sum(kl) / n, rel=1e-4) and s["kld"]["mean"] > 1e-4
    assert s["kld"]["max"] == pytest.approx(max(kl), rel=1e-4)
    assert s["kld"]["percentiles"]["50"] == pytest.approx(sorted(kl)[n // 2] if n % 2 else
                                                           (sorted(kl)[n // 2] + sorted(kl)[n // 2 - 1]) / 2, rel=1e-4)
    assert s["dp"]["mean"] == pytest.approx(sum(dp) / n, rel=1e-4, abs=1e-9)
    assert s["dp"]["rms"]["value"] == pytest.approx(math.sqrt(sum(d * d for d in dp) / n), rel=1e-4)
    assert s["same_top"]["value"] == pytest.approx(sum(same) / n)
    assert s["ppl_b"]["value"] == pytest.approx(math.exp(sum(nll_b) / n), rel=1e-4)
    assert s["ln_ppl_ratio"]["value"] == pytest.approx((sum(nll_b) - sum(nll_a)) / n, rel=1e-4, abs=1e-9)
    assert s["ln_ppl_correlation"] == pytest.approx(float(torch.corrcoef(torch.tensor([nll_a, nll_b]))[0, 1]),
                                                    rel=1e-3)


def test_a_side_against_itself_has_no_divergence(tiny_lm, text):
    from llmtrace.run.eval import evaluate

    s = evaluate(tiny_lm, text, b=tiny_lm, ctx=32, chunks=7).summary
    assert s["kld"]["mean"] == 0 and s["kld"]["max"] == 0 and s["same_top"]["value"] == 1.0
    assert s["ppl"] == s["ppl_b"] and s["ln_ppl_ratio"]["value"] == 0


# ----------------------------------------------------------------------------------------------------------------
# the top-K base file


def test_save_base_then_base_gives_the_one_process_kld_within_what_top_k_loses(tiny_lm, text, tmp_path):
    """With K = the whole vocabulary, the two runs agree (float32 storage); with a small K, the estimate is a lower
    bound of the KLD short of it by exactly T_A · KL(A's tail ‖ B's tail), the tails renormalized (eval_score.py)."""
    from llmtrace.run.compare import Side
    from llmtrace.run.eval import evaluate
    from llmtrace.run.interventions import Scale

    ctx, k = 32, 8
    b = Side(loaded=tiny_lm, interventions=(Scale(2, 0.5, part="ffn"),))
    one = evaluate(tiny_lm, text, b=b, ctx=ctx, chunks=k, batch=4)
    V = tiny_lm.config.vocab_size
    for top_k in (V, 16):
        path = tmp_path / f"base{top_k}.safetensors"
        saved = evaluate(tiny_lm, text, ctx=ctx, chunks=k, save_base=path, top_k=top_k)
        assert saved.base_written == str(path) and path.stat().st_size < k * 15 * (top_k * 8 + 16) + 4096
        two = evaluate(b, text, base=path, ctx=ctx, chunks=k, batch=4)
        s1, s2 = one.summary, two.summary
        assert s2["ppl"]["value"] == pytest.approx(s1["ppl"]["value"], rel=1e-6)  # A's next-token log-probs, kept
        assert s2["ppl_b"]["value"] == pytest.approx(s1["ppl_b"]["value"], rel=1e-6)
        assert s2["same_top"] == s1["same_top"]
        exact, approx = [v for c in one.chunks for v in c["kld"]], [v for c in two.chunks for v in c["kld"]]
        if top_k == V:
            assert approx == pytest.approx(exact, rel=1e-4, abs=1e-7)
        else:
            lost = [e - a for e, a in zip(exact, approx)]
            assert min(lost) > -1e-6 and max(lost) > 0  # a lower bound, and K = 16 of 300 does lose something
            assert sum(lost) / len(lost) == pytest.approx(_tail_kl(tiny_lm, b, text, ctx, k, top_k), rel=1e-3)


def _tail_kl(lm, b, text, ctx, k, top_k) -> float:
    """The mean of T_A · KL(tail_A ‖ tail_B) over the scored positions, from both sides' whole distributions."""
    from llmtrace.run.eval_score import Chunking, Scorer
    from llmtrace.run.interventions import prepare

    ids = lm.tokenizer.encode(text)
    ch = Chunking(ctx, None)
    scorer = Scorer(lm_a=lm, lm_b=lm, edits_b=prepare(lm, list(b.interventions), [ctx]))
    from llmtrace.run.eval_score import _logits

    total, n = 0.0, 0
    for i in range(k):
        la = torch.log_softmax(_logits(lm, [ch.ids(ids, i)], ch.first)[0].double(), -1)
        lb = torch.log_softmax(_logits(lm, [ch.ids(ids, i)], ch.first, scorer.edits_b)[0].double(), -1)
        top = la.topk(top_k, -1).indices
        mask = torch.ones_like(la, dtype=torch.bool).scatter_(1, top, False)  # the tail
        ta, tb = (la.exp() * mask).sum(-1), (lb.exp() * mask).sum(-1)
        qa, qb = la - ta.log()[:, None], lb - tb.log()[:, None]  # renormalized tails
        total += float((ta * ((qa.exp() * (qa - qb)) * mask).sum(-1)).sum())
        n += la.size(0)
    return total / n


def test_a_base_file_refuses_another_text_model_or_ctx(tiny_lm, text, tmp_path, capsys):
    path = tmp_path / "base.safetensors"
    p = tmp_path / "t.txt"
    p.write_text(text)
    code, _, err = run_cli(capsys, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 2, "--save-base", path,
                           "--top-k", 8)
    assert code == 0 and f"wrote {path}" in err
    code, out, err = run_cli(capsys, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 2, "--base", path,
                             "--dtype", "bfloat16")
    assert code == 0 and "Mean    KLD" in out, err
    hf = tmp_path / "hf"
    _write_other_tiny(hf)
    other = tmp_path / "other.txt"
    other.write_text(text.replace("truth", "fact"))
    fails(capsys, 2, "eval", other, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 2, "--base", path,
          says=("another text",))
    fails(capsys, 2, "eval", p, "-m", tiny_lm.path, "--ctx", 64, "--chunks", 2, "--base", path, says=("ctx 32",))
    fails(capsys, 2, "eval", p, "-m", hf, "--ctx", 32, "--chunks", 2, "--base", path, says=("another one",))
    fails(capsys, 2, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--base", p, says=("not a base file",))


def _write_other_tiny(path):
    from tiny import TinySpec, write_hf_dir

    write_hf_dir(path, TinySpec(n_layers=3, seed=5))


# ----------------------------------------------------------------------------------------------------------------
# the stream, resume


def test_interrupted_then_resumed_gives_the_uninterrupted_summary(tiny_lm, text):
    from llmtrace.run.eval import evaluate

    opts = dict(ctx=32, chunks=9, batch=2)
    whole = evaluate(tiny_lm, text, **opts)
    events: list[dict] = []

    def stop_after_5(rec, progress):
        events.append(rec)
        if progress.done == 5:
            raise KeyboardInterrupt

    cut = evaluate(tiny_lm, text, on_start=lambda h, kept: events.insert(0, h), on_chunk=stop_after_5, **opts)
    assert cut.interrupted and cut.summary["interrupted"] and cut.summary["chunks"] == 5
    events.append(cut.summary)
    lines = [json.loads(json.dumps(e)) for e in events]  # through JSON, as a file holds them
    resumed = evaluate(tiny_lm, text, resume=lines, **opts)
    assert not resumed.interrupted
    assert resumed.summary == whole.summary
    assert [c["chunk"] for c in resumed.chunks] == list(range(9))


def test_cli_jsonl_is_valid_line_by_line_and_resume_continues(tiny_lm, text, tmp_path, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    from llmtrace.trace.events import schema_path

    p = tmp_path / "t.txt"
    p.write_text(text)
    out = tmp_path / "run.jsonl"
    code, stdout, err = run_cli(capsys, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 4, "--b-dtype",
                                "bfloat16", "--jsonl", out, "--threads", 1)
    assert code == 0, err
    assert "Mean    KLD" in stdout and "Same top p" in stdout and "[4/4]" in err and "tok/s" in err
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["event"] for e in events] == ["eval"] + ["chunk"] * 4 + ["eval_summary"]
    validator = jsonschema.Draft202012Validator(json.loads(schema_path().read_text()))
    for ev in events:
        validator.validate(ev)
    assert undeclared_fields(events) == []
    s = events[-1]
    assert s["tokens_scored"] == 4 * 15 and s["kld"]["mean"] > 0 and 0 <= s["same_top"]["value"] <= 1
    # cut the file after two chunks (as a Ctrl-C leaves it, with an interrupted summary), resume
    kept = out.read_text().splitlines()[:3] + [json.dumps(s | {"chunks": 2, "interrupted": True})]
    out.write_text("\n".join(kept) + "\n")
    code, _, err = run_cli(capsys, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 4, "--b-dtype",
                           "bfloat16", "--resume", out, "--threads", 1)
    assert code == 0, err
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["event"] for e in again] == ["eval"] + ["chunk"] * 4 + ["eval_summary"]
    assert again[-1] == s


# ----------------------------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_one_line_and_exit_2(tiny_lm, tmp_path, capsys, text):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("A few words.")
    m = str(tiny_lm.path)
    fails(capsys, 2, "eval", empty, "-m", m, "--ctx", 32, says=("empty",))
    fails(capsys, 2, "eval", short, "-m", m, "--ctx", 32, says=("shorter than one chunk", "--ctx"))
    p = tmp_path / "t.txt"
    p.write_text(text)
    fails(capsys, 2, "eval", p, "-m", m, "--ctx", 4096, says=("--ctx", "context window"))
    fails(capsys, 2, "eval", p, "-m", m, "--ctx", 2, says=("--ctx",))
    fails(capsys, 2, "eval", p, "-m", m, "--ctx", 32, "--layers", says=("--layers",))
    fails(capsys, 2, "eval", p, "-m", m, "--ctx", 32, "--resume", tmp_path / "none.jsonl", says=("--resume",))
    code, out, _ = run_cli(capsys, "eval", "--help")
    assert code == 0 and "Examples" in out and "--save-base" in out


# ----------------------------------------------------------------------------------------------------------------
# --layers: where the error enters, MoE routing


def test_layers_locate_the_error_where_it_is_added(tiny_lm, text):
    """B scales layer 2's FFN: layers 0 and 1 add nothing, layer 2 adds the error, every position first diverges
    there."""
    from llmtrace.run.compare import Side
    from llmtrace.run.eval import evaluate
    from llmtrace.run.interventions import Scale

    b = Side(loaded=tiny_lm, interventions=(Scale(2, 0.5, part="ffn"),))
    s = evaluate(tiny_lm, text, b=b, ctx=32, chunks=4, batch=2, layers=True).summary
    rows = s["layers"]["rows"]  # embed, layers 0..3, logits
    assert [r["where"] for r in rows] == ["embed"] + ["layer"] * 4 + ["logits"]
    assert rows[0]["added"]["max"] == 0 and rows[1]["added"]["max"] == 0 and rows[2]["added"]["max"] == 0
    assert rows[3]["added"]["mean"] > 1e-3 and rows[3]["accumulated"]["p50"] == pytest.approx(
        rows[3]["added"]["p50"])
    assert rows[4]["accumulated"]["mean"] > 1e-3
    first = s["layers"]["first_divergence"]
    assert first[3] == s["tokens_scored"] and sum(first) == s["tokens_scored"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_routing_agreement_is_one_against_itself_and_less_against_fast(families, name, text, monkeypatch,
                                                                          tmp_path):
    from llmtrace.checkpoint.load import load_model
    from llmtrace.run.eval import evaluate

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path))
    path = str(families.gguf(name, "q8_0"))
    exact = load_model(path, device="cpu", dtype="float32")
    fast = load_model(path, device="cpu", fast=True)
    ctx = 32
    same = evaluate(exact, text, b=exact, ctx=ctx, chunks=3, layers=True).summary
    routing = same["layers"]["routing"]
    assert routing and all(r["agreement"] == 1.0 for r in routing)
    assert all(r["load_a"] == r["load_b"] and sum(r["load_a"]) == r["positions"] * exact.config.n_experts_used
               for r in routing)
    drift = evaluate(exact, text, b=fast, ctx=ctx, chunks=3, layers=True).summary
    agreement = [r["agreement"] for r in drift["layers"]["routing"]]
    assert min(agreement) < 1.0 and drift["kld"]["mean"] > 0


# ----------------------------------------------------------------------------------------------------------------
# beyond one process


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(threads)


def test_two_worker_processes_give_the_figures_of_one(tiny_lm, text, one_thread):
    from llmtrace.run.compare import Side
    from llmtrace.run.eval import evaluate

    spec = str(tiny_lm.path)
    opts = dict(b=Side(model=spec, dtype="bfloat16"), ctx=32, chunks=7, batch=2, threads=one_thread)
    one = evaluate(spec, text, **opts)
    seen = []
    two = evaluate(spec, text, workers=2, on_chunk=lambda rec, p: seen.append(rec["chunk"]), **opts)
    assert seen == list(range(7))  # heard in chunk order
    assert two.summary == one.summary and two.chunks == one.chunks


@pytest.mark.slow  # Ray starts a local cluster: about 10 s
def test_ray_actors_give_the_figures_of_one(tiny_lm, text, one_thread):
    ray = pytest.importorskip("ray")
    from llmtrace.run.compare import Side
    from llmtrace.run.eval import evaluate

    spec = str(tiny_lm.path)
    opts = dict(b=Side(model=spec, dtype="bfloat16"), ctx=32, chunks=5, batch=2, threads=one_thread)
    one = evaluate(spec, text, **opts)
    try:
        on_ray = evaluate(spec, text, workers=2, ray="local", **opts)  # Ray's cluster as --ray local starts it
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # on loopback only
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    finally:
        ray.shutdown()
    assert on_ray.summary == one.summary


def test_ray_missing_is_one_line(tiny_lm, tmp_path, capsys, text, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as where it is not installed
    p = tmp_path / "t.txt"
    p.write_text(text)
    fails(capsys, 2, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 2, "--ray", "local",
          says=("ray is not installed", "[ray]'", "pip install"))


def test_ctrl_c_keeps_a_valid_stream_and_resume_ends_on_the_same_summary(smollm_path, text, tmp_path):
    """A real SIGINT to the command mid-run: every line of --jsonl is whole JSON, the last an interrupted summary;
    --resume then finishes with the summary of a run that was never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    p = tmp_path / "t.txt"
    p.write_text(text)
    out, whole = tmp_path / "run.jsonl", tmp_path / "whole.jsonl"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    args = [sys.executable, "-m", "llmtrace", "eval", str(p), "-m", str(smollm_path), "--ctx", "64", "--threads", "1",
            "--batch", "1"]
    proc = subprocess.Popen(args + ["--jsonl", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert events[-1]["event"] == "eval_summary" and events[-1]["interrupted"]
    n_cut = events[-1]["chunks"]
    assert 2 <= n_cut < events[0]["chunks"]
    done = subprocess.run(args + ["--resume", str(out)], env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr
    again = subprocess.run(args + ["--jsonl", str(whole)], env=env, capture_output=True, timeout=600)
    assert again.returncode == 0
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    uninterrupted = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [e["event"] for e in resumed] == [e["event"] for e in uninterrupted]
    assert resumed[-1] == uninterrupted[-1] and not resumed[-1]["interrupted"]


# ----------------------------------------------------------------------------------------------------------------
# the page


def test_the_page_draws_the_distributions_and_the_layers_offline(tiny_lm, text, tmp_path, capsys, browser):
    from helpers import Opened

    p = tmp_path / "t.txt"
    p.write_text(text)
    html, doc = tmp_path / "eval.html", tmp_path / "eval.json"
    code, _, err = run_cli(capsys, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 8, "--b-dtype", "bfloat16",
                           "--layers", "--html", html, "--json", doc, "--threads", 1)
    assert code == 0, err
    d = json.loads(doc.read_text())
    o = Opened(browser, html)
    try:
        assert o.messages == [] and o.requests == [o.url]  # nothing from the network, no script error
        summary = o.page.inner_text("#summary")
        assert f"{d['summary']['kld']['mean']:10.6f}".strip() in summary and "Same top p" in summary
        n = d["summary"]["tokens_scored"]
        for chart in ("#kld-svg", "#dp-svg"):  # every scored position falls in one bar
            titles = o.page.eval_on_selector_all(f"{chart} rect title", "ts => ts.map(t => t.textContent)")
            assert sum(int(t.rsplit(": ", 1)[1]) for t in titles) == n
        assert o.page.locator("#layers polyline").count() == 3 and o.page.locator("#ppl polyline").count() == 2
    finally:
        o.page.close()


def test_the_python_api_takes_loaded_models_and_renders_the_page(tiny_lm, text):
    import llmtrace
    from llmtrace.api import Model

    m = Model(tiny_lm)
    r = llmtrace.evaluate(m, text, b=m, ctx=32, chunks=7)
    assert isinstance(r, llmtrace.Evaluation) and r.summary["kld"]["mean"] == 0 and not r.interrupted
    assert repr(r).startswith("Evaluation(chunks=7, ppl=")
    page = r.html()
    assert "<svg" in page and "KL(A‖B)" in page and "http" not in page.split("</head>")[0].replace(
        "http-equiv", "")
    assert [e["event"] for e in r.to_jsonl_events()] == ["eval"] + ["chunk"] * 7 + ["eval_summary"]
    one = llmtrace.evaluate(m, text, ctx=32, chunks=3)
    assert 'id="ppl"' in one.html() and 'id="kld"' not in one.html()


def test_statistics_are_llama_cpps():
    """Percentiles linear between ranks (numpy's default), the median of an even count the mean of the middle two,
    and llama.cpp's uncertainty of a mean (none over 10 values or fewer)."""
    import numpy as np

    from llmtrace.run.eval_stats import mean_unc, median, percentile

    rng = np.random.default_rng(0)
    v = sorted(rng.standard_normal(1001).tolist())
    for q in (0.1, 1, 5, 10, 25, 75, 90, 95, 99, 99.9):
        assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)), rel=1e-12, abs=1e-12)
    assert median(v[:10]) == pytest.approx((v[4] + v[5]) / 2)
    x = rng.standard_normal(50)
    m, u = mean_unc(float(x.sum()), float((x ** 2).sum()), 50)
    assert m == pytest.approx(x.mean()) and u == pytest.approx(x.std() / math.sqrt(49), rel=1e-9)
    assert mean_unc(1.0, 1.0, 10)[1] == 0.0
