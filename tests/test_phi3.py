"""Phi-3 (model/families/phi3.py) on the tiny checkpoints of tests/families.py, against transformers: from the HF
directory and from the GGUF llama.cpp's converter writes from it (fused attn_qkv and ffn_up, rope.dimension_count,
rope_factors_long/short), prompt ids identical, fp32 logits within 8x their own float32 error at every position,
greedy tokens identical through the KV cache. LongRoPE (phi3_longrope: original context 8) on both sides of the
switch: a prompt within 8 (short factors), one past it (long factors) and a prompt + generation that crosses it,
where the cache is computed again as transformers' Phi-3 computes it; partial rotary (8 of 16 dims) said and seen;
bad RoPE settings refused by field."""

import json

import pytest
import torch

from families import FAMILIES, PROMPT_IDS, hf_model_from_gguf
from helpers import fails, logits_tol

PHI3 = ["phi3", "phi3_longrope"]
TOL = 1e-4
PROMPT = "The quick brown fox"  # 14 tokens in the tiny vocabulary: past phi3_longrope's original context (8)
N_NEW = 8


@pytest.fixture(scope="module")
def references(families):
    """transformers' model of each file: the HF model itself, or transformers' own GGUF loader on the converter's
    file (given the RoPE settings its loader does not read)."""
    cache = {}

    def get(name: str, fmt: str):
        if (name, fmt) not in cache:
            cache[(name, fmt)] = families.model(name) if fmt == "hf" else hf_model_from_gguf(families.gguf(name),
                                                                                              FAMILIES[name])
        return cache[(name, fmt)]

    return get


@torch.no_grad()
def _prefix_logits(model, ids: list[int], first: int) -> torch.Tensor:
    """transformers' next-token logits after each prefix ids[:n], n = first .. len(ids), each one pass over the
    prefix: what its generate computes (Phi3ForCausalLM recomputes its cache when the sequence passes the original
    context). (len(ids) - first + 1, V)."""
    return torch.stack([model(torch.tensor([ids[:n]])).logits[0, -1] for n in range(first, len(ids) + 1)])


@torch.no_grad()
def _cached_logits(model, ids: list[int], first: int) -> torch.Tensor:
    """llmtrace's: a prefill of ids[:first], then one token a pass through the KV cache."""
    cache = model.new_cache(len(ids))
    out = [model(torch.tensor([ids[:first]]), cache, 0, last_only=True)[0]]
    for p in range(first, len(ids)):
        out.append(model(torch.tensor([[ids[p]]]), cache, p, last_only=True)[0])
    return torch.stack(out)


def _greedy(lm, ids: list[int], n: int) -> list[int]:
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    return list(generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), n, (), True,
                         None).tokens)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


# ----------------------------------------------------------------------------------------------------------------
# both formats against transformers


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", PHI3)
def test_logits_equal_transformers(loaded, references, name, fmt):
    """Every position of the 14-token prompt and of a 6-token one: for phi3_longrope the long factors (14 > 8) and
    the short ones (6 ≤ 8)."""
    lm, ref = loaded(name, fmt), references(name, fmt)
    assert lm.config.family == "phi3" and lm.config.rotary_dim == 8 and lm.config.head_dim == 16
    for ids in (PROMPT_IDS, PROMPT_IDS[:6]):
        with torch.no_grad():
            ours, theirs = lm.model(torch.tensor([ids]))[0], ref(torch.tensor([ids])).logits[0]
        diff, tol = float((ours - theirs).abs().max()), logits_tol(lm, ids)  # 8x the pass's float32 error
        assert diff <= tol, f"{name} {fmt}, {len(ids)} tokens: logits differ by {diff:.3g}, over {tol:.3g}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", PHI3)
