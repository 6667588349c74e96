"""`llmtrace generate`: run the model on a prompt and show every step from text to tokens."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.batch_input import PromptFlags
from llmtrace.cli.options import (ChatOpt, FlagGroup, HtmlOpt, InterventionFlags, INTERVENTIONS_HELP, JsonlOpt,
                                  JsonOpt, ForceOpt, LangOpt, LoadFlags, PanelCommand, SystemOpt, flag_groups,
                                  load_for_cli, write_html)
from llmtrace.cli.outputs import check_outputs, control_vector_files
from llmtrace.cli.text_input import NEWLINE_NOTE
from llmtrace import sigint
from llmtrace.errors import UsageError
from llmtrace.trace.events import Level
from llmtrace.registry.models_toml import DEFAULT_MODEL

SAMPLING = "Sampling (s10–s12)"

GENERATE_HELP = f"""Generate text and trace every step: tokens, shapes, top-k, sampler stages, KV cache.

The default model ({DEFAULT_MODEL}) is fetched on first use. Greedy decoding is the default (--temperature 0).
The prompt is the argument, else --file, else stdin. {NEWLINE_NOTE}

CPU threads: --threads, else $LLMTRACE_THREADS, else one per physical core; the run header shows the count.

The steps of the view (s1–s12, the seed table), one line each:

\b
  s1   tokenize: the text split into pieces
  s2   ids: each piece's vocabulary id
  s3   padding and attention mask (several prompts: -p … -p …)
  s4   embedding: ids → X [T, D]
  s5   position: RoPE, applied to q and k inside attention (s6.3)
  s6   each layer: norm, Q/K/V, RoPE, scores, softmax, ·V, FFN, KV cache
  s7   the last position: the row that predicts the next token
  s8   final RMSNorm (LLaMA normalizes every position, then takes the last)
  s9   LM head: one logit per vocabulary entry
  s10  temperature, penalties, logit bias, bans, DRY (row marked * if
       they changed the most likely token)
  s11  top-k, top-p, min-p, typical-p, top-nσ, XTC, mirostat: the survivors
       column; DRY, top-nσ, XTC and mirostat say on a line of their own
       what they did and why
  s12  sample (greedy: argmax), then detokenize

Examples:

  llmtrace generate "Quantum mechanics is a fundamental theory in physics that" -n 16

  llmtrace generate "The capital of France is" --ban " Paris" -n 4

  llmtrace generate "Write a haiku about rain" --chat --temperature 0.8 --top-p 0.9 --seed 1

  llmtrace generate "Once upon a time" --temperature 1 --mirostat 2 --seed 1

  llmtrace generate "The cat sat on the mat. The cat sat on the" --temperature 1 --dry-multiplier 0.8 --top-n-sigma 2 --xtc-probability 0.5 --sampler-order llama.cpp

  llmtrace generate "The capital of France is" --trace full --layers 0,-1 --jsonl trace.jsonl

  llmtrace generate "Once upon a time" --trace none -n 100

  llmtrace generate "The capital of France is" -n 16 --trace full --layers 0,-1 --html report.html

  llmtrace generate "The capital of France is" -n 0        # prefill only: shapes and the predicted next tokens

  llmtrace generate "Once upon a time" --trace none -n 2000 --compile

  llmtrace generate "Once upon a time" -m model.Q4_K_M.gguf --keep-quantized

  llmtrace generate "Once upon a time" --fast --compile --trace none -n 200   # int4 kernels, bf16: approximate

  llmtrace generate "Once upon a time" --fast --compile --freeze --trace none -n 5000   # steps 8-23% faster

  llmtrace generate "Once upon a time" -m ./Llama-3.1-8B --device-map auto --max-memory cpu=12GiB

  echo "Hello" | llmtrace generate --jsonl - | python -c "import sys, json; [json.loads(l) for l in sys.stdin]"

Several prompts as one batch (s3): each row is left-padded to the longest with the tokenizer's pad token (its EOS
when it has none), pad slots are masked, and each row's positions start at 0 at its first real token, so every row
generates what it would alone. Row r samples with seed + r (row 0 with --seed itself), so a row equals a run of its
prompt alone with --seed seed+r. Each row stops at its own EOS, --stop text or -n.

  llmtrace generate -p "The capital of France is" -p "Hi" -p "Once upon a time" -n 8

  llmtrace generate --prompts prompts.txt --chat --trace none      # one prompt per line, or JSONL {{"prompt": …}}

