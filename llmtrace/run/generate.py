"""The generation loop: prefill the prompts (in chunks when they are long), then decode one token at a time (s6-s12).

There is one loop, `_generate`, for B rows. `generate` (one prompt) and `generate_batch` (several, s3) check the
context window, each in its own way (one prompt is shortened to fit, a batch is refused), and call it. A single
prompt is a batch of one row without padding: no attention mask, the default positions, the decode step that
`--compile` compiles. Only a batch with pad slots (rows of different lengths, or a row that ended early) passes
each row's positions and the mask of its real slots to the model. Each step of the loop is two calls, as in
gpt-fast's `prefill` / `decode_one_token`: `forward_step` runs the model (s6-s9), whichever path the step takes
(prefill, padded decode, compiled or observed decode), and `next_tokens` turns the logits into each row's next
token (s10-s12).

The loop is the one place where a trace plugs in. It asks a `GenerationObserver` once which passes and layers it
observes, opens that scope (`Transformer.hooked`) around those passes, and calls it at fixed moments (start, around
each forward pass, each token, end) with everything it reports: the token, the sampler's ledger, the KV cache's
facts, timings. With `observer=None` nothing is recorded and nothing is computed for a trace. The loop owns the KV
cache and passes it to every forward pass.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, Union

import torch

from llmtrace.checkpoint.placement import available_memory
from llmtrace.model.compiled import CompiledDecode, decode_step
from llmtrace.model.packed import PackedProducts, matrix_bytes, packed_products
from llmtrace.errors import BadValue, FieldError, LlmtraceError
from llmtrace.fsutil import sigint_deferred
from llmtrace.checkpoint.loaded import LoadedModel
from llmtrace.model.transformer import KVCache, Transformer
from llmtrace.run.interventions import prepare
from llmtrace.run.sampler import Ledger, Sampler
from llmtrace.units import plural


PREFILL_CHUNK = 256  # prompt tokens per prefill pass: bounds the (H, T, S) attention scores a long prompt makes


@dataclass
class KVFacts:
    """The KV cache as one step left it, handed to the observer (which never reads the model)."""

    seq_len: int  # filled slots
    capacity: int  # slots allocated
    bytes_per_token: int  # one slot of one row, all layers, K and V
    bytes_allocated: int
    element_size: int  # bytes per cached number
    mha_bytes_per_token: int  # bytes_per_token without GQA (one K and V per query head)
    state_layers: tuple = ()  # the layers that keep a memory of fixed size (a recurrent state, a convolution window)
    state_bytes_per_layer: int = 0  # the largest such layer's, every row: the same at every step
    state_bytes: int = 0  # all of them together


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
    stop_reason: str = "max_tokens"  # "eos", "stop_text", "max_tokens" (also prefill-only), "context" or "interrupted"
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
    """What the loop tells an observer, and the one thing it asks: which layers of which passes to observe.

    A batch (generate_batch) is told of its rows: on_start(..., batch=every row's prompt ids, samplers=every row's
    sampler), on_batch(BatchLayout) once before the first pass, on_step / on_prediction with row=r, and
    on_end(BatchResult). A one-prompt run (generate) gets batch=None, no on_batch, row=None, a GenerationResult."""

    def wants_ledger(self) -> bool: ...
    def observation(self, phase: str) -> Optional[dict]:
        """None: passes of this phase ("prefill", "decode") are not observed; else the keyword arguments of
        `Transformer.hooked` (layers, attention) for each of them. Asked once per phase, at the start."""
    def __call__(self, layer: Optional[int], name: str, x: torch.Tensor) -> None: ...  # the model's observer
    def on_start(self, lm: LoadedModel, prompt_ids: list[int], sampler: Sampler,
                 batch: Optional[list[list[int]]] = None, samplers: Optional[list[Sampler]] = None) -> None: ...
    def on_batch(self, layout: BatchLayout) -> None: ...
    def before_forward(self, step: int, phase: str, start: int, n_tokens: int) -> None: ...
    def after_forward(self, step: int) -> None: ...
    def on_step(self, record: StepRecord, row: Optional[int] = None) -> None: ...
    def on_prediction(self, ledger: Ledger, position: int, kv: KVFacts, row: Optional[int] = None) -> None:
        """A prefill-only run (max_new_tokens 0): what the model would predict next, no token taken."""
    def on_end(self, result: Union[GenerationResult, BatchResult]) -> None: ...


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
    """Refuse prompts that do not fit; return the tokens the context window leaves room for, at most max_new_tokens
    (fewer: the run stops with stop reason "context"). A prompt of the whole window can be prefilled (-n 0, explain,
    lens: max_new_tokens 0) but leaves no room to generate."""
    ctx = lm.config.max_seq_len
    if n_prompt == 0:
        raise LlmtraceError("the prompt is empty (it encodes to zero tokens); give some text")
    if n_prompt > ctx or (n_prompt == ctx and max_new_tokens > 0):
        raise LlmtraceError(f"the prompt has {plural(n_prompt, 'token')} but the context window of {lm.name} is "
                            f"{plural(ctx, 'token')}; shorten the prompt")
    return min(max_new_tokens, ctx - n_prompt)


def check_batch_context(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """check_context for each row of a batch (the message names the row); returns each row's room, as check_context.
    A row's positions count its own tokens only (its pad slots are not positions), so each row stops at the context
    window on its own, as it would alone."""
    limits = []
    for r, p in enumerate(prompts):
        try:
            limits.append(check_context(lm, len(p), max_new_tokens))
        except LlmtraceError as e:
            if len(prompts) == 1:
                raise
            raise LlmtraceError(f"prompt {r + 1} of the batch: {e}") from None
    return limits


def context_note(lm: LoadedModel, prompt_lengths: list[int], max_new_tokens: int) -> Optional[str]:
    """One line saying which runs the context window cuts short of max_new_tokens (None when none is): a prompt of
    8,189 tokens in a window of 8,192 gets 3 tokens, not -n 8."""
    ctx = lm.config.max_seq_len
    cut = [(r, ctx - n) for r, n in enumerate(prompt_lengths) if 0 <= ctx - n < max_new_tokens]
    if not cut:
        return None
    if len(prompt_lengths) == 1:
        fit = cut[0][1]
        return (f"the prompt has {plural(prompt_lengths[0], 'token')} and the context window of {lm.name} is {ctx:,}: "
                f"{plural(fit, 'token')} {'fits' if fit == 1 else 'fit'}, not {max_new_tokens:,} "
                f"(stop reason: context)")
    rows = ", ".join(f"row {r}: {room:,}" for r, room in cut)
    return (f"the context window of {lm.name} ({plural(ctx, 'token')}) leaves fewer than "
            f"{plural(max_new_tokens, 'token')} to "
            f"{len(cut)} of {len(prompt_lengths)} rows ({rows}); "
            f"{'it stops' if len(cut) == 1 else 'they stop'} there (stop reason: context)")


def compile_decode(lm: LoadedModel, n_prompt: int, max_new_tokens: int, freeze: bool = False) -> CompiledDecode:
    """Compile the model's decode step (llmtrace.compiled) and run it once, so that a generation of `max_new_tokens`
    after `n_prompt` tokens starts with it ready; pass it to `generate(compiled=...)`. Its `compile_s` is the seconds
    this took: minutes on a small CPU the first time, seconds once Inductor's cache ($TORCHINDUCTOR_CACHE_DIR) holds
    the compiled code.

    The trial step runs on a scratch KV cache at the slot the first real decode step will have (dynamic shapes are
    marked there, and a first call at slot 0 or 1 would specialise on it). `freeze` (the fast path on the CPU only):
    the weights are compiled in as constants (CompiledDecode): each step 8-23% faster, the compile 11-14 s longer.

    Not the default: the longer compile pays back only after ~5,000-17,000 tokens (benchmarks/RESULTS.md)."""
    max_new_tokens = check_context(lm, n_prompt, max_new_tokens)
    check_compilable(lm, freeze)
    compiled = CompiledDecode(lm.model, freeze=freeze)
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
        raise FieldError("compile", f" failed: torch.compile could not build the decode step ({reason}); leave it out") from None
    compiled.compile_s = time.perf_counter() - t
    return compiled


def check_compilable(lm: LoadedModel, freeze: bool) -> None:
    """What compile_decode cannot do, said before it starts (minutes of compiling would end in an error): `freeze`
    off the fast path, and a mixture of experts, whose routing decides from the data which experts run."""
    check_freeze(lm, freeze)
    if lm.config.n_experts:
        raise BadValue("compile", " captures the decode step as one graph, and a mixture of experts chooses from the "
                       "data which experts run (a graph of its own for each choice); leave it out")


def check_freeze(lm: LoadedModel, freeze: bool) -> None:
    """`freeze` (compile_decode) is for the fast path on the CPU, where it was measured: elsewhere, one clear error."""
    if freeze and not (lm.config.extra.get("fast") and lm.device.type == "cpu"):
        raise BadValue("freeze", " needs fast (the int4 path) on the CPU, where it was measured; leave it out here",
                       also=("fast",))


def kv_facts(cache: KVCache) -> KVFacts:
    return KVFacts(seq_len=cache.seq_len, capacity=cache.max_len, bytes_per_token=cache.bytes_per_token,
                   bytes_allocated=cache.bytes_allocated, element_size=cache.element_size,
                   mha_bytes_per_token=cache.mha_bytes_per_token, state_layers=tuple(cache.state_layers),
                   state_bytes_per_layer=cache.state_bytes_per_layer, state_bytes=cache.state_bytes)


def prefill_split(n_prompt: int, chunk: int = PREFILL_CHUNK) -> int:
    """The first slot of a prefill's last pass (0 when the prompt fits in one)."""
    return (n_prompt - 1) // chunk * chunk


