"""The generation loop: prefill the prompt (in chunks when it is long), then decode one token at a time (s6-s12).

The loop is the one place where a trace plugs in. It asks a `GenerationObserver` once which passes and layers it
observes, opens that scope (`Transformer.observed`) around those passes, and calls it at fixed moments (start, around
each forward pass, each token, end) with everything it reports: the token, the sampler's ledger, the KV cache's
facts, timings. With `observer=None` nothing is recorded and nothing is computed for a trace. The loop owns the KV
cache and passes it to every forward pass.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from llmtrace.compiled import CompiledDecode, decode_step
from llmtrace.errors import LlmtraceError
from llmtrace.fsutil import sigint_deferred
from llmtrace.loaded import LoadedModel
from llmtrace.model import KVCache, Transformer
from llmtrace.sampler import Ledger, Sampler


PREFILL_CHUNK = 256  # prompt tokens per prefill pass: bounds the (H, T, S) attention scores a long prompt makes


@dataclass
class KVFacts:
    """The KV cache as one step left it, handed to the observer (which never reads the model)."""

    seq_len: int  # filled slots
    capacity: int  # slots allocated
    bytes_per_token: int  # one slot of one row, all layers, K and V
    bytes_allocated: int
    element_size: int  # bytes per cached number


@dataclass
class StepRecord:
    """What one generation step produced: the forward pass that ended at `position - 1` and the token it chose."""

    step: int  # 0 is the prefill step; 1.. are decode steps
    phase: str  # "prefill" or "decode"
    position: int  # position of the new token in the sequence
    token: int
    text: str  # the token's text as it joins the output (may be "" while a multi-byte character is incomplete)
    ledger: Optional[Ledger]  # the sampler's record, when the observer asked for one
    kv: KVFacts  # the cache after this step's forward pass
    ms: float  # forward pass + sampling, milliseconds


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "max_tokens"  # "eos", "stop_text", "max_tokens" (also for a prefill-only run) or "interrupted"
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
    """What the loop tells an observer, and the one thing it asks: which layers of which passes to observe."""

    def wants_ledger(self) -> bool: ...
    def observation(self, phase: str) -> Optional[dict]:
        """None: passes of this phase ("prefill", "decode") are not observed; else the keyword arguments of
        `Transformer.observed` (layers, attention) for each of them. Asked once per phase, at the start."""
    def __call__(self, layer: Optional[int], name: str, x: torch.Tensor) -> None: ...  # the model's observer
    def on_start(self, lm: LoadedModel, prompt_ids: list[int], sampler: Sampler) -> None: ...
    def before_forward(self, step: int, phase: str, start: int, n_tokens: int) -> None: ...
    def after_forward(self, step: int) -> None: ...
    def on_step(self, record: StepRecord) -> None: ...
    def on_prediction(self, ledger: Ledger, position: int, kv: KVFacts) -> None:
        """A prefill-only run (max_new_tokens 0): what the model would predict next, no token taken."""
    def on_end(self, result: GenerationResult) -> None: ...
    # A batch (generate_batch) also calls on_start(..., batch=every row's prompt ids, samplers=every row's sampler),
    # on_batch(BatchLayout) once before the first pass, on_step / on_prediction with row=r, and on_end(BatchResult).


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
    """Refuse prompts that do not fit; shorten max_new_tokens to what the context window leaves. A prompt of the whole
    window can be prefilled (-n 0, explain, lens: max_new_tokens 0) but leaves no room to generate."""
    ctx = lm.config.max_seq_len
    if n_prompt == 0:
        raise LlmtraceError("the prompt is empty (it encodes to zero tokens); give some text")
    if n_prompt > ctx or (n_prompt == ctx and max_new_tokens > 0):
        raise LlmtraceError(f"the prompt has {n_prompt} tokens but the context window of {lm.name} is {ctx} tokens; "
                            f"shorten the prompt")
    return min(max_new_tokens, ctx - n_prompt)


def compile_decode(lm: LoadedModel, n_prompt: int, max_new_tokens: int) -> CompiledDecode:
    """Compile the model's decode step (llmtrace.compiled) and run it once, so that a generation of `max_new_tokens`
    after `n_prompt` tokens starts with it ready; pass it to `generate(compiled=...)`. Its `compile_s` is the seconds
    this took: minutes on a small CPU the first time, seconds once Inductor's cache ($TORCHINDUCTOR_CACHE_DIR) holds
    the compiled code.

    The trial step runs on a scratch KV cache at the slot the first real decode step will have (dynamic shapes are
    marked there, and a first call at slot 0 or 1 would specialise on it)."""
    max_new_tokens = check_context(lm, n_prompt, max_new_tokens)
    compiled = CompiledDecode(lm.model)
    if max_new_tokens < 2:
        return compiled  # no decode step will run
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            scratch = lm.model.new_cache(n_prompt + max_new_tokens)
            compiled(torch.zeros((1, 1), dtype=torch.long, device=lm.device), scratch, max(n_prompt, 2))
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
    except KeyboardInterrupt:
        raise
    except Exception as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise LlmtraceError(f"torch.compile could not compile the decode step ({reason}); run without --compile") from None
    compiled.compile_s = time.perf_counter() - t
    return compiled


def kv_facts(cache: KVCache) -> KVFacts:
    return KVFacts(seq_len=cache.seq_len, capacity=cache.max_len, bytes_per_token=cache.bytes_per_token,
                   bytes_allocated=cache.bytes_allocated, element_size=cache.element_size)


def prefill_split(n_prompt: int, chunk: int = PREFILL_CHUNK) -> int:
    """The first slot of a prefill's last pass (0 when the prompt fits in one)."""
    return (n_prompt - 1) // chunk * chunk


