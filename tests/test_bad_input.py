"""Bad input, through the real CLI entry point: every case exits non-zero (2 for usage, 1 for runtime problems) with
one `error: ...` line on stderr that names the problem, and no traceback.

Most cases call `llmtrace.cli.main` in this process (one torch import for all). Where a case needs the real model,
`llmtrace.checkpoint.load.load_model` hands back the session's `smollm` instead of loading it again; tiny checkpoints go
through the real loader. A few cases run `python -m llmtrace` in a subprocess: the exit codes as a shell sees them,
LLMTRACE_DEBUG=1, and a closed pipe.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_no_conversion_left, fails, run_cli

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# helpers


def no_load(*args, **kwargs):
    raise AssertionError("the model was loaded, but this error should have been found before the load")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No user models.toml; torch's thread count left alone (the CLI would set it to every CPU)."""
    cfg = tmp_path / "config"
    cfg.mkdir()
    monkeypatch.setenv("LLMTRACE_CONFIG_DIR", str(cfg))
    monkeypatch.setattr("llmtrace.checkpoint.devices.set_threads", lambda n: torch.get_num_threads())


@pytest.fixture
def with_smollm(monkeypatch, smollm):
    """`load_model` returns the session's real model instead of loading it again."""
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", lambda *a, **k: smollm)
    return smollm


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny LLaMA checkpoint in HF form: config.json, model.safetensors, tokenizer.json (2 layers, width 64)."""
    from tiny import TinySpec, write_hf_dir

    path = tmp_path_factory.mktemp("tiny") / "hf"
    write_hf_dir(path, TinySpec())
    return path


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path):
    """A copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny import TinySpec, make_hf_model, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, make_hf_model(TinySpec()))
    return path


def rewrite_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    del sd[name]
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------------------------
# model paths


def test_missing_model_path(capsys, tmp_path):
    fails(capsys, 1, "generate", "hi", "-m", tmp_path / "nowhere" / "model.gguf", says=("no such file", "nowhere"))


def test_file_that_is_neither_gguf_nor_safetensors(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("just some text\n")
    fails(capsys, 1, "generate", "hi", "-m", notes, says=("notes.txt", "neither", ".gguf", "config.json"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf at all")
    fails(capsys, 1, "generate", "hi", "-m", fake, says=("model.gguf", "not a GGUF file"))


def test_directory_without_config_json(capsys, tmp_path, tiny_gguf):
    empty = tmp_path / "empty"
    empty.mkdir()
    fails(capsys, 1, "generate", "hi", "-m", empty, says=("empty", "no config.json"))
    shutil.copy(tiny_gguf, empty / "tiny.gguf")
    fails(capsys, 1, "generate", "hi", "-m", empty, says=("no config.json", "pass the file itself", "tiny.gguf"))


def test_config_json_that_is_not_json(capsys, tiny_copy):
    (tiny_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n  "hidden_size": 64,,\n}')
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("config.json", "not valid JSON", "line 2"))


def test_missing_tensor_files(capsys, tiny_copy):
    (tiny_copy / "model.safetensors").unlink()
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("no *.safetensors weight files",))
    (tiny_copy / "pytorch_model.bin").write_bytes(b"\x80\x02 pickle")
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("pytorch_model.bin", "never loaded", "convert them"))


def test_index_names_a_shard_that_is_missing(capsys, tiny_copy):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tiny_copy / "model.safetensors").rename(tiny_copy / "model-00001-of-00002.safetensors")
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("model-00002-of-00002.safetensors", "missing"))


def test_a_tensor_missing_from_the_checkpoint_is_named(capsys, tiny_copy):
    drop_tensor(tiny_copy, "model.layers.1.mlp.up_proj.weight")
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("layer 1", "up", "missing"))


def test_a_missing_final_norm_is_named(capsys, tiny_copy):
    drop_tensor(tiny_copy, "model.norm.weight")
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("norm.weight", "missing"))


