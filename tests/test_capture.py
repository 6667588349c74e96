"""Activations over a corpus (issue 49 item 6): `llmtrace capture`, `llmtrace.capture_corpus`, `read_capture`.

The shards hold what run_with_cache gives for each chunk run alone (float32 within 1e-5; float16 as its rounding),
on a Llama, a hybrid with linear attention (its recurrent state from zero in every chunk), LongRoPE and a GGUF; a run
stopped after k shards and resumed ends with the same bytes in every file as a run never stopped; two worker
processes write what one does.
"""

import json

import pytest
import torch

from llmtrace.api import Model
from llmtrace.errors import BadValue, LlmtraceError, UsageError
from llmtrace.run.capture import capture_corpus, read_capture
from tiny import CORPUS

TEXT = " ".join(CORPUS * 4)
CTX = 16
POINTS = ["0.resid_post", "1.o_proj", "1.attn_out", "1.down"]  # attn_out (B, T, H, Dh): kept as (tokens, H·Dh)
LINEAR = ["0.resid_post", "1.o_proj", "1.delta_out", "1.down"]  # Qwen3.5's layer 1 is linear attention


def check_against_cache(lm, acts: dict, names: list[str], n_chunks: int, dtype=torch.float32) -> None:
    model = Model(lm)
    ids = acts["ids"]
    assert ids.shape == (n_chunks * CTX,) and acts["positions"][:CTX].tolist() == list(range(CTX))
    for i in range(n_chunks):
        rows = slice(i * CTX, (i + 1) * CTX)
        assert acts["chunks"][rows].tolist() == [i] * CTX
        _, cache = model.run_with_cache(ids[rows].tolist(), names=names)
        for n in names:
            want = cache[n][0].reshape(CTX, -1)
            assert acts[n].shape == (n_chunks * CTX, want.size(1)) and acts[n].dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(acts[n][rows], want, atol=1e-5, rtol=0)
            else:  # the float32 value rounded to float16, give or take the last bit of a different pass's rounding
                torch.testing.assert_close(acts[n][rows].float(), want.to(dtype).float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name,fmt", [("llama", "hf"), ("qwen3_5", "hf"), ("phi3_longrope", "hf"),
                                      ("gemma3", "hf"), ("qwen3", "gguf")])
def test_the_shards_are_run_with_cache_s_tensors(loaded, tmp_path, name, fmt):
    lm = loaded(name, fmt)
    points = LINEAR if name == "qwen3_5" else POINTS
    r = capture_corpus(lm, TEXT, points, CTX, tmp_path / "acts", dtype="float32", chunks=5, shard_chunks=2, batch=2)
    assert (r.written, r.skipped, r.tokens, r.interrupted) == ([0, 1, 2], [], 5 * CTX, False)
    check_against_cache(lm, read_capture(tmp_path / "acts"), points, 5)


def test_float16_and_the_points_after_the_layers(loaded, tmp_path):
    lm = loaded("llama", "hf")
    capture_corpus(lm, TEXT, "final_norm,0.resid_pre", CTX, tmp_path / "a", chunks=2)
    acts = read_capture(tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["dtype"] == "float16" and list(manifest["points"]) == ["0.resid_pre", "final_norm"]
    check_against_cache(lm, acts, ["0.resid_pre", "final_norm"], 2, torch.float16)


def test_an_interrupted_capture_resumes_to_the_same_bytes(loaded, tmp_path):
    lm = loaded("qwen3_5", "hf")
    POINTS = LINEAR
    whole = capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "whole", chunks=6, shard_chunks=1, batch=2)
    assert len(whole.written) == 6
    cut = capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "cut", chunks=6, shard_chunks=1, batch=2, stop_after=2)
    assert cut.interrupted and cut.written == [0, 1]
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["manifest.json", "shard-00000.safetensors",
                                                                   "shard-00001.safetensors"]
    with pytest.raises(LlmtraceError, match="unfinished: 4 of 6"):
        read_capture(tmp_path / "cut")
    with pytest.raises(UsageError, match="already holds a capture"):
        capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "cut", chunks=6, shard_chunks=1, batch=2)
    with pytest.raises(UsageError, match="another ctx"):
        capture_corpus(lm, TEXT, POINTS, 8, tmp_path / "cut", chunks=6, shard_chunks=1, batch=2, resume=True)
    rest = capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "cut", chunks=6, shard_chunks=1, batch=2, resume=True)
    assert (rest.skipped, rest.written, rest.interrupted) == ([0, 1], [2, 3, 4, 5], False)
    for f in sorted((tmp_path / "whole").iterdir()):
        assert (tmp_path / "cut" / f.name).read_bytes() == f.read_bytes(), f.name


