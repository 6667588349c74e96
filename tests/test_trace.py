"""The trace of a run: schema, shapes, KV-cache bytes, statistics, dumps, and that observing changes nothing. The
checks that hold for any model run on the tiny model of the quick suite (`lm`: tiny_lm) and on the real SmolLM2."""

import json
import math
import subprocess
import sys

import pytest
from helpers import model_param, undeclared_fields
import torch

from llmtrace.run.generate import generate
from llmtrace.run.sampler import Sampler, SamplerConfig
from llmtrace.trace.events import schema_path
from llmtrace.trace.recorder import Recorder
from llmtrace.trace.options import TraceOptions

PROMPT = "Quantum mechanics is a fundamental theory in physics that"


def traced_run(lm, level, layers=None, n=6, dump=(), **sampling):
    events = []
    rec = Recorder(TraceOptions(level=level, layers=layers, dump=dump), [events.append], run_info={"prompt": PROMPT})
    cfg = SamplerConfig(**({"temperature": 0.0} | sampling))
    ids = lm.tokenizer.encode(PROMPT)
    result = generate(lm, ids, Sampler(cfg, lm.config.vocab_size), n, ignore_eos=True, observer=rec)
    return events, result


def assert_stats_of(st: dict, x: torch.Tensor, rel: float, abs_mean: float) -> None:
    """A recorded statistics dict equals the statistics of x computed directly (in float64)."""
    x = x.double()
    assert st["mean"] == pytest.approx(x.mean().item(), rel=rel, abs=abs_mean)
    for name, value in (("std", x.std()), ("min", x.min()), ("max", x.max()), ("norm", x.norm())):
        assert st[name] == pytest.approx(value.item(), rel=rel), name


@pytest.fixture(params=model_param())
def lm(request):
    """The model a check runs on: the tiny one (quick suite) and the real SmolLM2 (slow)."""
    return request.getfixturevalue(request.param)


def last(lm) -> int:
    return lm.config.n_layers - 1


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("level", ["steps", "layers", "full"])
def test_real_trace_validates_against_schema(lm, validator, level):
    events, _ = traced_run(lm, level, layers=[0, last(lm)] if level != "steps" else None, n=3)
    for ev in events:
        validator.validate(ev)
    validator.validate({"schema": "llmtrace.trace/1", "events": events})
    assert undeclared_fields(events) == []  # every field written is documented
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run" and kinds[1] == "tokens" and kinds[-1] == "summary"
    assert kinds.count("step") == 3


def test_schema_rejects_a_broken_event(validator):
    bad = {"event": "step", "step": 0, "phase": "sideways", "position": 1, "token": {"id": 1, "piece": "a", "text": "a"},
           "kv_cache": {}, "ms": 1.0}
    assert not validator.is_valid(bad)


