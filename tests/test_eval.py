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
# base files: exact (the default) and top K


@pytest.fixture(scope="module")
def one_run(tiny_lm, text):
    """Side B (layer 2's FFN halved) against A in one run: the KLD a base file must give back."""
    from llmtrace.run.compare import Side
    from llmtrace.run.eval import evaluate
    from llmtrace.run.interventions import Scale

    b = Side(loaded=tiny_lm, interventions=(Scale(2, 0.5, part="ffn"),))
    return b, evaluate(tiny_lm, text, b=b, ctx=32, chunks=8, batch=4)


def test_an_exact_base_gives_the_one_run_kld_within_its_stated_bound(tiny_lm, text, tmp_path, one_run):
    """The default base keeps every log-prob as 16 bits: chunk by chunk, |KLD − one-run KLD| is within the bound the
    run states (eval_score.py derives it from half a quantization step); PPL(A), Δp and same top are exact."""
    from llmtrace.run.eval import evaluate

    b, one = one_run
    path = tmp_path / "base.safetensors"
    saved = evaluate(tiny_lm, text, ctx=32, chunks=8, save_base=path)
    assert saved.base_written == str(path) and saved.header["base_form"] == "exact"
    V, n = tiny_lm.config.vocab_size, 8 * 15
    assert path.stat().st_size > 2 * n * V  # every entry of every row, 16 bits each
    two = evaluate(b, text, base=path, ctx=32, chunks=8, batch=4)
    s1, s2 = one.summary, two.summary
    assert two.header["base_form"] == "exact" and two.header["top_k"] is None
    for c1, c2 in zip(one.chunks, two.chunks):
        bound = c2["sums"]["kld_bound"]
        assert abs(c2["sums"]["kld"] - c1["sums"]["kld"]) <= bound
        assert c2["sums"]["nll"] == pytest.approx(c1["sums"]["nll"], rel=1e-12)  # kept whole
        assert c2["dp"] == pytest.approx(c1["dp"], rel=1e-9, abs=1e-15)
    assert abs(s2["kld"]["mean"] - s1["kld"]["mean"]) <= s2["kld"]["bound"] < 1e-3 * s1["kld"]["mean"]
    assert s2["same_top"] == s1["same_top"] and s2["ppl_b"]["value"] == pytest.approx(s1["ppl_b"]["value"], rel=1e-9)
    from llmtrace.render.eval import summary_text

    assert "exact base" in summary_text(two.header, s2)


def test_a_top_k_base_is_a_lower_bound_short_by_at_most_its_stated_bound(tiny_lm, text, tmp_path, one_run):
    """K = 16 of 320: the KLD never exceeds the one-run KLD, falls short of it by exactly T_A · KL(A's tail ‖ B's
    tail) (the tails renormalized), and by no more than the bound the run states, per chunk."""
    from llmtrace.render.eval import summary_text
    from llmtrace.run.eval import evaluate

    b, one = one_run
    path = tmp_path / "base16.safetensors"
    saved = evaluate(tiny_lm, text, ctx=32, chunks=8, save_base=path, base_top_k=16)
    assert path.stat().st_size < 8 * 15 * (16 * 8 + 16) + 4096
    assert saved.header["base_form"] == "top_k" and saved.header["top_k"] == 16
    two = evaluate(b, text, base=path, ctx=32, chunks=8, batch=4)
    exact, approx = [v for c in one.chunks for v in c["kld"]], [v for c in two.chunks for v in c["kld"]]
    lost = [e - a for e, a in zip(exact, approx)]
    assert min(lost) > -1e-9 and max(lost) > 0  # a lower bound, and K = 16 of 320 does lose something
    assert sum(lost) / len(lost) == pytest.approx(_tail_kl(tiny_lm, b, text, 32, 8, 16), rel=1e-6)
    for c1, c2 in zip(one.chunks, two.chunks):
        assert 0 <= c1["sums"]["kld"] - c2["sums"]["kld"] <= c2["sums"]["kld_bound"]
    s1, s2 = one.summary, two.summary
    assert s2["kld"]["mean"] <= s1["kld"]["mean"] <= s2["kld"]["mean"] + s2["kld"]["bound"]
    assert s2["ppl"]["value"] == pytest.approx(s1["ppl"]["value"], rel=1e-9) and s2["same_top"] == s1["same_top"]
    text_out = summary_text(two.header, s2)
    assert "top-16 base: a lower bound" in text_out and f"{s2['kld']['bound']:.2e}" in text_out
    tails = [1 - math.fsum(math.exp(x) for x in row) for row in _top_logp(tiny_lm, text, 32, 8, 16)]
    assert s2["kld"]["tail"] == pytest.approx(sum(tails) / len(tails), rel=1e-5)
    assert f"its tail held {100 * s2['kld']['tail']:.2f}% of A's mass" in text_out
    # K = the whole vocabulary: nothing is missing, the bound is 0 and the KLD the one-run KLD
    whole = tmp_path / "base_all.safetensors"
    evaluate(tiny_lm, text, ctx=32, chunks=8, save_base=whole, base_top_k=tiny_lm.config.vocab_size)
    all_k = evaluate(b, text, base=whole, ctx=32, chunks=8, batch=4)
    assert [v for c in all_k.chunks for v in c["kld"]] == pytest.approx(exact, rel=1e-4, abs=1e-7)
    assert all_k.summary["kld"]["bound"] == 0


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


