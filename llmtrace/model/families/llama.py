"""Llama, the reference family: model/transformer.py as it is. Qwen2 is Llama with biases on q, k and v, Mistral
Llama with a sliding window: both config values the modules read."""

from llmtrace.model.family import Family
from llmtrace.model.transformer import Transformer


FAMILY = Family(
    name="llama",
    title="Llama",
    model=Transformer,
    hf_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"},
    gguf_archs={"llama": True, "mistral": True, "qwen2": False},
)
