// llmtrace report: the interactive parts. Plain JavaScript, no library, no network: the page stays one small file
// that any browser opens from disk. Everything drawn here comes from the JSON embedded in the page (#data).
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const PAL = window.PALETTE.map((h) => [1, 3, 5].map((k) => parseInt(h.slice(k, k + 2), 16)));
  const $ = (sel, root) => (root || document).querySelector(sel);
  const $$ = (sel, root) => Array.from((root || document).querySelectorAll(sel));

  function rgb(x) { // a value in [0, 1] on the palette, as [r, g, b]
    x = Math.min(1, Math.max(0, x)) * (PAL.length - 1);
    const i = Math.min(Math.floor(x), PAL.length - 2), f = x - i;
    return [0, 1, 2].map((k) => Math.round(PAL[i][k] * (1 - f) + PAL[i + 1][k] * f));
  }
  // a token's text as the terminal shows it (tokens/token_facts.py visible_text): ▁ a space, \n \t \r, \xNN a
  // control character, <U+00A0> any other invisible one; ∅ when empty
  function vis(t) {
    return (t || "").replace(/[\p{Zs}\p{Zl}\p{Zp}\p{Cf}\p{Cc}\p{Co}\p{Cn}]/gu, (c) => {
      const n = c.codePointAt(0);
      if (c === " ") return "\u2581";
      if (c === "\n") return "\\n";
      if (c === "\t") return "\\t";
      if (c === "\r") return "\\r";
      if (n < 0x20 || n === 0x7f) return "\\x" + n.toString(16).padStart(2, "0");
      return "<U+" + n.toString(16).toUpperCase().padStart(4, "0") + ">";
    }) || "\u2205";
  }
  function fmt(x, d) { return x === null || x === undefined ? "\u2014" : Number(x).toPrecision(d || 4); }
  function esc(s) { const t = document.createElement("span"); t.textContent = s; return t.innerHTML; }
  function tr(key, vals) { // a text of the page's language (catalogue "js." keys), {name} filled in
    let s = D.words[key] || key;
    Object.keys(vals || {}).forEach((k) => { s = s.split("{" + k + "}").join(String(vals[k])); });
    return s;
  }

  // ---------------------------------------------------------------------------------------------- the chosen step
  let cur = 0;
  const steps = D.steps;
  function setStep(i) {
    if (!steps.length) return;
    cur = Math.max(0, Math.min(steps.length - 1, i));
    const s = steps[cur];
    $$(".step-panel").forEach((p) => { p.hidden = Number(p.dataset.step) !== s.step; });
    const range = $("#step");
    if (range) range.value = String(cur);
    const label = $("#step-label");
    if (label) label.textContent = tr("step_label", { step: s.step, n: steps.length, phase: tr("phase_" + s.phase), token: vis(s.token.text) });
    $$(".chip.gen").forEach((c) => c.classList.toggle("current", Number(c.dataset.step) === s.step));
    const mk = $("#kv .marker");
    if (mk) {
      const x0 = Number(mk.dataset.x0), x1 = Number(mk.dataset.x1);
      const x = Number(mk.dataset.l) + Number(mk.dataset.w) * (x1 > x0 ? (s.step - x0) / (x1 - x0) : 0.5);
      mk.setAttribute("x1", x); mk.setAttribute("x2", x);
    }
    const now = $("#kv-now");
    if (now) now.textContent = tr("kv_now", { step: s.step, len: s.kv.seq_len, bytes: s.kv.bytes_used.toLocaleString("en"),
      mha: s.kv.mha_bytes_used.toLocaleString("en") });
    $$("#residual polyline, #residual circle").forEach((p) => p.classList.toggle("current", p.classList.contains("s" + s.step)));
    drawAttention();
    if (stage) showStage(stage);
    document.dispatchEvent(new CustomEvent("llmtrace:step", { detail: cur })); // walk.js: the what-if sampler
    if (window.parent !== window) window.parent.postMessage({ llmtrace: "step", step: s.step }, "*"); // serve: the step to re-sample
  }
  const range = $("#step");
  if (range) range.addEventListener("input", () => setStep(Number(range.value)));
  const prev = $("#step-prev"), next = $("#step-next");
  if (prev) prev.addEventListener("click", () => setStep(cur - 1));
  if (next) next.addEventListener("click", () => setStep(cur + 1));
  $$(".chip.gen").forEach((c) => c.addEventListener("click", () => {
    setStep(steps.findIndex((s) => s.step === Number(c.dataset.step)));
  }));
  document.addEventListener("keydown", (ev) => {
    const tag = (ev.target.tagName || "").toLowerCase();
    if (tag === "input" || tag === "select" || tag === "textarea" || ev.target.id === "att-canvas") return;
    if (ev.key === "[") { setStep(cur - 1); ev.preventDefault(); }
    if (ev.key === "]") { setStep(cur + 1); ev.preventDefault(); }
  });

  // ---------------------------------------------------------------------------------------------- the pipeline
  Object.keys(D.tensors.points).forEach((n) => { // stored a list per field (page.compact_stats): rows again
    const c = D.tensors.points[n], g = D.tensors.grids[c.grid]; // its steps and layers, its shapes: shared (page.py)
    D.tensors.points[n] = g.step.map((s, i) => ({ step: s, layer: g.layer[i], mean: c.mean[i], std: c.std[i], min: c.min[i],
      max: c.max[i], norm: c.norm[i], shape: D.tensors.shapes[c.shapes][String(s)] }));
  });
  let stage = null;
  function showStage(id) {
    stage = id;
    $$("button.stage").forEach((b) => b.setAttribute("aria-pressed", String(b.dataset.stage === id)));
    const st = D.pipeline.stages.find((x) => x.id === id);
    const panel = $("#stage-panel");
    const pts = D.tensors.points;
    const want = steps.length ? steps[cur].step : 0;
    const kept = D.tensors.steps;
    let at = kept.length ? kept.reduce((a, b) => (Math.abs(b - want) < Math.abs(a - want) ? b : a)) : null;
    let html = "<h3>" + esc(st.id + " " + (D.step_titles[st.id] || "")) + "</h3>";
    if (st.sampler) {
      html += "<p>" + esc(tr("stage_sampler", { order: st.sampler.join(" \u2192 ") || tr("none"),
        active: st.active.join(", ") || tr("none") })) + "</p>";
    }
    if (st.id === "s1" || st.id === "s2") {
      const n = D.tokens.filter((t) => t.step === null).length;
      html += "<p>" + esc(tr("stage_tokens", { n: n })) + "</p>";
    }
    const names = st.points.map((p) => p.name).filter((n) => pts[n]);
    if (!st.sampler && st.points.length && !names.length) {
      html += "<p class=\"missing\">" + esc(tr("stage_missing")) + " <code>" +
        (D.kind === "generate" ? "--trace full</code> " + esc(tr("stage_layers")) : esc(D.fill) + "</code>") + ".</p>";
    }
    if (names.length && at !== want && at !== null) html += "<p class=\"note\">" + esc(tr("stage_nearest", { step: at })) + "</p>";
    names.forEach((n) => {
      // a row of the statistics table (report/data.py _tensor_table): {step, layer, mean, std, min, max, norm, shape}
      const rows = pts[n].filter((r) => r.step === at);
      if (!rows.length) return;
      const nmax = Math.max(...rows.map((r) => Math.abs(r.norm || 0))) || 1;
      html += "<table class=\"stats\"><caption>" + esc(n) + " " + esc("[" + rows[0].shape.join(", ") + "]") +
        "</caption><tr>" + ["layer", "mean", "std", "min", "max", "norm"].map((k) => "<th>" + esc(tr("stats_" + k)) + "</th>").join("") + "<th></th></tr>";
      rows.forEach((r) => {
        html += "<tr><th scope=row>" + (r.layer === null ? "\u2014" : r.layer) + "</th>" +
          ["mean", "std", "min", "max", "norm"].map((k) => "<td class=num>" + fmt(r[k]) + "</td>").join("") +
          "<td><span class=\"nbar\" style=\"width:" + (100 * Math.abs(r.norm || 0) / nmax).toFixed(1) + "px\"></span></td></tr>";
      });
      html += "</table>";
    });
    panel.innerHTML = html;
  }
  $$("button.stage").forEach((b) => b.addEventListener("click", () => showStage(b.dataset.stage)));

  // ---------------------------------------------------------------------------------------------- s3 of a batch
  // one page holds every row (report/write.py with_rows): the other rows' pages ride along in #rows; this page is
  // kept as it was parsed, so that the switch can come back to it. Writing a row's page in place runs its scripts
  // again; the rows stay on the window, which document.open keeps.
  const rowsEl = document.getElementById("rows");
  if (rowsEl && D.batch) {
    window.llmtraceRows = JSON.parse(rowsEl.textContent);
    rowsEl.remove();
    window.llmtraceRows[String(D.batch.row)] = "<!DOCTYPE html>\n" + document.documentElement.outerHTML;
  }
  const rowSwitch = $("#batch-row");
  if (rowSwitch) rowSwitch.addEventListener("change", () => {
    const rows = window.llmtraceRows, html = rows && rows[rowSwitch.value];
    if (html) { document.open(); document.write(html); document.close(); return; }
    $$(".batch-row").forEach((r) => { r.hidden = r.dataset.row !== rowSwitch.value; });
    $$("#mask-grid tr[data-row]").forEach((r) => r.classList.toggle("chosen", r.dataset.row === rowSwitch.value));
  });

  // ---------------------------------------------------------------------------------------------- BPE merges
  $$("button.word").forEach((b) => b.addEventListener("click", () => {
    $$("button.word").forEach((x) => x.setAttribute("aria-pressed", String(x === b)));
    $$(".merge").forEach((m) => { m.hidden = m.dataset.word !== b.dataset.word; });
  }));

  // ---------------------------------------------------------------------------------------------- attention
  const A = D.attention; // A.bins: the [lo, hi) position range of each row (and column) of a map
  const maps = {};
  function mapOf(layer) { // (heads, B, B) fixed-point values of one layer, decoded once
    if (!maps[layer]) {
      const bin = atob(A.maps[layer]);
      const view = new DataView(new ArrayBuffer(bin.length));
      for (let i = 0; i < bin.length; i++) view.setUint8(i, bin.charCodeAt(i));
      const out = new Float64Array(bin.length / 2);
      for (let i = 0; i < out.length; i++) out[i] = view.getUint16(2 * i, true) / A.quant;
      maps[layer] = out;
    }
    return maps[layer];
  }
  const canvas = $("#att-canvas");
  let cursor = null; // [row, col] under the mouse or the keyboard
  const PAD = A.pad || 0; // a batch row's leading pad slots (s3): the maps are by slot, its token i is slot PAD + i
  function padBin(b) { return A.bins[b][1] <= PAD; }
  const R = D.maths && D.maths.record;
  function windowOf(layer) { // the window of keys a layer declares (its plan), or null
    const k = R && !Number.isNaN(Number(layer)) && R.kinds[R.layer_kind[Number(layer)]];
    return (k && k.plan && k.plan.window) || null;
  }
  function outsideWindow(layer, r, c) { // every key of bin c is the window or more back from every query of bin r
    const W = windowOf(layer);
    return !!W && A.bins[r][0] - (A.bins[c][1] - 1) >= W;
  }
  function masked(r, c, layer) { // never attended: a later key (the causal mask), a pad slot (the padding mask), or a
    // key outside the layer's window
    return A.bins[c][0] >= A.bins[r][1] || padBin(c) || padBin(r) || (layer !== undefined && outsideWindow(layer, r, c));
  }
  function queryRow() { // the bin of the query that produced the chosen step's token
    if (!steps.length || A.source !== "maps") return null;
    const q = steps[cur].position - 1 + PAD;
    return A.bins.findIndex((b) => b[0] <= q && q < b[1]);
  }
  function paint(target, layer, hi, scale, cell) { // one head's map on a canvas, cell × cell pixels per cell
    const B = A.bins.length, m = mapOf(layer), off = hi * B * B, size = cell * B;
    target.width = size; target.height = size;
    const ctx = target.getContext("2d");
    const img = ctx.createImageData(size, size);
    let drawn = 0;
    for (let r = 0; r < B; r++) {
      let ranks = null;
      if (scale === "rank") {
        const vis = [];
        for (let c = 0; c < B; c++) if (!masked(r, c, layer)) vis.push(c);
        vis.sort((a, b) => m[off + r * B + a] - m[off + r * B + b]);
        ranks = new Map(vis.map((c, k) => [c, vis.length > 1 ? k / (vis.length - 1) : 1]));
      }
      for (let c = 0; c < B; c++) {
        const hatch = masked(r, c, layer);
        const v = m[off + r * B + c];
        let col;
        if (!hatch) {
          let x = v;
          if (scale === "log") x = (Math.log10(Math.max(v, 1e-4)) + 4) / 4;
          if (scale === "rank") x = ranks.get(c);
          col = rgb(x);
        }
        for (let y = 0; y < cell; y++) for (let x = 0; x < cell; x++) {
          const p = ((r * cell + y) * size + c * cell + x) * 4;
          const c2 = hatch ? (((x + y) % 4 < 2) ? [214, 214, 214] : [246, 246, 246]) : col;
          img.data[p] = c2[0]; img.data[p + 1] = c2[1]; img.data[p + 2] = c2[2]; img.data[p + 3] = 255;
        }
        drawn++;
      }
    }
    ctx.putImageData(img, 0, 0);
    return drawn;
  }
  function drawAttention() {
    if (!canvas || !A.layers.length) return;
    const layer = $("#att-layer").value, hi = Number($("#att-head").value), scale = $("#att-scale").value;
    const B = A.bins.length, cell = Math.max(1, Math.floor(480 / B)), size = cell * B;
    const drawn = paint(canvas, layer, hi, scale, cell);
    const ctx = canvas.getContext("2d");
    const qr = queryRow();
    if (qr !== null && qr >= 0) { ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2; ctx.strokeRect(1, qr * cell, size - 2, cell); }
    if (cursor) { ctx.strokeStyle = "#000"; ctx.lineWidth = 1; ctx.strokeRect(cursor[1] * cell + 0.5, cursor[0] * cell + 0.5, cell - 1, cell - 1); }
    canvas.dataset.rows = String(B); canvas.dataset.cols = String(B); canvas.dataset.cells = String(drawn);
    canvas.dataset.layer = layer; canvas.dataset.head = String(A.heads[hi]);
    canvas.dataset.cell = String(cell);
    const ends = { log: [tr("log_lo"), "1"], linear: ["p = 0", "1"], rank: [tr("rank_lo"), tr("rank_hi")] }[scale];
    $("#att-lo").textContent = ends[0]; $("#att-hi").textContent = ends[1];
    const h = A.heads[hi];
    $$(".gqa .qh, .gqa .link").forEach((el) => el.classList.toggle("on", h !== "mean" && Number(el.dataset.head) === h));
    $$(".gqa .kvh").forEach((el) => el.classList.toggle("on", h !== "mean" && A.groups[Number(el.dataset.kv)].includes(h)));
    $$("button.thumb").forEach((b) => b.setAttribute("aria-pressed", String(b.dataset.layer === layer && Number(b.dataset.hi) === hi)));
    readout();
  }
  let thumbScale = null;
  function drawThumbs() { // the layers × heads overview, in the chosen scale
    const scale = $("#att-scale") ? $("#att-scale").value : "log";
    if (scale === thumbScale) return;
    thumbScale = scale;
    const cell = Math.max(1, Math.floor(64 / A.bins.length));
    $$("button.thumb").forEach((b) => paint($("canvas", b), b.dataset.layer, Number(b.dataset.hi), scale, cell));
  }
  // inside llmtrace serve's page: the head a reader picked is the one it offers to ablate; a click with the pointer
  // (click: true) ablates it at once, and so does a click on a row's "layer N" (that layer's attention)
  function tellParent(click) {
    const h = A.heads[Number($("#att-head").value)];
    if (window.parent !== window && h !== "mean") {
      const layer = Number($("#att-layer").value);
      window.parent.postMessage({ llmtrace: "head", layer: layer, head: h, click: !!click }, "*");
    }
  }
  $$("button.thumb").forEach((b) => b.addEventListener("click", (ev) => {
    $("#att-layer").value = b.dataset.layer; $("#att-head").value = b.dataset.hi; drawAttention();
    tellParent(ev.detail > 0);
  }));
  if (window.parent !== window) {
    $$(".thumbs .tl[data-layer]").forEach((t) => {
      t.classList.add("live");
      t.addEventListener("click", () => {
        window.parent.postMessage({ llmtrace: "layer", layer: Number(t.dataset.layer), click: true }, "*");
      });
    });
  }
  function label(bin) {
    const b = A.bins[bin];
    if (b[1] - b[0] > 1) return tr(PAD ? "slots" : "positions", { lo: b[0], hi: b[1] - 1 });
    if (b[0] < PAD) return tr("slot_pad", { slot: b[0] });
    const t = D.tokens[b[0] - PAD];
    return (PAD ? tr("slot_position", { slot: b[0], pos: b[0] - PAD }) : tr("position", { pos: b[0] })) + (t ? " (" + vis(t.text) + ")" : "");
  }
  function readout() {
    const out = $("#att-readout");
    const h = A.heads[Number($("#att-head").value)];
    let text = tr("readout_layer", { layer: $("#att-layer").value, n: A.bins.length,
      head: h === "mean" ? tr("readout_mean") : tr("readout_head", { h: h, kv: A.groups.findIndex((g) => g.includes(h)) }) });
    if (steps.length && A.source === "maps") text += " " + tr("outline", { step: steps[cur].step });
    if (cursor) {
      const [r, c] = cursor, B = A.bins.length;
      const v = mapOf($("#att-layer").value)[Number($("#att-head").value) * B * B + r * B + c];
      const layer = $("#att-layer").value;
      const why = padBin(r) || padBin(c) ? tr("masked_pad") : outsideWindow(layer, r, c) && !masked(r, c) ? tr("masked_window") : tr("masked_later");
      text += " " + tr("query_key", { q: label(r), k: label(c) }) + ": " + (masked(r, c, layer) ? why : v.toFixed(5));
    }
    out.textContent = text;
  }
  function fitAxes() { // a phone: the map and its labels scaled down together to the section's width (never up)
    const ax = $(".att-axes"), room = ax && ax.closest("section");
    if (!ax || !room) return;
    ax.style.zoom = "";
    const cs = getComputedStyle(room), free = room.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    const need = ax.scrollWidth;
    if (need > free && free > 0) ax.style.zoom = String(Math.floor(1000 * free / need) / 1000);
  }
  if (canvas && A.layers.length) {
    fitAxes();
    window.addEventListener("resize", fitAxes);
    ["#att-layer", "#att-head", "#att-scale"].forEach((s) => $(s).addEventListener("change", () => { drawThumbs(); drawAttention(); tellParent(); }));
    drawThumbs();
    canvas.addEventListener("mousemove", (ev) => {
      const cell = Number(canvas.dataset.cell), rect = canvas.getBoundingClientRect();
      const k = canvas.width / rect.width;
      const c = Math.floor((ev.clientX - rect.left) * k / cell), r = Math.floor((ev.clientY - rect.top) * k / cell);
      if (r >= 0 && c >= 0 && r < A.bins.length && c < A.bins.length) { cursor = [r, c]; drawAttention(); }
    });
    canvas.addEventListener("keydown", (ev) => {
      const B = A.bins.length, moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
      if (!moves[ev.key]) return;
      cursor = cursor || [0, 0];
      cursor = [Math.max(0, Math.min(B - 1, cursor[0] + moves[ev.key][0])), Math.max(0, Math.min(B - 1, cursor[1] + moves[ev.key][1]))];
      ev.preventDefault(); drawAttention();
    });
  }

  // ---------------------------------------------------------------------------------------------- logit lens
  function lensCell(td) {
    const row = D.lens.rows[Number(td.dataset.row)], top = row.cells[td.dataset.pos];
    const W = D.words;
    const where = (row.layer === null ? W.lens_output : W.lens_after.replace("{layer}", row.label)) + ", " +
      W.lens_position.replace("{pos}", td.dataset.pos);
    let html = "<h3>" + esc(where) + "</h3><table class=\"stats\"><tr><th>" + esc(tr("lens_token")) + "</th><th>id</th><th>p</th><th>logit</th><th></th></tr>";
    top.forEach((c) => {
      html += "<tr><td translate=no>" + esc(vis(c.text)) + "</td><td class=num>" + c.id + "</td><td class=num>" + fmt(c.prob, 4) +
        "</td><td class=num>" + fmt(c.logit, 5) + "</td><td><span class=\"nbar\" style=\"width:" + (100 * c.prob).toFixed(1) + "px\"></span></td></tr>";
    });
    $("#lens-panel").innerHTML = html + "</table>";
    $$("table.lens td.sel").forEach((x) => x.classList.remove("sel"));
    td.classList.add("sel");
  }
  $$("table.lens td[data-row]").forEach((td) => {
    td.addEventListener("click", () => lensCell(td));
    td.addEventListener("focus", () => lensCell(td));
    td.addEventListener("mouseenter", () => lensCell(td));
  });

  setStep(0);
  if (!steps.length) drawAttention();
})();