def test_shapes_equal_the_model_dimensions(lm):
    c = lm.config
    chosen = [0, 3, 29] if c.n_layers == 30 else [0, c.n_layers // 2, last(lm)]
    events, _ = traced_run(lm, "full", layers=chosen, n=3)
    T = len(lm.tokenizer.encode(PROMPT))
    H, Hkv, Dh, D, F, V = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model, c.ffn_dim, c.vocab_size
    seen = set()
    for ev in (e for e in events if e["event"] == "tensor"):
        t = T if ev["step"] == 0 else 1  # tokens in this pass
        s = T + ev["step"]  # keys cached after this pass
        expected = {
            "embed": [t, D], "attn_norm": [t, D], "q": [t, H, Dh], "k": [t, Hkv, Dh], "v": [t, Hkv, Dh],
            "q_rope": [t, H, Dh], "k_rope": [t, Hkv, Dh], "kv_write": [t], "k_repeated": [H, s, Dh],
            "scores": [H, t, s], "probs": [H, t, s], "attn_out": [t, H, Dh], "o_proj": [t, D], "resid_mid": [t, D],
            "ffn_norm": [t, D], "gate": [t, F], "up": [t, F], "act": [t, F], "down": [t, D], "resid_post": [t, D],
            "final_norm": [t, D], "last": [D], "logits": [V],
        }[ev["name"]]
        assert ev["shape"] == expected, ev["name"]
        seen.add((ev["layer"], ev["name"]))
        if ev["name"] == "kv_write":
            assert ev["positions"] == [s - t, s - 1]
    for layer in chosen:
        assert {n for (lay, n) in seen if lay == layer} == set(lm.points.names(layer=True, traced=True))
    assert not any(lay not in (None, *chosen) for lay, _ in seen)


def test_stats_are_the_tensors_statistics(lm):
    """The recorded mean/std/min/max/norm of the logits equal a direct computation on the logits."""
    events, _ = traced_run(lm, "layers", layers=[0], n=1)
    ev = next(e for e in events if e["event"] == "tensor" and e["name"] == "logits" and e["step"] == 0)
    ids = torch.tensor([lm.tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        logits = lm.model(ids)[0, -1].double()
    assert_stats_of(ev["stats"], logits, rel=1e-5, abs_mean=1e-5)


def test_kv_bytes_grow_by_bytes_per_token(lm):
    c = lm.config
    events, _ = traced_run(lm, "steps", n=6)
    steps = [e for e in events if e["event"] == "step"]
    bpt = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    assert bpt == {30: 46080, 4: 1024}[c.n_layers]  # 2·30·3·64·4 for SmolLM2 in fp32; 2·4·2·16·4 for the tiny one
    T = len(lm.tokenizer.encode(PROMPT))
    assert [s["kv_cache"]["seq_len"] for s in steps] == list(range(T, T + 6))  # the slots each step's pass filled
    for a, b in zip(steps, steps[1:]):
        assert b["kv_cache"]["bytes_used"] - a["kv_cache"]["bytes_used"] == bpt
        assert b["kv_cache"]["seq_len"] == a["kv_cache"]["seq_len"] + 1
    for s in steps:
        kv = s["kv_cache"]
        assert kv["bytes_per_token"] == bpt
        assert kv["bytes_used"] == kv["seq_len"] * bpt
        assert kv["mha_bytes_used"] == kv["bytes_used"] * c.n_heads // c.n_kv_heads
        assert kv["bytes_allocated"] == kv["capacity"] * bpt
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * 5


@pytest.mark.slow
def test_greedy_output_is_the_same_with_and_without_tracing(smollm):
    ids = smollm.tokenizer.encode(PROMPT)
    plain = generate(smollm, ids, Sampler(SamplerConfig(temperature=0.0), smollm.config.vocab_size), 12, ignore_eos=True)
    for level in ("steps", "layers", "full"):
        _, traced = traced_run(smollm, level, n=12)
        assert traced.tokens == plain.tokens, level


@pytest.mark.slow
def test_sampled_output_is_reproducible_and_ledger_matches_direct_computation(smollm):
    events_a, res_a = traced_run(smollm, "steps", n=5, temperature=0.7, top_k=20, top_p=0.9, seed=1234)
    _, res_b = traced_run(smollm, "steps", n=5, temperature=0.7, top_k=20, top_p=0.9, seed=1234)
    assert res_a.tokens == res_b.tokens
    first = next(e for e in events_a if e["event"] == "step")
    # direct computation of step 0: softmax of the raw logits, then temperature, top-k and top-p by hand
    ids = torch.tensor([smollm.tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        logits = smollm.model(ids)[0, -1].double()
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, 5)
    assert [c["id"] for c in first["topk"][:5]] == top.indices.tolist()
    for c, p in zip(first["topk"], top.values.tolist()):
        assert c["prob"] == pytest.approx(p, rel=1e-4)
    stages = {s["stage"]: s for s in first["sampler"]}
    assert stages["top_k"]["survivors"] == 20
    scaled = torch.softmax(logits / 0.7, -1)
    top20 = torch.topk(scaled, 20).values
    top20 = top20 / top20.sum()
    n_nucleus = int((torch.cumsum(top20, 0) < 0.9).sum().item()) + 1
    assert stages["top_p"]["survivors"] == n_nucleus
    pick = first["token"]["id"]
    kept = torch.topk(scaled, n_nucleus)
    assert pick in kept.indices.tolist()
    p_pick = (scaled[pick] / kept.values.sum()).item()
    assert first["sampler"][-1]["pick_prob"] == pytest.approx(p_pick, rel=1e-4)
    assert 0 <= first["rng"]["draw"] < 1 and first["rng"]["seed"] == 1234


def test_dump_records_values(lm):
    events, _ = traced_run(lm, "steps", n=1, dump=("logits", "0.probs"))
    logits = next(e for e in events if e["event"] == "tensor" and e["name"] == "logits")
    assert len(logits["values"]) == lm.config.vocab_size
    assert max(logits["values"]) == pytest.approx(logits["stats"]["max"], rel=1e-6)
    probs = next(e for e in events if e["event"] == "tensor" and e["name"] == "probs")
    assert probs["layer"] == 0
    for head in probs["values"]:
        for row in head:
            assert math.fsum(row) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_jsonl_on_stdout_reads_line_by_line(smollm_path, tmp_path):
    cmd = [sys.executable, "-m", "llmtrace", "generate", PROMPT, "-m", str(smollm_path), "-n", "3", "--jsonl", "-"]
    reader = "import sys, json; ev = [json.loads(l) for l in sys.stdin]; print(len(ev), ev[0]['event'], ev[-1]['event'])"
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = subprocess.run([sys.executable, "-c", reader], stdin=gen.stdout, capture_output=True, text=True, timeout=300)
    gen.stdout.close()
    assert gen.wait(timeout=300) == 0, gen.stderr.read().decode()
    n, first, last = out.stdout.split()
    assert first == "run" and last == "summary" and int(n) >= 6


def test_json_document_and_show_render_without_model(smollm_path, tmp_path):
    doc = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-m", "llmtrace", "generate", "Hello", "-m", str(smollm_path), "-n", "2",
                        "--json", str(doc)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    events = json.loads(doc.read_text())["events"]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["interrupted"] is False and summary["generated_tokens"] == 2
    shown = subprocess.run([sys.executable, "-m", "llmtrace", "show", str(doc)], capture_output=True, text=True, timeout=120,
                           env={"NO_COLOR": "1", "PATH": "/usr/bin:/bin", "LLMTRACE_HOME": str(tmp_path / "empty")})
    assert shown.returncode == 0, shown.stderr
    assert summary["text"].strip() in shown.stdout.replace("\n", " ") or summary["text"].strip()[:5] in shown.stdout
    assert "46,080" in shown.stdout  # the KV cache line: bytes per cached token


def test_ban_removes_a_word_with_and_without_its_leading_space(smollm):
    from llmtrace.run.sampler import banned_sequences

    events, plain = traced_run(smollm, "steps", n=1)
    word = smollm.tokenizer.decode([plain.tokens[0]]).strip()  # " describes" for this prompt
    bans = banned_sequences(smollm.tokenizer, [word])
    assert [plain.tokens[0]] in bans  # the space-prefixed form, as it appears mid-sentence
    assert smollm.tokenizer.encode(word, add_special_tokens=False) in bans  # and the bare form
    events, banned = traced_run(smollm, "steps", n=1, ban=bans)
    assert banned.tokens[0] != plain.tokens[0]
    step = next(e for e in events if e["event"] == "step")
    assert step["topk"][0]["id"] == plain.tokens[0]  # the raw distribution still ranks it first: the ban is a stage


def test_repeated_keys_are_the_keys_attention_used(lm):
    """k_repeated is what the spelled-out attention multiplies with: the keys written by this pass and the ones cached
    before it (k_rope of every earlier pass), each KV head repeated for its G query heads, as repeat_kv lays them out."""
    c = lm.config
    group = c.n_heads // c.n_kv_heads
    events, _ = traced_run(lm, "full", layers=[2], n=2, dump=("2.k_repeated", "2.k_rope"))
    ev = next(e for e in events if e["event"] == "tensor" and e["name"] == "k_repeated" and e["step"] == 1)
    S = len(lm.tokenizer.encode(PROMPT)) + 1
    assert ev["shape"] == [c.n_heads, S, c.head_dim]
    values = torch.tensor(ev["values"], dtype=torch.float64)  # (H, S, Dh)
    k_rope = [torch.tensor(e["values"], dtype=torch.float64) for e in events  # (t, Hkv, Dh) per pass
              if e["event"] == "tensor" and e["name"] == "k_rope"]
    keys = torch.cat(k_rope).transpose(0, 1)  # (Hkv, S, Dh)
    assert torch.equal(values, keys.repeat_interleave(group, dim=0))
    assert_stats_of(ev["stats"], values, rel=1e-6, abs_mean=1e-9)


def test_broadcast_view_statistics_equal_the_materialised_tensor():
    x = torch.randn(1, 5, 3, 1, 4, dtype=torch.float32)
    view = x.expand(1, 5, 3, 6, 4)  # a stride-0 dimension: each of the 3 entries repeated 6 times
    full = view.reshape(1, 5, 18, 4)  # what repeat_interleave(6, dim=2) makes
    recorded = []
    for t in (view, full):
        events = []
        rec = Recorder(TraceOptions(level="full"), [events.append])
        rec.step, rec.phase, rec._n_tokens = 1, "decode", 1
        rec(0, "k_repeated", t)
        rec.after_forward(1)
        recorded.append(events[0])
    assert recorded[0]["shape"] == recorded[1]["shape"] == [5, 18, 4]
    for k in ("mean", "std", "min", "max", "norm"):
        assert recorded[0]["stats"][k] == pytest.approx(recorded[1]["stats"][k], rel=1e-6, abs=1e-9)


def test_prepared_json_lines_equal_the_encoder(lm):
    """The JSON lines the recorder writes itself (TensorEvent.line) read back as the event, for every tensor event of
    a full trace with dumps: prefill (masked scores), decode, model- and layer-level points; a non-finite value of a
    dump (a masked score's -inf) is null, where the json module refuses it."""
    import math

    from llmtrace.trace.recorder import TensorEvent

    def finite(v):
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, list):
            return [finite(x) for x in v]
        return None if isinstance(v, float) and not math.isfinite(v) else v

    other = 5 if lm.config.n_layers == 30 else last(lm)
    events, _ = traced_run(lm, "full", layers=[0, other], n=3, dump=("logits", f"{other}.probs", "0.scores"))
    tensors = [e for e in events if e["event"] == "tensor"]
    dumped_scores = [e for e in tensors if e["name"] == "scores" and e["layer"] == 0]
    assert len(dumped_scores) == 3 and all("values" in e and "masked" in e for e in dumped_scores)
    assert dumped_scores[0]["masked"] > 0 and dumped_scores[1]["masked"] == 0  # the prefill's causal mask only
    assert all(type(e) is TensorEvent and e.line is not None for e in tensors)
    assert any(v == float("-inf") for row in dumped_scores[0]["values"][0] for v in row)
    for ev in tensors:
        assert b"\n" not in ev.line and json.loads(ev.line) == finite(dict(ev))


def test_statistics_rounded_on_the_device_equal_rounding_each_value():
    """stats.rounded_rows rounds the (n, 6) statistics rows in one batch; each value must equal records.rounded's
    "%.7g", across magnitudes, for float32-derived values, zeros, the limits of the batched path and non-finite
    entries (None)."""
    from llmtrace.trace.records import rounded as _round
    from llmtrace.trace.stats import rounded_rows as _rounded_rows

    gen = torch.Generator().manual_seed(0)
    mags = torch.pow(10.0, torch.empty(30000, dtype=torch.float64).uniform_(-14, 21, generator=gen))
    signs = torch.where(torch.rand(30000, generator=gen) < 0.5, -1.0, 1.0).double()
    special = torch.tensor([0.0, -0.0, 1.0, 10.0, 1e-5, 9.9999999e-6, 9999999.5, 1e7, 1e22, 1e-15, 5e-324, 1e-300,
                            1e300, float("inf"), float("-inf"), float("nan"), 2.0**-30, 0.15, 0.25], dtype=torch.float64)
    f32 = torch.randn(10000, generator=gen).double()
    vals = torch.cat([mags * signs, special, f32])
    vals = vals[: len(vals) // 5 * 5].view(-1, 5)
    rows = torch.cat([vals, torch.arange(len(vals), dtype=torch.float64)[:, None] * 1e9 + 123], dim=1)
    got = _rounded_rows(rows)
    for row, out in zip(rows.tolist(), got):
        assert out[:5] == [_round(v) for v in row[:5]]
        assert out[5] == row[5]  # the count is not rounded


def test_the_records_and_the_schema_name_the_same_fields():
    """records.py defines the records once; the schema must know every field they write and require none they lack."""
    from llmtrace.trace import records

    defs = json.loads(schema_path().read_text())["$defs"]
    explain_model = next(c["then"] for c in defs["explain"]["allOf"] if "model" in c["then"].get("properties", {}))
    pairs = [
        (records.TokensEvent, defs["tokens"]),
        (records.TokenRecord, defs["tokens"]["properties"]["tokens"]["items"]),
        (records.StatsRecord, defs["tensor"]["properties"]["stats"]),
        (records.ModelRecord, defs["run"]["properties"]["model"]),
        (records.ExplainModelRecord, explain_model["properties"]["model"]),
    ]
    for record, schema in pairs:
        fields = set(record.__annotations__) - {"event"}  # `event` is each event's discriminator, checked by its $def
        assert fields <= set(schema["properties"]), (record.__name__, fields - set(schema["properties"]))
        assert set(schema.get("required", ())) - {"event"} <= set(record.__required_keys__), record.__name__


def test_one_rounding_rule_for_generate_and_explain():
    """Both commands write 7 significant digits: a value in an explain section rounds as the recorder rounds."""
    from llmtrace.run.explain import _r
    from llmtrace.trace.records import rounded

    x = 0.123456789123
    assert _r(x) == rounded(x) == 0.1234568
    assert _r(torch.tensor(x)) == rounded(float(torch.tensor(x)))


def test_prefill_only_run_reports_shapes_prediction_and_summary(lm):
    """-n 0: the prompt, the prefill's shape table, what the model would predict next (top-k of the real logits), and
    a summary with no token taken."""
    events, result = traced_run(lm, "steps", n=0)
    kinds = [e["event"] for e in events]
    assert kinds[:3] == ["run", "tokens", "shapes"] and kinds[-2:] == ["prediction", "summary"]
    assert "step" not in kinds and result.tokens == []
    ids = lm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]))[0, -1]
    pred = events[-2]
    assert pred["position"] == len(ids)
    assert [c["id"] for c in pred["topk"][:5]] == logits.topk(5).indices.tolist()
    assert pred["kv_cache"]["seq_len"] == len(ids)
    assert events[-1]["generated_tokens"] == 0 and events[-1]["prompt_tokens"] == len(ids)


def test_the_recorder_keeps_no_model_and_leaves_nothing_attached(lm):
    """A pure observer: after a full trace no module of the recorder's state is the model (or any module), and no
    point of the model still reports to it."""
    rec = Recorder(TraceOptions(level="full", layers=[1]), [lambda ev: None], run_info={"prompt": PROMPT})
    generate(lm, lm.tokenizer.encode(PROMPT), Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size),
             2, ignore_eos=True, observer=rec)
    assert not any(isinstance(v, torch.nn.Module) for v in vars(rec).values())
    assert all(getattr(m, "observer", None) is None for m in lm.model.modules())


