"""One step's state: where the step is (:class:`Status`), the one step lifecycle of every
front-end (:class:`Lifecycle`), the accumulation counters (:class:`StepState`), and the optimizer
surface the front-ends share with Horovod's (:class:`SkipSynchronize`,
:class:`LocalOptimizerSurface`)."""
from __future__ import annotations

import contextlib
import enum
from typing import Callable, Iterable, List, Optional, Sequence

import torch

from .agreement import NonFiniteGuard, StateAgreement
from .amp import LossScaleTracker

__all__ = ["Status", "SYNCED", "Lifecycle", "skipped_steps_of", "StepState", "SkipSynchronize", "LocalOptimizerSurface"]


class Status(enum.Enum):
    """Where an optimizer's step is.

    * ``IDLE``: nothing since the last ``step()`` (or ``zero_grad()``);
    * ``BACKWARD``: backward's hooks fired, the gradients are not synchronized yet;
    * ``SYNCED``: ``synchronize()`` wrote the averaged gradients; the update is not applied yet;
    * ``SKIPPED``: synchronized, and the ranks agreed to skip the step (a non-finite gradient);
    * ``CLOSED``: ``close()`` stopped communication for good.
    """

    IDLE = "idle"
    BACKWARD = "backward"
    SYNCED = "synced"
    SKIPPED = "skipped"
    CLOSED = "closed"


#: the statuses of a synchronized step whose gradients were not applied or dropped yet
SYNCED = (Status.SYNCED, Status.SKIPPED)


