"""The terminal view of `llmtrace eval`: a line per chunk as it finishes, and the summary as llama.cpp's
llama-perplexity prints it (its KL-divergence statistics with two sides). Plain text, from the events alone."""

from __future__ import annotations

import math
from typing import Optional

from llmtrace.words import in_words


def _pm(f: Optional[dict], digits: int = 4, pct: bool = False) -> str:
    if not f:
        return "n/a"
    k = 100.0 if pct else 1.0
    unit = "%" if pct else ""
    return f"{f['value'] * k:.{digits}f} ± {f['uncertainty'] * k:.{digits}f}{unit}"


def clock(seconds: float) -> str:
    """1:02:03, 4:05, or '?'."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_text(p, width: int = 80) -> str:
    """Where a run is, in at most `width` columns: chunks done, the running figure, the rate and the time left (the
    parts that do not fit are left out, the time left last)."""
    count = f"{p.done:,}/{p.total:,}"
    parts = [count]
    r = p.running
    if r is not None:
        if "kld" in r:
            parts.append(f"KLD {r['kld']['mean']:.5f} ± {r['kld']['uncertainty']:.5f}")
        else:
            parts.append(f"PPL {r['ppl']['value']:.3f} ± {r['ppl']['uncertainty']:.3f}")
    rate = f"{p.tokens_per_s:,.0f} tok/s" if p.tokens_per_s is not None else None
    left = f"{clock(p.eta_s)} left" if p.eta_s is not None else None
    for extra in ([rate, left], [left], []):
        line = ", ".join(parts + [x for x in extra if x])
        if len(line) <= width:
            return line
    return count


class EvalBar:
    """eval's progress on stderr. On a terminal a live bar that moves with every layer of a pass and every chunk
    scored, the running figure, the measured rate and the time left beside it; elsewhere (a pipe, CI) a plain line
    at each tenth of the run, at most 80 columns."""

    def __init__(self, console=None):
        from llmtrace.console import make_console

        self.console = console or make_console(stderr=True)
        self.live = self.console.is_terminal or self.console.is_jupyter
        self.progress = None
        self.tenth, self.last_done = -1, -1

    def say(self, message: str) -> None:
        """A line about what is happening, above the bar."""
        line = f"eval: {message}"
        if self.progress is not None:
            self.progress.console.print(line, highlight=False, markup=False)
        else:
            print(line, file=self.console.file, flush=True)

    def update(self, p) -> None:
        """Hear a run.eval.Progress."""
        if not self.live:
            self._plain(p)
            return
        from rich.progress import BarColumn, Progress, TextColumn

        width = min(self.console.width, 80)
        text = progress_text(p, width - 16)
        if self.progress is None:
            self.bar = BarColumn(bar_width=10)
            self.progress = Progress(TextColumn("eval"), self.bar, TextColumn("{task.fields[text]}"),
                                     console=self.console)
            self.task = self.progress.add_task("eval", total=p.total, text=text)
            self.progress.start()
        self.bar.bar_width = max(10, width - len(text) - 7)  # "eval" and the spaces between the columns
        self.progress.update(self.task, completed=p.position, total=p.total, text=text)

    def _plain(self, p) -> None:
        if p.running is None or p.done == self.last_done:  # a step within a batch: the terminal's bar only
            return
        self.last_done = p.done
        tenth = 10 * p.done // p.total if p.total else 10
        if tenth > self.tenth or p.done == p.total:
            self.tenth = tenth
            print(f"eval: {progress_text(p, 74)}", file=self.console.file, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def summary_text(header: dict, s: dict) -> str:
    """The final figures, as llama.cpp users read them."""
    lines = []
    if s.get("interrupted"):
        lines.append(f"interrupted after {s['chunks']} of {header['chunks']} chunks (" + in_words("`resume` continues") + ")")
    if not s.get("tokens_scored"):
        return "\n".join(lines + ["no chunk was scored"]) + "\n"
    n = f"{s['tokens_scored']:,} tokens scored in {s['chunks']:,} chunks of {header['ctx']}"
    if "kld" not in s:
        ppl = s["ppl"]
        return "\n".join(lines + [n, f"Final estimate: PPL = {ppl['value']:.4f} +/- {ppl['uncertainty']:.5f}"]) + "\n"
    lines += [n, "", "====== Perplexity statistics ======"]
    lines += [f"Mean PPL(B)                   : {_pm(s['ppl_b'], 6)}",
              f"Mean PPL(A, base)             : {_pm(s['ppl'], 6)}"]
    cor = s.get("ln_ppl_correlation")
    lines.append(f"Cor(ln(PPL(B)), ln(PPL(A)))   : {100 * cor:6.2f}%" if cor is not None else
                 "Cor(ln(PPL(B)), ln(PPL(A)))   : n/a")
    lines += [f"Mean ln(PPL(B)/PPL(A))        : {_pm(s['ln_ppl_ratio'], 6)}",
              f"Mean PPL(B)/PPL(A)            : {_pm(s['ppl_ratio'], 6)}",
              f"Mean PPL(B)-PPL(A)            : {_pm(s['ppl_diff'], 6)}", "", "====== KL divergence statistics ======"]
    kld = s["kld"]
    lines.append(f"Mean    KLD: {kld['mean']:10.6f} ± {kld['uncertainty']:10.6f}   (KL(B‖A): {s['kld_ba']['mean']:.6f})")
    lines += base_bound_lines(header, kld)
    lines += _distribution(kld, "KLD", lambda v: f"{v:10.6f}")
    dp = s["dp"]
    lines += ["", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * dp['mean']:6.3f} ± {100 * dp['uncertainty']:5.3f} %"]
    lines += _distribution(dp, "Δp", lambda v: f"{100 * v:6.3f}%")
    lines += [f"RMS Δp    : {_pm(dp['rms'], 3, True)}", f"Same top p: {_pm(s['same_top'], 3, True)}"]
    if s.get("layers"):
        lines += [""] + layers_text(s["layers"])
    return "\n".join(lines) + "\n"


def base_bound_lines(header: dict, kld: dict) -> list[str]:
    """With a base file: how far its KLD can be from the one-run KLD (eval_score.py derives the bound)."""
    if "bound" not in kld:
        return []
    b = kld["bound"]
    if header.get("base_form") == "exact":
        return [f"(exact base, 16-bit log-probs: within ± {b:.2e} of a one-run KLD)"]
    tail = f"; its tail held {100 * kld['tail']:.2f}% of A's mass" if "tail" in kld else ""
    return [f"(top-{header.get('top_k')} base: a lower bound{tail};",
            f" the KLD is at most {b:.2e} more, at most {kld['mean'] + b:.6f})"]


def _distribution(d: dict, name: str, fmt) -> list[str]:
    if "percentiles" not in d:
        return [f"(no distribution of {name} over fewer than 100 scored tokens)"]
    out = [f"Maximum {name}: {fmt(d['max'])}"]
    for q, v in d["percentiles"].items():
        label = "Median " if q == "50" else f"{float(q):4.1f}%  "
        out.append(f"{label} {name}: {fmt(v)}")
    out.append(f"Minimum {name}: {fmt(d['min'])}")
    return out


def layers_text(lay: dict) -> list[str]:
    """--layers: per stage, the relative error it adds and the accumulated one (mean, median, 99th percentile); where
    positions first diverge; MoE routing agreement."""
    out = ["====== Where the error enters ======",
           "‖a−b‖/‖a‖ over scored positions: added by the stage alone; accumulated to it",
           f"{'stage':<10}{'added mean':>12}{'median':>9}{'p99':>9}{'accum. mean':>13}{'p99':>9}{'first div.':>12}"]
    first = lay["first_divergence"]
    total = sum(first) or 1
    for k, row in enumerate(lay["rows"]):
        name = "embed" if row["where"] == "embed" else "logits" if row["where"] == "logits" else f"layer {row['layer']}"
        ad, ac = row["added"], row["accumulated"]
        out.append(f"{name:<10}{_e(ad['mean']):>12}{_e(ad['p50']):>9}{_e(ad['p99']):>9}{_e(ac['mean']):>13}"
                   f"{_e(ac['p99']):>9}{100 * first[k] / total:>11.1f}%")
    out.append(f"{'never':<10}{'':>52}{100 * first[-1] / total:>11.1f}%")
    for r in lay.get("routing", []):
        out.append(f"layer {r['layer']}: routing agreement {100 * r['agreement']:.2f}% of {r['positions']:,} positions")
    return out


def _e(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1e}"
