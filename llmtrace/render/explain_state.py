"""explain's view of a layer whose memory is a recurrent state (run.explain_state's `delta_rule` and `state_cache`
records): one delta-rule update on real numbers, then why no cache grows. Every line by its key in the view's
catalogue (render.say)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.render.generate import fmt_num, print_fitted, visible
from llmtrace.render.say import Say, verbatim
from llmtrace.units import human_bytes


def _title(console: Console, text: str, formula: str = "") -> None:
    console.print()
    line = Text(text, style="bold cyan")
    if formula:
        line.append_text(verbatim(formula, "bold cyan"))
    console.print(line)


def _note(console: Console, text: str) -> None:
    console.print(Text(text, style="dim"))


def _row(values: list) -> str:
    return "  ".join(f"{v:>9.4f}" for v in values) + ("  …" if values else "")


def _check(diff: float) -> Text:
    ok = diff <= 1e-4
    return Text(("✓ " if ok else "✗ ") + fmt_num(diff), style="green" if ok else "red")


def _at(toks: list[str], t: int) -> Text:
    """'(12: fox)': the position and its token, the token as it is."""
    return Text.assemble(f"({t}: ", verbatim(visible(toks[t]) if t < len(toks) else str(t)), ")")


def _recurrence(console: Console, ev: dict, toks: list[str], say: Say, key: str, title: dict, what: dict,
                scalars: str, rows: list[tuple[str, str]], states: list[tuple[str, str]]) -> None:
    """One recurrent state's update at the last token, for one head: its title and formula, the scalars that decay and
    write it, the first entries of the vectors it reads and writes (rows: label, event key), the state's corner before,
    decayed, written and after (states: header key, event key), and the two checks against the pass."""
    console.print()
    console.print(Text.assemble(Text(say(f"{key}.title", **title), style="bold cyan"), _at(toks, ev["position"]),
                                Text(": ", style="bold cyan"), verbatim(ev["formula"], "bold cyan")))
    _note(console, say(f"{key}.what", **what))
    console.print(scalars)
    t_ = Table(box=None, padding=(0, 1), header_style="bold")
    t_.add_column("", justify="left")
    t_.add_column(say(f"{key}.first", n=len(ev[rows[0][1]]), **what), justify="left")
    for label, name in rows:
        t_.add_row(label, _row(ev[name]))
    print_fitted(console, t_, say)
    grid = Table(box=None, padding=(0, 1), header_style="bold")
    for header, _ in states:
        grid.add_column(say(header), justify="right")
    first = ev[states[0][1]]
    for i in range(len(first)):
        grid.add_row(*[" ".join(f"{v:8.4f}" for v in ev[name][i]) for _, name in states])
    console.print(Text(say(f"{key}.corner", last=len(first) - 1)))
    print_fitted(console, grid, say)
    console.print(Text.assemble(say(f"{key}.check_state"), _check(ev["check_state_max_abs_diff"]),
                                say(f"{key}.check_out"), _check(ev["check_out_max_abs_diff"])))
    _note(console, say(f"{key}.whole", **what))


def delta_rule(console: Console, ev: dict, toks: list[str], say: Say) -> None:
    """③-⑤ for a linear-attention layer: the state's update at the last token, for one value head."""
    dk, dv = ev["shape_state"][1:]
    _recurrence(console, ev, toks, say, "explain.delta", {"head": ev["head"]}, {"dk": dk, "dv": dv},
                f"α = {ev['alpha']:.6g}   β = {ev['beta']:.6g}   ‖k‖ = {ev['norm_k']:.4g} " + say("explain.delta.l2"),
                [(say("explain.delta.v"), "v"), (say("explain.delta.held"), "held"), ("δ = β·(v − m)", "delta"),
                 (say("explain.delta.out"), "out")], [("explain.delta.s_before", "S_before"), ("explain.delta.s_decayed", "S_decayed"),
                 ("explain.delta.write", "write"), ("explain.delta.s_after", "S_after")])


