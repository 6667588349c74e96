"""Issue 39's contract, held by the pages: every worked example stands beside the trace's own value, checked, with
the operation the model declares for it.

1. The report's walk-through, in Chromium, for every family fixture (and the real Gemma 3 270M, slow): a
   `--trace full --layers 0,-1` report of a prompt past every window, stepped through every recorded layer and
   every head, at two prefill tokens and a decode step. Each `.card` names its point, layer and (per head) head;
   its `data-op` is the operation the model's declaration (model.maths) gives that point in that layer; its
   `data-max-error` (computed from the recorded inputs of the same head and row, against the trace's value) is
   within 1e-5 absolute or 1e-4 relative; a card that cannot check says why (`data-missing`) only where an input
   lives in a layer the trace did not record; and no point with a declared operation and a recorded sample in that
   pass lacks its card. A page built from a trace with one recorded output changed shows the check failing.
2. The terminal `explain`, its `--json` and its `--html` page name the same operation, formula and check for a
   windowed layer (Gemma 3's layer 0), a global one (its layer 5) and a layer without RoPE (a test-only family,
   tests/norope_family.py).
3. The layer without RoPE is what the model runs: llmtrace matches transformers' SmolLM3 (which skips RoPE there),
   the same weights with RoPE in every layer give other logits, and the layer equals a float64 computation of its
   declared operations, chained from its input (model.recompute), which a rotating RoPE would not.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from families import FAMILIES
from helpers import Opened, check_run, embedded, run_cli
from llmtrace.model.maths import op_kinds
from llmtrace.run.generate import PREFILL_CHUNK
from llmtrace.trace.packed import pack, unpack

ABS, REL = 1e-5, 1e-4  # the tolerance: a card checks within 1e-5 absolute or 1e-4 relative
# the operations a card shows computed and checks (issue 39, item 4; issue 47 item 3: every declared kind, computed
# by the one evaluator when the trace is recorded; the cache's write has nothing to compute)
CHECKING = set(op_kinds()) - {"cache_write"}
TEXT = "The quick brown fox"  # 13 tokens of tests/tiny.py's tokenizer: past every fixture's window (4) and LongRoPE's 8
CARD_FAMILIES = ["llama", "mistral", "qwen3", "qwen3_swa", "gemma2", "gemma3", "phi3", "phi3_longrope", "olmo2",
                 "mixtral", "qwen3_moe", "qwen3_moe_raw", "qwen3_moe_dense", "smollm3", "gpt_oss", "gpt_oss_mxfp4",
                 "qwen3_5", "granite_hybrid", "lfm2", "deepseek_v3", "deepseek_v2", "gemma4"]


def test_the_card_families_are_the_fixtures():
    """Every family fixture is stepped through (qwen3_tied and qwen3_5_tied are qwen3 and qwen3_5 with the head tied
    and, for Qwen3.5, one key head per value head; granite_hybrid_dense is granite_hybrid without experts: the same
    cards)."""
    assert set(CARD_FAMILIES) == set(FAMILIES) - {"qwen3_tied", "qwen3_5_tied", "granite_hybrid_dense"}


# ----------------------------------------------------------------------------------------------------------------
# 1. the walk-through's cards


@pytest.fixture(scope="module")
def reports(families, tmp_path_factory):
    """report(name) -> (the loaded model, the trace's events, the report page's path), made once per family."""
    import llmtrace

    out = tmp_path_factory.mktemp("cards")
    made = {}

    def get(name: str):
        if name not in made:
            model = llmtrace.load(str(families.hf_dir(name)), threads=1)
            run = model.generate(TEXT, max_new_tokens=2, trace="full", layers="0,-1", for_report=True,
                                 ignore_eos=True)
            made[name] = (model.loaded, run.events, run.report(out / f"{name}.html"))
        return made[name]

    return get


# One call per (token, layer): every head chosen in turn, and each card's attributes read after the redraw.
COLLECT = """async ([token, layer, heads]) => {
  const pick = async (sel, v) => {
    const e = document.querySelector(sel);
    e.value = String(v);
    e.dispatchEvent(new Event("change", {bubbles: true}));
    await new Promise((r) => setTimeout(r, 0));
    return e.value === String(v);
  };
  const out = {token: await pick("#walk-token", token), layer: await pick("#walk-layer", layer), heads: {}};
  for (const h of heads) {
    const ok = await pick("#walk-head", h);
    out.heads[h] = {picked: ok, cards: Array.from(document.querySelectorAll("#walk-panel .card")).map((c) => ({
      point: c.dataset.point === undefined ? null : c.dataset.point,
      layer: c.dataset.layer === undefined ? null : c.dataset.layer,
      op: c.dataset.op === undefined ? null : c.dataset.op,
      head: c.dataset.head === undefined ? null : c.dataset.head,
      err: c.dataset.maxError === undefined ? null : c.dataset.maxError,
      rel: c.dataset.maxRel === undefined ? null : c.dataset.maxRel,
      missing: c.dataset.missing === undefined ? null : c.dataset.missing}))};
  }
  return out;
}"""

OPTIONS = "s => Array.from(document.querySelector(s).options).map((o) => o.value)"


def recorded(events: list[dict]) -> dict[tuple[int, object], set[str]]:
    """(pass, layer or "m") -> the points the trace kept values of in that pass (a sample, or the slots written)."""
    out: dict = {}
    for ev in events:
        if ev["event"] == "tensor" and (ev.get("sample") or ev.get("positions")):
            key = (ev.get("step", 0), "m" if ev["layer"] is None else ev["layer"])
            out.setdefault(key, set()).add(ev["name"])
    return out


def declared_op(maths, layer, point: str):
    """The operation the model declares for `point` of `layer` ("m": outside the layers), or None."""
    return maths.op(None if layer == "m" else int(layer), point)


def unrecorded_operand(maths, layer, o, recorded_layers: set[int], untraced: set[str]):
    """An operand of `o` that lives in a layer the trace did not record (the card may then say what is missing):
    directly, or through a point a trace never keeps (`untraced`: resid_pre is the layer before's resid_post)."""
    here = None if layer == "m" else int(layer)
    for ref in o.inputs:
        if ref == "ids":
            continue
        where, name = maths.operand(here, ref)
        if where is not None and where not in recorded_layers:
            return ref
        if where is not None and name in untraced:
            if unrecorded_operand(maths, where, maths.op(where, name), recorded_layers, untraced):
                return ref
    return None


def within(err: str, rel: str | None) -> bool:
    """A card's max error (and relative one) as numbers within the tolerance; False for anything else."""
    try:
        a, r = float(err), float(rel) if rel is not None else math.inf
    except ValueError:
        return False
    return math.isfinite(a) and (a <= ABS or r <= REL)


def card_problems(lm, events, path, browser) -> list[str]:
    """Everything on the report page at PATH that breaks the card contract, one line each (empty: it holds)."""
    maths, points = lm.maths, lm.points
    axes = {("m", p.name): p.axes for p in points.model} | {("L", p.name): p.axes for p in points.layer}
    untraced = {p.name for p in points.layer if not p.traced}
    problems: list[str] = []
    data = embedded(path.read_text(encoding="utf-8"))
    # the declaration the page embeds (its `maths.record`, or the run event's `maths`) is the model's
    embedded_maths = (data.get("maths") or {}).get("record") or (data.get("run") or {}).get("maths")
    if embedded_maths != json.loads(json.dumps(maths.record())):
        problems.append("the page's embedded maths is not the model's declaration (model.maths.Maths.record())")
    kept = recorded(events)
    L, H = lm.config.n_layers, lm.config.n_heads
    G = H // lm.config.n_kv_heads
    tokens = next(e for e in events if e["event"] == "tokens")["tokens"]
    n_prompt = len(tokens)
    o = Opened(browser, path)
    try:
        pg = o.page
        if pg.locator("#walk-panel").count() != 1:
            return problems + ["no #walk-panel"]
        layers, heads = pg.evaluate(OPTIONS, "#walk-layer"), pg.evaluate(OPTIONS, "#walk-head")
        if layers != ["0", str(L - 1)]:
            problems.append(f"#walk-layer offers {layers}, the trace recorded layers 0 and {L - 1}")
        if heads != [str(h) for h in range(H)]:
            problems.append(f"#walk-head offers {heads}, the model has {H} heads")
        recorded_layers = {0, L - 1}
        # the last prompt token and one earlier (the prefill), and the first generated token (decode step 1)
        for token in (n_prompt - 1, n_prompt - 4, n_prompt):
            step, t, T = (0, token, n_prompt) if token < n_prompt else (token - n_prompt + 1, 0, 1)
            for layer in (0, L - 1):
                got = pg.evaluate(COLLECT, [token, layer, list(range(H))])
                where = f"token {token} (pass {step}), layer {layer}"
                if not (got["token"] and got["layer"]):
                    problems.append(f"{where}: the walk's controls do not offer it")
                    continue
                for h in range(H):
                    view = got["heads"][str(h)]
                    at = f"{where}, head {h}"
                    problems += view_problems(view, at, maths, axes, kept, step, layer, h, G, t == T - 1,
                                              recorded_layers, untraced, n_prompt > PREFILL_CHUNK)
        problems += [f"page error: {m}" for m in o.messages if m[0] in ("error", "pageerror")]
        if o.requests != [o.url]:
            problems.append(f"the page asked the network for {o.requests[1:]}")
    finally:
        o.page.close()
    return problems


def view_problems(view, at, maths, axes, kept, step, layer, h, G, last_row, recorded_layers, untraced,
                  chunked=False) -> list[str]:
    """The card contract on one drawn view (a token, a layer, a head)."""
    out = []
    if not view["picked"]:
        return [f"{at}: #walk-head does not offer head {h}"]
    shown = set()
    for c in view["cards"]:
        name, lay = c["point"], c["layer"]
        where = f"{at}: card {name!r} (data-layer {lay!r})"
        if name is None or lay is None:
            out.append(f"{where}: a .card without data-point or data-layer")
            continue
        if lay not in (str(layer), "m"):
            out.append(f"{where}: drawn in the view of layer {layer}")
            continue
        shown.add((lay, name))
        o = declared_op(maths, lay, name)
        if o is None:
            out.append(f"{where}: the model declares no operation for it")
            continue
        if c["op"] != o.kind:
            out.append(f"{where}: data-op {c['op']!r}, the model declares {o.kind!r}")
        point_axes = axes.get(("m" if lay == "m" else "L", name)) or ()
        if "H" in point_axes and c["head"] != str(h):
            out.append(f"{where}: data-head {c['head']!r} on a per-head point, head {h} chosen")
        if "Hkv" in point_axes and "H" not in point_axes and c["head"] not in (str(h), str(h // G)):
            out.append(f"{where}: data-head {c['head']!r} on a KV-head point, head {h} (KV head {h // G}) chosen")
        if c["err"] is not None:
            if c["rel"] is None and o.kind in CHECKING:
                out.append(f"{where}: data-max-error without data-max-rel")
            if not within(c["err"], c["rel"]):
                out.append(f"{where}: op {o.kind}, computed vs trace max error {c['err']} (rel {c['rel']}) "
                           f"> {ABS:g} abs / {REL:g} rel")
        elif o.kind in CHECKING and name in kept.get((step, "m" if lay == "m" else layer), ()):
            # (a point without a sample, the broadcast k_repeated, shows its formula and no values)
            lacking = unrecorded_operand(maths, lay, o, recorded_layers, untraced)
            if c["missing"] is None:
                out.append(f"{where}: op {o.kind} but neither data-max-error nor data-missing")
            elif lacking is None and not (chunked and (o.const("cached") or o.const("carried"))):
                # (a prompt prefilled in chunks is observed in its last chunk only: an operand spanning the earlier
                # chunks' slots, or a state they left, is not in the trace, and the card says it was not computed)
                out.append(f"{where}: op {o.kind} unchecked (data-missing {c['missing']!r}) though every input "
                           f"is in the trace")
    for lay in (str(layer), "m"):
        for name in sorted(kept.get((step, "m" if lay == "m" else layer), ())):
            if declared_op(maths, lay, name) is None or (lay, name) in shown:
                continue
            if "T" not in (axes.get(("m" if lay == "m" else "L", name)) or ("T",)) and not last_row:
                continue  # a point of the pass's last position only (s7's row, the logits)
            out.append(f"{at}: no card for {name!r} (layer {lay}), which has an operation and a recorded sample")
    return out


def assert_cards_hold(problems: list[str]) -> None:
    shown = problems[:60] + ([f"... and {len(problems) - 60} more"] if len(problems) > 60 else [])
    assert not problems, f"{len(problems)} breaks of the card contract:\n" + "\n".join(shown)


@pytest.mark.parametrize("name", CARD_FAMILIES)
def test_every_card_is_the_declared_operation_checked_beside_the_trace(browser, reports, name):
    lm, events, path = reports(name)
    assert len(next(e for e in events if e["event"] == "tokens")["tokens"]) > 8  # past every window and LongRoPE's 8
    assert_cards_hold(card_problems(lm, events, path, browser))


def report_of_changed_trace(capsys, tmp_path, events, layer: int, name: str, changed_row, computed=False) -> object:
    """`llmtrace report` of the trace `events` with the prefill's recorded sample of point `name` of `layer` (or,
    `computed`, the values the trace computed for its card) moved by 1 % in the rows `changed_row(row)` picks (the
    rows: the recorded shape's other axes, row-major)."""
    out = []
    for ev in events:
        if ev["event"] == "tensor" and ev.get("step", 0) == 0 and ev["layer"] == layer and ev["name"] == name:
            ev = json.loads(json.dumps(ev))
            at = ev["sample"]["computed"] if computed else ev["sample"]
            rows = unpack(at["values"], len(ev["sample"]["index"]))
            at["values"] = pack([row * 1.01 if changed_row(i) else row for i, row in enumerate(rows)])
        out.append(ev)
    trace = tmp_path / f"changed-{name}.jsonl"
    trace.write_text("".join(json.dumps(e) + "\n" for e in out), encoding="utf-8")
    page = tmp_path / f"changed-{name}.html"
    code, _, err = run_cli(capsys, "report", trace, "-o", page)
    assert code == 0, err
    return page


def card_errors(browser, page, token: int, layer: int, heads: list[int], point: str) -> dict[int, list[bool]]:
    """head -> for each card of `point` in that view, whether its check holds."""
    o = Opened(browser, page)
    try:
        got = o.page.evaluate(COLLECT, [token, layer, heads])
    finally:
        o.page.close()
    return {h: [c["err"] is not None and within(c["err"], c["rel"]) for c in got["heads"][str(h)]["cards"]
                if c["point"] == point and c["layer"] == str(layer)] for h in heads}


def test_a_card_shows_a_wrong_trace_value_as_a_failed_check(browser, reports, capsys, tmp_path):
    """The check can fail: the same trace with layer 0's recorded `act` (GeGLU's output) changed by 1 % in the prefill,
    made a report again (`llmtrace report`): its glu card then reads a max error past the tolerance."""
    lm, events, _ = reports("gemma3")
    n = len(next(e for e in events if e["event"] == "tokens")["tokens"])
    page = report_of_changed_trace(capsys, tmp_path, events, 0, "act", lambda row: True)
    assert card_errors(browser, page, n - 1, 0, [0], "act") == {0: [False]}


def test_a_card_shows_the_computed_values_of_its_own_head_and_row(browser, reports, capsys, tmp_path):
    """Issue 39: a card read head 0's input while it showed another head's output. The values the trace computed for
    layer 0's q_rope moved in one row only (the last prompt token, head 2): the q_rope card fails there and nowhere
    else, not at head 0 of that token, not at head 2 of the token before."""
    lm, events, _ = reports("gemma3")
    n = len(next(e for e in events if e["event"] == "tokens")["tokens"])
    H = lm.config.n_heads
    page = report_of_changed_trace(capsys, tmp_path, events, 0, "q_rope", lambda row: row == (n - 1) * H + 2,
                                   computed=True)
    assert card_errors(browser, page, n - 1, 0, list(range(H)), "q_rope") == {0: [True], 1: [True], 2: [False],
                                                                              3: [True]}
    assert card_errors(browser, page, n - 2, 0, [2], "q_rope") == {2: [True]}


DOT = """(point) => { const d = document.querySelector(`#walk-panel .card[data-point='${point}'] .dot`);
  if (!d) return null;
  const rows = Array.from(d.querySelectorAll("table.walkv tr")).map((r) => Array.from(r.querySelectorAll("td"))
    .map((td) => Number(td.textContent))).filter((r) => r.length);
  return {entry: Number(d.dataset.dotEntry), rows: rows, rest: d.querySelector("[data-dot-rest]").textContent,
          check: d.closest(".card").querySelector(".check").textContent}; }"""


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text.replace("−", "-"))]


@pytest.mark.parametrize("name, point", [("gemma3", "q"), ("gemma3", "logits"), ("mixtral", "gate"),
                                         ("deepseek_v3", "o_proj"), ("gpt_oss", "q")])
def test_a_matmul_card_works_one_entry_as_the_dot_product_of_both_rows(browser, reports, name, point):
    """Issue 50 item 5: a matrix product's card shows one output entry as Σ_j x_j·W_ij: the input row's and the
    weight row's first entries (both visible), their products, the sum of the other terms; they add up to the value
    computed, which is checked. For Gemma 3's q (head 2) the weight row is the checkpoint's row of that head's entry
    and x the recorded attn_norm row; the logits head reads one row of a vocabulary-wide matrix, Mixtral's gate a
    chosen expert's."""
    lm, events, path = reports(name)
    n = len(next(e for e in events if e["event"] == "tokens")["tokens"])
    o = Opened(browser, path)
    try:
        o.page.evaluate(COLLECT, [n - 1, 0, [2]])
        got = o.page.evaluate(DOT, point)
    finally:
        o.page.close()
    assert got is not None, f"no dot product on the {point} card"
    assert got["check"].startswith("✓")
    x, w, p = got["rows"]
    assert len(x) == len(w) == len(p) == 8
    for a, b, c in zip(x, w, p):
        assert c == pytest.approx(a * b, rel=1e-3, abs=1e-6)
    text = got["rest"]
    rest, y = numbers(text.split(":", 1)[1])[0], numbers(text.split("=")[-1])[0]
    bias = numbers(text.split("bᵢ =")[1])[0] if "bᵢ =" in text else 0.0
    assert ("bᵢ =" in text) == (name == "gpt_oss")  # gpt-oss's projections have a bias
    assert sum(p) + rest + bias == pytest.approx(y, rel=1e-3, abs=1e-4)
    if name == "gemma3" and point == "q":
        o_q = lm.maths.op(0, "q")
        Dh = lm.config.head_dim
        W = lm.model.get_parameter("layers.0." + o_q.weights[0]).detach().double()
        assert w == pytest.approx(W[2 * Dh + got["entry"], :8].tolist(), rel=1e-4, abs=1e-6)
        norm = next(e for e in events if e["event"] == "tensor" and e["layer"] == 0 and e["name"] == "attn_norm"
                    and e["step"] == 0)
        rows = unpack(norm["sample"]["values"], len(norm["sample"]["index"]))
        assert x == pytest.approx(rows[n - 1][:8].tolist(), rel=1e-4, abs=1e-6)


def test_masked_scores_read_minus_infinity_outside_this_layers_window(browser, reports):
    """Gemma 3's layer 0 (a window of 4) at the last prompt token: the scores card shows −∞, computed and in the
    trace, at every key the window or the causal mask hides, and its check holds."""
    lm, events, path = reports("gemma3")
    n = len(next(e for e in events if e["event"] == "tokens")["tokens"])
    o = Opened(browser, path)
    try:
        o.page.evaluate(COLLECT, [n - 1, 0, [1]])
        card = o.page.locator("#walk-panel .card[data-point='scores'][data-layer='0']")
        assert card.count() == 1 and card.get_attribute("data-op") == "scores"
        assert within(card.get_attribute("data-max-error"), card.get_attribute("data-max-rel"))
        hidden = n - 4  # keys 0 .. n-5: four or more back from position n-1
        assert card.inner_text().count("−∞") >= 2 * hidden
    finally:
        o.page.close()


@pytest.fixture(scope="module")
def gemma3_real_report(gemma3_path, tmp_path_factory):
    """The real Gemma 3 270M's report of a prompt past its window (512): loaded once, a 530-token prompt."""
    import llmtrace

    model = llmtrace.load(str(gemma3_path), threads=2)
    words = "the quick brown fox jumps over the lazy dog and then " * 60
    n = len(model.tokenizer.encode(words))
    assert n > 520, n
    run = model.generate(words, max_new_tokens=2, trace="full", layers="0,-1", for_report=True, ignore_eos=True)
    return model.loaded, run.events, run.report(tmp_path_factory.mktemp("gemma3-real") / "r.html")


@pytest.mark.slow
def test_the_real_gemma3s_cards_are_its_declared_operations_checked(browser, gemma3_real_report):
    lm, events, path = gemma3_real_report
    assert_cards_hold(card_problems(lm, events, path, browser))


# ----------------------------------------------------------------------------------------------------------------
# 2. the terminal explain, --json and the explain page: one operation, one formula, one check per step


@pytest.fixture(scope="module")
def norope_dir(tmp_path_factory):
    """The test-only family's tiny checkpoint (tests/norope_family.py) and transformers' SmolLM3 holding it."""
    from families import make_model, write_hf_dir
    from norope_family import NOROPE

    reference = make_model(NOROPE)
    path = tmp_path_factory.mktemp("norope") / "hf"
    write_hf_dir(path, NOROPE, reference)
    return path, reference


@pytest.fixture
def norope(monkeypatch):
    """The test-only family registered for this test (model.family's registry), its model class returned."""
    from norope_family import registered

    with registered(monkeypatch) as family:
        yield family


def explained(capsys, monkeypatch, tmp_path, model_dir, layer: int):
    """`llmtrace explain TEXT -m DIR --layer N --json F --html P` at 400 columns: (stdout, events, page path)."""
    monkeypatch.setenv("COLUMNS", "400")
    out, page = tmp_path / f"e{layer}.json", tmp_path / f"e{layer}.html"
    code, stdout, err = run_cli(capsys, "explain", TEXT, "-m", model_dir, "--layer", str(layer), "--json", out,
                                "--html", page)
    assert code == 0, err
    return stdout, json.loads(out.read_text(encoding="utf-8"))["events"], page


def section(events: list[dict], name: str) -> dict:
    return next(e for e in events if e["event"] == "explain" and e.get("section") == name)


def assert_terminal_says_the_steps(stdout: str, steps: dict) -> None:
    """Each declared step is one line of the terminal: its point, its operation, its formula and its check."""
    from llmtrace.render.generate import fmt_num

    lines = stdout.splitlines()
    for r in steps["steps"]:
        row = [ln for ln in lines if re.match(rf"\s*{re.escape(r['point'])}\s+{re.escape(r['op'])}\s+"
                                              rf"{re.escape(r['formula'])}", ln)]
        assert len(row) == 1, (r["point"], r["op"], r["formula"])
        if r["check"] is not None:
            assert ("✓ " if r["check"]["ok"] else "✗ ") + fmt_num(r["check"]["max_abs"]) in row[0], row[0]
    plan = steps["plan"]
    assert f"attention {plan['attention_words']}; RoPE {plan['rope_words']}" in stdout


PAGE_STEPS = """() => Array.from(document.querySelectorAll("tr[data-point][data-op]")).map((tr) => {
  const e = tr.matches("[data-max-error]") ? tr : tr.querySelector("[data-max-error]");
  return {point: tr.dataset.point, op: tr.dataset.op, text: tr.innerText.replace(/\\s+/g, " "),
          err: e ? e.dataset.maxError : null};
})"""


def page_problems(browser, page, steps: dict) -> list[str]:
    """Where the explain page's steps table differs from explain's `steps` section (its JSON)."""
    o = Opened(browser, page)
    try:
        rows = o.page.evaluate(PAGE_STEPS)
        text = re.sub(r"\s+", " ", o.page.inner_text("body"))
        errors = [m for m in o.messages if m[0] in ("error", "pageerror")]
    finally:
        o.page.close()
    out = [f"page error: {m}" for m in errors]
    by_point = {}
    for r in rows:
        by_point.setdefault(r["point"], []).append(r)
    for s in steps["steps"]:
        got = by_point.get(s["point"], [])
        if len(got) != 1:
            out.append(f"{s['point']}: {len(got)} rows tr[data-point][data-op] on the explain page, 1 expected")
            continue
        r = got[0]
        if r["op"] != s["op"]:
            out.append(f"{s['point']}: data-op {r['op']!r} on the page, {s['op']!r} in explain --json")
        if re.sub(r"\s+", " ", s["formula"]) not in r["text"]:
            out.append(f"{s['point']}: the page's row {r['text']!r} lacks the formula {s['formula']!r}")
        c = s["check"]
        if c is None:
            continue
        if r["err"] is None:
            out.append(f"{s['point']}: no data-max-error on the page (explain --json checks it: {c['max_abs']})")
        elif not math.isclose(float(r["err"]), c["max_abs"], rel_tol=1e-2, abs_tol=1e-12):
            out.append(f"{s['point']}: data-max-error {r['err']} on the page, {c['max_abs']} in explain --json")
    for words in (steps["plan"]["rope_words"], steps["plan"]["attention_words"]):
        if words not in text:
            out.append(f"the page never says this layer's {words!r}")
    return out


@pytest.mark.parametrize("layer, attention, base", [(0, "window", 10_000.0), (5, "global", 1_000_000.0)])
def test_explain_names_gemma3s_own_window_and_rope_base(families, capsys, monkeypatch, tmp_path, layer, attention,
                                                        base):
    """The terminal and --json: this layer's window (or none), its RoPE base, GeGLU, (1 + w) norms, checks."""
    stdout, events, _ = explained(capsys, monkeypatch, tmp_path, families.hf_dir("gemma3"), layer)
    steps = section(events, "steps")
    ops = {r["point"]: r for r in steps["steps"]}
    assert steps["plan"]["attention"] == attention and steps["plan"]["rope"]["base"] == base
    assert steps["plan"]["window"] == (4 if attention == "window" else None)
    # the declared operations, with this layer's constants
    assert ops["q_rope"]["op"] == "rope" and f"{base:,.0f}^" in ops["q_rope"]["formula"]
    assert ops["q_rope"]["inputs"] == ["q_norm"] and ops["attn_norm"]["inputs"] == ["resid_pre"]
    assert ("keys 4 or more back" in ops["scores"]["formula"]) == (attention == "window")
    assert ops["act"]["op"] == "glu" and "GeGLU" in ops["act"]["formula"]
    assert ops["attn_norm"]["op"] == "rmsnorm" and "1 + w" in ops["attn_norm"]["formula"]
    assert (layer == 0) == ("= embed_scaled" in ops["resid_pre"]["formula"])  # layer 0's input: the embedding × √D
    assert all(r["check"] is not None and r["check"]["ok"] for r in steps["steps"] if r["op"] in CHECKING), steps
    rope = section(events, "rope")
    assert rope["rotation"] == "rope" and rope["theta"] == base and rope["pairs"]
    # the terminal says the same steps
    assert_terminal_says_the_steps(stdout, steps)
    assert f"RoPE on q and k: base θ = {base:,.0f}" in stdout


def test_explain_of_a_layer_without_rope_says_no_rotation(norope_dir, norope, capsys, monkeypatch, tmp_path):
    """The terminal and --json of layer 1 (no RoPE): q_rope is `rope` with no rotation, checked equal to q; no base,
    no angle table, no distance check."""
    path, _ = norope_dir
    stdout, events, _ = explained(capsys, monkeypatch, tmp_path, path, 1)
    head = section(events, "model")
    assert head["model"]["family"] == "norope_test"
    assert any("no RoPE in layers 1, 3" in c for c in head["model"]["changes"])
    assert [p["rope"] is None for p in [k["plan"] for k in head["maths"]["kinds"]]] == [False, True]
    steps = section(events, "steps")
    assert steps["plan"]["rope"] is None and steps["plan"]["rope_words"] == "no rotation in this layer"
    ops = {r["point"]: r for r in steps["steps"]}
    for name, source in (("q_rope", "q"), ("k_rope", "k")):
        r = ops[name]
        assert r["op"] == "rope" and r["inputs"] == [source] and "no rotation" in r["formula"], r
        assert r["check"] is not None and r["check"]["ok"] and r["check"]["max_abs"] == 0, r  # q_rope is q, exactly
    assert all(r["check"] is not None and r["check"]["ok"] for r in steps["steps"] if r["op"] in CHECKING), steps
    rope = section(events, "rope")
    assert rope["rotation"] == "none" and "pairs" not in rope and "theta" not in rope and "relative" not in rope
    assert "no rotation" in rope["formula"] and rope["check_q_rope_max_abs_diff"] == 0
    # the terminal: the same steps, no angle table, no distance check, no base
    assert_terminal_says_the_steps(stdout, steps)
    assert "RoPE on q and k: no rotation in this layer" in stdout
    for rotating in ("θ_i rad/pos", "relative distance", "RoPE on q and k: base θ"):
        assert rotating not in stdout


@pytest.mark.parametrize("model, layer", [("gemma3", 0), ("gemma3", 5), ("norope", 1)],
                         ids=["gemma3-window", "gemma3-global", "norope"])
def test_the_explain_page_shows_the_steps_explain_prints(request, capsys, monkeypatch, tmp_path, browser, model,
                                                         layer):
    """`explain --html`: one row `tr[data-point][data-op]` per declared step, with the operation, formula and check
    (`data-max-error`) of `explain --json`, and the layer's attention and RoPE in words; no angle table for a layer
    without RoPE."""
    if model == "norope":
        request.getfixturevalue("norope")
        path = request.getfixturevalue("norope_dir")[0]
    else:
        path = request.getfixturevalue("families").hf_dir(model)
    stdout, events, page = explained(capsys, monkeypatch, tmp_path, path, layer)
    steps = section(events, "steps")
    problems = page_problems(browser, page, steps)
    if steps["plan"]["rope"] is None:
        o = Opened(browser, page)
        try:
            text = o.page.inner_text("body")
        finally:
            o.page.close()
        problems += [f"the explain page shows {w!r} for a layer without RoPE"
                     for w in ("θ_i rad/pos", "RoPE on q and k: base θ") if w in text]
    assert not problems, "\n".join(problems)


def test_explain_of_a_rotating_layer_of_the_same_model_has_its_angle_table(norope_dir, norope, capsys, monkeypatch,
                                                                           tmp_path):
    """The contrast: layer 0 of the same checkpoint rotates, and explain says so with its base and angles."""
    path, _ = norope_dir
    stdout, events, _ = explained(capsys, monkeypatch, tmp_path, path, 0)
    rope = section(events, "rope")
    assert rope["rotation"] == "rope" and rope["theta"] == 10_000.0 and rope["pairs"]
    assert rope["relative"]["max_deviation"] <= 1e-4
    q_rope = next(r for r in section(events, "steps")["steps"] if r["point"] == "q_rope")
    assert "no rotation" not in q_rope["formula"] and q_rope["check"]["ok"], q_rope
    assert "θ_i rad/pos" in stdout


def test_the_cards_of_a_layer_without_rope_check_that_it_rotates_nothing(norope_dir, norope, browser, tmp_path):
    """The report of the test-only family (layers 0 and 3 recorded; layer 3 has no RoPE): the card contract holds,
    and layer 3's q_rope and k_rope cards are `rope` cards, checked, with no error at all (the output is the input)."""
    import llmtrace

    model = llmtrace.load(str(norope_dir[0]), threads=1)
    run = model.generate(TEXT, max_new_tokens=2, trace="full", layers="0,-1", for_report=True, ignore_eos=True)
    path = run.report(tmp_path / "norope.html")
    lm = model.loaded
    assert lm.maths.plan[3].rope is None and lm.maths.plan[0].rope is not None
    o = Opened(browser, path)
    try:
        n = len(next(e for e in run.events if e["event"] == "tokens")["tokens"])
        cards = o.page.evaluate(COLLECT, [n - 1, 3, [0]])["heads"]["0"]["cards"]
        rope = [c for c in cards if c["point"] in ("q_rope", "k_rope")]
        assert len(rope) == 2 and all(c["op"] == "rope" and c["err"] is not None and float(c["err"]) == 0
                                      for c in rope), rope
        cards = o.page.evaluate(COLLECT, [n - 1, 0, [0]])["heads"]["0"]["cards"]
        assert any(c["point"] == "q_rope" and within(c["err"], c["rel"]) for c in cards)  # layer 0 rotates, checked
    finally:
        o.page.close()
    assert_cards_hold(card_problems(lm, run.events, path, browser))


# ----------------------------------------------------------------------------------------------------------------
# 3. the layer without RoPE is what the model runs


@pytest.fixture
def norope_lm(norope_dir, norope):
    from llmtrace.checkpoint.load import load_model

    return load_model(str(norope_dir[0]), device="cpu", dtype="float32")


IDS = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111]


