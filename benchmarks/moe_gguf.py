"""A Q8_0 GGUF shaped like a small Qwen3-MoE (arch `qwen3moe`), with random weights, made at run time.

    python benchmarks/moe_gguf.py /tmp/moe.Q8_0.gguf                 # the default shape below
    python benchmarks/moe_gguf.py FILE --layers 4 --experts 16 --used 2

For benchmarks only (issue 33): never in the repository or CI. Both llama.cpp and llmtrace load the file.

- **Shape** (default): 8 layers, D 1024, 16 query / 4 KV heads of 64 with Qwen3's per-head q/k RMSNorm, a mixture
  of 32 SwiGLU experts of width 512 a layer with 4 chosen per token, vocabulary 16,256, untied head: 457M weights
  held, 105M used per token (Qwen3-30B-A3B's proportions of experts to active ones, on a machine-sized scale).
- **Tensors**: as llama.cpp's converter writes a Qwen3-MoE (`Qwen3MoeModel`): `ffn_gate_inp` [E, D] (F32, as
  llama-quantize keeps it), the experts as three 3-D tensors `ffn_{gate,up,down}_exps` [E, Fe, D] / [E, D, Fe],
  `attn_q_norm` / `attn_k_norm` [Dh]; every matrix Q8_0 (the gguf package's quantizer), norms F32.
- **Weights**: normal(0, 0.02) from torch's generator seeded with --seed; the router normal(0, 0.5), so that its
  choices are not all ties; norms 1.
- **Tokenizer**: llama1b_gguf's byte-level BPE (Llama 3's split, `llama-bpe`), cut to 16,000 tokens + 256 specials.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FILE_TYPE_Q8_0 = 7  # llama_ftype LLAMA_FTYPE_MOSTLY_Q8_0


@dataclass(frozen=True)
class Shape:
    layers: int = 8
    d: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 32
    used: int = 4
    expert_ffn: int = 512
    n_tokens: int = 16000

    def weights(self) -> tuple[int, int]:
        """(weights held, weights one token uses)."""
        attn = (self.heads + 2 * self.kv_heads) * self.head_dim * self.d + self.heads * self.head_dim * self.d
        expert = 3 * self.expert_ffn * self.d
        vocab = (self.n_tokens + 256) * self.d
        held = self.layers * (attn + self.experts * self.d + self.experts * expert) + 2 * vocab
        used = self.layers * (attn + self.experts * self.d + self.used * expert) + 2 * vocab
        return held, used


def write(path: Path, shape: Shape = Shape(), seed: int = 0, log=print) -> Path:
    """Write the file (the module's docstring). Returns `path`."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    sys.path.insert(0, str(HERE))
    from llama1b_gguf import vocabulary

    s = shape
    t0 = time.perf_counter()
    tokens, types, merges = vocabulary(seed, s.n_tokens)
    arch = "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", f"Qwen3-MoE shape, random weights (seed {seed})")
    w.add_uint32("general.file_type", FILE_TYPE_Q8_0)
    for key, value in (("block_count", s.layers), ("context_length", 4096), ("embedding_length", s.d),
                       ("feed_forward_length", 4 * s.d), ("attention.head_count", s.heads),
                       ("attention.head_count_kv", s.kv_heads), ("attention.key_length", s.head_dim),
                       ("attention.value_length", s.head_dim), ("expert_count", s.experts),
                       ("expert_used_count", s.used), ("expert_feed_forward_length", s.expert_ffn)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 1000000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "llama-bpe")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", s.n_tokens)
    w.add_uint32("tokenizer.ggml.eos_token_id", s.n_tokens + 9)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    gen = torch.Generator().manual_seed(seed)

    def q8(*shape: int, std: float = 0.02) -> np.ndarray:
        """Q8_0 blocks of a random (…, rows, cols) tensor: bytes (…, rows, cols / 32 * 34)."""
        a = (torch.randn(*shape, generator=gen) * std).numpy().reshape(-1, shape[-1])
        return quantize(a, GGMLQuantizationType.Q8_0).reshape(*shape[:-1], -1)

    def add(name: str, data: np.ndarray, quantized: bool = True) -> None:
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType.Q8_0 if quantized else None)

    V, D, Dh, E, Fe = len(tokens), s.d, s.head_dim, s.experts, s.expert_ffn
    add("token_embd.weight", q8(V, D))
    for i in range(s.layers):
        add(f"blk.{i}.attn_norm.weight", np.ones(D, dtype=np.float32), False)
        add(f"blk.{i}.attn_q.weight", q8(s.heads * Dh, D))
        add(f"blk.{i}.attn_k.weight", q8(s.kv_heads * Dh, D))
        add(f"blk.{i}.attn_v.weight", q8(s.kv_heads * Dh, D))
        add(f"blk.{i}.attn_output.weight", q8(D, s.heads * Dh))
        add(f"blk.{i}.attn_q_norm.weight", np.ones(Dh, dtype=np.float32), False)
        add(f"blk.{i}.attn_k_norm.weight", np.ones(Dh, dtype=np.float32), False)
        add(f"blk.{i}.ffn_norm.weight", np.ones(D, dtype=np.float32), False)
        add(f"blk.{i}.ffn_gate_inp.weight", (torch.randn(E, D, generator=gen) * 0.5).numpy(), False)
        add(f"blk.{i}.ffn_gate_exps.weight", q8(E, Fe, D))
        add(f"blk.{i}.ffn_up_exps.weight", q8(E, Fe, D))
        add(f"blk.{i}.ffn_down_exps.weight", q8(E, D, Fe))
    add("output_norm.weight", np.ones(D, dtype=np.float32), False)
    add("output.weight", q8(V, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    held, used = s.weights()
    log(f"wrote {path} ({path.stat().st_size:,} bytes; {held / 1e6:.0f}M weights, {used / 1e6:.0f}M a token) in "
        f"{time.perf_counter() - t0:.0f} s")
    return path


def shape_args(ap: argparse.ArgumentParser) -> None:
    d = Shape()
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--experts", type=int, default=d.experts)
    ap.add_argument("--used", type=int, default=d.used, help="experts a token runs")
    ap.add_argument("--expert-ffn", type=int, default=d.expert_ffn)
    ap.add_argument("--seed", type=int, default=0)


def shape_of(args) -> Shape:
    return Shape(layers=args.layers, experts=args.experts, used=args.used, expert_ffn=args.expert_ffn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="the GGUF file to write")
    shape_args(ap)
    args = ap.parse_args()
    write(args.path, shape_of(args), args.seed)


if __name__ == "__main__":
    main()
