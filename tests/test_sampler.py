"""The sampler: each stage on hand-checkable numbers, the presets' orders, greedy, the seeded inverse-CDF draw, the
ledger, validation, and HF transformers' logits processors as the reference."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.run.sampler import (HF_ORDER, LLAMA_CPP_ORDER, STAGES, Sampler, SamplerConfig, banned_ids, inverse_cdf,
                                  parse_logit_bias, parse_order)

pytestmark = pytest.mark.usefixtures("one_thread")  # the sums of one thread, whatever ran before

INF = float("inf")
# a distribution whose nucleus / min-p cuts are easy to do by hand (id order = probability order)
P5 = [0.5, 0.2, 0.15, 0.1, 0.05]
L5 = torch.tensor([math.log(p) for p in P5])


def final_logits(sampler: Sampler, logits, history=()) -> torch.Tensor:
    return sampler.process(torch.as_tensor(logits, dtype=torch.float32), list(history))[-1][1]


def survivors(sampler: Sampler, logits, history=()) -> set[int]:
    return set(torch.isfinite(final_logits(sampler, logits, history)).nonzero().flatten().tolist())


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


# -----------------------------------------------------------------------------
# each stage by hand


def test_temperature_divides_logits_and_flattens_probs():
    logits = [2.0, 1.0, 0.0, -1.0, 3.0, 0.5]
    s = Sampler(SamplerConfig(temperature=2.0, seed=0), 6)
    torch.testing.assert_close(final_logits(s, logits), torch.tensor([1.0, 0.5, 0.0, -0.5, 1.5, 0.25]))
    token, ledger = s.sample(torch.tensor(logits), [], ledger=True)
    assert [r.stage for r in ledger.stages] == ["input", "temperature"]
    assert ledger.stages[1].pick_prob == pytest.approx(softmax([x / 2 for x in logits])[token], rel=1e-6)
    assert ledger.stages[0].pick_prob == pytest.approx(softmax(logits)[token], rel=1e-6)


def test_repetition_penalty_hf_sign_rule():
    # seen ids 0, 1, 5 (1 twice: penalised once); negative logits are multiplied, positive (and 0) divided
    logits = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    s = Sampler(SamplerConfig(repetition_penalty=2.0), 6)
    out = final_logits(s, logits, history=[0, 1, 1, 5])
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.5, 3.0, -2.0, 0.0]))


def test_frequency_and_presence_penalties_subtract():
    logits = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    history = [0, 1, 1, 5]  # counts: 0 -> 1, 1 -> 2, 5 -> 1
    s = Sampler(SamplerConfig(frequency_penalty=0.5), 6)
    torch.testing.assert_close(final_logits(s, logits, history), torch.tensor([1.5, -2.0, 0.5, 3.0, -2.0, -0.5]))
    s = Sampler(SamplerConfig(presence_penalty=1.0), 6)
    torch.testing.assert_close(final_logits(s, logits, history), torch.tensor([1.0, -2.0, 0.5, 3.0, -2.0, -1.0]))
    s = Sampler(SamplerConfig(presence_penalty=1.0, frequency_penalty=0.5), 6)
    torch.testing.assert_close(final_logits(s, logits, history), torch.tensor([0.5, -3.0, 0.5, 3.0, -2.0, -1.5]))


def test_penalties_with_empty_history_change_nothing():
    logits = torch.tensor([2.0, -1.0, 0.5])
    s = Sampler(SamplerConfig(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0), 3)
    torch.testing.assert_close(final_logits(s, logits, []), logits)


def test_logit_bias_adds():
    s = Sampler(SamplerConfig(logit_bias={2: 1.5, 4: -10.0}), 6)
    out = final_logits(s, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 3.5, 3.0, -6.0, 5.0]))


def test_ban_single_always_multi_only_after_prefix():
    seqs = [[3], [1, 2], [0, 4, 5]]
    assert banned_ids(seqs, []) == [3]
    assert banned_ids(seqs, [7, 1]) == [3, 2]
    assert banned_ids(seqs, [1, 7]) == [3]
    assert banned_ids(seqs, [0, 4]) == [3, 5]
    assert banned_ids(seqs, [4]) == [3]  # only half of the prefix 0, 4
    s = Sampler(SamplerConfig(ban=seqs), 6)
    assert survivors(s, [0.0] * 6, [7, 1]) == {0, 1, 4, 5}
    assert survivors(s, torch.zeros(6), torch.tensor([0, 4])) == {0, 1, 2, 4}  # history as a tensor


def test_top_k_keeps_k_largest_and_ties():
    logits = [1.0, 5.0, 3.0, 4.0, 2.0, 0.0]
    assert survivors(Sampler(SamplerConfig(top_k=1), 6), logits) == {1}
    assert survivors(Sampler(SamplerConfig(top_k=3), 6), logits) == {1, 2, 3}
    assert survivors(Sampler(SamplerConfig(top_k=100), 6), logits) == set(range(6))
    # HF keeps every token tied with the k-th largest
    assert survivors(Sampler(SamplerConfig(top_k=2), 6), [1.0, 5.0, 3.0, 3.0, 2.0, 0.0]) == {1, 2, 3}


@pytest.mark.parametrize(
    "p, expected",
    [(1e-9, {0}), (0.45, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (0.9, {0, 1, 2, 3}), (0.99, {0, 1, 2, 3, 4})],
)
def test_top_p_smallest_set_reaching_p(p, expected):
    # cumulative from the top: 0.5, 0.7, 0.85, 0.95, 1.0
    assert survivors(Sampler(SamplerConfig(top_p=p), 5), L5) == expected


@pytest.mark.parametrize(
    "m, expected",
    # threshold m * 0.5: 0.025 keeps all; 0.095 drops 0.05; 0.105 drops 0.1; 0.175 drops 0.15; 0.5 keeps the top only
    [(0.05, {0, 1, 2, 3, 4}), (0.19, {0, 1, 2, 3}), (0.21, {0, 1, 2}), (0.35, {0, 1}), (1.0, {0})],
)
def test_min_p_relative_to_top_prob(m, expected):
    assert survivors(Sampler(SamplerConfig(min_p=m), 5), L5) == expected


def typical_by_hand(probs: list[float], mass: float) -> set[int]:
    entropy = -sum(p * math.log(p) for p in probs)
    ranked = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - entropy))
    kept, total = [], 0.0
    for i in ranked:
        kept.append(i)
        total += probs[i]
        if total >= mass:
            break
    return set(kept)


@pytest.mark.parametrize("mass", [0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_typical_p_by_hand(mass):
    # entropy of P5 is 1.333 nats; surprisals -ln p are 0.69, 1.61, 1.90, 2.30, 3.00; distances to the entropy
    # 0.64, 0.28, 0.56, 0.97, 1.66 -> most typical first: 1, 2, 0, 3, 4
    assert survivors(Sampler(SamplerConfig(typical_p=mass), 5), L5) == typical_by_hand(P5, mass)
    assert typical_by_hand(P5, 0.1) == {1}
    assert typical_by_hand(P5, 0.3) == {1, 2}  # the most likely token is not in the typical set
    assert typical_by_hand(P5, 0.6) == {1, 2, 0}


# -----------------------------------------------------------------------------
# neutral stages, greedy, order


def test_neutral_stages_are_skipped():
    cfg = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)
    assert cfg.active_stages() == []
    token, ledger = Sampler(cfg, 5).sample(L5, [0, 1], ledger=True)
    assert [r.stage for r in ledger.stages] == ["input"]
    assert ledger.stages[0].survivors == 5
    assert ledger.stages[0].pick_prob == pytest.approx(P5[token], rel=1e-6)
    assert SamplerConfig(top_p=0.9, temperature=0.5).to_dict()["stages"] == ["temperature", "top_p"]


def test_greedy_is_argmax_and_skips_truncation():
    g = torch.Generator().manual_seed(0)
    s = Sampler(SamplerConfig(temperature=0.0), 50)
    for _ in range(20):
        x = torch.randn(50, generator=g)
        assert s.sample(x, [], ledger=False) == (int(torch.argmax(x)), None)
    # with truncation and a penalty: only the penalty runs, then argmax
    s = Sampler(SamplerConfig(temperature=0.0, top_k=1, top_p=0.5, repetition_penalty=10.0), 6)
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0, 0.0])
    token, ledger = s.sample(logits, [1, 3], ledger=True)
    assert token == 2  # 5 -> 0.5 and 4 -> 0.4 after the penalty, so 3.0 wins
    assert ledger.greedy and ledger.draw is None and ledger.token == 2
    assert [r.stage for r in ledger.stages] == ["input", "repetition_penalty"]
    assert ledger.stages[1].pick_prob == pytest.approx(softmax([1.0, 0.5, 3.0, 0.4, 2.0, 0.0])[2], rel=1e-6)


def test_greedy_fast_path_does_not_run_the_pipeline(monkeypatch):
    s = Sampler(SamplerConfig(temperature=0.0), 5)
    monkeypatch.setattr(s, "process", lambda *a: pytest.fail("pipeline ran on the greedy fast path"))
    assert s.sample(L5, [], ledger=False) == (0, None)


def test_everything_banned_is_an_error():
    for temp in (0.0, 1.0):
        s = Sampler(SamplerConfig(temperature=temp, ban=[[0], [1], [2]]), 3)
        with pytest.raises(LlmtraceError, match="no token"):
            s.sample(torch.zeros(3), [], ledger=False)


def test_presets_order():
    assert parse_order("hf") == HF_ORDER
    assert parse_order("llama.cpp") == LLAMA_CPP_ORDER
    assert sorted(HF_ORDER) == sorted(LLAMA_CPP_ORDER) == sorted(STAGES)
    assert HF_ORDER.index("temperature") < HF_ORDER.index("top_k") < HF_ORDER.index("top_p")
    assert LLAMA_CPP_ORDER[-1] == "temperature"
    assert LLAMA_CPP_ORDER.index("typical_p") < LLAMA_CPP_ORDER.index("top_p") < LLAMA_CPP_ORDER.index("min_p")
    assert parse_order(" top_k , temperature ") == ["top_k", "temperature"]


def test_temperature_before_or_after_top_p_changes_survivors():
    # raw: cumulative 0.5, 0.7 -> top_p 0.6 keeps 2 tokens.
    # at T=2 the probs are proportional to sqrt(p): 0.340, 0.215, 0.186, ... -> cumulative 0.555, 0.741 -> 3 tokens.
    flat = softmax([x / 2 for x in L5.tolist()])
    assert flat[0] + flat[1] < 0.6 < flat[0] + flat[1] + flat[2]
    cfg = dict(temperature=2.0, top_p=0.6, seed=0)
    hf = Sampler(SamplerConfig(**cfg, order=parse_order("hf")), 5)
    lc = Sampler(SamplerConfig(**cfg, order=parse_order("llama.cpp")), 5)
    assert survivors(hf, L5) == {0, 1, 2}
    assert survivors(lc, L5) == {0, 1}
    _, ledger = lc.sample(L5, [], ledger=True)
    assert [(r.stage, r.survivors) for r in ledger.stages] == [("input", 5), ("top_p", 2), ("temperature", 2)]


def test_bias_before_or_after_repetition_penalty():
    # both presets add the bias first (HF's SequenceBias and llama.cpp's logit-bias sampler head their chains), so the
    # penalty divides the biased logit; a custom order can put the penalty first
    cfg = dict(logit_bias={0: 2.0}, repetition_penalty=2.0)
    for preset in ("hf", "llama.cpp"):
        s = Sampler(SamplerConfig(**cfg, order=parse_order(preset)), 2)
        assert final_logits(s, [1.0, 0.0], [0])[0].item() == pytest.approx((1.0 + 2.0) / 2)
    s = Sampler(SamplerConfig(**cfg, order=parse_order("repetition_penalty,logit_bias")), 2)
    assert final_logits(s, [1.0, 0.0], [0])[0].item() == pytest.approx(1.0 / 2 + 2.0)


# -----------------------------------------------------------------------------
# the draw


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(1))
    cfg = dict(temperature=1.5, top_k=15)

    def run(seed):
        s = Sampler(SamplerConfig(**cfg, seed=seed), 20)
        return [s.sample(logits, [], ledger=False)[0] for _ in range(200)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    s = Sampler(SamplerConfig(**cfg), 20)  # no seed: one is picked and recorded
    picked = [s.sample(logits, [], ledger=False)[0] for _ in range(200)]
    assert s.config.to_dict()["seed"] == s.seed
    assert run(s.seed) == picked


def test_ledger_and_no_ledger_draw_the_same_tokens():
    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    cfg = SamplerConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=3)
    a, b = Sampler(cfg, 30), Sampler(cfg, 30)
    for step in range(50):
        assert a.sample(logits, [step % 30], ledger=False)[0] == b.sample(logits, [step % 30], ledger=True)[0]


def test_draw_rechecks_by_inverse_cdf():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(4))
    s = Sampler(SamplerConfig(temperature=0.7, top_k=6, min_p=0.02, seed=11), 10)
    for _ in range(50):
        token, ledger = s.sample(logits, [], ledger=True)
        probs = torch.softmax(final_logits(s, logits).double(), dim=-1).tolist()
        # walk the ids in order, summing probabilities, until the sum passes draw * total
        target, acc, pick = ledger.draw * sum(probs), 0.0, None
        for i, p in enumerate(probs):
            acc += p
            if acc > target:
                pick = i
                break
        assert 0.0 <= ledger.draw < 1.0
        assert token == ledger.token == pick
        assert ledger.stages[-1].pick_prob == pytest.approx(probs[token], rel=1e-5)
        assert ledger.seed == 11 and not ledger.greedy


def test_inverse_cdf_skips_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.75, 0.0])
    assert [inverse_cdf(probs, u) for u in (0.0, 0.2499, 0.25, 0.9999999)] == [1, 1, 4, 4]


def test_draw_frequencies_follow_final_probabilities():
    s = Sampler(SamplerConfig(temperature=1.0, top_k=4, seed=5), 5)
    n = 4000
    counts = [0] * 5
    for _ in range(n):
        counts[s.sample(L5, [], ledger=False)[0]] += 1
    expected = [p / 0.95 for p in P5[:4]] + [0.0]
    assert counts[4] == 0
    for c, p in zip(counts, expected):
        assert abs(c / n - p) < 0.03


def test_top_k_1_is_always_the_argmax():
    s = Sampler(SamplerConfig(temperature=3.0, top_k=1, seed=9), 5)
    assert {s.sample(L5, [], ledger=False)[0] for _ in range(100)} == {0}


def test_ledger_topk_is_raw_distribution():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    _, ledger = Sampler(SamplerConfig(temperature=0.5, seed=0), 5, k_show=3).sample(logits, [], ledger=True)
    probs = softmax(logits.tolist())
    assert [t[0] for t in ledger.topk] == [1, 3, 4]
    assert [t[1] for t in ledger.topk] == [3.0, 2.0, 1.0]
    assert [t[2] for t in ledger.topk] == pytest.approx([probs[1], probs[3], probs[4]], rel=1e-6)


# -----------------------------------------------------------------------------
# validation and parsing


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(typical_p=2.0), "typical_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(frequency_penalty=INF), "frequency_penalty"),
        (dict(logit_bias={10: 1.0}), "10"),
        (dict(logit_bias={1: -INF}), "a ban forbids"),
        (dict(ban=[[3, 10]]), "10"),
        (dict(ban=[[]]), "empty"),
        (dict(order=["top_k", "nope"]), "nope"),
        (dict(top_p=0.9, order=["top_k", "temperature"]), "top_p"),
        (dict(seed=-1), "seed"),
    ],
)
def test_validation_errors(kwargs, needle):
    with pytest.raises(UsageError) as err:
        Sampler(SamplerConfig(**kwargs), 10)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2
    assert "--" not in str(err.value)  # the library names values; the CLI says which flag gave them
    assert str(err.value).startswith(err.value.field)


def test_parse_order_errors_list_valid_names():
    with pytest.raises(UsageError, match="valid: temperature, repetition_penalty") as err:
        parse_order("top_k,topp")
    assert "'topp'" in str(err.value)
    with pytest.raises(UsageError, match="twice"):
        parse_order("top_k,top_k")
    with pytest.raises(UsageError, match="empty"):
        parse_order(" , ")


def test_parse_logit_bias():
    assert parse_logit_bias([], 10) == {}
    assert parse_logit_bias(["3=-5", " 7 = 2.5 ", "0=+1e-1"], 10) == {3: -5.0, 7: 2.5, 0: 0.1}
    for bad in ["3", "a=1", "3=x", "=1", "3=", "1.5=2", "10=1", "-1=1", "2=inf", "2=nan"]:
        with pytest.raises(UsageError) as err:
            parse_logit_bias(["1=1", bad], 10)
        assert f"'{bad}'" in str(err.value)
    with pytest.raises(UsageError, match="twice"):
        parse_logit_bias(["1=1", "1=2"], 10)


def test_to_dict_is_json_ready():
    import json

    cfg = SamplerConfig(temperature=0.0, top_k=5, logit_bias={3: 1.0}, ban=[[1, 2]], seed=4)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["logit_bias"] == {"3": 1.0} and d["ban"] == [[1, 2]] and d["seed"] == 4
    assert d["greedy"] is True and d["stages"] == ["logit_bias", "ban"]


# -----------------------------------------------------------------------------
# HF transformers as the reference


def hf_processors():
    lp = pytest.importorskip("transformers.generation.logits_process")
    return lp


@pytest.mark.parametrize("seed", range(8))
def test_truncation_and_penalty_match_hf(seed):
    lp = hf_processors()
    g = torch.Generator().manual_seed(seed)
    V = 64
    x = torch.randn(V, generator=g) * 3
    history = torch.randint(0, V, (12,), generator=g)
    cases = [
        (SamplerConfig(top_k=5), lp.TopKLogitsWarper(5)),
        (SamplerConfig(top_k=30), lp.TopKLogitsWarper(30)),
        (SamplerConfig(top_p=0.3), lp.TopPLogitsWarper(0.3)),
        (SamplerConfig(top_p=0.9), lp.TopPLogitsWarper(0.9)),
        (SamplerConfig(min_p=0.05), lp.MinPLogitsWarper(0.05)),
        (SamplerConfig(min_p=0.3), lp.MinPLogitsWarper(0.3)),
        (SamplerConfig(typical_p=0.5), lp.TypicalLogitsWarper(0.5)),
        (SamplerConfig(typical_p=0.95), lp.TypicalLogitsWarper(0.95)),
        (SamplerConfig(temperature=0.6), lp.TemperatureLogitsWarper(0.6)),
        (SamplerConfig(repetition_penalty=1.3), lp.RepetitionPenaltyLogitsProcessor(1.3)),
        (SamplerConfig(ban=[[3], [int(history[-1]), 9]]), lp.NoBadWordsLogitsProcessor([[3], [int(history[-1]), 9]])),
        (SamplerConfig(logit_bias={4: 2.0, 8: -1.0}), lp.SequenceBiasLogitsProcessor([[[4], 2.0], [[8], -1.0]])),
    ]
    for cfg, proc in cases:
        ours = final_logits(Sampler(cfg, V), x, history.tolist())
        theirs = proc(history[None], x[None].clone())[0]
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), cfg
        torch.testing.assert_close(ours, theirs, msg=str(cfg))


@pytest.mark.parametrize("mass", [0.2, 0.6, 0.9])
def test_sorting_stages_match_hf_after_top_k(mass):
    # top_p and typical_p sort only the survivors; the result must equal HF's full-vocabulary sort
    lp = hf_processors()
    x = torch.randn(200, generator=torch.Generator().manual_seed(3)) * 2
    masked = lp.TopKLogitsWarper(25)(None, x[None].clone())
    for cfg, proc in [
        (SamplerConfig(top_k=25, top_p=mass), lp.TopPLogitsWarper(mass)),
        (SamplerConfig(top_k=25, typical_p=mass), lp.TypicalLogitsWarper(mass)),
    ]:
        ours = final_logits(Sampler(cfg, 200), x)
        theirs = proc(None, masked.clone())[0]
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), cfg


def test_hf_preset_is_hf_generate_order():
    """Build HF generate's own processor list for a config and check that our "hf" preset gives the same logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    tiny = transformers.LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(tiny)
    history = torch.tensor([[5, 7, 3, 9, 2]])
    gen = transformers.GenerationConfig(
        do_sample=True, temperature=0.7, top_k=12, top_p=0.9, min_p=0.05, typical_p=0.95, repetition_penalty=1.3,
        sequence_bias=[[[3], 2.0], [[11], -1.5]], bad_words_ids=[[4], [2, 6]], pad_token_id=0,
    )  # fmt: skip
    gen._eos_token_tensor = None
    try:
        procs = model._get_logits_processor(
            generation_config=gen, input_ids_seq_length=history.shape[1], encoder_input_ids=history,
            logits_processor=transformers.LogitsProcessorList(), device="cpu", model_kwargs={},
        )  # fmt: skip
    except (AttributeError, TypeError) as exc:  # a private API; skip rather than fail if it moves
        pytest.skip(f"transformers' _get_logits_processor changed: {exc}")
    names = [type(p).__name__ for p in procs]
    assert names == [
        "SequenceBiasLogitsProcessor", "RepetitionPenaltyLogitsProcessor", "NoBadWordsLogitsProcessor",
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    ]  # fmt: skip
    cfg = SamplerConfig(
        temperature=0.7, top_k=12, top_p=0.9, min_p=0.05, typical_p=0.95, repetition_penalty=1.3,
        logit_bias={3: 2.0, 11: -1.5}, ban=[[4], [2, 6]], order=parse_order("hf"),
    )  # fmt: skip
    for seed in range(5):
        x = torch.randn(32, generator=torch.Generator().manual_seed(seed)) * 2
        theirs = procs(history, x[None].clone())[0]
        ours = final_logits(Sampler(cfg, 32), x, history[0].tolist())
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
        torch.testing.assert_close(ours, theirs)