def _top_logp(lm, text, ctx, k, top_k) -> list[list[float]]:
    """A's top `top_k` log-probs at every scored position of the first k chunks."""
    from llmtrace.run.eval_score import Chunking, _logits

    ids, ch = lm.tokenizer.encode(text), Chunking(ctx, None)
    return [row for i in range(k) for row in torch.log_softmax(
        _logits(lm, [ch.ids(ids, i)], ch.first)[0].double(), -1).topk(top_k, -1).values.tolist()]


def test_the_tail_bound_is_reached_by_the_worst_tail_and_holds_for_others():
    """The bound is the largest T_A · KL(Ã‖B̃) over every tail the file allows (each tail token at most the K-th
    kept probability): a tail built to be that worst case reaches it, and random allowed tails stay under it."""
    from llmtrace.run.eval_score import _against_top_k, top_rows

    g = torch.Generator().manual_seed(3)
    V, K = 40, 4
    lp_b = torch.log_softmax(torch.randn(1, V, generator=g, dtype=torch.float64) * 3, -1)
    for trial in range(30):
        la = torch.randn(1, V, generator=g, dtype=torch.float64) * (0.5 + trial / 10)
        lp_a = torch.log_softmax(la, -1)
        base = top_rows(lp_a, torch.tensor([0]), K) | {"form": "top_k"}
        base["top_logp"] = base["top_logp"].double()
        f = _against_top_k(base, lp_b, torch.tensor([0]))
        p_a, p_b = lp_a.exp(), lp_b.exp()
        full = float((p_a * (lp_a - lp_b)).sum())
        assert 0 <= full - float(f["kld"][0]) <= float(f["bound"][0]) + 1e-12
    # the worst tails: as much mass as each tail token may hold (p_K), on B's least likely tokens
    top, least = lp_b[0].argsort(descending=True)[:K], lp_b[0].argsort()
    for p_k, tail in ((0.151, [0.151, 0.151, 0.094]), (0.21, [0.16])):  # m = 2 entries at c and the rest; m = 0
        p_a = torch.zeros(V, dtype=torch.float64)
        p_a[top] = p_k
        p_a[least[:len(tail)]] = torch.tensor(tail, dtype=torch.float64)
        assert float(p_a.sum()) == pytest.approx(1.0, abs=1e-12)
        base = {"form": "top_k", "top_ids": top[None].to(torch.int32),
                "top_logp": torch.full((1, K), math.log(p_k), dtype=torch.float64),
                "tail": torch.tensor([sum(tail)], dtype=torch.float64), "target_logp": torch.tensor([math.log(p_k)])}
        f = _against_top_k(base, lp_b, top[:1])
        on = p_a > 0
        full = float((p_a[on] * (p_a[on].log() - lp_b[0, on])).sum())
        assert full - float(f["kld"][0]) == pytest.approx(float(f["bound"][0]), rel=1e-6)