""" + INTERVENTIONS_HELP


@dataclass
class SamplerFlags(FlagGroup):
    """The sampler's flags (s10-s12): the fields of run.sampler.SamplerConfig, which checks them, with the CLI's
    spellings (--sampler-order; --dry-sequence-breaker, repeatable; --logit-bias ID=BIAS; --ban, texts)."""

    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 means greedy (argmax).", rich_help_panel=SAMPLING)] = 0.0
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).", rich_help_panel=SAMPLING)] = 0
    top_p: Annotated[float, typer.Option("--top-p", help="Keep the smallest set with this much probability (1: off).", rich_help_panel=SAMPLING)] = 1.0
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p × the top probability (0: off).", rich_help_panel=SAMPLING)] = 0.0
    typical_p: Annotated[float, typer.Option("--typical-p", help="Locally typical sampling mass (1: off).", rich_help_panel=SAMPLING)] = 1.0
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="HF-style penalty for seen tokens (1: off).", rich_help_panel=SAMPLING)] = 1.0
    frequency_penalty: Annotated[float, typer.Option("--frequency-penalty", help="Subtract this × count of each seen token.", rich_help_panel=SAMPLING)] = 0.0
    presence_penalty: Annotated[float, typer.Option("--presence-penalty", help="Subtract this from every seen token.", rich_help_panel=SAMPLING)] = 0.0
    logit_bias: Annotated[Optional[list[str]], typer.Option("--logit-bias", help="ID=BIAS added to a token's logit (repeatable).", rich_help_panel=SAMPLING)] = None
    ban: Annotated[Optional[list[str]], typer.Option("--ban", help="Never generate this text (repeatable).", rich_help_panel=SAMPLING)] = None
    sampler_order: Annotated[str, typer.Option("--sampler-order", help="Stage order: 'hf', 'llama.cpp' (its default chain: penalties, dry, top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature) or a comma list.", rich_help_panel=SAMPLING)] = "hf"
    top_n_sigma: Annotated[float, typer.Option("--top-n-sigma", help="Keep tokens with logit ≥ max − N·σ of the logits; the same set at any temperature (0: off).", rich_help_panel=SAMPLING)] = 0.0
    xtc_probability: Annotated[float, typer.Option("--xtc-probability", help="XTC: at each step, with this chance, remove every token with p ≥ --xtc-threshold except the least likely of them (0: off).", rich_help_panel=SAMPLING)] = 0.0
    xtc_threshold: Annotated[float, typer.Option("--xtc-threshold", help="XTC's threshold probability (above 0.5 XTC never acts).", rich_help_panel=SAMPLING)] = 0.1
    dry_multiplier: Annotated[float, typer.Option("--dry-multiplier", help="DRY: a token that would extend a repeat of n ≥ --dry-allowed-length tokens loses M × base^(n − allowed) from its logit (0: off).", rich_help_panel=SAMPLING)] = 0.0
    dry_base: Annotated[float, typer.Option("--dry-base", help="DRY's base (≥ 1).", rich_help_panel=SAMPLING)] = 1.75
    dry_allowed_length: Annotated[int, typer.Option("--dry-allowed-length", help="DRY: repeats this long go unpenalised.", rich_help_panel=SAMPLING)] = 2
    dry_penalty_last_n: Annotated[int, typer.Option("--dry-penalty-last-n", help="DRY scans this many last tokens (prompt included); -1: all, 0: off.", rich_help_panel=SAMPLING)] = 64
    dry_sequence_breaker: Annotated[Optional[list[str]], typer.Option("--dry-sequence-breaker", help="Text that ends a repeat for DRY (repeatable; \\n and \\t are escapes; 'none': no breakers). Default: llama.cpp's \\n : \" *", rich_help_panel=SAMPLING, show_default=False)] = None
    mirostat: Annotated[int, typer.Option("--mirostat", help="Mirostat 1 or 2 (0: off): aims at --mirostat-tau bits of surprise per token; replaces penalties, DRY and truncation, as in llama.cpp.", rich_help_panel=SAMPLING)] = 0
    mirostat_tau: Annotated[float, typer.Option("--mirostat-tau", help="Mirostat's target surprise τ in bits (μ starts at 2τ).", rich_help_panel=SAMPLING)] = 5.0
    mirostat_eta: Annotated[float, typer.Option("--mirostat-eta", help="Mirostat's learning rate η.", rich_help_panel=SAMPLING)] = 0.1
    seed: Annotated[Optional[int], typer.Option(help="Random seed (default: random, and printed). Row r of a batch uses seed + r.", rich_help_panel=SAMPLING)] = None

    def keywords(self) -> dict:
        """The flags as `generate`'s keywords (api.GenerateOptions.of)."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        breakers = given.pop("dry_sequence_breaker")
        given["dry_sequence_breakers"] = None if breakers is None else breaker_texts(breakers)
        given["logit_bias"] = given["logit_bias"] or []
        given["ban"] = tuple(given["ban"] or ())
        return given


