"""The Python API, the one the CLI stands on: load a model, run it, get a trace back.

    import llmtrace
    model = llmtrace.load("smollm2-135m-instruct")          # registry name, hub id, HF directory or .gguf
    run = model.generate("The capital of France is", max_new_tokens=8, temperature=0)
    run.text, run.tokens, run.events                         # generated text and ids; the trace (llmtrace.trace/1)
    run.save("trace.jsonl"); run.report("report.html")       # what --jsonl/--json and --html write
    model.explain("The capital of France is", layer=3)       # a Trace, as `llmtrace explain`
    model.lens("The capital of France is")                   # a Trace, as `llmtrace lens`
    llmtrace.read_trace("trace.jsonl")                       # a saved trace, as a Trace

Its place: above run/ (the loop, the sampler, explain), trace/ (recorder, sinks, reader) and report/ (the page), which
it wires together, and below cli/, whose commands parse flags into the option values defined here, call these
functions, and add only the terminal view, the output files and the exit code. Each option value checks its fields
when it is made, before any model loads, and raises BadValue naming the field (`temperature`); the CLI names the flag.

Options are typed dataclasses (LoadOptions, GenerateOptions, ExplainOptions, LensOptions): a new keyword is a new
field. This module imports torch only when a model is loaded or run, so `import llmtrace` stays light.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from llmtrace.errors import BadValue, UsageError

if TYPE_CHECKING:
    from llmtrace.checkpoint.loaded import LoadedModel

Prompt = Union[str, Sequence[str]]  # one prompt, or several run as one batch (s3)
Sink = Callable[[dict], None]  # called with each event as it is made


# ----------------------------------------------------------------------------------------------------------------
# options


@dataclass
class LoadOptions:
    """What `load` takes: the model and where it runs (--model, --device, --dtype, --keep-quantized, --device-map,
    --max-memory, --offload-dir, --threads, --fast)."""

    spec: Optional[str] = None  # None: the registry's default model
    device: Optional[str] = None
    dtype: Optional[str] = None
    keep_quantized: bool = False
    device_map: Optional[str] = None
    max_memory: Optional[Sequence[str]] = None  # ["cuda:0=20GiB", "cpu=32GiB"]
    offload_dir: Optional[Path] = None
    threads: Optional[int] = None
    fast: bool = False  # a GGUF's matrices on int4 kernels, bfloat16 activations: approximate, and traces say so
    _placement: Any = field(default=(), init=False, repr=False, compare=False)  # () until placement() is called

    def placement(self):
        """The --device-map placement (None without one), checked once: accelerate installed, sizes well formed."""
        from llmtrace.checkpoint.placement import parse_placement

        if self._placement == ():
            key = Path(self.spec).name if self.spec else "default"
            self._placement = parse_placement(self.device_map, list(self.max_memory) if self.max_memory else None,
                                              self.offload_dir, key)
        return self._placement

    def check_device(self) -> None:
        """--device cuda without CUDA (or a dtype the device lacks) fails before a download or a load."""
        from llmtrace.checkpoint.devices import pick_device, pick_dtype

        pick_dtype(self.dtype, pick_device(self.device))


@dataclass
class GenerateOptions:
    """Every sampler, trace and batch option of `generate`. Field names are the CLI's flags without dashes."""

    max_new_tokens: int = 32
    # the sampler (s10-s12)
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Union[dict[int, float], Sequence[str], None] = None  # {id: bias} or ["ID=BIAS", ...]
    ban: Sequence[str] = ()  # texts never generated
    sampler_order: Union[str, Sequence[str]] = "hf"  # "hf", "llama.cpp", "a,b,c" or a list of stage names
    seed: Optional[int] = None  # None: random (and recorded); row r of a batch uses seed + r
    # llama.cpp's samplers (defaults are llama.cpp's; see run/sampler.py)
    top_n_sigma: float = 0.0  # 0: off
    xtc_probability: float = 0.0  # 0: off
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # -1: the whole context, 0: off
    dry_sequence_breakers: Optional[Sequence[str]] = None  # None: llama.cpp's "\n", ":", "\"", "*"
    mirostat: int = 0  # 0: off, 1 or 2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # the prompt
    chat: bool = False
    system: Optional[str] = None
    # stopping
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    # the trace
    trace: str = "steps"  # none, steps, layers or full
    layers: Union[str, Sequence[int], None] = None  # "0,3,-1", "2-5", [0, -1]; None: all
    dump: Sequence[str] = ()  # points whose values are recorded: "logits", "3.probs"
    show_top: int = 10  # candidates recorded per step
    for_report: bool = False  # also record the attention probabilities the HTML report draws (what --html adds)
    compile: bool = False  # torch.compile the decode step (steps nothing observes)
    freeze: bool = False  # with compile, on the fast path (CPU): the weights compiled into the step (CompiledDecode)
    save_tensors: Optional[str] = None  # FILE.safetensors: the full values of the recorded points (`llmtrace diff`)
    # interventions (run/interventions.py: Ablate, Scale, Patch, Steer, ControlVector), applied to every pass
    interventions: Sequence[Any] = ()

    def __post_init__(self):
        from llmtrace.trace.indices import parse_index_ranges

        if self.max_new_tokens < 0:
            raise BadValue("max_new_tokens", " must be ≥ 0")
        if self.show_top < 1:
            raise BadValue("show_top", " must be ≥ 1")
        check_system(self.chat, self.system)
        self.sampler_config().validate(vocab_size=sys.maxsize)  # ranges now; ids against the vocabulary after load
        self.trace_options()
        if isinstance(self.layers, str) and self.layers.strip() not in ("", "all"):
            parse_index_ranges(self.layers, "layers", "layer")
        if self.save_tensors is not None and not str(self.save_tensors).endswith(".safetensors"):
            raise BadValue("save_tensors", f" writes a .safetensors file; give a name ending in .safetensors, not "
                           f"{str(self.save_tensors)!r}")
        if self.freeze and not self.compile:
            raise BadValue("freeze", " freezes the weights into the compiled decode step; add compile",
                           also=("compile",))
        if self.compile and self.interventions:
            raise BadValue("compile", " runs the model as it is; a run with interventions runs eagerly, so leave "
                           "compile out", also=("interventions", "compile"))
        if self.compile and (self.trace in ("layers", "full") or self.dump or self.for_report):
            raise BadValue("compile", " speeds up decode steps that nothing observes; with trace layers/full, dump or "
                           "for_report (which records attention) every step is observed and runs eagerly, so leave "
                           "compile out", also=("trace", "dump", "for_report", "compile"))

    def sampler_config(self, vocab_size: int = sys.maxsize, tokenizer=None):
        """The SamplerConfig: logit-bias ids are checked against `vocab_size`, ban texts encoded with `tokenizer`."""
        from llmtrace.run.sampler import SamplerConfig, banned_sequences, parse_logit_bias, parse_order

        order = parse_order(self.sampler_order) if isinstance(self.sampler_order, str) else list(self.sampler_order)
        if isinstance(self.logit_bias, dict):
            bias = parse_logit_bias([f"{k}={v}" for k, v in self.logit_bias.items()], vocab_size)
        else:
            bias = parse_logit_bias(list(self.logit_bias or []), vocab_size)
        return SamplerConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                             typical_p=self.typical_p, repetition_penalty=self.repetition_penalty,
                             frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                             order=order, seed=self.seed, logit_bias=bias,
                             ban=banned_sequences(tokenizer, list(self.ban)) if tokenizer is not None else [],
                             top_n_sigma=self.top_n_sigma, xtc_probability=self.xtc_probability,
                             xtc_threshold=self.xtc_threshold, dry_multiplier=self.dry_multiplier,
                             dry_base=self.dry_base, dry_allowed_length=self.dry_allowed_length,
                             dry_penalty_last_n=self.dry_penalty_last_n, mirostat=self.mirostat,
                             mirostat_tau=self.mirostat_tau, mirostat_eta=self.mirostat_eta,
                             **({} if self.dry_sequence_breakers is None
                                else {"dry_sequence_breakers": list(self.dry_sequence_breakers)}))

    def check_prompts(self, prompt: Prompt) -> list[str]:
        """The prompts of a run with these options (before any model loads): a list of several is one batch."""
        texts = check_prompts(prompt)
        if self.compile and not isinstance(prompt, str) and len(texts) > 1:
            raise BadValue("compile", " runs one prompt; leave it out for a batch of several prompts")
        if self.save_tensors and not isinstance(prompt, str) and len(texts) > 1:
            raise BadValue("save_tensors", " records one prompt's run; leave it out for a batch of several prompts")
        return texts

    def trace_options(self):
        from llmtrace.trace.options import TraceOptions

        # the report's what-if sampler reads each step's 1,000 largest logits: kept for a page (--html) and at --trace
        # full; --dump logits keeps all of them
        logits_top = 1000 if self.for_report or self.trace == "full" else 0
        return TraceOptions(level=self.trace, dump=tuple(self.dump), topk=self.show_top, logits_top=logits_top)


