"""The core every front-end drives: the assembled pipeline (plan, methods, error feedback,
transports) and one step lifecycle (:class:`hvdcomp.step.Lifecycle`), over one
:class:`~hvdcomp.comm.group.ProcessGroup` (a Horovod process set or a ``torch.distributed``
process group: :func:`hvdcomp.comm.resolve_group`).

A front-end hands a :class:`Reducer` gradients (:meth:`~Reducer.gradient_ready`), asks it to
finish and agree on the step (:meth:`~Reducer.synchronize`: whether it goes ahead), and tells it
whether the update was applied (:meth:`~Reducer.commit`) or not (:meth:`~Reducer.discard`);
compressor state is staged from the step's first compression until then, and a step the ranks
agree to skip is rolled back on every rank with its gradients read NaN (so a ``GradScaler`` sees
the overflow). Used by the Horovod front-end (:mod:`hvdcomp.optimizer`) and the training modes
that reduce tensors of their own (:mod:`hvdcomp.local`: the pseudo-gradient Δ).
"""
from __future__ import annotations

import logging
import weakref
from typing import Dict, List, Optional

import torch

from .agreement import NonFiniteGuard, StateAgreement, StepSkipped, check_consistency
from .assembly import assemble
from .auto import Auto, AutoState
from .comm.group import elastic_world, world_changed
from .plan import TransportPlan, step_route_of
from .step import SYNCED, Lifecycle, Status, StepState

__all__ = ["Reducer", "check_free", "claim", "release"]

log = logging.getLogger(__name__)

#: the one owner registry of every front-end: method -> (weak reference to) what it serves
_owners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_free(compression) -> None:
    """A method's state is keyed by parameter name, so one instance serves one front-end object
    (a DistributedOptimizer, a DDP hook, a training mode) at a time.

    Raises:
        ValueError: ``compression`` serves another live one (the message names it and the fix).
    """
    ref = _owners.get(compression)
    owner = ref() if ref is not None else None
    if owner is not None:
        raise ValueError(f"this '{compression.name}' compressor already serves another {type(owner).__name__}; "
                         "its state is keyed by parameter name, so give each its own (pass the spec string, or "
                         "a new get_compressor(...))")


def claim(compression, owner) -> None:
    """Record that ``compression`` serves ``owner`` (until ``owner`` is gone or :func:`release`)."""
    _owners[compression] = weakref.ref(owner)


def release(compression, owner) -> None:
    """``owner`` no longer uses ``compression`` (it may serve a new front-end object)."""
    ref = _owners.get(compression)
    if ref is not None and ref() is owner:
        del _owners[compression]


