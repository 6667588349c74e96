"""A Q4_0 GGUF shaped like Llama-3.2-1B, with random weights and a full 128,256-entry vocabulary, made at run time.

    python benchmarks/llama1b_gguf.py /tmp/llama-1b-shape.Q4_0.gguf            # seed 0, tied head in Q6_K
    python benchmarks/llama1b_gguf.py FILE --seed 1 --embd Q8_0                 # another head type
    python benchmarks/fast_vs_llamacpp.py --llama-1b --no-exact --in-process    # made in a temporary directory

For benchmarks only (issue 24): never in the repository or CI. Both llama.cpp and llmtrace load the file.

- **Shape**: Llama-3.2-1B's (16 layers, D 2048, 32 query / 8 KV heads of 64, F 8192, V 128,256, tied embeddings,
  RoPE theta 500,000 with llama3 scaling stored as `rope_freqs.weight`, as llama.cpp's converter writes it).
- **Weights**: normal(0, 0.02) from torch's generator seeded with --seed (HF's initializer range), norms 1.
- **Types**: what llama.cpp's `llama-quantize ... Q4_0` makes of a tied model: every layer matrix Q4_0, and the
  token embedding (which is also the output head) Q6_K, because llama.cpp quantizes a tied embedding as the output
  tensor, and the output tensor of a Q4_0 file as Q6_K. Norms and rope_freqs F32. Q4_0 (and Q8_0) blocks come from
  the gguf package's quantizer; it has no Q6_K quantizer, so Q6_K blocks come from `q6_k` below (round to nearest
  with one scale per 16 weights, checked against `gguf.quants.dequantize` on every call). `--embd Q4_0` is
  `llama-quantize --pure`; `--embd Q8_0` a file whose head kept 8 bits.
- **Tokenizer**: byte-level BPE (`tokenizer.ggml.model` gpt2, pre-tokenizer `llama-bpe`, Llama 3's split): the 256
  byte tokens, the merges that `tokenizers`' BPE trainer learns on benchmarks/passage.txt, then seeded synthetic
  merges (a word piece + a lowercase piece, both already tokens) up to 128,000 tokens, then Llama 3's 256 special
  tokens (`<|begin_of_text|>` 128000 = BOS, `<|eot_id|>` 128009 = EOS, ...). Every merge's two parts and its result
  are tokens, so the merge list is consistent with the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

LAYERS, D, F, HEADS, KV_HEADS, HEAD_DIM = 16, 2048, 8192, 32, 8, 64
N_TOKENS, N_SPECIAL = 128000, 256  # 128,256 in all
ROPE_THETA = 500000.0
ROPE_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
BOS, EOS = 128000, 128009
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FILE_TYPE_Q4_0 = 2  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_0


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, ids 128000..128255."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 6: "<|start_header_id|>",
             7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>"}  # fmt: skip
    out, reserved = [], 0
    for i in range(N_SPECIAL):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def vocabulary(seed: int, n_tokens: int = N_TOKENS) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, GGUF token types, merges as "a b"): 128,000 byte-level BPE tokens (or n_tokens) then 256
    specials."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from llmtrace.tokens.vocab import BYTE_TO_CHAR  # GPT-2's byte alphabet, the one the project keeps

    alphabet = [BYTE_TO_CHAR[b] for b in range(256)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=n_tokens, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([(HERE / "passage.txt").read_text()], trainer)
    learned = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
               for m in json.loads(tok.to_str())["model"]["merges"]]
    tokens, merges = list(alphabet), []
    known = set(tokens)

    def add(a: str, b: str) -> bool:
        if a not in known or b not in known or a + b in known:
            return False
        tokens.append(a + b)
        known.add(a + b)
        merges.append(f"{a} {b}")
        return True

    for a, b in learned:
        assert add(a, b), (a, b)
    space = alphabet[ord(" ")]
    word = re.compile(f"^{space}?[a-z]+$")
    heads = [t for t in tokens if word.match(t)]  # word pieces: ' the', 'qu', ...
    tails = [t for t in heads if not t.startswith(space) and len(t) <= 4]  # short pieces that continue a word
    rng = random.Random(seed)
    while len(tokens) < n_tokens:
        a, b = heads[rng.randrange(len(heads))], tails[rng.randrange(len(tails))]
        if add(a, b) and len(a + b) <= 8:
            heads.append(a + b)  # a piece that later merges may extend (to 12 characters at most)
    types = [1] * n_tokens + [3] * N_SPECIAL  # 1 NORMAL, 3 CONTROL
    return tokens + special_tokens(), types, merges


# ----------------------------------------------------------------------------------------------------------------
# weights


def q6_k(rows: np.ndarray) -> np.ndarray:
    """float32 (N, K) -> Q6_K blocks (N, K / 256 * 210) uint8: per 16 weights an int8 scale of the block's float16
    d, values in [-32, 31] rounded to nearest. The layout is the one `gguf.quants.dequantize` reads: 128 bytes of low
    nibbles, 64 of high 2-bit pairs, 16 int8 scales, d."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = rows.shape
    x = rows.reshape(-1, 16, 16)  # (blocks, sub-blocks, weights)
    sub = np.abs(x).max(-1) / 31  # (blocks, 16): each sub-block's step
    d = (sub.max(-1, keepdims=True) / 127).astype(np.float16)  # (blocks, 1)
    df = d.astype(np.float32)
    sc = np.clip(np.round(np.divide(sub, df, out=np.zeros_like(sub), where=df > 0)), -128, 127).astype(np.int8)
    step = df * sc.astype(np.float32)
    q = np.round(np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 weights
    lo, hi = q & 0x0F, q >> 4
    lo = lo.reshape(-1, 2, 2, 64)  # element h*128 + j*64 + p: nibble j of byte h*64 + p
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = hi.reshape(-1, 2, 4, 32)  # element h*128 + j*32 + p: bits 2j..2j+1 of byte h*32 + p
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1).reshape(n, -1)
    back = dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(n, k)
    bound = np.repeat(step, 16, axis=1).reshape(n, k) * 1.01  # half a step of rounding, and at most as much clipped
    assert (np.abs(back - rows) <= bound + 1e-7).all(), "Q6_K blocks do not round-trip"
    return blocks