@app.command(help=GENERATE_HELP, no_args_is_help=False, cls=PanelCommand)
@flag_groups
def generate(
    prompts: PromptFlags,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate. 0: prefill only (the prompt, the shape table and the top-k the model would predict next).")] = 32,
    sampling: SamplerFlags = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past the end-of-sequence token.")] = False,
    trace: Annotated[str, typer.Option("--trace", help="Depth: none, steps, layers or full.")] = "steps",
    layers: Annotated[Optional[str], typer.Option("--layers", help="Layers to record, e.g. 0,3,-1 or 2-5 (default: all).")] = None,
    dump: Annotated[Optional[list[str]], typer.Option("--dump", help="Record the values of a point, e.g. logits or 3.probs (repeatable).")] = None,
    show_top: Annotated[int, typer.Option("--show-top", help="Candidates recorded per step.")] = 10,
    jsonl: JsonlOpt = None,
    json_out: JsonOpt = None,
    html: HtmlOpt = None,
    lang: LangOpt = "en",
    load: LoadFlags = None,
    save_tensors: Annotated[Optional[str], typer.Option("--save-tensors", metavar="FILE.safetensors", help="Also store the full "
                            "values of the points the trace records (--trace, --layers choose them) in FILE, tied to "
                            "this trace by a key in its run event: `llmtrace diff` compares two such runs point by "
                            "point.", show_default=False)] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="Compile the decode step with torch.compile: faster steps "
                                           "after a compile of minutes the first time at each thread count "
                                           "(seconds once cached). Only "
                                           "steps nothing observes use it: not with --trace layers/full or --dump.")] = False,
    freeze: Annotated[bool, typer.Option("--freeze", help="With --fast --compile on the CPU: compile the weights into "
                                         "the decode step as constants (Inductor's freezing). Each step 8-23% faster "
                                         "(measured on two CPUs), but the compile takes 11-14 s longer every run (it "
                                         "is not cached), so it pays off only after ~5,000-17,000 tokens.")] = False,
    interventions: InterventionFlags = None,
    force: ForceOpt = False,
) -> None:
    from llmtrace.api import GenerateOptions

    # Everything the user typed is checked before torch is imported and the (slow) model load.
    options = GenerateOptions.of(
        max_new_tokens=max_new_tokens, **sampling.keywords(), chat=chat, system=system, stop=tuple(stop or ()),
        ignore_eos=ignore_eos, trace=trace, layers=layers, dump=tuple(dump or ()), show_top=show_top,
        for_report=html is not None, compile=compile_, freeze=freeze, save_tensors=save_tensors,
        interventions=interventions.parse())
    check_outputs({"--json": json_out, "--jsonl": jsonl, "--html": html, "--save-tensors": save_tensors},
                  prompts.inputs() | {"the model (-m)": load.model,
                                      "a control vector (--control-vector)": control_vector_files(options.interventions)},
                  force=force)
    if save_tensors is not None and json_out is None and jsonl in (None, "-"):
        raise UsageError("--save-tensors stores tensors beside a trace file; give --json FILE or --jsonl FILE too")
    texts = prompts.read()
    options.check_prompts(texts)
    load_options = load.options()
    for note in sampler_notes(options.sampler, bool(sampling.logit_bias or sampling.ban)):
        print(f"note: {note}", file=sys.stderr)

    from llmtrace.fsutil import sigint_deferred
    from llmtrace.trace.events import NOT_STARTED, summary_event
    from llmtrace.trace.writers import JsonlWriter

    # The stream exists from here on (its file is created by its first event), so that a Ctrl-C during the load
    # (or a compile) still ends a stream on stdout with a summary; a file is replaced only once the run has begun.
    jsonl_sink = JsonlWriter(jsonl) if jsonl else None
    try:
        import llmtrace.api  # noqa: F401  (imported while Ctrl-C is held, as all before: llmtrace/sigint.py)
        import llmtrace.checkpoint.load  # noqa: F401
        import llmtrace.render.generate  # noqa: F401
        import llmtrace.run.generate  # noqa: F401

        sigint.release()  # the stream can end with a summary now: a Ctrl-C held since the first line is raised here
        model_ = load_for_cli(load_options)
        run(model_, texts, options, jsonl_sink=jsonl_sink, json_out=json_out, html=html, lang=lang)
    except KeyboardInterrupt:
        if jsonl_sink is not None and not jsonl_sink.started and jsonl_sink.target == "-":
            # stopped before the run began: a pipe still gets its last line (0 tokens, interrupted); a user's file
            # stays as it was, as --json's does
            with sigint_deferred():
                jsonl_sink(summary_event(NOT_STARTED))
        raise
    finally:
        if jsonl_sink is not None:
            jsonl_sink.close()