class Reducer:
    """The pipeline and the step lifecycle of one set of tensors (see the module docstring).

    Args:
        order: the tensors whose ``.grad`` is reduced, in the order their gradients are expected
            to be ready (backward: last parameters first); fixed and the same on every rank.
        names: tensor -> name (keys the method's state; the same on every rank).
        compression: the method (a :class:`hvdcomp.Compressor` or a step-wide method).
        group: the :class:`~hvdcomp.comm.group.ProcessGroup` to average over.
        settings: the validated :class:`hvdcomp.config.Settings`.
        timer: a :class:`hvdcomp.metrics.PhaseTimer`.
        prefix: names the collectives (unique per reducer, the same on every rank).

    Attributes:
        compression: the method (the one ``transport="auto"`` chose, where it chose; with
            ``compression="auto"``, the candidate in use).
        transport: the :class:`hvdcomp.plan.TransportPlan`.
        cost_model: the α-β model that routed gradients, or None.
        auto: with ``compression="auto"``, its :class:`hvdcomp.auto.AutoState` (decisions take
            effect at step boundaries, :meth:`commit`); else None.
        life: the step lifecycle (:class:`hvdcomp.step.Lifecycle`).
        active: whether anything is reduced (False outside the group, and for a job of one rank
            whose method leaves gradients as they are).
        status: where the step is (:class:`hvdcomp.step.Status`).

    Raises:
        ValueError: ranks that disagree on the set-up (on every rank, naming the difference), or
            what :func:`hvdcomp.assembly.assemble` refuses.
        RuntimeError: a method that needs point-to-point messages on a group without them.
    """

    def __init__(self, order: List[torch.Tensor], names: Dict[torch.Tensor, str], compression, group, settings,
                 timer, prefix: str):
        self.order, self.names, self.group, self.settings = order, names, group, settings
        self.compression, self.timer, self.prefix = compression, timer, prefix
        self.passes = settings.backward_passes_per_step
        self.nonfinite = settings.nonfinite
        self.position = {id(p): i for i, p in enumerate(order)}  # (no tensor hashing per hook)
        self.life = Lifecycle(compression, self.nonfinite, settings.grad_scaler)
        self.cost_model, self.pipe, self._agreement = None, None, None
        self.auto: Optional[AutoState] = None
        self.elastic = elastic_world(group, "the reduction")
        if self.elastic and isinstance(compression, Auto):
            raise ValueError("compression='auto' cannot follow a change of the world size (its measurements and "
                             "candidates' state are per size), and this job runs under elastic Horovod "
                             "(HOROVOD_ELASTIC=1): name the method (e.g. 'topk:density=0.01' or 'powersgd'), or "
                             "launch with a fixed `horovodrun -np N`")
        route = step_route_of(compression)
        if self.elastic and route is not None and route.needs_messages:
            raise RuntimeError(f"'{compression.name}' sends and receives point to point through MPI, and this "
                               "job runs under elastic Horovod (HOROVOD_ELASTIC=1), whose workers have only "
                               "Horovod's collectives: use topk or cltk, or launch with a fixed "
                               "`mpirun`/`horovodrun --mpi -np N`")
        # under elastic Horovod the set-up (collectives) waits for the first step, which every rank,
        # old or new, reaches alike after Horovod's reset (a new worker builds its optimizer while
        # the others are in the reset's broadcasts)
        self.pending = self.elastic
        self._setup()

    def _setup(self) -> None:
        """Build what depends on the group (its size bound into the method, the set-up
        agreement, the pipeline: plan, transports, allgatherer), now or, while :attr:`pending`,
        at the next step (collective over the group)."""
        group, compression, settings, order, names = self.group, self.compression, self.settings, self.order, self.names
        self.pipe, self._agreement = None, None
        self.transport = TransportPlan({names[p]: "local" for p in order})
        self.current = StepState([[i] for i in range(len(order))], self.passes)
        self.life.use(compression)
        # as Horovod: processes outside the group train locally, and a job of one rank without
        # compression leaves the gradients exactly as backward made them
        self.active = group.included and not (group.size == 1 and getattr(compression, "payload_is_gradient", False))
        if self.pending:
            return
        compression.bind_group(group.size)
        if not self.active:
            return
        prefix = self.prefix
        if settings.check_consistency and group.size > 1:  # before any collective ranks might not share
            check_consistency(group, settings.signature(compression, names, order, prefix), f"{prefix}.consistency")
        if isinstance(compression, Auto):  # every candidate's pipeline; the first choice installed
            self.auto = AutoState(compression, self)
            self.install(self.auto.pipeline)
            self.cost_model = self.auto.cost_model
        else:
            self.install(assemble(settings, compression, group, order, names, prefix, self.timer))
        log.info("hvdcomp: %s", self.transport)

    def resize(self, group) -> None:
        """The world changed (elastic Horovod's reset: workers lost or added): from the next step
        on, reduce over ``group`` (a :class:`~hvdcomp.comm.group.ProcessGroup` of the new world).

        Runs no collective: the step in progress is dropped, the old pipeline closed, and what
        depends on the size (bound size, set-up agreement, plan, transports, cost model) rebuilt
        at the next step's first gradient, on every rank alike. The method's state carries over;
        the surviving ranks give its shared part to new ranks, which start with zero residuals
        (:class:`hvdcomp.agreement.StateAgreement`).

        Raises:
            ValueError: ``compression='auto'`` (its per-size measurements cannot carry over).
        """
        if self.auto is not None:
            raise ValueError("compression='auto' cannot follow a change of the world size: name the method")
        for t in (self.pipe.transports if self.pipe is not None else []):
            t.reset()
        self.life.rollback()
        if self.pipe is not None and self.pipe.gatherer is not None:
            self.pipe.gatherer.close()
        self.group = group
        self.life.guard, self.life.restored = NonFiniteGuard(self.nonfinite), StateAgreement()
        self.life.restored.loaded = True  # this rank holds state: new ranks take the shared part from it
        self.pending = True
        self._setup()

    def _ready(self) -> None:
        """Build the pipeline if :meth:`resize` (or an elastic start) left it pending; under
        elastic Horovod, a world that changed without :meth:`resize` (no reset callback) is
        noticed here by its size or this rank's number, and followed the same way."""
        if self.elastic and not self.pending and self.current.status is Status.IDLE and not self.life.staged \
                and world_changed(self.group):
            self.resize(type(self.group)(self.group.process_set))
        if self.pending:
            self.pending = False
            self._setup()

    def install(self, pipe) -> None:
        """Use ``pipe`` (a :class:`hvdcomp.assembly.Pipeline`) from the next step on: its method,
        plan and transports, with fresh accumulation counters (between steps only)."""
        self.pipe = pipe
        self.compression, self.transport = pipe.compression, pipe.plan
        self.cost_model = pipe.cost_model if self.auto is None else self.auto.cost_model
        self.current = StepState(pipe.units.members, self.passes, pipe.draw_order)
        self.life.use(self.compression)

    @property
    def status(self) -> Status:
        return self.current.status

    @property
    def between_steps(self) -> bool:
        """No step is in progress (nothing in flight, staged, or synchronized and not taken)."""
        return not (self.busy or self.life.staged or self.current.synced)

    @property
    def busy(self) -> bool:
        """Whether collectives are queued or in flight."""
        return self.pipe is not None and any(t.busy for t in self.pipe.transports)

    # ---- the step in progress ------------------------------------------------------------------
    def discard(self) -> None:
        """The synchronized (or partly compressed) step will not be applied: roll its staged
        state back, so it leaves no trace.

        Raises:
            AssertionError: collectives are still in flight (synchronize first).
        """
        if self.busy:
            raise AssertionError("a step was discarded while collectives were in flight; call "
                                 "optimizer.synchronize() first")
        self.life.rollback()
        if self.current.status is not Status.CLOSED:
            self.current.status = Status.IDLE
        self.life.guard.reset()
        if self.auto is not None:
            self.auto.discarded()

    def _start(self, u: int) -> None:
        """Hand unit ``u`` to its transport (compress, start the collective), once a step. The
        summed agreement (``none``) goes first, so it is issued at the same point on every rank."""
        if not self.life.staged:  # (the step's first unit)
            self.life.open(self.group, self.prefix, () if self.auto is None else (self.auto.rescale,))
        if self.pipe.summed_agreement and self._agreement is None:  # (fused with the gradients')
            self._agreement = self.life.guard.launch_summed(
                self.group, self.life.restored.loaded_since_step, self.passes, f"{self.prefix}.agree")
        self.current.started[u] = True
        auto = self.auto
        if auto is None:
            self.pipe.transport_of[u].start(u)
            return
        t0 = auto.clock()
        auto.prepare(u)  # (a switch's carry into the gradients; a probe's copy of them)
        self.pipe.transport_of[u].start(u)
        if not auto.in_sync:
            auto.hook_s += auto.clock() - t0

    def gradient_ready(self, p: torch.Tensor) -> None:
        """Backward produced ``p``'s gradient (a post-accumulate-grad hook): count it; a unit
        now complete is compressed and its collective started. A new backward after
        :meth:`synchronize` drops the synchronized step (it was not applied).

        Raises:
            AssertionError: more backward passes than ``backward_passes_per_step`` (Horovod's message).
        """
        if self.elastic or self.pending:
            self._ready()
            if not self.active:
                return
        current = self.current
        if current.status in SYNCED:
            self.discard()
            current = self.current
        u = current.gradient_ready(self.position[id(p)])
        if u is not None and self.pipe.eager[u]:
            self._start(u)

    def synchronize(self) -> bool:
        """Finish the step's collectives and write the averaged gradients into ``p.grad``;
        returns whether the ranks go ahead (False: skipped on every rank, every ``.grad`` NaN).

        Tensors whose gradient did not arrive (unused in this step, or fewer backward passes than
        ``backward_passes_per_step``) are sent now with their current (or zero) gradient, so every
        rank takes part in the same collectives. Calling it again before :meth:`commit` or
        :meth:`discard` does nothing."""
        if self.elastic or self.pending:
            self._ready()
        auto = self.auto
        if auto is None or not self.active or self.current.synced:
            return self._synchronize()
        t0 = auto.clock()
        auto.in_sync = True
        try:
            return self._synchronize()
        finally:
            auto.in_sync = False
            auto.synced(auto.clock() - t0)

    def _synchronize(self) -> bool:
        """:meth:`synchronize` itself."""
        if not self.active or self.current.synced:
            skipped = self.current.status is Status.SKIPPED
            self.current.status = Status.SKIPPED if skipped else Status.SYNCED
            return not skipped
        pipe, step = self.pipe, self.current
        self._flush()
        # every local gradient's finiteness, in one fused check, except those reduced in place (none):
        # checked on their results (identical on every rank) after
        in_place = set() if pipe.summed_agreement else {pipe.units.members[u][0] for t in pipe.transports
                                                        for u in t.in_place_units() if len(pipe.units.members[u]) == 1}
        if not pipe.summed_agreement:
            self.life.guard.observe_gradients(self.order, exclude=in_place)
        if not pipe.deferred:
            for t in pipe.transports:
                t.finish()
            overflowed = [i for t in pipe.transports for u in t.overflowed_units() for i in pipe.units.members[u]]
            self.life.guard.observe_gradients(
                self.order, only=None if pipe.summed_agreement else {*in_place, *overflowed}, averaged=True)
        step.restart(self.passes)
        if (pipe.deferred and self.nonfinite != "ignore" and len(pipe.transports) == 1
                and getattr(pipe.transports[0], "verdict_rides", False)):
            ahead = self._agree(riding=pipe.transports[0])  # (PowerSGD: on its first allreduce)
        else:
            ahead = self._agree()
            if ahead and pipe.deferred:  # agreed first: a skipped step runs no collective and changes no state
                for t in pipe.transports:
                    t.finish()
        pipe.units.restore_sparse()
        return ahead

    def _agree(self, riding=None) -> bool:
        """The per-step agreement (:mod:`hvdcomp.agreement`); a non-finite step is skipped here
        (every ``.grad`` reads NaN, as an allreduced Inf would, so a GradScaler sees the overflow).
        ``riding``: the step-wide transport whose ``finish`` carries it on its first allreduce
        (:meth:`hvdcomp.agreement.NonFiniteGuard.riding`: no collective of its own; a skipped
        step ran that one allreduce), finished here. Returns whether the step goes ahead."""
        self.current.status = Status.SYNCED
        if self.nonfinite == "ignore":
            return True
        summed, self._agreement = self._agreement, None
        if riding is not None:
            exchange = self.pipe.gatherer.allgather_ints if self.group.size > 1 else (lambda v: [list(v)])
            try:
                riding.finish(self.life.riding(self.group.size, exchange, self.passes))
                return True
            except StepSkipped:
                pass
        elif not self.life.decide(self.group, self.pipe.gatherer, self.passes, summed, self.timer):
            return True
        self.life.skip(p.grad for p in self.order if p.grad is not None)
        self.current.status = Status.SKIPPED
        return False

    def take(self) -> bool:
        """The front-end is about to apply the synchronized step: whether it goes ahead (False:
        skipped on every rank, nothing to apply). The reducer is idle again; :meth:`commit` once
        the update is applied."""
        skipped, self.current.status = self.current.status is Status.SKIPPED, Status.IDLE
        if skipped and self.auto is not None:
            self.auto.skipped()
        return not skipped

    def launch(self) -> None:
        """Compress every ``.grad`` and start its collectives without waiting; :meth:`reduce`
        finishes them (CO2 under elastic Horovod: no thread of its own issues a collective)."""
        if self.elastic or self.pending:
            self._ready()
        if self.active and not self.current.synced:
            self._flush()

    def _flush(self) -> None:
        """Start what backward did not reach, in the same order on every rank."""
        for u in self.pipe.flush_order:
            if not self.current.started[u]:
                self._start(u)

    def reduce(self) -> bool:
        """Reduce the ``.grad`` of every tensor now and commit (for modes that reduce tensors of
        their own, e.g. the pseudo-gradient, with nothing to apply in between): returns whether
        the ranks went ahead (False: a non-finite value somewhere; every ``.grad`` NaN, the
        method's state unchanged)."""
        self.synchronize()
        ahead = self.take()
        if ahead:
            self.commit()
        return ahead

    def commit(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """The step's update was applied: commit its compressor state (with a method whose state
        is in gradient units, ``optimizer`` is where a ``GradScaler`` is looked for)."""
        self.life.commit(optimizer)
        if self.auto is not None:  # a step boundary: auto measures, and may decide and switch
            self.auto.boundary()

    def restart(self, passes: int) -> None:
        """New accumulation counters (``backward_passes_per_step`` = ``passes``)."""
        self.passes = passes
        self.current.restart(passes)

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The method's state and the skipped-step count (tensors, numbers and strings only); with
        ``auto``, also every candidate's state, the choice and the carry (under ``"auto"``)."""
        return self.life.state_dict(self.auto)

    def reset(self) -> None:
        """Drop the step in progress (transports forget it; staged state rolled back)."""
        for t in (self.pipe.transports if self.pipe is not None else []):
            t.reset()
        self._agreement = None
        self.discard()

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Inverse of :meth:`state_dict` (None: nothing of the method's saved); drops a step in
        progress. Ranks agree on restored state at the next step's first compression."""
        self.reset()
        if state is not None:
            self.life.load_state_dict(state, self.auto)

    def close(self) -> None:
        """Stop the allgather's background thread (the reducer no longer communicates)."""
        if self.pipe is not None and self.pipe.gatherer is not None:
            self.pipe.gatherer.close()
        self.current.status = Status.CLOSED
