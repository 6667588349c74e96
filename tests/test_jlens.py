"""The Jacobian lens (issue 49 item 5): `llmtrace lens --fit-jacobian` and `--jacobian`.

The fit is checked against a brute-force Jacobian: for each position t of each chunk, torch.autograd's jacobian of the
last layer's output at t as a function of layer l's output at t (the pass run again with that one vector replaced),
averaged. The readout is softmax(head(J_l · h_l)) with that brute-force J. Fitting with 2 worker processes writes the
same file as 1; a fit stopped after k chunks and resumed writes it too.
"""

import pytest
import torch
from safetensors.torch import load_file

from llmtrace.errors import UsageError
from llmtrace.run.jlens import fit, read_lens, readout
from tiny import CORPUS

TEXT = " ".join(CORPUS * 4)
CTX = 4  # the brute force costs a pass and D backward passes per position and layer


def brute_force(lm, ids_chunks: list[list[int]]) -> torch.Tensor:
    """(L, D, D): the mean over every position of every chunk of ∂h_L[t]/∂h_l[t], one jacobian call per cell."""
    model = lm.model
    L, D = lm.config.n_layers, lm.config.d_model
    total = torch.zeros(L, D, D, dtype=torch.float64)
    n = 0
    for ids in ids_chunks:
        idx = torch.tensor([ids])
        base = {}
        with torch.no_grad(), model.hooked(lambda i, name, x: base.__setitem__((i, name), x.clone()), spell_out=False):
            model(idx)
        for t in range(len(ids)):
            for layer in range(L):
                def f(v, layer=layer, t=t):  # h_L[t] with h_l[t] replaced by v, the rest of the pass as it is
                    out = {}

                    def hook(i, name, x):
                        if name != "resid_post":
                            return None
                        if i == layer:
                            x = x.clone()
                            x[0, t] = v
                        out[i] = x
                        return x

                    with model.hooked(hook, spell_out=False):
                        model(idx)
                    return out[L - 1][0, t]

                total[layer] += torch.autograd.functional.jacobian(f, base[(layer, "resid_post")][0, t]).double()
            n += 1
    return total / n


def chunks_of(lm, n: int) -> list[list[int]]:
    from llmtrace.run.eval_score import Chunking

    ids = lm.tokenizer.encode(TEXT, parse_special=False)
    c = Chunking(CTX, lm.tokenizer.bos_id if lm.tokenizer.add_bos else None)
    return [c.ids(ids, i) for i in range(n)]


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_5"])
def test_the_fit_is_the_brute_force_jacobian_and_the_readout_reads_it(loaded, tmp_path, name):
    lm = loaded(name, "hf")
    r = fit(lm, TEXT, CTX, tmp_path / "lens.safetensors", chunks=2)
    assert (r["done"], r["positions"], r["interrupted"]) == (2, 2 * CTX, False)  # two chunks: the mean is over both
    lens = read_lens(tmp_path / "lens.safetensors", lm)
    want = brute_force(lm, chunks_of(lm, 2))
    L, D = lm.config.n_layers, lm.config.d_model
    assert sorted(lens) == list(range(L))
    for layer in range(L):
        torch.testing.assert_close(lens[layer].double(), want[layer], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lens[L - 1], torch.eye(D), atol=1e-6, rtol=0)  # the last layer's own output
    prompt = chunks_of(lm, 1)[0]
    probs = readout(lm, prompt, lens)
    from llmtrace.api import Model

    _, cache = Model(lm).run_with_cache(prompt, names="*.resid_post")
    with torch.no_grad():
        for layer in range(L):
            mapped = cache[f"{layer}.resid_post"] @ want[layer].float().T
            torch.testing.assert_close(probs[layer], lm.model.head(mapped)[0].softmax(-1), atol=1e-5, rtol=1e-4)
        logits = Model(lm).run_with_hooks(prompt)[0]
    torch.testing.assert_close(probs[L - 1], logits.softmax(-1), atol=1e-5, rtol=1e-4)  # J = I at the last layer


def test_two_workers_and_a_resumed_fit_write_what_one_process_does(loaded, tmp_path):
    lm = loaded("llama", "hf")
    one = tmp_path / "one.safetensors"
    fit(lm, TEXT, CTX, one, chunks=4, threads=1)
    torch.set_num_threads(1)
    fit(lm, TEXT, CTX, tmp_path / "two.safetensors", chunks=4, workers=2, threads=1)
    a, b = load_file(str(one)), load_file(str(tmp_path / "two.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0)
    cut = tmp_path / "cut.safetensors"
    r = fit(lm, TEXT, CTX, cut, chunks=4, stop_after=1)
    assert r["interrupted"] and r["done"] == 1 and not cut.exists()
    with pytest.raises(UsageError, match="already exists"):
        fit(lm, TEXT, CTX, cut, chunks=4)
    with pytest.raises(UsageError, match="other settings"):
        fit(lm, TEXT, CTX + 1, cut, chunks=4, resume=True)
    fit(lm, TEXT, CTX, cut, chunks=4, resume=True)
    c = load_file(str(cut))
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-6, rtol=0)


def test_the_command(families, capsys, tmp_path, monkeypatch):
    from helpers import assert_one_line_error, run_cli

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    model = families.hf_dir("llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "lens.safetensors"
    code, _, err = run_cli(capsys, "lens", "--fit-jacobian", corpus, "-m", model, "--ctx", CTX, "--chunks", 2,
                           "-o", out)
    assert code == 0 and out.exists(), err
    code, stdout, err = run_cli(capsys, "lens", "the quick", "-m", model, "--jacobian", out, "--json", "-")
    assert code == 0, err
    import json

    ev = json.loads(stdout)
    assert ev["event"] == "jlens" and ev["n_layers"] == 2 and len(ev["cells"]) == 2 * len(ev["tokens"])  # 2 layers
    code, _, err = run_cli(capsys, "lens", "the quick", "-m", model, "--jacobian", tmp_path / "none.safetensors")
    assert code == 2 and assert_one_line_error(err, "no such lens file")
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run_cli(capsys, "lens", "--fit-jacobian", tmp_path / "empty.txt", "-m", model, "-o",
                           tmp_path / "x.safetensors")
    assert code == 2 and assert_one_line_error(err, "empty")
