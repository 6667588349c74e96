"""What a layer keeps between passes (s6.8): its memory, declared by the kind of layer that keeps it.

The seeds teach the KV cache as the memory of inference; the layers llmtrace runs remember in several ways, and each
kind of sequence mixer says which in one `Memory`:

- per token: entries that grow by one each token, one buffer per name (attention's K and V, each (Hkv, Dh); an MLA
  layer's latent c_kv and its shared RoPE key);
- constant: tensors of a fixed size, overwritten by each pass (a recurrent state, a convolution's last inputs);
- reads: nothing of its own, the per-token entries of an earlier layer (a KV-shared layer).

`KVCache` (model.transformer) allocates each layer's buffers from its declaration, and every figure the views show
(bytes per token, the constant bytes, what full multi-head attention would keep instead) comes from here: the run
event carries each layer's `record()`, and no view works a byte count out again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

# Memory.kind: a key the views translate (report catalogue "memory.<kind>"), never an English phrase.
KINDS = ("kv", "latent", "state", "window", "shared", "none")


@dataclass(frozen=True)
class Memory:
    """One layer's memory. Shapes are without the batch axis; a per-token shape is one token's entry."""

    kind: str
    per_token: dict[str, tuple[int, ...]] = field(default_factory=dict)
    constant: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reads: Optional[int] = None  # the layer whose per-token entries this one reads (it writes none)
    # what full multi-head attention with this layer's query heads would keep per token (K and V of every query
    # head), in elements: the comparison the KV section draws. 0 where the layer keeps nothing per token.
    mha_per_token: int = 0
    constant_float32: bool = True  # a recurrent state is kept in float32 whatever the model's dtype, as the reference

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown memory kind {self.kind!r}: one of {', '.join(KINDS)}")

    @property
    def per_token_elements(self) -> int:
        return sum(math.prod(s) for s in self.per_token.values())

    @property
    def constant_elements(self) -> int:
        return sum(math.prod(s) for s in self.constant.values())

    def per_token_bytes(self, element_size: int) -> int:
        """Bytes one more token adds to this layer's memory (0 in a layer that reads another's)."""
        return 0 if self.reads is not None else self.per_token_elements * element_size

    def constant_bytes(self, element_size: int) -> int:
        return self.constant_elements * (4 if self.constant_float32 else element_size)

    def mha_bytes(self, element_size: int) -> int:
        return 0 if self.reads is not None else self.mha_per_token * element_size

    def record(self, element_size: int) -> dict:
        """What the run event carries for one layer: its kind, each buffer's shape, and the bytes."""
        return {"kind": self.kind, "per_token": {n: list(s) for n, s in self.per_token.items()},
                "constant": {n: list(s) for n, s in self.constant.items()}, "reads": self.reads,
                "per_token_bytes": self.per_token_bytes(element_size),
                "constant_bytes": self.constant_bytes(element_size),
                "mha_per_token_bytes": self.mha_bytes(element_size)}


def kv_memory(n_kv_heads: int, head_dim: int, n_heads: int, v_dim: Optional[int] = None) -> Memory:
    """Attention's: K and V of every KV head, one entry a token; full MHA would keep them for every query head."""
    v_dim = head_dim if v_dim is None else v_dim
    return Memory("kv", {"k": (n_kv_heads, head_dim), "v": (n_kv_heads, v_dim)},
                  mha_per_token=n_heads * (head_dim + v_dim))


def totals(memory: list[Memory], element_size: int) -> dict:
    """The model's memory from its layers' declarations: bytes per token (growing), constant bytes, what full MHA
    would keep per token, and which layers keep what."""
    return {"bytes_per_token": sum(m.per_token_bytes(element_size) for m in memory),
            "constant_bytes": sum(m.constant_bytes(element_size) for m in memory),
            "mha_bytes_per_token": sum(m.mha_bytes(element_size) for m in memory),
            "growing_layers": [i for i, m in enumerate(memory) if m.per_token and m.reads is None],
            "constant_layers": [i for i, m in enumerate(memory) if m.constant],
            "shared_layers": [i for i, m in enumerate(memory) if m.reads is not None]}
