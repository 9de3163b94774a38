"""``randomk``: random-k sparsification with indices shared by all ranks.

Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k with memory);
Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed Optimization",
NeurIPS 2018. Every rank draws the same k indices from a dedicated ``torch.Generator`` seeded from
(seed, parameter name, step), so only the values travel and Horovod allreduce averages them. The
global RNG is never touched.
"""
from __future__ import annotations

import math
import zlib

import torch

from .base import Compressor
from .registry import register
from .topk import check_density, num_kept

_MASK63 = (1 << 63) - 1


def shared_seed(seed: int, name: str, step: int) -> int:
    """A seed equal on every rank for (seed, parameter name, step); Python's ``hash`` is not."""
    return ((seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_003 + step) & _MASK63


@register("randomk")
class RandomKCompressor(Compressor):
    """Keep k = max(1, ceil(ρ·n)) uniformly random entries, the same on every rank.

    Args:
        density: ρ in (0, 1].
        seed: base seed (the same on every rank).

    Payload: ``[values (k,) float32]``; indices are regenerated locally, so 4 bytes per kept
    element travel (nominal ratio counts indices anyway, as the study does). Error feedback is on
    by default (``ef=false`` to turn it off; the study shows that diverges).

    State: a step counter per parameter name (``state_dict()["steps"]``).

    Raises:
        ValueError: density not in (0, 1]; from :meth:`encode`, a missing parameter name.
    """

    name = "randomk"
    summable = True
    default_error_feedback = True
    shared_state_keys = ("steps",)  # the indices derive from (seed, name, step) on every rank

    def __init__(self, density: float = 0.01, seed: int = 0):
        self.density = check_density(density)
        self.seed = int(seed)
        self.steps = {}

    def describe(self):
        return {"name": self.name, "density": self.density, "seed": self.seed}

    def nominal_ratio(self, numel):
        return numel / max(1, num_kept(numel, self.density)) / 2.0

    def indices(self, numel: int, name: str, step: int, device=None) -> torch.Tensor:
        """The k shared indices (int64, sorted) for this parameter and step."""
        k = num_kept(numel, self.density)
        gen = torch.Generator().manual_seed(shared_seed(self.seed, name, step))
        idx = torch.randperm(numel, generator=gen)[:k].sort().values
        return idx.to(device) if device is not None else idx

    def _encode(self, tensor, name=None):
        if name is None:
            raise ValueError("randomk seeds its indices from the parameter name: use "
                             "hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        step = self._get("steps", name, 0)
        self._put("steps", name, step + 1)
        flat = tensor.reshape(-1)
        idx = self.indices(flat.numel(), name, step, flat.device)
        return [flat[idx].to(torch.float32)], (tensor.shape, tensor.dtype, idx)

    def decode(self, payload, ctx):
        shape, dtype, idx = ctx
        out = torch.zeros(math.prod(shape), dtype=torch.float32, device=payload[0].device)
        out[idx] = payload[0]
        return out.reshape(shape).to(dtype)

    def state_dict(self):
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state):
        self.steps = dict(state.get("steps", {}))