@dataclass
class ExplainOptions:
    """`explain`: one decoder layer taken apart (--layer, --head, --top, --chat, --system, --row)."""

    layer: int = 0
    head: Optional[int] = None
    top: int = 5
    chat: bool = False
    system: Optional[str] = None
    row: int = 0  # with several prompts: the row taken apart
    interventions: Sequence[Any] = ()  # run/interventions.py, applied to the pass taken apart

    def __post_init__(self):
        check_top(self.top)
        check_system(self.chat, self.system)


@dataclass
class LensOptions:
    """`lens`: the logit lens over layers and positions (--positions, --last, --layers, --top, --chat, --system, --row)."""

    positions: Optional[str] = None  # "all", "0,3,-1", "2-5"; None: the last `last`
    last: int = 12
    layers: Union[str, Sequence[int], None] = None
    top: int = 5
    chat: bool = False
    system: Optional[str] = None
    row: int = 0
    interventions: Sequence[Any] = ()  # run/interventions.py, applied to the pass

    def __post_init__(self):
        check_top(self.top)
        check_system(self.chat, self.system)
        if self.last < 1:
            raise BadValue("last", " must be ≥ 1")


def check_top(top: int) -> None:
    if not 1 <= top <= 100:
        raise BadValue("top", " must be between 1 and 100")