def test_a_layer_without_rope_matches_transformers_smollm3(norope_dir, norope_lm):
    """transformers' SmolLM3 skips RoPE in layers 1 and 3: llmtrace's logits agree within 1e-4, greedy identical."""
    assert [p.rope is None for p in norope_lm.maths.plan] == [False, True, False, True]
    check_run(norope_lm, norope_dir[1], IDS)


def test_rope_in_every_layer_gives_other_logits(norope_lm):
    """The same weights in Llama's model (RoPE in every layer): the logits move, so the parity above would fail if
    the no-RoPE layers rotated."""
    from llmtrace.model.transformer import Transformer

    rotating = Transformer(norope_lm.config).eval()
    rotating.load_state_dict(norope_lm.model.state_dict())
    assert all(p.rope is not None for p in rotating.maths().plan)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        ours, everywhere = norope_lm.model(ids)[0], rotating(ids)[0]
    assert float((ours - everywhere).abs().max()) > 1e-2
    assert torch.equal(ours[0], everywhere[0])  # the first position: no other key, so RoPE cannot matter there


def chain_layer(model, maths, layer: int, seen: dict, ids: torch.Tensor, rope_op=None) -> dict:
    """Every point of `layer` computed in float64 from its input alone (the layer's resid_pre as the pass had it),
    each declared operation applied to the values the chain made before (model.recompute). `rope_op` replaces
    q_rope's and k_rope's operation (a rotating one), to show what the chain would give."""
    from llmtrace.model.recompute import apply

    made: dict = {}
    positions = torch.arange(ids.size(1))
    for name, o in maths.layers[layer].items():
        if o.kind == "cache_write":
            continue
        if name in ("q_rope", "k_rope") and rope_op is not None:
            o = type(o)(o.kind, o.inputs, o.weights, rope_op.consts)
        if o.kind == "stream":
            made[name] = seen[(layer, name)].double()
            continue
        args = [made[ref] for ref in o.inputs]
        weights = [model.get_parameter(f"layers.{layer}.{w}") for w in o.weights]
        shape = tuple(seen[(layer, name)].shape)
        if name == "k_repeated":  # recorded as the (B, Hkv, G, S, Dh) view; made as the (B, H, S, Dh) it stands for
            shape = (shape[0], model.config.n_heads, *shape[-2:])
        made[name] = apply(o, args, weights, shape, positions=positions)
    return made


