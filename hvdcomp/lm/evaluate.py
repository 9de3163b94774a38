"""Validation of the language model, split over ranks (the sums are reduced by the caller)."""
from __future__ import annotations

import torch

from .data import batchify

__all__ = ["loss_sums", "window_loss"]


def window_loss(model, source: torch.Tensor, i: int, bptt: int, state, reduction: str = "mean"):
    """Cross-entropy of one truncated-BPTT window: rows ``i .. i+n-1`` of ``source`` predict rows
    ``i+1 .. i+n`` (n = min(bptt, rows − 1 − i)), the hidden ``state`` carried in but detached.

    Args:
        model: an :class:`~hvdcomp.lm.LSTMLM` (``model(tokens, state) -> (logits, state)``).
        source: ``(rows, sequences)`` int64 token ids (:func:`~hvdcomp.lm.batchify`).
        reduction: ``"mean"`` (nats per token) or ``"sum"``.

    Returns:
        ``(loss, new state, n)``: a scalar tensor, the model's state after the window, the rows used.
    """
    n = min(bptt, source.shape[0] - 1 - i)
    state = tuple(s.detach() for s in state)
    logits, state = model(source[i:i + n], state)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             source[i + 1:i + 1 + n].reshape(-1), reduction=reduction)
    return loss, state, n


def loss_sums(model, stream: torch.Tensor, eval_batch: int, bptt: int, rank: int, size: int) -> torch.Tensor:
    """This rank's share of the summed cross-entropy over ``stream``.

    The stream is cut into ``eval_batch`` columns (as training batches are) and rank r takes
    columns r, r+size, ...; each column is read in chunks of ``bptt`` tokens with the hidden state
    carried over.

    Args:
        model: an :class:`hvdcomp.lm.LSTMLM` (put in eval mode here, back in train mode after).
        stream: 1-D int64 token ids.
        eval_batch: number of columns over all ranks.
        bptt: tokens per chunk.
        rank, size: this rank and the world size.

    Returns:
        float64 CPU tensor ``[sum of token losses (nats), number of tokens]``; summed over ranks,
        ``exp(total[0] / total[1])`` is the perplexity.
    """
    model.eval()
    data = batchify(stream, eval_batch)[:, rank::size].to(model.embedding.weight.device)
    total = torch.zeros(2, dtype=torch.float64)  # on the CPU: the reducer may lack GPU operations
    if data.shape[1] > 0:
        state = model.init_state(data.shape[1])
        with torch.no_grad():
            for i in range(0, data.shape[0] - 1, bptt):
                loss, state, n = window_loss(model, data, i, bptt, state, reduction="sum")
                total += torch.tensor([loss.item(), float(n * data.shape[1])], dtype=torch.float64)
    model.train()
    return total