def test_prompt_ids_and_greedy_tokens_equal_transformers(families, loaded, references, name, fmt):
    import transformers

    lm, ref = loaded(name, fmt), references(name, fmt)
    path = families.hf_dir(name) if fmt == "hf" else families.gguf(name)
    tok = transformers.AutoTokenizer.from_pretrained(str(families.hf_dir(name))) if fmt == "hf" else \
        transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = lm.tokenizer.encode(PROMPT)
    assert ids == tok.encode(PROMPT) and len(ids) > 8
    assert _greedy(lm, ids, N_NEW) == _hf_greedy(ref, ids, N_NEW)


# ----------------------------------------------------------------------------------------------------------------
# LongRoPE's switch


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_generation_that_crosses_the_original_context_equals_transformers(loaded, references, fmt):
    """A 5-token prompt, then 10 greedy tokens: positions 5..14 pass 8. transformers' generate drops its cache when
    the sequence first passes 8 and goes on with the long factors; llmtrace computes the cached slots again there.
    The logits of every step match transformers' one-pass logits; without the recompute they would not."""
    from llmtrace.model.families import phi3

    lm, ref = loaded("phi3_longrope", fmt), references("phi3_longrope", fmt)
    assert lm.config.rope_scaling["original_max_position_embeddings"] == 8
    ids = PROMPT_IDS[:5]
    assert _greedy(lm, ids, 10) == _hf_greedy(ref, ids, 10)
    want = _prefix_logits(ref, PROMPT_IDS, 5)
    got = _cached_logits(lm.model, PROMPT_IDS, 5)
    assert float((got - want).abs().max()) <= TOL
    with pytest.MonkeyPatch.context() as mp:  # the same cached passes without the switch's recompute
        mp.setattr(phi3.Phi3, "cache_stale", lambda self, *a, **k: False)
        stale = _cached_logits(lm.model, PROMPT_IDS, 5)
    assert float((stale[:4] - want[:4]).abs().max()) <= TOL  # up to 8 slots: the short factors throughout
    assert float((stale[4:] - want[4:]).abs().max()) > 1e-2  # past 8: keys of the short set, queries of the long


def test_a_left_padded_batch_switches_as_transformers_batch_does(loaded, references):
    """Two prompts (5 and 3 tokens) left-padded into one batch, 8 greedy tokens: the batch passes 8 when its longest
    row does (transformers takes the largest position of the batch), and the recompute keeps each row's positions
    and padding. Tokens equal transformers' batched generate."""
    from llmtrace.run.generate import generate_batch
    from llmtrace.run.sampler import Sampler, SamplerConfig

    lm, ref = loaded("phi3_longrope", "hf"), references("phi3_longrope", "hf")
    prompts, n = [PROMPT_IDS[:5], PROMPT_IDS[3:6]], 8
    samplers = [Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size) for _ in prompts]
    ours = [list(r.tokens) for r in generate_batch(lm, prompts, samplers, n, ignore_eos=True).rows]
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        theirs = ref.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
    assert ours == theirs[:, T:].tolist()


def test_a_chunked_prefill_past_the_original_context_is_one_pass(loaded, references):
    """The prefill of a long prompt goes in chunks; chunks within 8 are computed with the short set, so the chunk
    that passes 8 computes them again: the prompt's logits are transformers' one-pass logits."""
    from llmtrace.run.generate import prefill

    from llmtrace.model.families import phi3

    lm, ref = loaded("phi3_longrope", "hf"), references("phi3_longrope", "hf")

    def chunked():
        with torch.no_grad():
            return prefill(lm.model, torch.tensor([PROMPT_IDS]), lm.model.new_cache(len(PROMPT_IDS)), chunk=4)[0]

    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT_IDS])).logits[0, -1]
    assert float((chunked() - theirs).abs().max()) <= TOL
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(phi3.Phi3, "cache_stale", lambda self, *a, **k: False)
        assert float((chunked() - theirs).abs().max()) > 1e-2


