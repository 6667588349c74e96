// llmtrace serve: the live page. It sends the form to the server's API (POST /api/generate, with the token of the
// URL it was opened with as a bearer token), shows each token as its step event arrives, then opens the run's
// learner's page (GET /api/page?run=ID: the report, the same page a file holds) in a sandboxed frame.
"use strict";
(function () {
  const W = JSON.parse(document.getElementById("words").textContent);
  const $ = (sel) => document.querySelector(sel);
  function t(key, vals) {
    let s = W[key] || key;
    Object.keys(vals || {}).forEach((k) => { s = s.split("{" + k + "}").join(String(vals[k])); });
    return s;
  }
  function vis(x) { return (x || "").replace(/ /g, "\u2581").replace(/\n/g, "\\n") || "\u2205"; }
  const TOKEN = new URLSearchParams(location.search).get("token") || "";
  history.replaceState(null, "", location.pathname); // the token stays in this page's memory, not in its address
  let controller = null, last = null; // the run in flight; the last finished run {tokens, options}

  function options(extra) {
    const num = (id) => Number($("#" + id).value);
    const o = { prompt: $("#prompt").value, model: $("#model").value, max_new_tokens: num("max_new_tokens"),
      temperature: num("temperature"), top_k: num("top_k"), top_p: num("top_p"), min_p: num("min_p"),
      seed: num("seed"), chat: $("#chat").checked, trace: $("#trace").value, ignore_eos: true };
    if ($("#layers").value.trim()) o.layers = $("#layers").value.trim();
    return Object.assign(o, extra || {});
  }
  function chip(text, cls) {
    const b = document.createElement("span");
    b.className = "chip" + (cls ? " " + cls : "");
    const p = document.createElement("span"); p.className = "piece"; p.textContent = vis(text);
    b.appendChild(p);
    $("#tokens").appendChild(b);
  }
  async function run(body) { // one run, streamed; resolves to {tokens, text, runId} or null
    if (controller) controller.abort();
    controller = new AbortController();
    $("#stop").disabled = false;
    $("#tokens").textContent = ""; $("#text").textContent = ""; $("#status").textContent = t("serve_running");
    const got = { tokens: [], text: "", runId: null, error: null };
    try {
      const r = await fetch("/api/generate", { method: "POST", signal: controller.signal,
        headers: { "Authorization": "Bearer " + TOKEN, "Content-Type": "application/json" }, body: JSON.stringify(body) });
      if (!r.ok) { const e = await r.json(); $("#status").textContent = t("serve_error", { error: e.error }); return null; }
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let nl;
        while ((nl = buf.indexOf("\n")) >= 0) { onEvent(JSON.parse(buf.slice(0, nl)), got); buf = buf.slice(nl + 1); }
      }
    } catch (e) {
      if (e.name === "AbortError") { $("#status").textContent = t("serve_stopped"); return null; }
      $("#status").textContent = t("serve_error", { error: String(e) }); return null;
    } finally { $("#stop").disabled = true; controller = null; }
    if (got.error) return null;
    await showPage(got.runId);
    return got;
  }
  function onEvent(ev, got) {
    if (ev.event === "queue") $("#status").textContent = t("serve_queue", { n: ev.position });
    else if (ev.event === "run_id") { got.runId = ev.id; $("#status").textContent = t("serve_running"); }
    else if (ev.event === "tokens") ev.tokens.forEach((x) => chip(x.text, ""));
    else if (ev.event === "step") { got.tokens.push(ev.token.id); chip(ev.token.text, "gen"); $("#text").textContent += ev.token.text; }
    else if (ev.event === "summary") {
      got.text = ev.text;
      $("#status").textContent = t("serve_done", { n: ev.generated_tokens, reason: ev.stop_reason });
    } else if (ev.event === "error") { got.error = ev.error; $("#status").textContent = t("serve_error", { error: ev.error }); }
  }
  async function showPage(runId) {
    if (!runId) return;
    const r = await fetch("/api/page?run=" + encodeURIComponent(runId) + "&lang=" + $("#lang").value,
      { headers: { "Authorization": "Bearer " + TOKEN } });
    if (r.ok) $("#page").srcdoc = await r.text();
  }
  function compare(before, after, layer, head) { // the ablated run against the run before, token by token
    const box = $("#compare");
    box.textContent = "";
    const p = document.createElement("p");
    const n = Math.max(before.tokens.length, after.tokens.length);
    let first = -1;
    for (let i = 0; i < n && first < 0; i++) if (before.tokens[i] !== after.tokens[i]) first = i;
    p.textContent = (layer === null ? t("serve_compare_resample") : t("serve_compare", { layer: layer, head: head })) + " " +
      (first < 0 ? t("serve_same") : t("serve_first_diff", { step: first }));
    box.appendChild(p);
    const table = document.createElement("table"); table.id = "diff";
    [[t("serve_before"), before.text], [layer === null ? t("serve_resampled") : t("serve_after"), after.text]].forEach(([k, v]) => {
      const tr = document.createElement("tr"), th = document.createElement("th"), td = document.createElement("td");
      th.textContent = k; td.textContent = vis(v); if (first >= 0 && k !== t("serve_before")) td.className = "changed";
      tr.appendChild(th); tr.appendChild(td); table.appendChild(tr);
    });
    box.appendChild(table);
  }
  $("#run-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("#compare").textContent = "";
    const o = options();
    const got = await run(o);
    if (got) last = { got: got, options: o };
  });
  $("#more").addEventListener("click", async () => { // the same run, one token longer (the same seed: the same tokens)
    $("#max_new_tokens").value = String(Number($("#max_new_tokens").value) + 1);
    $("#run-form").requestSubmit();
  });
  $("#ablate").addEventListener("click", async () => {
    const before = last;
    const layer = Number($("#ablate_layer").value), head = Number($("#ablate_head").value);
    const got = await run(options({ ablate: [layer + ".h" + head] }));
    if (got && before) compare(before.got, got, layer, head);
  });
  $("#stop").addEventListener("click", () => { if (controller) controller.abort(); });
  window.addEventListener("message", (e) => { // the run's page says which head its heatmap shows: the one to ablate
    if (e.source !== $("#page").contentWindow || !e.data) return;
    if (e.data.llmtrace === "head") { $("#ablate_layer").value = String(e.data.layer); $("#ablate_head").value = String(e.data.head); }
    if (e.data.llmtrace === "sampler") { // the what-if sliders: the settings a re-sample runs with
      ["temperature", "top_k", "top_p", "min_p"].forEach((k) => { if (Number.isFinite(e.data[k])) $("#" + k).value = String(e.data[k]); });
    }
  });
  $("#resample").addEventListener("click", async () => { // the real sampler, on the server, with these settings
    const before = last;
    const o = options();
    const got = await run(o);
    if (got && before) compare(before.got, got, null, null);
    if (got) last = { got: got, options: o };
  });
})();
