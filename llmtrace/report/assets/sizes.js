// llmtrace report: the size of things (report/sizes.py). Every tensor of one pass as a box whose area is its element
// count, at one scale for the whole section, laid out to the section's width. Plain JavaScript, no library, no
// network; everything comes from the section's own JSON (#sizes-data): the boxes, their captions and the views.
//   a box       rows × cols cells of c × c px (c² px² an element): rows the pass's tokens, cols the rest
//   folding     a box wider than the section wraps its columns into bands, one under the other (area unchanged)
//   breaking    a box larger and much taller than the layer's largest is cut with a tear; a button draws it whole
"use strict";
(function () {
  const el = document.getElementById("sizes-data");
  if (!el) return;
  const S = JSON.parse(el.textContent);
  S.entries = S.entries.map((x) => ({ name: x[0], label: x[1] || x[0], shape: x[2], rows: x[3], cols: x[4], split: x[5],
    text: x[6], role: x[7], model: !!x[8], n: x[2].reduce((a, b) => a * b, 1) })); // report/sizes.py packed()
  const $ = (sel, root) => (root || document).querySelector(sel);
  const NS = "http://www.w3.org/2000/svg";
  const fig = $("#sizes-fig"), sel = $("#sizes-layer");
  const whole = new Set(); // the boxes a learner asked to see whole, by name
  let step = S.steps[0], asked = S.steps[0];
  function t(key, vals) {
    let s = S.words[key] || key;
    Object.keys(vals || {}).forEach((k) => { s = s.split("{" + k + "}").join(String(vals[k])); });
    return s;
  }
  function svg(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    Object.keys(attrs).forEach((k) => e.setAttribute(k, attrs[k]));
    if (parent) parent.appendChild(e);
    return e;
  }
  const r3 = (x) => Math.round(x * 1000) / 1000;
  function sig(x) { return x >= 100 ? Math.round(x).toLocaleString("en") : String(Number(x.toPrecision(3))); }

  // the scale: the largest view's own boxes (S.ref elements) fill about W × min(W, 480) px²; at most 12 px a cell
  function cellOf(W) { return Math.min(12, Math.sqrt(W * Math.max(320, Math.min(W, 480)) / Math.max(1, S.ref))); }

  // a box's bands at cell c in width W: whole columns per band, the last band what is left
  function bands(e, c, W) {
    const per = Math.max(1, Math.min(e.cols, Math.floor(W / c + 1e-9)));
    const nb = Math.ceil(e.cols / per), out = [];
    for (let b = 0; b < nb; b++) out.push({ y: b * e.rows * c, w: Math.min(per, e.cols - b * per) * c, h: e.rows * c, from: b * per });
    return { per: per, list: out, w: per * c, h: nb * e.rows * c };
  }

  function drawBox(li, e, c, W, cap, bigN) {
    const B = bands(e, c, W);
    const can = B.h > cap && e.n > bigN; // only a box larger than the layer's largest is ever cut
    const broken = can && !whole.has(e.name);
    const H = broken ? cap : B.h;
    const box = svg("svg", { width: r3(B.w), height: r3(H + (broken ? 6 : 0)), "aria-hidden": "true" });
    let drawn = 0;
    const full = B.list.filter((b) => b.w === B.w).length; // the whole bands are one rect (no seams between them)
    [[0, full * (B.list[0].h), B.w], ...B.list.slice(full).map((b) => [b.y, b.h, b.w])].forEach(([y, h0, w]) => {
      const h = Math.min(h0, H - y);
      if (h <= 0 || w <= 0) return;
      svg("rect", { class: "sz-band", x: 0, y: r3(y), width: r3(w), height: r3(h) }, box);
      drawn += w * h;
    });
    B.list.forEach((b, k) => {
      if (b.y >= H) return;
      const h = Math.min(b.h, H - b.y);
      if (k && b.h >= 6) svg("line", { class: "sz-fold", x1: 0, x2: r3(b.w), y1: r3(b.y), y2: r3(b.y) }, box);
      if (e.split > 1 && (e.cols / e.split) * c >= 4) { // the slices across (heads): a thin line where each begins
        for (let s = 1; s < e.split; s++) {
          const j = s * e.cols / e.split;
          if (j > b.from && j < b.from + B.per) {
            const x = r3((j - b.from) * c);
            svg("line", { class: "sz-split", x1: x, x2: x, y1: r3(b.y), y2: r3(b.y + h) }, box);
          }
        }
      }
    });
    if (broken) { // the tear: a zigzag along the cut
      let d = "M0 " + r3(H);
      for (let x = 0, up = true; x < B.w; x += 8, up = !up) d += " L" + r3(Math.min(B.w, x + 8)) + " " + r3(H + (up ? 5 : 0));
      svg("path", { class: "sz-tear", d: d }, box);
    }
    box.dataset.drawn = String(drawn);
    box.dataset.full = String(e.n * c * c);
    li.classList.toggle("tiny", B.w < 2 || B.h < 2);
    li.style.width = Math.min(W, Math.max(B.w, 150)) + "px";
    li.insertBefore(box, li.firstChild);
    if (B.list.length > 1) {
      const f = document.createElement("span");
      f.className = "sz-fold-note";
      f.textContent = " · " + t("folded", { k: B.list.length });
      $(".sz-cap", li).appendChild(f);
    }
    return { broken: broken, shown: H, full: B.h, drawn: drawn, can: can };
  }

  function caption(e) {
    const p = document.createElement("p");
    p.className = "sz-cap";
    const b = document.createElement("b");
    b.setAttribute("translate", "no");
    b.textContent = e.label;
    const code = document.createElement("code");
    code.textContent = e.text;
    const n = document.createElement("span");
    n.className = "sz-n";
    n.textContent = t("count", { n: e.n.toLocaleString("en") });
    p.append(b, " ", code, " ", n);
    if (e.role) {
      const s = document.createElement("span");
      s.className = "sz-note";
      s.textContent = t(e.role);
      p.append(" ", s);
    }
    return p;
  }

  function draw() {
    if (!fig) return;
    const view = S.lists[S.views[S.steps.indexOf(step)][sel ? S.layers.indexOf(Number(sel.value)) : 0]];
    if (!view) return;
    const W = Math.max(60, fig.clientWidth - 4);
    const c = cellOf(W);
    const big = view.max === null ? null : S.entries[view.max];
    const bigH = big ? bands(big, c, W).h : 0;
    const cap = Math.max(160, 1.5 * bigH);
    const focus = document.activeElement && document.activeElement.closest ? document.activeElement.closest("#sizes-fig button") : null;
    const refocus = focus ? focus.dataset.name : null;
    fig.textContent = "";
    view.g.forEach(([g, es]) => {
      const grp = document.createElement("div");
      grp.className = "sz-group";
      grp.dataset.group = S.groups[g].id;
      const h = document.createElement("h3");
      const id = document.createElement("b");
      id.textContent = S.groups[g].id;
      h.append(id, " ", S.groups[g].title);
      const ul = document.createElement("ul");
      ul.className = "sz-boxes";
      ul.setAttribute("aria-label", fig.dataset.list || "");
      es.forEach((i) => {
        const e = S.entries[i];
        const li = document.createElement("li");
        li.className = "sz-tile" + (e.role ? " sz-" + e.role : "") + (e.model ? " sz-model" : "");
        Object.assign(li.dataset, { i: i, n: e.n, name: e.name, shape: e.shape.join(",") });
        li.appendChild(caption(e));
        const r = drawBox(li, e, c, W, cap, big ? big.n : 0);
        if (r.can) { // a box cut at the cap: what is shown, and a button that draws it whole (or cut again)
          const p = document.createElement("p");
          p.className = "sz-broken";
          if (r.broken) p.textContent = t("broken", { shown: Math.round(r.shown), full: Math.round(r.full),
            pct: (100 * r.drawn / (e.n * c * c)).toFixed(0), x: sig(e.n / big.n), name: big.label }) + " ";
          const btn = document.createElement("button");
          btn.type = "button";
          btn.dataset.name = e.name;
          btn.setAttribute("aria-expanded", String(!r.broken));
          btn.textContent = r.broken ? t("whole") : t("break");
          btn.addEventListener("click", () => {
            if (whole.has(e.name)) whole.delete(e.name); else whole.add(e.name);
            draw();
          });
          p.appendChild(btn);
          li.appendChild(p);
        }
        ul.appendChild(li);
      });
      grp.append(h, ul);
      fig.appendChild(grp);
    });
    if (refocus) { const b = fig.querySelector("button[data-name=\"" + refocus + "\"]"); if (b) b.focus(); }
    fig.dataset.cell = String(c);
    // the key: a square of a round number of elements, at most about 40 px a side
    const keyN = Math.pow(10, Math.max(0, Math.floor(Math.log10(1600 / (c * c)))));
    const side = Math.sqrt(keyN) * c;
    const key = $("#sizes-key");
    if (key) {
      key.textContent = "";
      key.setAttribute("width", r3(side)); key.setAttribute("height", r3(side));
      svg("rect", { x: 0, y: 0, width: r3(side), height: r3(side) }, key);
    }
    const scale = $("#sizes-scale");
    if (scale) scale.textContent = t("scale", { px: sig(c * c), side: sig(c), n: keyN.toLocaleString("en") });
    const at = $("#sizes-step");
    const ph = (S.step_of.find((x) => x[0] === step) || [step, ""])[1];
    if (at) at.textContent = asked === step ? (S.step_of.length ? t("step", { step: step, phase: ph }) : "") : t("nearest", { step: step });
  }

  if (sel) sel.addEventListener("change", draw);
  document.addEventListener("llmtrace:step", (ev) => { // the step bar's index: its step, or the nearest step kept
    const s = S.step_of[ev.detail];
    if (!s) return;
    asked = s[0];
    step = S.steps.reduce((a, b) => (Math.abs(b - asked) < Math.abs(a - asked) ? b : a));
    draw();
  });
  let queued = false;
  window.addEventListener("resize", () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; draw(); });
  });
  draw();
})();
