"""Tiny random checkpoints, written by the tests themselves: HF directories and GGUF files.

Every builder starts from a transformers model with random weights (`make_hf_model`), so that the same numbers exist
in two forms: the HF model in memory (the numerical reference) and a checkpoint on disk that llmtrace loads.

    TinySpec          the shape of a tiny model (2 layers, width 64 by default) and its family
    make_hf_model     transformers' LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM with random weights
    write_hf_dir      config.json + model.safetensors (or shards + index) + tokenizer.json + tokenizer_config.json
    write_gguf        a llama.cpp-style GGUF: metadata, gpt2 tokenizer, q/k rows permuted, tensors quantized per plan

Widths are multiples of 32 so that every matrix can be quantized (the GGML block formats work on 32 columns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
BOS, EOS = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokens become vectors, vectors pass through the layers, and the last one predicts the next token.",
    "Attention looks back at every earlier position; the cache keeps their keys and values.",
    "Hello world! hello there, the theory of everything is 42 and then some more text.",
    "Once upon a time there was a tiny model that had only two layers and sixty-four widths.",
]
VOCAB_SIZE = 320  # 3 specials + 256 byte characters + 61 merges
PROMPT = "The quick brown fox jumps over the lazy dog. Attention looks back at every earlier position."


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE, corpus: list[str] = CORPUS):
    """A byte-level BPE trained on CORPUS (or `corpus`), the specials first. Deterministic for a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def tokenizer_lists(tok) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, GGUF token types, merges as "a b") of a trained byte-level BPE."""
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


def write_tokenizer(path: Path, tok) -> None:
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[BOS],
        "eos_token": SPECIALS[EOS],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# ----------------------------------------------------------------------------------------------------------------
# HF models


@dataclass
class TinySpec:
    arch: str = "llama"  # llama, mistral or qwen2
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2  # 4 for MHA
    head_dim: Optional[int] = None  # None: d_model // n_heads
    ffn_dim: int = 128
    vocab_size: int = VOCAB_SIZE
    max_pos: int = 128
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # e.g. llama3: {"rope_type": "llama3", "factor": 8.0, ...}
    rms_eps: float = 1e-5
    tie: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)  # more config.json fields


def hf_config(spec: TinySpec):
    import transformers

    rope = {"rope_type": "default", "rope_theta": spec.rope_theta, **(spec.rope_scaling or {})}
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.ffn_dim,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
        max_position_embeddings=spec.max_pos, rms_norm_eps=spec.rms_eps, tie_word_embeddings=spec.tie,
        rope_parameters=rope, bos_token_id=BOS, eos_token_id=EOS, attn_implementation="eager", **spec.extra,
    )  # fmt: skip
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.arch == "llama":
        return transformers.LlamaConfig(**common)
    if spec.arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(spec.arch)


def make_hf_model(spec: TinySpec):
    """The transformers model for `spec`, float32, eager attention, with weights large enough to matter: matrices
    N(0, 0.2^2), embeddings N(0, 1), biases N(0, 0.2^2), RMSNorm gammas 1 + N(0, 0.3^2)."""
    import transformers

    config = hf_config(spec)
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[spec.arch]  # fmt: skip
    torch.manual_seed(spec.seed)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding and is listed once
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    if spec.tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def write_hf_dir(path: Path, spec: TinySpec, *, shard_size: Optional[str] = None, tokenizer: bool = True):
    """Write an HF checkpoint directory for `spec`; returns the transformers model that holds the same weights."""
    path.mkdir(parents=True, exist_ok=True)
    model = make_hf_model(spec)
    model.save_pretrained(str(path), **({"max_shard_size": shard_size} if shard_size else {}))
    if tokenizer:
        write_tokenizer(path, tiny_tokenizer(spec.vocab_size))
    return model


# ----------------------------------------------------------------------------------------------------------------
# GGUF


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert script for llama: each head's rows (x_0..x_{h-1} | x_h..x_{2h-1}) become interleaved
    (x_0, x_h, x_1, x_{h+1}, ...), the order its pairwise RoPE wants. Works on weights (rows, D) and biases (rows,)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF parameter name -> GGUF tensor name, per layer
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_tensors(hf_model, permute: bool = True) -> dict[str, np.ndarray]:
    """The HF state dict under GGUF names, float32, q/k rows in llama.cpp order (for llama and mistral)."""
    c = hf_model.config
    out = {}
    for key, t in hf_model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if key in GGUF_TOP:
            name = GGUF_TOP[key]
        else:
            i, _, sub = key[len("model.layers."):].partition(".")
            name = f"blk.{i}.{GGUF_NAMES[sub]}"
        a = t.detach().float().numpy().copy()
        if permute and ".attn_q." in name:
            a = permute_rope_rows(a, c.num_attention_heads)
        elif permute and ".attn_k." in name:
            a = permute_rope_rows(a, c.num_key_value_heads)
        out[name] = a
    return out


# name -> quantization type; None keeps F32. The default plan puts every type the gguf package can write into one file.
QuantPlan = Callable[[str, np.ndarray], Optional[str]]


def mixed_plan(name: str, a: np.ndarray) -> Optional[str]:
    if a.ndim == 1:
        return None  # norms and biases stay F32, as llama.cpp keeps them
    kinds = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
             "ffn_up": "F16", "ffn_down": "BF16", "token_embd": "Q8_0", "output": "Q4_1"}  # fmt: skip
    for part, kind in kinds.items():
        if f".{part}." in name or name.startswith(part + "."):
            return kind
    return None


def write_gguf(
    path: Path,
    hf_model,
    *,
    plan: QuantPlan = mixed_plan,
    arch: str = "llama",
    tokenizer=None,
    rope_freqs: Optional[np.ndarray] = None,
    name: str = "tiny",
    vocab_metadata: bool = False,
) -> dict[str, tuple[str, np.ndarray]]:
    """Write `hf_model` as a GGUF file the way llama.cpp's converter would. Returns {gguf name: (type, float32 values
    the file holds after dequantization, in the file's row order)}."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    c = hf_model.config
    tok = tokenizer or tiny_tokenizer(c.vocab_size)
    tokens, types, merges = tokenizer_lists(tok)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", name)
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    if vocab_metadata:  # a vocabulary larger than the tokenizer's list (benchmarks/scale.py)
        w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32(f"{arch}.rope.dimension_count", c.head_dim)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", BOS)
    w.add_uint32("tokenizer.ggml.eos_token_id", EOS)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)

    written: dict[str, tuple[str, np.ndarray]] = {}
    tensors = gguf_tensors(hf_model, permute=arch in ("llama", "mistral"))
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = np.asarray(rope_freqs, dtype=np.float32)
    for tname, a in tensors.items():
        kind = plan(tname, a) if tname != "rope_freqs.weight" else None
        if kind is None:
            w.add_tensor(tname, a)
            written[tname] = ("F32", a)
        elif kind == "F16":
            w.add_tensor(tname, a.astype(np.float16))
            written[tname] = ("F16", a.astype(np.float16).astype(np.float32))
        else:
            qtype = Q[kind]
            data = quantize(a, qtype)
            w.add_tensor(tname, data, raw_dtype=qtype)
            written[tname] = (kind, dequantize(data, qtype).reshape(a.shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def llama3_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as `rope_freqs.weight` for llama3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv_freq:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def token_ids(n: int, seed: int = 0, vocab: int = VOCAB_SIZE) -> torch.Tensor:
    """(1, n) random token ids."""
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
