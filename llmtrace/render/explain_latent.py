"""explain's view of a multi-head latent attention layer (the `latent_cache` section model.kinds.mla computes): what its cache
keeps per token beside MHA and GQA with the same heads, and its absorbed form worked on the pass's numbers. Every
line by its key in the view's catalogue (render.say)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.render.generate import fmt_num, print_fitted
from llmtrace.render.say import Say, verbatim


def _row(values: list) -> str:
    return "  ".join(f"{v:>9.4f}" for v in values)


def _check(diff: float, tol: float) -> Text:
    ok = diff <= tol
    return Text(("✓ " if ok else "✗ ") + fmt_num(diff), style="green" if ok else "red")


def latent(console: Console, ev: dict, say: Say) -> None:
    """③-⑤ for an MLA layer: the latent against MHA and GQA, then the two forms of one head's scores and output."""
    z = ev["sizes"]
    console.print()
    console.print(Text(say("explain.latent.title", head=ev["head"]), style="bold cyan"))
    _cache(console, ev, say, z)
    w = ev.get("worked")
    if w is None:
        console.print(Text(say("explain.latent.no_weights"), style="dim"))
        return
    console.print(Text(say("explain.latent.scores", head=ev["head"], t=w["position"], S=w["slots"]), style="bold"))
    t = Table(box=None, padding=(0, 1), header_style="bold")
    t.add_column("", justify="left")
    t.add_column(say("explain.latent.first_slots", n=len(w["scores_up"]), S=w["slots"]), justify="left")
    t.add_row(verbatim("q_nope · (c_s W_kb)"), _row(w["scores_up"]))
    t.add_row(verbatim("(W_kb q_nope) · c_s"), _row(w["scores_absorbed"]))
    print_fitted(console, t, say)
    console.print(Text.assemble(say("explain.latent.same_scores", R=z["R"]), _check(w["scores_diff"], 1e-9 * max(1.0, *map(abs, w["scores_up"])))))
    t = Table(box=None, padding=(0, 1), header_style="bold")
    t.add_column("", justify="left")
    t.add_column(say("explain.latent.first_dims", n=len(w["out_up"]), Dv=z["Dv"]), justify="left")
    t.add_row(verbatim("Σ P_s (c_s W_vbᵀ)"), _row(w["out_up"]))
    t.add_row(verbatim("(Σ P_s c_s) W_vbᵀ"), _row(w["out_absorbed"]))
    t.add_row(say("explain.latent.pass"), _row(w["out_pass"]))
    print_fitted(console, t, say)
    console.print(Text.assemble(say("explain.latent.same_out"), _check(w["out_diff"], 1e-9), say("explain.latent.vs_pass"),
                                _check(w["out_pass_diff"], 1e-4)))
    _note = lambda text: console.print(Text(text, style="dim"))  # noqa: E731
    _note(say("explain.latent.cost", S=w["slots"], up=f"{w['flops_up']:,}", absorbed=f"{w['flops_absorbed']:,}"))
    _note(say("explain.latent.runs"))


def _cache(console: Console, ev: dict, say: Say, z: dict) -> None:
    """The latent's numbers a token a layer, beside K and V of G heads of the same widths (G = H: MHA; less: GQA)."""
    n, b = ev["latent_numbers"], ev["latent_bytes"]
    console.print(say("explain.latent.keeps", R=z["R"], Dr=z["Dr"], n=n, bytes=f"{b:,}"))
    t = Table(box=None, padding=(0, 1), header_style="bold")
    for name, just in ((say("explain.latent.col.cache"), "left"), (say("explain.latent.col.numbers"), "right"),
                       (say("explain.latent.col.bytes"), "right"), (say("explain.latent.col.vs"), "right")):
        t.add_column(name, justify=just)
    t.add_row(Text(say("explain.latent.row.latent", R=z["R"], Dr=z["Dr"]), style="bold"), f"{n:,}", f"{b:,}", "1×")
    for r in ev["cache_rows"]:
        what = say.n("explain.latent.row.mha" if r["kv_heads"] == z["H"] else "explain.latent.row.gqa", r["kv_heads"],
                     Dq=z["Dn"] + z["Dr"], Dv=z["Dv"])
        t.add_row(what, f"{r['numbers']:,}", f"{r['bytes']:,}", f"{r['numbers'] / n:.2f}×")
    print_fitted(console, t, say)
    width = z["Dn"] + z["Dr"] + z["Dv"]
    console.print(Text(say("explain.latent.equal", g=f"{n / width:.2f}", width=width), style="dim"))
