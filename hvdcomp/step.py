"""One step's state: where the step is (:class:`Status`), the method's staged state
(:class:`Staging`: the one place that opens, commits and rolls back a step of a method's state,
for every front-end), and the accumulation counters that tell when a unit's gradients are ready."""
from __future__ import annotations

import enum
from typing import List, Optional, Sequence

__all__ = ["Status", "Staging", "StepState"]


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


class Staging:
    """A method's state across one step (:class:`hvdcomp.compressors.state.StagedState`): opened at
    the step's first compression, then committed when the step counts or rolled back when it does
    not, so a skipped or discarded step leaves no trace. Every front-end (the
    :class:`~hvdcomp.reducer.Reducer`, the DDP hook's :class:`~hvdcomp.ddp.cycle.StepCycle`, the
    adaptive optimizers' compressed allreduces) drives its method's steps through one of these.

    Args:
        method: the method (``begin_step`` / ``commit`` / ``rollback``).

    Attributes:
        staged: a step is open (its updates are staged).
    """

    __slots__ = ("method", "staged")

    def __init__(self, method):
        self.method, self.staged = method, False

    def open(self) -> None:
        """Open a step (nothing when one is open)."""
        if not self.staged:
            self.method.begin_step()
            self.staged = True

    def commit(self) -> None:
        """The step counts: apply its staged updates (nothing when none is open)."""
        if self.staged:
            self.method.commit()
            self.staged = False

    def rollback(self) -> None:
        """The step does not count: drop its staged updates (nothing when none is open)."""
        if self.staged:
            self.method.rollback()
            self.staged = False


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
        return self.status in (Status.SYNCED, Status.SKIPPED)

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