def run(model, prompts, options, *, jsonl_sink, json_out, html=None, lang: str = "en") -> None:
    """Everything after the load: the API's generate with the CLI's sinks (the stream, the document, the view), then
    the outputs. `jsonl_sink` (a `writers.JsonlWriter` or None) is opened and closed by the caller."""
    from llmtrace.console import make_console
    from llmtrace.render.generate import TerminalRenderer
    from llmtrace.trace.writers import JsonDocWriter

    batch = isinstance(prompts, list) and len(prompts) > 1
    machine_on_stdout = json_out == "-" or (jsonl_sink is not None and jsonl_sink.target == "-")
    view_console = None
    if not machine_on_stdout:
        view_console = make_console()
    elif sys.stderr.isatty():
        view_console = make_console(stderr=True)
    sinks = []
    doc_sink = JsonDocWriter(json_out) if json_out else None
    if jsonl_sink:
        sinks.append(jsonl_sink)
    if doc_sink:
        sinks.append(doc_sink)
    stream_text = not Level.of(options.trace).records and not batch  # a batch's texts are printed at the end, row by row
    if view_console is not None:
        sinks.append(TerminalRenderer(view_console, show_steps=Level.of(options.trace).records, stream_text=stream_text))

    on_text = None
    if stream_text and view_console is not None:
        def on_text(piece: str) -> None:
            view_console.file.write(piece)
            view_console.file.flush()

    prepared = model.prepare_generate(prompts, options)
    from llmtrace.words import say

    for note in prepared.notes:
        say(note)
    trace = prepared.run(sinks=sinks, on_text=on_text, keep_events=html is not None)
    if doc_sink is not None:
        doc_sink.write()  # complete (and marked interrupted if it was), or not written at all
    if html:
        write_html(trace.events, html, model.tokenizer, lang=lang)
    if trace.interrupted:
        raise typer.Exit(130)


def breaker_texts(values: list[str]) -> list[str]:
    """--dry-sequence-breaker values as texts: \\n, \\t, \\r, \\" and \\\\ are escapes (a shell passes them
    literally); the single value 'none' means no breakers."""
    import re

    if values == ["none"]:
        return []
    escapes = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}
    return [re.sub(r'\\([ntr"\\])', lambda m: escapes[m.group(1)], v) for v in values]


def sampler_notes(scfg, bias_or_ban: bool = False) -> list[str]:
    """What the sampler settings leave unused, in words naming the flags: one line each (printed as `note:`)."""
    from llmtrace.cli.options import flag_of

    notes = []
    ignored = scfg.ignored_by_mirostat()
    if ignored:
        flags = ", ".join(flag_of(f) for f in ignored)
        kept = "--logit-bias, --ban and --temperature apply" if bias_or_ban else "--temperature applies"
        notes.append(f"--mirostat {scfg.mirostat} replaces the sampler chain, as in llama.cpp: {flags} "
                     f"{'is' if len(ignored) == 1 else 'are'} ignored (only {kept} before it)")
    greedy = scfg.ignored_by_greedy()
    if greedy:
        flags = ", ".join(flag_of(f) for f in greedy)
        notes.append(f"--temperature 0 is greedy (the argmax), so {flags} {'does' if len(greedy) == 1 else 'do'} "
                     f"nothing; give --temperature (llama.cpp's default is 0.8)")
    return notes
