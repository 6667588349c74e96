"""The terminal view of a trace: rich tables built only from events, so live runs and saved traces look the same.

Readable at 100 columns; narrower terminals wrap, and NO_COLOR (or a non-terminal) drops colour.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmtrace.events import LAYER_POINTS


def make_console(stderr: bool = False, file=None) -> Console:
    no_color = "NO_COLOR" in os.environ
    return Console(stderr=stderr, file=file, no_color=no_color, highlight=False, soft_wrap=False,
                   width=None if (file or (sys.stderr if stderr else sys.stdout)).isatty() else 100)


def visible(text: str) -> str:
    """Whitespace made visible the way `llmtrace tokenize` shows it: ▁ for a space, \\n, \\t, \\xNN."""
    from llmtrace.tokenizer import visible_text

    return visible_text(text.encode("utf-8", errors="surrogatepass"))


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_num(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.3e}"
    return f"{x:.4f}"


def _shape(s) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


class TerminalRenderer:
    """Consumes events one at a time and prints the matching part of the view."""

    def __init__(self, console: Console, show_steps: bool = True, stream_text: bool = False):
        self.console = console
        self.show_steps = show_steps
        self.stream_text = stream_text
        self.run: Optional[dict] = None
        self._step_rows = 0
        self._prefill_tensors: list[dict] = []
        self._stats_rows: list[dict] = []
        self._last_kv: Optional[dict] = None

    def __call__(self, ev: dict) -> None:
        kind = ev.get("event")
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(ev)

    def _title(self, text: str) -> None:
        self.console.print(Text(text, style="bold cyan"))

    # -- header and prompt ----------------------------------------------------------------------------------------

    def _on_run(self, ev: dict) -> None:
        self.run = ev
        if not self.show_steps:  # --trace none: only the text and the timings
            return
        m = ev["model"]
        gqa = f"GQA {m['n_heads']}q/{m['n_kv_heads']}kv" if m["n_kv_heads"] < m["n_heads"] else f"MHA {m['n_heads']} heads"
        params = f" · {m['n_params'] / 1e6:.1f}M params" if m.get("n_params") else ""
        self.console.print(Text.assemble(("model ", "bold"), f"{m['name']} · {m['arch']} · {m['n_layers']} layers · "
                                         f"D={m['d_model']} · {gqa} · Dh={m['head_dim']} · F={m['ffn_dim']} · "
                                         f"V={m['vocab_size']:,} · RoPE θ={m['rope_theta']:g}{params}"))
        s = ev.get("sampling", {})
        mode = "greedy" if s.get("temperature") == 0 else "sampling " + ", ".join(
            f"{k}={v}" for k, v in s.items() if k in ("temperature", "top_k", "top_p", "min_p", "typical_p") and v not in (None,))
        self.console.print(f"[bold]run[/bold]   {ev['device']} · {ev['dtype']} · {mode} · seed {s.get('seed')} · "
                           f"trace {ev.get('trace', {}).get('level', '?')}")

    def _on_tokens(self, ev: dict) -> None:
        if not self.show_steps:
            return
        toks = ev["tokens"]
        self._title(f"s1–s3 prompt → {len(toks)} tokens (s3: one sequence, so no padding; every position is attended)")
        t = Table(box=None, padding=(0, 1), header_style="bold")
        t.add_column("#", justify="right")
        t.add_column("id", justify="right")
        t.add_column("piece")
        t.add_column("text")
        shown = toks if len(toks) <= 40 else toks[:20] + [None] + toks[-19:]
        for tok in shown:
            if tok is None:
                t.add_row("…", "…", f"({len(toks) - 39} more)", "")
                continue
            style = "magenta" if tok.get("special") else None
            t.add_row(str(tok["index"]), str(tok["id"]), Text(visible(tok["piece"]), style=style),
                      Text(visible(tok["text"]), style=style))
        self.console.print(t)

    # -- the prefill's shapes and per-layer statistics -------------------------------------------------------------

    def _on_shapes(self, ev: dict) -> None:
        self._title(f"s4–s9 prefill pass over {ev['n_tokens']} tokens: the shape at each stage "
                    f"(layer rows repeat in all {ev['n_layers']} layers)")
        t = Table(box=None, padding=(0, 1), header_style="bold")
        t.add_column("step")
        t.add_column("where")
        t.add_column("point")
        t.add_column("shape")
        t.add_column("dtype")
        order = {n: i for i, n in enumerate(("embed",) + LAYER_POINTS + ("final_norm", "last", "logits"))}
        for p in sorted(ev["points"], key=lambda p: order.get(p["name"], 99)):
            where = "model" if p["layer"] is None else "layer ℓ"
            shape = _shape(p["shape"]) if p["name"] != "kv_write" else f"positions 0..{p['shape'][0] - 1}"
            t.add_row(p.get("seed_step") or "", where, p["name"], shape, p["dtype"])
        self.console.print(t)

    def _on_tensor(self, ev: dict) -> None:
        if ev["step"] == 0:
            self._prefill_tensors.append(ev)
        else:
            self._stats_rows.append(ev)

    def _flush_tensor_table(self, rows: list[dict], title: str) -> None:
        if not rows:
            return
        self._title(title)
        t = Table(box=None, padding=(0, 1), header_style="bold")
        for col, just in (("layer", "right"), ("point", "left"), ("shape", "left"), ("mean", "right"), ("std", "right"),
                          ("min", "right"), ("max", "right"), ("‖x‖", "right")):
            t.add_column(col, justify=just)
        for r in rows:
            st = r["stats"]
            t.add_row("—" if r["layer"] is None else str(r["layer"]), r["name"], _shape(r["shape"]), fmt_num(st["mean"]),
                      fmt_num(st["std"]), fmt_num(st["min"]), fmt_num(st["max"]), fmt_num(st["norm"]))
        self.console.print(t)

    # -- generation steps ------------------------------------------------------------------------------------------

    def _on_step(self, ev: dict) -> None:
        self._last_kv = ev.get("kv_cache")
        if ev["step"] == 0:
            self._flush_tensor_table(self._prefill_tensors, "prefill (step 0): statistics at each recorded point")
            self._prefill_tensors = []
        if self.show_steps:
            self._step_row(ev)
        if self._stats_rows:
            self._flush_tensor_table(self._stats_rows, f"step {ev['step']}: statistics at each recorded point")
            self._stats_rows = []
            self._step_rows = 0  # repeat the step header after a statistics table

    def _step_row(self, ev: dict) -> None:
        if self._step_rows == 0 and ev["step"] == 0:
            self._title("s7–s12 each step: last position → logits → sampler stages → token; the KV cache grows")
        t = Table(box=None, padding=(0, 1), pad_edge=False, show_header=self._step_rows == 0, header_style="bold")
        widths = (("step", 4, "right"), ("pos", 4, "right"), ("token", 12, "left"), ("id", 6, "right"),
                  ("top-3 candidates", 27, "left"), ("survivors", 13, "left"), ("KV len", 7, "right"),
                  ("KV bytes", 9, "right"), ("ms", 6, "right"))
        for name, w, just in widths:
            t.add_column(name, width=w, justify=just, no_wrap=True, overflow="ellipsis")
        tok = ev["token"]
        topk = ev.get("topk") or []
        cands = "  ".join(f"{visible(c['text'])!s}:{c['prob']:.2f}" for c in topk[:3])
        stages = ev.get("sampler") or []
        if (ev.get("rng") or {}).get("greedy"):
            surv = "greedy argmax"
        elif stages:
            surv = "→".join(fmt_num(s["survivors"]) if s["survivors"] < 10000 else f"{s['survivors'] // 1000}k"
                            for s in stages)
        else:
            surv = ""
        kv = ev["kv_cache"]
        style = "magenta" if tok.get("special") else "bold"
        t.add_row(str(ev["step"]), str(ev["position"]), Text(visible(tok["text"]), style=style), str(tok["id"]), cands,
                  surv, str(kv["seq_len"]), f"{kv['bytes_used']:,}", f"{ev['ms']:.1f}")
        self.console.print(t)
        self._step_rows += 1

    def _on_prediction(self, ev: dict) -> None:
        """A prefill-only run (-n 0): the next-token candidates, no token taken."""
        self._last_kv = ev.get("kv_cache")
        self._flush_tensor_table(self._prefill_tensors, "prefill (step 0): statistics at each recorded point")
        self._prefill_tensors = []
        self._title(f"s7–s9 prefill only (-n 0): what the model would predict at position {ev['position']}")
        t = Table(box=None, padding=(0, 1), header_style="bold")
        for col, just in (("#", "right"), ("id", "right"), ("token", "left"), ("logit", "right"), ("prob", "right")):
            t.add_column(col, justify=just)
        for rank, c in enumerate(ev.get("topk") or [], 1):
            t.add_row(str(rank), str(c["id"]), Text(visible(c["text"])), fmt_num(c["logit"]), f"{c['prob']:.4f}")
        self.console.print(t)

    # -- the end ---------------------------------------------------------------------------------------------------

    def _on_summary(self, ev: dict) -> None:
        if self.stream_text:
            self.console.print()
        else:
            self.console.print(Text.assemble(("output ", "bold"), ev["text"]))
        interrupted = " · interrupted (Ctrl-C)" if ev.get("interrupted") else ""
        line = (f"{ev['prompt_tokens']} prompt tokens · {ev['generated_tokens']} generated · stop: {ev['stop_reason']}"
                f"{interrupted} · TTFT {ev['ttft_ms']:.0f} ms · prefill {ev['prefill_tok_s']:.1f} tok/s · "
                f"decode {ev['decode_tok_s']:.1f} tok/s")
        self.console.print(Text(line, style="dim"))
        if self.run is not None and self._last_kv is not None:
            kv = self._last_kv
            saving = kv["mha_bytes_used"] / kv["bytes_used"] if kv["bytes_used"] else 0
            self.console.print(Text(
                f"KV cache: {kv['seq_len']} positions × {kv['bytes_per_token']:,} B = {fmt_bytes(kv['bytes_used'])} "
                f"(allocated {fmt_bytes(kv['bytes_allocated'])}); full multi-head attention would need "
                f"{fmt_bytes(kv['mha_bytes_used'])}, {saving:.0f}× more", style="dim"))



def terminal_renderer(console: Console, show_steps: bool = True, stream_text: bool = False) -> TerminalRenderer:
    return TerminalRenderer(console, show_steps=show_steps, stream_text=stream_text)


def render_events(events: list[dict], console: Console) -> None:
    r = terminal_renderer(console)
    for ev in events:
        r(ev)
