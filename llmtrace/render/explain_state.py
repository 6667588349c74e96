"""explain's view of a layer whose memory is a recurrent state (run.explain_state's `delta_rule` and `state_cache`
records): one delta-rule update on real numbers, then why no cache grows."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.render.generate import fmt_num, print_fitted, visible
from llmtrace.units import human_bytes


def _title(console: Console, text: str) -> None:
    console.print()
    console.print(Text(text, style="bold cyan"))


def _note(console: Console, text: str) -> None:
    console.print(Text(text, style="dim"))


def _row(values: list) -> str:
    return "  ".join(f"{v:>9.4f}" for v in values) + ("  …" if values else "")


def _check(diff: float) -> Text:
    ok = diff <= 1e-4
    return Text(("✓ " if ok else "✗ ") + fmt_num(diff), style="green" if ok else "red")


def delta_rule(console: Console, ev: dict, toks: list[str]) -> None:
    """③-⑤ for a linear-attention layer: the state's update at the last token, for one value head."""
    h, t = ev["head"], ev["position"]
    dk, dv = ev["shape_state"][1:]
    _title(console, f"③-⑤ s6.4-s6.8  the delta rule, value head {h}, at the last token ({t}: "
                    f"{visible(toks[t]) if t < len(toks) else t}): {ev['formula']}")
    _note(console, f"this layer has no attention scores and no KV cache: its memory is a state S of {dk} × {dv} "
                   f"numbers per value head, written at each token's key and read with its query; α (0 < α < 1) is "
                   f"how much of S the token keeps, β how strongly it writes")
    console.print(f"α = {ev['alpha']:.6g}   β = {ev['beta']:.6g}   ‖k‖ = {ev['norm_k']:.4g} (L2-normalized)")
    t_ = Table(box=None, padding=(0, 1), header_style="bold")
    t_.add_column("", justify="left")
    t_.add_column(f"first {len(ev['v'])} of {dv} value dims", justify="left")
    t_.add_row("v  (the token's value)", _row(ev["v"]))
    t_.add_row("m = (α·S₀)ᵀk  (held at k)", _row(ev["held"]))
    t_.add_row("δ = β·(v − m)", _row(ev["delta"]))
    t_.add_row("o = Sᵀq  (the output)", _row(ev["out"]))
    print_fitted(console, t_)
    grid = Table(box=None, padding=(0, 1), header_style="bold")
    for name in ("S₀ (before)", "α·S₀", "k ⊗ δ (the write)", "S (after)"):
        grid.add_column(name, justify="right")
    for i in range(len(ev["S_before"])):
        grid.add_row(*[" ".join(f"{v:8.4f}" for v in ev[key][i]) for key in ("S_before", "S_decayed", "write",
                                                                              "S_after")])
    console.print(Text(f"the state's corner (rows: key dims 0-{len(ev['S_before']) - 1}; columns: value dims)"))
    print_fitted(console, grid)
    console.print(Text.assemble("S computed in float64 vs the state the pass left ", _check(ev["check_state_max_abs_diff"]),
                                ";  o vs the pass's output ", _check(ev["check_out_max_abs_diff"])))
    _note(console, "S₀ is the state after the earlier tokens (the same rule from zeros); the whole S is "
                   f"{dk} × {dv}, the corner shows how one token moves it")


