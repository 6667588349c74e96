"""The sampler: from the last position's logits to one token id (seed steps s10-s12).

Sampling is a pipeline of named stages, each a pure function from logits to logits:

    logits (V,) -> [stage] -> [stage] -> ... -> softmax -> draw -> token id

A stage either changes values (temperature, penalties, bias) or masks tokens out by setting their logit to -inf
(ban, top-k, top-p, min-p, typical-p). Because every stage has the same shape in and out, the ledger of what each one
did falls out for free: how many tokens survive it, and how likely the eventual pick was after it.

The order is data (`SamplerConfig.order`, a list of stage names) with two presets, "hf" and "llama.cpp". A stage
whose parameter is neutral (temperature 1, top-k 0, top-p 1, ...) is left out: it costs nothing and is not in the
ledger. Temperature 0 means greedy: the argmax after the value-changing stages (penalties, bias, ban); temperature
and truncation then have nothing to do and are skipped.

The draw is reproducible and checkable by hand: one uniform u in [0, 1) from a seeded `torch.Generator`, then the
first token id whose cumulative probability (summed in id order, in float64) exceeds u times the total.

Notation: V vocab size, T history length.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from llmtrace.errors import BadValue, LlmtraceError

NEG_INF = float("-inf")

# -----------------------------------------------------------------------------
# orders

# HF transformers 5.x, `GenerationMixin._get_logits_processor` (generation/utils.py) appends, in this order:
# SequenceBiasLogitsProcessor (our logit_bias), RepetitionPenaltyLogitsProcessor, NoBadWordsLogitsProcessor (ban),
# then, only when sampling: Temperature, TopK, TopP, MinP, Typical. HF has no frequency/presence penalty; we put
# them beside the repetition penalty, where llama.cpp's penalties sampler applies all three.
HF_ORDER = [
    "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "ban",
    "temperature", "top_k", "top_p", "min_p", "typical_p",
]  # fmt: skip

# llama.cpp `common_sampler_init` (common/sampling.cpp) first adds the logit-bias sampler (a ban is a -inf bias
# there), then the chain of `common_params_sampling::samplers` (common/common.h), by default: penalties (repeat,
# then frequency and presence), dry, top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature; then dist.
# dry, top_n_sigma and xtc are off by default and not implemented here.
LLAMA_CPP_ORDER = [
    "logit_bias", "ban", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "top_k", "typical_p", "top_p", "min_p", "temperature",
]  # fmt: skip

PRESETS = {"hf": HF_ORDER, "llama.cpp": LLAMA_CPP_ORDER}


# -----------------------------------------------------------------------------
# config


@dataclass
class SamplerConfig:
    temperature: float = 1.0  # logits / T; 0 = greedy (argmax), 1 = off
    top_k: int = 0  # keep the k largest logits (ties with the k-th kept); 0 = off
    top_p: float = 1.0  # nucleus: smallest set with cumulative probability >= p; 1 = off
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob; 0 = off
    typical_p: float = 1.0  # locally typical sampling mass; 1 = off
    repetition_penalty: float = 1.0  # seen ids: logit < 0 -> * p, else / p; 1 = off
    frequency_penalty: float = 0.0  # seen ids: logit -= f * count; 0 = off
    presence_penalty: float = 0.0  # seen ids: logit -= p; 0 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # id -> bias added to its logit
    ban: list[list[int]] = field(default_factory=list)  # token-id sequences that must not be completed
    order: list[str] = field(default_factory=lambda: list(HF_ORDER))  # stage names, applied in this order
    seed: int | None = None  # None = pick one from os.urandom (the Sampler records it)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def active_stages(self) -> list[str]:
        """The stages that will run, in order: the non-neutral ones, and for greedy only the value-changing ones."""
        return [
            name
            for name in self.order
            if STAGES[name].active(self) and (not self.greedy or STAGES[name].kind == "logits")
        ]

    def validate(self, vocab_size: int) -> None:
        """Raise BadValue, naming the field, for the first out-of-range setting."""
        t = self.temperature
        if not math.isfinite(t) or t < 0:
            raise BadValue("temperature", f" must be >= 0 (0 = greedy), got {t}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadValue("top_k", f" must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise BadValue("top_p", f" must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise BadValue("min_p", f" must be in [0, 1], got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise BadValue("typical_p", f" must be in (0, 1], got {self.typical_p}")
        r = self.repetition_penalty
        if not math.isfinite(r) or r <= 0:
            raise BadValue("repetition_penalty", f" must be > 0 (1 = off), got {r}")
        penalties = {"frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}
        for name, value in penalties.items():
            if not math.isfinite(value):
                raise BadValue(name, f" must be a finite number, got {value}")
        for tid, bias in self.logit_bias.items():
            if not 0 <= tid < vocab_size:
                raise BadValue("logit_bias", f" token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
            if not math.isfinite(bias):
                raise BadValue("logit_bias", f" for token {tid} must be finite, got {bias} (a ban forbids a token)")
        for seq in self.ban:
            if not seq:
                raise BadValue("ban", " got an empty token sequence")
            for tid in seq:
                if not 0 <= tid < vocab_size:
                    raise BadValue("ban", f" token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
        _check_order(self.order)
        for name, stage in STAGES.items():
            if stage.active(self) and name not in self.order:
                raise BadValue("order", f" {','.join(self.order)} leaves out sampler stage '{name}', which is set")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise BadValue("seed", f" must be in [0, 2**64), got {self.seed}")

    def to_dict(self) -> dict:
        """The trace's "sampling" record: every setting (JSON-safe) plus the stages that will actually run."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "typical_p": self.typical_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": {str(tid): bias for tid, bias in self.logit_bias.items()},
            "ban": [list(seq) for seq in self.ban],
            "order": list(self.order),
            "seed": self.seed,
            "greedy": self.greedy,
            "stages": self.active_stages(),
        }


