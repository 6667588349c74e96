"""Tensors and plain values from a `torch.save` file, through torch's own restricted loader.

A `.pt` file is a pickle, and unpickling a pickle runs whatever it names: llmtrace never loads weights that way. The
one `.pt` it reads is a published Jacobian lens (Anthropic's reference package `jlens`, which TransformerLens reads and
writes too: a dict of tensors and numbers, run/jlens.py), and it reads it with `torch.load(weights_only=True)`, torch's
maintained allowlist unpickler: tensors, their storages and plain values (dicts, lists, tuples, strings, numbers,
booleans, None) load; any other global or call is refused before it runs, and llmtrace says so in one line.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Union

from llmtrace.errors import LlmtraceError


def is_torch_zip(path: Union[str, Path]) -> bool:
    """Whether `path` is a zip (torch.save's format since torch 1.6); a safetensors file is not."""
    return zipfile.is_zipfile(path)


def read_torch_zip(path: Union[str, Path]) -> Any:
    """The saved object, tensors on the CPU; a file that names anything but tensors and plain values is refused."""
    import pickle

    import torch

    import warnings

    try:
        with warnings.catch_warnings():  # a protocol other than torch.save's own: the error below says it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Unsupported global" in text:
            name = text.split("Unsupported global:", 1)[1].split(" was not", 1)[0].replace("GLOBAL", "").strip()
            raise LlmtraceError(f"{path}: refused: it would call {name}, and llmtrace runs nothing a file names "
                                f"(only tensors and plain values load)") from None
        raise LlmtraceError(f"{path}: torch's weights-only loader cannot read it (save it with torch.save's own "
                            f"pickle protocol, 2)") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise LlmtraceError(f"{path}: not a torch.save file llmtrace can read ({str(e).splitlines()[0][:120]})") from None
