"""A loaded model: what the generation loop, the recorder and explain need of it, and nothing of how it was loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmtrace.model.transformer import ModelConfig, Transformer

if TYPE_CHECKING:
    from llmtrace.tokens.tokenizer import TextTokenizer


@dataclass
class LoadedModel:
    name: str  # registry name or path, for display
    source: str  # "gguf" or "hf"
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: TextTokenizer
    device: torch.device
    dtype: torch.dtype
    load_s: float  # seconds spent loading (conversion included on a cold GGUF load)
    converted: bool  # True if this load had to convert a GGUF (cold start)
    # the batch loop's packed products (model.packed.PackedProducts), made on the first batch and kept with the model
    packed: object = field(default=None, repr=False, compare=False)

    @property
    def points(self):
        """The observable points the model declares (model.points.Points)."""
        return self.model.declared_points()

    @property
    def maths(self):
        """Each point's operation and each layer's plan, as the model declares them (model.maths.Maths)."""
        return self.model.maths()