# ----------------------------------------------------------------------------------------------------------------
# s3: several prompts as one batch (one prompt is a batch of one row)


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
    if tokenizer.pad_id is not None:
        pad_id, source = tokenizer.pad_id, "pad"
    else:  # a tokenizer without EOS either (one prompt, never padded): any id does, no query attends a pad slot
        pad_id, source = (tokenizer.eos_ids or [0])[0], "eos"
    T = max(len(p) for p in prompts)
    ids, mask, pos = [], [], []
    for p in prompts:
        n_pad = T - len(p)
        ids.append([pad_id] * n_pad + list(p))
        mask.append([0] * n_pad + [1] * len(p))
        pos.append([0] * n_pad + list(range(len(p))))
    return BatchLayout(ids=ids, attention_mask=mask, position_ids=pos, pad_id=pad_id, pad_source=source)


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


# ----------------------------------------------------------------------------------------------------------------
# the generation loop: s6-s9 (prefill, decode), s10-s12 (sample), for every row at once


def prefill(model: Transformer, idx: torch.Tensor, cache: KVCache, observed=contextlib.nullcontext,
            on_progress: Optional[Callable[[int, int], None]] = None, chunk: int = PREFILL_CHUNK, *,
            input_pos: Optional[torch.Tensor] = None, padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run the prompts idx (B, T) into the empty cache; the logits (B, V) of their last slot.

    A prompt longer than `chunk` tokens goes through in passes of `chunk` (each attends to the slots cached before
    it), so memory stays bounded however long the prompt. Only the last pass is observed (`observed()`: the scope
    the observer asked for): it is the one whose logits the first token comes from. `on_progress(done, total)` is
    called after each pass of a chunked prefill. A left-padded batch gives its rows' positions `input_pos` (B, T)
    and `padding` (B, T), False at pad slots; None (the default) for rows without padding."""
    T = idx.size(1)
    last = prefill_split(T, chunk)  # the last pass covers [last, T)
    for s in range(0, last, chunk):
        model(idx[:, s : s + chunk], cache, s, input_pos=_cols(input_pos, s, s + chunk),
              attention_mask=_cols(padding, 0, s + chunk))
        if on_progress is not None:
            on_progress(s + chunk, T)
    with observed():
        logits = model(idx[:, last:], cache, last, input_pos=_cols(input_pos, last, T), attention_mask=padding,
                       last_only=True)
    if on_progress is not None and last > 0:
        on_progress(T, T)
    return logits


def forward_step(model: Transformer, idx: torch.Tensor, cache: KVCache, start: int, *, is_prefill: bool,
                 padding: Optional[dict] = None, observed=contextlib.nullcontext,
                 on_prefill_progress: Optional[Callable[[int, int], None]] = None,
                 compiled: Optional[CompiledDecode] = None, next_of_same_run: bool = False,
                 chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """s6-s9 for one step of the loop, whichever path it takes: the (B, V) float32 logits of each row's last slot.

    The prefill runs the prompts (chunked; `observed` is the scope of its last pass). A decode step feeds one token a
    row: with `padding` (pad slots to hide) the model masks them; with nothing observing it (`observed` is the null
    scope) it is the compiled or plain decode step; else the eager pass, inside the observer's decode scope, which
    the caller holds open for every decode pass."""
    if is_prefill:
        logits = prefill(model, idx, cache, observed, on_prefill_progress, chunk, **(padding or {}))
    elif padding is not None:
        logits = model(idx, cache, start, last_only=True, **padding)
    elif observed is contextlib.nullcontext:
        logits = decode_step(model, compiled, idx, cache, start, next_of_same_run=next_of_same_run)
    else:
        logits = model(idx, cache, start, last_only=True)
    return logits.float()  # the sampler works in float32


def next_tokens(logits: torch.Tensor, samplers: list[Sampler], histories: list[list[int]], rows, *,
                ledger: bool) -> list[tuple[int, int, Optional[Ledger]]]:
    """s10-s12 for each of `rows`: (row, its next token, the sampler's ledger when `ledger`)."""
    return [(r, *samplers[r].sample(logits[r], histories[r], ledger=ledger)) for r in rows]


def _cols(x: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    return None if x is None else x[:, a:b]


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
    interventions: Sequence = (),
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`. `on_text(str)` receives the text as it streams.
    `interventions`: a list of llmtrace.run.interventions objects (Ablate, Scale, Patch, Steer, ControlVector) applied to
    every pass of the run.

    `compiled` (compile_decode): runs the one-token decode passes that nothing observes. max_new_tokens 0 is a
    prefill-only run: the observer gets `on_prediction` (what the model would predict next) and no token is taken.
    A prompt that leaves less room in the context window than max_new_tokens gets what is left, and stops with
    stop reason "context"."""
    return _generate(lm, [list(prompt_ids)], [sampler], max_new_tokens, stop_texts, ignore_eos, observer,
                     on_prefill_progress, batched=False, on_text=on_text, compiled=compiled,
                     interventions=interventions).rows[0]


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
    interventions: Sequence = (),
) -> BatchResult:
    """Generate after each of B prompts at once: one forward pass per step for the whole batch.

    The prompts are left-padded (pad_batch); the attention mask hides pad slots from every query and each row's
    RoPE positions start at 0 at its first real token, so each row computes what it would alone. Row r samples with
    samplers[r] (its own seed and history). A row stops at its own EOS, stop text or limit; after that it is fed
    the pad id at slots its mask hides, and it reports nothing more. The observer (a GenerationObserver with
    `on_batch`) gets `on_start` with row 0's prompt and all rows, `on_batch(layout)`, then each row's StepRecord
    with `row` set. Each row stops at the context window as it would alone (stop reason "context")."""
    return _generate(lm, prompts, samplers, max_new_tokens, stop_texts, ignore_eos, observer, on_prefill_progress,
                     batched=True, interventions=interventions)


def _generate(lm: LoadedModel, prompts: list[list[int]], samplers: list[Sampler], max_new_tokens: int,
              stop_texts: tuple[str, ...], ignore_eos: bool, observer, on_prefill_progress, *, batched: bool,
              on_text=None, compiled: Optional[CompiledDecode] = None, interventions: Sequence = ()) -> BatchResult:
    """The one generation loop, for B rows (B = 1: one prompt). `batched`: the observer hears of rows (on_batch,
    "row" on every record, a BatchResult at the end); a one-prompt run (generate) reports as it always has.
    With interventions the prompt is prefilled in one pass and the compiled step is not used (llmtrace.run.interventions)."""
    loop = _Loop(lm, prompts, samplers, max_new_tokens, stop_texts, ignore_eos, observer, on_prefill_progress,
                 batched=batched, on_text=on_text, compiled=compiled, interventions=interventions)
    # Ctrl-C anywhere from here on ends the run as "interrupted", and the observer still gets its on_end. The start
    # and the end are held whole (a Ctrl-C during them is taken once they are done), so their events are never cut.
    try:
        loop.tell_start()
        loop.run()
    except KeyboardInterrupt:
        loop.interrupted()
    return loop.finish()


@dataclass
class _Row:
    """One row of the loop as it runs: its result so far, its sampler and history, its text, where it stands."""

    result: GenerationResult
    sampler: Sampler
    history: list[int]  # the row's ids so far, prompt included (what the sampler's penalties see)
    stream: TextStream  # its text, complete characters only
    pad: int  # pad slots in front of it (its position is its slot less these)
    limit: int  # tokens it may generate: -n, or fewer near the context window
    live: bool = True  # still generating (a finished row is fed the pad id at slots its mask hides)


class _Loop:
    """The state of one run of the generation loop (`_generate`): the batch's layout, cache and mask, each row's
    state (`_Row`), the observer and the hooks; `run` is the loop, one forward pass and one token a row per step."""

    def __init__(self, lm: LoadedModel, prompts: list[list[int]], samplers: list[Sampler], max_new_tokens: int,
                 stop_texts: tuple[str, ...], ignore_eos: bool, observer, on_prefill_progress, *, batched: bool,
                 on_text=None, compiled: Optional[CompiledDecode] = None, interventions: Sequence = ()):
        self.lm, self.model, self.device = lm, lm.model, lm.device
        self.prompts, self.samplers, self.observer, self.batched = prompts, samplers, observer, batched
        self.stop_texts, self.on_text, self.on_prefill_progress = stop_texts, on_text, on_prefill_progress
        self.B = B = len(prompts)
        self.layout = pad_batch(prompts, lm.tokenizer)  # s3; one prompt is a row without padding
        self.T = T = len(self.layout.ids[0])
        self.edits = prepare(lm, interventions, [len(p) for p in prompts])  # None without interventions
        self.chunk = PREFILL_CHUNK if self.edits is None else T
        self.compiled = compiled if self.edits is None else None
        self.padded = any(T - len(p) for p in prompts)
        self.requested = max_new_tokens
        limits = check_batch_context(lm, prompts, max_new_tokens)  # each row's room: -n, or less near the window
        self.max_new_tokens = max(limits)
        self.rows = [_Row(GenerationResult(prompt_ids=list(p)), samplers[r], list(p), TextStream(lm.tokenizer),
                          pad=T - len(p), limit=limits[r]) for r, p in enumerate(prompts)]
        self.result = BatchResult(layout=self.layout, rows=[row.result for row in self.rows])
        self.eos = set() if ignore_eos else set(lm.tokenizer.eos_ids)
        self.want_ledger = observer is not None and observer.wants_ledger()
        S = T + max(self.max_new_tokens, 1)
        self.cache = self.model.new_cache(S, batch=B)
        self.mask = None  # (B, S): True at the slots a row really fills; a row that ends early makes pad slots
        if B > 1:
            self.mask = torch.zeros((B, S), dtype=torch.bool, device=self.device)
            self.mask[:, :T] = torch.tensor(self.layout.attention_mask, dtype=torch.bool, device=self.device)
        self.emitted = 0  # characters of text already passed to on_text (a one-prompt run's)

    def tag(self, r: int) -> dict:
        """What the observer's records say of the row."""
        return {"row": r} if self.batched else {}

    @property
    def live(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row.live]

    def tell_start(self) -> None:
        if self.observer is None:
            return
        with sigint_deferred():
            if self.batched:
                self.observer.on_start(self.lm, list(self.prompts[0]), self.samplers[0],
                                       batch=[list(p) for p in self.prompts], samplers=self.samplers)
                self.observer.on_batch(self.layout)
            else:
                self.observer.on_start(self.lm, list(self.prompts[0]), self.samplers[0])

    def run(self) -> None:
        """Prefill, then decode a token a row per step until every row has stopped."""
        scopes = {phase: _scope(self.model, self.observer, phase) for phase in ("prefill", "decode")}
        self.t_start = time.perf_counter()
        idx = torch.tensor(self.layout.ids, dtype=torch.long, device=self.device)  # (B, T)
        start, step = 0, 0
        with contextlib.ExitStack() as held:
            products = batch_products(self.lm) if self.B > 1 else None
            if products is not None:  # a batch's products by oneDNN on packed weights (model.packed)
                held.enter_context(products.active())
            if self.edits is not None:
                held.enter_context(self.model.hooked(self.edits, self.edits.layers, spell_out=self.edits.spell_out))
            while True:
                phase = "prefill" if step == 0 else "decode"
                t0 = time.perf_counter()
                logits = self.forward(idx, start, step, scopes[phase])  # (B, V) float32
                if step == 0 and scopes["decode"] is not contextlib.nullcontext:
                    held.enter_context(scopes["decode"]())  # one scope for every decode pass
                if self.observer is not None:
                    self.observer.after_forward(step)
                if self.max_new_tokens == 0:
                    self.predict(logits)
                    return
                picked = next_tokens(logits, self.samplers, [row.history for row in self.rows], self.live,
                                     ledger=self.want_ledger)
                t1 = time.perf_counter()  # s10-s12 done
                if step == 0:
                    self.result.prefill_s = t1 - self.t_start
                else:
                    self.result.decode_s += t1 - t0
                start += idx.size(1)
                self.take(picked, step, phase, start, (t1 - t0) * 1e3)
                if not self.live:
                    return
                idx = self.next_input(start)  # (B, 1)
                step += 1

    def forward(self, idx: torch.Tensor, start: int, step: int, observed) -> torch.Tensor:
        """s6-s9 for step `step`, told to the observer first: the (B, V) logits of each row's last slot."""
        phase = "prefill" if step == 0 else "decode"
        if self.observer is not None:  # the pass it may observe: the prefill's last chunk, or the decode pass
            first = prefill_split(self.T, self.chunk) if step == 0 else start
            self.observer.before_forward(step, phase, first, start + idx.size(1) - first)
        if self.edits is not None:
            self.edits.begin_pass(prompt=step == 0, pads=[row.pad for row in self.rows])
        return forward_step(self.model, idx, self.cache, start, is_prefill=step == 0, padding=self.padding(start, step),
                            observed=observed, on_prefill_progress=self.on_prefill_progress,
                            compiled=self.compiled, next_of_same_run=step > 1, chunk=self.chunk)

    def padding(self, start: int, step: int) -> Optional[dict]:
        """The pad slots to hide from this step's pass: a left-padded batch, or rows that have ended (None: none)."""
        if step == 0:
            return _padding(self.layout, self.mask, self.T, self.device) if self.padded else None
        if self.padded or len(self.live) < self.B:
            return {"input_pos": torch.tensor([start - row.pad for row in self.rows], dtype=torch.long,
                                              device=self.device)[:, None],
                    "attention_mask": self.mask[:, : start + 1]}
        return None

    def predict(self, logits: torch.Tensor) -> None:
        """A prefill-only run (max_new_tokens 0): what the model would predict next (s10-s12), no token taken."""
        self.result.prefill_s = time.perf_counter() - self.t_start
        if self.observer is None:
            return
        histories = [row.history for row in self.rows]
        for r, _, ledger in next_tokens(logits, self.samplers, histories, range(self.B), ledger=True):
            self.observer.on_prediction(ledger, len(self.prompts[r]), kv_facts(self.cache), **self.tag(r))

    def take(self, picked, step: int, phase: str, start: int, ms: float) -> None:
        """Each row's token: its step event and the row's bookkeeping go together. A Ctrl-C here waits for them, so
        the summary never lists a token whose step was not reported."""
        with sigint_deferred():
            for r, token, ledger in picked:
                row = self.rows[r]
                row.history.append(token)
                row.result.tokens.append(token)
                piece = "" if token in self.eos else row.stream.push(token)  # the EOS marker is not output text
                if self.observer is not None:
                    self.observer.on_step(StepRecord(step=step, phase=phase, position=start - row.pad, token=token,
                                                     text=piece, ledger=ledger, kv=kv_facts(self.cache), ms=ms),
                                          **self.tag(r))
                row.live = not self.stopped(row, token, piece)

    def stopped(self, row: _Row, token: int, piece: str) -> bool:
        """Whether `token` ends the row (its EOS, a stop text, its limit), the stop reason set; else its text is
        streamed."""
        hit = _find_stop(row.stream.text, self.stop_texts)
        if token in self.eos:
            row.result.stop_reason = "eos"
        elif hit is not None:
            row.result.stop_reason = "stop_text"
            row.stream.text = row.stream.text[:hit]
        else:
            if self.on_text is not None and piece:
                self.emitted = _stream(self.on_text, row.stream.text, self.emitted, self.stop_texts)
            if len(row.result.tokens) < row.limit:
                return False
            if row.limit < self.requested:
                row.result.stop_reason = "context"
        return True  # finished: from now on fed the pad id at slots its mask hides

    def next_input(self, start: int) -> torch.Tensor:
        """The next pass's (B, 1) input: each live row's last token; the pad id for rows that have ended."""
        live = self.live
        if self.mask is not None:
            self.mask[live, start] = True
        fed = [[row.result.tokens[-1]] if row.live else [self.layout.pad_id] for row in self.rows]
        return torch.tensor(fed, dtype=torch.long, device=self.device)

    def interrupted(self) -> None:
        self.result.interrupted = True
        for row in self.rows:
            if row.live:
                row.result.interrupted = True
                row.result.stop_reason = "interrupted"

    def finish(self) -> BatchResult:
        """Each row's text and timings, the rest of the streamed text, and the observer's on_end."""
        for row in self.rows:
            row.result.text = row.stream.text
            row.result.prefill_s = row.result.ttft_s = self.result.prefill_s
            row.result.decode_s = self.result.decode_s
        first = self.rows[0].result
        if self.on_text is not None and len(first.text) > self.emitted:
            self.on_text(first.text[self.emitted:])
        if self.observer is not None:
            with sigint_deferred():
                self.observer.on_end(self.result if self.batched else first)
        return self.result


def batch_products(lm: LoadedModel) -> Optional[PackedProducts]:
    """The products a batch of several rows runs on: the model's float32 matrices packed for oneDNN (model.packed),
    made on the first batch and kept with the loaded model; None (torch's own products) where packing does not apply
    or its copy of the matrices would take more than half the memory left."""
    if lm.packed is None and matrix_bytes(lm.model) * 2 <= available_memory():
        lm.packed = packed_products(lm.model)
    return lm.packed


def _padding(layout: BatchLayout, mask: torch.Tensor, T: int, device) -> dict:
    """prefill's arguments for a left-padded batch: each row's positions and its pad slots, (B, T) each."""
    return {"input_pos": torch.tensor(layout.position_ids, dtype=torch.long, device=device), "padding": mask[:, :T]}


def _stream(on_text, text: str, emitted: int, stop_texts: tuple[str, ...]) -> int:
    """Pass on_text the text after `emitted`, holding back a tail that could still grow into a stop text; the
    characters passed on so far."""
    safe = len(text) - _partial_stop(text, stop_texts)
    if safe > emitted:
        on_text(text[emitted:safe])
        return safe
    return emitted


def _scope(model: Transformer, observer: Optional[GenerationObserver], phase: str):
    """A factory of the observation scope for the passes of `phase`: what the observer asked for, or nothing."""
    wanted = observer.observation(phase) if observer is not None else None
    if wanted is None:
        return contextlib.nullcontext
    return functools.partial(model.hooked, observer, **wanted)


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