@pytest.mark.parametrize("change, says", [
    ({"intermediate_size": 96}, ("model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[96, 64]")),
    ({"vocab_size": 400}, ("model.embed_tokens.weight", "[320, 64]", "[400, 64]")),
    ({"num_hidden_layers": 3}, ("layer 2", "missing")),
    ({"num_hidden_layers": 1}, ("unexpected tensor", "layers.1", "config says 1 layer)")),
])  # fmt: skip
def test_shape_mismatch_between_config_and_tensors_is_named(capsys, tiny_copy, change, says):
    rewrite_config(tiny_copy, **change)
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=says)


@pytest.mark.parametrize("arch, model_type", [("GPT2LMHeadModel", "gpt2"), ("BertForMaskedLM", "bert")])
def test_non_llama_architecture_is_named(capsys, tmp_path, arch, model_type):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type, "n_layer": 2}))
    line = fails(capsys, 1, "generate", "hi", "-m", d, says=(arch, "not supported", "LlamaForCausalLM"))
    from llmtrace.model.family import hf_types

    types = hf_types()  # every family's, as the family files declare them
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(types)
    assert line == (f"error: {d}: model_type {model_type!r}, architectures [{arch!r}] is not supported; "
                    f"llmtrace runs model_type {', '.join(sorted(types))} ({', '.join(types.values())})")


def test_a_config_with_model_type_and_no_architectures_loads_as_transformers_does(tiny_copy):
    """transformers' auto classes read model_type; `architectures` may be missing (issue 20, item 4)."""
    from llmtrace.checkpoint.load import load_model

    ids = torch.tensor([[5, 6, 7, 8]])
    before = load_model(str(tiny_copy), device="cpu").model(ids)
    cfg = json.loads((tiny_copy / "config.json").read_text())
    assert cfg.pop("architectures") == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    torch.testing.assert_close(load_model(str(tiny_copy), device="cpu").model(ids), before, rtol=0, atol=0)


