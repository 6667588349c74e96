"""Several prompts for one batch (s3): repeated -p/--prompt, or a --prompts file, checked before the model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtrace.cli.options import FileOpt, FlagGroup, PromptArg
from llmtrace.cli.text_input import decode_utf8, read_file, read_prompt
from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.fsutil import read_user_file

PromptsOpt = Annotated[Optional[list[str]], typer.Option(
    "--prompt", "-p", help="A prompt; repeat it to run several prompts as one batch (left-padded, s3).",
    show_default=False)]
PromptsFileOpt = Annotated[Optional[Path], typer.Option(
    "--prompts", help="A batch of prompts from FILE: one per line, or JSON Lines objects with a \"prompt\" field.",
    show_default=False)]
MaxBatchOpt = Annotated[int, typer.Option(
    "--max-batch", help="Most prompts run as one batch; more is refused (a batch's memory grows with its rows).")]


@dataclass
class PromptFlags(FlagGroup):
    """What a command reads as its prompts: the argument, --file or stdin (one prompt), or -p … -p … / --prompts FILE
    (a batch of at most --max-batch)."""

    prompt: PromptArg = None
    file: FileOpt = None
    prompt_list: PromptsOpt = None
    prompts_file: PromptsFileOpt = None
    max_batch: MaxBatchOpt = 64

    def inputs(self) -> dict:
        """The files the prompts are read from, for cli.outputs.check_outputs (no output may be one of them)."""
        return {"the prompt file (--file)": self.file, "the prompts file (--prompts)": self.prompts_file}

    def read(self, row: Optional[int] = None):
        """The prompt (a str) or the batch's prompts (a list): read_prompts."""
        return read_prompts(self.prompt, self.file, self.prompt_list, self.prompts_file, self.max_batch, row)


def read_prompt_list(prompts: Optional[list[str]], prompts_file: Optional[Path], max_batch: int) -> Optional[list[str]]:
    """The texts of -p/--prompt and --prompts FILE, in that order; None when neither was given. Each error names the
    prompt (its -p number or the file's line) and is one line."""
    if max_batch < 1:  # also when one prompt is given: the flag is wrong whatever it limits
        raise UsageError(f"--max-batch must be ≥ 1, not {max_batch}")
    if not prompts and prompts_file is None:
        return None
    texts: list[str] = []
    for i, p in enumerate(prompts or [], 1):
        if not p:
            raise UsageError(f"prompt {i} (-p number {i}) is empty; give some text")
        texts.append(decode_utf8(p.encode("utf-8", errors="surrogateescape"), f"prompt {i} (-p number {i})"))
    if prompts_file is not None:
        texts += _read_prompts_file(prompts_file)
    if len(texts) > max_batch:
        raise UsageError(f"{len(texts)} prompts, but a batch takes at most {max_batch}; pass --max-batch {len(texts)} "
                         f"to run them all as one batch")
    return texts


def read_prompts(prompt: Optional[str], file: Optional[Path], prompts: Optional[list[str]],
                 prompts_file: Optional[Path], max_batch: int, row: Optional[int] = None):
    """The one reader of a command's prompts: the argument, --file or stdin (one prompt, a str), or -p/--prompts
    (several, a list), never both. `row` (explain, lens): the one taken apart, checked against the list; an empty
    single prompt is refused there too (one forward pass needs a token)."""
    texts = read_prompt_list(prompts, prompts_file, max_batch)
    if texts is not None and (prompt is not None or file is not None):
        raise UsageError("give the prompt as an argument or --file, or prompts with -p/--prompts, not both")
    if row is not None and texts is not None and not 0 <= row < len(texts):
        raise UsageError(f"--row {row} is out of range; the batch has {len(texts)} prompts (rows 0..{len(texts) - 1})")
    if row not in (None, 0) and texts is None:
        raise UsageError("--row picks one of several prompts; give them with -p … -p … or --prompts")
    if texts is not None:
        return texts
    text = read_prompt(prompt, file)
    if row is not None and text == "":
        raise UsageError("the prompt is empty; give some text")
    return text


def _read_prompts_file(path: Path) -> list[str]:
    if str(path) == "-":
        data = read_file(path, "prompts").encode("utf-8")
    else:
        data = read_user_file(path, "prompts")
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file's final newline
    if not lines:  # a usage problem, as an empty --file is
        raise UsageError(f"prompts file {path} is empty; give one prompt per line")
    texts = []
    jsonl = lines[0].lstrip().startswith(b"{")
    for n, raw in enumerate(lines, 1):
        raw = raw[:-1] if raw.endswith(b"\r") else raw
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LlmtraceError(f"{path} line {n} is not valid UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}") from None
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LlmtraceError(f"{path} line {n} is not a JSON object ({e.msg}); the file's first line is, so "
                                    f"every line must be") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise LlmtraceError(f'{path} line {n} has no "prompt" string field')
            line = obj["prompt"]
        if not line:
            raise LlmtraceError(f"{path} line {n} is an empty prompt; remove the line or give some text")
        texts.append(line)
    return texts
