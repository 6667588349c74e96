"""Llama's relatives that need no module of their own, run from both formats against transformers: Qwen3 (its one
family file, per-head q/k norms), Mistral's sliding window (a banded mask, not a context limit), Qwen3 with a window
on some layers. Each from its HF directory and from the GGUF llama.cpp's converter writes, prompt longer than any
window: fp32 logits within 8x their own float32 error at every position and greedy tokens identical. A GGUF carries
no window (the converter drops it); it runs without one, as llama.cpp does, against transformers without one."""

import pytest
import torch
from helpers import check_run

from families import FAMILIES, PROMPT_IDS, hf_model_via_state_dict

from llmtrace.checkpoint.load import load_model

NAMES = ["llama", "qwen3", "qwen3_tied", "qwen3_swa", "mistral"]
TOL = 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_hf_dir_runs_as_transformers(families, name):
    lm = load_model(str(families.hf_dir(name)), device="cpu", dtype="float32")
    assert lm.config.family == ("qwen3" if name.startswith("qwen3") else "llama")
    window = FAMILIES[name].config.get("sliding_window")
    if window:
        assert lm.config.sliding_window == window and len(PROMPT_IDS) > window
        assert lm.config.max_seq_len == FAMILIES[name].config.get("max_position_embeddings", lm.config.max_seq_len)
    check_run(lm, families.model(name), PROMPT_IDS)


@pytest.mark.parametrize("name", NAMES)
def test_converter_gguf_runs_as_transformers_without_a_window(families, name):
    lm = load_model(str(families.gguf(name)), device="cpu", dtype="float32")
    assert lm.config.sliding_window is None  # llama.cpp's converter drops it
    config = FAMILIES[name].config
    windowless = {"sliding_window": None} | ({"use_sliding_window": False, "layer_types": [
        "full_attention"] * len(config["layer_types"])} if "use_sliding_window" in config else {})
    reference = hf_model_via_state_dict(families.gguf(name), FAMILIES[name], **windowless)
    check_run(lm, reference, PROMPT_IDS)


def test_the_window_is_a_banded_mask_not_a_context_limit(families):
    """Mistral with W = 4: past position 4 the logits differ from the same weights without a window (it bites), and
    the model's context is its own, not the window."""
    lm = load_model(str(families.hf_dir("mistral")), device="cpu", dtype="float32")
    windowless = load_model(str(families.gguf("mistral")), device="cpu", dtype="float32")
    idx = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        a, b = lm.model(idx)[0], windowless.model(idx)[0]
    W = lm.config.sliding_window
    assert float((a[:W] - b[:W]).abs().max()) <= TOL  # within the window the two are one model
    assert float((a[W:] - b[W:]).abs().max()) > 1e-2
    assert lm.config.max_seq_len > W


def test_what_a_family_changes_is_said_with_its_numbers(families):
    from llmtrace.model.family import describe_changes

    qwen = load_model(str(families.hf_dir("qwen3_swa")), device="cpu", dtype="float32")
    said = describe_changes(qwen.config)
    assert said[0].startswith(f"q/k RMSNorm per head (width {qwen.config.head_dim})")
    assert any("the last 4 tokens" in line and "not a context limit" in line for line in said)
    assert describe_changes(load_model(str(families.hf_dir("llama")), device="cpu").config) == []
    gguf = load_model(str(families.gguf("mistral")), device="cpu", dtype="float32")
    assert any("no sliding window" in line and "llama.cpp" in line for line in describe_changes(gguf.config))


def test_qwen3s_norms_are_points_of_the_trace(families):
    """The family's own steps are in the trace without any other file knowing them: q_norm and k_norm at s6.2, with
    their axes, between the split into heads and RoPE."""
    import llmtrace

    model = llmtrace.load(str(families.hf_dir("qwen3")), device="cpu")
    run = model.generate("The quick brown fox", max_new_tokens=1, trace="full")
    shapes = next(e for e in run.events if e["event"] == "shapes")["points"]
    names = [p["name"] for p in shapes if p["layer"] == 0]
    assert names.index("k") < names.index("q_norm") < names.index("k_norm") < names.index("q_rope")
    q_norm = next(p for p in shapes if p["name"] == "q_norm")
    assert q_norm["seed_step"] == "s6.2" and q_norm["axes"] == ["T", "H", "Dh"] and len(q_norm["shape"]) == 3
    declared = next(e for e in run.events if e["event"] == "run")["points"]
    assert any(p["name"] == "k_norm" and p["where"] == "attn" for p in declared)


@pytest.mark.parametrize("name", ["llama", "qwen3", "olmo2", "phi3_longrope"])
def test_explains_rope_check_rotates_what_the_family_rotates(families, name):
    """explain reproduces q_rope and k_rope from the point RoPE turns, following the declared inputs: q for Llama,
    the per-head q_norm for Qwen3, the whole-width q_norm (reshaped into heads) for OLMo 2, partial for Phi-3."""
    import llmtrace

    trace = llmtrace.load(str(families.hf_dir(name)), device="cpu").explain("The quick brown fox", layer=1)
    rope = next(e for e in trace.events if e.get("section") == "rope")
    assert rope["check_q_rope_max_abs_diff"] <= 1e-5 and rope["check_k_rope_max_abs_diff"] <= 1e-5
