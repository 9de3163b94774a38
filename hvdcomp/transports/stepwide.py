"""Step-wide methods and their transport: methods that compress every gradient of a step together
and reduce it with their own collectives (PowerSGD, global top-k, CLT-k, two-phase), in the shape
of PyTorch DDP's PowerSGD hook: a state object (the method: hyper-parameters, residuals, factors,
counters, all checkpointable and staged) and a reduce step (:meth:`StepMethod.reduce_batch`)
over the collectives of one step (:class:`hvdcomp.comm.stepcomm.StepComm`).

:class:`FlatStepMethod` is the common base of the methods that see the whole model as one vector
(gtopk, cltk, twophase): per step, per device, ``acc = concat(grad.float()) + residual`` (float32,
n elements, the parameters in the optimizer's order); the method returns the averaged dense
result and this rank's new residual, what of ``acc`` it did not deliver (error feedback,
:class:`hvdcomp.memory.Residuals`).
"""
from __future__ import annotations

import abc
from typing import Dict, List, Tuple

import torch

from ..compressors.base import Method, cast_saturating, check_floating
from ..compressors.topk import check_density, num_kept
from ..memory import Residuals
from .base import Transport, Wiring

__all__ = ["StepMethod", "FlatStepMethod", "SparseStepMethod", "StepTransport", "reduce_step"]


class StepMethod(Method):
    """A method that reduces all gradients of a step at once (see the module docstring); its
    error feedback, where it has one, is built in."""

    builtin_error_feedback = True
    #: it needs each gradient's own matrix shape (``granularity="bucket"`` is refused)
    needs_shapes = True
    #: every step's first collective is ``comm.allreduce_mean`` of a float32 or float64 tensor, so
    #: the step's verdict can ride on it (:meth:`hvdcomp.agreement.NonFiniteGuard.riding`)
    verdict_rides = False

    def encode(self, tensor, name=None, segments=None):
        """Refused: a step-wide method has no per-tensor payload.

        Raises:
            TypeError: always (naming :meth:`reduce_batch` and the optimizer that calls it; an
                integer or bool tensor first as every method refuses it).
        """
        if isinstance(tensor, torch.Tensor):
            check_floating(tensor, self.name)
        raise TypeError(f"{self.name} compresses all gradients of a step together and reduces them "
                        "with its own collectives: use it through hvdcomp.DistributedOptimizer, which "
                        "calls reduce_batch()")

    decode = compress = decompress = encode  # (stock hvd.DistributedOptimizer gets the same TypeError)

    @abc.abstractmethod
    def reduce_batch(self, named_grads: List[Tuple[str, torch.Tensor]], comm, timer) -> List[torch.Tensor]:
        """Average all gradients of a step over the ranks.

        Args:
            named_grads: ``(name, gradient)`` pairs in the same order on every rank (any shapes,
                floating dtypes).
            comm: a :class:`hvdcomp.comm.stepcomm.StepComm` of the optimizer's group.
            timer: a :class:`hvdcomp.metrics.PhaseTimer` (compress / communicate / decompress).

        Returns:
            The averaged gradients, shapes and dtypes as given (values saturated to the dtype).
        """


class FlatStepMethod(StepMethod):
    """Base of whole-model methods: see the module docstring. Subclasses implement
    :meth:`reduce_flat`.

    State: ``residual`` per parameter name (float32, the gradient's shape), per rank; rescaled
    with an AMP loss scale (:meth:`rescale_state`).
    """

    has_scaled_state = True
    needs_shapes = False  # the whole model is one vector: granularity makes no difference

    def __init__(self):
        self.memory = Residuals(self, "residual")

    @abc.abstractmethod
    def reduce_flat(self, acc: torch.Tensor, comm, timer) -> Tuple[torch.Tensor, torch.Tensor]:
        """Reduce one device's flat compensated gradient.

        Args:
            acc: 1-D float32 (n,), this rank's gradients plus residual (the method may modify it).
            comm: a :class:`hvdcomp.comm.stepcomm.StepComm`.
            timer: a :class:`hvdcomp.metrics.PhaseTimer`.

        Returns:
            ``(mean, residual)``: the averaged result, float32 (n,), identical on every rank, and
            this rank's new residual, float32 (n,).
        """

    def reduce_batch(self, named_grads, comm, timer):
        out: List[torch.Tensor] = [None] * len(named_grads)  # type: ignore[list-item]
        by_device: Dict[torch.device, List[int]] = {}
        for i, (_, g) in enumerate(named_grads):
            by_device.setdefault(g.device, []).append(i)
        for device, positions in by_device.items():
            names = [named_grads[i][0] for i in positions]
            with timer.phase("compress"):
                acc = torch.cat([named_grads[i][1].reshape(-1).to(torch.float32) for i in positions])
                self.memory.compensate_flat_(acc, names, [named_grads[i][1].numel() for i in positions])
            if acc.numel():  # (the same n on every rank: all skip an empty model together)
                mean, residual = self.reduce_flat(acc, comm, timer)
            else:
                mean, residual = acc, acc
            with timer.phase("decompress"):
                self.memory.keep_flat(residual, names, [named_grads[i][1].shape for i in positions])
                start = 0
                for i in positions:
                    g = named_grads[i][1]
                    stop = start + g.numel()
                    out[i] = cast_saturating(mean[start:stop].view(g.shape), g.dtype)
                    start = stop
        return out

    def rescale_state(self, factor):
        self.memory.rescale(factor)

    def state_dict(self):
        return {"residual": self.memory.state()}

    def load_state_dict(self, state):
        self._check_state_keys(state, "residual")
        self.memory.load(state.get("residual", {}))


