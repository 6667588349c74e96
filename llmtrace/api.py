"""The Python API, the one the CLI stands on: load a model, run it, get a trace back.

    import llmtrace
    model = llmtrace.load("smollm2-135m-instruct")          # registry name, hub id, HF directory or .gguf
    run = model.generate("The capital of France is", max_new_tokens=8, temperature=0)
    run.text, run.tokens, run.events                         # generated text and ids; the trace (llmtrace.trace/1)
    run.save("trace.jsonl"); run.report("report.html")       # what --jsonl/--json and --html write
    model.explain("The capital of France is", layer=3)       # a Trace, as `llmtrace explain`
    model.lens("The capital of France is")                   # a Trace, as `llmtrace lens`
    llmtrace.read_trace("trace.jsonl")                       # a saved trace, as a Trace

Its place: above run/ (the loop, the sampler, explain), trace/ (recorder, writers, reader) and report/ (the page), which
it wires together, and below cli/, whose commands parse flags into the option values defined here, call these
functions, and add only the terminal view, the output files and the exit code. Each option value checks its fields
when it is made, before any model loads, and raises BadValue naming the field (`temperature`); the CLI names the flag.

Options are typed dataclasses (LoadOptions, GenerateOptions, ExplainOptions, LensOptions): a new keyword is a new
field. This module imports torch only when a model is loaded or run, so `import llmtrace` stays light.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from llmtrace.errors import BadValue, UsageError
from llmtrace.run.sampler import SamplerConfig, parse_logit_bias, parse_order
from llmtrace.trace.events import Level
from llmtrace.units import plural

if TYPE_CHECKING:
    from llmtrace.checkpoint.loaded import LoadedModel

Prompt = Union[str, Sequence[str]]  # one prompt, or several run as one batch (s3)
Sink = Callable[[dict], None]  # called with each event as it is made


# ----------------------------------------------------------------------------------------------------------------
# options


@dataclass
class LoadOptions:
    """What `load` takes: the model and where it runs (--model, --device, --dtype, --keep-quantized, --device-map,
    --max-memory, --offload-dir, --threads, --fast). Every value that needs neither torch nor the model is checked
    when this is made (checkpoint/choices.py); what the machine must answer (CUDA, accelerate's placement) at load."""

    spec: Optional[str] = None  # None: the registry's default model
    device: Optional[str] = None
    dtype: Optional[str] = None
    keep_quantized: bool = False
    device_map: Optional[str] = None
    max_memory: Optional[Sequence[str]] = None  # ["cuda:0=20GiB", "cpu=32GiB"]
    offload_dir: Optional[Path] = None
    threads: Optional[int] = None
    fast: bool = False  # a GGUF's matrices on int4 kernels, bfloat16 activations: approximate, and traces say so

    def __post_init__(self):
        from llmtrace.checkpoint.choices import check_load_values

        check_load_values(self.device, self.dtype, self.keep_quantized, self.device_map, self.max_memory,
                          self.offload_dir, self.threads, self.fast)


def greedy() -> SamplerConfig:
    """The sampler a run has unless told otherwise: greedy (temperature 0), every other stage off."""
    return SamplerConfig(temperature=0.0)


# the keywords of `generate` that are the sampler's (SamplerConfig's fields, declared there once), as `generate` takes
# them: ban is texts (GenerateOptions.ban), the order is `sampler_order`, logit_bias may be ["ID=BIAS", ...]
SAMPLER_KEYWORDS = tuple(f.name for f in fields(SamplerConfig) if f.name not in ("ban", "order")) + ("sampler_order",)


@dataclass
class GenerateOptions:
    """Every option of `generate`: the sampler's settings as one SamplerConfig (run/sampler.py declares them and
    checks them when it is made), and the run's own fields, checked here when this is made, before any model loads.
    `GenerateOptions.of(temperature=0.7, top_k=40, ...)` takes the sampler's settings as keywords, as `generate` does.
    Field names are the CLI's flags without dashes."""

    max_new_tokens: int = 32
    sampler: SamplerConfig = field(default_factory=greedy)  # the sampler (s10-s12); its ban is filled in at the run
    ban: Sequence[str] = ()  # texts never generated (encoded into sampler.ban once the tokenizer is known)
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
    trace_options: Any = field(default=None, init=False, repr=False, compare=False)  # TraceOptions, made once here

    @classmethod
    def of(cls, **keywords) -> "GenerateOptions":
        """The options from `generate`'s keywords: the sampler's (SAMPLER_KEYWORDS) make its SamplerConfig."""
        given = {k: keywords.pop(k) for k in list(keywords) if k in SAMPLER_KEYWORDS}
        known = {f.name for f in fields(cls) if f.init and f.name != "sampler"}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise UsageError(f"generate() got an unknown keyword {unknown[0]!r}; it takes "
                             f"{', '.join(sorted(known | set(SAMPLER_KEYWORDS)))}")
        return cls(sampler=sampler_config(**given), **keywords)

    def __post_init__(self):
        from llmtrace.trace.indices import parse_index_ranges
        from llmtrace.trace.options import TraceOptions

        if self.max_new_tokens < 0:
            raise BadValue("max_new_tokens", " must be ≥ 0")
        if self.show_top < 1:
            raise BadValue("show_top", " must be ≥ 1")
        check_system(self.chat, self.system)
        check_texts("ban", self.ban, "a text never generated")
        check_texts("stop", self.stop, "the text that ends the run")
        if self.ban and "ban" not in self.sampler.order:
            raise BadValue("sampler_order", f" {','.join(self.sampler.order)} leaves out sampler stage 'ban', which "
                           "is set")
        try:
            # the report's what-if sampler reads each step's 1,000 largest logits: kept for a page (for_report) and
            # at trace full; dump logits keeps all of them
            logits_top = 1000 if self.for_report or Level.of(self.trace).full else 0
            self.trace_options = TraceOptions(level=self.trace, dump=tuple(self.dump), topk=self.show_top,
                                              logits_top=logits_top)
        except BadValue as e:  # the trace's own name for it is its level
            raise BadValue("trace" if e.field == "level" else e.field, e.rest, e.also) from None
        if isinstance(self.layers, str) and self.layers.strip() not in ("", "all"):
            parse_index_ranges(self.layers, "layers", "layer")
        if self.save_tensors is not None and not str(self.save_tensors).endswith(".safetensors"):
            raise BadValue("save_tensors", f" writes a .safetensors file; give a name ending in .safetensors, not "
                           f"{str(self.save_tensors)!r}")
        self._check_compile()

    def _check_compile(self) -> None:
        if self.freeze and not self.compile:
            raise BadValue("freeze", " freezes the weights into the compiled decode step; add compile",
                           also=("compile",))
        if self.compile and self.interventions:
            raise BadValue("compile", " runs the model as it is; a run with interventions runs eagerly, so leave "
                           "compile out", also=("compile",))
        if self.compile and (Level.of(self.trace).every_pass or self.dump or self.for_report):
            raise BadValue("compile", " speeds up decode steps that nothing observes; with trace layers/full, dump or "
                           "for_report (which records attention) every step is observed and runs eagerly, so leave "
                           "compile out", also=("trace", "dump", "for_report", "compile"))

    def check_prompts(self, prompt: Prompt) -> list[str]:
        """The prompts of a run with these options (before any model loads): a list of several is one batch."""
        texts = check_prompts(prompt)
        if self.compile and not isinstance(prompt, str) and len(texts) > 1:
            raise BadValue("compile", " runs one prompt; leave it out for a batch of several prompts")
        if self.save_tensors and not isinstance(prompt, str) and len(texts) > 1:
            raise BadValue("save_tensors", " records one prompt's run; leave it out for a batch of several prompts")
        return texts


def sampler_config(sampler_order: Union[str, Sequence[str], None] = None,
                   logit_bias: Union[dict[int, float], Sequence[str], None] = None, **settings) -> SamplerConfig:
    """A SamplerConfig from `generate`'s keywords: greedy unless `temperature` is given; `sampler_order` "hf",
    "llama.cpp", "a,b,c" or a list of stage names; `logit_bias` {id: bias} or ["ID=BIAS", ...];
    dry_sequence_breakers None: llama.cpp's. Ids are checked against the vocabulary once a model is known."""
    if logit_bias is not None and not isinstance(logit_bias, dict):
        logit_bias = parse_logit_bias(list(logit_bias), sys.maxsize)
    if logit_bias:
        settings["logit_bias"] = dict(logit_bias)
    if settings.get("dry_sequence_breakers", ()) is None:
        del settings["dry_sequence_breakers"]
    try:
        if sampler_order is not None:
            settings["order"] = parse_order(sampler_order) if isinstance(sampler_order, str) else list(sampler_order)
        return SamplerConfig(**{"temperature": 0.0, **settings})
    except BadValue as e:  # the sampler's own name for it is its `order`
        if e.field != "order":
            raise
        raise BadValue("sampler_order", e.rest, e.also, e.before) from None


def check_texts(name: str, texts: Sequence[str], what: str) -> None:
    for text in texts:
        if not isinstance(text, str) or text == "":
            raise BadValue(name, f" needs a non-empty text ({what}), got {text!r}")


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

    def __init__(self, events: list[dict], tokenizer=None, result=None, notes: Sequence[str] = ()):
        self.events = events
        self.tokenizer = tokenizer  # the model's, when known: the report draws the BPE merge story with it
        self.result = result  # generate's GenerationResult / BatchResult, when this trace is a run's
        self.notes = list(notes)  # what a person should know of the run, one line each (the CLI prints `note: ...`)

    def _summary(self) -> Optional[dict]:
        return next((e for e in reversed(self.events) if e.get("event") == "summary"), None)

    @property
    def text(self) -> Optional[str]:
        """The generated text (row 0's for a batch; `.rows` has each row's); None for explain and lens traces."""
        s = self._summary()
        return None if s is None or "text" not in s else s["text"]

    @property
    def tokens(self) -> Optional[list[int]]:
        """The generated token ids (row 0's for a batch); None for explain and lens traces."""
        s = self._summary()
        return None if s is None or "tokens" not in s else list(s["tokens"])

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
        from llmtrace.trace.writers import JsonDocWriter, JsonlWriter

        path = Path(path)
        if path.suffix == ".jsonl":
            sink = JsonlWriter(str(path))
            try:
                for ev in self.events:
                    sink(ev)
            finally:
                sink.close()
        elif path.suffix == ".json":
            doc = JsonDocWriter(str(path))
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
            return (f"Trace({kind}, {plural(len(self.events), 'event')}, {plural(len(self.tokens), 'token')}: "
                    f"{self.text!r})")
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
    from llmtrace.checkpoint.placement import parse_placement

    key = Path(options.spec).name if options.spec else "default"
    placement = parse_placement(options.device_map, list(options.max_memory) if options.max_memory else None,
                                options.offload_dir, key)
    if placement is None:
        devices.pick_dtype(options.dtype, devices.pick_device(options.device))  # --device cuda without CUDA: at once
    devices.set_threads(options.threads)
    return Model(checkpoint.load_model(options.spec, device=options.device, dtype=options.dtype,
                                       keep_quantized=options.keep_quantized, placement=placement,
                                       fast=options.fast))


class Model:
    """A loaded model (`.loaded`: model, tokenizer, config, device, dtype) and the runs it can make."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self._points: Optional[list] = None  # points(), listed once

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def config(self):
        return self.loaded.config

    def __repr__(self) -> str:
        lm = self.loaded
        return (f"Model({lm.name!r}, {plural(lm.config.n_layers, 'layer')}, {str(lm.dtype).replace('torch.', '')} "
                f"on {lm.device})")

    # -- the researcher's API: points, full tensors, your own hooks (run/research.py)

    def points(self, layer: Optional[int] = None, step: Optional[str] = None) -> list:
        """Every point of this model in forward order, as a hook sees it (run.hookpoints.PointInfo: name "3.q_rope",
        layer, seed step, axes, editable, the declared operation). `layer`: one layer's (negative from the end);
        `step`: one seed step's ("s6.3"; "s6" takes its sub-steps)."""
        from llmtrace.run.hookpoints import filter_points
        from llmtrace.run.research import points_of

        if self._points is None:
            self._points = points_of(self.loaded)
        return filter_points(self._points, layer, step, self.config.n_layers)

    def run_with_cache(self, prompt, names=None, layers: Optional[Sequence[int]] = None, dtype=None, device=None,
                       remove_batch_dim: bool = False, chat: bool = False, system: Optional[str] = None,
                       grad: bool = False, names_filter=None):
        """One forward pass over `prompt` (a text, a list of texts run as a left-padded batch, ids): (logits (B, T, V)
        float32, cache), the cache holding the full tensor of each point `names` picks (None: all; a name, a glob
        "*.resid_post", a list, or a predicate on the name; TransformerLens's names too) in `layers`, float32 unless
        `dtype` says, on the model's device unless `device` says. `remove_batch_dim` drops the batch axis of a
        one-prompt pass. `grad=True`: the logits and the kept tensors are one autograd graph (the weights stay
        frozen), so torch.autograd.grad(logits[0, -1, t], cache["1.resid_post"]) is that logit's gradient there.
        TransformerLens's `run_with_cache(tokens, names_filter=...)`; `names_filter=` is accepted for `names=`."""
        from llmtrace.run.research import run_with_cache

        return run_with_cache(self.loaded, prompt, names=names, layers=layers, dtype=dtype, device=device,
                              remove_batch_dim=remove_batch_dim, chat=chat, system=system, grad=grad,
                              names_filter=names_filter)

    def run_with_hooks(self, prompt, hooks: Sequence[Any] = (), chat: bool = False, system: Optional[str] = None,
                       fwd_hooks: Sequence[Any] = (), bwd_hooks: Sequence[Any] = (), grad: bool = False):
        """One forward pass over `prompt` with `hooks` attached: the logits (B, T, V), float32. A hook is a
        (name, fn) pair or llmtrace.Hook(name, fn), called fn(x, point); it returns None to observe or, at an
        editable point, the tensor the pass goes on with. The interventions (Ablate, Steer, ...) mix in.
        `fwd_hooks` is TransformerLens's keyword for `hooks`. `bwd_hooks`: (name, fn) pairs, fn(grad, point) called
        with the gradient flowing back through the point when you run a backward pass from the returned logits
        (which then carry the graph, as with `grad=True`). TransformerLens's `run_with_hooks(tokens, fwd_hooks=[...],
        bwd_hooks=[...])`."""
        from llmtrace.run.research import run_with_hooks

        return run_with_hooks(self.loaded, prompt, hooks, chat=chat, system=system, fwd_hooks=fwd_hooks,
                              bwd_hooks=bwd_hooks, grad=grad)

    def attribute(self, prompt, target: str, against: Optional[str] = None, position: int = -1, chat: bool = False,
                  system: Optional[str] = None):
        """Direct logit attribution: `target`'s logit (one token; minus `against`'s when given) at `position` of one
        prompt, split into the embedding's, each head's (through its slice of Wo), each feed-forward's or expert's
        direct contributions, with the final norm's scale frozen at this input's value (run/attribution.py). Returns
        an Attribution: `.logit`, `.parts` (name -> contribution, summing to the logit), `.top(n)`, `.record()`."""
        from llmtrace.run.attribution import attribute

        return attribute(self.loaded, prompt, target, against=against, position=position, chat=chat, system=system)

    def hooks(self, hooks: Sequence[Any] = (), fwd_hooks: Sequence[Any] = (), bwd_hooks: Sequence[Any] = ()):
        """`with model.hooks([("3.attn_out", fn)]):` every pass inside the block runs them (run_with_cache included);
        on exit, also by an exception, the model is unhooked. TransformerLens's `with model.hooks(fwd_hooks=...)`.
        Backward hooks belong to the pass that makes a graph: run_with_hooks(..., bwd_hooks=...)."""
        from llmtrace.run.research import hooks_attached

        if bwd_hooks:
            raise BadValue("bwd_hooks", " belong to the pass that makes a graph: give them to "
                                        "run_with_hooks(prompt, bwd_hooks=[...]), whose logits carry it")
        return hooks_attached(self.loaded, list(hooks) + list(fwd_hooks))

    def to_tokens(self, prompt, chat: bool = False, system: Optional[str] = None):
        """The ids a pass over `prompt` runs, (B, T): a text as `generate` encodes it, a list of texts left-padded.
        TransformerLens's `model.to_tokens`."""
        from llmtrace.run.research import to_tokens

        return to_tokens(self.loaded, prompt, chat=chat, system=system)

    def to_str_tokens(self, prompt, chat: bool = False, system: Optional[str] = None) -> list:
        """Each token of one prompt (a text or ids) as the text it stands for. TransformerLens's
        `model.to_str_tokens`."""
        from llmtrace.run.research import to_str_tokens

        return to_str_tokens(self.loaded, prompt, chat=chat, system=system)

    def requires_grad_(self, requires_grad: bool = True) -> "Model":
        """The weights as leaves of the graph a pass with gradients makes (True), or frozen again (False, as they
        load). A matrix kept as a GGUF's blocks (keep_quantized) has no float weights to differentiate; its biases
        do. Returns the model."""
        self.loaded.model.requires_grad_(requires_grad)
        return self

    # -- generate

    def generate(self, prompt: Prompt, **options) -> Trace:
        """Generate from one prompt, or from a list of prompts run as one batch. Keywords: GenerateOptions' fields
        (max_new_tokens=, temperature=, top_k=, top_p=, ..., seed=, stop=, trace=, layers=, dump=, show_top=)."""
        return self.generate_with(prompt, GenerateOptions.of(**options))

    def generate_with(self, prompt: Prompt, options: GenerateOptions, *, sinks: Sequence[Sink] = (),
                      on_text: Optional[Callable[[str], None]] = None, keep_events: bool = True) -> Trace:
        """`generate` with its options as one value, and the hooks the CLI adds: `sinks` get each event as it is
        made (a stream, a view), `on_text` each piece of text of a one-prompt run. `keep_events=False`: the
        returned Trace holds only the summary (a long traced run's events can be many). What a person should know
        of the run (characters the tokenizer drops, -n cut by the context window) is in the Trace's `notes`; to say
        them before the run starts, `prepare_generate` then `GenerateRun.run`."""
        return self.prepare_generate(prompt, options).run(sinks=sinks, on_text=on_text, keep_events=keep_events)

    def prepare_generate(self, prompt: Prompt, options: GenerateOptions) -> "GenerateRun":
        """Everything a run needs before its first pass, checked against this model (layers, dump layers, token
        ids, the context window, interventions): a GenerateRun whose `notes` can be said before it `run`s."""
        from llmtrace.run.generate import check_batch_context, context_note, row_seed
        from llmtrace.run.sampler import Sampler, banned_sequences
        from llmtrace.trace.indices import parse_layers

        lm, tok = self.loaded, self.loaded.tokenizer
        texts = options.check_prompts(prompt)
        batch = not isinstance(prompt, str) and len(texts) > 1  # a one-prompt list is a one-prompt run
        trace = copy.copy(options.trace_options)  # checked when the options were made: not made (and checked) again
        trace.layers = parse_layers(_layer_spec(options.layers), lm.config.n_layers)
        trace.check_dumps(lm.config.n_layers, lm.points)
        if options.for_report:  # the report's attention maps need the probabilities of the recorded layers
            from llmtrace.report.write import report_dumps

            extra = report_dumps(trace.layers, lm.config.n_layers, lm.points)
            trace = replace(trace, dump=tuple(dict.fromkeys(trace.dump + extra)))
        scfg = options.sampler.changed(ban=banned_sequences(tok, list(options.ban))) if options.ban else options.sampler
        sampler = Sampler(scfg, lm.config.vocab_size, k_show=trace.topk, tokenizer=tok)  # ids against the vocabulary
        encoded = [tok.encode_prompt(t, chat=options.chat, system=options.system) for t in texts]
        notes = [note for r, (text, _) in enumerate(encoded)
                 if (note := tok.dropped_note(text, f"prompt {r + 1}" if batch else "prompt"))]
        cut = context_note(lm, [len(i) for _, i in encoded], options.max_new_tokens)
        if cut:  # -n cut short by the context window: generate what fits and say so (stop reason "context")
            notes.append(cut)
        samplers = None
        if batch:
            check_batch_context(lm, [i for _, i in encoded], options.max_new_tokens)  # before any output
            samplers = [sampler.with_seed(row_seed(sampler.seed, r)) for r in range(len(encoded))]
        if options.interventions:
            from llmtrace.run.interventions import check

            check(list(options.interventions), lm.config, [len(i) for _, i in encoded])  # before any output
        return GenerateRun(self, options, encoded, trace, sampler, samplers, notes)

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

    def explain_with(self, prompt: Prompt, options: ExplainOptions, *, sinks: Sequence[Sink] = ()) -> Trace:
        """`explain` with a typed options value; `sinks` receive each event as it is made (the CLI's --jsonl), the
        summary last. A Ctrl-C ends the events there: the summary says `interrupted`, and so does the trace."""
        from llmtrace.run.explain import iter_explain_events

        prompt_text, ids, texts = self._encoded(prompt, options)
        events = iter_explain_events(self.loaded, ids, options.layer, head=options.head, top=options.top,
                                     prompt=prompt_text, chat=options.chat, interventions=list(options.interventions))
        return self._streamed("explain", events, self._batch_event(texts, options), len(ids), sinks)

    def lens(self, prompt: Prompt, **options) -> Trace:
        """The logit lens (`llmtrace lens`). Keywords: positions=, last=, layers=, top=, chat=, system=, row=."""
        return self.lens_with(prompt, _options(LensOptions, options, "lens"))

    def lens_with(self, prompt: Prompt, options: LensOptions, *, sinks: Sequence[Sink] = ()) -> Trace:
        """`lens` with a typed options value; `sinks` as for explain_with."""
        from llmtrace.run.explain import iter_lens_events, parse_positions
        from llmtrace.run.generate import check_context
        from llmtrace.trace.indices import parse_layers

        prompt_text, ids, texts = self._encoded(prompt, options)
        check_context(self.loaded, len(ids), 0)
        rows = parse_layers(_layer_spec(options.layers), self.config.n_layers)
        cols = parse_positions(options.positions, len(ids), options.last)
        events = iter_lens_events(self.loaded, ids, cols, rows, top=options.top, prompt=prompt_text, chat=options.chat,
                                  interventions=list(options.interventions))
        return self._streamed("lens", events, self._batch_event(texts, options), len(ids), sinks)

    def _streamed(self, command: str, events, batch: Optional[dict], n_tokens: int, sinks: Sequence[Sink]) -> Trace:
        """A pass's events handed to `sinks` as they are made and kept, the batch event after the header."""
        from llmtrace.run.explain import stream

        kept: list[dict] = []

        def emit(ev: dict) -> None:
            kept.append(ev)
            for sink in sinks:
                sink(ev)

        stream(events, command, n_tokens, emit, after_head=batch)
        return Trace(kept, tokenizer=self.tokenizer)

    def _batch_event(self, texts: list[str], options) -> Optional[dict]:
        """Several prompts: the s3 batch event (every row's padded ids and combined mask), which follows the header."""
        if len(texts) < 2:
            return None
        from llmtrace.run.explain import explain_batch_event

        prompts = [self.tokenizer.encode_prompt(t, chat=options.chat, system=options.system)[1] for t in texts]
        for r, p in enumerate(prompts):
            if not p:
                raise BadValue("prompt", f" {r + 1} of the batch is empty (it encodes to zero tokens); give some text")
        return explain_batch_event(self.tokenizer, prompts, options.row)


@dataclass
class GenerateRun:
    """A run of `generate`, prepared (Model.prepare_generate): the prompts encoded, the trace's scope and the samplers
    made, every value checked; nothing has run yet. `notes`: what a person should know of it, one line each."""

    model: Model
    options: GenerateOptions
    encoded: list[tuple[str, list[int]]]  # each prompt as the model reads it, and its ids
    trace: Any  # TraceOptions, its layers resolved against the model
    sampler: Any  # run.sampler.Sampler of row 0 (of the run, when it is one prompt)
    samplers: Optional[list[Any]]  # a batch's, one per row (row r: seed + r); None for one prompt
    notes: list[str]

    def run(self, *, sinks: Sequence[Sink] = (), on_text: Optional[Callable[[str], None]] = None,
            keep_events: bool = True) -> Trace:
        """Generate, telling `sinks` each event as it is made (see Model.generate_with)."""
        from llmtrace.console import prefill_progress
        from llmtrace.run.generate import generate, generate_batch
        from llmtrace.trace.recorder import Recorder

        lm, options = self.model.loaded, self.options
        events: list[dict] = []
        kept: Sink = _Kept(events, every=keep_events)
        run_info = self._run_info()
        compiled = None
        if options.compile:
            compiled = _compile_step(lm, len(self.encoded[0][1]), options.max_new_tokens, options.freeze)
            run_info["compiled"] = {"decode_step": True, "compile_s": round(compiled.compile_s, 3),
                                    "frozen": options.freeze}
        store = None
        if options.save_tensors:
            from llmtrace.trace.tensors import TensorStore

            store = TensorStore(Path(options.save_tensors))
        recorder = Recorder(self.trace, [*sinks, kept], run_info=run_info, tensors=store)
        common = dict(stop_texts=tuple(options.stop), ignore_eos=options.ignore_eos, observer=recorder,
                      on_prefill_progress=prefill_progress(), interventions=list(options.interventions))
        try:
            if self.samplers is not None:
                result = generate_batch(lm, [i for _, i in self.encoded], self.samplers, options.max_new_tokens,
                                        **common)
            else:
                result = generate(lm, self.encoded[0][1], self.sampler, options.max_new_tokens, on_text=on_text,
                                  compiled=compiled, **common)
        except Exception:
            recorder.abandon()  # the passes its worker finished reach the sinks, as they would have inline
            raise
        if store is not None:
            store.write()  # before the caller writes the trace document, which names it
        return Trace(events, tokenizer=lm.tokenizer, result=result, notes=self.notes)

    def _run_info(self) -> dict:
        """What the run event says of the run besides the model: the prompt(s), chat, threads, interventions."""
        import torch

        info = {"prompt": self.encoded[0][0], "chat": self.options.chat, "threads": torch.get_num_threads()}
        if self.options.interventions:
            from llmtrace.run.interventions import record

            info["interventions"] = [record(iv) for iv in self.options.interventions]
        if self.samplers is not None:
            info["prompts"] = [p for p, _ in self.encoded]
        return info


class _Kept:
    """The sink that keeps a run's events for its Trace: every event, or (every=False) the summary alone."""

    def __init__(self, events: list[dict], every: bool):
        self.events, self.every = events, every

    def __call__(self, event: dict) -> None:
        if self.every or event.get("event") == "summary":
            self.events.append(event)

    def many(self, events: list[dict]) -> None:  # a pass's tensor events (Recorder.emit_many): never a summary
        if self.every:
            self.events.extend(events)


def _layer_spec(layers) -> Optional[str]:
    """Layers as the index parser takes them: "0,3,-1", "2-5", "all" or None; a list of ints becomes "0,-1"."""
    if layers is None or isinstance(layers, str):
        return layers
    return ",".join(str(int(i)) for i in layers)


def _compile_step(lm, n_prompt: int, max_new_tokens: int, freeze: bool = False):
    """torch.compile the decode step before the run starts, saying so on stderr (it can take minutes)."""
    import os

    from llmtrace.registry.cache import cache_dir
    from llmtrace.run.generate import check_compilable, compile_decode

    # Inductor's compiled code is kept with llmtrace's other caches, so that later runs load it in seconds
    check_compilable(lm, freeze)  # before saying that it compiles
    where = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    # three lines, so that it reads at 80 columns: the cache's path alone can be long. Inductor keys its compiled code
    # by torch's thread count (its CPU kernels are split for that many threads), so each new count compiles afresh
    import torch

    from llmtrace.units import plural

    print(f"compiling the decode step with torch.compile (minutes the first time)…\n"
          f"  its cache: {where}\n"
          f"  kept per thread count ({plural(torch.get_num_threads(), 'thread')} here): another count compiles "
          f"anew", file=sys.stderr, flush=True)
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


def diff(trace_a: Union[str, Path], trace_b: Union[str, Path], **options) -> "Comparison":
    """Two saved runs of one prompt compared without a model (`llmtrace diff`): with their tensors
    (saved by generate's `save_tensors=`), compare's figures; else what the traces hold. Keywords: tolerance=, tensors=
    (run/diff.py)."""
    from llmtrace.run.diff import diff_traces

    return Comparison(diff_traces(str(trace_a), str(trace_b), **options))


class Comparison:
    """What `compare` or `diff` found (run.compare.CompareResult: `.first_divergence`, `.layers`, `.kld_mean`,
    `.to_json()`, `.save(path)`, ...) with the views a notebook needs: `.report(path)` and the page inline."""

    def __init__(self, result):
        self.result = result

    def __getattr__(self, name: str):
        return getattr(self.result, name)

    def html(self, lang: str = "en") -> str:
        from llmtrace.report.compare import render_compare_page

        return render_compare_page(self.result.to_json(), lang)

    def report(self, path: Union[str, Path], lang: str = "en") -> int:
        """The HTML comparison page to `path` (atomically), its words in `lang` (en, zh). Returns its size in bytes."""
        from llmtrace.report.compare import write_compare_page

        return write_compare_page(self.result, path, lang)

    def _repr_html_(self) -> str:
        import html

        return (f'<iframe sandbox="allow-scripts" style="width:100%;height:640px;border:1px solid #ddd" '
                f'srcdoc="{html.escape(self.html(), quote=True)}"></iframe>')

    def __repr__(self) -> str:
        return f"Comparison({self.result.summary_line()!r})"


# ----------------------------------------------------------------------------------------------------------------
# evaluating over a corpus


def evaluate(model, text: str, progress: bool = False, **options) -> "Evaluation":
    """Score `text` in chunks as llama.cpp's llama-perplexity does (`llmtrace eval`): PPL ± its uncertainty, and
    with side `b=` (a spec, a `Side` or a loaded `Model`) llama.cpp's KL-divergence statistics of B against A.
    `model`: a spec, a `Side` or a loaded `Model`. `progress=True`: show the run's progress on stderr, as the
    command does (a live bar on a terminal, a line at each tenth of the run elsewhere); quiet by default. Keywords:
    ctx=, chunks=, batch=, b=, base=, save_base=, base_top_k=, layers=, tolerance=, workers=, ray=, threads=,
    resume=, on_start=, on_chunk=, on_progress=, say= (run/eval.py)."""
    from llmtrace.run.eval import evaluate as run_eval

    if not isinstance(progress, bool):
        raise BadValue("progress", f" is True or False (a listener goes to `on_progress`), not {progress!r}")
    if isinstance(options.get("b"), Model):
        options["b"] = options["b"].loaded
    bar = None
    if progress:
        from llmtrace.render.eval import EvalBar

        bar = EvalBar()
        heard, said = options.get("on_progress"), options.get("say")
        options["on_progress"] = bar.update if heard is None else (lambda p: (bar.update(p), heard(p)))
        options["say"] = bar.say if said is None else (lambda m: (bar.say(m), said(m)))
    try:
        return Evaluation(run_eval(model.loaded if isinstance(model, Model) else model, text, **options))
    finally:
        if bar is not None:
            bar.close()


class Evaluation:
    """What `evaluate` found (run.eval.EvalResult: `.summary`, `.chunks`, `.header`, `.interrupted`, `.to_json()`,
    `.to_jsonl_events()`) with the views a notebook needs: `.report(path)` and the page inline."""

    def __init__(self, result):
        self.result = result

    def __getattr__(self, name: str):
        return getattr(self.result, name)

    def html(self) -> str:
        from llmtrace.report.eval import render_eval_page

        return render_eval_page(self.result.to_jsonl_events())

    def report(self, path: Union[str, Path]) -> int:
        """The HTML evaluation page to `path` (atomically). Returns its size in bytes."""
        from llmtrace.fsutil import write_text_atomic

        page = self.html()
        write_text_atomic(Path(path), page)
        return len(page.encode("utf-8"))

    def _repr_html_(self) -> str:
        import html

        return (f'<iframe sandbox="allow-scripts" style="width:100%;height:640px;border:1px solid #ddd" '
                f'srcdoc="{html.escape(self.html(), quote=True)}"></iframe>')

    def __repr__(self) -> str:
        s = self.result.summary
        ppl = s.get("ppl", {}).get("value")
        return f"Evaluation(chunks={s['chunks']}, ppl={ppl!r}, kld={s.get('kld', {}).get('mean')!r})"


def patch_sweep(model, clean: str, corrupt: str, answer: str, against: str, at: Optional[str] = None,
                **options) -> dict:
    """The activation-patching sweep (`llmtrace patch`): the corrupt prompt run once per layer and position with the
    clean prompt's activation at `at` patched in; returns the `patch` event (`cells`: layer, position, metric,
    recovery). `model`: a loaded `Model` (or LoadedModel). Keywords: on_progress= (run/patching.py)."""
    from llmtrace.run.patching import patch_sweep as sweep

    lm = model.loaded if isinstance(model, Model) else model
    return sweep(lm, clean, corrupt, answer, against, at=at, **options)
