"""Helpers the tests import (`from helpers import run_cli, fails`): running the CLI in this process, checks of its
failures and of the trace's schema, and the tiny models the quick suite runs its trace, report, intervention,
patching and explain checks on. Fixtures live in conftest.py; no test module imports another."""

import io
import json
import sys
from pathlib import Path

from tiny import TinySpec, make_hf_model, tiny_tokenizer, write_tokenizer

# ----------------------------------------------------------------------------------------------------------------
# running the CLI in this process


class FakeStdin(io.TextIOWrapper):
    """Standard input holding DATA; a terminal or not."""

    def __init__(self, data: bytes, tty: bool = False):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._tty = tty

    def isatty(self):
        return self._tty


def run_cli(capsys, *argv, stdin: bytes | None = None, tty: bool = False) -> tuple[int, str, str]:
    """Run `llmtrace ARGV` in this process: (exit code, stdout, stderr). STDIN, when given, replaces standard input."""
    from llmtrace.cli.main import main

    capsys.readouterr()  # what fixtures printed before (transformers' progress bars) is not the command's
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = FakeStdin(stdin, tty)
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = saved
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *says: str) -> str:
    """ERR is exactly one `error: ...` line, no traceback, holding every fragment of SAYS (any case); returns it."""
    lines = err.splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and err.endswith("\n"), f"not one error line: {err!r}"
    for fragment in says:
        assert fragment.lower() in lines[0].lower(), f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def assert_no_conversion_left(home) -> None:
    """A failed load leaves no (half-)converted model behind in the cache HOME."""
    converted = home / "converted"
    if converted.exists():
        assert not list(converted.rglob("llmtrace_config.json")), list(converted.iterdir())


def fails(capsys, code: int | None, *argv, says: tuple[str, ...] = ()) -> str:
    """Run the CLI and check the failure contract (exit CODE, or any non-zero one when None); returns the line."""
    got, _, err = run_cli(capsys, *argv)
    assert got == code if code is not None else got != 0, f"exit {got}, expected {code}; stderr: {err!r}"
    return assert_one_line_error(err, *says)


def undeclared_fields(events: list[dict]) -> list[str]:
    """Top-level fields of EVENTS that the schema's definition of their kind does not declare ("step.foo"): the
    schema allows extra fields, so validation alone would not notice a field written but never documented."""
    import json

    from llmtrace.trace.events import schema_path

    defs = json.loads(schema_path().read_text())["$defs"]
    out = []
    for ev in events:
        declared = defs.get(ev["event"], {}).get("properties", {})
        out += [f"{ev['event']}.{k}" for k in ev if k != "event" and k not in declared and f"{ev['event']}.{k}" not in out]
    return out


# ----------------------------------------------------------------------------------------------------------------
# tiny models for the quick suite


def load_tiny(path, **spec):
    """A tiny random LLaMA (tests/tiny.py: TinySpec(**spec), its byte-level BPE tokenizer) written as an HF directory
    at PATH and loaded by llmtrace on the CPU in float32."""
    from llmtrace.checkpoint.load import load_model
    from tiny import write_hf_dir

    write_hf_dir(path, TinySpec(**spec))
    return load_model(str(path), device="cpu", dtype="float32")


def model_param(tiny: str = "tiny_lm"):
    """The parameters of a fixture that runs a check on the tiny model (quick) and on the real SmolLM2 (slow)."""
    import pytest

    return [tiny, pytest.param("smollm", marks=pytest.mark.slow)]


# ----------------------------------------------------------------------------------------------------------------
# pages in a real browser (the `browser` fixture is in conftest.py)

CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


