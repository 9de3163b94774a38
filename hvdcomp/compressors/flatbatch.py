"""Common base of the methods that compress all gradients of a step as one vector and reduce it
with their own collectives (``gtopk``, ``cltk``, ``twophase``): one place for the flattening, the
error-feedback residual and the split back.

Per step (``reduce_batch``), per device: ``acc = concat(grad.float()) + residual`` (float32, n
elements, the parameters in the optimizer's order); the method returns the averaged dense result
and this rank's new residual: what of ``acc`` it did not deliver into the result (error
feedback: Stich et al., NeurIPS 2018; Karimireddy et al., ICML 2019).

State: ``residual`` per parameter name (float32, the gradient's shape), per rank; rescaled with an
AMP loss scale (:meth:`rescale_state`).
"""
from __future__ import annotations

import abc
from typing import Dict, List, Tuple

import torch

from .base import Compressor, cast_saturating
from .topk import check_density, num_kept

__all__ = ["FlatBatchCompressor", "GlobalSparseCompressor"]


class FlatBatchCompressor(Compressor):
    """Base class: see the module docstring. Subclasses implement :meth:`reduce_flat`."""

    summable = False
    batched = True
    whole_model = True
    builtin_error_feedback = True
    has_scaled_state = True

    def __init__(self):
        self.residual: Dict[str, torch.Tensor] = {}

    def _encode(self, tensor, name=None):
        raise TypeError(f"{self.name} compresses all gradients of a step together and reduces them "
                        "with its own collectives: use it through hvdcomp.DistributedOptimizer, which "
                        "calls reduce_batch()")

    def decode(self, payload, ctx):
        raise TypeError(f"{self.name} has no per-tensor payload; see reduce_batch()")

    @abc.abstractmethod
    def reduce_flat(self, acc: torch.Tensor, comm, timer) -> Tuple[torch.Tensor, torch.Tensor]:
        """Reduce one device's flat compensated gradient.

        Args:
            acc: 1-D float32 (n,), this rank's gradients plus residual (the method may modify it).
            comm: a :class:`hvdcomp.comm.step.StepComm`.
            timer: a :class:`hvdcomp.metrics.PhaseTimer`.

        Returns:
            ``(mean, residual)``: the averaged result, float32 (n,), identical on every rank, and
            this rank's new residual, float32 (n,).
        """

    def reduce_batch(self, named_grads: List[Tuple[str, torch.Tensor]], comm, timer) -> List[torch.Tensor]:
        """Average all gradients of a step over the ranks (see the module docstring).

        Args:
            named_grads: ``(name, gradient)`` pairs in the same order on every rank.
            comm: a :class:`hvdcomp.comm.step.StepComm` of the optimizer's group.
            timer: a :class:`hvdcomp.metrics.PhaseTimer` (compress / communicate / decompress).

        Returns:
            The averaged gradients, shapes and dtypes as given (values saturated to the dtype).
        """
        out: List[torch.Tensor] = [None] * len(named_grads)  # type: ignore[list-item]
        by_device: Dict[torch.device, List[int]] = {}
        for i, (_, g) in enumerate(named_grads):
            by_device.setdefault(g.device, []).append(i)
        for device, positions in by_device.items():
            with timer.phase("compress"):
                acc = torch.cat([named_grads[i][1].reshape(-1).to(torch.float32) for i in positions])
                start = 0
                for i in positions:
                    name, g = named_grads[i]
                    e = self._get("residual", name)
                    if e is not None:
                        acc[start:start + g.numel()] += e.reshape(-1)
                    start += g.numel()
            if acc.numel():  # (the same n on every rank: all skip an empty model together)
                mean, residual = self.reduce_flat(acc, comm, timer)
            else:
                mean, residual = acc, acc
            with timer.phase("decompress"):
                start = 0
                for i in positions:
                    name, g = named_grads[i]
                    stop = start + g.numel()
                    self._put("residual", name, residual[start:stop].view(g.shape))
                    out[i] = cast_saturating(mean[start:stop].view(g.shape), g.dtype)
                    start = stop
        return out

    def rescale_state(self, factor):
        for e in self.residual.values():
            e.mul_(factor)

    def state_dict(self):
        return {"residual": {k: v.clone() for k, v in self.residual.items()}}

    def load_state_dict(self, state):
        unknown = sorted(set(state) - {"residual"})
        if unknown:
            raise ValueError(f"{self.name} state has only 'residual', got keys {unknown}")
        self.residual = {k: v.clone() for k, v in state.get("residual", {}).items()}


class GlobalSparseCompressor(FlatBatchCompressor):
    """A sparsifier over the whole model: k = max(1, ceil(ρ·n)) of its n entries; the residual
    is ``acc`` with the positions this rank delivered zeroed, so that over all ranks
    ``size · mean + Σ residual = Σ acc``: nothing is lost, only delayed.

    Args:
        density: ρ in (0, 1].

    Raises:
        ValueError: ``density`` not in (0, 1].
    """

    def __init__(self, density: float = 0.01):
        super().__init__()
        self.density = check_density(density)

    def describe(self):
        return {"name": self.name, "density": self.density}

    def nominal_ratio(self, numel):
        return numel / max(1, num_kept(numel, self.density)) / 2.0

    @abc.abstractmethod
    def reduce_sparse(self, acc: torch.Tensor, k: int, comm, timer) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(mean, sent)``: the averaged result, float32 (n,), and the int64 positions whose
        values of this rank are inside it (see :meth:`reduce_flat`)."""

    def reduce_flat(self, acc, comm, timer):
        mean, sent = self.reduce_sparse(acc, num_kept(acc.numel(), self.density), comm, timer)
        acc[sent] = 0  # what stays: the residual
        return mean, acc
