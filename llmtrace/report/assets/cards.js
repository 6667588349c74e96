// llmtrace report: the worked examples of the walk-through, one card per point, from the model's declared maths
// (D.maths: the trace's run.maths, model/maths.py). A card names the point's operation (data-op), shows its formula
// with this layer's constants, works it out on the recorded inputs of the same head and row, and puts the result
// beside the trace's own value: data-max-error (largest |computed - recorded|) and data-max-rel (that over the row's
// largest |recorded|). No point name and no family is written here: the operation says what to compute, the
// operands say what to read.
"use strict";
window.llmtraceCards = function (api) {
  const D = api.D, t = api.t, esc = api.esc, num = api.num;
  const R = D.maths && D.maths.record;
  const nLayers = D.run.model.n_layers;
  function opOf(layer, name) { // {op, inputs, weights, consts} or null
    if (!R) return null;
    if (layer === "m") return R.model[name] || null;
    const kind = R.kinds[R.layer_kind[layer]];
    return (kind && kind.ops[name]) || null;
  }
  function formulaOf(layer, name) {
    const F = D.maths.formulas;
    return layer === "m" ? F.model[name] : (F.kinds[R.layer_kind[layer]] || {})[name];
  }
  function planOf(layer) { return layer === "m" ? null : R.kinds[R.layer_kind[layer]].plan; }
  function operand(layer, ref) { // where an operand lives: {layer, name}; "^x" is x of the layer before
    if (ref.charAt(0) === "^") {
      const name = ref.slice(1);
      if (layer === "m") return { layer: nLayers - 1, name: name };
      return layer > 0 ? { layer: layer - 1, name: name } : { layer: "m", name: R.stream_in };
    }
    if (layer !== "m" && !opOf(layer, ref) && R.model[ref]) return { layer: "m", name: ref };
    return { layer: layer, name: ref };
  }
  function source(layer, ref) { // the operand's point, followed through an operation that only passes it on
    let at = operand(layer, ref);
    for (let k = 0; k < 4; k++) {
      const o = opOf(at.layer, at.name);
      if (!o || o.op !== "stream") break;
      at = operand(at.layer, o.inputs[0]);
    }
    return at;
  }
  const HEADS = ["H", "Hkv"];
  function headOf(axes, h) { // the head index a point's row uses for query head h, or null
    if (!axes) return null;
    if (axes.indexOf("H") >= 0) return h;
    if (axes.indexOf("Hkv") >= 0) return Math.floor(h / (D.run.model.n_heads / D.run.model.n_kv_heads));
    return null;
  }
  // the recorded entries of one operand for the card's token and head, keyed by their index along the last axis
  function entries(pass, at, h) {
    const s = api.sample(pass.step, at.layer, at.name);
    if (!s || !s.values || !s.meta.axes) return null;
    const row = api.rowOf(s.meta.axes, s.meta.shape, pass.t, h), k = s.meta.index.length, out = {};
    s.meta.index.forEach((ix, j) => { out[ix] = s.values[row * k + j]; });
    return { s: s, row: row, byIndex: out, n: s.meta.shape[s.meta.shape.length - 1] };
  }
  function missing(why) { return { missing: why }; }
  // the sink's column of a softmax with a sink (its point has one entry per query): exp(sink) / (Σ exp(s) + exp(sink))
  // = 1 / (1 + exp(lse(s) − sink)) for each query row of this head, from the input's log-sum-exp per row
  function sinkColumn(o, layer, pass, h, out) {
    const at = source(layer, o.inputs[0]), sc = api.sample(pass.step, at.layer, at.name);
    if (!sc || !sc.lse || !sc.meta.axes) return missing(t("card_lse_missing"));
    if (!out.s.sink) return missing(t("card_gamma_missing"));
    const sk = out.s.sink[headOf(out.s.meta.axes, h) || 0], computed = {};
    out.index.forEach((i) => {
      const lse = sc.lse[api.rowOf(sc.meta.axes, sc.meta.shape, i, h)];
      if (lse !== undefined) computed[i] = 1 / (1 + Math.exp(lse - sk));
    });
    const here = computed[pass.t];
    return { computed: computed, note: here === undefined ? "" : t("card_sink", { share: num(here, 4) }) };
  }
  // the θᵢ the layer runs (its declared inv_freq, scaling included) and, for a scaled RoPE, the rule that made them
  function ropeTheta(c, inv, half, f) {
    const shown = Array.from(inv.slice(0, 8), (v, i) => "\u03b8" + i + " = " + num(v, 4)).join(", ") + (half > 8 ? ", \u2026" : "");
    let s = t("card_rope_theta", { last: half - 1, thetas: shown });
    const sc = c.scaling || {}, i = Math.min(4, half - 1), plain = Math.pow(c.base, -2 * i / c.rotary_dim);
    if (sc.rope_type === "yarn")
      s += " " + t("card_rope_yarn", { s: sc.factor, L: sc.original_max_position_embeddings, bf: sc.beta_fast, bs: sc.beta_slow,
        i: i, ti: num(inv[i], 4), bi: num(plain, 4), f: num(f, 4) });
    else if (sc.rope_type && sc.rope_type !== "default")
      s += " " + t("card_rope_scaled", { kind: sc.rope_type, i: i, ti: num(inv[i], 4), bi: num(plain, 4) });
    return s;
  }
  const gelu = (x) => 0.5 * x * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (x + 0.044715 * x * x * x)));
  const silu = (x) => x / (1 + Math.exp(-x));
  const ACT = { silu: silu, gelu_tanh: gelu };

  // each operation: (o, point, layer, pass, h, out) -> {computed: {index: value}, note, missing}
  const WORK = {
    rmsnorm(o, p, layer, pass, h, out) {
      const at = source(layer, o.inputs[0]);
      const inS = api.sample(pass.step, at.layer, at.name);
      if (!inS || !inS.values || !inS.meta.axes) return missing(t("card_input_missing", { input: at.name, layer: at.layer }));
      if (!out.s.gamma) return missing(t("card_gamma_missing"));
      const gamma = out.s.gamma, width = out.n, inW = inS.meta.shape[inS.meta.shape.length - 1];
      // the norm's row may span several of the input's rows (q normed over all heads before the split)
      const per = width / inW, k = inS.meta.index.length, ix = inS.meta.index;
      const first = api.rowOf(inS.meta.axes, inS.meta.shape, pass.t, per > 1 ? 0 : h);
      let ssq = 0;
      for (let r = 0; r < per; r++) ssq += Math.pow(inS.norms[first + r], 2);
      const rms = Math.sqrt(ssq / width + o.consts.eps), computed = {};
      out.index.forEach((i, j) => {
        const r = first + Math.floor(i / inW), pos = ix.indexOf(i % inW);
        if (pos >= 0) computed[i] = inS.values[r * k + pos] / rms * gamma[j];
      });
      return { computed: computed, note: t("card_rms", { input: at.name, rms: num(rms), gamma: o.consts.gamma }) };
    },
    rope(o, p, layer, pass, h, out) {
      const at = source(layer, o.inputs[0]);
      const x = entries(pass, at, h);
      if (!x) return missing(t("card_input_missing", { input: at.name, layer: at.layer }));
      const c = o.consts, computed = {};
      const flat = x.n !== out.n; // the input is the whole projection (q normed before the split): head h's slice
      const wf = x.s.meta.full, off = flat ? headOf(out.s.meta.axes, h) * out.n : 0;
      // the input's whole row where the trace kept it (trace/worked.py: a partner past the sample's entries)
      const whole = wf && pass.t >= wf.t[0] && pass.t <= wf.t[1] ? api.fullRow(x.s, pass.t, wf.heads > 1 ? headOf(x.s.meta.axes, h) : 0) : null;
      const get = (i) => (whole ? whole[off + i] : x.byIndex[off + i]);
      if (c.rotation === "none") {
        out.index.forEach((i) => { computed[i] = get(i); });
        return { computed: computed, note: t("card_no_rotation") };
      }
      const pos = api.positionOf(pass), dr = c.rotary_dim, half = dr / 2;
      const inv = c.inv_freq_long && pos + 1 > c.original ? c.inv_freq_long : c.inv_freq, f = c.attention_factor || 1;
      out.index.forEach((i) => {
        if (i >= dr) { computed[i] = get(i); return; } // past the rotary width: unturned
        const j = i < half ? i : i - half, a = get(j), b = get(j + half);
        if (a === undefined || b === undefined) return;
        const ang = pos * inv[j], cs = Math.cos(ang) * f, sn = Math.sin(ang) * f;
        computed[i] = i < half ? a * cs - b * sn : b * cs + a * sn;
      });
      return { computed: computed, note: t("card_rope", { pos: pos, base: c.base, dr: dr }) + " " + ropeTheta(c, inv, half, f) };
    },
    scores(o, p, layer, pass, h, out) {
      const c = o.consts;
      const qa = source(layer, o.inputs[0]);
      let ka = operand(layer, o.inputs[1]);
      const ko = opOf(ka.layer, ka.name);
      if (ko && ko.op === "repeat_kv") ka = operand(ka.layer, ko.inputs[0]);
      const q = api.sample(pass.step, qa.layer, qa.name);
      if (!q || !q.meta.full || pass.t < q.meta.full.t[0] || pass.t > q.meta.full.t[1])
        return missing(t("card_full_missing", { layers: (D.walk.full_layers || []).join(", ") || "\u2014" }));
      const qrow = api.fullRow(q, pass.t, headOf(q.meta.axes, h)), slot0 = api.slotOf(pass);
      const computed = {}, W = c.window, qslot = slot0 + pass.t;
      out.index.forEach((s) => {
        if (c.mask && (s > qslot || (W && qslot - s >= W) || api.isPad(s))) { computed[s] = -Infinity; return; }
        const krow = api.keyRow(layer === "m" ? null : ka, s, headOf(["Hkv"], h));
        if (!krow) return;
        let dot = 0;
        for (let d = 0; d < qrow.length; d++) dot += qrow[d] * krow[d];
        let v = dot * c.scale;
        if (c.softcap) v = c.softcap * Math.tanh(v / c.softcap);
        computed[s] = v;
      });
      return { computed: computed, note: t("card_scores", { n: qrow.length, scale: num(c.scale), label: c.scale_label }) };
    },
    softcap(o, p, layer, pass, h, out) {
      const x = entries(pass, source(layer, o.inputs[0]), h);
      if (!x) return missing(t("card_input_missing", { input: o.inputs[0], layer: layer }));
      const c = o.consts, computed = {}, qslot = api.slotOf(pass) + pass.t;
      out.index.forEach((i) => {
        const masked = c.mask && (i > qslot || (c.window && qslot - i >= c.window) || api.isPad(i));
        computed[i] = masked ? -Infinity : c.cap * Math.tanh(x.byIndex[i] / c.cap);
      });
      return { computed: computed, note: t("card_softcap", { cap: c.cap }) };
    },
    softmax(o, p, layer, pass, h, out) {
      if (o.consts.take === "sink") return sinkColumn(o, layer, pass, h, out);
      const x = entries(pass, source(layer, o.inputs[0]), h);
      if (x && !x.s.exact && (D.walk.full_layers || []).length)
        return missing(t("card_coarse", { layers: D.walk.full_layers.join(", ") }));
      if (!x || !x.s.lse) return missing(t("card_lse_missing"));
      let lse = x.s.lse[x.row], note = t("card_softmax", { lse: num(lse) });
      if (o.consts.sink) { // the head's learned sink logit joins the sum as one more column (gpt-oss)
        if (!out.s.sink) return missing(t("card_gamma_missing"));
        const hk = headOf(out.s.meta.axes, h) || 0, sk = out.s.sink[hk], total = Math.log(Math.exp(lse - sk) + 1) + sk;
        note = t("card_softmax_sink", { lse: num(total), lse_s: num(lse), head: hk, sink: num(sk), share: num(Math.exp(sk - total), 4) });
        lse = total;
      }
      const computed = {};
      out.index.forEach((i) => { const v = x.byIndex[i]; computed[i] = Number.isNaN(v) || v === -Infinity ? 0 : Math.exp(v - lse); });
      return { computed: computed, note: note };
    },
    glu(o, p, layer, pass, h, out) {
      const g = entries(pass, source(layer, o.inputs[0]), h), u = entries(pass, source(layer, o.inputs[1]), h);
      if (!g || !u) return missing(t("card_input_missing", { input: o.inputs.join(", "), layer: layer }));
      const c = o.consts, computed = {};
      out.index.forEach((i) => {
        let a = g.byIndex[i], b = u.byIndex[i];
        if (c.clamp !== null && c.clamp !== undefined) {
          a = Math.min(a, c.clamp); b = Math.max(-c.clamp, Math.min(c.clamp, b));
          computed[i] = a / (1 + Math.exp(-c.alpha * a)) * (b + (c.up_offset || 0));
        } else computed[i] = ACT[c.act](a) * b;
      });
      return { computed: computed, note: c.clamp !== null && c.clamp !== undefined ?
        t("card_glu_clamped", { lim: c.clamp, alpha: c.alpha, off: c.up_offset || 0 }) : t("card_glu", { act: c.act }) };
    },
    add(o, p, layer, pass, h, out) {
      const sa = source(layer, o.inputs[0]), sb = source(layer, o.inputs[1]);
      const a = entries(pass, sa, h), b = entries(pass, sb, h);
      if (!a || !b) return missing(t("card_input_missing", { input: (a ? sb : sa).name, layer: (a ? sb : sa).layer }));
      const computed = {};
      out.index.forEach((i) => { computed[i] = a.byIndex[i] + b.byIndex[i]; });
      return { computed: computed, note: t("card_add", { a: source(layer, o.inputs[0]).name, b: source(layer, o.inputs[1]).name }) };
    },
    scale(o, p, layer, pass, h, out) {
      const x = entries(pass, source(layer, o.inputs[0]), h);
      if (!x) return missing(t("card_input_missing", { input: o.inputs[0], layer: layer }));
      const computed = {};
      out.index.forEach((i) => { computed[i] = x.byIndex[i] * o.consts.factor; });
      return { computed: computed, note: "" };
    },
    select_last(o, p, layer, pass, h, out) {
      const at = source(layer, o.inputs[0]);
      const s = api.sample(pass.step, at.layer, at.name);
      if (!s || !s.values) return missing(t("card_input_missing", { input: at.name, layer: at.layer }));
      const k = s.meta.index.length, row = s.meta.rows - 1, computed = {};
      s.meta.index.forEach((ix, j) => { computed[ix] = s.values[row * k + j]; });
      return { computed: computed, note: t("card_last", { input: at.name }) };
    },
    router(o, p, layer, pass, h, out) {
      const x = entries(pass, source(layer, o.inputs[0]), h);
      if (!x || x.s.meta.index.length !== x.n) return missing(t("card_router_wide"));
      const c = o.consts, z = x.s.meta.index.map((i) => x.byIndex[i]);
      const order = z.map((v, i) => i).sort((a, b) => z[b] - z[a]).slice(0, c.k);
      let w = order.map((i) => z[i]);
      if (c.order === "topk_softmax" || c.order === "top-k, then softmax") { const m = w[0], e = w.map((v) => Math.exp(v - m)), s = e.reduce((a, b) => a + b, 0); w = e.map((v) => v / s); } // the second: a trace before keys
      else if (c.renormalise) { const s = w.reduce((a, b) => a + b, 0); w = w.map((v) => v / s); }
      const computed = {};
      out.index.forEach((i) => { computed[i] = 0; });
      order.forEach((e, j) => { computed[e] = w[j]; });
      return { computed: computed, note: t("card_router", { k: c.k }) };
    },
  };

  function sameValue(a, b) { // masked entries are -inf in the computation and NaN (null in JSON) in the trace
    const ma = a === -Infinity || Number.isNaN(a), mb = b === -Infinity || Number.isNaN(b);
    return ma && mb ? 0 : ma || mb ? Infinity : Math.abs(a - b);
  }

  // the card of point p in `layer` ("m" outside the layers) for one pass, token row and head
  function work(p, layer, pass, h, s) {
    const o = opOf(layer, p.name);
    if (!o) return { html: "" };
    const res = { op: o.op, head: headOf(s && s.meta.axes ? s.meta.axes : p.axes, h), formula: formulaOf(layer, p.name) };
    let html = "<p class=formula data-formula>" + esc(res.formula || "") + "</p>";
    const fn = WORK[o.op];
    if (!fn || !s || !s.values || !s.meta.axes) { res.html = html; return res; }
    const row = api.rowOf(s.meta.axes, s.meta.shape, pass.t, h), k = s.meta.index.length;
    const out = { s: s, row: row, index: s.meta.index, n: s.meta.shape[s.meta.shape.length - 1] };
    out.values = s.meta.index.map((ix, j) => s.values[row * k + j]);
    const w = fn(o, p, layer, pass, h, out);
    if (w.missing) { res.missing = w.missing; res.html = html + "<p class=note>" + esc(w.missing) + "</p>"; return res; }
    let err = 0, big = 0;
    const comp = out.index.map((i, j) => {
      const v = w.computed[i];
      if (v === undefined) return undefined;
      err = Math.max(err, sameValue(v, out.values[j]));
      if (Number.isFinite(out.values[j])) big = Math.max(big, Math.abs(out.values[j]));
      return v;
    });
    // a check holds only over values it computed: a card with an entry it could not work out marks nothing
    const undone = out.index.filter((ix, j) => comp[j] === undefined);
    if (undone.length) res.missing = t("card_not_computed", { n: undone.length, of: out.index.length, entries: undone.join(", ") });
    else { res.err = err; res.rel = big > 0 ? err / big : err; }
    const ok = res.err <= 1e-5 || res.rel <= 1e-4;
    html += (w.note ? "<p class=note>" + esc(w.note) + "</p>" : "") +
      api.walkTable(out.index, [[t("computed"), comp.map((v) => (v === undefined ? "\u00b7" : api.cellNum(v)))],
        [t("recorded"), out.values.map((v) => api.cellNum(v))]]) +
      (res.missing ? "<p class=\"check none\">" + esc(res.missing) + "</p>" :
        "<p class=\"check " + (ok ? "ok" : "bad") + "\">" + (ok ? "\u2713 " : "\u2717 ") +
        esc(t("card_check", { err: num(res.err, 3), rel: num(res.rel, 3) })) + "</p>");
    res.html = html;
    return res;
  }
  return { work: work, opOf: opOf, planOf: planOf };
};
