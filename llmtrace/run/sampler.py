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

The samplers llama.cpp has and transformers lacks are stages too, read from llama.cpp's src/llama-sampling.cpp,
common/sampling.cpp and common/common.h and from the papers (each function cites its sources): DRY (a penalty, so it
also runs when greedy), top-nσ and XTC (truncations; XTC takes a draw of its own from the row's generator, before
the final one), and mirostat, which is no part of the order: when on it replaces penalties, DRY and truncation, as
llama.cpp's mirostat chain does (logit bias and ban, temperature, mirostat), runs last, and carries its state μ from
step to step in the Sampler (one Sampler per batch row). Each of them also leaves a `detail` in the ledger: what it
computed over the full vocabulary and why it did or did not act. Decisions where llama.cpp leaves a choice: p is
float64 here (float32 there); dry_penalty_last_n defaults to llama.cpp's current 64 (it was -1, the whole context,
before); ties are broken by id; XTC has no min_keep (llama.cpp's common default is 0).

Notation: V vocab size, T history length.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass, field, fields
from typing import Callable

from llmtrace.errors import BadValue, LlmtraceError


class _Torch:
    """torch, imported when a stage first runs: the CLI checks sampler settings (SamplerConfig.validate, parse_order,
    parse_logit_bias) before it imports torch, so that a usage error is said at once, not after 2-3 s of `import
    torch`. The first attribute looked up replaces this stand-in by the module itself."""

    def __getattr__(self, name: str):
        import torch as module

        globals()["torch"] = module
        return getattr(module, name)


torch = _Torch()

NEG_INF = float("-inf")

# -----------------------------------------------------------------------------
# orders

# HF transformers 5.x, `GenerationMixin._get_logits_processor` (generation/utils.py) appends, in this order:
# SequenceBiasLogitsProcessor (our logit_bias), RepetitionPenaltyLogitsProcessor, NoBadWordsLogitsProcessor (ban),
# then, only when sampling: Temperature, TopK, TopP, MinP, Typical. HF has no frequency/presence penalty; we put
# them beside the repetition penalty, where llama.cpp's penalties sampler applies all three.
#
# transformers has none of DRY, top-nσ or XTC (decision: they sit in this preset where llama.cpp puts them relative to
# the stages HF has: DRY with the penalties, top-nσ before top-k (it does not depend on temperature), XTC last).
HF_ORDER = [
    "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "dry", "ban",
    "temperature", "top_n_sigma", "top_k", "top_p", "min_p", "typical_p", "xtc",
]  # fmt: skip

# llama.cpp `common_sampler_init` (common/sampling.cpp) first adds the logit-bias sampler (a ban is a -inf bias
# there), then the chain of `common_params_sampling::samplers` (common/common.h), by default: penalties (repeat,
# then frequency and presence), dry, top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature; then dist.
# With mirostat on, `common_sampler_init` builds a different chain: logit bias, temperature, mirostat (v1 or v2), and
# nothing of the list above; llmtrace does the same (`SamplerConfig.active_stages`, `ignored_by_mirostat`).
LLAMA_CPP_ORDER = [
    "logit_bias", "ban", "repetition_penalty", "frequency_penalty", "presence_penalty", "dry",
    "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature",
]  # fmt: skip

PRESETS = {"hf": HF_ORDER, "llama.cpp": LLAMA_CPP_ORDER}

# What llama.cpp's mirostat chain keeps in front of mirostat (a ban is a -inf logit bias there); everything else of the
# order is left out while mirostat is on.
MIROSTAT_KEEPS = ("logit_bias", "ban", "temperature")
MIROSTAT_M = 100  # v1 fits the Zipf exponent on the m most likely tokens (llama.cpp passes m = 100, as the paper does)

DRY_BREAKERS = ["\n", ":", "\"", "*"]  # llama.cpp's default dry_sequence_breakers (common/common.h)
DRY_MAX_BREAKER_CHARS = 40  # llama.cpp truncates a longer breaker (with a warning); llmtrace refuses it
DRY_MAX_TAIL = 20  # tokens of a breaker's tail that are matched (llama.cpp's MAX_SEQ_LEN)
DETAIL_TOKENS = 8  # tokens a stage's detail lists (most penalised, removed): the ledger's "why", not a dump


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
    # the samplers llama.cpp has and transformers lacks; defaults are llama.cpp's (common/common.h)
    top_n_sigma: float = 0.0  # keep logits >= max - n * sigma; 0 = off (llama.cpp writes -1)
    xtc_probability: float = 0.0  # the chance that XTC acts at a step; 0 = off
    xtc_threshold: float = 0.1  # XTC removes the tokens with p >= this except the least likely; > 0.5: never acts
    dry_multiplier: float = 0.0  # DRY: a token extending a repeat of length n >= allowed loses M * base^(n - allowed)
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # tokens of the context DRY scans; -1 = all of it, 0 = off
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))  # texts that end a repeat
    mirostat: int = 0  # 0 = off, 1 = mirostat (v1), 2 = mirostat 2.0
    mirostat_tau: float = 5.0  # target surprise, bits
    mirostat_eta: float = 0.1  # learning rate of mu

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def active_stages(self) -> list[str]:
        """The stages that will run, in order: the non-neutral ones, and for greedy only the value-changing ones.
        With mirostat on, llama.cpp's mirostat chain: logit bias and ban, temperature, then mirostat."""
        names = [
            name
            for name in self.order
            if STAGES[name].active(self) and (not self.greedy or STAGES[name].kind == "logits")
        ]
        if self.mirostat:
            names = [n for n in names if n in MIROSTAT_KEEPS] + ([] if self.greedy else ["mirostat"])
        return names

    def ignored_by_mirostat(self) -> list[str]:
        """The fields set to something other than neutral that mirostat's chain leaves out (llama.cpp builds no
        penalties, DRY or truncation samplers when mirostat is on), in the order's order."""
        if not self.mirostat:
            return []
        return [STAGE_FIELD.get(n, n) for n in self.order if n not in MIROSTAT_KEEPS and STAGES[n].active(self)]

    def ignored_by_greedy(self) -> list[str]:
        """The set fields of the new sampling stages that temperature 0 (greedy: the argmax) leaves out."""
        if not self.greedy:
            return []
        if self.mirostat:  # the others are mirostat's to ignore
            return ["mirostat"]
        return [STAGE_FIELD.get(n, n) for n in ("top_n_sigma", "xtc") if STAGES[n].active(self)]

    def __post_init__(self):
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Raise BadValue, naming the field, for the first out-of-range setting: once, when the config is made. The
        ids (logit_bias, ban) are checked against the vocabulary by `check_ids`, once the model is known."""
        t = self.temperature
        if not math.isfinite(t):
            raise BadValue("temperature", f" must be a finite number >= 0 (0 = greedy), got {t}")
        if t < 0:
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
            raise BadValue("repetition_penalty", f" must be a finite number > 0 (1 = off), got {r}")
        penalties = {"frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}
        for name, value in penalties.items():
            if not math.isfinite(value):
                raise BadValue(name, f" must be a finite number, got {value}")
        for tid, bias in self.logit_bias.items():
            if not math.isfinite(bias):
                raise BadValue("logit_bias", f" for token {tid} must be finite, got {bias} (a ban forbids a token)")
        if any(not seq for seq in self.ban):
            raise BadValue("ban", " got an empty token sequence")
        _check_order(self.order)
        for name, stage in STAGES.items():
            if stage.active(self) and name not in self.order:
                raise BadValue("order", f" {','.join(self.order)} leaves out sampler stage '{name}', which is set")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise BadValue("seed", f" must be in [0, 2**64), got {self.seed}")
        self._validate_llama_cpp_samplers()

    def check_ids(self, vocab_size: int) -> None:
        """The token ids of logit_bias and ban are in the vocabulary (known once a model is), and the order has a
        place for a ban set after the config was made (`changed(ban=...)`)."""
        for tid in self.logit_bias:
            if not 0 <= tid < vocab_size:
                raise BadValue("logit_bias", f" token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
        for seq in self.ban:
            for tid in seq:
                if not 0 <= tid < vocab_size:
                    raise BadValue("ban", f" token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
        if self.ban and "ban" not in self.order:
            raise BadValue("order", f" {','.join(self.order)} leaves out sampler stage 'ban', which is set")

    def changed(self, **changes) -> "SamplerConfig":
        """A copy with `changes` (seed, ban), not checked again: its ranges were checked when it was made, and ids are
        `check_ids`' to check."""
        other = copy.copy(self)
        for name, value in changes.items():
            setattr(other, name, value)
        return other

    def _validate_llama_cpp_samplers(self) -> None:
        n = self.top_n_sigma
        if not math.isfinite(n) or n < 0:
            raise BadValue("top_n_sigma", f" must be >= 0 (0 = off), got {n}")
        for name in ("xtc_probability", "xtc_threshold"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise BadValue(name, f" is a probability: it must be in [0, 1], got {v}")
        m = self.dry_multiplier
        if not math.isfinite(m) or m < 0:
            raise BadValue("dry_multiplier", f" must be >= 0 (0 = off), got {m}")
        b = self.dry_base
        if not math.isfinite(b) or b < 1:
            raise BadValue("dry_base", f" must be >= 1 (llama.cpp turns DRY off below 1), got {b}")
        if _not_int(self.dry_allowed_length) or self.dry_allowed_length < 0:
            raise BadValue("dry_allowed_length", f" must be an integer >= 0, got {self.dry_allowed_length}")
        if _not_int(self.dry_penalty_last_n) or self.dry_penalty_last_n < -1:
            raise BadValue("dry_penalty_last_n", f" must be an integer >= 0, or -1 for the whole context, got "
                                                 f"{self.dry_penalty_last_n}")
        for text in self.dry_sequence_breakers:
            if not isinstance(text, str) or not text:
                raise BadValue("dry_sequence_breakers", f" must be a non-empty text, got {text!r}")
            if len(text.encode("utf-8")) > DRY_MAX_BREAKER_CHARS:
                raise BadValue("dry_sequence_breakers", f" {text!r} is longer than {DRY_MAX_BREAKER_CHARS} bytes "
                                                       "(llama.cpp's limit)")
        if _not_int(self.mirostat) or self.mirostat not in (0, 1, 2):
            raise BadValue("mirostat", f" must be 0 (off), 1 or 2, got {self.mirostat}")
        for name in ("mirostat_tau", "mirostat_eta"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise BadValue(name, f" must be >= 0, got {v}")

    def to_dict(self) -> dict:
        """The trace's "sampling" record: every setting, as declared above (JSON-safe: ids as keys are strings), plus
        what follows from them: greedy, the stages that will actually run, and the fields left unused."""
        return {f.name: _json_safe(getattr(self, f.name)) for f in fields(self)} | {
            "greedy": self.greedy,
            "stages": self.active_stages(),
            "ignored": self.ignored_by_mirostat() + self.ignored_by_greedy(),
        }


def _json_safe(value):
    """A setting as JSON holds it: a dict's keys as strings, tuples and lists as lists."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _not_int(v) -> bool:
    return isinstance(v, bool) or not isinstance(v, int)


def _check_order(names: list[str]) -> None:
    valid = ", ".join(STAGES)
    if not names:
        raise BadValue("order", f" is empty; give presets hf or llama.cpp, or stage names from: {valid}")
    for name in names:
        if name == "mirostat":
            raise BadValue("order", ": mirostat has no place in the order; when on (mirostat 1 or 2) it replaces the "
                                    "truncation chain and always runs last")
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
# the samplers of llama.cpp that transformers lacks. Each returns (logits, detail): the detail is the ledger's record of
# what the stage computed over the whole vocabulary, so that a reader sees why it did or did not act.


def top_n_sigma(logits: torch.Tensor, n: float) -> tuple[torch.Tensor, dict]:
    """Top-nσ (Tang et al., "Top-nσ: Not All Logits Are You Need", arXiv 2411.07641; llama.cpp #11223,
    `llama_sampler_top_n_sigma_apply` in src/llama-sampling.cpp): keep the tokens whose logit is >= max - n·σ, σ the
    standard deviation (population: divided by the count) of the finite logits; masked tokens are not candidates.
    Dividing every logit by a temperature T divides max and σ by T as well, so the kept set is the same at any
    temperature: llama.cpp runs it before temperature, and the ledger says so. max and σ are computed in float64."""
    finite = torch.isfinite(logits)
    vals = logits[finite].double()
    detail = {"n": n, "candidates": int(vals.numel())}
    if vals.numel() == 0:
        return logits, detail
    mx = float(vals.max())
    sigma = float(vals.std(correction=0)) if vals.numel() > 1 else 0.0
    threshold = mx - n * sigma
    detail |= {"max": mx, "sigma": sigma, "threshold": threshold}
    return logits.masked_fill(logits.double() < threshold, NEG_INF), detail


def xtc(logits: torch.Tensor, probability: float, threshold: float, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """XTC, "exclude top choices" (text-generation-webui #6335; llama.cpp #9742, `llama_sample_xtc_apply`): with
    probability `probability`, if at least two candidates have p >= `threshold`, remove all of them except the least
    likely one, so the model takes a less obvious but still plausible continuation.

    The chance is one uniform u in [0, 1) from the row's generator (the same stream as the final draw, drawn before
    it); XTC acts when u < probability. As in llama.cpp there is no draw at all when threshold > 0.5 (two tokens cannot
    both reach it) or fewer than two candidates are left. p is the softmax (float64) of the candidates as they reach
    XTC. Among tokens of equal p the one with the highest id is taken as the least likely. llama.cpp's min_keep
    (common default 0) is not an option: the least likely token over the threshold always stays."""
    candidates = int(torch.isfinite(logits).sum())
    detail: dict = {"probability": probability, "threshold": threshold, "draw": None, "fired": False, "over": 0,
                    "removed": [], "n_removed": 0, "kept": None}
    if probability <= 0 or threshold > 0.5 or candidates < 2:
        return logits, detail
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    detail["draw"] = u
    if not u < probability:
        return logits, detail
    detail["fired"] = True
    probs = logits.double().softmax(dim=-1)
    over = (probs >= threshold).nonzero().squeeze(1)  # (O,) ascending ids
    detail["over"] = int(over.numel())
    if over.numel() < 2:
        return logits, detail
    order = torch.sort(probs[over], descending=True, stable=True).indices  # ties keep id order: the last is kept
    removed, kept = over[order[:-1]], int(over[order[-1]])
    detail |= {"removed": [{"id": int(i), "p": float(probs[i])} for i in removed[:DETAIL_TOKENS * 4]],
               "n_removed": int(removed.numel()), "kept": {"id": kept, "p": float(probs[kept])}}
    return logits.index_fill(0, removed, NEG_INF), detail


def repeat_lengths(context: list[int]) -> list[int]:
    """n[j] for every position j of the context: how many tokens ending at j equal the same number of tokens at the
    end of the context (the longest suffix of context[:j+1] that is also a suffix of the context). n[L-1] is L.

    The Z-function of the reversed context (z[k]: the longest common prefix of r and r[k:]), computed in linear time;
    llama.cpp's DRY uses the same idea (its step 2)."""
    r = context[::-1]
    L = len(r)
    z = [0] * L
    if L:
        z[0] = L
    left = right = 0  # the window [left, right) of r known to equal a prefix of r
    for k in range(1, L):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < L and r[z[k]] == r[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z[::-1]


FLOAT_MAX_LOG = 88.7228391  # ln of float32's largest value: llama.cpp clamps DRY's exponent so base^exp stays finite


def dry(logits: torch.Tensor, context: list[int], multiplier: float, base: float, allowed: int,
        breakers: dict[int, list[tuple[int, ...]]]) -> tuple[torch.Tensor, dict]:
    """DRY, "don't repeat yourself" (text-generation-webui #5677 by p-e-w; llama.cpp #9702, `llama_sampler_dry_apply`,
    ported there from koboldcpp #982): a candidate that would extend a repeat loses multiplier · base^(n − allowed)
    from its logit, n being the length of the repeat it would extend, when n >= allowed.

    `context` is the last dry_penalty_last_n tokens (prompt included). For each earlier position j whose tokens repeat
    the end of the context for n >= allowed tokens, the token that followed j, context[j + 1], would extend the repeat
    to n + 1; a token takes the largest such n. Sequence breakers end repeats: the most recent one limits every n to
    the tokens after it, and a token that is a breaker on its own is never penalised. `breakers` maps a breaker's
    first token to the rest of each breaker sequence starting with it (() for a one-token breaker), see
    `dry_breakers`. Nothing happens when the context has at most `allowed` tokens or the last breaker leaves fewer
    than `allowed` after it. The exponent is clamped as llama.cpp does (base^exp stays a finite float32)."""
    L = len(context)
    detail: dict = {"multiplier": multiplier, "base": base, "allowed_length": allowed, "scanned": L, "limit": None,
                    "breaker_distance": None, "longest": 0, "penalised": [], "n_penalised": 0, "exempt": []}
    if L <= allowed:
        return logits, detail
    limit = L
    for i in range(L):  # i tokens from the end: the most recent breaker wins
        tails = breakers.get(context[L - 1 - i])
        if tails is None:
            continue
        longest = max((len(t) for t in tails if len(t) <= i and list(t) == context[L - i : L - i + len(t)]), default=-1)
        if longest >= 0:
            limit = i - longest  # the tokens after the whole breaker sequence
            detail["breaker_distance"] = i
            break
    detail["limit"] = limit
    if limit < allowed:
        return logits, detail
    n = repeat_lengths(context)
    best: dict[int, int] = {}
    for j in range(L - 1):
        nj = min(n[j], limit)
        detail["longest"] = max(detail["longest"], nj)
        if nj >= allowed:
            tid = context[j + 1]
            best[tid] = max(best.get(tid, -1), nj)
    max_exp = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    hits = []
    for tid, nt in best.items():
        if () in breakers.get(tid, ()):
            detail["exempt"].append({"id": tid, "n": nt})
            continue
        e = nt - allowed
        if max_exp > 0 and e > max_exp:
            e = max_exp
        hits.append((multiplier * base**e, tid, nt))
    hits.sort(key=lambda h: (-h[0], h[1]))
    detail["exempt"] = detail["exempt"][:DETAIL_TOKENS]
    detail["n_penalised"] = len(hits)
    detail["penalised"] = [{"id": tid, "n": nt, "penalty": pen} for pen, tid, nt in hits[:DETAIL_TOKENS]]
    if not hits:
        return logits, detail
    ids = torch.tensor([h[1] for h in hits], dtype=torch.long, device=logits.device)
    pens = torch.tensor([h[0] for h in hits], dtype=logits.dtype, device=logits.device)  # float32, as llama.cpp's
    out = logits.clone()
    out[ids] = logits[ids] - pens
    return out, detail


@functools.lru_cache(maxsize=8)
def dry_breakers(tokenizer, texts: tuple[str, ...], vocab_size: int) -> dict[int, list[tuple[int, ...]]]:
    """The token sequences each sequence-breaker text can appear as, as llama.cpp finds them
    (`get_overlapping_token_sequences`, from koboldcpp): a token whose text contains the breaker is a breaker on its
    own (tail ()); a token whose text ends with the start of the breaker is its head, and the rest of the breaker,
    tokenized, is its tail (at most DRY_MAX_TAIL tokens). Compared as UTF-8 bytes over every token of the vocabulary.
    `tokenizer` needs `token_bytes(id)`, `encode(text, add_special_tokens=False)` and `vocab_size`."""
    table: dict[int, list[tuple[int, ...]]] = {}
    words = [tokenizer.token_bytes(t) for t in range(min(vocab_size, tokenizer.vocab_size))]
    for text in texts:
        s = text.encode("utf-8")
        for tid, word in enumerate(words):
            if s in word:
                seqs = [()]
            else:  # every position from which the rest of the word is a proper prefix of the breaker
                seqs = []
                pos = word.find(s[:1])
                while pos != -1:
                    rest = word[pos:]
                    if s.startswith(rest):
                        more = s[len(rest) :].decode("utf-8", errors="ignore")
                        seqs.append(tuple(tokenizer.encode(more, add_special_tokens=False)[:DRY_MAX_TAIL]))
                    pos = word.find(s[:1], pos + 1)
            for seq in seqs:
                if seq not in table.setdefault(tid, []):
                    table[tid].append(seq)
    return table


def mirostat_v1(logits: torch.Tensor, mu: float, n_vocab: int, m: int = MIROSTAT_M) -> tuple[torch.Tensor, dict]:
    """Mirostat (Basu et al., "Mirostat: a neural text decoding algorithm that directly controls perplexity", ICLR
    2021, arXiv 2007.14966, Algorithm 1; llama.cpp `llama_sampler_mirostat_apply`): assume the sorted probabilities
    follow Zipf's law p_i ∝ i^-s and estimate s from the m most likely tokens by least squares through the origin,
    s_hat = Σ t_i·b_i / Σ t_i², t_i = ln((i+2)/(i+1)), b_i = ln(p_i / p_(i+1)); then keep the top k tokens,
    k = (ε·2^μ / (1 − N^−ε))^(1/s_hat), ε = s_hat − 1, N the vocabulary size (int(k), at least 1). Probabilities are
    float64; a token of probability 0 is not fitted. When k is not a finite number (s_hat = 1, one candidate), every
    candidate stays (llama.cpp's float arithmetic leaves that case undefined). μ is updated after the draw."""
    probs = logits.double().softmax(dim=-1)
    p_sorted, order = torch.sort(probs, descending=True, stable=True)
    n_pos = int((p_sorted > 0).sum())
    top = p_sorted[: min(m, n_pos)].tolist()
    num = den = 0.0
    for i in range(len(top) - 1):
        t = math.log((i + 2) / (i + 1))
        num += t * math.log(top[i] / top[i + 1])
        den += t * t
    s_hat = num / den if den > 0 else float("nan")
    try:
        eps = s_hat - 1
        k = math.pow(eps * math.pow(2, mu) / (1 - math.pow(n_vocab, -eps)), 1 / s_hat)
    except (ValueError, OverflowError, ZeroDivisionError):
        k = float("nan")
    keep = min(max(int(k), 1), n_pos) if math.isfinite(k) else n_pos
    drop = torch.ones_like(probs, dtype=torch.bool)
    drop[order[:keep]] = False
    detail = {"version": 1, "mu": mu, "s_hat": s_hat if math.isfinite(s_hat) else None,
              "k": k if math.isfinite(k) else None, "kept": keep}
    return logits.masked_fill(drop, NEG_INF), detail


def mirostat_v2(logits: torch.Tensor, mu: float) -> tuple[torch.Tensor, dict]:
    """Mirostat 2.0 (the simplified algorithm llama.cpp ships as `llama_sampler_mirostat_v2_apply`; Basu et al.,
    arXiv 2007.14966): keep the tokens whose surprise −log2 p is at most μ (at least the most likely one), then draw
    from them renormalised. p is float64. μ is updated after the draw."""
    probs = logits.double().softmax(dim=-1)
    keep = -torch.log2(probs) <= mu
    if not keep.any():
        keep[int(torch.argmax(probs))] = True
    detail = {"version": 2, "mu": mu, "kept": int(keep.sum())}
    return logits.masked_fill(~keep, NEG_INF), detail


def mirostat_update(mu: float, surprise: float, tau: float, eta: float) -> float:
    """μ ← μ − η·(s − τ): s the surprise −log2 p of the chosen token in the distribution it was drawn from (after
    the truncation, renormalised). The same rule for v1 and v2; μ starts at 2τ."""
    return mu - eta * (surprise - tau)


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
    dry_context: list[int] = field(default_factory=list)  # the last dry_penalty_last_n tokens (DRY on)
    dry_breakers: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    generator: torch.Generator | None = None  # the row's random stream (XTC draws from it)
    details: dict[str, dict] = field(default_factory=dict)  # stage name -> its ledger detail, this step

    def keep(self, name: str, result: tuple[torch.Tensor, dict]) -> torch.Tensor:
        self.details[name] = result[1]
        return result[0]


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
    "dry": _Stage(
        "logits",
        lambda c: c.dry_multiplier != 0.0 and c.dry_penalty_last_n != 0,
        lambda x, c, h: h.keep(
            "dry", dry(x, h.dry_context, c.dry_multiplier, c.dry_base, c.dry_allowed_length, h.dry_breakers)
        ),
    ),
    "top_n_sigma": _Stage(
        "truncate", lambda c: c.top_n_sigma != 0.0, lambda x, c, h: h.keep("top_n_sigma", top_n_sigma(x, c.top_n_sigma))
    ),
    "xtc": _Stage(
        "truncate",
        lambda c: c.xtc_probability != 0.0,
        lambda x, c, h: h.keep("xtc", xtc(x, c.xtc_probability, c.xtc_threshold, h.generator)),
    ),
}

# The field that turns a stage on, where it is not the stage's name (a note names the option, not the stage).
STAGE_FIELD = {"dry": "dry_multiplier", "xtc": "xtc_probability"}


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
    detail: dict | None = None  # DRY, top-nσ, XTC, mirostat: what the stage computed and why it did or did not act


@dataclass
class Ledger:
    topk: list[tuple[int, float, float]]  # (id, logit, prob) of the raw logits, the k_show largest
    stages: list[StageRecord]  # "input" first, then each applied stage in order
    draw: float | None  # the uniform u in [0, 1); None when greedy
    seed: int
    token: int
    greedy: bool
    slice: tuple[float, float] | None = None  # the token's [lo, hi) of [0, 1) in the draw (id order); None if greedy
    raw: object = field(default=None, repr=False)  # the raw logits (V,) the stages started from (a tensor, not copied)


# -----------------------------------------------------------------------------
# sampler


class Sampler:
    """Applies a SamplerConfig step after step with one seeded generator, so the same seed gives the same tokens."""

    def __init__(self, config: SamplerConfig, vocab_size: int, *, k_show: int = 10, tokenizer=None):
        """`tokenizer` (a llmtrace TextTokenizer) is needed only when DRY is on with sequence breakers, which are
        texts: `dry_breakers` finds the tokens they can appear as."""
        config.check_ids(vocab_size)  # its ranges were checked when it was made
        self.seed: int = config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.config = config.changed(seed=self.seed)  # to_dict() then records the seed actually used
        self.vocab_size = vocab_size
        self.k_show = k_show
        self.generator = torch.Generator().manual_seed(self.seed)
        active = config.active_stages()
        self.stages = [(name, STAGES[name]) for name in active if name != "mirostat"]
        self.mirostat = config.mirostat if "mirostat" in active else 0  # 0, 1 or 2; it runs after the stages
        self.mu: float | None = 2 * config.mirostat_tau if self.mirostat else None  # mirostat's state, this row's
        self._bias_ids = torch.tensor(list(config.logit_bias), dtype=torch.long)
        self._bias_values = torch.tensor(list(config.logit_bias.values()), dtype=torch.float32)
        self._ban_always = sorted({seq[0] for seq in config.ban if len(seq) == 1})
        self._ban_prefixed = [list(seq) for seq in config.ban if len(seq) > 1]
        self._dry_breakers: dict[int, list[tuple[int, ...]]] = {}
        if "dry" in active and config.dry_sequence_breakers:
            if tokenizer is None:
                raise ValueError("DRY's sequence breakers are texts: pass the tokenizer (Sampler(..., tokenizer=...)), "
                                 "or set dry_sequence_breakers=[]")
            self._dry_breakers = dry_breakers(tokenizer, tuple(config.dry_sequence_breakers), vocab_size)

    def with_seed(self, seed: int) -> "Sampler":
        """This sampler's settings under another seed (a batch row's: run.generate.row_seed), not checked again: a
        generator and a mirostat state of its own."""
        other = copy.copy(self)
        other.seed = seed
        other.config = self.config.changed(seed=seed)
        other.generator = torch.Generator().manual_seed(seed)
        other.mu = 2 * self.config.mirostat_tau if self.mirostat else None
        return other

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
        dry_context: list[int] = []
        if "dry" in names:
            last_n = self.config.dry_penalty_last_n
            tail = history[-last_n:] if last_n > 0 else history
            dry_context = tail.tolist() if isinstance(tail, torch.Tensor) else list(tail)
        return _Context(
            seen=seen,
            counts=counts,
            banned=torch.tensor(banned, dtype=torch.long, device=device),
            bias_ids=self._bias_ids.to(device),
            bias_values=self._bias_values.to(device),
            dry_context=dry_context,
            dry_breakers=self._dry_breakers,
            generator=self.generator,
        )

    def process(self, logits: torch.Tensor, history: list[int] | torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """[("input", logits), (stage, logits after it), ...] for every active stage, in order. XTC takes its draw
        from the row's generator here; mirostat's truncation uses the current μ (updated only by `sample`)."""
        return self._run(logits, history)[0]

    def _run(self, logits: torch.Tensor, history) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict]]:
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(f"expected logits of shape ({self.vocab_size},), got {tuple(logits.shape)}")
        x = logits.float()
        out = [("input", x)]
        details: dict[str, dict] = {}
        if self.stages:
            ctx = self._context(history, x.device)
            for name, stage in self.stages:
                x = stage.apply(x, self.config, ctx)
                out.append((name, x))
            details = ctx.details
        if self.mirostat:
            x, details["mirostat"] = (mirostat_v1(x, self.mu, self.vocab_size) if self.mirostat == 1 else
                                      mirostat_v2(x, self.mu))
            details["mirostat"] |= {"tau": self.config.mirostat_tau, "eta": self.config.mirostat_eta}
            out.append(("mirostat", x))
        return out, details

    def sample(
        self, logits: torch.Tensor, history: list[int] | torch.Tensor, *, ledger: bool
    ) -> tuple[int, Ledger | None]:
        """logits (V,) for the next position, history = token ids so far (prompt included) -> (token id, ledger)."""
        greedy = self.config.greedy
        if greedy and not self.stages and not ledger:
            return int(torch.argmax(logits)), None  # the common fast path: one sync
        steps, details = self._run(logits, history)
        final = steps[-1][1]
        u = None
        if greedy:
            token = int(torch.argmax(final))
            if final[token].item() == NEG_INF:
                raise LlmtraceError("the sampler stages left no token with a positive probability (all banned?)")
        else:
            u = float(torch.rand((), generator=self.generator, dtype=torch.float64))
            probs = torch.softmax(final.to(device="cpu", dtype=torch.float64), dim=-1)
            token = inverse_cdf(probs, u)
            lo = float(probs[:token].sum() / probs.sum())  # the chosen token's slice of [0, 1): the draw landed in it
            drawn = (lo, lo + float(probs[token] / probs.sum()))
            if self.mirostat:  # mirostat is the last stage: probs is its renormalised distribution
                surprise = -math.log2(float(probs[token]))
                self.mu = mirostat_update(self.mu, surprise, self.config.mirostat_tau, self.config.mirostat_eta)
                details["mirostat"] |= {"surprise": surprise, "mu_after": self.mu}
        if not ledger:
            return token, None
        return token, self._ledger(steps, token, u, details, None if greedy else drawn)

    def _ledger(self, steps: list[tuple[str, torch.Tensor]], token: int, u: float | None,
                details: dict[str, dict] | None = None, drawn: tuple[float, float] | None = None) -> Ledger:
        raw = steps[0][1]
        logps = torch.stack([x.log_softmax(dim=-1) for _, x in steps])  # (S, V)
        finite = torch.stack([_finite_count(x) for _, x in steps]).to(torch.float64)  # (S,)
        tops = logps.max(dim=-1).indices.double()  # (S,) the first largest, as argmax; ids below 2**53 are exact
        facts = torch.stack([finite, logps[:, token].exp().double(), logps.exp().sum(dim=-1).double(), tops], dim=1)
        k = min(self.k_show, raw.shape[0])
        top_logits, top_ids = torch.topk(raw, k)
        top_probs = logps[0, top_ids].exp()
        return Ledger(
            topk=list(zip(top_ids.tolist(), top_logits.tolist(), top_probs.tolist())),
            stages=[
                StageRecord(stage=name, survivors=int(n), pick_prob=p, probs_sum=s, top=int(t),
                            detail=(details or {}).get(name))
                for (name, _), (n, p, s, t) in zip(steps, facts.tolist())
            ],
            draw=u,
            seed=self.seed,
            token=token,
            greedy=u is None,
            slice=drawn,
            raw=raw,
        )


def _finite_count(x: torch.Tensor) -> torch.Tensor:
    """How many entries of x are finite (a stage's survivors). On the CPU a finite sum says at once that all are
    (an inf or a nan makes the sum inf or nan), which spares a pass over the vocabulary at every step of a trace."""
    if x.device.type == "cpu" and bool(torch.isfinite(x.sum())):
        return torch.tensor(x.numel())
    return torch.isfinite(x).sum()


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