class Opened:
    """A page opened from file://, with every console message, page error and request it made."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.messages, self.requests = [], []
        self.page.on("console", lambda m: self.messages.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.messages.append(("pageerror", str(e))))
        self.page.route("**/*", self._route)
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)

    def _route(self, route):
        self.requests.append(route.request.url)
        if route.request.url == self.url:
            route.continue_()
        else:
            route.abort()


def open_at(browser, path, size) -> Opened:
    """A page opened from file:// at a viewport of `size` (width, height), with its messages and requests (Opened)."""
    o = Opened.__new__(Opened)
    o.page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    o.messages, o.requests = [], []
    o.page.on("console", lambda m: o.messages.append((m.type, m.text)))
    o.page.on("pageerror", lambda e: o.messages.append(("pageerror", str(e))))
    o.url = path.resolve().as_uri()
    o.page.route("**/*", o._route)
    o.page.goto(o.url)
    return o


# every box the report's sizes section drew (report/sizes.py, assets/sizes.js), as a script for page.evaluate: its
# caption's parts, its role, whether it is cut (and its button), and its bands' rendered area
DRAWN = """() => Array.from(document.querySelectorAll("#sizes-fig li.sz-tile")).map((li) => {
  const svg = li.querySelector("svg");
  const area = Array.from(li.querySelectorAll("rect.sz-band")).reduce((a, r) => {
    const b = r.getBoundingClientRect(); return a + b.width * b.height; }, 0);
  const btn = li.querySelector(".sz-broken button");
  return {name: li.dataset.name, n: Number(li.dataset.n), shape: li.dataset.shape.split(",").map(Number),
          label: li.querySelector(".sz-cap b").textContent, text: li.querySelector(".sz-cap code").textContent,
          cap: li.querySelector(".sz-cap").textContent, role: ["cache", "state"].find((r) => li.classList.contains("sz-" + r)) || "",
          group: li.closest(".sz-group").dataset.group, area: area, hidden: svg.getAttribute("aria-hidden"),
          broken: btn ? btn.getAttribute("aria-expanded") === "false" : false, can: !!btn,
          note: li.querySelector(".sz-broken") ? li.querySelector(".sz-broken").textContent : "",
          full: Number(svg.dataset.full), right: li.getBoundingClientRect().right};
})"""


# ----------------------------------------------------------------------------------------------------------------
# two tiny models that differ in one number (compare, diff and the comparison page)

SPEC = TinySpec(n_layers=3)  # the models compare and diff tell apart


def save_hf(path, model, tokenizer=None):
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    write_tokenizer(path, tokenizer or tiny_tokenizer(SPEC.vocab_size))
    return path


def perturbed_copy(layer: int, param: str, amount: float = 1e-2, spec: TinySpec = SPEC):
    """The tiny model of `spec` with one entry of one matrix (or norm) of one layer nudged by `amount`."""
    import torch

    model = make_hf_model(spec)
    with torch.no_grad():
        p = model.get_parameter(f"model.layers.{layer}.{param}")
        p.view(-1)[7] += amount
    return model


def check_against_schema(doc: dict, events: list[dict]) -> None:
    """A compare or diff document and its JSONL events, valid for the schema, with no field it does not declare."""
    import pytest

    jsonschema = pytest.importorskip("jsonschema")
    from llmtrace.trace.events import schema_path

    schema = json.loads(schema_path().read_text())
    # validators made once: jsonschema.validate() checks the whole schema against the meta-schema on every call
    # (1.5 s each here, so a few dozen events took most of a minute)
    jsonschema.Draft202012Validator.check_schema(schema)
    events_validator = jsonschema.Draft202012Validator(schema)
    compare_def = {"$ref": "#/$defs/compare_document", "$defs": schema["$defs"]}
    jsonschema.Draft202012Validator(compare_def).validate(doc)
    declared = schema["$defs"]["compare_document"]["properties"]
    assert [k for k in doc if k not in declared] == []
    for name in ("compare_layer", "compare_point", "compare_position"):
        assert schema["$defs"][name]["properties"]
    for p in doc["layers"][0]["points"]:
        assert [k for k in p if k not in schema["$defs"]["compare_point"]["properties"]] == []
    for ev in events:
        events_validator.validate(ev)