def test_the_layer_without_rope_is_its_declared_maths_in_float64(norope_lm):
    """Layer 1, computed in float64 from its resid_pre through its declared operations alone, gives the model's
    resid_post within 1e-4 relative; with layer 0's rotating RoPE in place of its own it does not."""
    from llmtrace.model.capture import capture
    from llmtrace.model.recompute import max_error

    model, maths = norope_lm.model, norope_lm.maths
    ids = torch.tensor([IDS])
    with torch.no_grad(), capture(model, spell_out=True) as seen:
        model(ids)
    assert torch.equal(seen[(1, "q_rope")], seen[(1, "q")]) and torch.equal(seen[(1, "k_rope")], seen[(1, "k")])
    assert not torch.allclose(seen[(0, "q_rope")], seen[(0, "q")])  # layer 0 does rotate
    made = chain_layer(model, maths, 1, seen, ids)
    for name in ("q_rope", "scores", "probs", "attn_out", "resid_mid", "resid_post"):
        absolute, relative = max_error(made[name], seen[(1, name)])
        assert absolute <= ABS or relative <= REL, (name, absolute, relative)
    rotated = chain_layer(model, maths, 1, seen, ids, rope_op=maths.op(0, "q_rope"))
    assert max_error(rotated["resid_post"], seen[(1, "resid_post")])[1] > 1e-3


def test_the_page_computes_no_maths_of_its_own():
    """Every worked value comes from the one evaluator (trace/cards.py): the cards' script has no maths at all, and
    the walk-through's only exp is the live what-if sampler's (re-sampling a step at another temperature)."""
    from pathlib import Path

    import llmtrace.report

    assets = Path(llmtrace.report.__file__).parent / "assets"
    maths = re.compile(r"Math\.(exp|log|log1p|tanh|sqrt|pow|expm1)\b")
    assert not maths.findall((assets / "cards.js").read_text())
    walk = (assets / "walk.js").read_text()
    found = [walk[:m.start()].count("\n") + 1 for m in maths.finditer(walk)]
    start = walk.index("function whatif(")  # the sampler's function, and its end: the next top-level line of the IIFE
    end = walk.index("\n  }\n", start)
    lines = range(walk[:start].count("\n") + 1, walk[:end].count("\n") + 2)
    assert found and all(line in lines for line in found), (found, lines)