def test_non_llama_gguf_is_named(capsys, tmp_path, fresh_home):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_uint32("gpt2.block_count", 1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fails(capsys, 1, "generate", "hi", "-m", path, says=("architecture 'gpt2'", "not supported", "llama"))
    assert_no_conversion_left(fresh_home)


# ----------------------------------------------------------------------------------------------------------------
# corrupt files


@pytest.mark.parametrize("where", ["header", "data"])
def test_truncated_safetensors(capsys, tiny_copy, where):
    f = tiny_copy / "model.safetensors"
    data = f.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    rng = random.Random(f"safetensors-{where}")
    cut = rng.randrange(1, header_end) if where == "header" else rng.randrange(header_end, len(data))
    f.write_bytes(data[:cut])
    fails(capsys, 1, "generate", "hi", "-m", tiny_copy, says=("model.safetensors", "truncated or corrupt"))


@pytest.mark.parametrize("where", ["metadata", "data"])
def test_truncated_gguf(capsys, tmp_path, tiny_gguf, fresh_home, where):
    import gguf

    data = tiny_gguf.read_bytes()
    data_start = gguf.GGUFReader(str(tiny_gguf)).data_offset
    rng = random.Random(f"gguf-{where}")
    cut = rng.randrange(4, data_start) if where == "metadata" else rng.randrange(data_start, len(data))
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    fails(capsys, 1, "generate", "hi", "-m", path, says=("cut.gguf", "truncated or corrupt"))
    assert_no_conversion_left(fresh_home)


def test_gguf_with_a_quantization_we_cannot_dequantize(capsys, tmp_path, fresh_home):
    from tiny import TinySpec, make_hf_model, mixed_plan, write_gguf

    path = tmp_path / "tq2.gguf"  # a ternary type of BitNet's: no family llmtrace runs has one (MXFP4 it reads)
    plan = lambda name, a: "TQ2_0" if "ffn_down" in name else mixed_plan(name, a)  # noqa: E731
    write_gguf(path, make_hf_model(TinySpec(ffn_dim=256)), plan=plan)  # rows of 256: TQ2_0's block
    fails(capsys, 1, "generate", "hi", "-m", path, says=("blk.0.ffn_down.weight", "TQ2_0", "cannot dequantize", "Q8_0"))


def test_models_toml_syntax_error_names_the_line(capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "config"
    bad = '[models."mine"]\ndescription = "my model"\nsources = [ {kind = "hub" repo = "a/b"} ]\n'  # no comma
    (cfg / "models.toml").write_text(bad)
    line = fails(capsys, 1, "generate", "hi", "-m", "mine", says=("models.toml:3", "invalid TOML"))
    assert str(cfg / "models.toml") in line


# ----------------------------------------------------------------------------------------------------------------
# sampling parameters: all checked before the model loads


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "-0.5"], ("--temperature", ">= 0", "-0.5")),
    (["--temperature", "nan"], ("--temperature", "finite", "nan")),
    (["--temperature", "inf"], ("--temperature", "must be a finite number >= 0", "got inf")),
    (["--repetition-penalty", "inf"], ("--repetition-penalty", "finite", "got inf")),
    (["--temperature", "hot"], ("--temperature", "number")),
    (["--top-p", "0"], ("--top-p", "(0, 1]")),
    (["--top-p", "1.5"], ("--top-p", "(0, 1]", "1.5")),
    (["--top-p", "-0.1"], ("--top-p",)),
    (["--top-k", "-1"], ("--top-k", ">= 0")),
    (["--top-k", "2.5"], ("--top-k",)),
    (["--min-p", "-0.1"], ("--min-p", "[0, 1]")),
    (["--min-p", "1.01"], ("--min-p", "[0, 1]")),
    (["--typical-p", "0"], ("--typical-p",)),
    (["--repetition-penalty", "0"], ("--repetition-penalty", "> 0")),
    (["--repetition-penalty", "-1"], ("--repetition-penalty", "> 0")),
    (["--frequency-penalty", "inf"], ("--frequency-penalty", "finite")),
    (["--logit-bias", "abc"], ("--logit-bias", "abc", "ID=BIAS")),
    (["--logit-bias", "1234"], ("--logit-bias", "ID=BIAS")),
    (["--logit-bias", "1234=strong"], ("--logit-bias", "1234=strong")),
    (["--logit-bias", "=5"], ("--logit-bias", "ID=BIAS")),
    (["--logit-bias", "-3=1"], ("--logit-bias", "outside the vocabulary")),
    (["--logit-bias", "12=inf"], ("--logit-bias", "finite", "a ban forbids")),
    (["--logit-bias", "12=1", "--logit-bias", "12=2"], ("given twice",)),
    (["--sampler-order", "top_k,warp"], ("warp",)),
    (["--max-new-tokens", "-1"], ("--max-new-tokens",)),
    (["--trace", "everything"], ("--trace", "none, steps, layers, full")),
    (["--dump", "nosuchpoint"], ("--dump", "nosuchpoint")),
    (["--layers", "a,b"], ("--layers", "'a'")),
    (["--seed", "-1"], ("--seed",)),
    (["--dtype", "float8"], ("--dtype", "float8", "float32")),
    (["--device", "tpu"], ("--device", "tpu", "cpu")),
    (["--no-such-flag"], ("--no-such-flag",)),
    (["--compile", "--trace", "full"], ("--compile", "observed")),
    (["--compile", "--dump", "logits"], ("--compile", "--dump")),
    (["--compile", "--html", "/tmp/llmtrace-never-written.html"], ("--compile", "--html")),
])  # fmt: skip
def test_usage_errors_exit_2_before_the_model_loads(capsys, monkeypatch, flags, says):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    line = fails(capsys, 2, "generate", "hi", *flags, says=says)
    assert not line.endswith(":"), line


