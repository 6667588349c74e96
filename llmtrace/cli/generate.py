"""`llmtrace generate`: run the model on a prompt and show every step from text to tokens."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import (ChatOpt, DeviceMapOpt, DeviceOpt, DtypeOpt, FastOpt, FileOpt, KeepQuantizedOpt, MaxMemoryOpt,
                                  ModelOpt, OffloadDirOpt, PromptArg, SystemOpt, ThreadsOpt, HtmlOpt, check_outputs,
                                  load_options, say_fast_note,
                                  write_html)
from llmtrace.cli.batch_input import MaxBatchOpt, PromptsFileOpt, PromptsOpt, read_prompt_list
from llmtrace.cli.text_input import NEWLINE_NOTE, read_prompt
from llmtrace.errors import UsageError
from llmtrace.registry.models_toml import DEFAULT_MODEL

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
  s10  temperature, penalties, logit bias, bans (row marked * if they
       changed the most likely token)
  s11  top-k, top-p, min-p, typical-p: the survivors column
  s12  sample (greedy: argmax), then detokenize

Examples:

  llmtrace generate "Quantum mechanics is a fundamental theory in physics that" -n 16

  llmtrace generate "The capital of France is" --ban " Paris" -n 4

  llmtrace generate "Write a haiku about rain" --chat --temperature 0.8 --top-p 0.9 --seed 1

  llmtrace generate "The capital of France is" --trace full --layers 0,-1 --jsonl trace.jsonl

  llmtrace generate "Once upon a time" --trace none -n 100

  llmtrace generate "The capital of France is" -n 16 --trace full --layers 0,-1 --html report.html
  llmtrace generate "The capital of France is" -n 0        # prefill only: shapes and the predicted next tokens

  llmtrace generate "Once upon a time" --trace none -n 2000 --compile

  llmtrace generate "Once upon a time" -m model.Q4_K_M.gguf --keep-quantized

  llmtrace generate "Once upon a time" --fast --compile --trace none -n 200   # int4 kernels, bf16: approximate

  llmtrace generate "Once upon a time" -m ./Llama-3.1-8B --device-map auto --max-memory cpu=12GiB

  echo "Hello" | llmtrace generate --jsonl - | python -c "import sys, json; [json.loads(l) for l in sys.stdin]"

Several prompts as one batch (s3): each row is left-padded to the longest with the tokenizer's pad token (its EOS
when it has none), pad slots are masked, and each row's positions start at 0 at its first real token, so every row
generates what it would alone. Row r samples with seed + r (row 0 with --seed itself), so a row equals a run of its
prompt alone with --seed seed+r. Each row stops at its own EOS, --stop text or -n.

  llmtrace generate -p "The capital of France is" -p "Hi" -p "Once upon a time" -n 8

  llmtrace generate --prompts prompts.txt --chat --trace none      # one prompt per line, or JSONL {{"prompt": …}}
"""