def ssm_scan(console: Console, ev: dict, toks: list[str]) -> None:
    """③-⑤ for a Mamba2 layer: the state's update at the last token, for one head."""
    h, t = ev["head"], ev["position"]
    P, N = ev["shape_state"][1:]
    _title(console, f"③-⑤ s6.4-s6.8  the selective scan, head {h} (B and C of group {ev['group']}), at the last "
                    f"token ({t}: {visible(toks[t]) if t < len(toks) else t}): {ev['formula']}")
    _note(console, f"this layer has no attention scores and no KV cache: its memory is a state h of {P} × {N} numbers "
                   f"per head; each token writes its x (P) along its B (N), scaled by its step Δ, after the state "
                   f"decays by a = exp(Δ·A) (0 < a < 1), and reads it back with its C")
    console.print(f"Δ = {ev['dt']:.6g}   a = exp(Δ·A) = {ev['a']:.6g}   D = {ev['D']:.6g}")
    t_ = Table(box=None, padding=(0, 1), header_style="bold")
    t_.add_column("", justify="left")
    t_.add_column("first values", justify="left")
    t_.add_row(f"x  (the token's, first {len(ev['x'])} of {P})", _row(ev["x"]))
    t_.add_row(f"B  (write, first {len(ev['B'])} of {N})", _row(ev["B"]))
    t_.add_row(f"C  (read, first {len(ev['C'])} of {N})", _row(ev["C"]))
    t_.add_row("h·C  (the read)", _row(ev["read"]))
    t_.add_row("D·x  (the skip)", _row(ev["skip"]))
    t_.add_row("y = h·C + D·x", _row(ev["out"]))
    print_fitted(console, t_)
    grid = Table(box=None, padding=(0, 1), header_style="bold")
    for name in ("h₀ (before)", "a·h₀", "Δ·x ⊗ B (the write)", "h (after)"):
        grid.add_column(name, justify="right")
    for i in range(len(ev["h_before"])):
        grid.add_row(*[" ".join(f"{v:8.4f}" for v in ev[key][i]) for key in ("h_before", "h_decayed", "write",
                                                                              "h_after")])
    console.print(Text(f"the state's corner (rows: head dims 0-{len(ev['h_before']) - 1} of x; columns: state dims)"))
    print_fitted(console, grid)
    console.print(Text.assemble("h computed in float64 vs the state the pass left ", _check(ev["check_state_max_abs_diff"]),
                                ";  y vs the pass's read-out ", _check(ev["check_out_max_abs_diff"])))
    _note(console, f"h₀ is the state after the earlier tokens (the same rule from zeros); the whole h is {P} × {N}, "
                   f"the corner shows how one token moves it")


def state_cache(console: Console, ev: dict) -> None:
    """⑧ for a state layer: what it keeps, and why nothing grows."""
    kept = ", ".join(f"{n} [{' × '.join(str(d) for d in s)}]" for n, s in ev["state"].items())
    if ev.get("reads") is not None:  # a KV-shared layer (model.kinds.shared_kv): nothing of its own
        _title(console, f"⑧ s6.8  nothing cached here: the layer reads layer {ev['reads']}'s keys and values")
        console.print(f"its queries are scored against layer {ev['reads']}'s keys and read its values, every slot; it "
                      f"computes no K or V and writes none, so a token costs this layer 0 B of cache (layer "
                      f"{ev['reads']} pays for it, once)")
        return
    window = ev.get("memory_kind") == "window"  # a convolution's last inputs (model.memory's kinds), not a state
    _title(console, f"⑧ s6.8  no KV cache grows here: the layer keeps {kept} = {ev['state_bytes']:,} B"
                    + ("" if window else " (float32)"))
    T, per = ev["n_tokens"], ev["kv_bytes_per_token"]
    console.print(f"after {T} tokens, after 1, or after {ev['context']:,}: the same {ev['state_bytes']:,} B. " + (
        "Each token's input enters the window and the oldest leaves it: nothing older is kept." if window else
        "Each token is folded into the state and then dropped: nothing is kept per token."))
    for line in (ev.get("updates") or {}).values():
        console.print(Text("  " + line, style="dim"))
    console.print(f"an attention layer of this model (layers {', '.join(map(str, ev['attention_layers']))}) caches "
                  f"{per:,} B per token: {ev['kv_bytes_now']:,} B now, {human_bytes(ev['kv_bytes_context'])} at "
                  f"{ev['context']:,} tokens; it overtakes this state at {ev['break_even']:,} tokens")
    price = ("the price: the layer sees only its last few inputs; anything older reaches it through the attention "
             "layers" if window else "the price: the state cannot recall a token exactly as attention can; it holds "
             "a blend that decays")
    _note(console, f"{price}. {len(ev['state_layers'])} of {len(ev['state_layers']) + len(ev['attention_layers'])} "
                   f"layers pay it")
