"""SmolLM3 (model/families/smollm3.py): Llama with no RoPE in every 4th layer, on the tiny checkpoint of
tests/families.py (4 layers: layer 3 rotates nothing), against transformers. From the HF directory and from the GGUF
llama.cpp's converter writes (arch `smollm3`, which has no key for the layers without RoPE: llama.cpp and llmtrace
take the interval of 4; transformers cannot load the file, so its reference is the converter undone by hand): prompt
ids identical, fp32 logits within 8x their own float32 error at every position, greedy tokens identical through the
KV cache. The layer without RoPE is one: turning q and k there as well would change the logits."""

import pytest
import torch
from helpers import check_run

from families import FAMILIES, PROMPT_IDS, hf_model_via_state_dict

from llmtrace.model.capture import capture

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reference(families):
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            cache[fmt] = families.model("smollm3") if fmt == "hf" else hf_model_via_state_dict(
                families.gguf("smollm3"), FAMILIES["smollm3"])
        return cache[fmt]

    return get


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_runs_as_transformers(families, loaded, reference, fmt):
    import transformers

    lm = loaded("smollm3", fmt)
    assert lm.config.family == "smollm3" and lm.config.no_rope_layers == [3]
    assert families.model("smollm3").config.no_rope_layers == [1, 1, 1, 0]  # transformers' flags: 0 = no RoPE
    ids = lm.tokenizer.encode(PROMPT)
    assert ids == transformers.AutoTokenizer.from_pretrained(str(families.hf_dir("smollm3"))).encode(PROMPT)
    check_run(lm, reference(fmt), PROMPT_IDS)


def test_the_layer_without_rope_passes_q_and_k_unturned(loaded):
    lm = loaded("smollm3", "hf")
    with torch.no_grad(), capture(lm.model, lambda layer, name: name in ("q", "k", "q_rope", "k_rope")) as kept:
        lm.model(torch.tensor([PROMPT_IDS]))
    assert torch.equal(kept[(3, "q_rope")], kept[(3, "q")]) and torch.equal(kept[(3, "k_rope")], kept[(3, "k")])
    for layer in (0, 1, 2):  # the others turn: every position past 0 moves
        assert float((kept[(layer, "q_rope")] - kept[(layer, "q")])[:, 1:].abs().max()) > 1e-3


def test_rope_in_the_layer_without_it_would_be_wrong(families, loaded):
    """The same weights with RoPE in every layer: position 0 (angle 0) agrees, every later position moves away from
    transformers. So the exactness test above is a test of the layer without RoPE."""
    from llmtrace.checkpoint.load import load_model

    lm = load_model(str(families.hf_dir("smollm3")), device="cpu", dtype="float32")
    lm.model.kinds = [("global", mask) for _, mask in lm.model.kinds]  # as if the config had no no_rope_layers
    idx = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        ours, theirs = lm.model(idx)[0], families.model("smollm3")(idx).logits[0]
    assert float((ours[0] - theirs[0]).abs().max()) <= 1e-4
    assert float((ours[1:] - theirs[1:]).abs().max(dim=-1).values.min()) > 1e-3


def test_the_gguf_says_nothing_and_the_interval_is_four(families):
    from families import gguf_metadata

    meta = gguf_metadata(families.gguf("smollm3"))
    assert meta["general.architecture"] == "smollm3"
    assert not [k for k in meta if "rope" in k and ("layer" in k or "interval" in k or "step" in k)]


def test_explain_says_no_rotation_in_the_layer_without_rope(families):
    import llmtrace
    from llmtrace.model.family import describe_changes

    model = llmtrace.load(str(families.hf_dir("smollm3")), device="cpu")
    assert describe_changes(model.config) == ["no RoPE in layer 3 of 4: q and k go unrotated, so attention there "
                                              "sees content, not position"]
    gguf = llmtrace.load(str(families.gguf("smollm3")), device="cpu")
    assert "(the GGUF has no key for them: llama.cpp's every 4th)" in describe_changes(gguf.config)[0]
    rope = next(e for e in model.explain(PROMPT, layer=3).events if e.get("section") == "rope")
    assert rope["rotation"] == "none" and "theta" not in rope and "pairs" not in rope
    assert rope["check_q_rope_max_abs_diff"] == 0 and "content" in rope["why"]
    plan = next(e for e in model.explain(PROMPT, layer=3).events if e.get("section") == "steps")["plan"]
    assert plan["rope"] is None
    turned = next(e for e in model.explain(PROMPT, layer=2).events if e.get("section") == "rope")
    assert turned["rope_table"] == "global" and turned["check_q_rope_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("flags, says", [([1, 1, 0], "no_rope_layers must list 4 flags"),
                                         ([1, 1, 2, 0], "no_rope_layers must list 4 flags")])
def test_a_bad_no_rope_list_is_one_line(capsys, families, tmp_path, flags, says):
    import json
    import shutil

    from helpers import fails

    path = tmp_path / "smollm3"
    shutil.copytree(families.hf_dir("smollm3"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "no_rope_layers": flags}))
    fails(capsys, None, "generate", "hi", "-m", path, "-n", "1", says=(str(path), says))