@app.command(help=GENERATE_HELP, no_args_is_help=False)
def generate(
    prompt: PromptArg = None,
    model: ModelOpt = None,
    file: FileOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate. 0: prefill only (the prompt, the shape table and the top-k the model would predict next).")] = 32,
    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 means greedy (argmax).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Keep the smallest set with this much probability (1: off).")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p × the top probability (0: off).")] = 0.0,
    typical_p: Annotated[float, typer.Option("--typical-p", help="Locally typical sampling mass (1: off).")] = 1.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="HF-style penalty for seen tokens (1: off).")] = 1.0,
    frequency_penalty: Annotated[float, typer.Option("--frequency-penalty", help="Subtract this × count of each seen token.")] = 0.0,
    presence_penalty: Annotated[float, typer.Option("--presence-penalty", help="Subtract this from every seen token.")] = 0.0,
    logit_bias: Annotated[Optional[list[str]], typer.Option("--logit-bias", help="ID=BIAS added to a token's logit (repeatable).")] = None,
    ban: Annotated[Optional[list[str]], typer.Option("--ban", help="Never generate this text (repeatable).")] = None,
    sampler_order: Annotated[str, typer.Option("--sampler-order", help="Stage order: 'hf', 'llama.cpp' or a comma list.")] = "hf",
    seed: Annotated[Optional[int], typer.Option(help="Random seed (default: random, and printed). Row r of a batch uses seed + r.")] = None,
    chat: ChatOpt = False,
    system: SystemOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past the end-of-sequence token.")] = False,
    trace: Annotated[str, typer.Option("--trace", help="Depth: none, steps, layers or full.")] = "steps",
    layers: Annotated[Optional[str], typer.Option("--layers", help="Layers to record, e.g. 0,3,-1 or 2-5 (default: all).")] = None,
    dump: Annotated[Optional[list[str]], typer.Option("--dump", help="Record the values of a point, e.g. logits or 3.probs (repeatable).")] = None,
    topk: Annotated[int, typer.Option("--show-top", help="Candidates recorded per step.")] = 10,
    jsonl: Annotated[Optional[str], typer.Option("--jsonl", help="Stream events, one JSON object per line, to FILE (- for "
                                                 "stdout) as they happen: `tail -f FILE` follows the run. An existing "
                                                 "FILE is replaced (emptied) when the run starts. A killed run leaves "
                                                 "the lines written so far; after Ctrl-C the last line is the summary.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the whole trace as one JSON document to FILE (- for "
                                                    "stdout), at the end and all at once: an existing FILE is kept "
                                                    "until the new document is complete.")] = None,
    html: HtmlOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    keep_quantized: KeepQuantizedOpt = False,
    fast: FastOpt = False,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadDirOpt = None,
    threads: ThreadsOpt = None,
    prompt_list: PromptsOpt = None,
    prompts_file: PromptsFileOpt = None,
    max_batch: MaxBatchOpt = 64,
    compile_: Annotated[bool, typer.Option("--compile", help="Compile the decode step with torch.compile: faster steps "
                                           "after a compile of minutes the first time (seconds once cached). Only "
                                           "steps nothing observes use it: not with --trace layers/full or --dump.")] = False,
) -> None:
    from llmtrace.run.sampler import SamplerConfig, parse_logit_bias, parse_order
    from llmtrace.trace.indices import parse_index_ranges
    from llmtrace.trace.options import TraceOptions

    # Everything the user typed is checked before the (slow) model load.
    if max_new_tokens < 0:
        raise UsageError("--max-new-tokens must be ≥ 0")
    if topk < 1:
        raise UsageError("--show-top must be ≥ 1")
    check_outputs(json_out, jsonl, html)
    options = TraceOptions(level=trace, dump=tuple(dump or ()), topk=topk)
    scfg = SamplerConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                         repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                         presence_penalty=presence_penalty, order=parse_order(sampler_order), seed=seed)
    scfg.validate(vocab_size=sys.maxsize)  # ranges now; ids against the real vocabulary after the load
    parse_logit_bias(logit_bias or [], sys.maxsize)  # the same for the syntax of --logit-bias and --layers
    if layers is not None and layers.strip() not in ("", "all"):
        parse_index_ranges(layers, "layers", "layer")
    texts = read_prompt_list(prompt_list, prompts_file, max_batch)
    if texts is not None and (prompt is not None or file is not None):
        raise UsageError("give the prompt as an argument or --file, or prompts with -p/--prompts, not both")
    if texts is not None and len(texts) > 1 and compile_:
        raise UsageError("--compile runs one prompt; leave it out for a batch of several prompts")
    text = read_prompt(prompt, file) if texts is None else texts[0]
    if system is not None and not chat:
        raise UsageError("--system only applies with --chat")
    if compile_ and (trace in ("layers", "full") or dump or html):
        raise UsageError("--compile speeds up decode steps that nothing observes; with --trace layers/full, --dump or "
                         "--html (which records attention) every step is observed and runs eagerly, so leave --compile out")

    from llmtrace.trace.events import NOT_STARTED, summary_event
    from llmtrace.fsutil import sigint_deferred
    from llmtrace.trace.sinks import JsonlSink

    scale = load_options(model, keep_quantized, device_map, max_memory, offload_dir, fast)  # checked before the stream starts
    # The stream exists from here on (its file is created by its first event), so that a Ctrl-C during the load
    # (or a compile) still ends it with a summary.
    jsonl_sink = JsonlSink(jsonl) if jsonl else None
    try:
        from llmtrace.checkpoint.load import load_model
        from llmtrace.checkpoint.devices import pick_device, pick_dtype, set_threads

        pick_dtype(dtype, pick_device(device))  # --device cuda without CUDA fails before a download or a load

        set_threads(threads)
        lm = load_model(model, device=device, dtype=dtype, **scale)
        say_fast_note(lm)
        batch = texts if texts is not None and len(texts) > 1 else None  # a single -p is a one-prompt run
        run(lm, batch or text, scfg, options, max_new_tokens=max_new_tokens, chat=chat, system=system,
            stop=tuple(stop or ()), ignore_eos=ignore_eos, layers=layers, logit_bias=logit_bias or [], ban=ban or [],
            jsonl_sink=jsonl_sink, json_out=json_out, compile_decode=compile_, html=html)
    except KeyboardInterrupt:
        if jsonl_sink is not None and not jsonl_sink.started:  # stopped before the run began: 0 tokens, interrupted
            with sigint_deferred():
                jsonl_sink(summary_event(NOT_STARTED))
        raise
    finally:
        if jsonl_sink is not None:
            jsonl_sink.close()


