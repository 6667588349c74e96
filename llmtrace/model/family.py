"""A model family, declared: the `Family` record each file of model/families/ defines, and the registry that finds
them (which family reads a config.json's model_type or a GGUF architecture)."""


from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import cache
from typing import Callable, Optional

from llmtrace.errors import LlmtraceError


def _nothing(*_args) -> dict:
    return {}


class Said(str):
    """A line a family says, in English (it is that str), with the key of its words and their arguments, so that a
    page in another language says it from the same words: a family declares each line in every language in its own
    file (`Family.words`: key -> (English, Chinese), {name} filled in from the arguments)."""

    key: str
    args: dict

    def record(self) -> dict:
        return {"key": self.key, "args": self.args}


def say(words: dict, key: str, **args) -> Said:
    """The English line `key` of `words` with `args` filled in, carrying its key and arguments (Said)."""
    line = Said(words[key][0].format(**args))
    line.key, line.args = key, args
    return line


def said_in(family: Optional[str], said: dict, lang: str) -> Optional[str]:
    """A line recorded as {"key", "args"} in `lang` ("en", "zh"), from the words of family `family` (or of every
    family: WORDS below); None where neither declares the key (a trace from another version)."""
    table = dict(WORDS)
    try:
        table.update(family_named(family).words if family else {})
    except LlmtraceError:
        pass
    words = table.get(said.get("key"))
    if words is None:
        return None
    try:
        return words[1 if lang == "zh" and len(words) > 1 else 0].format(**(said.get("args") or {}))
    except (KeyError, IndexError, ValueError):
        return None


# The lines describe_changes adds from the config itself, whatever the family.
WORDS = {
    "window_every": ("every layer sees only the last {w} tokens (a sliding window, not a context limit: positions go "
                     "on to {n}; the KV cache keeps every slot)",
                     "每一层只看最近的 {w} 个词元（滑动窗口，不是上下文上限：位置一直数到 {n}；KV 缓存保留每个槽位）"),
    "window_one": ("layer {layer} of {layers} sees only the last {w} tokens (a sliding window, not a context limit: "
                   "positions go on to {n}; the KV cache keeps every slot)",
                   "{layers} 层中的第 {layer} 层只看最近的 {w} 个词元（滑动窗口，不是上下文上限：位置一直数到 {n}；KV 缓存保留每个槽位）"),
    "window_some": ("{k} of {layers} layers see only the last {w} tokens (a sliding window, not a context limit: "
                    "positions go on to {n}; the KV cache keeps every slot)",
                    "{layers} 层中有 {k} 层只看最近的 {w} 个词元（滑动窗口，不是上下文上限：位置一直数到 {n}；KV 缓存保留每个槽位）"),
    "rope_local": ("RoPE base {local} in the sliding-window layers, {base} in the global ones",
                   "滑动窗口层的 RoPE 基数为 {local}，全局层为 {base}"),
}


@dataclass(frozen=True)
class Family:
    """One family. `hf_types`: config.json model_type -> the architecture class transformers saves it with;
    `gguf_archs`: GGUF general.architecture -> whether llama.cpp's converter reordered q/k rows for its RoPE pairing.
    `hf_config(cfg)` and `gguf_config(meta)` return the config fields this family adds (ModelConfig's names; a mixture
    of experts' n_experts, n_experts_used, expert_ffn_dim, norm_topk_prob and dense_layers, which
    ModelConfig.from_dict files into the experts' config part, model.transformer.MOVED_TO_PARTS), reading
    config.json (a dict) or GGUF metadata (`meta(key)`, key without the arch prefix); they raise LlmtraceError naming
    a field whose value this family cannot run. `changes(config)`: what this family changes from Llama, one short
    line per change, in the order the maths runs, with the checkpoint's own numbers. `reads_rope`: hf_config and
    gguf_config read RoPE's type and scaling themselves (the generic readers then leave them: Phi-3's LongRoPE). `gguf_config_tensors`:
    GGUF tensors that are config, not weights (Phi-3's LongRoPE factors), read through `meta.tensor(name)`.
    `gguf_requires`: metadata keys (without the arch prefix) that a file of one of `gguf_archs` must have, non-zero,
    for this family to read it; of the families that list an arch, one whose keys are all there is chosen before one
    that requires none (Mixtral is Llama's arch with `expert_count`). `hf_wrappers`: a model_type that wraps this
    family's text model with other parts (a vision encoder) -> (its architecture class, the key prefix of the text
    model's tensors): llmtrace reads its `text_config` and those tensors, and leaves the rest."""

    name: str
    title: str
    model: type
    hf_types: dict[str, str]
    gguf_archs: dict[str, bool] = field(default_factory=dict)
    gguf_requires: tuple[str, ...] = ()
    hf_config: Callable[[dict], dict] = _nothing
    gguf_config: Callable[[Callable], dict] = _nothing
    changes: Callable[[object], list] = lambda config: []
    reads_rope: bool = False
    gguf_config_tensors: tuple[str, ...] = ()
    hf_wrappers: dict[str, tuple[str, str]] = field(default_factory=dict)
    words: dict[str, tuple[str, str]] = field(default_factory=dict)  # its change lines: key -> (English, Chinese)


