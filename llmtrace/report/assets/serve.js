// llmtrace serve: the live page. It sends the form to the server's API (POST /api/generate, with the token of the
// URL it was opened with as a bearer token) and shows each step as its event arrives: the token, the most likely
// candidates and the sampler's ledger. Then it opens the run's learner's page (GET /api/page?run=ID: the report, the
// same page a file holds) in a sandboxed frame. Re-sample asks the server to run the sampler again on one step's
// logits (POST /api/resample); a click on a head of the frame's heatmap ablates it, runs again and compares the two
// runs layer by layer (POST /api/compare).
"use strict";
(function () {
  const WORDS = JSON.parse(document.getElementById("words").textContent);
  let W = WORDS.all[WORDS.lang];
  const $ = (sel) => document.querySelector(sel);
  function t(key, vals) {
    let s = W["js." + key] || key;
    Object.keys(vals || {}).forEach((k) => { s = s.split("{" + k + "}").join(String(vals[k])); });
    return s;
  }
  function vis(x) { return (x || "").replace(/ /g, "\u2581").replace(/\n/g, "\\n") || "\u2205"; }
  function fmt(x, d) { return x === null || x === undefined ? "\u2014" : Number(x).toPrecision(d || 3); }
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  const TOKEN = new URLSearchParams(location.search).get("token") || "";
  history.replaceState(null, "", location.pathname); // the token stays in this page's memory, not in its address
  const AUTH = { "Authorization": "Bearer " + TOKEN, "Content-Type": "application/json" };
  let controller = null, last = null; // the request in flight; the last finished run {got, options}

  function options(extra) {
    const num = (id) => Number($("#" + id).value);
    const o = { prompt: $("#prompt").value, model: $("#model").value, max_new_tokens: num("max_new_tokens"),
      temperature: num("temperature"), top_k: num("top_k"), top_p: num("top_p"), min_p: num("min_p"),
      seed: num("seed"), chat: $("#chat").checked, trace: $("#trace").value, ignore_eos: true };
    if ($("#layers").value.trim()) o.layers = $("#layers").value.trim();
    return Object.assign(o, extra || {});
  }
  function chip(box, text, cls) {
    const b = el("span", undefined, "chip" + (cls ? " " + cls : ""));
    b.appendChild(el("span", vis(text), "piece"));
    box.appendChild(b);
  }
  function ledger(ev) { // "input 49152 → top_k 40 → top_p 7; p 0.41": the candidates each stage left
    if (!ev.sampler) return "";
    const pick = ev.sampler[ev.sampler.length - 1].pick_prob;
    const stages = ev.sampler.map((s) => s.stage + " " + s.survivors.toLocaleString("en"));
    return stages.join(" \u2192 ") + "; p " + fmt(pick);
  }
  function draw(ev) { return !ev.rng ? "" : ev.rng.greedy ? t("serve_greedy") : fmt(ev.rng.draw, 6); }
  function stepRow(ev) { // a row of the live step table, as the step's event arrives
    const tr = document.createElement("tr");
    tr.dataset.step = String(ev.step);
    const top = (ev.topk || []).slice(0, 5).map((c) => vis(c.text) + " " + fmt(c.prob, 2)).join("  ");
    [String(ev.step), vis(ev.token.text), top, ledger(ev), draw(ev)].forEach((x, i) => {
      tr.appendChild(el("td", x, i === 1 || i === 2 ? "tok" : ""));
    });
    $("#live-steps tbody").appendChild(tr);
    $("#live-steps").hidden = false;
  }

  async function lines(path, body, onLine) { // POST, then each NDJSON line as it arrives; null when refused
    const r = await fetch(path, { method: "POST", signal: controller.signal, headers: AUTH,
      body: JSON.stringify(body) });
    if (!r.ok) {
      const e = await r.json();
      $("#status").textContent = t("serve_error", { error: e.error });
      return null;
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) { onLine(JSON.parse(buf.slice(0, nl))); buf = buf.slice(nl + 1); }
    }
    return true;
  }
  async function guarded(work) { // one request at a time: a new one stops the one in flight
    if (controller) controller.abort();
    const mine = controller = new AbortController();
    $("#stop").disabled = false;
    try { return await work(); } catch (e) {
      $("#status").textContent = e.name === "AbortError" ? t("serve_stopped") : t("serve_error", { error: String(e) });
      return null;
    } finally { if (controller === mine) { $("#stop").disabled = true; controller = null; } }
  }
  // one generate run, streamed into `view` ({tokens, text, steps}: the elements it fills; page: open its page)
  async function generate(body, view) {
    view.tokens.textContent = ""; view.text.textContent = "";
    if (view.steps) { $("#live-steps tbody").textContent = ""; $("#live-steps").hidden = true; }
    $("#status").textContent = t("serve_running");
    const got = { tokens: [], text: "", runId: null, error: null, steps: {} };
    const ok = await lines("/api/generate", body, (ev) => {
      if (ev.event === "queue") $("#status").textContent = t("serve_queue", { n: ev.position });
      else if (ev.event === "run_id") got.runId = ev.id;
      else if (ev.event === "tokens") ev.tokens.forEach((x) => chip(view.tokens, x.text, ""));
      else if (ev.event === "step") {
        got.tokens.push(ev.token.id); got.steps[ev.step] = ev;
        chip(view.tokens, ev.token.text, "gen"); view.text.textContent += ev.token.text;
        if (view.steps) stepRow(ev);
      } else if (ev.event === "summary") {
        got.text = ev.text;
        $("#status").textContent = t("serve_done", { n: ev.generated_tokens, reason: ev.stop_reason });
      } else if (ev.event === "error") {
        got.error = ev.error;
        $("#status").textContent = t("serve_error", { error: ev.error });
      }
    });
    if (!ok || got.error) return null;
    if (view.page) await showPage("#page", got.runId);
    return got;
  }
  async function showPage(frame, runId) {
    if (!runId) return;
    const r = await fetch("/api/page?run=" + encodeURIComponent(runId) + "&lang=" + $("#lang").value,
      { headers: { "Authorization": "Bearer " + TOKEN }, signal: controller ? controller.signal : undefined });
    if (r.ok) {
      $(frame).srcdoc = await r.text(); $(frame).hidden = false;
      if (frame === "#page") $("#page-note").hidden = true;  // the page is here: the line that promised it goes
    }
  }
  function speak(lang) { // the page's own words in the chosen language (the report in its frame follows on the next run)
    if (!WORDS.all[lang]) return;
    W = WORDS.all[lang];
    document.documentElement.lang = lang === "zh" ? "zh-Hans" : lang;
    document.querySelectorAll("[data-w]").forEach((e) => { if (W[e.dataset.w]) e.textContent = W[e.dataset.w]; });
    document.querySelectorAll("[data-w-title]").forEach((e) => { if (W[e.dataset.wTitle]) e.title = W[e.dataset.wTitle]; });
    SLIDERS.forEach(showSlider); // "0 (greedy)", "off" in the new language
  }
  $("#lang").addEventListener("change", () => {
    speak($("#lang").value);
    if (last && last.got && last.got.runId) guarded(() => showPage("#page", last.got.runId)); // the report too
  });
  const MAIN = { tokens: $("#tokens"), text: $("#text"), steps: true, page: true };

  $("#run-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("#compare").textContent = ""; $("#resample").textContent = ""; $("#compare-page").hidden = true;
    const o = options();
    const got = await guarded(() => generate(o, MAIN));
    if (got) last = { got: got, options: o };
  });
  $("#more").addEventListener("click", () => { // the same run, one token longer (the same seed: the same tokens)
    $("#max_new_tokens").value = String(Number($("#max_new_tokens").value) + 1);
    $("#run-form").requestSubmit();
  });
  $("#stop").addEventListener("click", () => { if (controller) controller.abort(); });

  // ---------------------------------------------------------------------------------------------- re-sample a step
  function side(title, ev, cls, survivors) { // one step's ledger: the chosen token, the draw, each stage
    const box = el("div", undefined, "side " + cls);
    box.appendChild(el("h3", title));
    box.appendChild(el("p", t("serve_chosen", { token: vis(ev.token.text), id: ev.token.id }), "tok"));
    box.appendChild(el("p", ev.rng && !ev.rng.greedy ? t("serve_u", { u: fmt(ev.rng.draw, 6) }) : t("serve_greedy")));
    const table = el("table", undefined, "stats");
    const head = document.createElement("tr");
    [t("serve_stage"), t("serve_survivors"), t("serve_pick")].forEach((x) => head.appendChild(el("th", x)));
    table.appendChild(head);
    (ev.sampler || []).forEach((s) => {
      const tr = document.createElement("tr");
      tr.appendChild(el("th", s.stage));
      tr.appendChild(el("td", s.survivors.toLocaleString("en"), "num"));
      tr.appendChild(el("td", fmt(s.pick_prob, 4), "num"));
      table.appendChild(tr);
    });
    box.appendChild(table);
    if (survivors) { // the distribution after the last stage, as bars (redrawn at each move of a slider)
      box.appendChild(el("p", t("serve_left")));
      const dist = el("ol", undefined, "dist");
      survivors.forEach((c) => {
        const li = el("li");
        li.dataset.id = String(c.id);
        li.appendChild(el("span", vis(c.text), "tok"));
        li.appendChild(el("span", fmt(c.prob, 3), "num"));
        const bar = el("span", undefined, "bar");
        bar.style.width = (160 * c.prob).toFixed(1) + "px";
        li.appendChild(bar);
        dist.appendChild(li);
      });
      box.appendChild(dist);
    }
    return box;
  }
  // ---------------------------------------------------------------------------------------------- the sliders
  // temperature, top-k, top-p and min-p as sliders, each with its number beside it (and said to a screen reader: 0 is
  // greedy, a truncation that cuts nothing is off); once a run is done, moving one re-samples the chosen step on the
  // server at once (one request at a time, the latest settings next), the distribution redrawn
  const SLIDERS = ["temperature", "top_k", "top_p", "min_p"];
  function said(id, v) {
    if (id === "temperature" && v === 0) return t("greedy");
    if ((id === "top_k" && v === 0) || (id === "top_p" && v === 1) || (id === "min_p" && v === 0)) return t("off");
    return String(v);
  }
  function showSlider(id) {
    const inp = $("#" + id), text = said(id, Number(inp.value));
    $("#" + id + "-out").textContent = text;
    inp.setAttribute("aria-valuetext", text);
  }
  let live = null, again = false, waiting = false; // the live re-sample in flight; moved since; waiting for a run
  async function resampleStep() {
    const box = $("#resample");
    if (!last) { box.textContent = t("serve_no_run"); return; }
    const step = Number($("#step").value), o = options();
    const body = { run: last.got.runId, step: step, temperature: o.temperature, top_k: o.top_k, top_p: o.top_p,
      min_p: o.min_p };
    const r = await fetch("/api/resample", { method: "POST", signal: (live || controller).signal, headers: AUTH,
      body: JSON.stringify(body) });
    const a = await r.json();
    if (!r.ok) { box.textContent = t("serve_error", { error: a.error }); return; }
    box.textContent = "";
    box.dataset.temperature = String(body.temperature); box.dataset.topK = String(body.top_k); box.dataset.topP = String(body.top_p);
    box.appendChild(el("p", t("serve_resample_title", { step: step, t: body.temperature === 0 ? t("greedy") : body.temperature,
      k: body.top_k === 0 ? t("off") : body.top_k, p: body.top_p === 1 ? t("off") : body.top_p,
      m: body.min_p === 0 ? t("off") : body.min_p, draw: a.draw === "fresh" ? t("serve_draw_fresh") : t("serve_draw_run") })));
    if (last.got.steps[step]) box.appendChild(side(t("serve_own"), last.got.steps[step], "own", null));
    box.appendChild(side(t("serve_again"), a.step, "again", a.survivors));
  }
  async function liveResample() {
    if (!last) return; // before a run: the sliders only set what it will use
    if (controller) { // a run (or its page) still on its way: re-sample once it is done
      if (!waiting) { waiting = true; setTimeout(() => { waiting = false; liveResample(); }, 250); }
      return;
    }
    if (live) { again = true; return; }
    live = new AbortController();
    try { await resampleStep(); } catch (e) { $("#resample").textContent = t("serve_error", { error: String(e) }); }
    live = null;
    if (again) { again = false; liveResample(); }
  }
  SLIDERS.forEach((id) => {
    showSlider(id);
    $("#" + id).addEventListener("input", () => { showSlider(id); liveResample(); });
  });
  $("#resample-step").addEventListener("click", () => guarded(resampleStep));

  // ---------------------------------------------------------------------------------------------- ablate and compare
  function textDiff(before, after, what) { // the ablated run against the run before, token by token
    const box = $("#compare");
    box.textContent = "";
    const n = Math.max(before.tokens.length, after.tokens.length);
    let first = -1;
    for (let i = 0; i < n && first < 0; i++) if (before.tokens[i] !== after.tokens[i]) first = i;
    const where = first < 0 ? t("serve_same") : t("serve_first_diff", { step: first });
    box.appendChild(el("p", t("serve_compare", { what: what }) + " " + where));
    const table = el("table"); table.id = "diff";
    const rows = [[t("serve_before"), before.text, ""], [t("serve_after"), after.text, first >= 0 ? "changed" : ""]];
    rows.forEach(([k, v, cls]) => {
      const tr = document.createElement("tr");
      tr.appendChild(el("th", k)); tr.appendChild(el("td", vis(v), cls));
      table.appendChild(tr);
    });
    box.appendChild(table);
  }
  function compareLine(doc) { // the comparison's answer in two sentences
    const fd = doc.first_divergence, n = doc.ids.length - doc.n_prompt;
    const where = fd ? t("serve_cmp_part", { n: n, layer: fd.layer === null ? "\u2014" : fd.layer, point: fd.point,
      step: fd.seed_step || "", pos: fd.position }) : t("serve_cmp_none", { tol: doc.tolerance });
    return where + " " + t("serve_cmp_answers", { kld: fmt(doc.kld_mean), kldmax: fmt(doc.kld_max),
      same: Math.round(100 * doc.same_top) });
  }
  async function ablate(spec, what) {
    const before = last;
    if (!before) { $("#compare").textContent = t("serve_no_run"); return; }
    await guarded(async () => {
      const view = { tokens: el("div", undefined, "chips"), text: el("p", undefined, "tok"), steps: false,
        page: false };
      $("#compare").textContent = "";
      $("#compare").appendChild(el("p", t("serve_ablating", { what: what })));
      $("#compare").appendChild(view.text); // the ablated run's text, as it comes
      const got = await generate(Object.assign({}, before.options, { ablate: [spec] }), view);
      if (!got) return;
      textDiff(before.got, got, what);
      const p = el("p", t("serve_comparing"), "cmp");
      $("#compare").appendChild(p);
      const events = [];
      let runId = null;
      const ok = await lines("/api/compare", { prompt: before.options.prompt, model: before.options.model,
        chat: before.options.chat, max_new_tokens: before.got.tokens.length, b_ablate: [spec] }, (ev) => {
        if (ev.event === "run_id") runId = ev.id;
        else if (ev.event === "error") p.textContent = t("serve_error", { error: ev.error });
        else if (ev.event === "compare") { events.push(ev); p.textContent = compareLine(ev); }
      });
      if (ok && events.length) await showPage("#compare-page", runId);
    });
  }
  function spec(part, layer, head) {
    if (part === "head") return [layer + ".h" + head, t("serve_what_head", { layer: layer, head: head })];
    return [layer + "." + part, t(part === "attn" ? "serve_what_attn" : "serve_what_ffn", { layer: layer })];
  }
  $("#ablate").addEventListener("click", () => {
    const [s, what] = spec($("#ablate_part").value, Number($("#ablate_layer").value), Number($("#ablate_head").value));
    ablate(s, what);
  });
  window.addEventListener("message", (e) => { // what the run's page tells: the head or layer picked, the step shown
    if (e.source !== $("#page").contentWindow || !e.data) return;
    const d = e.data;
    if (d.llmtrace === "head" || d.llmtrace === "layer") {
      $("#ablate_layer").value = String(d.layer);
      $("#ablate_part").value = d.llmtrace === "head" ? "head" : "attn";
      if (d.llmtrace === "head") $("#ablate_head").value = String(d.head);
      if (d.click) $("#ablate").click(); // a click with the pointer ablates at once
    }
    if (d.llmtrace === "step" && Number.isFinite(d.step)) $("#step").value = String(d.step);
    if (d.llmtrace === "sampler") { // the what-if sliders: the settings a re-sample runs with
      SLIDERS.forEach((k) => {
        if (Number.isFinite(d[k])) { $("#" + k).value = String(d[k]); showSlider(k); }
      });
    }
  });
})();