def check_system(chat: bool, system: Optional[str]) -> None:
    if system is not None and not chat:
        raise BadValue("system", " only applies with chat", also=("chat",))


def check_prompts(prompt: Prompt, row: Optional[int] = None) -> list[str]:
    """The one check of what is given as prompts: a string or a non-empty list of strings; `row` (explain and lens)
    one of them. Returns the list."""
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BadValue("prompt", " must be a string or a non-empty list of strings")
    if row is not None:
        if len(texts) == 1 and row != 0:
            raise BadValue("row", " picks one of several prompts; give a list of them", also=())
        if not 0 <= row < len(texts):
            raise BadValue("row", f" {row} is out of range; the batch has {len(texts)} prompts (rows 0..{len(texts) - 1})")
    return texts


def _options(cls, given: dict[str, Any], call: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise UsageError(f"{call}() got an unknown keyword {unknown[0]!r}; it takes {', '.join(sorted(known))}")
    return cls(**given)


# ----------------------------------------------------------------------------------------------------------------
# the trace a run returns


class Trace:
    """A trace's events (schema llmtrace.trace/1), from a run or read from a file, with what a notebook needs."""

    def __init__(self, events: list[dict], tokenizer=None, result=None):
        self.events = events
        self.tokenizer = tokenizer  # the model's, when known: the report draws the BPE merge story with it
        self.result = result  # generate's GenerationResult / BatchResult, when this trace is a run's

    def _summary(self) -> Optional[dict]:
        return next((e for e in reversed(self.events) if e.get("event") == "summary"), None)

    @property
    def text(self) -> Optional[str]:
        """The generated text (row 0's for a batch; `.rows` has each row's); None for explain and lens traces."""
        s = self._summary()
        return None if s is None else s["text"]

    @property
    def tokens(self) -> Optional[list[int]]:
        """The generated token ids (row 0's for a batch); None for explain and lens traces."""
        s = self._summary()
        return None if s is None else list(s["tokens"])

    @property
    def rows(self) -> Optional[list[dict]]:
        """A batch's rows: each one's tokens, text and stop reason."""
        s = self._summary()
        return None if s is None else s.get("rows")

    @property
    def interrupted(self) -> bool:
        s = self._summary()
        return bool(s and s.get("interrupted"))

    def save(self, path: Union[str, Path]) -> Path:
        """Write the trace: `.jsonl` one event per line, `.json` one document (what `show` and `report` read)."""
        from llmtrace.trace.sinks import JsonDocSink, JsonlSink

        path = Path(path)
        if path.suffix == ".jsonl":
            sink = JsonlSink(str(path))
            try:
                for ev in self.events:
                    sink(ev)
            finally:
                sink.close()
        elif path.suffix == ".json":
            doc = JsonDocSink(str(path))
            for ev in self.events:
                doc(ev)
            doc.write()
        else:
            raise BadValue("path", f" {str(path)!r} must end in .jsonl (one event per line) or .json (one document)")
        return path

    def html(self, row: int = 0, lang: str = "en") -> str:
        """The HTML report page, as a string; `lang` the language of its words (en, zh)."""
        from llmtrace.report.write import build

        return build(self.events, self.tokenizer, row=row, lang=lang)

    def report(self, path: Union[str, Path], row: int = 0, lang: str = "en") -> Path:
        """Write the self-contained HTML report (what --html and `llmtrace report` write)."""
        from llmtrace.report.write import write_report

        write_report(self.events, path, tokenizer=self.tokenizer, row=row, lang=lang)
        return Path(path)

    def _repr_html_(self) -> str:
        """Jupyter shows the report inline, in a sandboxed frame (its script and styles stay inside)."""
        import html

        return (f'<iframe sandbox="allow-scripts" style="width:100%;height:640px;border:1px solid #ddd" '
                f'srcdoc="{html.escape(self.html(), quote=True)}"></iframe>')

    def __repr__(self) -> str:
        head = next((e for e in self.events if e.get("event") in ("run", "explain")), {})
        kind = head.get("command", "generate") if head.get("event") == "explain" else "generate"
        if self.text is not None:
            return f"Trace({kind}, {len(self.events)} events, {len(self.tokens)} tokens: {self.text!r})"
        return f"Trace({kind}, {len(self.events)} events)"


def read_trace(path: Union[str, Path], tokenizer=None) -> Trace:
    """A saved trace (--json document or --jsonl stream, "-" for stdin), checked against the schema."""
    from llmtrace.trace.reader import load_trace

    return Trace(load_trace(str(path)), tokenizer=tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# the model


def load(spec: Optional[str] = None, **options) -> "Model":
    """Load a model: a registry name, hub id, HF directory or .gguf file (None: the default model). Keywords as the
    CLI's flags: device=, dtype=, keep_quantized=, device_map=, max_memory=, offload_dir=, threads=, fast=."""
    return load_with(_options(LoadOptions, {"spec": spec, **options}, "load"))


def load_with(options: LoadOptions) -> "Model":
    from llmtrace.checkpoint import load as checkpoint
    from llmtrace.checkpoint import devices

    placement = options.placement()
    options.check_device()
    devices.set_threads(options.threads)
    return Model(checkpoint.load_model(options.spec, device=options.device, dtype=options.dtype,
                                       keep_quantized=options.keep_quantized, placement=placement,
                                       fast=options.fast))


class Model:
    """A loaded model (`.loaded`: model, tokenizer, config, device, dtype) and the runs it can make."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def config(self):
        return self.loaded.config

    def __repr__(self) -> str:
        lm = self.loaded
        return f"Model({lm.name!r}, {lm.config.n_layers} layers, {str(lm.dtype).replace('torch.', '')} on {lm.device})"

    # -- generate

    def generate(self, prompt: Prompt, **options) -> Trace:
        """Generate from one prompt, or from a list of prompts run as one batch. Keywords: GenerateOptions' fields
        (max_new_tokens=, temperature=, top_k=, top_p=, ..., seed=, stop=, trace=, layers=, dump=, show_top=)."""
        return self.generate_with(prompt, _options(GenerateOptions, options, "generate"))

    def generate_with(self, prompt: Prompt, options: GenerateOptions, *, sinks: Sequence[Sink] = (),
                      on_text: Optional[Callable[[str], None]] = None, keep_events: bool = True) -> Trace:
        """`generate` with its options as one value, and the hooks the CLI adds: `sinks` get each event as it is
        made (a stream, a view), `on_text` each piece of text of a one-prompt run. `keep_events=False`: the
        returned Trace holds only the summary (a long traced run's events can be many)."""
        import torch

        from llmtrace.console import prefill_progress
        from llmtrace.run.generate import check_batch_context, context_note, generate, generate_batch, row_seed
        from llmtrace.run.sampler import Sampler
        from llmtrace.trace.indices import parse_layers
        from llmtrace.trace.recorder import Recorder

        lm, tok = self.loaded, self.loaded.tokenizer
        texts = options.check_prompts(prompt)
        batch = not isinstance(prompt, str) and len(texts) > 1  # a one-prompt list is a one-prompt run
        trace = options.trace_options()
        trace.layers = parse_layers(_layer_spec(options.layers), lm.config.n_layers)
        trace.check_dump_layers(lm.config.n_layers)
        if options.for_report:  # the report's attention maps need the probabilities of the recorded layers
            from llmtrace.report.write import report_dumps

            extra = report_dumps(trace.layers, lm.config.n_layers, getattr(lm, "points", None))
            trace = replace(trace, dump=tuple(dict.fromkeys(trace.dump + extra)))
        scfg = options.sampler_config(lm.config.vocab_size, tok)
        scfg.validate(lm.config.vocab_size)
        encoded = [tok.encode_prompt(t, chat=options.chat, system=options.system) for t in texts]
        for r, (prompt_text, _) in enumerate(encoded):
            dropped = tok.dropped_note(prompt_text, f"prompt {r + 1}" if batch else "prompt")
            if dropped:
                print(f"note: {dropped}", file=sys.stderr)
        ids = encoded[0][1]
        cut = context_note(lm, [len(i) for _, i in encoded], options.max_new_tokens)
        if cut:  # -n cut short by the context window: generate what fits and say so (stop reason "context")
            print(f"note: {cut}", file=sys.stderr)
        sampler = Sampler(scfg, lm.config.vocab_size, k_show=trace.topk, tokenizer=tok)
        if batch:
            check_batch_context(lm, [i for _, i in encoded], options.max_new_tokens)  # before any output
            samplers = [Sampler(replace(scfg, seed=row_seed(sampler.seed, r)), lm.config.vocab_size, k_show=trace.topk,
                                tokenizer=tok) for r in range(len(encoded))]

        events: list[dict] = []
        kept: Sink = events.append if keep_events else (lambda ev: ev.get("event") == "summary" and events.append(ev))
        run_info = {"prompt": encoded[0][0], "chat": options.chat, "threads": torch.get_num_threads()}
        interventions = list(options.interventions)
        if interventions:
            from llmtrace.run.interventions import check, record

            check(interventions, lm.config, [len(i) for _, i in encoded])  # before any output
            run_info["interventions"] = [record(iv) for iv in interventions]
        if batch:
            run_info["prompts"] = [p for p, _ in encoded]
        compiled = None
        if options.compile:
            compiled = _compile_step(lm, len(ids), options.max_new_tokens, options.freeze)
            run_info["compiled"] = {"decode_step": True, "compile_s": round(compiled.compile_s, 3),
                                    "frozen": options.freeze}
        store = None
        if options.save_tensors:
            from llmtrace.trace.tensors import TensorStore

            store = TensorStore(Path(options.save_tensors))
        recorder = Recorder(trace, [*sinks, kept], run_info=run_info, tensors=store)
        if batch:
            result = generate_batch(lm, [i for _, i in encoded], samplers, options.max_new_tokens,
                                    stop_texts=tuple(options.stop), ignore_eos=options.ignore_eos, observer=recorder,
                                    on_prefill_progress=prefill_progress(), interventions=interventions)
        else:
            result = generate(lm, ids, sampler, options.max_new_tokens, stop_texts=tuple(options.stop),
                              ignore_eos=options.ignore_eos, observer=recorder, on_text=on_text, compiled=compiled,
                              on_prefill_progress=prefill_progress(), interventions=interventions)
        if store is not None:
            store.write()  # before the caller writes the trace document, which names it
        return Trace(events, tokenizer=tok, result=result)

    # -- explain and lens

    def _encoded(self, prompt: Prompt, options) -> tuple[str, list[int], list[str]]:
        texts = check_prompts(prompt, options.row)
        text = texts[options.row]
        if text == "":
            raise BadValue("prompt", " is empty; give some text")
        prompt_text, ids = self.tokenizer.encode_prompt(text, chat=options.chat, system=options.system)
        return prompt_text, ids, texts

    def explain(self, prompt: Prompt, **options) -> Trace:
        """One decoder layer taken apart on the prompt (`llmtrace explain`). Keywords: layer=, head=, top=, chat=,
        system=, row= (with a list of prompts: the row taken apart, after the batch's masks)."""
        return self.explain_with(prompt, _options(ExplainOptions, options, "explain"))

    def explain_with(self, prompt: Prompt, options: ExplainOptions) -> Trace:
        from llmtrace.run.explain import explain_events

        prompt_text, ids, texts = self._encoded(prompt, options)
        events = explain_events(self.loaded, ids, options.layer, head=options.head, top=options.top,
                                prompt=prompt_text, chat=options.chat, interventions=list(options.interventions))
        return Trace(self._with_batch(texts, options, events), tokenizer=self.tokenizer)

    def lens(self, prompt: Prompt, **options) -> Trace:
        """The logit lens (`llmtrace lens`). Keywords: positions=, last=, layers=, top=, chat=, system=, row=."""
        return self.lens_with(prompt, _options(LensOptions, options, "lens"))

    def lens_with(self, prompt: Prompt, options: LensOptions) -> Trace:
        from llmtrace.run.explain import lens_events, parse_positions
        from llmtrace.run.generate import check_context
        from llmtrace.trace.indices import parse_layers

        prompt_text, ids, texts = self._encoded(prompt, options)
        check_context(self.loaded, len(ids), 0)
        rows = parse_layers(_layer_spec(options.layers), self.config.n_layers)
        cols = parse_positions(options.positions, len(ids), options.last)
        events = lens_events(self.loaded, ids, cols, rows, top=options.top, prompt=prompt_text, chat=options.chat,
                             interventions=list(options.interventions))
        return Trace(self._with_batch(texts, options, events), tokenizer=self.tokenizer)

    def _with_batch(self, texts: list[str], options, events: list[dict]) -> list[dict]:
        """Several prompts: the s3 batch event (every row's padded ids and combined mask) before the row's events."""
        if len(texts) < 2:
            return events
        from llmtrace.run.explain import explain_batch_event

        prompts = [self.tokenizer.encode_prompt(t, chat=options.chat, system=options.system)[1] for t in texts]
        for r, p in enumerate(prompts):
            if not p:
                raise BadValue("prompt", f" {r + 1} of the batch is empty (it encodes to zero tokens); give some text")
        return events[:1] + [explain_batch_event(self.tokenizer, prompts, options.row)] + events[1:]


def _layer_spec(layers) -> Optional[str]:
    """Layers as the index parser takes them: "0,3,-1", "2-5", "all" or None; a list of ints becomes "0,-1"."""
    if layers is None or isinstance(layers, str):
        return layers
    return ",".join(str(int(i)) for i in layers)


def _compile_step(lm, n_prompt: int, max_new_tokens: int, freeze: bool = False):
    """torch.compile the decode step before the run starts, saying so on stderr (it can take minutes)."""
    import os

    from llmtrace.registry.cache import cache_dir
    from llmtrace.run.generate import check_freeze, compile_decode

    # Inductor's compiled code is kept with llmtrace's other caches, so that later runs load it in seconds
    check_freeze(lm, freeze)  # before saying that it compiles
    where = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    # two lines, so that it reads at 80 columns: the cache's path alone can be long
    print(f"compiling the decode step with torch.compile (minutes the first time)…\n  its cache: {where}",
          file=sys.stderr, flush=True)
    compiled = compile_decode(lm, n_prompt, max_new_tokens, freeze=freeze)
    print(f"compiled in {compiled.compile_s:.1f} s", file=sys.stderr, flush=True)
    return compiled


# ----------------------------------------------------------------------------------------------------------------
# comparing two runs


def compare(a, b, prompt: Prompt, **options) -> "Comparison":
    """Run `prompt` through A and B side by side and compare them at every point, layer and position (`llmtrace
    compare`). `a`, `b`: a model spec, a `Side` (a spec and how to run it: dtype=, device=, keep_quantized=) or a
    loaded `Model`. Keywords: max_new_tokens=, chat=, system=, tolerance=, ids_from=, progress= (run/compare.py)."""
    from llmtrace.run.compare import compare as run_compare

    a, b = (x.loaded if isinstance(x, Model) else x for x in (a, b))
    return Comparison(run_compare(a, b, prompt, **options))


class Comparison:
    """What `compare` found (run.compare.CompareResult: `.first_divergence`, `.layers`, `.kld_mean`, `.to_json()`,
    `.save(path)`, ...) with the views a notebook needs: `.report(path)` and the page inline."""

    def __init__(self, result):
        self.result = result

    def __getattr__(self, name: str):
        return getattr(self.result, name)

    def html(self) -> str:
        from llmtrace.report.compare import render_compare_page

        return render_compare_page(self.result.to_json())

    def report(self, path: Union[str, Path]) -> int:
        """The HTML comparison page to `path` (atomically). Returns its size in bytes."""
        from llmtrace.report.compare import write_compare_page

        return write_compare_page(self.result, path)

    def _repr_html_(self) -> str:
        import html

        return (f'<iframe sandbox="allow-scripts" style="width:100%;height:640px;border:1px solid #ddd" '
                f'srcdoc="{html.escape(self.html(), quote=True)}"></iframe>')

    def __repr__(self) -> str:
        return f"Comparison({self.result.summary_line()!r})"


def patch_sweep(model, clean: str, corrupt: str, answer: str, against: str, at: str = "resid_post", **options) -> dict:
    """The activation-patching sweep (`llmtrace patch`): the corrupt prompt run once per layer and position with the
    clean prompt's activation at `at` patched in; returns the `patch` event (`cells`: layer, position, metric,
    recovery). `model`: a loaded `Model` (or LoadedModel). Keywords: on_progress= (run/patching.py)."""
    from llmtrace.run.patching import patch_sweep as sweep

    lm = model.loaded if isinstance(model, Model) else model
    return sweep(lm, clean, corrupt, answer, against, at=at, **options)