def test_a_base_file_round_trips_and_an_old_one_still_loads(tiny_lm, text, tmp_path):
    """What the exact writer streams is what the reader gives back, entry for entry, each within half a step of A's
    log-prob; a base file of format /1 (top K, before the exact form) still loads and compares; another format is
    refused in one line."""
    import json as _json

    from safetensors.torch import save_file

    from llmtrace.errors import UsageError
    from llmtrace.run.eval import evaluate
    from llmtrace.run.eval_base import dequantize, half_steps, open_base
    from llmtrace.run.eval_score import Chunking, _logits

    path = tmp_path / "base.safetensors"
    evaluate(tiny_lm, text, ctx=32, chunks=3, save_base=path, batch=2)
    f = open_base(path)
    assert f.form == "exact" and f.header["chunks"] == 3 and f.top_k is None
    ids = tiny_lm.tokenizer.encode(text)
    assert f.tokens == ids[:3 * 32]
    ch = Chunking(32, tiny_lm.tokenizer.bos_id if tiny_lm.tokenizer.add_bos else None)
    for i in range(3):
        rows = f.rows(i, ch.scored)
        lp = torch.log_softmax(_logits(tiny_lm, [ch.ids(ids, i)], ch.first)[0].double(), -1)
        back = dequantize(rows["q"], rows["lo"], rows["step"])
        assert ((back - lp).abs() <= half_steps(rows["step"])[:, None]).all()
        assert rows["lo"].tolist() == lp.min(-1).values.tolist() and (rows["q"].int().max(-1).values == 65535).all()
        tgt = torch.tensor(ch.targets(ids, i))
        assert rows["target_logp"].tolist() == lp.gather(1, tgt[:, None])[:, 0].tolist()
        assert rows["top_id"].tolist() == lp.argmax(-1).tolist()
    # format /1: the top-K tensors, no `form` in its header
    header = dict(f.header)
    del header["form"]
    header["top_k"] = 8
    top = lambda lp: lp.topk(8, -1)  # noqa: E731
    lps = [torch.log_softmax(_logits(tiny_lm, [ch.ids(ids, i)], ch.first)[0].double(), -1) for i in range(3)]
    tgts = [torch.tensor(ch.targets(ids, i)) for i in range(3)]
    old = tmp_path / "old.safetensors"
    save_file({"tokens": torch.tensor(f.tokens, dtype=torch.int32),
               "top_ids": torch.cat([top(lp).indices for lp in lps]).to(torch.int32),
               "top_logp": torch.cat([top(lp).values for lp in lps]).float(),
               "tail": torch.cat([1 - top(lp).values.exp().sum(-1) for lp in lps]),
               "target_logp": torch.cat([lp.gather(1, t[:, None])[:, 0] for lp, t in zip(lps, tgts)])},
              str(old), metadata={"format": "llmtrace.eval-base/1", "header": _json.dumps(header)})
    r = evaluate(tiny_lm, text, base=old, ctx=32, chunks=3)
    assert r.header["base_form"] == "top_k" and r.header["top_k"] == 8
    assert r.summary["ppl"]["value"] == pytest.approx(evaluate(tiny_lm, text, ctx=32, chunks=3).summary["ppl"]["value"],
                                                      rel=1e-9)
    assert r.summary["kld"]["mean"] < 1e-6 <= r.summary["kld"]["bound"] + 1e-6  # A against itself, through its top 8
    future = tmp_path / "future.safetensors"
    save_file({"tokens": torch.tensor([1])}, str(future), metadata={"format": "llmtrace.eval-base/9"})
    with pytest.raises(UsageError, match=r"not a base file of llmtrace eval \(its format is 'llmtrace.eval-base/9'\)"):
        evaluate(tiny_lm, text, base=future, ctx=32, chunks=3)


def test_an_interrupted_save_base_leaves_no_file(tiny_lm, text, tmp_path):
    from llmtrace.run.eval import evaluate

    path = tmp_path / "base.safetensors"

    def stop(rec, p):
        if p.done == 2:
            raise KeyboardInterrupt

    r = evaluate(tiny_lm, text, ctx=32, chunks=4, batch=1, save_base=path, on_chunk=stop)
    assert r.interrupted and r.base_written is None
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy


def test_a_base_file_refuses_another_text_model_or_ctx(tiny_lm, text, tmp_path, capsys):
    path = tmp_path / "base.safetensors"
    p = tmp_path / "t.txt"
    p.write_text(text)
    code, _, err = run_cli(capsys, "eval", p, "-m", tiny_lm.path, "--ctx", 32, "--chunks", 2, "--save-base", path,
                           "--base-top-k", 8)
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
    assert "Mean    KLD" in stdout and "Same top p" in stdout and "eval: 4/4, KLD " in err and "tok/s" in err
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


# ----------------------------------------------------------------------------------------------------------------
# progress


