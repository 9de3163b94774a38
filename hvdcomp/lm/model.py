"""Word-level 2-layer LSTM language model with tied input/output embeddings (the study's model)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

__all__ = ["LSTMLM", "MODEL_SIZES"]

#: hidden (= embedding) size of the study's small / medium / large models
MODEL_SIZES = {"small": 100, "medium": 300, "large": 500}


class LSTMLM(nn.Module):
    """Embedding → dropout → ``layers``-layer LSTM → dropout → logits ``h·Eᵀ`` (tied, no bias).

    With a 10,000-word vocabulary this has 1,161,600 / 4,444,800 / 9,008,000 parameters for
    hidden 100 / 300 / 500, as in the seed study.

    Args:
        vocab_size: V. hidden: H (embedding size too). layers: LSTM layers. dropout: probability.

    Shapes: ``forward(tokens (T, B) int64, state) -> (logits (T, B, V) float32, state)`` with
    ``state = (h, c)``, each ``(layers, B, H)``.
    """

    def __init__(self, vocab_size: int, hidden: int, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        if vocab_size < 2 or hidden < 1 or layers < 1 or not 0.0 <= dropout < 1.0:
            raise ValueError(f"bad model size: vocab_size={vocab_size} hidden={hidden} "
                             f"layers={layers} dropout={dropout}")
        self.hidden, self.layers = hidden, layers
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(hidden, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)

    def init_state(self, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zero (h, c), each (layers, batch, hidden), on the model's device and dtype."""
        w = self.embedding.weight
        z = w.new_zeros(self.layers, batch, self.hidden)
        return z, z.clone()

    def forward(self, tokens: torch.Tensor, state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        """Logits (T, B, V) for tokens (T, B) int64, and the new (h, c) state."""
        out, state = self.lstm(self.drop(self.embedding(tokens)), state)
        return self.drop(out) @ self.embedding.weight.t(), state
