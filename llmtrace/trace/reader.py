"""Reading a saved trace back (`llmtrace show`): a JSON document or a JSONL stream, each event checked against the
schema as it is read, so that a renderer only ever sees events that have what it needs.

- A JSON document ({"schema": ..., "events": [...]}) is read in any layout (`jq .` output included).
- A JSONL stream may end in a line cut short (a run killed mid-write, a copy cut off): the complete lines are
  returned and a warning names the line left out.
- Anything else is one line naming the place: `trace.jsonl line 7: the "step" event lacks "kv_cache"`.

The checks come from the package's trace.schema.json, the one statement of what an event holds. They cover the part of
JSON Schema that file uses (type, required, properties, items, const, enum, bounds, $ref, allOf with if/then);
tests/test_show.py checks that the file uses no other keyword and that the checks agree with the jsonschema package.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from llmtrace.errors import LlmtraceError, UsageError
from llmtrace.fsutil import read_user_file
from llmtrace.trace.comparison import COMPARE_SCHEMA, jsonl_events
from llmtrace.trace.events import SCHEMA_ID, schema_path
from llmtrace.units import plural

# what the files llmtrace reads back are, for the message that refuses anything else (in the words of both the CLI
# and the Python API: the commands' and the functions' names are the same, the way of asking for the file is not)
WRITERS = "it reads the traces that generate, explain, lens, compare, diff and patch save, as JSON or JSONL"
GENERATE_EVENTS = {"run", "tokens", "shapes", "tensor", "step", "prediction", "batch", "summary"}

# A check returns None, or (the path to the bad value, a function that says what is wrong with it). Both are built
# only on failure, and the words only for the failure that is reported: most checks that fail are the `if` of an
# if/then, which fail for every event kind but one.
Problem = Optional[tuple[list, Callable[[], str]]]
Check = Callable[[Any], Problem]

KEYWORDS = {"type", "required", "properties", "additionalProperties", "items", "minItems", "maxItems", "const", "enum",
            "minimum", "maximum", "exclusiveMinimum", "$ref", "allOf", "if", "then"}  # what _compile understands
IGNORED = {"$schema", "$id", "$defs", "title", "description", "oneOf"}  # annotations, and the top level's choice


def load_trace(path: str, warn: Callable[[str], None] = lambda msg: print(f"warning: {msg}", file=sys.stderr)
               ) -> list[dict]:
    """The events of a file llmtrace wrote (a trace of generate, explain, lens or patch; a comparison of compare or
    diff, as the events of its JSONL), each checked against the schema. Raises LlmtraceError naming the file and place; a
    file that is no llmtrace output at all is a UsageError."""
    data = sys.stdin.buffer.read() if path == "-" else read_user_file(Path(path), "trace")
    name = "stdin" if path == "-" else path
    if not data.strip():
        raise LlmtraceError(f"{name}: the trace is empty")
    error: Optional[ValueError] = None
    try:
        whole = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        error = e
    if error is None:  # the whole text is one JSON value
        if isinstance(whole, dict) and "events" in whole:
            return _document_events(whole, name)
        if isinstance(whole, dict) and "event" in whole:  # a stream of one event
            return [_checked(whole, f"{name} line {_first_line(data)}", first=True)]
        if isinstance(whole, dict) and str(whole.get("schema", "")).startswith("llmtrace.compare/"):
            return _comparison_events(whole, name)
        raise not_ours(name, "valid JSON")
    lines = data.split(b"\n")
    first = next(i for i, line in enumerate(lines) if line.strip())
    if not lines[first].lstrip().startswith(b"{") and not _parses(lines[first]):
        raise not_ours(name, f"line {first + 1} is not valid JSON")  # text, a page, a model: each file of ours is JSON
    if len([line for line in lines if line.strip()]) > 1 and not _parses(lines[first]):
        # several lines, and the first is no event on its own: a document written over several lines, damaged
        where = f"line {error.lineno}, column {error.colno}: {error.msg}" if isinstance(error, json.JSONDecodeError) \
            else f"byte {error.start} is not UTF-8"
        raise LlmtraceError(f"{name}: not valid JSON ({where})")
    return _stream_events(lines, name, ends_cleanly=data.endswith(b"\n"), warn=warn)


def not_ours(where: str, what: str) -> UsageError:
    """The one rule for a file that llmtrace did not write (a text file, a page, a model, another tool's JSON): a
    usage problem, exit 2, worded here once. A file of llmtrace's that is damaged is an LlmtraceError (exit 1)."""
    return UsageError(f"{where}: {what}; not a file llmtrace reads back ({WRITERS})")


def _comparison_events(doc: dict, name: str) -> list[dict]:
    """A comparison's --json object, checked, as the events its --jsonl holds."""
    if doc["schema"] != COMPARE_SCHEMA:
        raise LlmtraceError(f"{name}: a comparison of schema {doc['schema']!r}; this llmtrace reads {COMPARE_SCHEMA}")
    problem = _def_check("compare_document")(doc)
    if problem is not None:
        path, what = problem
        raise LlmtraceError(f"{name}: the comparison {what().replace('{field}', _field(path))}")
    return [_checked(ev, f"{name}") for ev in jsonl_events(doc)]


def _document_events(doc: dict, name: str) -> list[dict]:
    if doc.get("schema") != SCHEMA_ID:
        raise LlmtraceError(f"{name}: a trace of schema {doc.get('schema')!r}; this llmtrace reads {SCHEMA_ID}")
    events = doc["events"]
    if not isinstance(events, list):
        raise LlmtraceError(f"{name}: \"events\" is {_kind(events)}, not a list")
    return [_checked(ev, f"{name} event {i}") for i, ev in enumerate(events, 1)]


def _stream_events(lines: list[bytes], name: str, ends_cleanly: bool, warn: Callable[[str], None]) -> list[dict]:
    last = max(i for i, line in enumerate(lines) if line.strip())
    events = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        where = f"{name} line {i + 1}"
        try:
            ev = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if i < last:
                detail = f"column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else \
                    f"byte {e.start} of the line is not UTF-8"
                raise LlmtraceError(f"{where}: not valid JSON ({detail})") from None
            # the last line: a stream cut off mid-line (a run killed while writing, a copy cut short)
            cut = not ends_cleanly and not (isinstance(e, UnicodeDecodeError) and e.reason != "unexpected end of data")
            how = "is cut off" if cut else "is not valid JSON" if isinstance(e, json.JSONDecodeError) else \
                "is not UTF-8 text"
            if not events:
                raise LlmtraceError(f"{name}: no complete event (line {i + 1} {how})")
            warn(f"{where} {how}; showing the {plural(len(events), 'complete event')} "
                 f"before it")
            return events
        events.append(_checked(ev, where, first=not events))
    if events[0]["event"] == "run" and events[-1]["event"] != "summary":  # generate's stream ends with its summary
        warn(f"{name} ends after {plural(len(events), 'event')} without a summary: the trace is "
             f"incomplete (the run was killed, or the file was cut); showing what it has")
    return events


def _checked(ev: Any, where: str, first: bool = False) -> dict:
    """The event, checked against the schema. An event of a kind llmtrace never writes, or a first line that is no
    event at all, is not an llmtrace file (a UsageError); damage further on is an LlmtraceError."""
    refuse = (lambda what: not_ours(where, what)) if first else (lambda what: LlmtraceError(f"{where}: {what}"))
    if not isinstance(ev, dict):
        raise refuse(f"{_kind(ev)}, not an event (a JSON object with \"event\")")
    if "event" not in ev:
        raise refuse("an object without \"event\", not an llmtrace event")
    if isinstance(ev["event"], str) and ev["event"] not in event_kinds():
        raise not_ours(where, f"an event of kind {_short(ev['event'])}, which llmtrace does not write")
    if ev["event"] == "run" and isinstance(ev.get("schema"), str) and ev["schema"] != SCHEMA_ID:
        # a newer (or older) contract: say so, rather than name the first field this version misses
        raise LlmtraceError(f"{where}: a trace of schema {ev['schema']!r}; this llmtrace reads {SCHEMA_ID}")
    problem = _event_check()(ev)
    if problem is not None:
        path, what = problem
        kind = ev["event"]
        event = f"the {json.dumps(kind, ensure_ascii=False)} event" if isinstance(kind, str) else "the event"
        raise LlmtraceError(f"{where}: {event} {what().replace('{field}', _field(path))}")
    return ev


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _first_line(data: bytes) -> int:
    """The number of the line on which the text starts (after blank lines)."""
    return data[: len(data) - len(data.lstrip())].count(b"\n") + 1


# ----------------------------------------------------------------------------------------------------------------
# the schema's checks, compiled once


@functools.cache
def _schema() -> dict:
    return json.loads(schema_path().read_text(encoding="utf-8"))


@functools.cache
def event_kinds() -> frozenset:
    """The kinds of event llmtrace writes, as the schema lists them."""
    return frozenset(_schema()["$defs"]["event"]["properties"]["event"]["enum"])


def _event_check() -> Check:
    return _def_check("event")


@functools.cache
def _def_check(definition: str) -> Check:
    defs = _schema()["$defs"]
    compiled: dict[str, Check] = {}

    def ref(target: str) -> Check:
        name = target.removeprefix("#/$defs/")
        if name not in compiled:
            compiled[name] = lambda v: compiled[name + "!"](v)  # a forward reference, for recursive definitions
            compiled[name + "!"] = _compile(defs[name], ref)
        return compiled[name]

    return ref(f"#/$defs/{definition}")


# ----------------------------------------------------------------------------------------------------------------
# which command wrote the file


def trace_kind(events: list[dict], name: str = "the file") -> str:
    """The command that wrote these events: "generate", "explain", "lens", "patch", "compare" or "diff". A UsageError
    for events that no command writes on their own (a comparison's layers without its head, say)."""
    head = next((e for e in events if e["event"] == "compare"), None)
    if head is not None:
        return head.get("source", "compare")
    if any(e["event"] == "patch" for e in events):
        return "patch"
    model = next((e for e in events if e["event"] == "explain" and e.get("section") == "model"), None)
    if model is not None:
        return "lens" if model.get("command") == "lens" else "explain"
    if any(e["event"] in GENERATE_EVENTS for e in events):
        return "generate"
    raise not_ours(name, f"its events ({', '.join(sorted({e['event'] for e in events}))}) are not a whole file of "
                         "any command")


JSON_TYPE = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null", int: "integer",
             float: "number"}  # what json.loads makes


