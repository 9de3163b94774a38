"""Shared wire format of the sparsifiers: ``[values float32, indices int32/int64]``."""
from __future__ import annotations

import abc
import math

import torch

from .base import Compressor

__all__ = ["SparseCompressor", "index_dtype"]


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices when they fit (n < 2^31), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


class SparseCompressor(Compressor):
    """Base of methods whose payload is ``[values (m,) float32, indices (m,) int32]``.

    Subclasses implement :meth:`select` (which indices to send). Decoding scatter-adds values
    into zeros; :meth:`aggregate` scatter-adds every rank's payload at once, so an index sent by
    several ranks adds up, then divides by the world size.
    """

    summable = False

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, name) -> torch.Tensor:
        """Indices (int64, 1-D) of ``flat`` (1-D, n elements) to send."""

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1)
        idx = self.select(flat, name)
        return [flat[idx].to(torch.float32), idx.to(index_dtype(flat.numel()))], (tensor.shape, tensor.dtype)

    def decode(self, payload, ctx):
        values, idx = payload
        shape, dtype = ctx
        out = torch.zeros(math.prod(shape), dtype=torch.float32, device=values.device)
        out.index_add_(0, idx.long(), values)
        return out.reshape(shape).to(dtype)

    def aggregate(self, payloads, ctx):
        values = torch.cat([p[0] for p in payloads])
        idx = torch.cat([p[1] for p in payloads])
        return self.decode([values, idx], ctx).div_(len(payloads))