def test_logit_bias_id_beyond_the_vocabulary(capsys, with_smollm):
    fails(capsys, 2, "generate", "hi", "--logit-bias", "49152=1.0",
          says=("49152", "outside the vocabulary", "0..49151"))


# ----------------------------------------------------------------------------------------------------------------
# layers


@pytest.mark.parametrize("spec, bad", [("30", "30"), ("-31", "-31"), ("0,3,99", "99"), ("28-31", "31"), ("0-9999999999", "9999999999")])
def test_layers_out_of_range(capsys, with_smollm, spec, bad):
    fails(capsys, 2, "generate", "hi", "-n", "1", "--layers", spec, says=(f"layer {bad}", "30 layers", "0..29"))


@pytest.mark.parametrize("spec", ["30.probs", "-31.scores"])
def test_dump_layer_out_of_range(capsys, with_smollm, spec):
    fails(capsys, 2, "generate", "hi", "-n", "1", "--dump", spec, says=("--dump", spec.split(".")[0], "30 layers"))


@pytest.mark.parametrize("command, flags", [("explain", ["--layer", "30"]), ("explain", ["--layer", "-31"]),
                                            ("lens", ["--layers", "0,30"])])
def test_explain_layer_out_of_range(capsys, with_smollm, command, flags):
    fails(capsys, 2, command, "The capital of France is", *flags, says=("30", "out of range", "30 layers"))


# ----------------------------------------------------------------------------------------------------------------
# prompts


def test_prompt_longer_than_the_context_window(capsys, with_smollm):
    text = "hello " * 8300
    n = len(with_smollm.tokenizer.encode(text))
    assert n > with_smollm.config.max_seq_len
    fails(capsys, 1, "generate", text, "-n", "1",
          says=(f"{n:,} tokens", f"context window of {with_smollm.name} is {with_smollm.config.max_seq_len:,} tokens",
                "shorten the prompt"))


@pytest.mark.parametrize("argv", [("generate", ""), ("explain", ""), ("lens", ""), ("generate", "-p", ""),
                                  ("generate", "--file", "EMPTY")], ids=lambda a: " ".join(a))
def test_empty_prompt_is_a_usage_error_found_before_the_load(capsys, tmp_path, argv):
    """Exit 2 and one line, whatever the command; the model named (which does not exist) is never looked at."""
    (tmp_path / "EMPTY").write_text("\n")  # one trailing newline is dropped: an empty prompt
    argv = [str(tmp_path / a) if a == "EMPTY" else a for a in argv]
    line = fails(capsys, 2, *argv, "-m", tmp_path / "never-loaded")
    assert line in ("error: the prompt is empty; give some text", "error: prompt 1 (-p number 1) is empty; give some text")


