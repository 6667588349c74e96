"""Commands: tokenize (text → tokens, with bytes, spans and BPE merges) and detokenize (ids → text).

Both are thin: they read the input, call `TextTokenizer` / `llmtrace.tokens.bpe`, and render the result as a rich table
(stdout), or as plain JSON / JSONL / ids for scripts. Notes and warnings go to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.options import ForceOpt, JsonOpt, ModelOpt, json_opt, jsonl_opt, write_output
from llmtrace.cli.outputs import check_outputs
from llmtrace.cli.text_input import NEWLINE_NOTE, read_file, read_stdin, read_text
from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.render.generate import columns_left_out
from llmtrace.render.tokenize import (ID_COLUMNS, fitted_table, highlight_specials, merge_lines, quoted, summary_line,
                                      token_table)
from llmtrace.tokens.token_facts import bos_eos_summary
from llmtrace.tokens.tokenizer import TextTokenizer
from llmtrace.tokens.chat_template import check_messages

# ---------------------------------------------------------------------------------------------------------------------
# loading and input
# ---------------------------------------------------------------------------------------------------------------------


def load_tokenizer(spec: str | None) -> TextTokenizer:
    """The tokenizer for `-m` (a registry name, hub id, .gguf file or HF directory), without torch when it can."""
    from llmtrace.checkpoint.tokenizer_only import load_tokenizer as load

    return load(spec)


def _read_messages(path: str) -> list[dict]:
    raw = read_file(path, "messages")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LlmtraceError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    return [dict(m) for m in check_messages(data, where=path)]


def _console(err: bool = False):
    from llmtrace.console import make_console  # the one console factory: terminal width, else $COLUMNS, else 100

    return make_console(stderr=err)


def _note(message: str) -> None:
    from llmtrace.words import say

    say(message)


def _check_one_format(**flags: bool) -> None:
    chosen = [f"--{name}" for name, on in flags.items() if on]
    if len(chosen) > 1:
        raise UsageError(f"choose one output format, not {' and '.join(chosen)}")


# ---------------------------------------------------------------------------------------------------------------------
# tokenize
# ---------------------------------------------------------------------------------------------------------------------

_TOKENIZE_EPILOG = f"""\b
Examples:
  llmtrace tokenize "Hello world"
  llmtrace tokenize "你好 😀" --merges
  llmtrace tokenize "<|im_start|>user" --no-special
  llmtrace tokenize "What is 2+2?" --chat --system "Be brief."
  llmtrace tokenize --messages chat.json --json -
  llmtrace tokenize --file notes.txt --ids
  echo "piped text" | llmtrace tokenize --jsonl -
  llmtrace tokenize "Hello world" --merges --json tokens.json