def ssm_scan(console: Console, ev: dict, toks: list[str], say: Say) -> None:
    """③-⑤ for a Mamba2 layer: the state's update at the last token, for one head."""
    P, N = ev["shape_state"][1:]
    _recurrence(console, ev, toks, say, "explain.scan", {"head": ev["head"], "group": ev["group"]}, {"P": P, "N": N},
                f"Δ = {ev['dt']:.6g}   a = exp(Δ·A) = {ev['a']:.6g}   D = {ev['D']:.6g}",
                [(say("explain.scan.x", n=len(ev["x"]), P=P), "x"), (say("explain.scan.B", n=len(ev["B"]), N=N), "B"),
                 (say("explain.scan.C", n=len(ev["C"]), N=N), "C"), (say("explain.scan.read"), "read"),
                 (say("explain.scan.skip"), "skip"), ("y = h·C + D·x", "out")],
                [("explain.scan.h_before", "h_before"), ("explain.scan.h_decayed", "h_decayed"),
                 ("explain.scan.write", "write"), ("explain.scan.h_after", "h_after")])


def state_cache(console: Console, ev: dict, say: Say) -> None:
    """⑧ for a state layer: what it keeps, and why nothing grows."""
    kept = ", ".join(f"{n} [{' × '.join(str(d) for d in s)}]" for n, s in ev["state"].items())
    if ev.get("reads") is not None:  # a KV-shared layer (model.kinds.shared_kv): nothing of its own
        _title(console, say("explain.shared.title", reads=ev["reads"]))
        console.print(say("explain.shared.why", reads=ev["reads"]))
        return
    window = ev.get("memory_kind") == "window"  # a convolution's last inputs (model.memory's kinds), not a state
    _title(console, say("explain.state.title", kept=kept, bytes=f"{ev['state_bytes']:,}")
           + ("" if window else say("explain.state.float32")))
    T, per = ev["n_tokens"], ev["kv_bytes_per_token"]
    console.print(say("explain.state.same", T=T, context=f"{ev['context']:,}", bytes=f"{ev['state_bytes']:,}")
                  + say("explain.window.flow" if window else "explain.state.flow"))
    for line in (ev.get("updates") or {}).values():
        console.print(verbatim("  " + line, "dim"))
    console.print(say("explain.state.attention", layers=", ".join(map(str, ev["attention_layers"])), per=f"{per:,}",
                      now=f"{ev['kv_bytes_now']:,}", at=human_bytes(ev["kv_bytes_context"]),
                      context=f"{ev['context']:,}", even=f"{ev['break_even']:,}"))
    price = say("explain.window.price" if window else "explain.state.price")
    _note(console, say("explain.state.pay", price=price, n=len(ev["state_layers"]),
                       of=len(ev["state_layers"]) + len(ev["attention_layers"])))


def conv_window(console: Console, ev: dict, toks: list[str], say: Say) -> None:
    """③ for a short convolution layer: one channel's convolution at the last token, and the window it leaves."""
    d, t, L = ev["channel"], ev["position"], ev["kernel"]
    console.print()
    console.print(Text.assemble(Text(say("explain.conv.title", channel=d, L=L), style="bold cyan"), _at(toks, t)))
    _note(console, say("explain.conv.what", L=L, D=ev["width"]))
    grid = Table(box=None, padding=(0, 1), header_style="bold")
    for key, just in (("explain.col.pos", "right"), ("explain.col.token", "left"), ("explain.conv.input", "right"),
                      ("explain.conv.weight", "right"), ("explain.conv.product", "right")):
        grid.add_column(say(key, L=L), justify=just)
    for r in ev["rows"]:
        p = r["position"]
        where = verbatim(visible(toks[p])) if 0 <= p < len(toks) else Text(say("explain.conv.before"), style="dim")
        grid.add_row(str(p), where, f"{r['input']:.4f}", f"{r['weight']:.4f}", f"{r['product']:.4f}")
    print_fitted(console, grid, say)
    console.print(Text.assemble(f"z = Σ = {ev['sum']:.6g}   ", say("explain.conv.vs_pass", value=f"{ev['pass']:.6g}"),
                                _check(ev["check"])))
    console.print(f"y = C · z = {ev['gate']:.6g} × {ev['sum']:.6g} = {ev['gated']:.6g}   "
                  + say("explain.conv.gated_pass", value=f"{ev['gated_pass']:.6g}"))
    window = "  ".join(f"{x:.4f}" for x in ev["window"])
    line = Text(say("explain.conv.window", n=L - 1, lo=t - L + 2, hi=t, values=window))
    if ev.get("window_check") is not None:
        line.append_text(Text("  ") + _check(ev["window_check"]))
    console.print(line)
    _note(console, say("explain.conv.memory", n=L - 1, D=ev["width"], total=ev["width"] * (L - 1)))
