// llmtrace report: the worked examples of the walk-through, one card per point, from the model's declared maths
// (D.maths: the trace's run.maths, model/maths.py). A card names the point's operation (data-op), shows its formula
// with this layer's constants, and puts the values the one float64 evaluator computed when the trace was recorded
// (trace/cards.py, model/recompute.py) beside the trace's own values: data-max-error (largest |computed - recorded|
// of the row, worked out when the page was written) and data-max-rel (that over the row's largest |recorded|). A
// matrix product's card works one output entry as its dot product. Nothing is computed here: no point name, no
// family and no formula is evaluated in JavaScript; a card whose values the trace did not compute says so.
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
  function headOf(axes, h) { // the head index a point's row uses for query head h, or null
    if (!axes) return null;
    if (axes.indexOf("H") >= 0) return h;
    if (axes.indexOf("Hkv") >= 0) return Math.floor(h / (D.run.model.n_heads / D.run.model.n_kv_heads));
    return null;
  }
  const cardLayers = D.walk.card_layers || [];
  // the words of a card, from the layer's constants and the numbers the trace computed for this row (c.aux)
  function ropeTheta(c, inv, half, f, layer, name) {
    const shown = Array.from(inv.slice(0, 8), (v, i) => "\u03b8" + i + " = " + num(v, 4)).join(", ") + (half > 8 ? ", \u2026" : "");
    let s = t("card_rope_theta", { last: half - 1, thetas: shown });
    const sc = c.scaling || {}, w = layer === "m" ? null : ((D.maths.rope || [])[R.layer_kind[layer]] || {})[name];
    if (!w) return s;
    if (sc.rope_type === "yarn")
      s += " " + t("card_rope_yarn", { s: sc.factor, L: sc.original_max_position_embeddings, bf: sc.beta_fast, bs: sc.beta_slow,
        i: w.i, ti: num(inv[w.i], 4), bi: num(w.plain, 4), f: num(f, 4) });
    else if (sc.rope_type && sc.rope_type !== "default")
      s += " " + t("card_rope_scaled", { kind: sc.rope_type, i: w.i, ti: num(inv[w.i], 4), bi: num(w.plain, 4) });
    return s;
  }
  const NOTE = {
    rmsnorm: (o, layer, pass, h, c) => (c.aux && c.aux.rms ? t("card_rms", { input: source(layer, o.inputs[0]).name, rms: num(c.aux.rms[c.row]), gamma: o.consts.gamma || "none" }) : ""),
    rope(o, layer, pass, h, c, name) {
      const k = o.consts;
      if (k.rotation === "none") return t("card_no_rotation");
      const pos = api.positionOf(pass), inv = k.inv_freq_long && pos + 1 > k.original ? k.inv_freq_long : k.inv_freq;
      return t("card_rope", { pos: pos, base: k.base, dr: k.rotary_dim }) + " " + ropeTheta(k, inv, inv.length, k.attention_factor || 1, layer, name);
    },
    scores(o, layer) {
      const q = source(layer, o.inputs[0]), qs = api.sample(0, q.layer, q.name);
      return t("card_scores", { n: qs ? qs.meta.shape[qs.meta.shape.length - 1] : "D", scale: num(o.consts.scale), label: o.consts.scale_label });
    },
    softcap: (o) => t("card_softcap", { cap: o.consts.cap }),
    softmax(o, layer, pass, h, c) {
      const a = c.aux || {};
      if (o.consts.take === "sink") {
        const at = c.index.indexOf(pass.t);
        return at < 0 ? "" : t("card_sink", { share: num(c.values[at], 4) });
      }
      if (!a.lse) return "";
      if (a.sink) return t("card_softmax_sink", { lse: num(a.lse[c.row]), lse_s: num(a.lse_s[c.row]), head: headOf(c.axes, h) || 0,
        sink: num(a.sink[c.row]), share: num(a.share[c.row], 4) });
      return t("card_softmax", { lse: num(a.lse[c.row]) });
    },
    glu: (o) => (o.consts.clamp !== null && o.consts.clamp !== undefined ?
      t("card_glu_clamped", { lim: o.consts.clamp, alpha: o.consts.alpha, off: o.consts.up_offset || 0 }) : t("card_glu", { act: o.consts.act })),
    add: (o, layer) => t("card_add", { a: source(layer, o.inputs[0]).name, b: source(layer, o.inputs[1]).name }),
    select_last: (o, layer) => t("card_last", { input: source(layer, o.inputs[0]).name }),
    router: (o) => t("card_router", { k: o.consts.k }),
  };
  // a matrix product's first kept output entry of this row as y_i = Σ_j x_j·W_ij (+ b_i): the input row's and the
  // weight row's first entries j, their products, the other terms' sum and the bias, as the trace computed them
  // (trace/cards.py: each input row kept once, read by d.xg output rows in turn; d.wg weight rows, cycled)
  function dotHtml(d, o, layer, name, row, y) {
    if (!d) return "";
    const k = d.j.length, at = (v, r) => Array.from(v.slice(r * k, (r + 1) * k));
    const xr = Math.floor(row / d.xg), wr = row % d.wg; // the input row this output row reads, and its weight row
    const input = source(layer, o.inputs[0]).name, w = (o.weights || [])[0] || "W";
    let html = "<div class=dot data-dot-entry=\"" + d.i + "\"><p>" + esc(t("card_dot", { i: d.i, out: name, input: input, w: w, n: d.n })) + "</p>" +
      api.walkTable(d.j, [["x\u2c7c (" + input + ")", at(d.x, xr).map(api.cellNum)], ["W\u1d62\u2c7c (" + w + ")", at(d.w, wr).map(api.cellNum)],
        ["x\u2c7c\u00b7W\u1d62\u2c7c", at(d.p, row).map(api.cellNum)]]);
    html += "<p class=note data-dot-rest>" + esc(t(d.b ? "card_dot_rest_bias" : "card_dot_rest", { m: d.n - k, rest: api.cellNum(d.rest[row]),
      b: d.b ? api.cellNum(d.b[wr]) : "", out_i: name + "[" + d.i + "]", y: api.cellNum(y) })) + "</p></div>";
    return html;
  }

  // the card's computed values ({values, errors, aux, dot}) of the sample s, unpacked once (report/walk.py card_values)
  function computedOf(s) {
    if (s._card !== undefined) return s._card;
    const x = s.meta.x && s.meta.x.c ? s.meta.x : null;
    if (!x) return (s._card = null);
    const aux = {};
    Object.keys(x.aux || {}).forEach((k) => { aux[k] = api.unpack(x.aux[k]); });
    const dot = x.dot ? Object.assign({}, (D.walk.dot_weights || {})[s.meta.at] || {}, x.dot) : null; // w, b: kept once
    if (dot) {
      ["x", "w", "p", "rest", "b"].forEach((k) => { if (dot[k]) dot[k] = api.unpack24(dot[k]); });
      dot.j = Array.from({ length: dot.k }, (v, i) => i); // its first k terms
    }
    // the computed values: an entry whose 24 bits equal the recorded one's is marked in "same", the others follow
    const same = api.bytes(x.c.same), other = api.unpack24(x.c.v), values = new Float32Array(s.values.length);
    let o = 0;
    for (let i = 0; i < values.length; i++) values[i] = (same[i >> 3] >> (i & 7)) & 1 ? s.values[i] : other[o++];
    return (s._card = { values: values, errors: api.unpack24(x.e), aux: aux, dot: dot });
  }

  // the card of point p in `layer` ("m" outside the layers) for one pass, token row and head
  function work(p, layer, pass, h, s) {
    const o = opOf(layer, p.name);
    if (!o) return { html: "" };
    const res = { op: o.op, head: headOf(s && s.meta.axes ? s.meta.axes : p.axes, h), formula: formulaOf(layer, p.name) };
    let html = "<p class=formula data-formula>" + esc(res.formula || "") + "</p>";
    if (!s || !s.values || !s.meta.axes) { res.html = html; return res; }
    const row = api.rowOf(s.meta.axes, s.meta.shape, pass.t, h), k = s.meta.index.length;
    const values = s.meta.index.map((ix, j) => s.values[row * k + j]);
    const c = computedOf(s);
    if (!c) { // the trace computed no values for this card: an older trace, or a layer outside the card layers
      res.missing = layer !== "m" && cardLayers.length && cardLayers.indexOf(layer) < 0 ?
        t("card_other_layer", { layers: cardLayers.join(", ") }) : t("card_uncomputed");
      res.html = html + "<p class=\"check none\">" + esc(res.missing) + "</p>";
      return res;
    }
    const comp = Array.from(c.values.slice(row * k, (row + 1) * k));
    const here = { row: row, index: s.meta.index, axes: s.meta.axes, values: comp, aux: {} };
    Object.keys(c.aux).forEach((a) => { here.aux[a] = c.aux[a]; });
    const note = NOTE[o.op] ? NOTE[o.op](o, layer, pass, h, here, p.name) : "";
    // a check holds only over values it computed: a card with an entry it could not work out marks nothing
    const undone = s.meta.index.filter((ix, j) => Number.isNaN(comp[j]));
    if (undone.length) res.missing = t("card_not_computed", { n: undone.length, of: k, entries: undone.join(", ") });
    else { res.err = c.errors[2 * row]; res.rel = c.errors[2 * row + 1]; }
    const ok = res.err <= 1e-5 || res.rel <= 1e-4;
    html += (note ? "<p class=note>" + esc(note) + "</p>" : "") +
      api.walkTable(s.meta.index, [[t("computed"), comp.map((v) => (Number.isNaN(v) ? "\u00b7" : api.cellNum(v)))],
        [t("recorded"), values.map((v) => api.cellNum(v))]]) +
      (res.missing ? "<p class=\"check none\">" + esc(res.missing) + "</p>" :
        "<p class=\"check " + (ok ? "ok" : "bad") + "\">" + (ok ? "\u2713 " : "\u2717 ") +
        esc(t("card_check", { err: num(res.err, 3), rel: num(res.rel, 3) })) + "</p>") +
      dotHtml(c.dot, o, layer, p.name, row, comp[0]);
    res.html = html;
    return res;
  }
  return { work: work, opOf: opOf, planOf: planOf };
};
