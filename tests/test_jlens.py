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



@pytest.mark.slow  # Ray starts a local cluster: about 10 s
def test_ray_actors_fit_what_one_process_does(loaded, tmp_path, one_thread):
    ray = pytest.importorskip("ray")
    lm = loaded("llama", "hf")
    one = tmp_path / "one.safetensors"
    fit(lm, TEXT, CTX, one, chunks=3, threads=1)
    try:
        r = fit(lm, TEXT, CTX, tmp_path / "ray.safetensors", chunks=3, workers=2, ray="local", threads=1)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # --ray local: on loopback only
    finally:
        ray.shutdown()
    assert (r["done"], r["interrupted"]) == (3, False)
    # the same chunks' sums added in the same order: the same file, byte for byte
    assert (tmp_path / "ray.safetensors").read_bytes() == one.read_bytes()

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


CELLS = """(lens) => Array.from(document.querySelectorAll(`table[data-lens=${lens}] td.c`)).map((td) => ({
  layer: Number(td.dataset.layer), pos: Number(td.dataset.pos), id: Number(td.dataset.id), p: Number(td.dataset.p),
  text: td.firstChild.textContent, shown: td.querySelector("small").textContent}))"""


def test_the_page_draws_both_lenses_as_the_json_and_the_logit_lens_read_them(families, browser, capsys, tmp_path,
                                                                            monkeypatch):
    import json

    from helpers import Opened, run_cli

    from llmtrace.report.page import visible

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    model = families.hf_dir("llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    lens = tmp_path / "lens.safetensors"
    code, _, err = run_cli(capsys, "lens", "--fit-jacobian", corpus, "-m", model, "--ctx", CTX, "--chunks", 2,
                           "-o", lens)
    assert code == 0, err
    prompt = "the quick brown fox"
    code, _, err = run_cli(capsys, "lens", prompt, "-m", model, "--jacobian", lens, "--json", tmp_path / "j.json",
                           "--html", tmp_path / "j.html")
    assert code == 0, err
    ev = json.loads((tmp_path / "j.json").read_text())
    code, out, err = run_cli(capsys, "lens", prompt, "-m", model, "--positions", "all", "--json", "-")  # J = I
    assert code == 0, err
    logit_lens = {(e["layer"], e["position"]): e["topk"][0] for e in json.loads(out)["events"]
                  if e["event"] == "lens" and e["layer"] is not None}
    o = Opened(browser, tmp_path / "j.html")
    T, L = len(ev["tokens"]), ev["n_layers"]
    jl, ll = o.page.evaluate(CELLS, "jlens"), o.page.evaluate(CELLS, "logit")
    assert len(jl) == len(ll) == L * T == len(ev["cells"])
    for c, drawn in zip(ev["cells"], jl):  # the Jacobian lens's cells: the --json readout's top candidate
        t = c["top"][0]
        assert (drawn["layer"], drawn["pos"], drawn["id"], drawn["text"]) == (c["layer"], c["position"], t["id"],
                                                                            visible(t["text"]))
        assert drawn["p"] == t["p"] and float(drawn["shown"]) == pytest.approx(t["p"], abs=0.005 + 1e-9)
    for drawn in ll:  # the logit lens's cells: what `llmtrace lens` (the logit lens it draws) reads there
        want = logit_lens[(drawn["layer"], drawn["pos"])]
        assert drawn["id"] == want["id"] and drawn["p"] == pytest.approx(want["prob"], abs=2e-6)
    # the two differ before the last layer (J_l is not I there) and agree at it (J_{L-1} = I)
    assert any(a["id"] != b["id"] or abs(a["p"] - b["p"]) > 1e-3 for a, b in zip(jl, ll) if a["layer"] < L - 1)
    for a, b in zip(jl[-T:], ll[-T:]):
        assert a["id"] == b["id"] and a["p"] == pytest.approx(b["p"], abs=2e-6)
    fit = dict(zip(o.page.locator("#fit th").all_inner_texts(), o.page.locator("#fit td").all_inner_texts()))
    assert fit["corpus tokens"] == str(2 * CTX) and fit["ctx"] == str(CTX) and fit["chunks"] == "2"
    assert fit["fitted on"] == ev["fit"]["model"] and fit["format"] == "llmtrace.jlens/1"
    assert [m for m in o.messages if m[0] in ("error", "pageerror")] == [] and o.requests == [o.url]
    o.page.close()


class Runs:
    """A pickle that would call `path.touch()` when unpickled: what a .pt file can hold, and llmtrace never runs."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (type(self.path).touch, (self.path,))


def test_torch_save_files_are_read_without_running_them(tmp_path):
    from llmtrace.checkpoint.torch_zip import read_torch_zip
    from llmtrace.errors import LlmtraceError

    big = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    saved = {"J": {0: big.half(), 1: big[1:3, ::2], 2: big.T.bfloat16(), 3: torch.tensor(2.5, dtype=torch.float64)},
             "n": 5, "layers": [0, 1], "meta": {"name": "x", "lr": 1.5, "ok": True, "none": None, "pair": (1, "a")}}
    torch.save(saved, tmp_path / "a.pt")  # torch.save's own protocol, as the reference package writes
    got = read_torch_zip(tmp_path / "a.pt")
    assert {k: v for k, v in got.items() if k != "J"} == {k: v for k, v in saved.items() if k != "J"}
    for k, v in saved["J"].items():  # views (a slice, a transpose) come out as their values, in their dtype
        assert got["J"][k].dtype == v.dtype and torch.equal(got["J"][k], v), k
    torch.save(saved, tmp_path / "p4.pt", pickle_protocol=4)  # one torch's weights-only loader does not read
    with pytest.raises(LlmtraceError, match="cannot read it"):
        read_torch_zip(tmp_path / "p4.pt")
    marker = tmp_path / "ran"
    torch.save({"J": Runs(marker)}, tmp_path / "evil.pt")
    with pytest.raises(LlmtraceError, match="refused: it would call"):
        read_torch_zip(tmp_path / "evil.pt")
    assert not marker.exists()
    (tmp_path / "not.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(LlmtraceError, match="not a torch.save file"):
        read_torch_zip(tmp_path / "not.pt")


def test_a_lens_in_the_reference_format_reads_as_the_same_lens(loaded, families, capsys, tmp_path, monkeypatch):
    """The reference package's file (anthropics/jacobian-lens, which TransformerLens reads and writes): torch.save of
    {J: {layer: (D, D)}, n_prompts, source_layers, d_model[, metadata]} over layers 0 … L-2, fp16 by default."""
    import json

    from helpers import assert_one_line_error, run_cli

    from llmtrace.errors import LlmtraceError
    from llmtrace.run.jlens import lens_info

    lm = loaded("llama", "hf")
    ours = tmp_path / "lens.safetensors"
    fit(lm, TEXT, CTX, ours, chunks=2)
    lens = read_lens(ours, lm)
    L, D = lm.config.n_layers, lm.config.d_model
    meta = {"model_name": "tiny llama", "corpus": "tiny"}

    def reference(path, dtype=torch.float32, layers=range(L - 1), width=D):
        torch.save({"J": {layer: lens[layer][:width, :width].to(dtype) for layer in layers}, "n_prompts": 2,
                    "source_layers": list(layers), "d_model": width, "metadata": meta}, path)
        return path

    ref = read_lens(reference(tmp_path / "ref.pt"), lm)
    assert sorted(ref) == list(range(L)) and torch.equal(ref[L - 1], torch.eye(D))  # the last layer's J is I
    for layer in range(L):
        assert torch.equal(ref[layer], lens[layer]), layer
    prompt = chunks_of(lm, 1)[0]
    assert torch.equal(readout(lm, prompt, ref), readout(lm, prompt, lens))
    half = read_lens(reference(tmp_path / "half.pt", torch.float16), lm)  # the reference's default storage
    for layer in range(L - 1):
        assert torch.equal(half[layer], lens[layer].half().float()), layer
    assert lens_info(tmp_path / "ref.pt") == {"format": "jlens", "d_model": D, "n_prompts": 2,
                                              "source_layers": list(range(L - 1)), "metadata": meta}
    torch.save({"jacobian_sum": {layer: 4 * lens[layer] for layer in range(L - 1)}, "n_done": 4, "next_idx": 4,
                "target_layer": L - 1}, tmp_path / "sums.pt")  # the reference's fit checkpoint: sums over n_done
    sums = read_lens(tmp_path / "sums.pt", lm)
    for layer in range(L - 1):
        torch.testing.assert_close(sums[layer], lens[layer], atol=1e-6, rtol=0)
    torch.save({"J": {0: lens[0]}, "n_prompts": 2, "source_layers": [0], "d_model": D,
                "metadata": {"target_layer": 0}}, tmp_path / "target.pt")
    with pytest.raises(LlmtraceError, match="not the last layer's"):
        read_lens(tmp_path / "target.pt", lm)
    with pytest.raises(LlmtraceError, match="no matrix for layer 0"):
        read_lens(reference(tmp_path / "part.pt", layers=range(1, L)), lm)
    with pytest.raises(LlmtraceError, match="width 8"):
        read_lens(reference(tmp_path / "narrow.pt", width=8), lm)

    monkeypatch.setenv("LLMTRACE_HOME", str(tmp_path / "home"))
    model = families.hf_dir("llama")
    docs = []
    for f in (ours, tmp_path / "ref.pt"):
        code, out, err = run_cli(capsys, "lens", "the quick", "-m", model, "--jacobian", f, "--json", "-")
        assert code == 0, err
        docs.append(json.loads(out))
    assert docs[1]["fit"]["format"] == "jlens" and docs[0]["cells"] == docs[1]["cells"]
    torch.save({"J": Runs(tmp_path / "ran")}, tmp_path / "evil.pt")
    code, _, err = run_cli(capsys, "lens", "the quick", "-m", model, "--jacobian", tmp_path / "evil.pt")
    assert code == 1 and assert_one_line_error(err, "runs nothing a file names") and not (tmp_path / "ran").exists()
