// The comparison page's one interaction: choose a point (a cell of the heat strip) and see its error per position.
// The geometry is the page's: bar heights come as 0..1 fractions of the log scale (fields h_rel, h_added), computed
// in Python; this script only places them. It reads the JSON in #compare-data and changes nothing else.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("compare-data").textContent);
  const svg = document.getElementById("point-svg");
  const label = document.getElementById("point-label");
  const numbers = document.getElementById("point-numbers");
  const NS = "http://www.w3.org/2000/svg";
  const W = data.bar, H = data.height, L = data.left, TOP = 8; // TOP: room for the top tick's label // L: the left margin, where the y axis and its ticks are

  function el(name, attrs, text) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function tr(key, vals) { // a text of the page's language (the catalogue's "js." keys), {name} filled in
    let s = (data.words || {})[key] || key;
    Object.keys(vals || {}).forEach((k) => { s = s.split("{" + k + "}").join(String(vals[k])); });
    return s;
  }
  function fmt(x) { return x === null || x === undefined ? "—" : (x === 0 ? "0" : x.toExponential(2).replace(/e([+-])0*(\d)/, (m, s, d) => "e" + (s === "-" ? "-" : "") + d)); }

  function choose(key) {
    const p = data.points[key];
    if (!p) return;
    document.querySelectorAll("rect.cell.chosen").forEach((c) => c.classList.remove("chosen"));
    document.querySelectorAll('rect.cell[data-key="' + key + '"]').forEach((c) => c.classList.add("chosen"));
    label.textContent = p.label;
    svg.dataset.key = key;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.appendChild(el("line", { class: "axis", x1: L - 2, x2: L - 2, y1: TOP, y2: TOP + H }));
    data.ticks.forEach((t) => { // the log scale's ticks, 1e-9 .. 1e-1
      const y = TOP + H - t.f * H;
      svg.appendChild(el("line", { class: "axis", x1: L - 6, x2: L - 2, y1: y, y2: y }));
      svg.appendChild(el("text", { class: "ytick", x: L - 8, y: y + 4, "text-anchor": "end" }, t.text));
    });
    const half = p.h_added.length ? (W - 4) / 2 : W - 4;
    let worst = 0;
    p.rel.forEach((v, i) => {
      if (v !== null && v > p.rel[worst]) worst = i;
    });
    p.h_rel.forEach((f, i) => {
      if (f === null) return;
      const h = Math.max(f > 0 ? 1 : 0, f * H);
      const r = el("rect", { class: "bar", x: L + i * W + 2, y: TOP + H - h, width: half, height: h });
      r.appendChild(el("title", {}, tr("cmp_bar", { position: data.positions[i].position, token: data.positions[i].token,
        err: fmt(p.rel[i]), abs: fmt(p.max_abs[i]), cos: p.cos[i] }) + (p.added.length ? tr("cmp_bar_added", { added: fmt(p.added[i]) }) : "")));
      svg.appendChild(r);
      if (p.h_added.length && p.h_added[i] !== null) {
        const ha = Math.max(p.h_added[i] > 0 ? 1 : 0, p.h_added[i] * H);
        svg.appendChild(el("rect", { class: "bar added", x: L + i * W + 2 + half, y: TOP + H - ha, width: half, height: ha }));
      }
    });
    data.positions.forEach((pos, i) => {
      svg.appendChild(el("text", { class: "token", translate: "no", transform: "translate(" + (L + i * W + W / 2 + 3) + "," + (TOP + H + 8) +
        ") rotate(60)" }, pos.token));
    });
    svg.dataset.bars = String(svg.querySelectorAll("rect.bar:not(.added)").length);
    numbers.textContent = p.rel.length ? tr("cmp_largest", { position: data.positions[worst].position,
      err: fmt(p.rel[worst]), abs: fmt(p.max_abs[worst]), cos: p.cos[worst] }) : "";
  }

  document.querySelectorAll("rect.cell[data-key]").forEach((c) => {
    c.addEventListener("click", () => choose(c.dataset.key));
  });
  if (data.chosen) choose(data.chosen);
})();