def prefill(model: Transformer, idx: torch.Tensor, cache: KVCache, observed=contextlib.nullcontext,
            on_progress: Optional[Callable[[int, int], None]] = None, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run the prompt idx (B, T) into the empty cache; the logits (B, V) of its last position.

    A prompt longer than `chunk` tokens goes through in passes of `chunk` (each attends to the slots cached before
    it), so memory stays bounded however long the prompt. Only the last pass is observed (`observed()`: the scope
    the observer asked for): it is the one whose logits the first token comes from. `on_progress(done, total)` is
    called after each pass of a chunked prefill."""
    T = idx.size(1)
    last = prefill_split(T, chunk)  # the last pass covers [last, T)
    for s in range(0, last, chunk):
        model(idx[:, s : s + chunk], cache, s)
        if on_progress is not None:
            on_progress(s + chunk, T)
    with observed():
        logits = model(idx[:, last:], cache, last, last_only=True)
    if on_progress is not None and last > 0:
        on_progress(T, T)
    return logits


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
    compiled: Optional[CompiledDecode] = None,
    on_prefill_progress: Optional[Callable[[int, int], None]] = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`. `on_text(str)` receives the text as it streams.

    `compiled` (compile_decode): runs the one-token decode passes that nothing observes. max_new_tokens 0 is a
    prefill-only run: the observer gets `on_prediction` (what the model would predict next) and no token is taken."""
    model, tok = lm.model, lm.tokenizer
    max_new_tokens = check_context(lm, len(prompt_ids), max_new_tokens)
    result = GenerationResult(prompt_ids=list(prompt_ids))
    eos = set() if ignore_eos else set(tok.eos_ids)
    want_ledger = observer is not None and observer.wants_ledger()
    cache = model.new_cache(len(prompt_ids) + max(max_new_tokens, 1))
    stream = TextStream(tok)
    history = list(prompt_ids)
    emitted = 0  # characters of text already passed to on_text
    # Ctrl-C anywhere from here on ends the run as "interrupted", and the observer still gets its on_end. The start
    # and the end are held whole (a Ctrl-C during them is taken once they are done), so their events are never cut.
    try:
        if observer is not None:
            with sigint_deferred():
                observer.on_start(lm, list(prompt_ids), sampler)
        scopes = {phase: _scope(model, observer, phase) for phase in ("prefill", "decode")}
        t_start = time.perf_counter()
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=lm.device)  # (1, T)
        start, step = 0, 0
        decode_scope = scopes["decode"]
        with contextlib.ExitStack() as held:
            while True:
                phase = "prefill" if step == 0 else "decode"
                t0 = time.perf_counter()
                if observer is not None:  # the pass it may observe: the prefill's last chunk, or the decode pass
                    first = prefill_split(idx.size(1)) if step == 0 else start
                    observer.before_forward(step, phase, first, start + idx.size(1) - first)
                if step == 0:  # s6-s9 over the prompt
                    logits = prefill(model, idx, cache, scopes["prefill"], on_prefill_progress)
                    if decode_scope is not contextlib.nullcontext:
                        held.enter_context(decode_scope())  # one scope for every decode pass
                elif decode_scope is contextlib.nullcontext:  # s6-s9 for one token; nothing observes it
                    logits = decode_step(model, compiled, idx, cache, start, next_of_same_run=step > 1)
                else:
                    logits = model(idx, cache, start, last_only=True)
                logits = logits[0].float()  # (V,): the sampler works in float32
                if observer is not None:
                    observer.after_forward(step)
                if max_new_tokens == 0:
                    result.prefill_s = result.ttft_s = time.perf_counter() - t_start
                    if observer is not None:
                        _, ledger = sampler.sample(logits, history, ledger=True)  # what it would take: s10-s12
                        observer.on_prediction(ledger, len(prompt_ids), kv_facts(cache))
                    break
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
                                                ledger=ledger, kv=kv_facts(cache), ms=(t1 - t0) * 1e3))
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