def test_prompt_file_missing_or_not_utf8(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    fails(capsys, 1, "generate", "-f", tmp_path / "prompt.txt", says=("prompt file not found", "prompt.txt"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    fails(capsys, 1, "generate", "-f", bad, says=("latin1.txt", "not valid UTF-8", "0xe9", "byte offset 3"))
    fails(capsys, 1, "generate", "-f", tmp_path, says=("is a directory",))
    fails(capsys, 2, "generate", "hi", "-f", bad, says=("not both",))


def test_prompt_on_stdin_that_is_not_utf8(capsys, monkeypatch):
    import io

    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff\xfe")))
    fails(capsys, 1, "generate", says=("stdin", "not valid UTF-8", "0xff", "byte offset 3"))


# ----------------------------------------------------------------------------------------------------------------
# output


@pytest.mark.parametrize("flag", ["--json", "--jsonl"])
def test_output_into_a_missing_directory_fails_before_the_load(capsys, monkeypatch, tmp_path, flag):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    target = tmp_path / "no" / "such" / "dir" / "trace.json"
    fails(capsys, 1, "generate", "hi", flag, target, says=(str(target), "does not exist", "create the directory"))
    fails(capsys, 1, "generate", "hi", flag, tmp_path, says=("is a directory",))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_output_into_an_unwritable_directory_fails_before_the_load(capsys, monkeypatch, tmp_path):
    """/proc refuses new files even to root; a mode-0555 directory refuses them to everyone else."""
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    fails(capsys, 1, "generate", "hi", "--json", "/proc/trace.json", says=("/proc", "not writable", "another path"))
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        fails(capsys, 1, "generate", "hi", "--jsonl", locked / "t.jsonl", says=("not writable",))


def test_same_file_for_json_and_jsonl(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    fails(capsys, 2, "generate", "hi", "--json", tmp_path / "t", "--jsonl", tmp_path / "t", says=("same file",))
    fails(capsys, 2, "generate", "hi", "--json", "-", "--jsonl", "-", says=("stdout",))


def test_a_failed_run_leaves_existing_outputs_alone(capsys, with_smollm, tmp_path):
    """The JSONL stream is opened before generation starts; a run that then fails replaces nothing."""
    old_json, old_jsonl = tmp_path / "t.json", tmp_path / "t.jsonl"
    old_json.write_text("OLD JSON\n")
    old_jsonl.write_text("OLD JSONL\n")
    fails(capsys, 1, "generate", "hello " * 8300, "--json", old_json, "--jsonl", old_jsonl, "--force",
          says=("context window",))
    assert old_json.read_text() == "OLD JSON\n" and old_jsonl.read_text() == "OLD JSONL\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config", "t.json", "t.jsonl"]  # no temporary files left


def test_outputs_to_devices_are_written_in_place(capsys, with_smollm, tmp_path):
    """--json /dev/null must not be replaced by a renamed file (as root, a rename would succeed)."""
    code, _, err = run_cli(capsys, "generate", "hi", "-n", "2", "--json", os.devnull, "--jsonl", os.devnull)
    assert code == 0, err
    assert Path(os.devnull).is_char_device()


# ----------------------------------------------------------------------------------------------------------------
# devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr("llmtrace.checkpoint.load.load_model", no_load)
    fails(capsys, 1, "generate", "hi", "--device", "cuda", says=("--device cuda", "no CUDA", "--device cpu"))


# ----------------------------------------------------------------------------------------------------------------
# as a shell sees it: a subprocess


def run_llmtrace(*argv, env=None, timeout=120, **kw) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "LLMTRACE_DEBUG"} | (env or {})
    return subprocess.run([sys.executable, "-m", "llmtrace", *map(str, argv)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO, **kw)


def test_subprocess_exit_codes_and_one_line(tmp_path):
    usage = run_llmtrace("generate", "hi", "--top-p", "1.5")
    assert usage.returncode == 2 and usage.stderr == "error: --top-p must be in (0, 1], got 1.5\n"
    missing = run_llmtrace("generate", "hi", "-m", tmp_path / "missing.gguf")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr
    assert missing.stdout == ""


def test_llmtrace_debug_shows_the_traceback(tmp_path):
    r = run_llmtrace("generate", "hi", "-m", tmp_path / "missing.gguf", env={"LLMTRACE_DEBUG": "1"})
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in r.stderr and "LlmtraceError" in r.stderr


def test_jsonl_into_a_closed_pipe_ends_quietly(smollm_path):
    """`llmtrace generate ... --jsonl - | head -1`: no BrokenPipeError, no 'Exception ignored', nothing on stderr."""
    script = (f'"{sys.executable}" -m llmtrace generate "Once upon a time" -n 64 --ignore-eos --device cpu '
              f'--threads 1 --jsonl - | head -1')
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={k: v for k, v in os.environ.items() if k != "LLMTRACE_DEBUG"})
    assert r.returncode == 0
    assert json.loads(r.stdout)["event"] == "run"
    assert r.stderr == ""


def test_a_full_disk_names_the_stream(capsys, with_smollm):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    fails(capsys, 1, "generate", "hi", "-n", "2", "--jsonl", "/dev/full",
          says=("cannot write /dev/full", "no space left on device"))
