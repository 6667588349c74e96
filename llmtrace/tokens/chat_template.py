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


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
