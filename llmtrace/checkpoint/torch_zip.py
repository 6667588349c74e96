"""Tensors and plain values from a `torch.save` file, read without unpickling it.

A `.pt` file written by `torch.save` is a zip: `<name>/data.pkl` (a pickle of the saved object) and `<name>/data/<key>`
(each tensor's storage, raw little-endian bytes). Unpickling runs whatever the pickle names, so llmtrace never does it
(pickle checkpoints are never loaded). Instead, this walks the pickle's opcodes (`pickletools.genops` only parses
them) on a small stack machine that knows plain values (dicts, lists, tuples, strings, numbers, booleans, None) and
exactly one call: torch's rebuilding of a tensor from a storage (`torch._utils._rebuild_tensor_v2` over a typed
storage such as `torch.HalfStorage`, with an empty `collections.OrderedDict` of hooks). Any other global, any other
call or opcode is refused with one line: nothing in the file is ever run.

This is what is needed for a Jacobian lens published by Anthropic's reference package (`jlens`) or TransformerLens
(run/jlens.py): a dict of tensors and numbers.
"""

from __future__ import annotations

import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from llmtrace.errors import LlmtraceError

STORAGES = {"HalfStorage": torch.float16, "FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16,
            "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32}
REBUILD = ("torch._utils", "_rebuild_tensor_v2")
ORDERED_DICT = ("collections", "OrderedDict")


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


class _Mark:
    pass


def is_torch_zip(path: Union[str, Path]) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def read_torch_zip(path: Union[str, Path]) -> Any:
    """The object `torch.save` wrote to `path`, for plain values and tensors only (see the module's docstring)."""
    path = Path(path)
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise LlmtraceError(f"{path} is not a torch.save file (a zip): {e}") from None
    with z:
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise LlmtraceError(f"{path} is a zip but not a torch.save file (no single <name>/data.pkl in it)")
        root = pkl[0][: -len("data.pkl")]
        if root + "byteorder" in z.namelist() and z.read(root + "byteorder").strip() != b"little":
            raise LlmtraceError(f"{path} holds big-endian tensors; only little-endian ones are read")

        def storage_bytes(s: _Storage) -> bytes:
            name = f"{root}data/{s.key}"
            if name not in z.namelist():
                raise LlmtraceError(f"{path}: its pickle names a storage {s.key!r} the zip does not hold")
            return z.read(name)

        return _walk(z.read(pkl[0]), storage_bytes, path)


def _walk(data: bytes, storage_bytes, path: Path) -> Any:
    """Interpret the opcodes of `data` (a pickle) over plain values and the tensor rebuild only."""
    machine = _Machine(storage_bytes, path)
    for op, arg, _ in pickletools.genops(data):
        if op.name == "STOP":
            break
        machine.step(op.name, arg)
    if len(machine.stack) != 1:
        raise machine.refuse("a malformed stream")
    return machine.stack[0]


LITERALS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT", "BINUNICODE",
            "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
EMPTY = {"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_TUPLE": tuple}


class _Machine:
    """The pickle machine's stack and memo, with the few operations a torch.save of plain values and tensors uses."""

    def __init__(self, storage_bytes, path: Path):
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.storages: dict[str, torch.Tensor] = {}  # a storage's elements, read once (views of it share them)
        self.storage_bytes, self.path = storage_bytes, path

    def refuse(self, what: str) -> LlmtraceError:
        return LlmtraceError(f"{self.path}: its pickle holds {what}, which llmtrace does not run (only plain values "
                             f"and tensors are read from a torch.save file)")

    def since_mark(self) -> list:
        stack = self.stack
        for i in range(len(stack) - 1, -1, -1):
            if isinstance(stack[i], _Mark):
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise self.refuse("a broken MARK")

    def step(self, name: str, arg) -> None:
        stack = self.stack
        if name in ("PROTO", "FRAME"):
            return
        if name in LITERALS:
            stack.append(arg)
        elif name in CONSTANTS:
            stack.append(CONSTANTS[name])
        elif name in EMPTY:
            stack.append(EMPTY[name]())
        elif name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
            self.memo[len(self.memo) if name == "MEMOIZE" else int(arg)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            if int(arg) not in self.memo:
                raise self.refuse("a reference to nothing")
            stack.append(self.memo[int(arg)])
        elif name == "MARK":
            stack.append(_Mark())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name in ("TUPLE", "LIST", "DICT"):
            items = self.since_mark()
            stack.append(tuple(items) if name == "TUPLE" else list(items) if name == "LIST" else
                         dict(zip(items[::2], items[1::2])))
        else:
            self.build(name, arg)

    def build(self, name: str, arg) -> None:
        """The opcodes that fill a container, name a global or call one."""
        stack = self.stack
        if name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else self.since_mark()
            _list(stack[-1], self.refuse).extend(items)
        elif name in ("SETITEM", "SETITEMS"):
            items = [stack.pop(-2), stack.pop()] if name == "SETITEM" else self.since_mark()
            d = _dict(stack[-1], self.refuse)
            for k, v in zip(items[::2], items[1::2]):
                d[_key(k, self.refuse)] = v
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = arg.partition(" ")
            else:
                attr, module = stack.pop(), stack.pop()
            if (module, attr) not in (REBUILD, ORDERED_DICT) and not (module == "torch" and attr in STORAGES):
                raise self.refuse(f"a reference to {module}.{attr}")
            stack.append(_Global(module, attr))
        elif name == "BINPERSID":
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
                    and pid[1].module == "torch" and pid[1].name in STORAGES and isinstance(pid[4], int)):
                raise self.refuse(f"a persistent reference of an unknown kind ({_short(pid)})")
            stack.append(_Storage(STORAGES[pid[1].name], str(pid[2]), pid[4]))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            if fn == _Global(*ORDERED_DICT) and args == ():
                stack.append({})
            elif fn == _Global(*REBUILD) and isinstance(args, tuple):
                stack.append(self.rebuild(args))
            else:
                raise self.refuse(f"a call of {_short(fn)}")
        else:
            raise self.refuse(f"the opcode {name}")

    def rebuild(self, args: tuple) -> torch.Tensor:
        """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, ...): a copy."""
        if len(args) < 5 or not isinstance(args[0], _Storage):
            raise self.refuse("a tensor rebuilt from something other than a storage")
        storage, offset, size, stride = args[0], args[1], tuple(args[2]), tuple(args[3])
        if len(args) > 5 and args[5] not in ({}, None):
            raise self.refuse("a tensor with backward hooks")
        if storage.key not in self.storages:
            raw = self.storage_bytes(storage)
            item = torch.empty((), dtype=storage.dtype).element_size()
            if len(raw) != storage.numel * item:
                raise LlmtraceError(f"{self.path}: storage {storage.key} holds {len(raw)} bytes, not "
                                    f"{storage.numel} elements of {storage.dtype}")
            self.storages[storage.key] = torch.frombuffer(bytearray(raw), dtype=storage.dtype) if raw else \
                torch.empty(0, dtype=storage.dtype)
        flat = self.storages[storage.key]
        if len(size) != len(stride) or any(not isinstance(v, int) or v < 0 for v in (offset, *size, *stride)):
            raise self.refuse("a tensor of a malformed shape")
        last = offset + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else offset - 1
        if last >= flat.numel():
            raise self.refuse("a tensor reaching past its storage")
        return flat.as_strided(size, stride, offset).clone()


def _list(x, refuse) -> list:
    if not isinstance(x, list):
        raise refuse("an append to something other than a list")
    return x


def _dict(x, refuse) -> dict:
    if not isinstance(x, dict):
        raise refuse("an item set on something other than a dict")
    return x


def _key(k, refuse):
    if not isinstance(k, (str, int, float, bool, type(None), tuple)):
        raise refuse(f"a dict key of type {type(k).__name__}")
    return k


def _short(x) -> str:
    s = f"{x.module}.{x.name}" if isinstance(x, _Global) else repr(x)
    return s if len(s) <= 60 else s[:57] + "..."
