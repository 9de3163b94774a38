"""The DDP hook's step in progress over the one step lifecycle (:class:`hvdcomp.step.Lifecycle`):
when DDP's step opens, commits, rolls back or skips the method's state (docs/ddp.md, "State
follows what is applied"; DDP's own: a joined rank's shadow steps, accumulation without
``no_sync``). The hook drives it:

================================ ========================= =================================================
call                             from                      status after
================================ ========================= =================================================
:meth:`StepCycle.open`           a backward's first bucket ``BACKWARD`` (state staged)
:meth:`StepCycle.agree`          the last bucket           (the per-step verdict; raises or skips)
:meth:`StepCycle.skip`           the last bucket, a skip   ``SKIPPED`` (rolled back, results NaN)
:meth:`StepCycle.reduced`        the last bucket, done     ``SYNCED`` (or ``SKIPPED``)
:meth:`StepCycle.apply`          ``optimizer.step()``      committed; a skipped step is not applied
:meth:`StepCycle.forward_starts` the model's forward       discarded (``IDLE``) if the gradients were zeroed
:meth:`StepCycle.zeroed`         ``optimizer.zero_grad()`` discarded (``IDLE``)
:meth:`StepCycle.discard`        an error, a loaded state  ``IDLE`` (a skip agreed on stays ``SKIPPED``)
================================ ========================= =================================================
"""
from __future__ import annotations

import contextlib
import types
from typing import List

from ..step import Lifecycle, Status
from .buckets import Bucket

__all__ = ["StepCycle"]