class Lifecycle:
    """The one step lifecycle of a method (:class:`hvdcomp.compressors.state.StagedState`), for
    every front-end: a step is opened at its first compression (:meth:`open`, or :meth:`stage`
    alone), decided (:meth:`decide`, :meth:`riding`), then committed when it counts
    (:meth:`commit`), rolled back when it does not (:meth:`rollback`) or skipped on every rank
    (:meth:`skip`), so a skipped or discarded step leaves no trace.

    Args:
        compression: the method (``begin_step`` / ``commit`` / ``rollback``, ``rescale_state``).
        nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"`` (:class:`hvdcomp.agreement.NonFiniteGuard`).
        grad_scaler: a ``torch.amp.GradScaler`` to follow, or None (then found at the first
            committed step where the method keeps state in gradient units).

    Attributes:
        staged: a step is open (its updates are staged).
        guard: the per-step :class:`~hvdcomp.agreement.NonFiniteGuard`.
        restored: the :class:`~hvdcomp.agreement.StateAgreement` on restored state.
        loss_scale: the :class:`~hvdcomp.amp.LossScaleTracker`.
        skipped_steps: steps skipped on every rank for a non-finite gradient somewhere.
    """

    def __init__(self, compression, nonfinite: str, grad_scaler=None):
        self.nonfinite, self.skipped_steps = nonfinite, 0
        self.guard, self.restored = NonFiniteGuard(nonfinite), StateAgreement()
        self.loss_scale = LossScaleTracker(grad_scaler)
        self.use(compression)

    def use(self, compression) -> None:
        """Drive ``compression`` from the next step on (between steps: a switch of ``auto``)."""
        self.compression, self.staged = compression, False

    def state_dict(self, auto=None) -> dict:
        """Every front-end's checkpoint of its method: the method's state and the skipped-step
        count (tensors, numbers and strings only); with ``compression="auto"``'s ``auto``, every
        candidate's state, the choice and the carry too (under ``"auto"``)."""
        state = {"compression": self.compression.state_dict(), "skipped_steps": self.skipped_steps}
        if auto is not None:
            state["auto"] = auto.state_dict()
        return state

    def load_state_dict(self, state: dict, auto=None) -> None:
        """Inverse of :meth:`state_dict` (``auto`` installs its saved choice first, which
        :meth:`use` s it); the ranks agree on the restored state at the next step."""
        if auto is not None and "auto" in state:
            auto.load_state_dict(state["auto"])
        self.compression.load_state_dict(state["compression"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.restored.note_load()

    def stage(self) -> None:
        """Open a step of the method's state (nothing when one is open)."""
        if not self.staged:
            self.compression.begin_step()
            self.staged = True

    def open(self, group, prefix: str, rescale: Iterable[Callable[[float], None]] = ()) -> None:
        """A step's first compression: agree with every rank on restored state (once, collective
        over ``group``, names prefixed ``prefix``), follow a loss-scale change (the method's
        state, and each of ``rescale``, times the factor), stage the method's state. Nothing
        when a step is open."""
        if self.staged:
            return
        if not self.restored.agreed:
            self.skipped_steps = self.restored.agree(group, self.compression, self.skipped_steps, prefix)
        factor = self.loss_scale.factor()
        if factor is not None:
            self.compression.rescale_state(factor)
            for f in rescale:
                f(factor)
        self.stage()

    def commit(self, optimizer=None) -> None:
        """The step's update was applied: commit its staged state (with a method whose state is
        in gradient units, ``optimizer`` is where a ``GradScaler`` is looked for)."""
        if self.staged:
            if optimizer is not None and self.compression.has_scaled_state:
                self.loss_scale.discover(optimizer)
            self.compression.commit()
            self.staged = False

    def rollback(self) -> None:
        """The step does not count: drop its staged state (nothing when none is open)."""
        if self.staged:
            self.compression.rollback()
            self.staged = False

    def decide(self, group, gatherer, passes: int, summed=None, timer=None) -> bool:
        """Whether every rank skips this step (:meth:`hvdcomp.agreement.NonFiniteGuard.decide`;
        the exchange timed as ``communicate``). ``gatherer`` None: every flag is on results
        identical on every rank, so this rank decides alone."""
        loaded, self.restored.loaded_since_step = self.restored.loaded_since_step, False
        if gatherer is None:
            return self.guard.agree(lambda v: [list(v)], loaded, passes).skip
        with timer.phase("communicate") if group.size > 1 else contextlib.nullcontext():
            return self.guard.decide(group, gatherer, summed, loaded, passes).skip

    def riding(self, size: int, exchange, passes: int):
        """``f(allreduce_mean)``: the step's verdict riding on a step-wide method's first
        allreduce (:meth:`hvdcomp.agreement.NonFiniteGuard.riding`)."""
        loaded, self.restored.loaded_since_step = self.restored.loaded_since_step, False
        return lambda mean: self.guard.riding(mean, size, exchange, loaded, passes)

    def skip(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every rank skips the step: its state rolled back, counted, and every one of ``tensors``
        NaN (as an allreduced Inf would be, so a ``GradScaler`` sees the overflow)."""
        self.rollback()
        self.skipped_steps += 1
        for t in tensors:
            t.fill_(float("nan"))


def skipped_steps_of(life: Callable) -> property:
    """A front-end's ``skipped_steps`` (read and set): that of its :class:`Lifecycle`, ``life(self)``."""
    return property(lambda self: life(self).skipped_steps,
                    lambda self, value: setattr(life(self), "skipped_steps", int(value)),
                    doc="Steps skipped on every rank because some rank had a non-finite gradient.")


class StepState:
    """The step in progress.

    Args:
        members: per compression unit, the positions of its parameters (in expected backward
            order); every parameter is in exactly one unit.
        passes: ``backward_passes_per_step``.
        draw_order: a :class:`hvdcomp.compressors.rng.DrawOrder` to keep the order in which
            gradients are completed in (a fused pipeline of a method that draws at each call),
            or None.

    Attributes:
        status: a :class:`Status`.
        started: per unit, whether its transport has started it this step.
    """

    def __init__(self, members: Sequence[Sequence[int]], passes: int, draw_order=None):
        self.unit_of = [0] * sum(len(m) for m in members)  # per parameter, its unit
        for u, m in enumerate(members):
            for i in m:
                self.unit_of[i] = u
        self.sizes = [len(m) for m in members]
        self.status = Status.IDLE
        self.draw_order = draw_order
        self.restart(passes)

    def restart(self, passes: int) -> None:
        """New accumulation counters: every parameter waits for ``passes`` backward passes."""
        self.passes = passes
        self.delay: List[int] = [passes] * len(self.unit_of)
        self.waiting: List[int] = list(self.sizes)  # per unit: gradients still to come
        self.started: List[bool] = [False] * len(self.sizes)
        self.ready: Optional[List[int]] = None  # with a draw order: the gradients completed, in order
        if self.draw_order is not None:
            self.ready = []
            self.draw_order.restart(self.ready)

    @property
    def synced(self) -> bool:
        """``synchronize()`` ran and its gradients were not applied or dropped yet."""
        return self.status in SYNCED

    def gradient_ready(self, i: int) -> Optional[int]:
        """Backward produced parameter ``i``'s gradient: count it; returns its unit when that unit
        is now complete (every member has had its last backward pass), else None.

        Raises:
            AssertionError: more backward passes than ``backward_passes_per_step`` before
                ``step()`` or ``synchronize()`` (Horovod's message).
        """
        if self.delay[i] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to "
                "step() or synchronize(). Increase backward_passes_per_step to accumulate "
                "gradients locally.")
        self.delay[i] -= 1
        self.status = Status.BACKWARD
        if self.delay[i]:
            return None
        if self.ready is not None:
            self.ready.append(i)
        u = self.unit_of[i]
        self.waiting[u] -= 1
        return u if self.waiting[u] == 0 else None


class SkipSynchronize:
    """Horovod's clipping recipe, ``opt.synchronize(); clip; with opt.skip_synchronize(): opt.step()``:
    inside the block ``_sync_on_step`` is False, so a ``step()`` that synchronizes first skips it;
    a front-end whose ``synchronize()`` has nothing to wait for runs the block as it is."""

    _sync_on_step = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip ``synchronize()`` (call it yourself first, e.g. to clip gradients)."""
        self._sync_on_step = False
        try:
            yield
        finally:
            self._sync_on_step = True


class LocalOptimizerSurface(SkipSynchronize):
    """The ``torch.optim.Optimizer`` surface of a front-end that steps a local optimizer (its
    attribute named by ``_local_optimizer``) and averages no gradient before ``step()``:
    ``param_groups``, ``state`` and ``zero_grad`` are that optimizer's; ``synchronize()`` and
    :meth:`SkipSynchronize.skip_synchronize` do nothing (kept so loops written for
    :func:`hvdcomp.DistributedOptimizer` run unchanged)."""

    _local_optimizer = "optimizer"

    @property
    def param_groups(self):
        """The local optimizer's parameter groups (learning-rate schedules set them)."""
        return getattr(self, self._local_optimizer).param_groups

    @property
    def state(self):
        """The local optimizer's state (momentum buffers, ...)."""
        return getattr(self, self._local_optimizer).state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The local optimizer's ``zero_grad``."""
        getattr(self, self._local_optimizer).zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Nothing to do: no gradient is averaged before ``step()``."""