{NEWLINE_NOTE}
"""


@app.command(epilog=_TOKENIZE_EPILOG)
def tokenize(
    text: Annotated[Optional[str], typer.Argument(metavar="[TEXT]", help="Text to tokenize (or use --file, or pipe it on stdin).", show_default=False)] = None,
    model: ModelOpt = None,
    file: Annotated[Optional[str], typer.Option("--file", "-f", metavar="PATH", help="Read the text from this UTF-8 file ('-' for stdin).", show_default=False)] = None,
    special: Annotated[bool, typer.Option("--special/--no-special", help="Parse special-token text such as <|im_start|> as one control token (--no-special: as plain characters).")] = True,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap TEXT in the model's chat template as a user message first.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", help="System message for --chat.", show_default=False)] = None,
    role: Annotated[Optional[str], typer.Option("--role", metavar="ROLE", help="Role of TEXT in the chat (default: user). Implies --chat.", show_default=False)] = None,
    messages: Annotated[Optional[str], typer.Option("--messages", metavar="FILE", help='JSON file with a list of {"role", "content"} messages (multi-turn). Implies --chat; TEXT, if given, is appended.', show_default=False)] = None,
    generation_prompt: Annotated[bool, typer.Option("--generation-prompt/--no-generation-prompt", help="With --chat: end with the assistant's turn header.")] = True,
    merges: Annotated[bool, typer.Option("--merges", help="Show the BPE merges that build each word's tokens.")] = False,
    words: Annotated[int, typer.Option("--words", metavar="N", help="With --merges: how many words to show.", min=1)] = 20,
    ids: Annotated[bool, typer.Option("--ids", help="Print only the ids, space-separated.")] = False,
    as_json: json_opt("one JSON document", "") = None,
    as_jsonl: jsonl_opt("one JSON object per token (and per merged word with --merges)", "") = None,
    force: ForceOpt = False,
) -> None:
    """Split text into tokens and show each one: id, piece, text, UTF-8 bytes, character span, special or not.

    Tokens that hold only part of a character (CJK, emoji) say which bytes they carry, e.g. "e4 bd (1-2/3 of 你)".
    """
    _check_one_format(ids=ids, json=as_json == "-", jsonl=as_jsonl == "-")
    check_outputs({"--json": as_json, "--jsonl": as_jsonl},
                  {"the text file (--file)": file, "the --messages file": messages, "the model (-m)": model}, force=force)
    chat = chat or system is not None or role is not None or messages is not None
    source = read_text(text, file, "text", stdin=messages is None)

    conversation = None
    if chat:
        conversation = []
        if system is not None:
            conversation.append({"role": "system", "content": system})
        if messages is not None:
            conversation += _read_messages(messages)
        if source is not None:
            conversation.append({"role": role or "user", "content": source})
        if not conversation:
            raise UsageError("--chat needs a message: give TEXT, --file, --messages or pipe text on stdin")
    elif source is None:
        raise UsageError("nothing to tokenize: give TEXT, --file PATH, or pipe text on stdin")

    tt = load_tokenizer(model)
    for n in tt.notes:
        _note(n)
    if conversation is not None:
        prompt = tt.render_chat(conversation, add_generation_prompt=generation_prompt)
        add_special = False
    else:
        prompt, add_special = source, True
    tokens = tt.encode_detailed(prompt, add_special_tokens=add_special, parse_special=special)
    bos_eos = bos_eos_summary(tt, tokens, add_special, conversation is not None)
    dropped = tt.dropped_note(prompt)
    if dropped:
        _note(dropped)

    traces, total_words = None, None
    if merges:
        from llmtrace.tokens.bpe import trace_merges

        all_traces = trace_merges(tt, prompt, parse_special=special)
        total_words = len(all_traces)
        traces = all_traces[:words]

    if as_json or as_jsonl:
        head = {
            "model": _model_name(model),
            "text": prompt,
            "chat": None if conversation is None else {"messages": conversation, "add_generation_prompt": generation_prompt},
            "parse_special": special,
            "add_special_tokens": add_special,
            "count": len(tokens),
            "chars": len(prompt),
            "bytes": len(prompt.encode("utf-8")),
            "chars_per_token": round(len(prompt) / len(tokens), 4) if tokens else None,
            **bos_eos,
        }
        if as_json:
            doc = {**head, "tokens": [t.to_dict() for t in tokens]}
            if traces is not None:
                doc["merges"] = {"words_total": total_words, "words": [w.to_dict() for w in traces]}
            write_output(as_json, json.dumps(doc, ensure_ascii=False) + "\n")
        if as_jsonl:
            lines = [json.dumps({"kind": "token", **t.to_dict()}, ensure_ascii=False) for t in tokens]
            lines += [json.dumps({"kind": "word", **w.to_dict()}, ensure_ascii=False) for w in traces or ()]
            write_output(as_jsonl, "".join(line + "\n" for line in lines))
    if ids:
        print(" ".join(str(t.id) for t in tokens))
        return
    if "-" in (as_json, as_jsonl) and not sys.stderr.isatty():
        return

    con = _console(err="-" in (as_json, as_jsonl))
    if conversation is not None:
        from rich.panel import Panel

        con.print(Panel(highlight_specials(tt, prompt), title="chat template output", title_align="left", expand=False))
    _print_tokens(con, tokens)
    con.print(summary_line(tt, prompt, tokens, bos_eos))
    if traces is not None:
        con.print()
        con.print(merge_lines(tt, traces, total_words))


def _print_tokens(con, tokens) -> None:
    """The token table that fits the console, the columns it left out named above it."""
    table, left_out = token_table(tokens, con.width)
    if left_out:  # before the table, so that it reads as what the table below lacks
        con.print(columns_left_out(con, left_out))
    con.print(table)


# ---------------------------------------------------------------------------------------------------------------------
# detokenize
# ---------------------------------------------------------------------------------------------------------------------

_DETOKENIZE_EPILOG = """\b
Examples:
  llmtrace detokenize 19556 905
  llmtrace tokenize "Hello world" --ids | llmtrace detokenize
  llmtrace detokenize 1 4093 198 6004 2 --skip-special --json -
  llmtrace detokenize 19556 905 --jsonl - | jq -r .visible