def _check_order(names: list[str]) -> None:
    valid = ", ".join(STAGES)
    if not names:
        raise BadValue("order", f" is empty; give presets hf or llama.cpp, or stage names from: {valid}")
    for name in names:
        if name not in STAGES:
            raise BadValue("order", f": unknown sampler stage '{name}'; valid: {valid} (or a preset: hf, llama.cpp)")
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise BadValue("order", f": sampler stage '{dup}' appears twice")


def parse_order(spec: str) -> list[str]:
    """'hf' | 'llama.cpp' | 'a,b,c' -> list of stage names (validated)."""
    spec = spec.strip()
    if spec in PRESETS:
        return list(PRESETS[spec])
    names = [s.strip() for s in spec.split(",") if s.strip()]
    _check_order(names)
    return names


def parse_logit_bias(items: list[str], vocab_size: int) -> dict[int, float]:
    """['ID=BIAS', ...] -> {id: bias}. Bad syntax, an id outside [0, vocab_size) or a repeated id -> BadValue."""
    out: dict[int, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            tid, bias = int(key.strip()), float(value.strip())
        except ValueError:
            raise BadValue("logit_bias", f" '{item}' is not ID=BIAS (e.g. 1234=-5.0)") from None
        if not 0 <= tid < vocab_size:
            raise BadValue("logit_bias", f" '{item}': token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
        if not math.isfinite(bias):
            raise BadValue("logit_bias", f" '{item}': bias must be a finite number (a ban forbids a token)")
        if tid in out:
            raise BadValue("logit_bias", f" '{item}': token id {tid} is given twice")
        out[tid] = bias
    return out


# -----------------------------------------------------------------------------
# stages: pure functions, logits (V,) float32 -> logits (V,), masked entries -inf


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    return logits / t


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF: for each id seen in the history (once, however often), a negative logit is multiplied by the penalty and a
    positive one divided, so both move down for penalty > 1."""
    out = logits.clone()
    x = logits[seen]
    out[seen] = torch.where(x < 0, x * penalty, x / penalty)
    return out


def frequency_penalty(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, f: float) -> torch.Tensor:
    """OpenAI / llama.cpp: logit -= f * (times the id occurs in the history)."""
    out = logits.clone()
    out[seen] = logits[seen] - f * counts.to(logits.dtype)
    return out


def presence_penalty(logits: torch.Tensor, seen: torch.Tensor, p: float) -> torch.Tensor:
    """OpenAI / llama.cpp: logit -= p for every id that occurs in the history at all."""
    out = logits.clone()
    out[seen] = logits[seen] - p
    return out


def logit_bias(logits: torch.Tensor, ids: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    out[ids] = logits[ids] + biases
    return out


def ban(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.index_fill(0, ids, NEG_INF)


def banned_ids(sequences: list[list[int]], history: list[int]) -> list[int]:
    """HF NoBadWords: a one-token sequence is always banned; a longer one bans its last token only when the history
    ends with the rest of it (the next token would complete the banned text)."""
    out = []
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or history[len(history) - len(prefix) :] == prefix:
            out.append(seq[-1])
    return out


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """HF: drop everything below the k-th largest logit (ties with it survive)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def _on_survivors(stage: Callable[..., torch.Tensor], logits: torch.Tensor, *args) -> torch.Tensor:
    """Run a sorting stage on the finite entries only: after top-k, sorting 40 survivors instead of V is ~100x cheaper,
    and masked tokens (probability 0) cannot change what a sort-and-cumulate stage keeps."""
    idx = torch.isfinite(logits).nonzero().squeeze(1)  # (S,)
    if idx.numel() in (0, logits.numel()):
        return stage(logits, *args)
    out = torch.full_like(logits, NEG_INF)
    out[idx] = stage(logits[idx], *args)
    return out


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """HF: sort ascending and drop the low tail whose cumulative probability is <= 1 - p; the top token always stays.
    What survives is the smallest set of top tokens with cumulative probability >= p."""
    return _on_survivors(_top_p, logits, p)


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=False, stable=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= 1 - p
    drop_sorted[-1] = False
    drop = drop_sorted.scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below p times the top token's (the top token always stays, since p <= 1)."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < p * probs.max(), NEG_INF)


def typical_p(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """HF locally typical sampling: rank tokens by how far their surprisal -log p is from the entropy H, and keep the
    closest ones until their probability reaches `mass` (ties at the cut survive; at least one token stays)."""
    return _on_survivors(_typical_p, logits, mass)


def _typical_p(logits: torch.Tensor, mass: float) -> torch.Tensor:
    logp = logits.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum()  # masked tokens give -inf * 0 = nan, dropped by nansum
    distance = (-logp - entropy).abs()
    sorted_distance, order = torch.sort(distance, descending=False, stable=True)
    cum = logits[order].softmax(dim=-1).cumsum(dim=-1)
    last = min(int((cum < mass).sum()), logits.shape[-1] - 1)
    drop_sorted = sorted_distance > sorted_distance[last]
    drop_sorted[0] = False
    drop = drop_sorted.scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


# -----------------------------------------------------------------------------
# the stage table: name -> kind, when it is active, how it is applied


@dataclass
class _Context:
    """What stages need besides the logits, computed once per step: the history's distinct ids and their counts,
    the ids a ban forbids now, and the bias as tensors."""

    seen: torch.Tensor  # (U,) distinct ids in the history
    counts: torch.Tensor  # (U,) how often each occurs
    banned: torch.Tensor  # (B,) ids to mask this step
    bias_ids: torch.Tensor  # (N,)
    bias_values: torch.Tensor  # (N,)


@dataclass(frozen=True)
class _Stage:
    kind: str  # "logits": changes values, also runs when greedy; "scale" / "truncate": only when sampling
    active: Callable[[SamplerConfig], bool]
    apply: Callable[[torch.Tensor, SamplerConfig, _Context], torch.Tensor]


STAGES: dict[str, _Stage] = {
    "temperature": _Stage("scale", lambda c: c.temperature != 1.0, lambda x, c, h: temperature(x, c.temperature)),
    "repetition_penalty": _Stage(
        "logits",
        lambda c: c.repetition_penalty != 1.0,
        lambda x, c, h: repetition_penalty(x, h.seen, c.repetition_penalty),
    ),
    "frequency_penalty": _Stage(
        "logits",
        lambda c: c.frequency_penalty != 0.0,
        lambda x, c, h: frequency_penalty(x, h.seen, h.counts, c.frequency_penalty),
    ),
    "presence_penalty": _Stage(
        "logits",
        lambda c: c.presence_penalty != 0.0,
        lambda x, c, h: presence_penalty(x, h.seen, c.presence_penalty),
    ),
    "logit_bias": _Stage(
        "logits",
        lambda c: bool(c.logit_bias),
        lambda x, c, h: logit_bias(x, h.bias_ids, h.bias_values),
    ),
    "ban": _Stage("logits", lambda c: bool(c.ban), lambda x, c, h: ban(x, h.banned)),
    "top_k": _Stage("truncate", lambda c: c.top_k != 0, lambda x, c, h: top_k(x, c.top_k)),
    "top_p": _Stage("truncate", lambda c: c.top_p != 1.0, lambda x, c, h: top_p(x, c.top_p)),
    "min_p": _Stage("truncate", lambda c: c.min_p != 0.0, lambda x, c, h: min_p(x, c.min_p)),
    "typical_p": _Stage("truncate", lambda c: c.typical_p != 1.0, lambda x, c, h: typical_p(x, c.typical_p)),
}


# -----------------------------------------------------------------------------
# the draw


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The first token id whose cumulative probability (float64, summed in id order) exceeds u * total.

    A token of probability 0 can never be that first id: its cumulative value equals its predecessor's."""
    cdf = probs.to(device="cpu", dtype=torch.float64).cumsum(dim=0)
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)):
        raise LlmtraceError(f"the sampler stages left no token to draw (all masked, or logits overflowed: total {total})")
    target = torch.tensor([u * total], dtype=torch.float64)
    i = int(torch.searchsorted(cdf, target, right=True))
    if i >= cdf.shape[0]:  # u * total rounded up to total: take the last token that has any probability
        i = int(torch.nonzero(probs.cpu()).max())
    return i


# -----------------------------------------------------------------------------
# ledger


@dataclass
class StageRecord:
    stage: str  # "input" for the raw distribution, then one per applied stage
    survivors: int  # tokens with a finite logit after this stage
    pick_prob: float  # probability of the eventual pick after this stage (renormalised over survivors)
    probs_sum: float  # sum of the probabilities after this stage (1 up to rounding)
    top: int = -1  # the most likely token after this stage (a bias, ban or penalty can change it)


@dataclass
class Ledger:
    topk: list[tuple[int, float, float]]  # (id, logit, prob) of the raw logits, the k_show largest
    stages: list[StageRecord]  # "input" first, then each applied stage in order
    draw: float | None  # the uniform u in [0, 1); None when greedy
    seed: int
    token: int
    greedy: bool


# -----------------------------------------------------------------------------
# sampler


class Sampler:
    """Applies a SamplerConfig step after step with one seeded generator, so the same seed gives the same tokens."""

    def __init__(self, config: SamplerConfig, vocab_size: int, *, k_show: int = 10):
        config.validate(vocab_size)
        self.seed: int = config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.config = replace(config, seed=self.seed)  # to_dict() then records the seed actually used
        self.vocab_size = vocab_size
        self.k_show = k_show
        self.generator = torch.Generator().manual_seed(self.seed)
        self.stages = [(name, STAGES[name]) for name in config.active_stages()]
        self._bias_ids = torch.tensor(list(config.logit_bias), dtype=torch.long)
        self._bias_values = torch.tensor(list(config.logit_bias.values()), dtype=torch.float32)
        self._ban_always = sorted({seq[0] for seq in config.ban if len(seq) == 1})
        self._ban_prefixed = [list(seq) for seq in config.ban if len(seq) > 1]

    def _context(self, history: list[int] | torch.Tensor, device: torch.device) -> _Context:
        names = {name for name, _ in self.stages}
        empty = torch.empty(0, dtype=torch.long, device=device)
        seen, counts = empty, empty
        if names & {"repetition_penalty", "frequency_penalty", "presence_penalty"}:
            h = torch.as_tensor(history, dtype=torch.long, device=device)
            if h.numel():
                seen, counts = torch.unique(h, return_counts=True)
        banned = self._ban_always
        if "ban" in names and self._ban_prefixed:
            longest = max(len(seq) for seq in self._ban_prefixed) - 1
            tail = history[-longest:] if len(history) else []
            tail = tail.tolist() if isinstance(tail, torch.Tensor) else list(tail)
            banned = sorted(set(banned) | set(banned_ids(self._ban_prefixed, tail)))
        return _Context(
            seen=seen,
            counts=counts,
            banned=torch.tensor(banned, dtype=torch.long, device=device),
            bias_ids=self._bias_ids.to(device),
            bias_values=self._bias_values.to(device),
        )

    def process(self, logits: torch.Tensor, history: list[int] | torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """[("input", logits), (stage, logits after it), ...] for every active stage, in order."""
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(f"expected logits of shape ({self.vocab_size},), got {tuple(logits.shape)}")
        x = logits.float()
        out = [("input", x)]
        if self.stages:
            ctx = self._context(history, x.device)
            for name, stage in self.stages:
                x = stage.apply(x, self.config, ctx)
                out.append((name, x))
        return out

    def sample(
        self, logits: torch.Tensor, history: list[int] | torch.Tensor, *, ledger: bool
    ) -> tuple[int, Ledger | None]:
        """logits (V,) for the next position, history = token ids so far (prompt included) -> (token id, ledger)."""
        greedy = self.config.greedy
        if greedy and not self.stages and not ledger:
            return int(torch.argmax(logits)), None  # the common fast path: one sync
        steps = self.process(logits, history)
        final = steps[-1][1]
        u = None
        if greedy:
            token = int(torch.argmax(final))
            if final[token].item() == NEG_INF:
                raise LlmtraceError("the sampler stages left no token with a positive probability (all banned?)")
        else:
            u = float(torch.rand((), generator=self.generator, dtype=torch.float64))
            token = inverse_cdf(torch.softmax(final.to(device="cpu", dtype=torch.float64), dim=-1), u)
        if not ledger:
            return token, None
        return token, self._ledger(steps, token, u)

    def _ledger(self, steps: list[tuple[str, torch.Tensor]], token: int, u: float | None) -> Ledger:
        raw = steps[0][1]
        logps = torch.stack([x.log_softmax(dim=-1) for _, x in steps])  # (S, V)
        finite = torch.stack([torch.isfinite(x).sum() for _, x in steps]).to(torch.float64)  # (S,)
        tops = logps.argmax(dim=-1).double()  # (S,) ids below 2**53 are exact in float64
        facts = torch.stack([finite, logps[:, token].exp().double(), logps.exp().sum(dim=-1).double(), tops], dim=1)
        k = min(self.k_show, raw.shape[0])
        top_logits, top_ids = torch.topk(raw, k)
        top_probs = logps[0, top_ids].exp()
        return Ledger(
            topk=list(zip(top_ids.tolist(), top_logits.tolist(), top_probs.tolist())),
            stages=[
                StageRecord(stage=name, survivors=int(n), pick_prob=p, probs_sum=s, top=int(t))
                for (name, _), (n, p, s, t) in zip(steps, facts.tolist())
            ],
            draw=u,
            seed=self.seed,
            token=token,
            greedy=u is None,
        )


def banned_sequences(tok, texts: list[str]) -> list[list[int]]:
    """The token sequences the ban stage refuses for each text: the text as given and with one leading space (how a
    word appears mid-sentence), each encoded without special tokens. `tok` is a llmtrace TextTokenizer."""
    out: list[list[int]] = []
    for t in texts:
        if not t:
            raise BadValue("ban", " needs a non-empty text")
        for variant in (t, " " + t.lstrip(" ")):
            ids = tok.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out