def run(lm, text, scfg, options, *, max_new_tokens, chat, system, stop, ignore_eos, layers, logit_bias, ban, jsonl_sink,
        json_out, compile_decode=False, html=None) -> None:
    """Everything after the load: encode, generate with the chosen observers, write the outputs. `text` is one
    prompt, or a list of several run as one batch. `jsonl_sink` (a `sinks.JsonlSink` or None) is opened and closed
    by the caller."""
    from llmtrace.run.generate import generate as run_generation
    from llmtrace.render.generate import TerminalRenderer
    from llmtrace.console import make_console
    from llmtrace.run.sampler import Sampler, banned_sequences, parse_logit_bias
    from llmtrace.trace.indices import parse_layers
    from llmtrace.trace.sinks import JsonDocSink
    from llmtrace.trace.recorder import Recorder

    tok = lm.tokenizer
    batch = isinstance(text, list)  # several prompts: one batch
    options.layers = parse_layers(layers, lm.config.n_layers)
    options.check_dump_layers(lm.config.n_layers)
    if html:  # the report's attention maps need the probabilities of the recorded layers
        from llmtrace.report.write import report_dumps

        options.dump = tuple(dict.fromkeys(options.dump + report_dumps(options.layers, lm.config.n_layers)))
    scfg.logit_bias = parse_logit_bias(logit_bias, lm.config.vocab_size)
    scfg.ban = banned_sequences(tok, ban)
    scfg.validate(lm.config.vocab_size)
    encoded = [tok.encode_prompt(t, chat=chat, system=system) for t in (text if batch else [text])]
    for r, (prompt_text, _) in enumerate(encoded):
        dropped = tok.dropped_note(prompt_text, f"prompt {r + 1}" if batch else "prompt")
        if dropped:
            print(f"note: {dropped}", file=sys.stderr)
    prompt_text, ids = encoded[0]
    sampler = Sampler(scfg, lm.config.vocab_size, k_show=options.topk)
    if batch:
        from dataclasses import replace

        from llmtrace.run.generate import check_batch_context, row_seed

        check_batch_context(lm, [i for _, i in encoded], max_new_tokens)  # before any output
        samplers = [Sampler(replace(scfg, seed=row_seed(sampler.seed, r)), lm.config.vocab_size, k_show=options.topk)
                    for r in range(len(encoded))]

    machine_on_stdout = json_out == "-" or (jsonl_sink is not None and jsonl_sink.target == "-")
    view_console = None
    if not machine_on_stdout:
        view_console = make_console()
    elif sys.stderr.isatty():
        view_console = make_console(stderr=True)
    sinks = []
    doc_sink = JsonDocSink(json_out) if json_out else None
    if jsonl_sink:
        sinks.append(jsonl_sink)
    if doc_sink:
        sinks.append(doc_sink)
    recorded: list[dict] = []
    if html:
        sinks.append(recorded.append)
    stream_text = options.level == "none" and not batch  # a batch's texts are printed at the end, row by row
    if view_console is not None:
        sinks.append(TerminalRenderer(view_console, show_steps=options.level != "none", stream_text=stream_text))
    import torch

    run_info = {"prompt": prompt_text, "chat": chat, "threads": torch.get_num_threads()}
    if batch:
        run_info["prompts"] = [p for p, _ in encoded]
    compiled = None
    if compile_decode:
        compiled = compile_step(lm, len(ids), max_new_tokens)
        run_info["compiled"] = {"decode_step": True, "compile_s": round(compiled.compile_s, 3)}
    recorder = Recorder(options, sinks, run_info=run_info)

    on_text = None
    if stream_text and view_console is not None:
        def on_text(piece: str) -> None:
            view_console.file.write(piece)
            view_console.file.flush()

    if batch:
        from llmtrace.run.generate import generate_batch

        result = generate_batch(lm, [i for _, i in encoded], samplers, max_new_tokens, stop_texts=stop,
                                ignore_eos=ignore_eos, observer=recorder, on_prefill_progress=prefill_progress())
    else:
        result = run_generation(lm, ids, sampler, max_new_tokens, stop_texts=stop, ignore_eos=ignore_eos,
                                observer=recorder, on_text=on_text, compiled=compiled,
                                on_prefill_progress=prefill_progress())
    if doc_sink is not None:
        doc_sink.write()  # complete (and marked interrupted if it was), or not written at all
    if html:
        write_html(recorded, html, tok)
    if result.interrupted:
        raise typer.Exit(130)