def quantize(a: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    return q6_k(a) if kind == "Q6_K" else gguf_quantize(a, GGMLQuantizationType[kind])


def write(path: Path, seed: int = 0, embd: str = "Q6_K", layers: int = LAYERS, log=print) -> Path:
    """Write the file (see the module's docstring). Returns `path`."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import llama3_rope_freqs

    t0 = time.perf_counter()
    tokens, types, merges = vocabulary(seed)
    log(f"vocabulary: {len(tokens)} tokens, {len(merges)} merges ({time.perf_counter() - t0:.0f} s)")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", f"Llama-3.2-1B shape, random weights (seed {seed}), token_embd {embd}")
    w.add_uint32("general.file_type", FILE_TYPE_Q4_0)
    w.add_uint32("llama.block_count", layers)
    w.add_uint32("llama.context_length", 131072)
    w.add_uint32("llama.embedding_length", D)
    w.add_uint32("llama.feed_forward_length", F)
    w.add_uint32("llama.attention.head_count", HEADS)
    w.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    w.add_uint32("llama.attention.key_length", HEAD_DIM)
    w.add_uint32("llama.attention.value_length", HEAD_DIM)
    w.add_float32("llama.rope.freq_base", ROPE_THETA)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.rope.dimension_count", HEAD_DIM)
    w.add_uint32("llama.vocab_size", len(tokens))
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "llama-bpe")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", BOS)
    w.add_uint32("tokenizer.ggml.eos_token_id", EOS)
    w.add_bool("tokenizer.ggml.add_bos_token", True)

    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int, kind: str, chunk: int = 8192) -> np.ndarray:
        parts = []
        for r in range(0, rows, chunk):
            a = (torch.randn(min(chunk, rows - r), cols, generator=gen) * 0.02).numpy()
            parts.append(quantize(a, kind))
        return np.concatenate(parts)

    def add(name: str, data: np.ndarray, kind: str | None = None) -> None:
        if kind is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", matrix(len(tokens), D, embd), embd)
    add("rope_freqs.weight", np.asarray(llama3_rope_freqs(HEAD_DIM, ROPE_THETA, ROPE_SCALING), dtype=np.float32))
    ones = np.ones(D, dtype=np.float32)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", ones)
        add(f"blk.{i}.attn_q.weight", matrix(HEADS * HEAD_DIM, D, "Q4_0"), "Q4_0")
        add(f"blk.{i}.attn_k.weight", matrix(KV_HEADS * HEAD_DIM, D, "Q4_0"), "Q4_0")
        add(f"blk.{i}.attn_v.weight", matrix(KV_HEADS * HEAD_DIM, D, "Q4_0"), "Q4_0")
        add(f"blk.{i}.attn_output.weight", matrix(D, HEADS * HEAD_DIM, "Q4_0"), "Q4_0")
        add(f"blk.{i}.ffn_norm.weight", ones)
        add(f"blk.{i}.ffn_gate.weight", matrix(F, D, "Q4_0"), "Q4_0")
        add(f"blk.{i}.ffn_up.weight", matrix(F, D, "Q4_0"), "Q4_0")
        add(f"blk.{i}.ffn_down.weight", matrix(D, F, "Q4_0"), "Q4_0")
    add("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    log(f"wrote {path} ({path.stat().st_size:,} bytes) in {time.perf_counter() - t0:.0f} s")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="the GGUF file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embd", default="Q6_K", choices=["Q6_K", "Q8_0", "Q4_0"],
                    help="type of the tied token embedding / output head (default Q6_K, as llama-quantize Q4_0)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    write(args.path, args.seed, args.embd, args.layers)


if __name__ == "__main__":
    main()
