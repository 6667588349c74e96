"""Chat messages and the jinja2 helpers a model's chat template may call (rendered in jinja2's sandbox by
tokenizer.TextTokenizer.render_chat)."""

from __future__ import annotations

import json
from typing import Any


from llmtrace.errors import LlmtraceError


def check_messages(messages: Any, where: str = "messages") -> list[dict]:
    """A chat as a list of {"role": str, "content": str}; anything else is a one-line LlmtraceError."""
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, list) or not messages:
        raise LlmtraceError(f"{where}: expected a non-empty JSON list of {{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise LlmtraceError(f"{where}: message {i} is not an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise LlmtraceError(f"{where}: message {i} has no \"role\" string")
        if not isinstance(m.get("content"), str):
            raise LlmtraceError(f"{where}: message {i} has no \"content\" string")
    return messages


class TemplateRaised(Exception):
    pass


def raise_exception(message: str):
    raise TemplateRaised(message)


def tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


# Gemma's turn format, for a Gemma GGUF that ships no tokenizer.chat_template (the 270M base model's file has none):
# BOS, then each message as "<start_of_turn>ROLE\n" CONTENT "<end_of_turn>\n", the assistant's role written "model";
# Gemma has no system role, so a system message opens the first user turn, followed by a blank line; the turns
# alternate user, model, user, ...; a generation prompt opens the model's turn.
GEMMA_TURNS = (
    "{{ bos_token }}{% set turns = messages %}{% set opening = '' %}"
    "{% if turns and turns[0]['role'] == 'system' %}"
    "{% set opening = turns[0]['content'] | trim ~ '\n\n' %}{% set turns = turns[1:] %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma turns alternate: user, then assistant, then user, ...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ opening if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def gguf_chat_template(get, notes: list[str]) -> str | None:
    """tokenizer.chat_template; for a Gemma file without one, Gemma's turn format (and a note that says so)."""
    template = get("tokenizer.chat_template")
    if template is None and get("general.architecture") in GEMMA_ARCHITECTURES:
        notes.append("this GGUF has no chat template; `chat=True` uses Gemma's turn format "
                     "(<start_of_turn>user … <end_of_turn>, then <start_of_turn>model)")
        return GEMMA_TURNS
    return template