# -----------------------------------------------------------------------------
# properties


@st.composite
def cases(draw):
    V = draw(st.integers(2, 24))
    finite = st.floats(-20, 20, allow_nan=False, width=32)
    logits = draw(st.lists(st.one_of(finite, finite, finite, st.just(-INF)), min_size=V, max_size=V))
    if all(x == -INF for x in logits):
        logits[draw(st.integers(0, V - 1))] = 0.0
    ids = st.integers(0, V - 1)
    cfg = SamplerConfig(
        temperature=draw(st.sampled_from([0.0, 1.0]) | st.floats(0.05, 5.0)),
        top_k=draw(st.integers(0, V + 2)),
        top_p=draw(st.just(1.0) | st.floats(0.01, 1.0)),
        min_p=draw(st.just(0.0) | st.floats(0.0, 1.0)),
        typical_p=draw(st.just(1.0) | st.floats(0.01, 1.0)),
        repetition_penalty=draw(st.just(1.0) | st.floats(0.5, 3.0)),
        frequency_penalty=draw(st.just(0.0) | st.floats(-2.0, 2.0)),
        presence_penalty=draw(st.just(0.0) | st.floats(-2.0, 2.0)),
        logit_bias=draw(st.dictionaries(ids, st.floats(-10, 10), max_size=3)),
        ban=draw(st.lists(st.lists(ids, min_size=1, max_size=2), max_size=2)),
        order=draw(st.sampled_from([HF_ORDER, LLAMA_CPP_ORDER]) | st.permutations(list(STAGES))),
        seed=draw(st.integers(0, 2**32)),
    )
    history = draw(st.lists(ids, max_size=8))
    return torch.tensor(logits), cfg, history


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_properties(case):
    logits, cfg, history = case
    s = Sampler(cfg, logits.shape[0])
    try:
        token, ledger = s.sample(logits, history, ledger=True)
    except LlmtraceError:
        # only allowed when the stages really left nothing
        assert not torch.isfinite(final_logits(s, logits, history)).any()
        return
    final = final_logits(s, logits, history)
    assert torch.softmax(final.double(), dim=-1)[token] > 0  # never a token the stages removed
    assert ledger.stages[-1].pick_prob > 0
    for r in ledger.stages:
        assert abs(r.probs_sum - 1) < 1e-5, r
        assert 0 < r.survivors <= logits.shape[0]
    counts = [r.survivors for r in ledger.stages]
    assert counts == sorted(counts, reverse=True)  # masking only ever removes tokens
    if cfg.greedy:
        assert ledger.greedy and token == int(torch.argmax(final))
        assert all(STAGES[r.stage].kind == "logits" for r in ledger.stages[1:])
    # the same seed, without the ledger, picks the same token
    assert Sampler(cfg, logits.shape[0]).sample(logits, history, ledger=False)[0] == token


@pytest.mark.parametrize("fill", [None, -INF, INF, float("nan"), "both"])
def test_the_ledgers_survivor_count_is_the_count_of_finite_logits(fill):
    """The ledger counts a stage's survivors; its shortcut (a finite sum: all finite) gives the plain count."""
    from llmtrace.run.sampler import _finite_count

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    if fill == "both":
        x[[3, 500]] = torch.tensor([INF, -INF])
    elif fill is not None:
        x[[3, 7, 999]] = fill
    assert int(_finite_count(x)) == int(torch.isfinite(x).sum())
    sampler = Sampler(SamplerConfig(temperature=0.0), 1000)
    if fill is None:  # the greedy ledger of a full vocabulary: every id survives the input stage
        _, ledger = sampler.sample(x, [], ledger=True)
        assert ledger.stages[0].survivors == 1000 and ledger.token == int(x.argmax())
