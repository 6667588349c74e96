"""SmolLM3: Llama with no RoPE in some layers (NoPE). config.json's `no_rope_layers` holds one flag per layer, 1 where
the layer rotates q and k and 0 where it does not; by default every 4th layer (3, 7, 11, ...) rotates nothing
(`no_rope_layer_interval` 4). In such a layer attention sees content, not position: a query scores a key by what the
two vectors hold, and order reaches it only through the stream and the causal mask. The core runs it from the config
(ModelConfig.no_rope_layers: the layers without RoPE; the layer's RoPE table is "none", model/transformer.py).

A GGUF (arch `smollm3`, q/k rows permuted as Llama's) has no key for this: llama.cpp hard-codes the interval of 4
(its smollm3 graph skips RoPE where (layer + 1) % 4 == 0), and so does this file's reading of one."""

from llmtrace.errors import LlmtraceError
from llmtrace.model.family import Family, say
from llmtrace.units import noun
from llmtrace.model.transformer import Transformer

GGUF_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for smollm3: no GGUF key says it


def every(interval: int, n_layers: int) -> list[int]:
    """The layers without RoPE when every `interval`-th has none: (i + 1) % interval == 0."""
    return [i for i in range(n_layers) if (i + 1) % interval == 0]


def hf_config(cfg: dict) -> dict:
    n = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise LlmtraceError(f"no_rope_layer_interval is {interval!r}; it must be a whole number ≥ 1")
        return {"no_rope_layers": every(interval, n) or None}
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise LlmtraceError(f"no_rope_layers must list {n} flags of 0 (no RoPE) or 1 (RoPE), one per layer; it is "
                            f"{flags!r}")
    return {"no_rope_layers": [i for i, f in enumerate(flags) if not f] or None}


def gguf_config(meta) -> dict:
    return {"no_rope_layers": every(GGUF_INTERVAL, int(meta("block_count"))) or None}


def changes(c) -> list[str]:
    layers = c.no_rope_layers or []
    if not layers:
        return [say(WORDS, "all_rope")]
    gguf = (c.extra or {}).get("format") == "gguf"
    return [say(WORDS, "no_rope_gguf" if gguf else "no_rope", layer=noun(len(layers), "layer"),
                which=", ".join(map(str, layers)), n=c.n_layers)]


# What SmolLM3 changes from Llama, each line in English and Chinese (model.family.say).
WORDS = {
    "all_rope": ("every layer applies RoPE (no_rope_layers all 1)", "每一层都做 RoPE（no_rope_layers 全为 1）"),
    "no_rope": ("no RoPE in {layer} {which} of {n}: q and k go unrotated, so attention there sees content, not "
                "position", "{n} 层中的第 {which} 层不做 RoPE：q 和 k 不旋转，所以那里的注意力看内容，不看位置"),
    "no_rope_gguf": ("no RoPE in {layer} {which} of {n} (the GGUF has no key for them: llama.cpp's every 4th): q and "
                     "k go unrotated, so attention there sees content, not position",
                     "{n} 层中的第 {which} 层不做 RoPE（GGUF 没有对应的键：按 llama.cpp 的每 4 层一层）：q 和 k 不旋转，"
                     "所以那里的注意力看内容，不看位置"),
}


FAMILY = Family(
    name="smollm3",
    title="SmolLM3",
    model=Transformer,
    hf_types={"smollm3": "SmolLM3ForCausalLM"},
    gguf_archs={"smollm3": True},  # the converter's SmolLM3 class is its Llama class: q/k rows permuted
    hf_config=hf_config,
    gguf_config=gguf_config,
    changes=changes,
    words=WORDS,
)