@cache
def families() -> tuple[Family, ...]:
    """Every family file's FAMILY, Llama first."""
    import llmtrace.model.families as package

    found = [importlib.import_module(f"{package.__name__}.{m.name}").FAMILY for m in pkgutil.iter_modules(package.__path__)]
    return tuple(sorted(found, key=lambda f: (f.name != "llama", f.name)))


def family_named(name: str) -> Family:
    for f in families():
        if f.name == name:
            return f
    raise LlmtraceError(f"unknown model family {name!r}; llmtrace runs: {', '.join(f.name for f in families())}")


def family_of_hf(model_type: Optional[str]) -> Optional[Family]:
    return next((f for f in families() if model_type in f.hf_types), None)


def hf_wrapper(model_type: Optional[str]) -> Optional[tuple[Family, str, str]]:
    """(the family, the architecture class, the text model's key prefix) of a model_type that wraps a family's text
    model, or None."""
    return next(((f, *f.hf_wrappers[model_type]) for f in families() if model_type in f.hf_wrappers), None)


def family_of_gguf(arch: Optional[str], meta: Callable = lambda key: None) -> Optional[Family]:
    """The family that reads a GGUF of this architecture; `meta(key)` reads the file's `{arch}.{key}` (for
    Family.gguf_requires)."""
    claims = [f for f in families() if arch in f.gguf_archs and all(meta(k) for k in f.gguf_requires)]
    return max(claims, key=lambda f: len(f.gguf_requires), default=None)


def hf_types() -> dict[str, str]:
    """Every model_type llmtrace reads -> its architecture class, in family order."""
    return {t: a for f in families() for t, a in f.hf_types.items()}


def gguf_archs() -> list[str]:
    return list(dict.fromkeys(a for f in families() for a in f.gguf_archs))


# Models llmtrace recognises but does not run yet, by HF model_type and GGUF arch: what they need that no family has.
NOT_YET = {
    "qwen2_moe": "Qwen2-MoE has a shared expert (a dense SwiGLU with a sigmoid gate) beside the routed experts",
    "qwen2moe": "Qwen2-MoE has a shared expert (a dense SwiGLU with a sigmoid gate) beside the routed experts",
}


def not_yet(name: Optional[str]) -> Optional[str]:
    """Why a model_type or GGUF arch that no family runs is not run yet (None: llmtrace does not know it)."""
    return NOT_YET.get(name) if isinstance(name, str) else None


def build(config):
    """The model of `config.family`, its weights uninitialised (the loader fills them)."""
    return family_named(config.family).model(config)


def points_of(config):
    """The points the model of `config` declares (model.points.Points), known without building it."""
    return family_named(config.family).model.declared_points()


def said_changes(lines: list[str]) -> list[Optional[dict]]:
    """The key and arguments of each change line (Said.record), None for a line said in English only."""
    return [x.record() if isinstance(x, Said) else None for x in lines]


def describe_changes(config) -> list[str]:
    """What the model of `config` changes from Llama, in the order the maths runs, with its own numbers: the family's
    account (Family.changes), then what the config itself sets (sliding windows, a second RoPE base)."""
    out = list(family_named(config.family).changes(config))
    if config.sliding_window is not None and config.layer_types:
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding"]
        key = "window_every" if len(sliding) == config.n_layers else "window_one" if len(sliding) == 1 else "window_some"
        out.append(say(WORDS, key, w=f"{config.sliding_window:,}", n=f"{config.max_seq_len:,}", layers=config.n_layers,
                       layer=sliding[0] if sliding else 0, k=len(sliding)))
    if config.rope_local_theta is not None:
        out.append(say(WORDS, "rope_local", local=_number(config.rope_local_theta), base=_number(config.rope_theta)))
    note = (config.extra or {}).get("window_note")
    if note:
        out.append(note)
    return out


def _number(x: float) -> str:
    """1000000.0 -> '1,000,000' (not '1e+06'); 0.5 -> '0.5'."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,g}"


def known_points(**flags) -> tuple[str, ...]:
    """Every point name some family declares (filtered as Points.names filters), Llama's first: what a point given
    on the command line must be before the model it names is known (its own declaration decides once it is)."""
    out: dict[str, None] = {}
    for f in families():
        out.update(dict.fromkeys(f.model.declared_points().names(**flags)))
    return tuple(out)