def _has_type(v, allowed: frozenset) -> bool:
    kind = JSON_TYPE.get(type(v))
    return kind in allowed or (kind == "integer" and "number" in allowed) or (
        kind == "number" and "integer" in allowed and v.is_integer())


def _compile(schema: dict, ref: Callable[[str], Check]) -> Check:
    """One JSON Schema (the subset KEYWORDS) as a function of a value. Messages say "{field} ..." for the caller."""
    checks: list[Check] = []
    unknown = set(schema) - KEYWORDS - IGNORED
    if unknown:
        raise AssertionError(f"trace.schema.json uses {sorted(unknown)}, which the reader does not check")
    if "$ref" in schema:
        checks.append(ref(schema["$ref"]))
    if set(schema) & {"type", "const", "enum", "minimum", "maximum", "exclusiveMinimum"}:
        checks.append(_scalar_check(schema))
    if "required" in schema:
        checks.append(functools.partial(_required, keys=tuple(schema["required"])))
    if "properties" in schema or "additionalProperties" in schema:
        props = {k: _compile(s, ref) for k, s in schema.get("properties", {}).items()}
        rest = _compile(schema["additionalProperties"], ref) if isinstance(schema.get("additionalProperties"), dict) \
            else None
        checks.append(functools.partial(_members, props=props, rest=rest))
    if "items" in schema or "minItems" in schema or "maxItems" in schema:
        item = _compile(schema["items"], ref) if "items" in schema else None
        checks.append(functools.partial(_items, item=item, lo=schema.get("minItems", 0),
                                        hi=schema.get("maxItems", float("inf"))))
    by_value: dict[str, dict] = {}  # if/then on one property's const (the event kind, the explain section)
    for part in schema.get("allOf", ()):
        cond = part.get("if", {})
        if set(cond) == {"properties"} and len(cond["properties"]) == 1 and \
                set(next(iter(cond["properties"].values()))) == {"const"}:
            (key, value), = ((k, c["const"]) for k, c in cond["properties"].items())
            by_value.setdefault(key, {}).setdefault(value, []).append(_compile(part.get("then", {}), ref))
        elif "if" in part:
            checks.append(functools.partial(_if_then, when=_compile(cond, ref), then=_compile(part.get("then", {}), ref)))
        else:
            checks.append(_compile(part, ref))
    for key, thens in by_value.items():
        checks.append(functools.partial(_switch, key=key, thens=thens))
    if len(checks) == 1:
        return checks[0]
    return functools.partial(_all, checks=tuple(checks))