def test_the_factor_sets_and_the_attention_factor_bite(families, loaded):
    """The switch is a real one: the same weights with only the short set, or without the attention factor, give
    other logits past 8 (the fixture's numbers are large enough to show it)."""
    import copy

    from llmtrace.model.families.phi3 import Phi3

    lm = loaded("phi3_longrope", "hf")
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        base = lm.model(ids)[0]
        for change in ({"long_factor": lm.config.rope_scaling["short_factor"]}, {"attention_factor": 1.0}):
            config = copy.deepcopy(lm.config)
            config.rope_scaling.update(change)
            other = Phi3(config).eval()
            other.load_state_dict(lm.model.state_dict(), strict=False)
            assert float((other(ids)[0] - base).abs().max()) > 1e-2, change


def test_gguf_reads_the_factor_tensors_and_the_rotary_width(loaded):
    hf, gguf = loaded("phi3_longrope", "hf").config, loaded("phi3_longrope", "gguf").config
    assert gguf.head_dim == 16 and gguf.rotary_dim == 8  # rope.dimension_count is 8: the rotary width, not Dh
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        assert gguf.rope_scaling[key] == pytest.approx(hf.rope_scaling[key])
    assert gguf.rope_scaling["attention_factor"] == pytest.approx(2 ** 0.5)  # √(1 + ln(64/8) / ln 8)
    assert hf.rope_scaling["attention_factor"] == pytest.approx(2 ** 0.5)


def test_a_window_in_a_phi3_gguf_is_left_out_and_said():
    """Phi-3-mini's GGUF names a 2,047-token window that llama.cpp and transformers' GGUF loader leave out: so does
    llmtrace, and the run header says so (the fixtures have none: the converter writes 0)."""
    from llmtrace.model.families.phi3 import gguf_config

    values = {"embedding_length": 3072, "attention.head_count": 32, "rope.dimension_count": 96,
              "attention.sliding_window": 2047}

    def meta(key, default=None):
        return values.get(key, default)

    meta.tensor = lambda name: None
    out = gguf_config(meta)
    assert out["head_dim"] == 96 and out["rotary_dim"] is None and "sliding_window" not in out
    assert "2,047" in out["extra"]["window_note"] and "llama.cpp" in out["extra"]["window_note"]


# ----------------------------------------------------------------------------------------------------------------
# seeing it


def test_what_phi3_changes_is_said_with_its_numbers(loaded):
    from llmtrace.model.family import describe_changes

    said = describe_changes(loaded("phi3_longrope", "gguf").config)
    assert said[0].startswith("q, k and v read from one fused matrix (64 + 64 + 64 rows)")
    assert said[1].startswith("RoPE on 8 of 16 dims of each head (dims 0-7 turn, 8-15 pass unchanged)")
    assert said[2].startswith("LongRoPE: short factors up to 8 positions, long beyond") and "× 1.414" in said[2]
    assert said[3].startswith("gate and up read from one fused matrix (128 + 128 rows, gate first)")
    assert not any("LongRoPE" in line for line in describe_changes(loaded("phi3", "hf").config))