class SparseStepMethod(FlatStepMethod):
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


class StepTransport(Transport):
    """Carries a step-wide method: nothing travels during backward; :meth:`finish` hands every
    ``(name, gradient)`` to the method's ``reduce_batch`` and writes the averaged results back
    into ``p.grad``. ``deferred``: the optimizer agrees on the step first, so a skipped step runs
    no collective and leaves the method's state untouched.

    Args:
        wiring: the optimizer's :class:`~hvdcomp.transports.base.Wiring` (its ``step_comm``,
            timer, method, units and parameter ``names``; ``op_sum`` scales the means).
    """

    deferred = True

    def __init__(self, wiring: Wiring):
        self.timer, self.compression, self.step_comm = wiring.timer, wiring.compression, wiring.step_comm
        self.units, self.names, self.scale = wiring.units, wiring.names, wiring.scale
        self.dense_bytes = sum(p.numel() * 4 for p in self.units.order)  # fp32-equivalent, per step

    busy = False  # never holds a step in progress between calls

    def start(self, u: int) -> None:
        """Prepare unit ``u``'s gradients (zeros where unused, sparse made dense); nothing travels."""
        for i in self.units.members[u]:
            p = self.units.order[i]
            if p.grad is None or p.grad.is_sparse:
                self.units.gradient(p)

    def reset(self) -> None:
        """Nothing to drop: a step-wide step runs within :meth:`finish`."""

    @property
    def verdict_rides(self) -> bool:
        """The step's verdict can ride on the method's first allreduce (``finish(riding)``)."""
        return getattr(self.compression, "verdict_rides", False)

    def finish(self, riding=None) -> None:
        """Reduce every gradient (``p.grad``, any shape and float dtype) and write the averaged
        result back into ``p.grad``; counts the fp32-equivalent dense bytes. ``riding``: the
        step's verdict carried by the first allreduce
        (:meth:`hvdcomp.agreement.NonFiniteGuard.riding` over this transport's ``allreduce_mean``;
        a skip raises :class:`~hvdcomp.agreement.StepSkipped` before any result is written)."""
        reduce_step(self.compression, self.names, [p.grad for p in self.units.order], self.step_comm, self.timer,
                    self.scale, riding)
        self.timer.add_bytes(dense=self.dense_bytes)


def reduce_step(compression, names: List[str], targets: List[torch.Tensor], comm, timer, scale: float = 1.0,
                riding=None) -> None:
    """A step-wide method's step, for every front-end: ``reduce_batch`` of the ``targets`` (the
    step's gradients, any shape and float dtype, named ``names``, in the expected backward order)
    over ``comm`` (a :class:`hvdcomp.comm.stepcomm.StepComm`); the averaged results (``× scale``)
    are written back into ``targets``. ``riding``: ``f(allreduce_mean) -> allreduce_mean`` that
    carries the step's verdict on the first allreduce
    (:meth:`hvdcomp.agreement.NonFiniteGuard.riding`; a skip raises
    :class:`~hvdcomp.agreement.StepSkipped` before any target is written)."""
    if riding is not None:
        riding = riding(comm.allreduce_mean)
        comm = comm.replaced(riding)
    grads = compression.reduce_batch(list(zip(names, targets)), comm, timer)
    if riding is not None:
        riding.settle()
    with timer.phase("decompress"):
        torch._foreach_copy_(targets, grads)
        if scale != 1.0:
            torch._foreach_mul_(targets, scale)