def _scalar_check(schema: dict) -> Check:
    """type, const, enum and bounds in one function: most of a trace's values are leaves checked by nothing else."""
    names = schema.get("type")
    names = names if isinstance(names, list) else [names] if names else []
    allowed, wanted = frozenset(names), " or ".join(names)
    has_const, const = "const" in schema, schema.get("const")
    options = schema.get("enum")
    bounds = [(schema[key], ok, says) for key, ok, says in (
        ("minimum", lambda v, b: v >= b, "below"), ("maximum", lambda v, b: v <= b, "above"),
        ("exclusiveMinimum", lambda v, b: v > b, "not above")) if key in schema]

    def check(v) -> Problem:
        if allowed and not _has_type(v, allowed):
            return [], lambda: f"has {{field}} as {_kind(v)}, not {wanted}"
        if has_const and v != const:
            return [], lambda: f"has {{field}} = {_short(v)}, not {_short(const)}"
        if options is not None and v not in options:
            return [], lambda: f"has {{field}} = {_short(v)}, not one of {', '.join(map(_short, options))}"
        if bounds and type(v) in (int, float):
            for bound, ok, says in bounds:
                if not ok(v, bound):
                    return [], lambda: f"has {{field}} = {_short(v)}, {says} {bound}"
        return None

    return check