def test_two_workers_write_what_one_does(loaded, tmp_path):
    lm = loaded("llama", "hf")
    capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "one", dtype="float32", chunks=4, shard_chunks=1, threads=1)
    capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "two", dtype="float32", chunks=4, shard_chunks=1, workers=2,
                   threads=1)
    one, two = read_capture(tmp_path / "one"), read_capture(tmp_path / "two")
    for n in one:
        torch.testing.assert_close(two[n], one[n], atol=1e-6, rtol=0)



@pytest.mark.slow  # Ray starts a local cluster: about 10 s
def test_ray_actors_write_what_one_process_does(loaded, tmp_path, one_thread):
    ray = pytest.importorskip("ray")
    lm = loaded("llama", "hf")
    opts = dict(dtype="float32", chunks=4, shard_chunks=1, batch=2, threads=1)
    capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "one", **opts)
    try:
        r = capture_corpus(lm, TEXT, POINTS, CTX, tmp_path / "ray", workers=2, ray="local", **opts)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # --ray local: on loopback only
    finally:
        ray.shutdown()
    assert sorted(r.written) == [0, 1, 2, 3] and not r.interrupted
    # each shard is the same passes over the same chunks, whichever process ran them: the same bytes
    for f in sorted((tmp_path / "one").iterdir()):
        assert (tmp_path / "ray" / f.name).read_bytes() == f.read_bytes(), f.name

def test_what_a_capture_refuses(loaded, tmp_path):
    lm = loaded("llama", "hf")
    with pytest.raises(BadValue, match="'1.resid_psot' is not a point"):
        capture_corpus(lm, TEXT, "1.resid_psot", CTX, tmp_path / "x")
    with pytest.raises(BadValue, match="key slots"):
        capture_corpus(lm, TEXT, "1.scores", CTX, tmp_path / "x")
    with pytest.raises(UsageError, match="empty"):
        capture_corpus(lm, "  ", "1.resid_post", CTX, tmp_path / "x")
    with pytest.raises(BadValue, match="ctx"):
        capture_corpus(lm, "short", "1.resid_post", CTX, tmp_path / "x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="other files"):
        capture_corpus(lm, TEXT, "1.resid_post", CTX, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "x").exists()


def test_the_command(families, capsys, tmp_path, monkeypatch):
    from helpers import assert_one_line_error, run_cli

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    model = str(families.hf_dir("llama"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    code, _, err = run_cli(capsys, "capture", corpus, "-m", model, "--points", "0.resid_post,1.attn_out", "--ctx",
                           CTX, "--chunks", 3, "-o", tmp_path / "acts")
    assert code == 0, err
    acts = read_capture(tmp_path / "acts")
    assert acts["0.resid_post"].shape == (3 * CTX, 64) and acts["1.attn_out"].shape == (3 * CTX, 64)
    code, _, err = run_cli(capsys, "capture", corpus, "-m", model, "--points", "0.resid_psot", "--ctx", CTX,
                           "-o", tmp_path / "b")
    assert code == 2 and assert_one_line_error(err, "0.resid_psot")
    (tmp_path / "empty.txt").write_text("\n")
    code, _, err = run_cli(capsys, "capture", tmp_path / "empty.txt", "-m", model, "--points", "0.resid_post",
                           "-o", tmp_path / "c")
    assert code == 2 and assert_one_line_error(err, "empty")
