"""The generation loop: prefill the prompt in one pass, then decode one token at a time (s6-s12, repeated).

The loop is the one place where a trace plugs in. It calls a `GenerationObserver` at fixed moments (start, around
each forward pass, each token, end); the observer decides what to record. With `observer=None` nothing is recorded
and nothing is computed for a trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from llmtrace.errors import LlmtraceError
from llmtrace.fsutil import sigint_deferred
from llmtrace.loader import LoadedModel
from llmtrace.sampler import Ledger, Sampler


@dataclass
class StepRecord:
    """What one generation step produced: the forward pass that ended at `position - 1` and the token it chose."""

    step: int  # 0 is the prefill step; 1.. are decode steps
    phase: str  # "prefill" or "decode"
    position: int  # position of the new token in the sequence
    token: int
    text: str  # the token's text as it joins the output (may be "" while a multi-byte character is incomplete)
    ledger: Optional[Ledger]  # the sampler's record, when the observer asked for one
    kv_seq_len: int  # cached positions after this step's forward pass
    ms: float  # forward pass + sampling, milliseconds


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "max_tokens"  # "eos", "stop_text", "max_tokens" or "interrupted"
    interrupted: bool = False
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.tokens) - 1  # the first token comes out of the prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class GenerationObserver(Protocol):
    def wants_ledger(self) -> bool: ...
    def on_start(self, lm: LoadedModel, prompt_ids: list[int], sampler: Sampler) -> None: ...
    def before_forward(self, step: int, phase: str, start: int, n_tokens: int) -> None: ...
    def after_forward(self, step: int) -> None: ...
    def on_step(self, record: StepRecord) -> None: ...
    def on_end(self, result: GenerationResult) -> None: ...


class TextStream:
    """Turns token ids into text increments, holding back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.text = full[len(self.text):], full
        return new


def check_context(lm: LoadedModel, n_prompt: int, max_new_tokens: int) -> int:
    """Refuse prompts that do not fit; shorten max_new_tokens to what the context window leaves."""
    ctx = lm.config.max_seq_len
    if n_prompt == 0:
        raise LlmtraceError("the prompt is empty (it encodes to zero tokens); give some text")
    if n_prompt >= ctx:
        raise LlmtraceError(f"the prompt has {n_prompt} tokens but the context window of {lm.name} is {ctx} tokens; "
                            f"shorten the prompt")
    return min(max_new_tokens, ctx - n_prompt)


def compile_decode(lm: LoadedModel, n_prompt: int, max_new_tokens: int) -> float:
    """Compile the model's decode step (`Transformer.compile_decode`) and run it once, so that a generation of
    `max_new_tokens` after `n_prompt` tokens starts with it ready. Returns the seconds this took: minutes on a small
    CPU the first time, seconds once Inductor's cache ($TORCHINDUCTOR_CACHE_DIR) holds the compiled code.

    The trial step runs on a scratch KV cache at the position the first real decode step will have (dynamic shapes
    are marked there, and a first call at position 0 or 1 would specialise on it)."""
    model = lm.model
    max_new_tokens = check_context(lm, n_prompt, max_new_tokens)
    model.compile_decode()
    if max_new_tokens < 2:
        return 0.0  # no decode step will run
    t = time.perf_counter()
    saved = model.cache
    try:
        with torch.inference_mode():
            model.setup_cache(n_prompt + max_new_tokens)
            model.step(torch.zeros((1, 1), dtype=torch.long, device=lm.device), max(n_prompt, 2))
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
    except KeyboardInterrupt:
        model.uncompile()
        raise
    except Exception as e:
        model.uncompile()
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise LlmtraceError(f"torch.compile could not compile the decode step ({reason}); run without --compile") from None
    finally:
        model.cache = saved
    return time.perf_counter() - t


@torch.inference_mode()
def generate(
    lm: LoadedModel,
    prompt_ids: list[int],
    sampler: Sampler,
    max_new_tokens: int,
    stop_texts: tuple[str, ...] = (),
    ignore_eos: bool = False,
    observer: Optional[GenerationObserver] = None,
    on_text=None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`. `on_text(str)` receives the text as it streams."""
    model, tok = lm.model, lm.tokenizer
    max_new_tokens = check_context(lm, len(prompt_ids), max_new_tokens)
    result = GenerationResult(prompt_ids=list(prompt_ids))
    if max_new_tokens <= 0:
        return result
    eos = set() if ignore_eos else set(tok.eos_ids)
    want_ledger = observer is not None and observer.wants_ledger()
    model.setup_cache(len(prompt_ids) + max_new_tokens)
    stream = TextStream(tok)
    history = list(prompt_ids)
    emitted = 0  # characters of text already passed to on_text
    # Ctrl-C anywhere from here on ends the run as "interrupted", and the observer still gets its on_end. The start
    # and the end are held whole (a Ctrl-C during them is taken once they are done), so their events are never cut.
    try:
        if observer is not None:
            with sigint_deferred():
                observer.on_start(lm, list(prompt_ids), sampler)
        t_start = time.perf_counter()
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=lm.device)  # (1, T)
        start, step = 0, 0
        while True:
            phase = "prefill" if step == 0 else "decode"
            t0 = time.perf_counter()
            if observer is not None:
                observer.before_forward(step, phase, start, idx.size(1))
            logits = model.step(idx, start, next_of_same_run=step > 0)[0].float()  # (V,) s7-s9; sampler in fp32
            if observer is not None:
                observer.after_forward(step)
            token, ledger = sampler.sample(logits, history, ledger=want_ledger)  # s10-s12
            t1 = time.perf_counter()
            if step == 0:
                result.prefill_s = result.ttft_s = t1 - t_start
            else:
                result.decode_s += t1 - t0
            start += idx.size(1)
            history.append(token)
            result.tokens.append(token)
            piece = "" if token in eos else stream.push(token)  # the end-of-sequence marker is not output text
            if observer is not None:
                observer.on_step(StepRecord(step=step, phase=phase, position=start, token=token, text=piece,
                                            ledger=ledger, kv_seq_len=start, ms=(t1 - t0) * 1e3))
            if token in eos:
                result.stop_reason = "eos"
                break
            hit = _find_stop(stream.text, stop_texts)
            if hit is not None:
                result.stop_reason = "stop_text"
                stream.text = stream.text[:hit]
                break
            if on_text is not None and piece:
                # hold back a tail that could still grow into a stop text
                safe = len(stream.text) - _partial_stop(stream.text, stop_texts)
                if safe > emitted:
                    on_text(stream.text[emitted:safe])
                    emitted = safe
            if len(result.tokens) >= max_new_tokens:
                break
            idx = torch.tensor([[token]], dtype=torch.long, device=lm.device)  # (1, 1)
            step += 1
    except KeyboardInterrupt:
        result.interrupted = True
        result.stop_reason = "interrupted"
    result.text = stream.text
    if on_text is not None and len(result.text) > emitted:
        on_text(result.text[emitted:])
    if observer is not None:
        with sigint_deferred():
            observer.on_end(result)
    return result


def _find_stop(text: str, stops: tuple[str, ...]) -> Optional[int]:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the beginning of some stop text."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
