"""Word-level language models with tied input/output embeddings: the study's 2-layer LSTM, and a
small causal transformer (the same interface, no recurrent state) for methods' behaviour on a
model of a different kind."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

__all__ = ["LSTMLM", "TransformerLM", "MODEL_SIZES", "ARCHITECTURES", "make_lm"]

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


class TransformerLM(nn.Module):
    """Embedding + learned positions → dropout → ``layers`` causal
    ``nn.TransformerEncoderLayer`` (``heads`` heads, feed-forward 4H, post-norm) → logits
    ``h·Eᵀ`` (tied, no bias): a GPT-style decoder-only model (Radford et al., 2018) in the form of
    PyTorch's word_language_model example, where each ``bptt`` chunk is attended causally and
    nothing carries over between chunks.

    Args:
        vocab_size: V. hidden: H (a multiple of ``heads``). layers, heads, dropout: as named.
        max_len: longest chunk (positions learned up to it).

    Shapes: ``forward(tokens (T, B) int64, state) -> (logits (T, B, V) float32, ())``; ``state``
    is accepted and ignored (``init_state`` gives ``()``), so training loops written for
    :class:`LSTMLM` run unchanged.

    Raises:
        ValueError: bad sizes (H not a multiple of ``heads``, ...), or ``T > max_len``.
    """

    def __init__(self, vocab_size: int, hidden: int, layers: int = 2, dropout: float = 0.2,
                 heads: int = 4, max_len: int = 512):
        super().__init__()
        if vocab_size < 2 or hidden < 1 or layers < 1 or heads < 1 or hidden % heads or not 0.0 <= dropout < 1.0:
            raise ValueError(f"bad model size: vocab_size={vocab_size} hidden={hidden} layers={layers} "
                             f"heads={heads} (hidden must be a multiple of heads) dropout={dropout}")
        self.hidden, self.layers, self.max_len = hidden, layers, max_len
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.drop = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.uniform_(self.position.weight, -0.1, 0.1)

    def init_state(self, batch: int) -> tuple:
        """No recurrent state: ``()``."""
        return ()

    def forward(self, tokens: torch.Tensor, state=None):
        """Logits (T, B, V) for tokens (T, B) int64 (each position sees itself and earlier ones)."""
        length = tokens.shape[0]
        if length > self.max_len:
            raise ValueError(f"chunk of {length} tokens is longer than max_len={self.max_len}")
        positions = torch.arange(length, device=tokens.device).unsqueeze(1)
        x = self.drop(self.embedding(tokens) + self.position(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        out = self.encoder(x, mask=mask, is_causal=True)
        return self.drop(out) @ self.embedding.weight.t(), ()


#: ``--arch`` choices of the training script
ARCHITECTURES = {"lstm": LSTMLM, "transformer": TransformerLM}


def make_lm(arch: str, vocab_size: int, size: str, dropout: float = 0.2) -> nn.Module:
    """The language model ``arch`` (``"lstm"`` or ``"transformer"``) of hidden size
    ``MODEL_SIZES[size]``.

    Raises:
        ValueError: unknown ``arch`` or ``size``.
    """
    if arch not in ARCHITECTURES or size not in MODEL_SIZES:
        raise ValueError(f"unknown model {arch!r}/{size!r}: arch is one of {sorted(ARCHITECTURES)}, "
                         f"size one of {sorted(MODEL_SIZES)}")
    return ARCHITECTURES[arch](vocab_size, MODEL_SIZES[size], dropout=dropout)