def test_the_cache_views_statistics_carried_from_pass_to_pass_equal_reducing_them_whole(tiny_lm, monkeypatch):
    """k_repeated (every key cached so far) is reduced, after its first pass, by the slots each pass wrote
    (trace.growing): over a prefill in two passes (the first one not observed) and decode steps its statistics equal
    those of the whole cache reduced at every pass, and the carried path is the one taken after the first pass."""
    from llmtrace.run import generate as generation
    from llmtrace.trace import growing

    lm = tiny_lm
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 24)  # a 40-token prompt is prefilled in two passes
    ids = (lm.tokenizer.encode(PROMPT) * 20)[:40]
    taken = []
    split = growing.Growing.split

    def counted(self, *args):
        got = split(self, *args)
        taken.append(got is not None)
        return got

    def run(carried: bool) -> list[dict]:
        events = []
        rec = Recorder(TraceOptions(level="full"), [events.append], run_info={"prompt": PROMPT})
        monkeypatch.setattr(growing.Growing, "split", counted if carried else (lambda self, *a: None))
        generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), 4, ignore_eos=True,
                 observer=rec)
        return [e for e in events if e["event"] == "tensor" and e["name"] == "k_repeated"]

    carried, whole = run(True), run(False)
    assert [(e["step"], e["layer"], e["shape"]) for e in carried] == [(e["step"], e["layer"], e["shape"]) for e in whole]
    assert len({e["step"] for e in carried}) == 4 and len(carried) == 4 * lm.config.n_layers  # the prefill's last pass
    for a, b in zip(carried, whole):
        for k in ("mean", "std", "min", "max", "norm"):
            assert a["stats"][k] == pytest.approx(b["stats"][k], rel=1e-12, abs=1e-15), (a["step"], a["layer"], k)
    n = lm.config.n_layers
    assert taken == [False] * n + [True] * (3 * n)  # the first pass reduced whole, each later one by its slots
    assert carried[0]["shape"][1] == 40 and carried[-1]["shape"][1] == 43  # every slot cached, both chunks' too