def _scope(model: Transformer, observer: Optional[GenerationObserver], phase: str):
    """A factory of the observation scope for the passes of `phase`: what the observer asked for, or nothing."""
    wanted = observer.observation(phase) if observer is not None else None
    if wanted is None:
        return contextlib.nullcontext
    return functools.partial(model.observed, observer, **wanted)


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


# ----------------------------------------------------------------------------------------------------------------
# s3: several prompts as one batch


MAX_BATCH = 64  # rows a run takes unless told otherwise (--max-batch)


def row_seed(seed: int, row: int) -> int:
    """The seed of batch row `row` when the run's seed is `seed`: seed + row (mod 2**64). Row 0 keeps the run's seed,
    so a batch's row r samples exactly what a run of that prompt alone with --seed seed+r samples."""
    return (seed + row) % 2**64


@dataclass
class BatchLayout:
    """s3: B prompts left-padded to one length T, as the first forward pass sees them."""

    ids: list[list[int]]  # (B, T) token ids, pad_id in front of the shorter rows
    attention_mask: list[list[int]]  # (B, T) 1 at real tokens, 0 at pad slots
    position_ids: list[list[int]]  # (B, T) each row's positions, 0 at its first real token (0 at pad slots too)
    pad_id: int
    pad_source: str  # "pad": the tokenizer's padding token; "eos": the checkpoint has none, so its end-of-sequence


def pad_batch(prompts: list[list[int]], tokenizer) -> BatchLayout:
    """Left-pad the prompts to the longest one, so that every row's last prompt token sits in the same slot and
    the first new token of every row is predicted by one pass. A pad slot is never attended (attention_mask 0)."""
    pad_id, source = (tokenizer.pad_id, "pad") if tokenizer.pad_id is not None else (tokenizer.eos_ids[0], "eos")
    T = max(len(p) for p in prompts)
    ids, mask, pos = [], [], []
    for p in prompts:
        n_pad = T - len(p)
        ids.append([pad_id] * n_pad + list(p))
        mask.append([0] * n_pad + [1] * len(p))
        pos.append([0] * n_pad + list(range(len(p))))
    return BatchLayout(ids=ids, attention_mask=mask, position_ids=pos, pad_id=pad_id, pad_source=source)