def _all(v, checks) -> Problem:
    for check in checks:
        problem = check(v)
        if problem is not None:
            return problem
    return None


def _required(v, keys) -> Problem:
    if isinstance(v, dict):
        for key in keys:
            if key not in v:
                return [key], lambda: "lacks {field}"
    return None


def _members(v, props, rest) -> Problem:
    if not isinstance(v, dict):
        return None
    for key, value in v.items():
        check = props.get(key, rest)
        if check is not None:
            problem = check(value)
            if problem is not None:
                return [key] + problem[0], problem[1]
    return None


def _items(v, item, lo, hi) -> Problem:
    if not isinstance(v, list):
        return None
    if not lo <= len(v) <= hi:
        return [], lambda: f"has {{field}} with {plural(len(v), 'item')}, not {lo}" + ("" if lo == hi else f" to {hi}")
    if item is not None:
        for i, value in enumerate(v):
            problem = item(value)
            if problem is not None:
                return [i] + problem[0], problem[1]
    return None


def _switch(v, key, thens: dict) -> Problem:
    """The `then` of each `if: {properties: {key: {const: value}}}`, found by the value instead of tried in turn. As in
    JSON Schema, such an `if` holds for a value that is no object or lacks the key, so then every `then` applies."""
    if isinstance(v, dict) and key in v:
        try:
            chosen = thens.get(v[key], ())
        except TypeError:  # an unhashable value equals no const
            chosen = ()
    else:
        chosen = [check for checks in thens.values() for check in checks]
    for check in chosen:
        problem = check(v)
        if problem is not None:
            return problem
    return None


def _if_then(v, when, then) -> Problem:
    return then(v) if when(v) is None else None


def _field(path: list) -> str:
    """["kv_cache", "seq_len"] -> '"kv_cache.seq_len"'; ["topk", 2, "prob"] -> '"topk[2].prob"'; [] -> "it"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + part
    return json.dumps(text, ensure_ascii=False) if text else "the event"


def _kind(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _short(v) -> str:
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "…"


def trace_points(events: list[dict]):
    """The observable points a trace was recorded with (model.points.Points): its `run` event's declaration (explain's
    and lens's: their model section's), or, for a trace written before traces carried one, Llama's (the only family
    llmtrace ran then)."""
    from llmtrace.model.llama_points import llama_points
    from llmtrace.model.points import Points

    head = next((e for e in events if e.get("event") == "run" or e.get("section") == "model"), None)
    if head and head.get("points"):
        return Points.from_records(head["points"])
    return llama_points()
