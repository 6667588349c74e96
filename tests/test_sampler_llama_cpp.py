"""The samplers llama.cpp has and transformers lacks (issue 25): DRY, XTC, top-nσ and mirostat v1/v2.

Each is checked against a transcription of its definition written here independently of llmtrace.run.sampler: plain
Python over lists, on fixed logits, as llama.cpp's src/llama-sampling.cpp and the papers define it. The stages that
are off change nothing (tests/test_sampler.py runs unchanged)."""

import json
import math
import random

import pytest
import torch

from llmtrace.errors import UsageError
from llmtrace.run.sampler import (
    DRY_BREAKERS,
    LLAMA_CPP_ORDER,
    HF_ORDER,
    Sampler,
    SamplerConfig,
    dry_breakers,
    parse_order,
    repeat_lengths,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # sums in one order, as llama.cpp's one thread makes them


class CharTokenizer:
    """A test tokenizer: a fixed list of token texts, encoded by longest match. It has what DRY's breaker search
    uses (token_bytes, encode, vocab_size)."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.vocab_size = len(texts)

    def token_bytes(self, tid: int) -> bytes:
        return self.texts[tid].encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0
        while i < len(text):
            tid = max((t for t in range(self.vocab_size) if self.texts[t] and text.startswith(self.texts[t], i)),
                      key=lambda t: len(self.texts[t]))
            out.append(tid)
            i += len(self.texts[tid])
        return out


VOCAB = ["a", "b", "c", "d", "e", ":", "\n", "x", "y", "xy", "b:", "<s>"]
TOK = CharTokenizer(VOCAB)
A, B, C, D, E, COLON, NL, X, Y, XY, BCOLON, S = range(len(VOCAB))
V = len(VOCAB)


def rand_logits(seed: int, n: int = V, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


def survivors(x: torch.Tensor) -> set[int]:
    return set(torch.isfinite(x).nonzero().flatten().tolist())


# -----------------------------------------------------------------------------
# DRY


def ref_dry(logits: list[float], context: list[int], m: float, base: float, allowed: int,
            single_breakers: set[int]) -> list[float]:
    """DRY by its definition, O(L²): the most recent breaker limits a repeat to the tokens after it; a candidate t
    takes the longest n over the positions j with context[j + 1] == t such that the n tokens ending at j equal the
    last n tokens of the context; n >= allowed costs m * base ** (n - allowed), unless t is itself a breaker."""
    L = len(context)
    if L <= allowed:
        return list(logits)
    limit = L
    for i in range(L):
        if context[L - 1 - i] in single_breakers:
            limit = i
            break
    if limit < allowed:
        return list(logits)
    best: dict[int, int] = {}
    for j in range(L - 1):
        n = 0
        while n <= j and context[j - n] == context[L - 1 - n]:
            n += 1
        n = min(n, limit)
        if n >= allowed:
            best[context[j + 1]] = max(best.get(context[j + 1], -1), n)
    out = list(logits)
    for t, n in best.items():
        if t not in single_breakers:
            out[t] = float(torch.tensor(out[t], dtype=torch.float32) - torch.tensor(m * base ** (n - allowed),
                                                                                     dtype=torch.float32))
    return out


def dry_sampler(context_breakers=(":",), **kw) -> Sampler:
    cfg = SamplerConfig(dry_multiplier=kw.pop("m", 0.8), dry_base=kw.pop("base", 1.75),
                        dry_allowed_length=kw.pop("allowed", 2), dry_penalty_last_n=kw.pop("last_n", -1),
                        dry_sequence_breakers=list(context_breakers), seed=0, **kw)
    return Sampler(cfg, V, tokenizer=TOK)


def test_repeat_lengths_on_llama_cpp_example():
    # src/llama-sampling.cpp's comment: "a b c c b c y a b c" has repeat counts 0 0 3 1 0 2 0 0 0 (and the last is
    # the whole context): the suffix "a b c" also ends at index 2, "b c" at 5, "c" at 3
    assert repeat_lengths([A, B, C, C, B, C, Y, A, B, C]) == [0, 0, 3, 1, 0, 2, 0, 0, 0, 10]


@pytest.mark.parametrize("seed", range(30))
def test_repeat_lengths_match_brute_force(seed):
    rng = random.Random(seed)
    ctx = [rng.choice([A, B, C]) for _ in range(rng.randint(1, 40))]
    L = len(ctx)
    brute = []
    for j in range(L):
        n = 0
        while n <= j and ctx[j - n] == ctx[L - 1 - n]:
            n += 1
        brute.append(n)
    assert repeat_lengths(ctx) == brute


def test_dry_nested_repeats_and_a_breaker_match_the_definition():
    logits = rand_logits(1)
    # nested repeats: "a b c a b c a b" holds "a b" three times and "a b c a b" twice; a ':' then the same again
    ctx = [A, B, C, A, B, C, A, B, COLON, A, B, C, A, B]
    s = dry_sampler()
    out = s.process(logits, ctx)[-1][1]
    ref = ref_dry(logits.tolist(), ctx, 0.8, 1.75, 2, {COLON})
    assert out.tolist() == ref  # bit for bit: the same float32 subtraction
    # by hand: the breaker leaves 5 tokens (a b c a b); "a b" ends at 1, 4, 7, 10 -> c follows with n up to 5
    # (capped by the breaker), ':' follows at 7 but is a breaker itself, so never penalised
    led = s.sample(logits, ctx, ledger=True)[1].stages[-1].detail
    assert led["limit"] == 5 and led["breaker_distance"] == 5
    assert led["penalised"][0] == {"id": C, "n": 5, "penalty": pytest.approx(0.8 * 1.75 ** 3)}
    assert {e["id"] for e in led["exempt"]} == {COLON}
    assert out[COLON] == logits[COLON]
    # without the breaker the repeat "a b c a b" continues further back
    ref_nb = ref_dry(logits.tolist(), ctx, 0.8, 1.75, 2, set())
    assert dry_sampler(context_breakers=()).process(logits, ctx)[-1][1].tolist() == ref_nb
    assert ref_nb != ref


@pytest.mark.parametrize("seed", range(20))
def test_dry_random_contexts_match_the_definition(seed):
    rng = random.Random(seed)
    ctx = [rng.choice([A, B, C, D, COLON]) for _ in range(rng.randint(0, 50))]
    allowed, base, m = rng.randint(0, 3), rng.choice([1.0, 1.5, 1.75, 3.0]), rng.choice([0.3, 0.8, 2.0])
    logits = rand_logits(seed)
    out = dry_sampler(m=m, base=base, allowed=allowed).process(logits, ctx)[-1][1]
    assert out.tolist() == ref_dry(logits.tolist(), ctx, m, base, allowed, {COLON})


def test_dry_last_n_limits_the_context_and_says_why_it_did_not_act():
    logits = rand_logits(2)
    ctx = [A, B, C, D, A, B]
    full = dry_sampler(last_n=-1).sample(logits, ctx, ledger=True)[1].stages[-1].detail
    assert full["penalised"][0]["id"] == C and full["scanned"] == 6
    short = dry_sampler(last_n=3)  # sees "d a b": no repeat
    led = short.sample(logits, ctx, ledger=True)[1].stages[-1].detail
    assert led["scanned"] == 3 and led["n_penalised"] == 0 and led["longest"] < 2
    assert short.process(logits, ctx)[-1][1].tolist() == logits.tolist()
    # a breaker one token from the end: no repeat can be 2 long
    led = dry_sampler().sample(logits, [A, B, A, COLON, B], ledger=True)[1].stages[-1].detail
    assert led["limit"] == 1 and led["n_penalised"] == 0
    # context no longer than the allowed length
    assert dry_sampler().sample(logits, [A, B], ledger=True)[1].stages[-1].detail["limit"] is None
    # dry_penalty_last_n 0 is off: no stage at all
    assert "dry" not in SamplerConfig(dry_multiplier=1.0, dry_penalty_last_n=0).active_stages()


def test_dry_breaker_tokens_as_llama_cpp_finds_them():
    table = dry_breakers(TOK, (":", "xy"), V)
    assert table[COLON] == [()] and table[BCOLON] == [()]  # a token containing ':' breaks on its own
    assert table[XY] == [()]
    assert table[X] == [(Y,)]  # 'x' starts "xy": a breaker when 'y' follows
    assert Y not in table and A not in table
    # a two-token breaker x y in the context limits repeats to what follows it
    ctx = [A, B, C, X, Y, A, B]
    s = Sampler(SamplerConfig(dry_multiplier=1.0, dry_sequence_breakers=["xy"], dry_penalty_last_n=-1), V,
                tokenizer=TOK)
    led = s.sample(rand_logits(3), ctx, ledger=True)[1].stages[-1].detail
    assert led["limit"] == 2 and led["breaker_distance"] == 3
    assert led["penalised"] == [{"id": C, "n": 2, "penalty": 1.0}]


def test_dry_defaults_are_llama_cpp_s():
    c = SamplerConfig()
    assert (c.dry_base, c.dry_allowed_length, c.dry_penalty_last_n) == (1.75, 2, 64)
    assert DRY_BREAKERS == ["\n", ":", '"', "*"] and c.dry_sequence_breakers == DRY_BREAKERS
    assert (c.mirostat_tau, c.mirostat_eta) == (5.0, 0.1)


def test_dry_runs_when_greedy_and_can_change_the_argmax():
    logits = torch.zeros(V)
    logits[C] = 1.0  # c would be the argmax, but it extends "a b c" again
    ctx = [A, B, C, D, A, B]
    tok, _ = Sampler(SamplerConfig(temperature=0, dry_multiplier=2.0, dry_penalty_last_n=-1,
                                   dry_sequence_breakers=[]), V).sample(logits, ctx, ledger=False)
    assert tok != C


# -----------------------------------------------------------------------------
# XTC


def test_xtc_one_token_over_the_threshold_changes_nothing():
    logits = torch.tensor([5.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])  # p0 ~ 0.9, the rest < 0.1
    s = Sampler(SamplerConfig(xtc_probability=1.0, xtc_threshold=0.1, temperature=1.0, seed=3), V)
    out = s.process(logits, [])[-1][1]
    assert torch.equal(out, logits)
    d = s.sample(logits, [], ledger=True)[1].stages[-1].detail
    assert d["fired"] and d["over"] == 1 and d["removed"] == [] and d["kept"] is None


def test_xtc_several_over_the_threshold_keeps_only_the_least_likely():
    logits = torch.tensor([3.0, 2.5, 0.0, 2.0, -1.0, 1.0, -2.0, -2.0, -3.0, -3.0, -4.0, -5.0])
    p = torch.softmax(logits.double(), 0).tolist()
    over = [i for i in range(V) if p[i] >= 0.1]
    assert over == [0, 1, 3]
    least = min(over, key=lambda i: p[i])
    s = Sampler(SamplerConfig(xtc_probability=1.0, xtc_threshold=0.1, seed=3), V)
    token, led = s.sample(logits, [], ledger=True)
    out = s.process(logits, [])[-1][1]
    assert survivors(out) == set(range(V)) - (set(over) - {least})
    d = led.stages[-1].detail
    assert d["kept"]["id"] == least and sorted(r["id"] for r in d["removed"]) == sorted(set(over) - {least})
    assert d["n_removed"] == 2 and led.stages[-1].survivors == V - 2
    assert token not in set(over) - {least}


def test_xtc_draw_comes_from_the_row_stream_and_is_recorded():
    logits = torch.tensor([3.0, 2.5, 0.0, 2.0, -1.0, 1.0, -2.0, -2.0, -3.0, -3.0, -4.0, -5.0])
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        u_xtc = float(torch.rand((), generator=g, dtype=torch.float64))  # XTC's draw comes first
        u_final = float(torch.rand((), generator=g, dtype=torch.float64))
        s = Sampler(SamplerConfig(xtc_probability=0.5, xtc_threshold=0.1, seed=seed), V)
        _, led = s.sample(logits, [], ledger=True)
        d = led.stages[-1].detail
        assert d["draw"] == u_xtc and led.draw == u_final
        assert d["fired"] == (u_xtc < 0.5)
        assert (led.stages[-1].survivors < V) == d["fired"]


def test_xtc_threshold_above_half_draws_nothing():
    s = Sampler(SamplerConfig(xtc_probability=1.0, xtc_threshold=0.6, seed=5), V)
    _, led = s.sample(rand_logits(5), [], ledger=True)
    g = torch.Generator().manual_seed(5)
    assert led.stages[-1].detail["draw"] is None
    assert led.draw == float(torch.rand((), generator=g, dtype=torch.float64))  # the final draw is the first


# -----------------------------------------------------------------------------
# top-nσ


def ref_top_n_sigma(logits: list[float], n: float) -> set[int]:
    fin = [x for x in logits if math.isfinite(x)]
    mean = sum(fin) / len(fin)
    sigma = math.sqrt(sum((x - mean) ** 2 for x in fin) / len(fin))
    return {i for i, x in enumerate(logits) if math.isfinite(x) and x >= max(fin) - n * sigma}


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("order", ["hf", "llama.cpp"])
def test_top_n_sigma_survivors_are_the_same_at_every_temperature(n, order):
    logits = rand_logits(7, n=V, scale=2.0)
    logits[4] = float("-inf")  # a masked token is not a candidate: σ is over the finite logits
    ref = ref_top_n_sigma(logits.tolist(), n)
    assert 1 <= len(ref) < V - 1
    for t in (0.25, 0.7, 1.0, 1.5, 4.0):
        s = Sampler(SamplerConfig(temperature=t, top_n_sigma=n, order=parse_order(order), seed=0), V)
        steps = s.process(logits, [])
        names = [name for name, _ in steps]
        assert "top_n_sigma" in names and (t == 1.0) != ("temperature" in names)
        assert survivors(steps[-1][1]) == ref


def test_top_n_sigma_detail():
    logits = rand_logits(8)
    _, led = Sampler(SamplerConfig(top_n_sigma=1.0, seed=1), V).sample(logits, [], ledger=True)
    d = led.stages[-1].detail
    x = logits.double()
    assert d["max"] == pytest.approx(float(x.max())) and d["sigma"] == pytest.approx(float(x.std(correction=0)))
    assert d["threshold"] == pytest.approx(d["max"] - d["sigma"]) and d["candidates"] == V


# -----------------------------------------------------------------------------
# mirostat


def ref_draw(probs: list[float], u: float) -> int:
    total, acc = sum(probs), 0.0
    for i, p in enumerate(probs):
        acc += p
        if acc > u * total:
            return i
    return max(i for i, p in enumerate(probs) if p > 0)


def ref_softmax(xs: list[float]) -> list[float]:
    m = max(x for x in xs if math.isfinite(x))
    e = [math.exp(x - m) if math.isfinite(x) else 0.0 for x in xs]
    total = sum(e)
    return [v / total for v in e]


def ref_mirostat_v2_step(logits: list[float], mu: float, u: float, tau: float, eta: float):
    p = ref_softmax(logits)
    keep = [pi > 0 and -math.log2(pi) <= mu for pi in p]
    if not any(keep):
        keep[max(range(len(p)), key=lambda i: (p[i], -i))] = True
    q = ref_softmax([x if k else float("-inf") for x, k in zip(logits, keep)])
    tok = ref_draw(q, u)
    return tok, mu - eta * (-math.log2(q[tok]) - tau)


def ref_mirostat_v1_step(logits: list[float], mu: float, u: float, tau: float, eta: float, n_vocab: int, m=100):
    p = ref_softmax(logits)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    ps = [p[i] for i in order if p[i] > 0][:m]
    num = sum(math.log((i + 2) / (i + 1)) * math.log(ps[i] / ps[i + 1]) for i in range(len(ps) - 1))
    den = sum(math.log((i + 2) / (i + 1)) ** 2 for i in range(len(ps) - 1))
    s_hat = num / den
    eps = s_hat - 1
    k = ((eps * 2**mu) / (1 - n_vocab ** (-eps))) ** (1 / s_hat)
    k = min(max(int(k), 1), len(ps))
    kept = set(order[:k])
    q = ref_softmax([x if i in kept else float("-inf") for i, x in enumerate(logits)])
    tok = ref_draw(q, u)
    return tok, mu - eta * (-math.log2(q[tok]) - tau), k


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_mu_over_20_steps_matches_the_definition(version):
    n_vocab = 300
    tau, eta, temp, seed = 3.0, 0.2, 0.9, 11
    s = Sampler(SamplerConfig(temperature=temp, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, seed=seed),
                n_vocab)
    assert s.mu == 2 * tau
    g = torch.Generator().manual_seed(seed)
    mu = 2 * tau
    ks = set()
    for step in range(20):
        logits = rand_logits(100 + step, n=n_vocab, scale=2.5)
        u = float(torch.rand((), generator=g, dtype=torch.float64))
        scaled = (logits / temp).tolist()  # the temperature stage, float32 as llmtrace does it
        if version == 2:
            tok, mu_next = ref_mirostat_v2_step(scaled, mu, u, tau, eta)
        else:
            tok, mu_next, k = ref_mirostat_v1_step(scaled, mu, u, tau, eta, n_vocab)
            ks.add(k)
        token, led = s.sample(logits, [], ledger=True)
        d = led.stages[-1].detail
        assert led.stages[-1].stage == "mirostat" and [r.stage for r in led.stages] == ["input", "temperature", "mirostat"]
        assert token == tok, step
        assert d["mu"] == pytest.approx(mu, abs=1e-9) and d["mu_after"] == pytest.approx(mu_next, abs=1e-9)
        assert s.mu == d["mu_after"]
        if version == 1:
            assert d["kept"] == k == led.stages[-1].survivors
        mu = mu_next
    assert mu != 2 * tau
    if version == 1:
        assert len(ks) > 1  # k followed μ


def test_mirostat_replaces_penalties_dry_and_truncation_as_llama_cpp_does():
    cfg = SamplerConfig(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1, dry_multiplier=0.8,
                        xtc_probability=0.5, logit_bias={1: 2.0}, mirostat=2, order=parse_order("llama.cpp"))
    assert cfg.active_stages() == ["logit_bias", "temperature", "mirostat"]
    assert cfg.ignored_by_mirostat() == ["repetition_penalty", "dry_multiplier", "top_k", "top_p", "xtc_probability"]
    assert cfg.to_dict()["ignored"] == cfg.ignored_by_mirostat()
    greedy = SamplerConfig(temperature=0, mirostat=1, xtc_probability=0.5)
    assert greedy.active_stages() == [] and greedy.ignored_by_greedy() == ["mirostat"]
    assert SamplerConfig(temperature=0, xtc_probability=0.5, top_n_sigma=1).ignored_by_greedy() == [
        "top_n_sigma", "xtc_probability"]


# -----------------------------------------------------------------------------
# orders, off stages, validation


def test_llama_cpp_preset_is_its_default_chain():
    # common/common.h, common_params_sampling::samplers: penalties, dry, top_n_sigma, top_k, typical_p, top_p,
    # min_p, xtc, temperature (logit bias first, from common_sampler_init)
    chain = [n for n in LLAMA_CPP_ORDER if n not in ("logit_bias", "ban", "frequency_penalty", "presence_penalty")]
    assert chain == ["repetition_penalty", "dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc",
                     "temperature"]
    assert HF_ORDER.index("top_n_sigma") < HF_ORDER.index("top_k") and HF_ORDER[-1] == "xtc"


def test_stages_that_are_off_change_nothing():
    logits = rand_logits(9)
    base = SamplerConfig(temperature=0.9, top_k=5, seed=4)
    off = SamplerConfig(temperature=0.9, top_k=5, seed=4, xtc_threshold=0.3, dry_base=3.0, dry_allowed_length=5,
                        mirostat_tau=2.0, dry_sequence_breakers=["z"])
    assert off.active_stages() == base.active_stages() == ["temperature", "top_k"]
    a, b = Sampler(base, V), Sampler(off, V)
    for step in range(10):
        ta, la = a.sample(logits + step, [A, B, A, B], ledger=True)
        tb, lb = b.sample(logits + step, [A, B, A, B], ledger=True)
        assert ta == tb and la.draw == lb.draw and all(r.detail is None for r in lb.stages)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(xtc_probability=1.5), "xtc_probability is a probability"),
        (dict(xtc_probability=-0.1), "[0, 1]"),
        (dict(xtc_threshold=2.0), "xtc_threshold"),
        (dict(dry_multiplier=-1.0), "dry_multiplier"),
        (dict(dry_base=0.5), "dry_base"),
        (dict(dry_allowed_length=-1), "dry_allowed_length"),
        (dict(dry_penalty_last_n=-2), "dry_penalty_last_n"),
        (dict(dry_sequence_breakers=[""]), "dry_sequence_breaker"),
        (dict(dry_sequence_breakers=["x" * 41]), "40"),
        (dict(mirostat=3), "mirostat must be 0 (off), 1 or 2, got 3"),
        (dict(mirostat_tau=-1.0), "mirostat_tau"),
        (dict(mirostat_eta=float("nan")), "mirostat_eta"),
        (dict(top_n_sigma=-1.0), "top_n_sigma"),
    ],
)
def test_validation_errors(kwargs, needle):
    with pytest.raises(UsageError) as err:
        Sampler(SamplerConfig(**kwargs), 10)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2 and str(err.value).startswith(err.value.field)


def test_mirostat_is_not_an_order_stage():
    with pytest.raises(UsageError, match="always runs last"):
        parse_order("top_k,mirostat")


def test_dry_breakers_need_the_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        Sampler(SamplerConfig(dry_multiplier=1.0), V)
    Sampler(SamplerConfig(dry_multiplier=1.0, dry_sequence_breakers=[]), V)  # no breakers: no tokenizer needed


# -----------------------------------------------------------------------------
# end to end on the real SmolLM2: the CLI's trace, its survivors recomputed from the dumped logits, batches, `show`


@pytest.fixture
def cli_run(capsys, smollm, monkeypatch, tmp_path):
    """Run `llmtrace generate ARGV --jsonl FILE` on the session's model: (events, stderr)."""
    from helpers import run_cli

    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", lambda *a, **k: smollm)

    def run(*argv):
        f = tmp_path / "t.jsonl"
        code, _, err = run_cli(capsys, "generate", *argv, "--jsonl", f)
        assert code == 0, err
        return [json.loads(line) for line in f.read_text().splitlines()], err

    return run


REPEATS = "one two three, one two three, one two three, one two"


def _check_schema(events):
    """The events validate against trace.schema.json, and every field a stage detail writes is declared there."""
    from helpers import undeclared_fields

    from llmtrace.trace.events import schema_path

    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator(schema).validate({"schema": "llmtrace.trace/1", "events": events})
    assert undeclared_fields(events) == []
    declared = schema["$defs"]["step"]["properties"]["sampler"]["items"]["properties"]["detail"]["properties"]
    sampling = schema["$defs"]["run"]["properties"]["sampling"]["properties"]
    assert set(events[0]["sampling"]) <= set(sampling), set(events[0]["sampling"]) - set(sampling)
    for ev in events:
        for st in ev.get("sampler") or []:
            assert set(st.get("detail", {})) <= set(declared), set(st["detail"]) - set(declared)


def test_cli_trace_survivors_match_our_computation_on_the_dumped_logits(cli_run, smollm):
    events, _ = cli_run(REPEATS, "-n", "6", "--temperature", "1.3", "--seed", "4", "--dry-multiplier", "0.8",
                        "--dry-penalty-last-n", "-1", "--top-n-sigma", "1.5", "--xtc-probability", "0.7",
                        "--xtc-threshold", "0.05", "--dump", "logits", "--sampler-order", "llama.cpp")
    run = events[0]
    assert run["sampling"]["stages"] == ["dry", "top_n_sigma", "xtc", "temperature"]
    _check_schema(events)
    logits = {e["step"]: e["values"] for e in events if e["event"] == "tensor" and e["name"] == "logits"}
    steps = [e for e in events if e["event"] == "step"]
    history = smollm.tokenizer.encode(REPEATS)
    breakers = dry_breakers(smollm.tokenizer, tuple(DRY_BREAKERS), smollm.config.vocab_size)
    single = {t for t, tails in breakers.items() if () in tails}
    acted = set()
    for ev in steps:
        raw = logits[ev["step"]]  # rounded to 7 digits: compare with room at the cuts
        by = {s["stage"]: s for s in ev["sampler"]}
        # DRY: the penalised tokens and their n, by the definition (no multi-token breakers are in this context)
        assert not any(t in breakers and t not in single for t in history)
        after_dry = ref_dry(raw, history, 0.8, 1.75, 2, single)
        changed = {i: raw[i] - after_dry[i] for i in range(len(raw)) if after_dry[i] != raw[i]}
        d = by["dry"]["detail"]
        assert d["n_penalised"] == len(changed)
        for e in d["penalised"]:
            assert e["penalty"] == pytest.approx(changed[e["id"]], rel=1e-5)
            assert e["penalty"] == pytest.approx(0.8 * 1.75 ** (e["n"] - 2), rel=1e-6)
        acted.add("dry") if changed else None
        # top-nσ over the penalised logits
        fin = after_dry
        mean = sum(fin) / len(fin)
        sigma = math.sqrt(sum((x - mean) ** 2 for x in fin) / len(fin))
        cut = max(fin) - 1.5 * sigma
        kept = {i for i, x in enumerate(fin) if x >= cut}
        assert by["top_n_sigma"]["detail"]["threshold"] == pytest.approx(cut, abs=1e-4)
        near = {i for i, x in enumerate(fin) if abs(x - cut) < 1e-4}
        assert abs(by["top_n_sigma"]["survivors"] - len(kept)) <= len(near)
        # XTC over those survivors: p renormalised over them
        x = by["xtc"]["detail"]
        if x["fired"]:
            p = ref_softmax([v if i in kept else float("-inf") for i, v in enumerate(fin)])
            over = sorted((i for i in kept if p[i] >= 0.05), key=lambda i: -p[i])
            assert x["over"] == len(over)
            if len(over) >= 2:
                acted.add("xtc")
                assert {r["id"] for r in x["removed"]} == set(over[:-1]) and x["kept"]["id"] == over[-1]
                assert by["xtc"]["survivors"] == len(kept) - len(over) + 1
        assert ev["token"]["id"] in kept
        history.append(ev["token"]["id"])
    assert acted == {"dry", "xtc"}  # the run shows both acting (seed and settings chosen so)


@pytest.mark.parametrize("version", [1, 2])
def test_cli_mirostat_carries_mu_and_names_what_it_ignores(cli_run, version):
    events, err = cli_run("Once upon a time", "-n", "8", "--temperature", "0.9", "--seed", "2", "--mirostat",
                          str(version), "--top-k", "40", "--dry-multiplier", "0.5", "--mirostat-tau", "3")
    assert err.count("note:") == 1 and "--dry-multiplier, --top-k are ignored" in err
    _check_schema(events)
    run = events[0]["sampling"]
    assert run["stages"] == ["temperature", "mirostat"] and run["ignored"] == ["dry_multiplier", "top_k"]
    mu = 6.0
    for ev in (e for e in events if e["event"] == "step"):
        d = ev["sampler"][-1]["detail"]
        assert ev["sampler"][-1]["stage"] == "mirostat" and d["version"] == version
        assert d["mu"] == pytest.approx(mu, rel=1e-6)
        assert d["mu_after"] == pytest.approx(mu - 0.1 * (d["surprise"] - 3.0), rel=1e-5)
        assert d["surprise"] == pytest.approx(-math.log2(ev["sampler"][-1]["pick_prob"]), abs=1e-4)
        mu = d["mu_after"]


def test_batch_rows_carry_their_own_mu_and_dry_context(smollm):
    from dataclasses import replace

    from llmtrace.run.generate import generate, generate_batch, row_seed

    texts = [REPEATS, "Hi", "Once upon a time"]
    prompts = [smollm.tokenizer.encode_prompt(t, chat=False, system=None)[1] for t in texts]
    V = smollm.config.vocab_size
    for cfg in (SamplerConfig(temperature=1.0, mirostat=2, mirostat_tau=3.0, seed=9),
                SamplerConfig(temperature=1.0, dry_multiplier=1.5, dry_allowed_length=1, xtc_probability=0.5,
                              xtc_threshold=0.05, top_n_sigma=2.0, seed=9)):
        rows = [Sampler(replace(cfg, seed=row_seed(9, r)), V, tokenizer=smollm.tokenizer) for r in range(3)]
        result = generate_batch(smollm, prompts, rows, 5)
        for r, p in enumerate(prompts):
            alone = Sampler(replace(cfg, seed=9 + r), V, tokenizer=smollm.tokenizer)
            assert result.rows[r].tokens == generate(smollm, p, alone, 5).tokens, (cfg, r)
            assert rows[r].mu == (None if alone.mu is None else pytest.approx(alone.mu, rel=1e-4))  # the logits agree to ~1e-4
        if cfg.mirostat:
            assert len({s.mu for s in rows}) == 3


def test_show_renders_each_stage_line_from_a_saved_trace(cli_run, capsys, tmp_path, monkeypatch):
    from helpers import run_cli

    monkeypatch.setenv("COLUMNS", "250")  # one line per stage, unwrapped

    events, _ = cli_run(REPEATS, "-n", "4", "--temperature", "1.3", "--seed", "4", "--dry-multiplier", "0.8",
                        "--top-n-sigma", "1.5", "--xtc-probability", "1", "--xtc-threshold", "0.05")
    f = tmp_path / "saved.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out, err = run_cli(capsys, "show", f)
    assert code == 0, err
    assert "dry-multiplier 0.8" in out and "stages dry → temperature → top_n_sigma → xtc" in out
    for head in ("  dry: ", "  top-nσ: kept ", "  xtc: draw "):
        assert out.count(head) == 4, head
    assert "the same tokens at any temperature" in out


def test_report_funnel_says_what_each_new_stage_did(cli_run, tmp_path):
    html = tmp_path / "r.html"
    events, _ = cli_run(REPEATS, "-n", "3", "--temperature", "1.3", "--seed", "4", "--dry-multiplier", "0.8",
                        "--top-n-sigma", "1.5", "--xtc-probability", "1", "--xtc-threshold", "0.05", "--html", html)
    page = html.read_text()
    assert page.count('<tr class="why">') == 3 * 3  # dry, top-nσ and xtc at each of the 3 steps
    assert "llama.cpp samplers</th><td>top-n-sigma 1.5; xtc-probability 1; dry-multiplier 0.8" in page
    assert "dry: " in page and "top-nσ: kept" in page and "xtc: draw" in page


# -----------------------------------------------------------------------------
# the CLI: bad input in one line before the load, notes, --help


def _no_load(*args, **kwargs):
    raise AssertionError("the model was loaded, but this error should have been found before the load")


@pytest.mark.parametrize("flags, says", [
    (["--xtc-probability", "1.5"], ("--xtc-probability", "[0, 1]", "1.5")),
    (["--xtc-probability", "-0.1"], ("--xtc-probability", "[0, 1]")),
    (["--xtc-threshold", "2"], ("--xtc-threshold", "[0, 1]")),
    (["--dry-multiplier", "-0.8"], ("--dry-multiplier", ">= 0")),
    (["--dry-base", "0.5"], ("--dry-base", ">= 1")),
    (["--dry-allowed-length", "-1"], ("--dry-allowed-length", ">= 0")),
    (["--dry-penalty-last-n", "-5"], ("--dry-penalty-last-n", "-1")),
    (["--dry-sequence-breaker", ""], ("--dry-sequence-breaker", "non-empty")),
    (["--mirostat", "3"], ("--mirostat", "0 (off), 1 or 2", "3")),
    (["--mirostat-tau", "-1"], ("--mirostat-tau",)),
    (["--mirostat-eta", "-0.1"], ("--mirostat-eta",)),
    (["--top-n-sigma", "-1"], ("--top-n-sigma", ">= 0")),
])  # fmt: skip
def test_bad_values_exit_2_before_the_model_loads(capsys, monkeypatch, flags, says):
    from helpers import fails

    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", _no_load)
    fails(capsys, 2, "generate", "hi", *flags, says=says)


def test_breaker_escapes_and_none():
    from llmtrace.cli.generate import breaker_texts

    assert breaker_texts(["\\n", "a\\tb", ":", '\\"', "\\\\"]) == ["\n", "a\tb", ":", '"', "\\"]
    assert breaker_texts(["none"]) == []


def test_notes_name_what_mirostat_and_greedy_ignore():
    from llmtrace.cli.generate import sampler_notes

    notes = sampler_notes(SamplerConfig(temperature=0.8, mirostat=2, top_p=0.9, presence_penalty=0.5), False)
    assert notes == ["--mirostat 2 replaces the sampler chain, as in llama.cpp: --presence-penalty, --top-p are "
                     "ignored (only --temperature applies before it)"]
    notes = sampler_notes(SamplerConfig(temperature=0, xtc_probability=0.5), False)
    assert notes == ["--temperature 0 is greedy (the argmax), so --xtc-probability does nothing; give --temperature "
                     "(llama.cpp's default is 0.8)"]
    assert sampler_notes(SamplerConfig(temperature=0, dry_multiplier=0.8)) == []  # DRY is a penalty: greedy keeps it


def test_help_groups_the_sampler_options(capsys, monkeypatch):
    from helpers import run_cli

    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(capsys, "generate", "--help")
    assert code == 0
    options, panel = out.split("Sampling (s10–s12):")  # the panel comes last, after the general options
    options = options[options.index("\nOptions:"):]  # (the examples above use sampler flags)
    assert "--max-new-tokens" in options and "--jsonl" in options
    for flag in ("--temperature", "--top-k", "--top-p", "--min-p", "--typical-p", "--repetition-penalty", "--ban",
                 "--logit-bias", "--sampler-order", "--seed", "--top-n-sigma", "--xtc-probability", "--xtc-threshold",
                 "--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
                 "--dry-sequence-breaker", "--mirostat", "--mirostat-tau", "--mirostat-eta"):
        assert flag in panel, flag
    assert "--max-new-tokens" not in panel and "--temperature" not in options