def test_progress_moves_within_a_batch_and_its_rate_is_measured(tiny_lm, text, monkeypatch):
    """Each chunk is heard as soon as it is scored, in order, with a count that only grows; between them the
    position moves with every layer of the pass; the rate is the work done (in scored tokens, the batch in flight
    counted by its steps) over the time it took on the clock (here one that reads half a second later at each look),
    and the time left the work to go at that rate."""
    from llmtrace.run import eval as run_eval

    reads: list[float] = []

    def clock() -> float:
        reads.append(0.5 * len(reads))
        return reads[-1]

    monkeypatch.setattr(run_eval.Counter, "clock", staticmethod(clock))
    heard, chunks = [], []
    heard_at_first: list[int] = []

    def on_chunk(rec, p):
        chunks.append((rec["chunk"], p, reads[-1]))
        heard_at_first.append(len(heard))

    run_eval.evaluate(tiny_lm, text, ctx=32, chunks=6, batch=3, on_progress=heard.append, on_chunk=on_chunk)
    assert [c for c, _, _ in chunks] == list(range(6))
    assert [p.done for _, p, _ in chunks] == [1, 2, 3, 4, 5, 6] and {p.total for _, p, _ in chunks} == {6}
    positions = [p.position for p in heard]
    assert positions == sorted(positions) and positions[-1] == 6
    before_first = positions[:heard_at_first[0]]  # the first batch's pass, a layer at a time, before any chunk
    assert len(before_first) >= tiny_lm.config.n_layers + 1 and before_first[0] == 0
    assert all(x < y for x, y in zip(before_first, before_first[1:]))
    t0 = reads[0]  # the first look: the first pass starts
    for _, p, t in chunks:
        assert p.tokens_per_s == pytest.approx(p.position * 15 / (t - t0), rel=1e-12)
        assert p.eta_s == pytest.approx((6 - p.position) * 15 / p.tokens_per_s, rel=1e-12, abs=1e-12)
        assert p.position >= p.done and p.running["tokens_scored"] == p.done * 15
    assert heard[0].tokens_per_s is None  # nothing measured yet


def test_the_bar_and_the_plain_lines_fit_80_columns():
    """On a terminal the bar's line; in a pipe a line at the first chunk and at each tenth: never over 80 columns,
    with large counts, rates and times too."""
    import io
    import re

    from rich.console import Console

    from llmtrace.render.eval import EvalBar
    from llmtrace.run.eval import Progress

    ppl = {"ppl": {"value": 123456.789, "uncertainty": 98765.4}, "tokens_scored": 1}
    kld = {"kld": {"mean": 0.123456, "uncertainty": 0.0123}, "ppl": ppl["ppl"], "tokens_scored": 1}
    for running in (ppl, kld, None):
        out = io.StringIO()
        bar = EvalBar(Console(file=out, force_terminal=True, width=80, color_system=None))
        for done in (0, 99_998, 99_999):
            bar.update(Progress(done=done, total=100_000, position=done + 0.5, tokens_per_s=1_234_567.8,
                                eta_s=400_000.0, running=running))
        bar.close()
        lines = [x for x in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())) if x.strip()]
        assert lines and all(len(x) <= 80 for x in lines), lines
        assert "99,999/100,000" in lines[-1] and lines[-1].startswith("eval ")
        if running is not None:
            assert ("KLD 0.12346" if "kld" in running else "PPL 123456.789") in lines[-1]
    out = io.StringIO()
    bar = EvalBar(Console(file=out, force_terminal=False, width=80))
    for done in range(1, 41):
        bar.update(Progress(done=done - 1, total=40, position=done - 0.5, tokens_per_s=None, eta_s=None,
                            running=kld if done > 1 else None))  # a step within a batch: not a line
        bar.update(Progress(done=done, total=40, position=done, tokens_per_s=12_345.0, eta_s=4000.0, running=kld))
    lines = out.getvalue().splitlines()
    assert [x.split(",")[0] for x in lines] == ["eval: 1/40"] + [f"eval: {4 * k}/40" for k in range(1, 11)]
    assert all(len(x) <= 80 for x in lines) and "12,345 tok/s, 1:06:40 left" in lines[-1]


def test_the_api_is_quiet_by_default_and_shows_progress_when_asked(tiny_lm, text, capsys):
    import llmtrace
    from llmtrace.api import Model
    from llmtrace.errors import BadValue

    m = Model(tiny_lm)
    llmtrace.evaluate(m, text, ctx=32, chunks=3)
    assert capsys.readouterr().err == ""
    heard = []
    llmtrace.evaluate(m, text, ctx=32, chunks=3, batch=1, progress=True, on_progress=heard.append)
    err = capsys.readouterr().err.splitlines()  # not a terminal: a line a tenth
    assert [x.split(",")[0] for x in err] == ["eval: 1/3", "eval: 2/3", "eval: 3/3"] and "tok/s" in err[-1]
    assert heard and heard[-1].done == 3  # the caller's listener hears it too
    with pytest.raises(BadValue, match="progress"):
        llmtrace.evaluate(m, text, ctx=32, chunks=3, progress="yes")


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
