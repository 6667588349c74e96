"""Scoring chunks of a text for `llmtrace eval`: the forward passes and the per-position figures, as chunk records.

A chunk is `ctx` token ids; its first id is BOS when the tokenizer adds one (llama.cpp replaces the chunk's first
token so). Only the second half is scored: the logits at positions first … ctx−2 (first = ctx // 2) predict the ids
at first+1 … ctx−1. B chunks run as the B rows of one pass (`batch`).

Per scored position, in float64 from each side's logits (A the base, B the model under test):

    nll      −ln softmax(z_A)[t]                 (t the next token)
    kld      KL(A‖B) = Σ_v p_A(v) (ln p_A(v) − ln p_B(v))        and KL(B‖A) (`kld_ba`)
    dp       p_B(t) − p_A(t)
    same top argmax z_A = argmax z_B

A side A read from a base file (eval_base.py) comes with a bound on how far its KLD can be from the one-run KLD, per
position (`kld_bound`, summed in the chunk's sums):

- **exact** (uint16 log-probs): A's row comes back as r = p·e^ε with |ε| ≤ 2δ (δ = half a step: each entry within δ,
  and the renormalisation moves it by at most δ more). Then KL(r‖q) − KL(p‖q) = Σ p (e^ε − 1)(ln p − ln q) + KL(r‖p),
  the first term at most (e^{2δ} − 1) Σ p |ln p − ln q| in size and 0 ≤ KL(r‖p) ≤ χ²(r‖p) ≤ (e^{2δ} − 1)². With
  p ≤ e^{2δ} r and |ln p − ln q| ≤ |ln r − ln q| + 2δ, from what the run holds:

      |KLD − KLD_one_run| ≤ (e^{2δ} − 1) · (e^{2δ} (Σ r |ln r − ln q| + 2δ) + e^{2δ} − 1)

- **top_k**: A's top K log-probabilities and the mass T_A of the rest (the tail). The KLD is then
  Σ_top p_A (ln p_A − ln p_B) + T_A (ln T_A − ln T_B), T_B B's mass on A's tail: by the log-sum inequality at most
  the whole-vocabulary KLD, short of it by exactly T_A · KL(Ã‖B̃), Ã and B̃ the tails renormalized. Every tail token
  has p_A ≤ p_K (the K-th largest kept), so Ã ≤ c = p_K / T_A entrywise. KL(Ã‖B̃) is convex in Ã, so over the
  polytope {0 ≤ Ã ≤ c, Σ Ã = 1} it is largest at a vertex: m = ⌊1/c⌋ entries at c and one at 1 − m·c, put on the
  tokens where B̃ is smallest. With B̃ sorted ascending (b_1 ≤ b_2 ≤ …):

      0 ≤ KLD − KLD_top_k ≤ T_A · (Σ_{i≤m} c ln(c / b_i) + (1 − m c) ln((1 − m c) / b_{m+1}))

A chunk record holds plain sums (eval_stats.py adds them across chunks) and the per-position values of the
distributions, as Python floats: written to JSON and read back, they are the same numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from llmtrace.errors import BadValue, UsageError
from llmtrace.units import plural

EVAL_SCHEMA = "llmtrace.eval/1"
DEFAULT_TOLERANCE = 1e-4  # compare's: a relative error above it is a divergence


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def chunk_count(n_tokens: int, ctx: int, chunks: Optional[int]) -> int:
    """How many chunks a text of n_tokens gives at ctx (llama.cpp: n_tokens // ctx), at most `chunks`."""
    n = n_tokens // ctx
    return n if chunks is None else min(n, chunks)


def encode_text(tok, text: str, ctx: int, max_ctx: int) -> list[int]:
    """The text's ids (BOS first where the tokenizer adds one; text that spells a special token is read as text, as
    llama-perplexity reads it), refusing an empty text, a ctx beyond the model's
    window and a text shorter than one chunk."""
    if not text.strip():
        raise UsageError("the text is empty: give a file with some text to score")
    if ctx > max_ctx:
        raise BadValue("ctx", f" {ctx} exceeds the model's context window of {max_ctx} tokens")
    ids = tok.encode(text, parse_special=False)  # as llama-perplexity: special tokens' text is plain text
    if len(ids) < ctx:
        raise BadValue("ctx", f" {ctx} needs at least one chunk of {ctx} tokens",
                       before=f"the text has {plural(len(ids), 'token')}, shorter than one chunk: ")
    return ids


@dataclass
class Chunking:
    """How a token list is cut: ctx ids per chunk, the first id replaced by `bos` (None: kept)."""

    ctx: int
    bos: Optional[int]

    @property
    def first(self) -> int:
        return self.ctx // 2

    @property
    def scored(self) -> int:
        """Scored positions per chunk."""
        return self.ctx - 1 - self.first

    def ids(self, tokens: list[int], i: int) -> list[int]:
        ids = list(tokens[i * self.ctx:(i + 1) * self.ctx])
        if self.bos is not None:
            ids[0] = self.bos
        return ids

    def targets(self, tokens: list[int], i: int) -> list[int]:
        """The ids the scored positions predict."""
        return list(tokens[i * self.ctx + self.first + 1:(i + 1) * self.ctx])


@dataclass
class Scorer:
    """What scores a batch of chunks: side A's model (or its base-file rows), side B's (None: one side), B's
    interventions (run.interventions.Edits), --layers (with its tolerance), and what to keep of A for a base file
    (`keep`: None nothing, 0 the whole rows (exact), K the top K)."""

    lm_a: Any
    lm_b: Any = None
    edits_b: Any = None
    layers: bool = False
    tolerance: float = DEFAULT_TOLERANCE
    keep: Optional[int] = None

    def score(self, tokens: list[int], chunking: Chunking, indices: list[int], base_rows: Optional[list] = None
              ) -> list[dict]:
        """The chunk records of chunks `indices`, run as one batch (`scored`, all at once)."""
        return list(self.scored(tokens, chunking, indices, base_rows))

    def scored(self, tokens: list[int], chunking: Chunking, indices: list[int], base_rows: Optional[list] = None,
               on_step: Optional[Callable[[int, int], None]] = None) -> Iterator[dict]:
        """The chunk records of chunks `indices`, run as one batch, each as soon as it is scored. `base_rows`: side
        A's saved rows of each chunk, when A is a base file. `on_step(done, total)` hears the batch move: a step per
        layer of each pass, and one per chunk scored."""
        import torch

        rows = [chunking.ids(tokens, i) for i in indices]
        n_layers = (self.lm_a or self.lm_b).config.n_layers
        passes = 3 if self.layers else (self.lm_a is not None and base_rows is None) + (self.lm_b is not None)
        total = passes * n_layers + len(rows)
        done = [0]
        if on_step is not None:
            on_step(0, total)  # the pass starts

        def step() -> None:
            done[0] += 1
            if on_step is not None:
                on_step(done[0], total)

        with torch.inference_mode():
            if self.layers:
                logits_a, logits_b, layer_recs = side_by_side(self, rows, chunking.first, step)
            else:
                logits_a = None if base_rows is not None else _logits(self.lm_a, rows, chunking.first, step=step)
                logits_b = (_logits(self.lm_b, rows, chunking.first, self.edits_b, step)
                            if self.lm_b is not None else None)
                layer_recs = [None] * len(rows)
            for r, i in enumerate(indices):
                tgt = torch.tensor(chunking.targets(tokens, i), dtype=torch.long)
                a = base_rows[r] if base_rows is not None else logits_a[r]
                b = logits_b[r] if logits_b is not None else None
                rec, kept = score_row(a, b, tgt, self.keep)
                rec = {"event": "chunk", "chunk": i, "start": i * chunking.ctx} | own_figures(rec) | rec
                if layer_recs[r] is not None:
                    rec["layers"] = layer_recs[r]
                if kept is not None:
                    rec["_base"] = kept
                step()
                yield rec


def own_figures(rec: dict) -> dict:
    """The chunk's own figures, from its sums, for a reader of the stream: its PPL, and with two sides B's PPL, its
    mean KLD and its share of same top tokens."""
    import math

    s, n = rec["sums"], rec["tokens_scored"]
    out = {"ppl": math.exp(s["nll"] / n)}
    if "kld" in s:
        out |= {"ppl_b": math.exp(s["nll_b"] / n), "kld_mean": s["kld"] / n, "same_top": s["same_top"] / n}
    return out


def _logits(lm, rows: list[list[int]], first: int, edits=None, step: Optional[Callable[[], None]] = None):
    """The logits of the scored positions of each row: (B, ctx−1−first, V), float32 on the CPU; `step()` after each
    layer."""
    import contextlib

    import torch

    model = lm.model
    idx = torch.tensor(rows, device=lm.device)  # (B, ctx)
    hooked = model.hooked(edits, edits.layers, spell_out=False) if edits is not None else contextlib.nullcontext()
    if edits is not None:
        edits.begin_pass(prompt=True, pads=[0] * len(rows))
    with hooked:
        x = model.embed_tokens(idx)  # (B, ctx, D)
        inputs = model.layer_inputs(idx, dtype=x.dtype)
        for i in range(lm.config.n_layers):  # the model's loop, a layer at a time, so that a long pass shows progress
            x = model.run_layers(x, inputs, [i])
            if step is not None:
                step()
        return model.head(x[:, first:-1]).float().cpu()  # (B, P, V)


def score_row(a, b, tgt, keep: Optional[int] = None) -> tuple[dict, Optional[dict]]:
    """One chunk's record from side A (its logits (P, V), or its base-file rows) and side B's logits (or None):
    `tokens_scored`, `sums` and the per-position `kld` and `dp` lists; and A's rows to save (`keep`: 0 the whole
    rows, K the top K, None nothing)."""
    import torch

    if isinstance(a, dict):
        lp_b = torch.log_softmax(b.double(), -1)
        figures = _against_exact(a, lp_b, tgt) if a["form"] == "exact" else _against_top_k(a, lp_b, tgt)
        kept = None
    else:
        lp_a = torch.log_softmax(a.double(), -1)  # (P, V)
        kept = None if keep is None else exact_rows(lp_a, tgt) if keep == 0 else top_rows(lp_a, tgt, keep)
        nll_a = -lp_a.gather(1, tgt[:, None])[:, 0]
        if b is None:
            return {"tokens_scored": len(tgt), "sums": {"nll": float(nll_a.sum()), "nll2": float((nll_a ** 2).sum())}
                    }, kept
        lp_b = torch.log_softmax(b.double(), -1)
        p_a, p_b = lp_a.exp(), lp_b.exp()
        figures = {"nll": nll_a, "kld": (p_a * (lp_a - lp_b)).sum(-1), "kld_ba": (p_b * (lp_b - lp_a)).sum(-1),
                   "same": lp_a.argmax(-1) == lp_b.argmax(-1), "p_a": (-nll_a).exp()}
        figures["lp_b_t"] = lp_b.gather(1, tgt[:, None])[:, 0]
    nll_a, nll_b = figures["nll"], -figures["lp_b_t"]
    dp = nll_b.neg().exp() - figures["p_a"]
    kld = figures["kld"].clamp_min(0.0)
    sums = {"nll": nll_a.sum(), "nll2": (nll_a ** 2).sum(), "nll_b": nll_b.sum(), "nll_b2": (nll_b ** 2).sum(),
            "nll_ab": (nll_a * nll_b).sum(), "kld": kld.sum(), "kld2": (kld ** 2).sum(),
            "kld_ba": figures["kld_ba"].clamp_min(0.0).sum(), "dp": dp.sum(), "dp2": (dp ** 2).sum(),
            "dp4": (dp ** 4).sum()}
    if "bound" in figures:
        sums["kld_bound"] = figures["bound"].sum()
    if "tail" in figures:  # a top-K base: A's mass outside its top K
        sums["base_tail"] = figures["tail"].sum()
    rec = {"tokens_scored": len(tgt), "sums": {k: float(v) for k, v in sums.items()} | {
        "same_top": int(figures["same"].sum())}, "kld": kld.tolist(), "dp": dp.tolist()}
    return rec, kept


def exact_rows(lp_a, tgt) -> dict:
    """What an exact base file keeps of side A per scored position: the whole row as uint16 (eval_base.quantize), the
    next token's log-prob and the most likely token."""
    import torch

    from llmtrace.run.eval_base import quantize

    return quantize(lp_a) | {"target_logp": lp_a.gather(1, tgt[:, None])[:, 0],
                             "top_id": lp_a.argmax(-1).to(torch.int32)}


def top_rows(lp_a, tgt, k: int) -> dict:
    """What a top-K base file keeps of side A per scored position: the top k ids and log-probs, the tail's mass
    (everything else), the next token's log-prob."""
    import torch

    k = min(k, lp_a.size(-1))
    top = lp_a.topk(k, dim=-1)  # (P, k), largest first
    tail = (1.0 - top.values.exp().sum(-1)).clamp_min(0.0)  # (P,)
    return {"top_ids": top.indices.to(torch.int32), "top_logp": top.values.float(), "tail": tail,
            "target_logp": lp_a.gather(1, tgt[:, None])[:, 0]}


def _against_exact(base: dict, lp_b, tgt) -> dict:
    """A's figures from its uint16 rows against B's log-probs, with the bound on the KLD's error (module docstring)."""
    import torch

    from llmtrace.run.eval_base import dequantize, half_steps

    lp_r = dequantize(base["q"], base["lo"], base["step"])  # (P, V)
    lp_r = lp_r - torch.logsumexp(lp_r, -1, keepdim=True)  # r: a distribution again
    p_r = lp_r.exp()
    diff = lp_r - lp_b
    two_d = 2 * half_steps(base["step"])  # (P,)
    e = torch.expm1(two_d)
    bound = e * ((1 + e) * ((p_r * diff.abs()).sum(-1) + two_d) + e)
    nll_a = -base["target_logp"].double()
    return {"nll": nll_a, "kld": (p_r * diff).sum(-1), "kld_ba": (lp_b.exp() * -diff).sum(-1),
            "same": base["top_id"].long() == lp_b.argmax(-1), "p_a": (-nll_a).exp(),
            "lp_b_t": lp_b.gather(1, tgt[:, None])[:, 0], "bound": bound}


def _against_top_k(base: dict, lp_b, tgt) -> dict:
    """A's figures from its saved top K and tail (float64 from the stored float32 log-probs), against B's log-probs;
    the KLD a lower bound, with how much it can fall short (module docstring)."""
    import torch

    ids = base["top_ids"].long()  # (P, K)
    lp_top = base["top_logp"].double()
    p_top = lp_top.exp()
    lpb_top = lp_b.gather(1, ids)  # (P, K)
    t_a = base["tail"].double()
    lt_b = torch.logsumexp(lp_b.scatter(1, ids, -torch.inf), -1)  # ln T_B: B's mass on A's tail, (P,)
    lt_a = t_a.clamp_min(1e-300).log()
    has_tail = (t_a > 0) & (ids.size(-1) < lp_b.size(-1))  # K = V: no tail, whatever float32 left of T_A
    tail_term = torch.where(has_tail, t_a * (lt_a - lt_b), torch.zeros_like(t_a))
    kld = (p_top * (lp_top - lpb_top)).sum(-1) + tail_term
    pb_top = lpb_top.exp()
    kld_ba = (pb_top * (lpb_top - lp_top)).sum(-1) + torch.where(has_tail, lt_b.exp() * (lt_b - lt_a),
                                                                 torch.zeros_like(t_a))
    nll_a = -base["target_logp"].double()
    return {"nll": nll_a, "kld": kld, "kld_ba": kld_ba, "same": ids[:, 0] == lp_b.argmax(-1),
            "p_a": (-nll_a).exp(), "lp_b_t": lp_b.gather(1, tgt[:, None])[:, 0],
            "bound": _tail_bound(lp_top[:, -1], t_a, lp_b, ids, lt_b), "tail": t_a}


def _tail_bound(lp_k, t_a, lp_b, ids, lt_b):
    """The most T_A · KL(Ã‖B̃) can be, given Ã ≤ c = p_K / T_A entrywise (module docstring), per position (P,)."""
    import torch

    n_tail = lp_b.size(-1) - ids.size(-1)
    if n_tail <= 0:
        return torch.zeros_like(t_a)
    lb = (lp_b - lt_b[:, None]).scatter(1, ids, torch.inf)  # ln B̃ on the tail; A's top sorts last
    lb = lb.sort(-1).values[:, :n_tail]  # (P, n_tail), ascending
    has_tail = t_a > 0
    lc = lp_k - t_a.clamp_min(1e-300).log()  # ln c
    c = lc.exp()
    m = torch.floor(1 / c).clamp(0, n_tail - 1).long()  # entries at c
    rem = (1 - m * c).clamp(0, 1)  # the one entry left
    csum = torch.cat([torch.zeros_like(lb[:, :1]), lb.cumsum(-1)], -1)  # Σ_{i<j} ln b_i, j = 0 … n_tail
    full = m * c * lc - c * csum.gather(1, m[:, None])[:, 0]
    last = torch.where(rem > 0, rem * (rem.clamp_min(1e-300).log() - lb.gather(1, m[:, None])[:, 0]),
                       torch.zeros_like(rem))
    kl = (full + last).clamp_min(0.0)
    return torch.where(has_tail, t_a * kl * (1 + 1e-9), torch.zeros_like(t_a))


# ----------------------------------------------------------------------------------------------------------------
# --layers: both sides layer by layer


def _rel_rows(a, b, first: Optional[int]) -> list[list[float]]:
    """Per row and scored position (positions first … −2 of (B, T, N) tensors; every one where first is None),
    ‖a − b‖ / ‖a‖ (‖a − b‖ where ‖a‖ is 0) in float64: compare's relative error."""
    import torch

    if first is not None:
        a, b = a[:, first:-1], b[:, first:-1]
    a, b = a.double().cpu(), b.to(a.device).double().cpu()
    d = torch.linalg.vector_norm(a - b, dim=-1)  # (B, P)
    n = torch.linalg.vector_norm(a, dim=-1)
    return torch.where(n > 0, d / torch.where(n > 0, n, torch.ones_like(n)), d).tolist()


def side_by_side(scorer: Scorer, rows: list[list[int]], first: int, step: Optional[Callable[[], None]] = None):
    """Both models over the rows, layer by layer, and B's layer once more on A's input (compare's scheme): A's and
    B's logits of the scored positions, and each row's `layers` record: per stage (the embeddings, each layer, the
    logits) the accumulated and the added relative error at each scored position, where each position first diverges
    (a count per stage, then one for "nowhere"), and for a mixture of experts the routing agreement and load."""
    import torch

    from llmtrace.model.capture import capture
    from llmtrace.model.moe_points import ROUTER_PROBS

    lm_a, lm_b = scorer.lm_a, scorer.lm_b
    ma, mb = lm_a.model, lm_b.model
    ia, ib = torch.tensor(rows, device=lm_a.device), torch.tensor(rows, device=lm_b.device)
    stages: list[tuple[list, list]] = []  # (accumulated, added), each [row][position]
    routing: dict[int, list] = {}
    xa, xb = ma.embed_tokens(ia), _b_call(scorer, lambda: mb.embed_tokens(ib), len(rows))
    acc = _rel_rows(xa, xb, first)
    stages.append((acc, acc))
    inputs_a, inputs_b = ma.layer_inputs(ia, dtype=xa.dtype), mb.layer_inputs(ib, dtype=xb.dtype)
    moe = bool(lm_a.config.n_experts)
    for i in range(lm_a.config.n_layers):
        wanted = lambda _layer, name: moe and name == ROUTER_PROBS.name  # noqa: E731
        with capture(ma, wanted, layers=[i], clone=False) as ka:
            ya = ma.run_layers(xa, inputs_a, [i])
        with capture(mb, wanted, layers=[i], clone=False) as kb:
            yb = _b_call(scorer, lambda: mb.run_layers(xb, inputs_b, [i]), len(rows))
        x_in = xa.to(lm_b.device, lm_b.dtype)
        yz = yb if torch.equal(x_in, xb) else _b_call(scorer, lambda: mb.run_layers(x_in, inputs_b, [i]), len(rows))
        stages.append((_rel_rows(ya, yb, first), _rel_rows(ya, yz, first)))
        if moe and ka and kb:
            routing[i] = _routing_rows(next(iter(ka.values())), next(iter(kb.values())), first,
                                       lm_a.config.n_experts_used)
        xa, xb = ya, yb
        for _ in range(3):  # A's layer, B's, B's on A's input: three of the batch's steps
            if step is not None:
                step()
    la = ma.head(xa[:, first:-1])
    lb = _b_call(scorer, lambda: mb.head(xb[:, first:-1]), len(rows))
    x_in = xa[:, first:-1].to(lm_b.device, lm_b.dtype)
    lz = lb if torch.equal(x_in, xb[:, first:-1]) else _b_call(scorer, lambda: mb.head(x_in), len(rows))
    stages.append((_rel_rows(la, lb, None), _rel_rows(la, lz, None)))
    recs = [_layer_record(stages, routing, r, scorer.tolerance) for r in range(len(rows))]
    return la.float().cpu(), lb.float().cpu(), recs


def _b_call(scorer: Scorer, fn, n_rows: int):
    """One of B's calls, under B's interventions (A may be the same model: its calls stay as they are)."""
    edits = scorer.edits_b
    if edits is None:
        return fn()
    edits.begin_pass(prompt=True, pads=[0] * n_rows)
    with scorer.lm_b.model.hooked(edits, edits.layers, spell_out=False):
        return fn()


def _routing_rows(pa, pb, first: int, k: int) -> list[dict]:
    """Per row: at how many scored positions B's router chose A's set of k experts, and each side's expert load."""
    out = []
    n_exp = pa.size(-1)
    for r in range(pa.size(0)):
        ca = pa[r, first:-1].topk(k, dim=-1).indices.sort(dim=-1).values  # (P, k)
        cb = pb[r, first:-1].topk(k, dim=-1).indices.sort(dim=-1).values
        out.append({"agree": int((ca == cb).all(-1).sum()), "n": int(ca.size(0)),
                    "load_a": ca.flatten().bincount(minlength=n_exp).tolist(),
                    "load_b": cb.flatten().bincount(minlength=n_exp).tolist()})
    return out


def _layer_record(stages: list, routing: dict, r: int, tolerance: float) -> dict:
    accumulated = [acc[r] for acc, _ in stages]
    added = [add[r] for _, add in stages]
    first = [0] * (len(stages) + 1)  # a count per stage, then "nowhere"
    for p in range(len(accumulated[0])):
        s = next((s for s, errs in enumerate(accumulated) if errs[p] > tolerance), len(stages))
        first[s] += 1
    rec: dict = {"accumulated": accumulated, "added": added, "first_divergence": first}
    if routing:
        rec["routing"] = {str(layer): rows[r] for layer, rows in routing.items()}
    return rec