"""


def _model_name(model: Optional[str]) -> str:
    """The model as --model named it, or the default model's name."""
    from llmtrace.registry.models_toml import default_model

    return model if model is not None else default_model()


def _parse_ids(values: list[str]) -> list[int]:
    out = []
    for chunk in values:
        for item in chunk.replace(",", " ").split():
            try:
                out.append(int(item))
            except ValueError:
                raise UsageError(f"{item!r} is not a token id (expected whole numbers)") from None
    return out


@app.command(epilog=_DETOKENIZE_EPILOG)
def detokenize(
    token_ids: Annotated[Optional[list[str]], typer.Argument(metavar="[IDS]...", help="Token ids (or pipe them on stdin, separated by spaces, commas or newlines).", show_default=False)] = None,
    model: ModelOpt = None,
    skip_special: Annotated[bool, typer.Option("--skip-special", help="Leave special tokens out of the joined text.")] = False,
    as_json: JsonOpt = None,
    as_jsonl: jsonl_opt("one JSON object per id", "") = None,
    force: ForceOpt = False,
) -> None:
    """Turn token ids back into text: each id's piece and text, then the joined text."""
    check_outputs({"--json": as_json, "--jsonl": as_jsonl}, {"the model (-m)": model}, force=force)
    if token_ids:
        values = list(token_ids)
    elif not sys.stdin.isatty():
        values = [read_stdin()]
    else:
        raise UsageError("give token ids as arguments or on stdin")
    id_list = _parse_ids(values)
    tt = load_tokenizer(model)
    for tid in id_list:
        tt.check_id(tid)
    joined = tt.decode(id_list, skip_special_tokens=skip_special)
    rows = [
        {
            "index": i,
            "id": tid,
            "piece": tt.piece(tid),
            "visible": tt.visible_piece(tid),
            "text": tt.token_bytes(tid).decode("utf-8", errors="replace"),
            "bytes": tt.token_bytes(tid).hex(" "),
            "special": tt.is_special(tid),
        }
        for i, tid in enumerate(id_list)
    ]
    if as_json:
        doc = {"model": _model_name(model), "ids": id_list, "tokens": rows, "text": joined}
        write_output(as_json, json.dumps(doc, ensure_ascii=False) + "\n")
    if as_jsonl:
        write_output(as_jsonl, "".join(json.dumps({"kind": "token", **r}, ensure_ascii=False) + "\n" for r in rows))
    if "-" in (as_json, as_jsonl) and not sys.stderr.isatty():
        return

    from rich.text import Text

    con = _console(err="-" in (as_json, as_jsonl))
    if rows:
        cells = [[Text(str(r["index"])), Text(str(r["id"])), Text(r["visible"]), Text(quoted(r["text"])),
                  Text(r["bytes"]), Text("yes" if r["special"] else "")] for r in rows]
        table, left_out = fitted_table(ID_COLUMNS, cells, con.width)
        if left_out:  # before the table, so that it reads as what the table below lacks
            con.print(columns_left_out(con, left_out))
        con.print(table)
    else:
        con.print(Text("(no ids)", style="dim"))
    con.print(Text("text: ", style="bold") + Text(joined))
