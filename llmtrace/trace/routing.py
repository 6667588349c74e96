"""The router ledger of a mixture-of-experts model: what each MoE layer's router chose for each token, as `routing`
events, and how the tokens spread over the experts (each layer's load), for the summary.

A routing event is one MoE layer in one forward pass (one row of a batch): for each position, the K experts it ran
(most probable first) and the weights their outputs were summed with, the router's most probable 2K experts with
their probabilities before the cut to K (how close the next one came), and the entropy of the router's distribution
over all E experts, in bits (log2 E when it cannot choose, 0 when it is sure). Built from two points the model
reports (model/moe_points.py): router_probs and expert_weights, after any intervention (an ablated expert has
probability 0; a scaled one its scaled weight).
"""

from __future__ import annotations

from typing import Optional

import torch

from llmtrace.model.moe_points import chosen_experts
from llmtrace.trace.stats import round_tensor


def routing_tables(probs: torch.Tensor, weights: torch.Tensor, k: int) -> list:
    """probs, weights (..., T, E) of one or more MoE layers and rows -> for each of the leading entries, per position:
    `experts` (K ids, most probable first), `weights` (theirs), `candidates` (the min(E, 2K) most probable ids) with
    `probs`, and `entropy` in bits, as lists, floats rounded. One pass over them all, one transfer to the host (a
    decode step's routing costs a few small operations, whatever the number of layers)."""
    probs = probs.float()
    n_top = min(probs.size(-1), 2 * k)
    top_p, top_e = probs.topk(n_top, dim=-1)  # (..., T, 2K)
    chosen = chosen_experts(probs, weights, k)  # (..., T, K): the experts the model ran, most probable first
    w = weights.float().gather(-1, chosen)  # (..., T, K)
    p = probs.clamp_min(0)
    entropy = -(torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p))).sum(-1)  # (..., T)
    floats = round_tensor(torch.cat([w, top_p, entropy[..., None]], dim=-1).double().cpu()).tolist()
    ids = top_e.cpu().tolist()

    def tables(f: list, c: list) -> dict:
        return {"experts": [r[:k] for r in c], "weights": [r[:k] for r in f], "candidates": c,
                "probs": [r[k : k + n_top] for r in f], "entropy": [r[-1] for r in f]}

    def walk(f: list, c: list, depth: int):
        return tables(f, c) if depth == 0 else [walk(a, b, depth - 1) for a, b in zip(f, c)]

    return walk(floats, ids, probs.dim() - 2)


def routing_event(step: int, phase: str, layer: int, positions: list[int], tables: dict[str, list], k: int,
                  n_experts: int, renormalised: bool, row: Optional[int] = None) -> dict:
    """The `routing` event of one MoE layer in one pass (fields as trace.schema.json's `routing`)."""
    return {"event": "routing", "step": step, "phase": phase, "layer": layer, **({} if row is None else {"row": row}),
            "k": k, "n_experts": n_experts, "renormalised": renormalised, "positions": positions,
            "experts": tables["experts"], "weights": tables["weights"], "candidates": tables["candidates"],
            "probs": tables["probs"], "entropy": tables["entropy"]}


class ExpertLoad:
    """How many tokens each expert of each MoE layer ran for over a run (every routing event's positions)."""

    def __init__(self):
        self.counts: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}
        self.k: dict[int, int] = {}

    def add(self, ev: dict) -> None:
        layer = ev["layer"]
        counts = self.counts.setdefault(layer, [0] * ev["n_experts"])
        for chosen in ev["experts"]:
            for e in chosen:
                counts[e] += 1
        self.tokens[layer] = self.tokens.get(layer, 0) + len(ev["experts"])
        self.k[layer] = ev["k"]

    def records(self) -> list[dict]:
        """Each layer's load (tokens per expert) and imbalance: the busiest expert's count over the mean count."""
        return [load_record(layer, self.counts[layer], self.tokens[layer], self.k[layer])
                for layer in sorted(self.counts)]


def load_record(layer: int, counts: list[int], tokens: int, k: int) -> dict:
    """One layer's entry of the summary's `routing`: with E experts and K a token, the mean count is tokens·K/E."""
    mean = tokens * k / len(counts) if counts else 0
    return {"layer": layer, "tokens": tokens, "load": counts,
            "imbalance": round(max(counts) / mean, 4) if mean else None}