def embedded(page: str) -> dict:
    """The data a report page embeds (its <script id="data"> JSON)."""
    import re

    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def greedy_hf(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ids: n tokens, never stopped early."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def greedy_hf_cached(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation through its own cache, EOS a token like any other (greedy_hf forbids EOS with
    min_new_tokens, which a tiny vocabulary's greedy path may pick early)."""
    import torch
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def stepwise_hf(model, ids: list[int]):
    """transformers fed one token at a time through its cache (its decode path: a recurrence, a convolution's update,
    a shared layer's read): every position's logits, and the cache it leaves."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        rows = [model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1] for t in ids]
    return torch.stack(rows), cache


def greedy_ours(lm, ids: list[int], n: int) -> list[int]:
    """llmtrace's greedy continuation of ids through its generation loop (KV cache), n tokens, EOS ignored."""
    from llmtrace.run.generate import generate
    from llmtrace.run.sampler import Sampler, SamplerConfig

    sampler = Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size)
    return list(generate(lm, ids, sampler, n, (), True, None).tokens)


# How far two float32 computations of the same sums may differ, in units of the rounding error of one of them.
# |ours - theirs| <= |ours - exact| + |theirs - exact|. The first term is measured on the spot: llmtrace's pass in
# float32 against the same pass with every weight in float64 (exact to ~1e-16 next to float32's 1.2e-7), which is the
# float32 error of this computation at its depth, widths and magnitudes, on this CPU and its kernels. The second is
# transformers' rounding of the same sums in another order or form; its error is of the same kind, not one CPU's luck:
# the largest seen is Qwen3.5's token-by-token (recurrent) form, 3.9x ours, alike under ATEN_CPU_CAPABILITY=avx2 and
# avx512 at 1 and 2 threads, against 0.3-1.2x for every prefill. 8 covers 1 + 3.9 with room for another CPU's order.
ROUNDING_MARGIN = 8
_F32_EPS = 1.1920928955078125e-07  # torch.finfo(torch.float32).eps
_float64_twins = {}


def float64_twin(lm):
    """llmtrace's model of lm with every weight and buffer in float64 (a copy, made once per model)."""
    import copy

    key = id(lm.model)
    if key not in _float64_twins or _float64_twins[key][0] is not lm.model:
        _float64_twins[key] = (lm.model, copy.deepcopy(lm.model).double())
    return _float64_twins[key][1]


def rounding_tol(value, exact) -> float:
    """The tolerance for a float32 value computed two ways: ROUNDING_MARGIN times its own float32 error (`exact` is
    the float64 pass's value), and never under that many ulps of its largest entry (no float32 result is nearer)."""
    err = float((value.double() - exact.double()).abs().max())
    return ROUNDING_MARGIN * max(err, _F32_EPS * float(exact.abs().max()))


def logits_tol(lm, ids: list[int]) -> float:
    """The tolerance for llmtrace's fp32 logits on ids against another fp32 implementation (see ROUNDING_MARGIN)."""
    import torch

    idx = torch.tensor([ids])
    with torch.no_grad():
        return rounding_tol(lm.model(idx), float64_twin(lm)(idx))


def check_run(lm, reference, ids: list[int], tol: float | None = None, n_new: int = 8) -> None:
    """llmtrace's model against transformers' `reference` on ids: fp32 logits within tol (by default logits_tol: a
    multiple of the pass's own float32 error) at every position, and n_new greedy tokens identical (decode through
    the KV cache)."""
    import torch

    idx = torch.tensor([ids])
    tol = logits_tol(lm, ids) if tol is None else tol
    with torch.no_grad():
        ours, theirs = lm.model(idx)[0], reference(idx).logits[0]
    diff = float((ours - theirs).abs().max())
    assert diff <= tol, f"logits differ by {diff:.3g}, over {tol:.3g}"
    assert greedy_ours(lm, ids, n_new) == greedy_hf(reference, ids, n_new)