def test_q_k_v_gate_up_and_the_rotation_are_points_of_the_trace(families):
    """The fused matrices are split where Llama's are: q, k, v, gate and up are the trace's points, with their axes;
    q_rope's rotated and unrotated dims are what the model computed."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("phi3_longrope")), device="cpu")
    run = model.generate(PROMPT, max_new_tokens=1, trace="full")
    shapes = {p["name"]: p for p in next(e for e in run.events if e["event"] == "shapes")["points"]
              if p["layer"] in (0, None)}
    for name, axes in (("q", ["T", "H", "Dh"]), ("k", ["T", "Hkv", "Dh"]), ("v", ["T", "Hkv", "Dh"]),
                       ("q_rope", ["T", "H", "Dh"]), ("gate", ["T", "F"]), ("up", ["T", "F"])):
        assert shapes[name]["axes"] == axes, name
    declared = {p["name"]: p for p in next(e for e in run.events if e["event"] == "run")["points"]}
    assert "first Dr dims" in declared["q_rope"]["about"]


@torch.no_grad()
def test_only_the_first_rotary_dims_turn(loaded):
    """q_rope equals q in dims 8-15 of every head (they pass unchanged) and differs in dims 0-7 past position 0."""
    lm = loaded("phi3", "hf")
    seen = {}
    with lm.model.hooked(lambda layer, name, x: seen.__setitem__(name, x.clone()) if name in ("q", "q_rope") else None,
                         layers=[0]):
        lm.model(torch.tensor([PROMPT_IDS]))
    q, q_rope = seen["q"][0], seen["q_rope"][0]  # (T, H, Dh)
    assert torch.equal(q[..., 8:], q_rope[..., 8:])
    assert torch.equal(q[0], q_rope[0])  # position 0: angle 0
    assert float((q[1:, :, :8] - q_rope[1:, :, :8]).abs().min(-1).values.max()) > 0


# ----------------------------------------------------------------------------------------------------------------
# what is refused


@pytest.mark.parametrize("change, says", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
     ("rope_parameters.rope_type 'yarn' is not supported", "LongRoPE")),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.1}},
     ("partial_rotary_factor 0.1 is not supported", "even")),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                          "short_factor": [1.0, 1.0], "long_factor": [1.0, 2.0, 3.0, 4.0]}},
     ("rope_parameters.short_factor '2 numbers' is not supported", "(4)")),
])  # fmt: skip
def test_a_rope_phi3_does_not_run_is_refused_by_field(capsys, families, tmp_path, change, says):
    import shutil

    d = tmp_path / "phi3"
    shutil.copytree(families.hf_dir("phi3"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | change))
    fails(capsys, 1, "generate", "hi", "-m", d, "-n", "1", says=says)


@pytest.mark.slow  # compiles (a minute on a small CPU)
def test_the_compiled_decode_step_hands_the_switch_to_the_eager_pass(loaded, references):
    """--compile: the one step that passes the original context runs eagerly (it recomputes the cache); the compiled
    steps before and after it choose their factor set in the graph. Every step's logits are transformers'."""
    from llmtrace.model.compiled import decode_step
    from llmtrace.run.generate import compile_decode

    lm, ref = loaded("phi3_longrope", "hf"), references("phi3_longrope", "hf")
    step = compile_decode(lm, 5, len(PROMPT_IDS) - 5)
    want = _prefix_logits(ref, PROMPT_IDS, 5)
    with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
        cache = lm.model.new_cache(len(PROMPT_IDS) + 1)  # as generate's: the last token is never written
        got = [lm.model(torch.tensor([PROMPT_IDS[:5]]), cache, 0, last_only=True)[0]]
        for p in range(5, len(PROMPT_IDS)):
            got.append(decode_step(lm.model, step, torch.tensor([[PROMPT_IDS[p]]]), cache, p,
                                   next_of_same_run=p > 5)[0])
    assert float((torch.stack(got) - want).abs().max()) <= TOL


def test_the_hooks_see_only_the_pass_that_crosses_not_its_recompute(loaded):
    """The pass that first passes the original context (8) computes the 8 cached slots again (a pass of 8 tokens)
    before its own 1-token pass; a hook attached around it sees the 1-token pass only, and is attached again after
    (the model's `unhooked`, not a caller's save-clear-restore of its attributes)."""
    import torch

    lm = loaded("phi3_longrope", "hf")
    m, ids = lm.model, PROMPT_IDS[:9]
    seen = []
    with torch.no_grad():
        cache = m.new_cache(16)
        m(torch.tensor([ids[:8]]), cache, 0)  # 8 slots: within the original context, the short factors
        with m.hooked(lambda layer, name, x: seen.append((layer, name, tuple(x.shape)))):
            m(torch.tensor([ids[8:9]]), cache, 8)  # position 8 passes it: the recompute, then this pass
            hooked = [mod for mod in m.modules() if getattr(mod, "hook", None) is not None]
    assert seen and {shape[1] for layer, name, shape in seen if name == "embed"} == {1}
    assert len([s for s in seen if s[1] == "embed"]) == 1  # one pass reported, not two
    assert len(hooked) > 1  # the hooks are back after the recompute, still inside the block
    assert all(getattr(mod, "hook", None) is None for mod in m.modules())