class StepCycle:
    """The step in progress of one DDP hook.

    Args:
        group: the :class:`~hvdcomp.comm.torchdist.TorchDistGroup` the ranks agree in.
        nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"`` (:class:`hvdcomp.agreement.NonFiniteGuard`).
        grad_scaler: a ``torch.amp.GradScaler`` to follow, or None (found at the first applied
            step where the method keeps state in gradient units).
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (the agreement's exchange is ``communicate``).
        compression: the method whose state is staged (``begin_step`` / ``commit`` /
            ``rollback``; the hook installs another where ``compression="auto"`` switches).

    Attributes:
        status: a :class:`hvdcomp.step.Status`.
        life: the :class:`hvdcomp.step.Lifecycle`.
        backward_steps: synchronized backward passes reduced so far.
        optimizer: the attached optimizer, or None.
        auto: ``compression="auto"``'s :class:`hvdcomp.auto.AutoState`, told of every step
            committed, skipped (on every rank, a joined one too) or dropped; else None.
    """

    def __init__(self, group, nonfinite: str, grad_scaler, timer, compression):
        self.group, self.nonfinite, self.timer, self.auto = group, nonfinite, timer, None
        self.life, self.status = Lifecycle(compression, nonfinite, grad_scaler), Status.IDLE
        self.backward_steps = 0
        self.optimizer = self._original_step = self._original_zero_grad = None
        self._shadowing = False
        self.joining = None  # (a weak reference to the DDP model, from ``ddp_model.join()`` to its end)

    # ---- how the hook learns the step was applied --------------------------------------------------
    def attach(self, optimizer) -> None:
        """``optimizer.step`` becomes a bound method (LR schedulers wrap it) calling :meth:`apply`;
        ``optimizer.zero_grad`` one calling :meth:`zeroed` first."""
        original, original_zero_grad = optimizer.step, optimizer.zero_grad
        cycle = self

        def step(opt, *args, **kwargs):
            return cycle.apply(original, args, kwargs)

        def zero_grad(opt, *args, **kwargs):
            cycle.zeroed()
            return original_zero_grad(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)
        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
        self.optimizer, self._original_step, self._original_zero_grad = optimizer, original, original_zero_grad

    def detach(self) -> None:
        """Give the attached optimizer its own ``step`` and ``zero_grad`` back."""
        if self.optimizer is not None:
            self.optimizer.step = self._original_step
            self.optimizer.zero_grad = self._original_zero_grad
        self.optimizer = self._original_step = self._original_zero_grad = None

    def apply(self, original, args, kwargs):
        """The attached optimizer's step: skipped (None) after a non-finite step, else applied and
        the step's compressor state committed."""
        if self.status is Status.SKIPPED:
            self.status = Status.SYNCED
            return None
        result = original(*args, **kwargs)
        if self.unapplied:
            self._commit(self.optimizer)
        return result

    def _commit(self, optimizer=None, buckets=()) -> None:
        """The step counts: its state committed (a step boundary for ``auto``; ``buckets``: the
        step's averaged buffers where ``.grad`` does not hold them)."""
        self.life.commit(optimizer)
        if self.auto is not None:  # (the views made only where auto reads them)
            views = lambda: {n: v for b in buckets for n, v in zip(b.layout.names, b.layout.views(b.buffer))}  # noqa: E731
            self.auto.boundary(views if buckets else None)

    @property
    def unapplied(self) -> bool:
        """A reduced step's state is staged and nobody applied it (yet)."""
        return self.life.staged and self.status is Status.SYNCED

    def zeroed(self) -> None:
        """The attached optimizer zeroes the gradients: a reduced step not applied is discarded
        (its state rolled back)."""
        if self.unapplied:
            self._drop()

    def forward_starts(self, grads_zeroed) -> None:
        """The DDP model's forward begins: a reduced step not applied whose gradients were zeroed
        (``grads_zeroed()``, called only then) is discarded; one whose gradients are still there
        waits (a synchronized backward that adds to them commits it: :meth:`open`)."""
        if self.unapplied and grads_zeroed():
            self._drop()

    @contextlib.contextmanager
    def shadowing(self):
        """While DDP's join hook shadows a step on a joined rank (``_DDPJoinHook.main_hook``: its
        hook is called with zero gradients, to match the other ranks' collectives), a step reduced
        is committed at its last bucket: this rank never applies it, the others apply the same
        step (PyTorch's hooks keep their state the same way on a joined rank)."""
        self._shadowing = True
        try:
            yield
        finally:
            self._shadowing = False

    # ---- the step ---------------------------------------------------------------------------------------
    def needs_open(self, index: int) -> bool:
        """Whether bucket ``index`` starts a new step (the first bucket, or a backward after the
        last one was reduced)."""
        return index == 0 or not self.life.staged or self.status in (Status.SYNCED, Status.SKIPPED)

    def open(self) -> None:
        """A backward's first bucket: commit a reduced step not applied and not discarded (this
        backward accumulates onto its gradients: DDP's bucket holds their sum), agree on restored
        state (once, :meth:`hvdcomp.agreement.StateAgreement.agree`), follow the loss scale, and
        stage this step's updates."""
        if self.unapplied:
            self._commit()
        elif self.life.staged:  # (a backward that never reached its last bucket)
            self._drop()
        self.status = Status.BACKWARD
        self.life.guard.reset()
        self.life.open(self.group, "hvdcomp.ddp", () if self.auto is None else (self.auto.rescale,))

    def agree(self, buckets: List[Bucket]) -> bool:
        """Whether the ranks skip this step (:meth:`hvdcomp.step.Lifecycle.decide`; raises under
        ``nonfinite="raise"``). Buckets reduced in place are checked on their results, identical
        on every rank: a step of only those needs no exchange."""
        if self.nonfinite == "ignore":
            return False
        direct = [b.buffer for b in buckets if b.in_place]
        if direct:
            self.life.guard.observe(direct, averaged=True)
        alone = len(direct) == len(buckets)
        return self.life.decide(self.group, None if alone else self.group, 1, timer=self.timer)

    def skip(self, buckets: List[Bucket]) -> None:
        """Every rank skips: state rolled back, every bucket's result NaN (a GradScaler sees the
        overflow)."""
        self.life.skip(b.buffer for b in buckets)
        self.status = Status.SKIPPED

    def reduced(self, buckets: List[Bucket]) -> None:
        """The last bucket is reduced (``buckets``: the step's, averaged): the update waits to be
        applied (without an optimizer, nobody tells, and a joined rank's shadow step is never
        applied: what was reduced counts, committed now; inside a join, so on every rank)."""
        self.backward_steps += 1
        if self.status is Status.SKIPPED:  # (not a step: for auto, on every rank, a joined one too)
            if self.auto is not None:
                self.auto.skipped()
            return
        self.status = Status.SYNCED
        # (inside an enabled join, on every rank: a joined rank cannot learn of a discard)
        joined = self.joining is not None and getattr(self.joining(), "_join_config", None)
        if self.optimizer is None or self._shadowing or (joined and joined.enable):
            self._commit(buckets=buckets)

    def discard(self) -> None:
        """Drop the step in progress (an error, or a state loaded in the middle of it)."""
        self._drop(self.status if self.status is Status.SKIPPED else Status.IDLE)
        self.life.guard.reset()

    def _drop(self, status: Status = Status.IDLE) -> None:
        """Roll back a step that is discarded (for ``auto``: its time is not a step's)."""
        self.life.rollback()
        self.status = status
        if self.auto is not None:
            self.auto.discarded()