def check_batch_context(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Refuse a batch whose padded length plus max_new_tokens does not fit the context window (one line)."""
    ctx = lm.config.max_seq_len
    for r, p in enumerate(prompts):
        if not p:
            raise LlmtraceError(f"prompt {r + 1} of the batch is empty (it encodes to zero tokens); give some text")
    T = max(len(p) for p in prompts)
    if T + max_new_tokens > ctx:
        raise LlmtraceError(f"the batch is padded to {T} tokens and -n {max_new_tokens} asks for {T + max_new_tokens} "
                            f"slots, but the context window of {lm.name} is {ctx} tokens; shorten the longest prompt "
                            f"or lower -n")


@dataclass
class BatchResult:
    layout: BatchLayout
    rows: list[GenerationResult]  # one per row, its own tokens, text and stop reason
    interrupted: bool = False
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens of every row after the first, per second of decode: the batch's aggregate throughput."""
        n = sum(max(len(r.tokens) - 1, 0) for r in self.rows)
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@torch.inference_mode()
def generate_batch(
    lm: LoadedModel,
    prompts: list[list[int]],
    samplers: list[Sampler],
    max_new_tokens: int,
    stop_texts: tuple[str, ...] = (),
    ignore_eos: bool = False,
    observer=None,
    on_prefill_progress: Optional[Callable[[int, int], None]] = None,
) -> BatchResult:
    """Generate after each of B prompts at once: one forward pass per step for the whole batch.

    The prompts are left-padded (pad_batch); the attention mask hides pad slots from every query and each row's
    RoPE positions start at 0 at its first real token, so each row computes what it would alone. Row r samples with
    samplers[r] (its own seed and history). A row stops at its own EOS, stop text or limit; after that it is fed
    the pad id at slots its mask hides, and it reports nothing more. The observer (a GenerationObserver with
    `on_batch`) gets `on_start` with row 0's prompt and all rows, `on_batch(layout)`, then each row's StepRecord
    with `row` set."""
    model, tok, device = lm.model, lm.tokenizer, lm.device
    B = len(prompts)
    check_batch_context(lm, prompts, max_new_tokens)
    layout = pad_batch(prompts, tok)
    T = len(layout.ids[0])
    rows = [GenerationResult(prompt_ids=list(p)) for p in prompts]
    result = BatchResult(layout=layout, rows=rows)
    eos = set() if ignore_eos else set(tok.eos_ids)
    want_ledger = observer is not None and observer.wants_ledger()
    S = T + max(max_new_tokens, 1)
    cache = model.new_cache(S, batch=B)
    mask = torch.zeros((B, S), dtype=torch.bool, device=device)  # (B, S): True at the slots a row really fills
    mask[:, :T] = torch.tensor(layout.attention_mask, dtype=torch.bool, device=device)
    next_pos = [len(p) for p in prompts]  # each row's position of the token it takes next
    streams = [TextStream(tok) for _ in range(B)]
    histories = [list(p) for p in prompts]
    live = list(range(B))  # rows still generating
    masked = not all(all(m) for m in layout.attention_mask)  # some row is padded
    try:
        if observer is not None:
            with sigint_deferred():
                observer.on_start(lm, list(prompts[0]), samplers[0], batch=[list(p) for p in prompts],
                                  samplers=samplers)
                observer.on_batch(layout)
        scopes = {phase: _scope(model, observer, phase) for phase in ("prefill", "decode")}
        t_start = time.perf_counter()
        idx = torch.tensor(layout.ids, dtype=torch.long, device=device)  # (B, T)
        input_pos = torch.tensor(layout.position_ids, dtype=torch.long, device=device)  # (B, T)
        start, step = 0, 0
        with contextlib.ExitStack() as held:
            while True:
                phase = "prefill" if step == 0 else "decode"
                t0 = time.perf_counter()
                if observer is not None:
                    first = prefill_split(T) if step == 0 else start
                    observer.before_forward(step, phase, first, start + idx.size(1) - first)
                if step == 0:
                    logits = _prefill_rows(model, idx, input_pos, mask[:, :T], cache, scopes["prefill"],
                                           on_prefill_progress)
                    if scopes["decode"] is not contextlib.nullcontext:
                        held.enter_context(scopes["decode"]())
                else:  # no pad slot anywhere (rows of one length, none finished): no mask to apply
                    padded = masked or len(live) < B
                    logits = model(idx, cache, start, input_pos=input_pos,
                                   attention_mask=mask[:, : start + 1] if padded else None, last_only=True)
                logits = logits.float()  # (B, V)
                if observer is not None:
                    observer.after_forward(step)
                if max_new_tokens == 0:
                    result.prefill_s = time.perf_counter() - t_start
                    for r in range(B):
                        rows[r].prefill_s = rows[r].ttft_s = result.prefill_s
                    if observer is not None:
                        for r in range(B):
                            _, ledger = samplers[r].sample(logits[r], histories[r], ledger=True)
                            observer.on_prediction(ledger, len(prompts[r]), kv_facts(cache), row=r)
                    break
                picked = {r: samplers[r].sample(logits[r], histories[r], ledger=want_ledger) for r in live}
                t1 = time.perf_counter()
                if step == 0:
                    result.prefill_s = t1 - t_start
                    for r in range(B):
                        rows[r].prefill_s = rows[r].ttft_s = result.prefill_s
                else:
                    result.decode_s += t1 - t0
                start += idx.size(1)
                ms = (t1 - t0) * 1e3
                for r in list(live):
                    token, ledger = picked[r]
                    histories[r].append(token)
                    rows[r].tokens.append(token)
                    piece = "" if token in eos else streams[r].push(token)
                    if observer is not None:
                        observer.on_step(StepRecord(step=step, phase=phase, position=next_pos[r], token=token,
                                                    text=piece, ledger=ledger, kv=kv_facts(cache), ms=ms), row=r)
                    hit = _find_stop(streams[r].text, stop_texts)
                    if token in eos:
                        rows[r].stop_reason = "eos"
                    elif hit is not None:
                        rows[r].stop_reason = "stop_text"
                        streams[r].text = streams[r].text[:hit]
                    elif len(rows[r].tokens) < max_new_tokens:
                        continue
                    live.remove(r)  # finished: from now on fed the pad id at slots its mask hides
                if not live:
                    break
                step_ids = [layout.pad_id] * B
                for r in live:
                    step_ids[r] = rows[r].tokens[-1]
                    mask[r, start] = True
                idx = torch.tensor(step_ids, dtype=torch.long, device=device)[:, None]  # (B, 1)
                input_pos = torch.tensor(next_pos, dtype=torch.long, device=device)[:, None]  # (B, 1)
                next_pos = [n + 1 for n in next_pos]
                step += 1
    except KeyboardInterrupt:
        result.interrupted = True
        for r in live:
            rows[r].interrupted = True
            rows[r].stop_reason = "interrupted"
    for r in range(B):
        rows[r].text = streams[r].text
        rows[r].decode_s = result.decode_s
    if observer is not None:
        with sigint_deferred():
            observer.on_end(result)
    return result


def _prefill_rows(model: Transformer, idx: torch.Tensor, input_pos: torch.Tensor, padding: torch.Tensor,
                  cache: KVCache, observed, on_progress, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """`prefill` for a padded batch: idx, input_pos, padding (B, T). The logits (B, V) of the last slot."""
    T = idx.size(1)
    last = prefill_split(T, chunk)
    for s in range(0, last, chunk):
        model(idx[:, s : s + chunk], cache, s, input_pos=input_pos[:, s : s + chunk], attention_mask=padding[:, : s + chunk])
        if on_progress is not None:
            on_progress(s + chunk, T)
    with observed():
        logits = model(idx[:, last:], cache, last, input_pos=input_pos[:, last:], attention_mask=padding, last_only=True)
    if on_progress is not None and last > 0:
        on_progress(T, T)
    return logits
