"""A checkpoint whose config ties the LM head to the embedding (tie_word_embeddings: true) but whose files store
lm_head.weight as well, as many fine-tunes on the hub do.

transformers 5.25's `save_pretrained` of a tiny tied Llama writes no lm_head.weight (checked below), so the fixtures
add the tensor to the file themselves: once equal to the embedding, once different. transformers loads both: equal,
one tied matrix; different, the stored head, untied (with a warning). llmtrace loads them the same way, says nothing
of the first and one line of the second, and its logits match transformers' on each."""

from __future__ import annotations

import pytest
import torch

from helpers import check_run, run_cli
from tiny import TinySpec, write_hf_dir

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SPEC = TinySpec(tie=True, n_layers=2, seed=7)
IDS = [12, 250, 99, 7, 64, 300, 18, 77]  # greedy meets no EOS here (transformers would hold it back: min_new_tokens)


def _with_tensor(path, key: str, make) -> None:
    """Add tensor KEY (make(state dict)) to the directory's one safetensors file."""
    f = path / "model.safetensors"
    sd = safetensors_torch.load_file(str(f))
    sd[key] = make(sd)
    safetensors_torch.save_file(sd, str(f), metadata={"format": "pt"})


def _reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    """{"plain": as save_pretrained writes it, "equal": + lm_head.weight equal to the embedding, "differs": + a
    lm_head.weight of its own, "stray": + a tensor no Llama reads}."""
    out = {}
    for kind in ("plain", "equal", "differs", "stray"):
        path = tmp_path_factory.mktemp(f"tied-{kind}")
        write_hf_dir(path, SPEC)
        gen = torch.Generator().manual_seed(3)
        if kind == "equal":
            _with_tensor(path, "lm_head.weight", lambda sd: sd["model.embed_tokens.weight"].clone())
        elif kind == "differs":
            _with_tensor(path, "lm_head.weight",
                         lambda sd: torch.randn(sd["model.embed_tokens.weight"].shape, generator=gen))
        elif kind == "stray":
            _with_tensor(path, "model.extra_proj.weight", lambda sd: torch.zeros(4, 4))
        out[kind] = path
    return out


def _load(path):
    from llmtrace.checkpoint.load import load_model

    return load_model(str(path), device="cpu", dtype="float32")


def test_save_pretrained_of_a_tied_model_writes_no_head(tied_dirs):
    """Why the fixtures write the head themselves: transformers keeps a tied head out of the file."""
    with safetensors_torch.safe_open(str(tied_dirs["plain"] / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())


def test_a_stored_head_equal_to_the_embedding_loads_tied_and_silently(tied_dirs, capsys):
    capsys.readouterr()
    lm = _load(tied_dirs["equal"])
    assert capsys.readouterr().err == ""
    assert lm.config.tie_embeddings and lm.model.lm_head.weight is lm.model.embed.weight
    check_run(lm, _reference(tied_dirs["equal"]), IDS)


def test_a_stored_head_that_differs_is_the_head_as_transformers_loads_it(tied_dirs, capsys):
    capsys.readouterr()
    lm = _load(tied_dirs["differs"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("note: ") and "tie_word_embeddings" in err[0], err
    assert "lm_head.weight" in err[0] and "stored head is used" in err[0]
    reference = _reference(tied_dirs["differs"])
    # transformers 5.x keeps the stored head when it differs (it warns and does not tie)
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    assert not lm.config.tie_embeddings
    assert torch.equal(lm.model.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(lm.model.embed.weight, reference.model.embed_tokens.weight)
    check_run(lm, reference, IDS)


def test_the_cli_says_the_note_once_and_runs(tied_dirs, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    code, out, err = run_cli(capsys, "generate", "The quick", "-m", tied_dirs["differs"], "-n", "2",
                             "--jsonl", "-")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "tie_word_embeddings" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ")


def test_a_stray_tensor_is_named_without_blaming_the_layer_count(tied_dirs):
    from llmtrace.errors import LlmtraceError

    with pytest.raises(LlmtraceError) as e:
        _load(tied_dirs["stray"])
    msg = str(e.value)
    assert "unexpected tensor model.extra_proj.weight" in msg and "llama" in msg
    assert "layer" not in msg.replace("model.extra_proj", "")
