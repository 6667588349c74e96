"""`llmtrace serve` (issue 35) on a tiny random model: the API's streams equal `generate --jsonl`, the security rules
(token, Host, origin, no paths, limits), two runs at once, a client that goes away, and the live page end to end in
Chromium against a real `llmtrace serve` process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="starlette's test client needs httpx")

from starlette.testclient import TestClient  # noqa: E402

from llmtrace.serve.app import make_app  # noqa: E402
from llmtrace.serve.runs import Limits, Served  # noqa: E402

TOKEN = "t0ken-for-tests"
HOST = "127.0.0.1:8321"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from tiny import TinySpec, write_hf_dir

    path = tmp_path_factory.mktemp("tiny") / "tinyhf"
    write_hf_dir(path, TinySpec())
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    import llmtrace

    return llmtrace.load(str(tiny_dir), threads=1)


def client(tiny, limits=None, served=None, **kw) -> TestClient:
    limits = limits or Limits(max_new_tokens=16)
    served = served if served is not None else {}
    served["tiny"] = Served("tiny", tiny, asyncio.Semaphore(limits.concurrent_per_model))
    app = make_app(served, TOKEN, host="127.0.0.1", port=8321, limits=limits, **kw)
    return TestClient(app, base_url=f"http://{HOST}")


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def lines(r) -> list[dict]:
    return [json.loads(x) for x in r.text.splitlines() if x]


def events_of(r) -> list[dict]:
    return [e for e in lines(r) if e["event"] not in ("queue", "run_id")]


def test_the_apis_events_are_the_clis_jsonl(tiny, tiny_dir, tmp_path):
    with client(tiny) as c:
        r = c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 5, "ignore_eos": True,
                                                         "trace": "steps"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    got = events_of(r)
    out = tmp_path / "cli.jsonl"
    cli = subprocess.run([sys.executable, "-m", "llmtrace", "generate", PROMPT, "-m", str(tiny_dir), "-n", "5",
                          "--ignore-eos", "--threads", "1", "--jsonl", str(out), "--html", str(tmp_path / "p.html")],
                         capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr
    want = [json.loads(x) for x in out.read_text().splitlines()]  # the server records what a page needs, as --html
    tokens = lambda evs: [e["token"]["id"] for e in evs if e["event"] == "step"]  # noqa: E731
    assert tokens(got) == tokens(want) and len(tokens(got)) == 5
    assert [e["event"] for e in got] == [e["event"] for e in want]
    summary = next(e for e in got if e["event"] == "summary")
    assert summary["text"] == next(e for e in want if e["event"] == "summary")["text"]


def test_a_request_without_the_token_is_refused(tiny):
    with client(tiny) as c:
        assert c.get("/").status_code == 401
        assert c.post("/api/generate", json={"prompt": PROMPT}).status_code == 401
        assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(f"/?token={TOKEN}").status_code == 200
        page = c.get("/", headers=AUTH)
        assert page.status_code == 200 and "Content-Security-Policy" in page.text
        assert page.headers["referrer-policy"] == "no-referrer" and page.headers["x-frame-options"] == "DENY"


def test_a_foreign_host_or_origin_is_refused(tiny):
    with client(tiny) as c:
        assert c.get("/", headers=AUTH | {"Host": "evil.example:8321"}).status_code == 421  # DNS rebinding
        assert c.get("/", headers=AUTH | {"Host": "localhost:8321"}).status_code == 200
        r = c.post("/api/generate", headers=AUTH | {"Origin": "http://evil.example"}, json={"prompt": PROMPT})
        assert r.status_code == 403
        assert c.get("/", headers=AUTH | {"Sec-Fetch-Site": "cross-site"}).status_code == 403
        assert c.post("/api/generate", headers=AUTH | {"Origin": f"http://{HOST}"},
                      json={"prompt": PROMPT, "max_new_tokens": 1}).status_code == 200


def test_a_path_in_a_request_is_refused_and_the_server_lives_on(tiny, tiny_dir):
    with client(tiny) as c:
        for name in (str(tiny_dir), "../x.gguf", "/etc/passwd", "model.gguf"):
            r = c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "model": name})
            assert r.status_code == 400 and "path" in r.json()["error"], (name, r.text)
        r = c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "model": "smollm2-135m-instruct"})
        assert r.status_code == 400 and "not served here" in r.json()["error"]
        bad = [({"prompt": ""}, "prompt"), ({"prompt": PROMPT, "temperature": -1}, "temperature"),
               ({"prompt": PROMPT, "max_new_tokens": 10_000}, "max_new_tokens"),
               ({"prompt": PROMPT, "dump": ["logits"]}, "dump"),
               ({"prompt": PROMPT, "save_tensors": "/tmp/x"}, "save_tensors"),
               ({"prompt": PROMPT, "ablate": ["99.h0"]}, "layer")]
        for body, says in bad:
            r = c.post("/api/generate", headers=AUTH, json=body)
            if r.status_code == 200:  # a check that needs the model: an error line in the stream
                err = [e for e in lines(r) if e["event"] == "error"]
                assert err and says in err[0]["error"], (body, r.text)
            else:
                assert r.status_code == 400 and says in r.json()["error"], (body, r.text)
        r = c.post("/api/generate", headers=AUTH | {"Content-Type": "application/json"}, content=b"x" * 70_000)
        assert r.status_code == 413
        r = c.post("/api/generate", headers=AUTH, content=b"{not json")
        assert r.status_code == 400
        # the message, never a Python class ("ValueError: the request body is not JSON ..." was the answer)
        for body, says in ((b"{not json", "the request body is not JSON (Expecting property name enclosed in double "
                                        "quotes)"),
                           (b"\xff\xfe{", "the request body is not JSON (it is not UTF-8 text)"),
                           (b'{"prompt": "Hi", "temperature": "hot"}', 'temperature must be a number, not "hot"'),
                           (b'{"prompt": "Hi", "top_k": 1.5}', "top_k must be a whole number, not 1.5"),
                           (b'{"prompt": "Hi", "stop": 5}', "stop must be a text or a list of texts, not 5"),
                           (b'{"prompt": "Hi", "layers": {"a": 1}}', "layers must be a text or a list of whole "
                                                                     "numbers or null, not an object")):
            r = c.post("/api/generate", headers=AUTH, content=body)
            assert r.status_code == 400 and r.json() == {"error": says}, (body, r.text)
        r = c.post("/api/resample", headers=AUTH, content=b"{not json")
        assert r.status_code == 400 and r.json()["error"].startswith("the request body is not JSON ("), r.text
        r = c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and sum(e["event"] == "step" for e in lines(r)) == 2  # still answering


def test_two_runs_at_once_both_come_back_right_one_waits(tiny):
    import threading

    want = tiny.generate(PROMPT, max_new_tokens=6, ignore_eos=True).tokens
    results = []
    with client(tiny) as c:
        def go():
            results.append(lines(c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 6,
                                                                               "ignore_eos": True, "trace": "full"})))
        ts = [threading.Thread(target=go) for _ in range(2)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(120)
    assert len(results) == 2
    for evs in results:
        assert [e["token"]["id"] for e in evs if e["event"] == "step"] == list(want)
    assert sum(any(e["event"] == "queue" for e in evs) for evs in results) == 1  # one run waited, and was told


def test_a_run_stops_when_its_client_goes_away(tiny):
    served: dict = {}
    steps = 0
    with client(tiny, Limits(max_new_tokens=4000), served) as c:
        with c.stream("POST", "/api/generate", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 4000,
                                                                     "ignore_eos": True, "trace": "full"}) as r:
            for raw in r.iter_lines():
                steps += '"event":"step"' in raw
                if steps == 3:
                    break  # the client leaves after three tokens of four thousand
        s = served["tiny"]
        deadline = time.time() + 60
        while (s.active or s.lock.locked()) and time.time() < deadline:
            time.sleep(0.05)
        assert s.active == 0 and not s.lock.locked()  # the run ended, and freed the model
        r = c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 2, "ignore_eos": True})
        assert sum(e["event"] == "step" for e in lines(r)) == 2


def test_each_step_is_streamed_while_the_run_is_still_going(tiny):
    """A step's line reaches the client before the run ends, shown by events, not by timing: a forward hook parks the
    run's thread inside the model's next pass, so when the client holds step 0 and the thread is parked, the run has
    provably not ended; released, the rest follow and the summary comes last."""
    import threading

    reached, release, calls = threading.Event(), threading.Event(), []

    def park(module, args, out):  # the prefill passes; the first decode step's pass waits here until released
        calls.append(1)
        if len(calls) == 2:
            reached.set()
            assert release.wait(120), "the test never released the run"

    handle = tiny.loaded.model.register_forward_hook(park)
    got: list[dict] = []
    try:
        with client(tiny) as c, c.stream("POST", "/api/generate", headers=AUTH, json={
                "prompt": PROMPT, "max_new_tokens": 4, "ignore_eos": True}) as r:
            lines_in = r.iter_lines()
            for raw in lines_in:
                got.append(json.loads(raw))
                if got[-1]["event"] == "step":
                    break
            assert reached.wait(120), "the run never reached its second pass"
            assert [e["event"] for e in got][-1] == "step" and got[-1]["step"] == 0
            assert not any(e["event"] == "summary" for e in got)  # step 0 is here; the run is parked mid-way
            release.set()
            got += [json.loads(raw) for raw in lines_in if raw]
    finally:
        release.set()
        handle.remove()
    assert [e["step"] for e in got if e["event"] == "step"] == [0, 1, 2, 3]
    assert got[-1]["event"] == "summary"


def test_the_page_of_a_run_is_the_report(tiny):
    with client(tiny) as c:
        evs = lines(c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 3,
                                                                 "ignore_eos": True, "trace": "full"}))
        run_id = next(e["id"] for e in evs if e["event"] == "run_id")
        page = c.get(f"/api/page?run={run_id}", headers=AUTH)
        assert page.status_code == 200 and 'id="whatif"' in page.text and 'id="walk"' in page.text
        assert 'id="sizes-data"' in page.text  # the pass's tensors to scale (tests/test_report_sizes.py)
        assert "温度" in c.get(f"/api/page?run={run_id}&lang=zh", headers=AUTH).text
        assert c.get("/api/page?run=nope", headers=AUTH).status_code == 404
        assert c.post("/api/explain", headers=AUTH, json={"prompt": PROMPT, "layer": 1}).status_code == 200
        lens = events_of(c.post("/api/lens", headers=AUTH, json={"prompt": PROMPT}))
        assert any(e["event"] == "lens" for e in lens)
        assert c.post("/api/nothing", headers=AUTH, json={}).status_code == 404
        sweep = {"clean": "The quick brown fox", "corrupt": "The quick lazy dog", "answer": " b", "against": "The"}
        patch = events_of(c.post("/api/patch", headers=AUTH, json=sweep))
        import llmtrace

        want = llmtrace.patch_sweep(tiny, clean="The quick brown fox", corrupt="The quick lazy dog", answer=" b",
                                    against="The")
        assert [c["recovery"] for c in patch[0]["cells"]] == [c["recovery"] for c in want["cells"]]
        r = c.post("/api/patch", headers=AUTH, json={"clean": "a", "corrupt": "a longer one", "answer": " b",
                                                     "against": "The"})
        assert "same number of tokens" in lines(r)[-1]["error"]


# ----------------------------------------------------------------------------------------------------------------
# compare over the API: one model under two settings, as `compare --jsonl` writes it


def test_compare_over_the_api_is_the_clis_jsonl(tiny, tiny_dir, tmp_path):
    with client(tiny) as c:
        r = c.post("/api/compare", headers=AUTH, json={"prompt": PROMPT, "max_new_tokens": 2, "b_ablate": ["1.h0"]})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        got = events_of(r)
        run_id = next(e["id"] for e in lines(r) if e["event"] == "run_id")
        page = c.get(f"/api/page?run={run_id}", headers=AUTH)
        assert page.status_code == 200 and "attn_out" in page.text  # the comparison page of that run
    out = tmp_path / "cmp.jsonl"
    cli = subprocess.run([sys.executable, "-m", "llmtrace", "compare", PROMPT, "-m", str(tiny_dir), "--b-ablate",
                          "1.h0", "-n", "2", "--threads", "1", "--jsonl", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    want = [json.loads(x) for x in out.read_text().splitlines()]
    assert got == want  # the same events, number for number (two runs of one loaded model: A plain, B ablated)
    head = got[0]
    assert (head["first_divergence"]["layer"], head["first_divergence"]["point"]) == (1, "attn_out")
    added = [e["added_rel_err"] for e in got if e["event"] == "compare_layer"]
    assert added[0] == 0 and added[1] > 1e-3  # the ablated head adds error at its layer, none before it
    assert str(tiny_dir) not in r.text  # the model by its name, never its path


def test_compare_over_the_api_checks_as_the_cli_does(tiny, tiny_dir):
    with client(tiny, Limits(max_new_tokens=4)) as c:
        bad = [({"prompt": PROMPT}, "must change side B"),
               ({"prompt": PROMPT, "b_model": str(tiny_dir)}, "path"),
               ({"prompt": PROMPT, "b_model": "smollm2-135m-instruct"}, "not served here"),
               ({"prompt": PROMPT, "b_ablate": ["1.h0"], "max_new_tokens": 5}, "max_new_tokens"),
               ({"prompt": PROMPT, "b_ablate": "1.h0"}, "b_ablate"),
               ({"prompt": PROMPT, "b_ablate": ["1.h0"], "tolerance": 0}, "tolerance"),
               ({"prompt": PROMPT, "b_ablate": ["1.h0"], "system": "be brief"}, "chat"),
               ({"prompt": PROMPT, "b_ablate": ["1.h0"], "dtype": "bfloat16"}, "dtype"),
               ({"prompt": "", "b_ablate": ["1.h0"]}, "prompt"),
               ({"prompt": PROMPT, "b_ablate": ["7.h0"]}, "layer")]
        for body, says in bad:
            r = c.post("/api/compare", headers=AUTH, json=body)
            if r.status_code == 200:  # a check that needs the model: an error line in the stream
                err = [e for e in lines(r) if e["event"] == "error"]
                assert err and says in err[0]["error"], (body, r.text)
            else:
                assert r.status_code == 400 and says in r.json()["error"], (body, r.text)
        assert c.post("/api/compare", json={"prompt": PROMPT, "b_ablate": ["1.h0"]}).status_code == 401
        r = c.post("/api/compare", headers=AUTH, json={"prompt": PROMPT, "b_model": "tiny"})  # itself: no difference
        head = events_of(r)[0]
        assert head["first_divergence"] is None and head["kld_max"] == 0


# ----------------------------------------------------------------------------------------------------------------
# re-sampling one step: the run's own sampler on the logits that step produced


def hf_logits(tiny_dir, ids: list[int]):
    """The last position's logits from transformers (the reference, independent of llmtrace's forward pass)."""
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


def run_steps(c, **options) -> tuple[str, list[dict], list[int]]:
    r = c.post("/api/generate", headers=AUTH, json={"prompt": PROMPT, "ignore_eos": True, **options})
    evs = lines(r)
    prompt_ids = [t["id"] for e in evs if e["event"] == "tokens" for t in e["tokens"]]
    return next(e["id"] for e in evs if e["event"] == "run_id"), [e for e in evs if e["event"] == "step"], prompt_ids


def test_resample_at_the_runs_own_settings_is_the_runs_own_step(tiny):
    with client(tiny) as c:
        run_id, steps, _ = run_steps(c, max_new_tokens=5, temperature=0.9, top_k=40, top_p=0.95, seed=11)
        assert len(steps) == 5
        own = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0}
        for step in steps:
            for given in ({}, own):  # the run's settings, left out or given again
                r = c.post("/api/resample", headers=AUTH, json={"run": run_id, "step": step["step"], **given})
                assert r.status_code == 200, r.text
                a = r.json()
                assert a["draw"] == "the run's" and a["sampling"]["seed"] == 11
                want = {k: v for k, v in step.items() if k not in ("ms", "logits")}
                assert {k: v for k, v in a["step"].items() if k != "ms"} == want  # token, top-k, ledger, draw
        fresh = c.post("/api/resample", headers=AUTH, json={"run": run_id, "step": 2, "seed": 5}).json()
        assert fresh["draw"] == "fresh" and fresh["step"]["rng"]["draw"] != steps[2]["rng"]["draw"]


def test_resample_at_temperature_2_is_softmax_of_logits_over_2(tiny, tiny_dir):
    import torch

    with client(tiny) as c:
        run_id, steps, prompt_ids = run_steps(c, max_new_tokens=3)  # greedy
        k = 2
        r = c.post("/api/resample", headers=AUTH, json={"run": run_id, "step": k, "temperature": 2})
        a = r.json()
    z = hf_logits(tiny_dir, prompt_ids + [s["token"]["id"] for s in steps[:k]])
    probs = torch.softmax(z / 2, dim=-1)
    top = a["survivors"][0]
    assert top["id"] == int(probs.argmax())
    assert top["prob"] == pytest.approx(float(probs.max()), abs=1e-4)  # computed here from transformers' logits
    assert top["logit"] == pytest.approx(float(z.max()), abs=1e-4)  # the raw logit, not divided
    ledger = {s["stage"]: s for s in a["step"]["sampler"]}
    assert list(ledger) == ["input", "temperature"] and ledger["temperature"]["survivors"] == tiny.config.vocab_size
    chosen = a["step"]["token"]["id"]
    assert ledger["temperature"]["pick_prob"] == pytest.approx(float(probs[chosen]), abs=1e-4)
    assert a["step"]["rng"]["greedy"] is False and 0 <= a["step"]["rng"]["draw"] < 1
    assert a["step"]["topk"] == steps[k]["topk"]  # the raw candidates: the same logits


def test_resample_checks_and_its_memory_bound(tiny):
    per_step = tiny.config.vocab_size * 4 + 5056  # a step's float32 logits and the generator's state
    with client(tiny, Limits(max_new_tokens=16, kept_logits_bytes=3 * per_step)) as c:
        first, _, _ = run_steps(c, max_new_tokens=5)
        ok = c.post("/api/resample", headers=AUTH, json={"run": first, "step": 2, "temperature": 1})
        assert ok.status_code == 200
        r = c.post("/api/resample", headers=AUTH, json={"run": first, "step": 3})
        assert r.status_code == 400 and "not kept" in r.json()["error"]  # past the bound: said, not guessed
        bad = [({"run": first, "step": 1, "temperature": -1}, "temperature"),
               ({"run": first, "step": 9}, "not a step"), ({"run": first, "step": "1"}, "step"),
               ({"run": first, "step": 1, "prompt": "x"}, "prompt"), ({"step": 1}, "run"),
               ({"run": first, "step": 1, "top_p": 0}, "top_p")]
        for body, says in bad:
            r = c.post("/api/resample", headers=AUTH, json=body)
            assert r.status_code == 400 and says in r.json()["error"], (body, r.text)
        assert c.post("/api/resample", headers=AUTH, json={"run": "nope", "step": 0}).status_code == 404
        assert c.post("/api/resample", json={"run": first, "step": 0}).status_code == 401
        second, _, _ = run_steps(c, max_new_tokens=2)  # its steps need the room: the older run's go
        assert c.post("/api/resample", headers=AUTH, json={"run": first, "step": 0}).status_code == 404
        assert c.post("/api/resample", headers=AUTH, json={"run": second, "step": 1}).status_code == 200


# ----------------------------------------------------------------------------------------------------------------
# end to end: `llmtrace serve` in its own process, the page in Chromium


@pytest.fixture
def server(tiny_dir):
    env = dict(os.environ, LLMTRACE_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "llmtrace", "serve", "-m", str(tiny_dir), "--port", "0",
                          "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    url = None
    while time.time() < deadline and url is None:
        line = p.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/\?token=\S+)", line)
        if m:
            url = m.group(1)
        elif p.poll() is not None:
            break
    assert url, p.stderr.read()
    yield p, url
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def press(page, name: str) -> None:
    """Click a button of the live page. (After a click inside the run's frame, chromium under playwright can send
    the next click to the frame unless the page is scrolled to the button first.)"""
    button = page.get_by_role("button", name=name)
    button.scroll_into_view_if_needed()
    button.click()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_before_the_first_run_the_page_shows_one_line_not_an_empty_frame(browser, lang):
    """Before any run, the learner's page's frame was a large empty framed box (80% of the window's height): now it
    is not drawn, and one line says what will appear there."""
    from llmtrace.report.i18n import Words
    from llmtrace.report.serve_page import serve_page

    page = browser.new_page(viewport={"width": 1000, "height": 800})
    page.set_content(serve_page(["tinyhf"], Limits(), lang))
    assert page.locator("#page").bounding_box() is None  # not drawn at all
    note = page.locator("#page-note")
    assert note.is_visible() and note.inner_text() == Words(lang)("serve.page_note")
    page.close()


def test_serve_end_to_end_prompt_run_shows_the_greedy_text(server, tiny, browser):
    from playwright.sync_api import expect

    proc, url = server
    want = tiny.generate("The capital of France is", max_new_tokens=8, ignore_eos=True).text
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    assert "token=" not in page.url  # the token left the address bar
    assert page.locator("#model option").all_inner_texts() == ["tinyhf"]  # the model by its name, never its path
    assert not page.locator("#page").is_visible() and page.locator("#page-note").is_visible()  # no empty frame yet
    page.get_by_label("Prompt").fill("The capital of France is")
    page.get_by_label("new tokens").fill("8")
    page.get_by_role("button", name="Run").click()
    page.locator("#status", has_text="done").wait_for(timeout=120_000)  # (the page's CSP forbids eval'd waits)
    assert page.inner_text("#text") == want
    assert page.locator("#tokens .chip.gen").count() == 8
    # that steps stream before the run ends is shown by events in test_each_step_is_streamed_while_the_run_is_still_
    # going: here the server's lines may reach the page in one read, so the page's row counts prove nothing either way
    rows = page.locator("#live-steps tbody tr")
    assert rows.count() == 8 and "input 320" in rows.nth(0).inner_text()  # each step's top-k and sampler ledger
    frame = page.frame_locator("#page")
    frame.locator("#whatif").wait_for(timeout=60_000)
    assert frame.locator("#walk").count() == 1
    assert page.locator("#page").is_visible() and not page.locator("#page-note").is_visible()  # the page took its place
    # the size of things in the frame: each box's drawn area its count; the K cache a slot longer at the next step
    from helpers import DRAWN

    def drawn():
        cell = float(frame.locator("#sizes-fig").get_attribute("data-cell"))
        boxes = {b["name"]: b for b in frame.locator("#sizes-fig").evaluate(f"() => ({DRAWN})()")}
        assert all(b["area"] == pytest.approx(b["n"] * cell * cell, rel=0.03) for b in boxes.values()
                   if not b["broken"] and b["n"] * cell * cell >= 1)
        return boxes
    before = drawn()["cache.k"]["shape"][0]

    # re-sample: the what-if slider's temperature, the step the page shows, the real sampler on the server
    frame.locator("#step-next").click()
    assert drawn()["cache.k"]["shape"][0] == before + 1
    expect(page.locator("#step")).to_have_value("1")
    frame.locator("#wi-temperature").evaluate("e => { e.value = '1.5'; e.dispatchEvent(new Event('input')); }")
    expect(page.locator("#temperature")).to_have_value("1.5")  # the what-if sliders set what a re-sample runs with
    press(page, "Re-sample this step")
    again = page.locator("#resample .side.again")
    again.locator("table").wait_for(timeout=60_000)
    assert "Step 1 sampled again on the server with temperature 1.5" in page.inner_text("#resample")
    assert "temperature" in again.locator("table").inner_text() and "draw u = " in again.inner_text()
    assert page.locator("#resample .side.own").count() == 1  # beside the run's own step

    # a click on a head of the heatmap ablates it at once and compares the runs
    frame.locator("button.thumb[data-layer='1'][data-hi='2']").click()
    page.locator("#compare p.cmp", has_text="part").wait_for(timeout=120_000)
    text = page.inner_text("#compare")
    assert "With layer 1 head 2 ablated" in text and "the runs part at layer 1, attn_out" in text
    expect(page.locator("#ablate_layer")).to_have_value("1")
    expect(page.locator("#ablate_head")).to_have_value("2")
    page.frame_locator("#compare-page").locator("body").wait_for(timeout=60_000)  # the comparison page
    frame.locator(".thumbs .tl[data-layer='0']").click()  # a row's "layer 0": that layer's attention
    page.locator("#compare p.cmp", has_text="part at layer 0").wait_for(timeout=120_000)
    assert "With layer 0's attention ablated" in page.inner_text("#compare")
    expect(page.locator("#ablate_part")).to_have_value("attn")
    # from the keyboard: the fields and the button (a layer's FFN)
    page.get_by_label("ablate: part").select_option("ffn")
    page.get_by_label("ablate: layer").fill("0")
    press(page, "Ablate and compare")
    page.locator("#compare p.cmp", has_text="part at layer 0").wait_for(timeout=120_000)
    assert "With layer 0's FFN ablated" in page.inner_text("#compare")

    # the run can be stopped while it goes: a long run's first tokens, then Stop
    page.get_by_label("new tokens").fill("256")
    press(page, "Run")
    rows.first.wait_for(timeout=120_000)
    press(page, "Stop")
    page.locator("#status", has_text="stopped").wait_for(timeout=60_000)
    assert 0 < rows.count() < 256
    assert errors == []
    page.close()
    proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
    assert proc.wait(30) == 0 or proc.returncode in (0, 130)
    assert "Traceback" not in proc.stderr.read()
