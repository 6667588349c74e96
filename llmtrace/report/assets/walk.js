// llmtrace report: the learner's parts. Plain JavaScript, no library, no network; everything comes from the JSON
// embedded in the page (#data), by named fields:
//   walk     one token through the pass, s1-s12, on the values the trace kept (D.walk.samples, D.points)
//   what-if  the sampler again on the chosen step's logits (D.kept_logits), with temperature, top-k, top-p, min-p
// No point is named here: what a point is comes from its declaration (seed step, axes, input, residual).
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const WD = D.words;
  const $ = (sel, root) => (root || document).querySelector(sel);
  function t(key, vals) { // a text of the page's language, {name} filled in
    let s = WD[key] || key;
    Object.keys(vals || {}).forEach((k) => { s = s.split("{" + k + "}").join(String(vals[k])); });
    return s;
  }
  function esc(s) { const e = document.createElement("span"); e.textContent = s; return e.innerHTML; }
  function vis(x) { // a token's text as the terminal shows it: ▁ a space, \n, <U+00A0>
    return (x || "").replace(/[\p{Zs}\p{Zl}\p{Zp}\p{Cf}\p{Cc}\p{Co}\p{Cn}]/gu, (c) => {
      const n = c.codePointAt(0);
      if (c === " ") return "\u2581";
      if (c === "\n") return "\\n";
      if (c === "\t") return "\\t";
      if (n < 0x20 || n === 0x7f) return "\\x" + n.toString(16).padStart(2, "0");
      return "<U+" + n.toString(16).toUpperCase().padStart(4, "0") + ">";
    }) || "\u2205";
  }
  function num(x, d) { return x === null || x === undefined || Number.isNaN(x) ? "\u2014" : Number(x).toPrecision(d || 5); }
  function unpack(b64, Type) {
    const bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Type(bytes.buffer);
  }
  function unpack24(b64) { // float32 without its last byte, 3 bytes each (report/walk.py pack_f24)
    const bin = atob(b64), n = bin.length / 3, out = new Float32Array(n), dv = new DataView(new ArrayBuffer(4));
    for (let i = 0; i < n; i++) {
      dv.setUint8(0, 0); dv.setUint8(1, bin.charCodeAt(3 * i)); dv.setUint8(2, bin.charCodeAt(3 * i + 1)); dv.setUint8(3, bin.charCodeAt(3 * i + 2));
      out[i] = dv.getFloat32(0, true);
    }
    return out;
  }
  const cache = {};
  function sample(step, layer, name) { // {meta, values (rows × k), norms} of one point of one pass, or null
    const key = step + "/" + layer + "/" + name;
    let m = D.walk.samples[key];
    if (!m) return null;
    if (!cache[key]) {
      if (Array.isArray(m)) m = D.walk.samples[key] = { m: m[0], v: m[1], n: m[2], x: m[3] }; // [meta, values, norms, extra]
      if (m.m !== undefined) Object.assign(m, D.walk.metas[m.m]); // its shape, axes, rows and entries, stored once
      if (m.ix !== undefined) m.index = D.walk.indexes[m.ix]; // the entries kept along the last axis
      m.at = layer + "/" + name; // its layer and point (a dot product's weight rows are kept once for each)
      if (m.v === undefined) cache[key] = { meta: m };
      else if (m.n === null || m.n === undefined) { // 24-bit values, then each row's norm, in one string (report/walk.py)
        const all = unpack24(m.v), nv = all.length - m.rows;
        cache[key] = { meta: m, values: all.subarray(0, nv), norms: all.subarray(nv) };
      } else cache[key] = { meta: m, values: unpack24(m.v), norms: unpack24(m.n) }; // (a page before the norms joined)
    }
    return cache[key];
  }
  const M = D.run.model, G = M.n_heads / M.n_kv_heads;
  const nPrompt = D.tokens.filter((x) => x.step === null).length;
  const PAD = D.pad || 0;

  // ------------------------------------------------------------------------------------------ the walk-through
  // a long prompt's prefill ran in chunks: the page keeps the last chunk, the prompt's last OFF0.. slots
  const OFF0 = D.walk.prefill_rows ? Math.max(0, PAD + nPrompt - D.walk.prefill_rows) : 0;
  function passOf(i) { // the pass that takes token i as input, and its row along T (off: the pass's first slot)
    if (i < nPrompt) return { step: 0, t: PAD + i - OFF0, T: PAD + nPrompt - OFF0, position: i, off: OFF0, abs: PAD + i };
    const step = i - nPrompt + 1;
    return { step: step, t: 0, T: 1, position: i, off: 0, abs: PAD + nPrompt + step - 1 };
  }
  function rowOf(axes, shape, t, h) { // the row of a sample (all axes but the last, row-major) for token t, head h
    let row = 0;
    for (let a = 0; a < axes.length - 1; a++) {
      let idx = 0;
      if (axes[a] === "T") idx = t;
      else if (axes[a] === "H") idx = h;
      else if (axes[a] === "Hkv") idx = Math.floor(h / G);
      else if (axes[a] === "G") idx = h % G;
      row = row * shape[a] + idx;
    }
    return row;
  }
  function rowValues(s, row) {
    const k = s.meta.index.length;
    return Array.from(s.values.slice(row * k, (row + 1) * k));
  }
  function shapeText(m) {
    return "[" + m.shape.map((n, a) => (m.axes ? m.axes[a] + "=" : "") + n).join(", ") + "]";
  }
  function cellNum(x) { // a table cell's number: 5 significant figures, short (an exponent below 0.001)
    if (x === -Infinity || (typeof x === "number" && Number.isNaN(x))) return "\u2212\u221e";
    if (x === null || x === undefined) return "\u00b7";
    return x !== 0 && Math.abs(x) < 1e-3 ? Number(x).toExponential(4) : Number(x).toPrecision(5);
  }
  // the rows of a walk table ([heading, cells as text]), one column per kept entry (index i); a sample's two halves
  // (its first entries and those from the middle) stacked as two tables, so that a card fits the page's width
  function walkTable(index, rows) {
    const parts = index.length > 8 ? [[0, index.length / 2 | 0], [index.length / 2 | 0, index.length]] : [[0, index.length]];
    return parts.map(([a, b]) => "<div class=scroll><table class=\"stats walkv\"><tr><th scope=row>" + esc(t("index")) + "</th>" +
      index.slice(a, b).map((ix) => "<th>" + ix + "</th>").join("") + "</tr>" +
      rows.map((r) => "<tr><th scope=row>" + esc(r[0]) + "</th>" + r[1].slice(a, b).map((v) => "<td class=num>" + esc(v) + "</td>").join("") + "</tr>").join("") +
      "</table></div>").join("");
  }
  function valuesTable(index, cols, masked) { // one row per series ([heading, values]); `masked`: a missing value is a masked −∞
    return walkTable(index, cols.map((c) => [c[0], index.map((ix, j) => (!masked && Number.isNaN(c[1][j]) ? "\u2014" : cellNum(c[1][j])))]));
  }
  // the worked examples (cards.js): each point's declared operation, worked out on the recorded inputs
  function positionOf(pass) { // the token's position (RoPE's m): a batch row counts from its first real token
    return !D.positions ? pass.position : pass.step === 0 ? D.positions[pass.abs] : D.positions[D.positions.length - 1] + pass.step;
  }
  const T0 = PAD + nPrompt; // the prefill's slots; decode step j writes slot T0 + j - 1
  function slotOf(pass) { return pass.step === 0 ? pass.off : T0 + pass.step - 1; } // the pass's first slot
  const CARDS = window.llmtraceCards({ D: D, t: t, esc: esc, num: num, cellNum: cellNum, walkTable: walkTable, sample: sample, rowOf: rowOf, positionOf: positionOf,
    unpack: (b64) => unpack(b64, Float32Array), unpack24: unpack24, bytes: (b64) => unpack(b64, Uint8Array) });
  // s3: the mask this layer used for the query of this pass's row, slot by slot: "on" (attended), "pad" (a batch row's
  // leading pad slot), "later" (causal), "window" (outside the layer's window of keys), "masked" (none of those):
  // read from the recorded scores row where the trace kept every slot (a masked key is −∞ there), else from the
  // layer's declared mask (its plan: causal, its window) and the row's padding
  function maskOf(pass, layer, h) {
    const plan = CARDS.planOf(layer);
    if (plan && plan.attention === "none") return null; // a kind that reads no keys (its state carries the past)
    const q = slotOf(pass) + pass.t, S = pass.step === 0 ? slotOf(pass) + pass.T : q + 1, W = plan && plan.window;
    const why = (s) => (s < PAD ? "pad" : s > q ? "later" : W && q - s >= W ? "window" : "masked");
    const sc = D.points.find((p) => p.layer && p.step.split("/")[0] === "s6.4" && JSON.stringify(p.axes) === "[\"H\",\"T\",\"S\"]");
    const s = sc && sample(pass.step, layer, sc.name);
    const kinds = [];
    if (s && s.values && s.meta.index.length === s.meta.shape[s.meta.shape.length - 1] && s.meta.index.length === S) {
      const v = rowValues(s, rowOf(s.meta.axes, s.meta.shape, pass.t, h));
      v.forEach((x, k) => kinds.push(Number.isNaN(x) || x === -Infinity ? why(k) : "on"));
      return { q: q, S: S, kinds: kinds, from: "scores", window: W };
    }
    for (let k = 0; k < S; k++) { const w = why(k); kinds.push(w === "masked" ? "on" : w); }
    return { q: q, S: S, kinds: kinds, from: "plan", window: W };
  }
  function ranges(list) { // [0, 1, 2, 5] -> "0–2, 5"
    const out = [];
    list.forEach((k) => { const r = out[out.length - 1]; if (r && r[1] === k - 1) r[1] = k; else out.push([k, k]); });
    return out.map((r) => (r[0] === r[1] ? String(r[0]) : r[0] + "\u2013" + r[1])).join(", ");
  }
  function maskLine(pass, layer, h) { // s3: the keys this token may attend in this layer, and why the others are masked
    const m = maskOf(pass, layer, h);
    if (!m) return "<p>" + esc(t("mask_no_keys", { layer: layer })) + "</p>";
    const groups = ["pad", "window", "later", "masked"].map((kind) => {
      const at = m.kinds.map((x, k) => (x === kind ? k : -1)).filter((k) => k >= 0);
      return at.length ? ranges(at) + " (" + t("mask_why_" + kind, { w: m.window }) + ")" : "";
    }).filter((x) => x);
    const allowed = m.kinds.filter((x) => x === "on").length;
    return "<p data-mask-allowed=\"" + allowed + "\" data-mask-slots=\"" + m.S + "\">" + esc(t(m.from === "scores" ? "mask_row" : "mask_row_plan", { layer: layer, head: h,
      allowed: allowed, slots: m.S, masked: groups.length ? groups.join("; ") : "\u2014" })) + "</p>";
  }
  function padRow(pass, layer, h) { // s3 of a padded batch row: the query's mask row, slot by slot (pad, window, seen, later)
    if (!D.batch) return "";
    const m = maskOf(pass, layer, h);
    if (!m) return "";
    let head = "", cells = "";
    m.kinds.forEach((kind, s) => {
      head += "<th>" + s + "</th>";
      cells += "<td class=\"" + kind + "\" title=\"" + esc(t("mask_" + kind, { w: m.window })) + "\">" + (kind === "on" ? "1" : kind === "pad" ? "0" : "\u2212\u221e") + "</td>";
    });
    return "<p>" + esc(PAD ? t("pad_row", { slot: m.q, pads: PAD }) : t("pad_row_none", { slot: m.q })) + "</p><div class=scroll><table class=\"maskgrid walkmask\"><tr><th>" +
      esc(t("slot")) + "</th>" + head + "</tr><tr><th>" + m.q + "</th>" + cells + "</tr></table></div>";
  }
  function headLine(axes, h) { // which head a per-head card reads: the query head and its GQA group, or the KV head
    const kv = Math.floor(h / G), group = [];
    for (let q = kv * G; q < (kv + 1) * G; q++) group.push(q);
    const attr = " data-kv-head=\"" + kv + "\" data-group=\"" + group.join(",") + "\"";
    if (axes.indexOf("Hkv") >= 0 && axes.indexOf("H") < 0)
      return "<p class=headline" + attr + ">" + esc(t(G > 1 ? "head_kv" : "head_kv_mha", { kv: kv, h: h, group: group.join(", "), G: G })) + "</p>";
    if (axes.indexOf("H") >= 0)
      return "<p class=headline" + attr + ">" + esc(t(G > 1 ? "head_q" : "head_q_mha", { kv: kv, h: h, group: group.join(", "), G: G })) + "</p>";
    return "";
  }
  function aboutOf(p, lay) { // what a point is; a RoPE that rotates nothing in this layer says so, not "rotated"
    const o = D.maths ? CARDS.opOf(lay, p.name) : null;
    return o && o.op === "rope" && o.consts && o.consts.rotation === "none" ? t("about_no_rope") : p.about || "";
  }
  function pointCard(p, pass, layer, h) {
    const lay = p.layer ? layer : "m";
    const s = sample(pass.step, lay, p.name);
    if (s && s.meta.axes && s.meta.axes.indexOf("T") < 0 && pass.t !== pass.T - 1) return "";  // the pass's last position only
    const w = CARDS.work(p, lay, pass, h, s && !s.meta.positions ? s : null);
    const attr = (k, v) => (v === undefined || v === null ? "" : " data-" + k + "=\"" + esc(String(v)) + "\"");
    let html = "<div class=\"wpoint card\"" + attr("point", p.name) + attr("layer", lay) + attr("op", w.op) + attr("head", w.head) +
      attr("max-error", w.err) + attr("max-rel", w.rel) + attr("missing", w.missing) + "><h4>" + esc(p.name) + " <code>" +
      (s ? esc(shapeText(s.meta)) : "") + "</code> <span class=note>" + esc(aboutOf(p, lay)) + "</span>" +
      (w.op ? " <span class=op>" + esc(w.op) + "</span>" : "") + "</h4>";
    if (!s) return html + w.html + "<p class=note>" + esc(t("no_sample")) + "</p></div>";
    if (s.meta.positions) return html + w.html + "<p>" + esc(t("slots_written", { slots: s.meta.positions.join("\u2013") })) + "</p></div>";
    if (!s.meta.axes) return html + "<p class=note>" + esc(t("no_axes")) + "</p></div>";
    const row = rowOf(s.meta.axes, s.meta.shape, pass.t, h), vals = rowValues(s, row);
    html += headLine(s.meta.axes, h);
    html += "<p>" + (Number.isFinite(s.norms[row]) ? esc(t("norm")) + ": " + num(s.norms[row]) :
      esc(t("norm_masked"))) + "</p>"; // a scores row with a masked key (−∞) has no finite norm
    return html + w.html + (w.err !== undefined ? "" : valuesTable(s.meta.index, [[t("value"), vals]], w.op === "scores" || w.op === "softcap")) + "</div>";
  }
  const SEED = Object.keys(D.step_titles);
  // the walk's words for a seed step with no point of its own (s1–s3, s5, s10–s12), or null: the token, the mask, the
  // position RoPE reads, the sampler
  function seedBody(sid, i, pass, layer, h) {
    const tok = D.tokens[i];
    if (sid === "s1" || sid === "s2")
      return "<p><b class=tok>" + esc(vis(tok.text)) + "</b> \u00b7 " + esc(t("token_facts", { id: tok.id, piece: tok.piece,
        bytes: tok.bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ") })) + " \u00b7 " +
        esc(t("position", { pos: pass.position })) + " \u00b7 " + esc(pass.step === 0 ? t("pass_prefill", { t: pass.t, T: pass.T }) : t("pass_decode", { step: pass.step })) + "</p>";
    if (sid === "s3") return maskLine(pass, layer, h) + padRow(pass, layer, h);
    if (sid === "s5") {
      if (D.points.some((p) => p.step.split("/")[0] === "s5" && p.traced !== false)) return null;
      const plan = D.maths ? CARDS.planOf(layer) : null;
      return "<p>" + esc(t(plan && !plan.rope ? "seed_s5_none" : "seed_s5", { pos: positionOf(pass), layer: layer })) + "</p>";
    }
    if (sid === "s10" || sid === "s11" || sid === "s12") {
      const st = D.steps.find((x) => x.step === pass.step);
      return "<p>" + esc(st && pass.t === pass.T - 1 ? t("sampler_here", { token: vis(st.token.text), step: st.step }) : t("sampler_not")) + "</p>";
    }
    return null;
  }
  function drawWalk() {
    const panel = $("#walk-panel");
    if (!panel) return;
    const i = Number($("#walk-token").value), layer = Number($("#walk-layer").value), h = Number($("#walk-head").value);
    const tok = D.tokens[i], pass = passOf(i);
    panel.dataset.token = String(i); panel.dataset.step = String(pass.step);
    if (D.walk.steps.indexOf(pass.step) < 0) { panel.innerHTML = "<p class=missing>" + esc(t("not_passed")) + "</p>"; return; }
    if (pass.t < 0) { // an earlier chunk of a long prompt's prefill: the page keeps the last one
      panel.innerHTML = "<p class=missing>" + esc(t("earlier_chunk", { first: OFF0 - PAD })) + "</p>"; return;
    }
    let html = "";
    SEED.forEach((sid) => {
      if (sid === "s2" || sid === "s11" || sid === "s12") return; // told with s1 and s10
      let body = seedBody(sid, i, pass, layer, h);
      if (body === null) {
        body = "";
        D.points.filter((p) => p.step.split("/")[0] === sid && p.traced !== false)
          .filter((p) => !D.maths || CARDS.opOf(p.layer ? layer : "m", p.name)) // a layer's own points (a hybrid's: its kind's)
          .forEach((p) => { body += pointCard(p, pass, layer, h); });
      }
      if (body) html += "<section class=\"wstep\" data-seed=\"" + sid + "\"><h3>" + esc(sid + (sid === "s1" ? "\u2013s2" : sid === "s10" ? "\u2013s12" : "") + " " + titleOf(sid, layer)) + "</h3>" + body + "</section>";
    });
    panel.innerHTML = html;
  }
  ["#walk-token", "#walk-layer", "#walk-head"].forEach((s) => { const e = $(s); if (e) e.addEventListener("change", () => { drawWalk(); drawMap(); }); });

  // ------------------------------------------------------------------------------------------ the map of the pass
  // s1 -> s12 as the model declares it: each seed step a box, each of its points a button named by its operation; a
  // button opens that point's worked card in place, on the walk-through's token, layer and head.
  let mapOpen = null; // {name, layer} of the open block
  function titleOf(sid, layer) { // a seed step's title in this layer: its kind's own where it declares one (model.kinds)
    const R = D.maths && D.maths.record, own = R && D.kind_titles && D.kind_titles[R.layer_kind[layer]];
    return (own && own[sid]) || D.step_titles[sid];
  }
  function walkChoice() {
    const v = (id, d) => { const e = $(id); return e ? Number(e.value) : d; };
    const i = v("#walk-token", nPrompt - 1);
    return { i: i, pass: passOf(i), layer: v("#walk-layer", (D.walk.layers || [0])[0] || 0), h: v("#walk-head", 0) };
  }
  function drawMap() {
    const el = $("#passmap");
    if (!el || !D.maths) return;
    const c = walkChoice(), R = D.maths.record, plan = CARDS.planOf(c.layer);
    const shapeOf = (p, lay) => { const s = sample(c.pass.step, lay, p.name); return s ? shapeText(s.meta) : ""; };
    let html = "";
    SEED.forEach((sid, k) => {
      let pts = D.points.filter((p) => p.step.split("/")[0] === sid && p.traced !== false);
      pts = pts.filter((p) => CARDS.opOf(p.layer ? c.layer : "m", p.name));
      let extra = "";
      if (sid === "s6.3" && plan && !plan.rope) extra = "<span class=mapnote>" + esc(t("map_no_rope")) + "</span>";
      if (sid === "s6.4" && plan && plan.window) extra = "<span class=mapnote>" + esc(t("map_window", { w: plan.window })) + "</span>";
      const mem = (M.memory || [])[c.layer]; // the layer's declared memory (model.memory): grows a slot a token, or not
      if (sid === "s6.8") extra = mem ? (mem.reads != null ? "<span class=mapnote>" + esc(t("map_shared", { layer: mem.reads })) + "</span>" :
        !mem.per_token_bytes ? "<span class=mapnote>" + esc(t("map_state")) + "</span>" : null) : (plan && plan.attention === "linear" ? // a trace before the kinds
        "<span class=mapnote>" + esc(t("map_state")) + "</span>" : null);
      if (sid === "s6.8" && extra === null) extra =
        "<span class=mapnote data-kv-slots=\"" + (slotOf(c.pass) + c.pass.T) + "\">" +
        esc(t("map_kv", { slots: slotOf(c.pass) + c.pass.T })) + "</span>";
      const told = !pts.length && ["s1", "s2", "s3", "s5", "s10", "s11", "s12"].indexOf(sid) >= 0;
      const seedOpen = mapOpen && mapOpen.seed === sid;
      const seedButton = told ? "<button type=button class=\"mapblock mapseed" + (seedOpen ? " open" : "") + "\" data-seed-open=\"" + sid +
        "\" aria-expanded=\"" + (seedOpen ? "true" : "false") + "\" aria-label=\"" + esc(sid + " " + (titleOf(sid, c.layer) || "")) + "\">" +
        esc(t("map_open_step")) + "</button>" : "";
      const buttons = seedButton + pts.map((p) => {
        const lay = p.layer ? c.layer : "m", o = CARDS.opOf(lay, p.name), open = mapOpen && mapOpen.name === p.name;
        return "<button type=button class=\"mapblock" + (open ? " open" : "") + "\" data-point=\"" + esc(p.name) + "\" data-layer=\"" + lay +
          "\" data-op=\"" + esc(o.op) + "\" aria-expanded=\"" + (open ? "true" : "false") + "\" aria-label=\"" + esc(sid + " " + p.name + ": " + o.op) +
          "\">" + esc(p.name) + " <span class=op>" + esc(o.op) + "</span><span class=mapshape>" + esc(shapeOf(p, lay)) + "</span></button>";
      }).join("");
      html += "<li class=mapstep data-seed=\"" + sid + "\"" + (sid.startsWith("s6") ? " data-in-layer" : "") + "><b>" + esc(sid) + "</b> " +
        esc(titleOf(sid, c.layer) || "") + (buttons ? "<div>" + buttons + "</div>" : "") + extra + "</li>";
      if (k < SEED.length - 1) html += "<li class=maparrow aria-hidden=true>\u2192</li>";
    });
    el.innerHTML = "<p class=note>" + esc(t("map_intro", { layer: c.layer, kind: (D.kind_words || [])[R.layer_kind[c.layer]] || R.layer_kind[c.layer] })) + "</p><ol class=mapflow>" + html + "</ol>" +
      "<div id=map-card aria-live=polite></div>";
    el.querySelectorAll(".mapblock").forEach((b) => b.addEventListener("click", () => {
      const seed = b.dataset.seedOpen;
      const same = mapOpen && (seed ? mapOpen.seed === seed : mapOpen.name === b.dataset.point);
      mapOpen = same ? null : seed ? { seed: seed } : { name: b.dataset.point };
      drawMap();
      const again = el.querySelector(seed ? ".mapblock[data-seed-open=\"" + seed + "\"]" : ".mapblock[data-point=\"" + b.dataset.point + "\"]");
      if (again) again.focus();
    }));
    if (mapOpen && mapOpen.seed) {
      const body = seedBody(mapOpen.seed, c.i, c.pass, c.layer, c.h);
      $("#map-card").innerHTML = body ? "<div class=\"card mapseedcard\" data-seed=\"" + mapOpen.seed + "\">" + body + "</div>" : "";
    } else if (mapOpen) {
      const p = D.points.find((x) => x.name === mapOpen.name);
      $("#map-card").innerHTML = p ? pointCard(p, c.pass, c.layer, c.h) : "";
    }
  }

  // ------------------------------------------------------------------------------------------ the what-if sampler
  function logitsOf(step) { // {ids, z, tail, vocab, all} of one step, decoded once
    const L = D.kept_logits[String(step)];
    if (!L) return null;
    if (!L._z) { L._ids = unpack(L.ids, L.vocab <= 65536 ? Uint16Array : Uint32Array); L._z = unpack(L.values, Float32Array); }
    return L;
  }
  function whatif(L, temperature, topK, topP, minP, order) {
    // temperature, then the run's truncations among top_k, top_p, min_p in the run's order, each renormalising. The
    // trace keeps the n largest logits and the rest as a histogram (the tail): the tail joins every softmax while no
    // truncation has cut inside the kept n (then no tail token can survive it either).
    const n = L._z.length, greedy = temperature === 0, T = greedy ? 1 : temperature;
    let keep = n, tail = !!L.tail;
    function softmax() {
      const z0 = L._z[0] / T;
      const e = Array.from(L._z.slice(0, keep), (v) => Math.exp(v / T - z0));
      let sum = e.reduce((x, y) => x + y, 0);
      if (tail) L.tail.counts.forEach((c, j) => { sum += c * Math.exp(L.tail.means[j] / T - z0); });
      return e.map((v) => v / sum);
    }
    let probs = softmax();
    order.forEach((stage) => {
      let k = keep;
      if (stage === "top_k" && topK > 0) k = Math.min(keep, topK);
      if (stage === "top_p" && topP < 1) {
        let c = 0; k = 0;
        while (k < keep && c < topP) { c += probs[k]; k++; }
        if (c < topP && tail) k = keep; // the top-p set reaches into the tail: the kept n all stay
      }
      if (stage === "min_p" && minP > 0) { k = 0; while (k < keep && probs[k] >= minP * probs[0]) k++; }
      k = Math.max(1, k);
      if (k < keep || (stage === "top_k" && topK > 0 && topK <= n)) tail = false;
      keep = k;
      probs = softmax();
    });
    if (greedy) { keep = 1; tail = false; probs = [1]; }
    return { keep: keep, probs: probs.slice(0, keep), survivors: keep + (tail ? L.vocab - n : 0) };
  }
  const TOP_SHOWN = 10; // rows of the what-if table (the step's top-k, whose texts the trace has)
  function said(id, v) { // a setting as the run table says it: temperature 0 is greedy, a truncation that cuts nothing is off
    if (id === "#wi-temperature" && v === 0) return t("greedy");
    if ((id === "#wi-top-k" && v === 0) || (id === "#wi-top-p" && v === 1) || (id === "#wi-min-p" && v === 0)) return t("off");
    return String(v);
  }
  function drawWhatif() {
    const panel = $("#whatif-panel");
    if (!panel || !D.steps.length) return;
    const cur = Number(($("#step") || { value: 0 }).value || 0), st = D.steps[cur], L = logitsOf(st.step);
    if (!L) { panel.innerHTML = "<p class=missing>" + esc(t("whatif_none")) + "</p>"; return; }
    const get = (id) => Number($(id).value);
    const T = get("#wi-temperature"), k = get("#wi-top-k"), p = get("#wi-top-p"), mp = get("#wi-min-p");
    ["#wi-temperature", "#wi-top-k", "#wi-top-p", "#wi-min-p"].forEach((id) => {
      const inp = $(id), out = $("output[for=\"" + id.slice(1) + "\"]");
      out.textContent = said(id, Number(inp.value)) + (Number(inp.value) === Number(inp.dataset.run) ? " (" + t("whatif_run") + ")" : "");
    });
    const runOrder = (D.run.sampling && D.run.sampling.order) || ["temperature", "top_k", "top_p", "min_p"];
    const order = runOrder.filter((s) => ["top_k", "top_p", "min_p"].indexOf(s) >= 0);
    const r = whatif(L, T, k, p, mp, order);
    const text = (id) => {
      if (id === st.token.id) return vis(st.token.text);
      const c = (st.topk || []).find((x) => x.id === id);
      return c ? vis(c.text) : "id " + id;
    };
    let html = "<p class=note>" + esc(L.all ? t("whatif_source_all", { vocab: L.vocab }) : t("whatif_source_top", { n: L.n, rest: L.vocab - L.n })) +
      " \u00b7 " + esc(t("whatif_order", { order: ["temperature"].concat(order).join(" \u2192 ") })) + "</p>";
    html += "<p id=\"whatif-summary\">" + esc(t(r.survivors === 1 ? "whatif_survivor_one" : "whatif_survivors", { n: r.survivors.toLocaleString("en"), vocab: L.vocab.toLocaleString("en") })) +
      " \u00b7 <span id=\"whatif-top1\">" + esc(t("whatif_top1", { token: text(L._ids[0]), p: r.probs[0].toFixed(6) })) + "</span></p>";
    html += "<table class=\"stats whatif-bars\"><tr><th>" + esc(t("whatif_token")) + "</th><th>id</th><th>p</th><th></th></tr>";
    for (let j = 0; j < Math.min(Math.max(TOP_SHOWN, (st.topk || []).length), L._z.length); j++) {
      const id = L._ids[j], pj = j < r.keep ? r.probs[j] : 0, chosen = id === st.token.id;
      html += "<tr" + (chosen ? " class=chosen" : "") + " data-id=\"" + id + "\"><td><span translate=no>" + esc(text(id)) + "</span>" + (chosen ? " \u2190 " + esc(t("whatif_chosen")) : "") +
        "</td><td class=num>" + id + "</td><td class=num>" + (j < r.keep ? pj.toFixed(4) : "\u2014") + "</td><td><span class=\"nbar\" style=\"width:" + (200 * pj).toFixed(1) + "px\"></span></td></tr>";
    }
    html += "</table>" + drawBar(L, r, st, text);
    panel.innerHTML = html;
  }
  function drawBar(L, r, st, text) { // each survivor's slice of [0, 1) in id order, and where the run's u lands
    if (!st.rng || st.rng.draw === null || st.rng.draw === undefined || r.keep < 1) return "";
    const ids = Array.from(L._ids.slice(0, r.keep)), pr = r.probs.slice(0, r.keep);
    const total = pr.reduce((a, b) => a + b, 0), order = ids.map((id, j) => [id, pr[j] / total]).sort((a, b) => a[0] - b[0]);
    const W = 480, X0 = 12, u = st.rng.draw;
    let acc = 0, landed = null, rects = "";
    order.forEach(([id, q], j) => {
      const x = X0 + W * acc;
      if (landed === null && u < acc + q) landed = id;
      rects += "<rect x=\"" + x.toFixed(2) + "\" y=\"6\" width=\"" + Math.max(0.5, W * q).toFixed(2) + "\" height=\"14\" class=\"wslice" + (j % 2 ? " odd" : "") +
        "\"><title>" + esc(text(id)) + " " + q.toFixed(4) + "</title></rect>";
      acc += q;
    });
    if (landed === null && order.length) landed = order[order.length - 1][0];
    const ux = X0 + W * u;
    return "<p>" + esc(t("whatif_draw", { u: u.toFixed(4), token: text(landed) })) + "</p><svg class=\"draw whatif-draw\" width=\"" + (W + 24) + "\" height=\"40\" viewBox=\"0 0 " + (W + 24) +
      " 40\" role=\"img\" data-landed=\"" + landed + "\">" + rects + "<line x1=\"" + ux + "\" x2=\"" + ux + "\" y1=\"2\" y2=\"24\" class=\"u\"/><text x=\"" + X0 + "\" y=\"35\" text-anchor=\"middle\" class=\"cap\">0</text><text x=\"" +
      (X0 + W) + "\" y=\"35\" text-anchor=\"middle\" class=\"cap\">1</text></svg>";
  }
  function tellParent() { // inside llmtrace serve's page: its re-sample runs the real sampler with these settings
    if (window.parent === window) return;
    const v = (id) => Number($(id).value);
    window.parent.postMessage({ llmtrace: "sampler", temperature: v("#wi-temperature"), top_k: v("#wi-top-k"),
      top_p: v("#wi-top-p"), min_p: v("#wi-min-p") }, "*");
  }
  ["#wi-temperature", "#wi-top-k", "#wi-top-p", "#wi-min-p"].forEach((s) => {
    const e = $(s);
    if (e) e.addEventListener("input", () => { drawWhatif(); tellParent(); });
  });
  const reset = $("#wi-reset");
  if (reset) reset.addEventListener("click", () => {
    ["#wi-temperature", "#wi-top-k", "#wi-top-p", "#wi-min-p"].forEach((s) => { $(s).value = $(s).dataset.run; });
    drawWhatif();
  });
  document.addEventListener("llmtrace:step", drawWhatif);
  drawWalk();
  drawMap();
  drawWhatif();
})();