def prefill_progress(after_s: float = 2.0):
    """A progress callback for a chunked prefill: on stderr once the prefill looks like taking more than `after_s`."""
    import time

    t0 = time.perf_counter()
    shown = [False]

    def show(done: int, total: int) -> None:
        elapsed = time.perf_counter() - t0
        if not shown[0] and elapsed * total / done < after_s:
            return
        shown[0] = True
        tty = sys.stderr.isatty()  # a terminal gets one line rewritten in place, a file one line per pass
        print(f"{chr(13) if tty else ''}prefill: {done:,}/{total:,} prompt tokens ({100 * done // total}%), "
              f"{elapsed:.1f} s", end="\n" if done == total or not tty else "", file=sys.stderr, flush=True)

    return show


def compile_step(lm, n_prompt: int, max_new_tokens: int):
    """torch.compile the decode step before the run starts, saying so on stderr (it can take minutes)."""
    import os

    from llmtrace.run.generate import compile_decode
    from llmtrace.registry.cache import cache_dir

    # Inductor's compiled code is kept with llmtrace's other caches, so that later runs load it in seconds
    where = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    print(f"compiling the decode step with torch.compile (cache: {where}; minutes the first time on a small CPU)…",
          file=sys.stderr, flush=True)
    compiled = compile_decode(lm, n_prompt, max_new_tokens)
    print(f"compiled in {compiled.compile_s:.1f} s", file=sys.stderr, flush=True)
    return compiled
