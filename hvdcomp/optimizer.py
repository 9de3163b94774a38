"""hvdcomp.DistributedOptimizer: Horovod's ``DistributedOptimizer`` with gradient compression,
a drop-in with the same arguments, methods and recipes (``docs/horovod-recipes.md``).

This module is the Horovod facade only. One gradient's path (``docs/architecture.md``):

1. backward fires a post-accumulate-grad hook on the parameter; :mod:`hvdcomp.step` counts it
   (``backward_passes_per_step``) and tells when its compression unit is complete;
2. the unit's transport (:mod:`hvdcomp.transports`, chosen by :mod:`hvdcomp.plan` at
   construction, built by :mod:`hvdcomp.assembly`) compresses it (the method's ``encode``, error
   feedback included: :mod:`hvdcomp.memory`) and starts its collective (:mod:`hvdcomp.comm`);
3. ``synchronize()`` (called by ``step()``) starts what backward did not reach (unused parameters
   send zeros), lets every transport finish (results written into ``p.grad``), and agrees with
   every rank on the step (:mod:`hvdcomp.agreement`: non-finite gradients, restored state,
   accumulation settings).

Compressor state (residuals, momenta, counters, generators) follows what is *applied*: a step's
updates are staged when it is compressed, committed when ``step()`` applies the update, and
dropped when the synchronized gradient is discarded (``zero_grad()`` or a new backward before
``step()``, a skipped non-finite step, a ``GradScaler`` overflow). With a ``GradScaler`` the state
follows loss-scale changes (:mod:`hvdcomp.amp`).

Time and bytes per phase go to ``optimizer.timer`` (:class:`hvdcomp.metrics.PhaseTimer`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
import weakref
from typing import Iterable, Optional, Tuple

import torch

from .agreement import NonFiniteGuard, StateAgreement, check_consistency
from .amp import LossScaleTracker
from .assembly import assemble
from .comm.group import Group, horovod
from .config import (ARGUMENTS_DOC, DEFAULT_BUCKET_BYTES, OPTIMIZER_ENV, Settings, adasum_compression, check_method,
                     name_parameters)
from .launch import HOROVOD_FRONTEND, start_frontend
from .metrics import PhaseTimer
from .plan import TransportPlan
from .rebuild import keeping_class, template
from .spec import resolve_compression
from .step import Status, StepState

__all__ = ["DistributedOptimizer", "resolve_compression", "DEFAULT_BUCKET_BYTES", "OPTIMIZER_ENV"]

log = logging.getLogger(__name__)

_ids = itertools.count()  # creation order of optimizers: identical on every rank, names collectives
_owners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # compressor -> optimizer using it
_CLOSED = ("this DistributedOptimizer was closed (close() stopped its communication): build a new one "
           "to keep training distributed")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (as Horovod does)."""

    def __init__(self, params, named_parameters, compression, settings: Settings):
        super(self.__class__, self).__init__(params)
        s = settings
        self.settings, self.compression = s, compression
        self.timer = s.timer if s.timer is not None else PhaseTimer()
        self.backward_passes_per_step, self.op = s.backward_passes_per_step, s.op
        self.gradient_predivide_factor, self.sparse_as_dense = s.gradient_predivide_factor, s.sparse_as_dense
        self.bucket_bytes, self.nonfinite, self.granularity = s.bucket_bytes, s.nonfinite, s.granularity
        self.group = Group(s.process_set)
        compression.bind_group(self.group.size)
        self._prefix = f"hvdcomp.{next(_ids)}"
        self._names = name_parameters(self.param_groups, named_parameters)
        # expected backward order: last parameters first. Fixed, identical on every rank.
        self._order = [p for g in reversed(self.param_groups) for p in reversed(g["params"]) if p.requires_grad]
        self._pos = {id(p): i for i, p in enumerate(self._order)}  # (no tensor hashing per hook)
        self._guard, self._state = NonFiniteGuard(self.nonfinite), StateAgreement()
        self._loss_scale = LossScaleTracker(s.grad_scaler)
        self.skipped_steps, self.cost_model, self._pipe, self._agreement = 0, None, None, None
        self.transport = TransportPlan({self._names[p]: "local" for p in self._order})
        self._step = StepState([[i] for i in range(len(self._order))], self.backward_passes_per_step)
        # as Horovod: processes outside the set train locally, and a job of one rank without
        # compression leaves the gradients exactly as backward made them
        if not self.group.included or (self.group.size == 1 and getattr(compression, "payload_is_gradient", False)):
            return
        if s.check_consistency and self.group.size > 1:  # before any collective ranks might not share
            check_consistency(self.group, s.signature(compression, self._names, self._order, self._prefix),
                              f"{self._prefix}.consistency")
        pipe = self._pipe = assemble(s, compression, self.group, self._order, self._names, self._prefix, self.timer)
        self.compression, self.transport, self.cost_model = pipe.compression, pipe.plan, pipe.cost_model
        self._step = StepState(pipe.units.members, self.backward_passes_per_step, pipe.draw_order)
        log.info("hvdcomp: %s", self.transport)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._order]

    # ---- the step in progress ------------------------------------------------------------------
    def _open(self) -> None:
        """First compression of a step: agree on state (once), follow the loss scale, stage."""
        if self._step.staged:
            return
        if not self._state.agreed:
            self.skipped_steps = self._state.agree(self.group, self.compression, self.skipped_steps, self._prefix)
        factor = self._loss_scale.factor()
        if factor is not None:
            self.compression.rescale_state(factor)
        self.compression.begin_step()
        self._step.staged = True

    def _discard(self) -> None:
        """The synchronized (or partly compressed) gradient will not be applied: drop its staged
        compressor state, so it leaves no trace."""
        if self._busy():
            raise AssertionError("a step was discarded while collectives were in flight; call "
                                 "optimizer.synchronize() first")
        if self._step.staged:
            self.compression.rollback()
        self._step.staged = False
        if self._step.status is not Status.CLOSED:
            self._step.status = Status.IDLE
        self._guard.reset()

    def _busy(self) -> bool:
        return self._pipe is not None and any(t.busy for t in self._pipe.transports)

    def _start(self, u: int) -> None:
        """Hand unit ``u`` to its transport (compress, start the collective), once a step."""
        self._open()
        self._step.started[u] = True
        self._pipe.transport_of[u].start(u)
        if self._pipe.summed_agreement and self._agreement is None:  # (fused with the gradients')
            self._agreement = self._guard.launch_summed(self.group, self._state.loaded_since_step,
                                                        self.backward_passes_per_step, f"{self._prefix}.agree")

    def _hook(self, p: torch.Tensor) -> None:
        if self._step.synced:  # a new backward after synchronize() without step(): that update is dropped
            self._discard()
        u = self._step.gradient_ready(self._pos[id(p)])
        if u is not None and self._pipe.eager[u]:
            self._start(u)

    # ---- synchronisation ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient's collective and write the averaged gradients into ``p.grad``.

        Parameters whose hook did not fire (unused in this step, or fewer backward passes than
        ``backward_passes_per_step``) are sent now with their current (or zero) gradient, so all
        ranks take part in the same collectives. Calling it again before ``step()`` (with no
        backward in between) does nothing: a gradient is compressed once per step.

        Raises:
            RuntimeError: the optimizer was closed (:meth:`close`).
        """
        if self._step.status is Status.CLOSED:
            raise RuntimeError(_CLOSED)
        if self._pipe is None or self._step.synced:
            self._step.status = Status.SKIPPED if self._step.status is Status.SKIPPED else Status.SYNCED
            return
        pipe, step = self._pipe, self._step
        for u in pipe.flush_order:  # what backward did not reach, in the same order on every rank
            if not step.started[u]:
                self._start(u)
        # every local gradient's finiteness, in one fused check, except those reduced in place (none):
        # checked on their results (identical on every rank) after
        in_place = set() if pipe.summed_agreement else {pipe.units.members[u][0] for t in pipe.transports
                                                        for u in t.in_place_units() if len(pipe.units.members[u]) == 1}
        if not pipe.summed_agreement:
            self._guard.observe_gradients(self._order, exclude=in_place)
        if not pipe.deferred:
            for t in pipe.transports:
                t.finish()
            overflowed = [i for t in pipe.transports for u in t.overflowed_units() for i in pipe.units.members[u]]
            self._guard.observe_gradients(self._order, only=None if pipe.summed_agreement else {*in_place, *overflowed}, averaged=True)
        step.restart(self.backward_passes_per_step)
        if self._agree() and pipe.deferred:  # agreed first: a skipped step runs no collective
            for t in pipe.transports:                      # and changes no state
                t.finish()
        pipe.units.restore_sparse()

    def _agree(self) -> bool:
        """The per-step agreement (:mod:`hvdcomp.agreement`); a non-finite step is skipped here
        (every ``.grad`` reads NaN, as an allreduced Inf would, so a GradScaler sees the overflow).
        Returns whether the step goes ahead."""
        self._step.status = Status.SYNCED
        if self.nonfinite == "ignore":
            return True
        with self.timer.phase("communicate") if self.group.size > 1 else contextlib.nullcontext():
            verdict = self._guard.decide(self.group, self._pipe.gatherer, self._agreement,
                                         self._state.loaded_since_step, self.backward_passes_per_step)
        self._agreement, self._state.loaded_since_step = None, False
        if not verdict.skip:
            return True
        if self._step.staged:
            self.compression.rollback()
        self._step.staged, self._step.status = False, Status.SKIPPED
        self.skipped_steps += 1
        for p in self._order:
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        return False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip ``synchronize()`` (call it yourself first, e.g. to clip gradients)."""
        self._step.sync_on_step = False
        try:
            yield
        finally:
            self._step.sync_on_step = True

    def step(self, closure=None):
        """``synchronize()`` unless inside :meth:`skip_synchronize` (or already synchronized),
        then the wrapped optimizer's step, and the compressor state of this step is committed.

        After a skipped (non-finite) step nothing is updated and ``None`` is returned.

        Raises:
            RuntimeError: the optimizer was closed (:meth:`close`), also inside
                :meth:`skip_synchronize`.
        """
        if self._step.status is Status.CLOSED:
            raise RuntimeError(_CLOSED)
        if self._step.sync_on_step:
            if self._step.synced:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); the synchronized gradients are applied "
                              "as they are (not compressed and sent again).")
            else:
                self.synchronize()
        skipped, self._step.status = self._step.status is Status.SKIPPED, Status.IDLE
        if skipped:  # a non-finite gradient somewhere: no rank updates
            return None
        result = super(self.__class__, self).step(closure)
        if self._step.staged:
            if self.compression.has_scaled_state:
                self._loss_scale.discover(self)
            self.compression.commit()
            self._step.staged = False
        return result

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (as Horovod's: accumulation counters restart).

        Raises:
            ValueError: ``passes`` is not an integer >= 1. Ranks that set different values fail
                at the next step, on every rank, naming the values.
        """
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.backward_passes_per_step = passes
        self._step.restart(passes)

    def state_dict(self):
        """The wrapped optimizer's state plus the compressor's (residuals, momenta, Q, RNG states)
        under ``"hvdcomp"``: tensors, numbers and strings only (loads with ``weights_only=True``).

        Saved on every rank (``torch.save(opt.state_dict(), f"ckpt.{hvd.rank()}.pt")``) and loaded
        by each rank from its own file, it resumes bit-identically; saved on rank 0 only and
        restored with Horovod's broadcast recipe, the shared part of the compressor state is
        broadcast at the first step and other ranks' per-rank state starts fresh."""
        sd = super(self.__class__, self).state_dict()
        sd["hvdcomp"] = {"compression": self.compression.state_dict(), "skipped_steps": self.skipped_steps}
        return sd

    def load_state_dict(self, state_dict):
        """Inverse of :meth:`state_dict`; like Horovod's, it also drops a step in progress."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdcomp", None)
        for t in (self._pipe.transports if self._pipe is not None else []):
            t.reset()
        self._agreement = None
        self._discard()
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            self.compression.load_state_dict(extra["compression"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            self._state.note_load()

    def zero_grad(self, set_to_none: bool = True):
        """As the wrapped optimizer's, but refuses while a backward's gradients are pending (as
        Horovod does); after ``synchronize()`` without ``step()`` the synchronized update is
        discarded, leaving no trace in compressor state."""
        if self._step.status is Status.BACKWARD or self._busy():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited "
                                 "as it can cause a race condition.")
        if self._step.synced or self._step.staged:
            self._discard()
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the optimizer then no longer communicates)."""
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []

    def close(self) -> None:
        """Stop communicating: detach the backward hooks and stop the allgather's background
        thread, for programs that build many optimizers in one process. Call it on every rank of
        the process set, between steps; idempotent. Afterwards ``synchronize()`` and ``step()``
        raise, and the compressor, with its state, may serve a new optimizer. The MPI
        communicators it made stay until ``MPI_Finalize`` (freeing them crashed Open MPI 4.1.4:
        :meth:`hvdcomp.comm.allgather.MPIAllgatherer.close`), so thousands of optimizers should not
        share one process.

        Raises:
            RuntimeError: a step is in progress (backward ran, its gradients are not
                synchronized and applied yet): call ``step()`` (or ``synchronize()`` and
                ``zero_grad()``) first, on every rank.
        """
        if self._step.status is Status.CLOSED:
            return
        if self._step.status is not Status.IDLE or self._busy():
            raise RuntimeError("close() during a step: backward's gradients are not synchronized and "
                               "applied yet. Call optimizer.step() (or synchronize() and zero_grad()) "
                               "first, on every rank.")
        self.remove_hooks()
        if self._pipe is not None and self._pipe.gatherer is not None:
            self._pipe.gatherer.close()
        owner = _owners.get(self.compression)
        if owner is not None and owner() is self:  # the compressor (and its state) may serve a new one
            del _owners[self.compression]
        self._step.status = Status.CLOSED


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                         compression="none", backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, *, allgather: str = "auto",
                         timer: Optional[PhaseTimer] = None, nonfinite: str = "skip",
                         check_consistency: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         cost_model="measure", grad_scaler=None, granularity: str = "tensor",
                         fuse_tensors: bool = True, transport: str = "planned") -> torch.optim.Optimizer:
    hvd = horovod()
    if not hvd.is_initialized():  # ValueError, the type stock Horovod raises here
        raise ValueError("Horovod is not initialised: call hvd.init() before hvdcomp.DistributedOptimizer")
    start_frontend(HOROVOD_FRONTEND, "horovod", hvd.size())  # the launch fits; an uncaught exception ends the job
    if op is hvd.Adasum:  # stock's Adasum optimizer: it combines parameter deltas (none / fp16 only)
        return hvd.DistributedOptimizer(template(optimizer), named_parameters, adasum_compression(compression, hvd),
                                        backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
                                        sparse_as_dense, hvd.global_process_set if process_set is None else process_set)
    settings = Settings.validate(
        hvd, backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
        sparse_as_dense=sparse_as_dense, process_set=process_set, allgather=allgather, timer=timer,
        nonfinite=nonfinite, check_consistency=check_consistency, bucket_bytes=bucket_bytes,
        cost_model=cost_model, grad_scaler=grad_scaler, granularity=granularity, fuse_tensors=fuse_tensors,
        transport=transport)
    compression = resolve_compression(compression)
    check_method(compression, optimizer, granularity)
    owner = _owners.get(compression)
    if owner is not None and owner() is not None:
        raise ValueError(f"this '{compression.name}' compressor already serves another "
                         "DistributedOptimizer; its state is keyed by parameter name, so give each "
                         "optimizer its own (e.g. pass the spec string, or a new get_compressor(...))")
    # (keeping_class: the user's constructor-set attributes and defaults survive the rebuild)
    cls = type(optimizer.__class__.__name__, (keeping_class(optimizer),), dict(_DistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state() initialises the state of a fresh optimizer with a *local* step
    # of the wrapped optimizer only when it recognises a Horovod DistributedOptimizer by its module;
    # otherwise it calls step() on the fresh ranks only, and a synchronising step on a subset of the
    # ranks deadlocks. hvdcomp's optimizer is of that family, so it says so.
    from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer
    cls.__module__ = _HorovodOptimizer.__module__
    opt = cls(optimizer.param_groups, named_parameters, compression, settings)
    _owners[opt.compression] = weakref.ref(opt)  # (transport="auto" may have chosen another)
    return opt


DistributedOptimizer.__doc__ = """Wrap ``optimizer`` so that gradients are compressed and averaged over Horovod ranks.

    Takes ``hvd.DistributedOptimizer``'s arguments, in its order, plus hvdcomp's own (keyword
    only); the returned object is an instance of a subclass of ``optimizer``'s class holding the
    same parameter groups, ``defaults`` and constructor-set attributes (:mod:`hvdcomp.rebuild`;
    its ``add_param_group`` raises ``ValueError``). Communication starts from gradient hooks during
    backward; ``step()`` synchronizes first (or ``synchronize()`` + ``skip_synchronize()`` to clip
    or unscale the averaged gradients).

{arguments}
    Raises:
        ValueError: Horovod is not initialised (as stock Horovod), bad ``named_parameters``,
            ``backward_passes_per_step < 1``, unknown ``nonfinite``, ``op`` not Average/Sum/Adasum
            (or Adasum with a method other than ``none``/``fp16``), ``gradient_predivide_factor`` with
            ``op != Average``, bad ``groups``, ``bucket_bytes < 1``, an unknown ``cost_model``
            or ``granularity`` (or ``"bucket"`` with PowerSGD), an unknown ``transport`` (or
            ``"auto"`` with ``cost_model="off"``), a compressor already used by another
            optimizer, a compressor that applies momentum (DGC) with an optimizer that also does,
            or ranks that disagree on any setting (raised on every rank, naming the difference).
        TypeError: unsupported ``compression`` or ``grad_scaler``.
        RuntimeError: the launcher started several tasks but Horovod sees one (see :func:`hvdcomp.launch.start_frontend`), or a method that messages
            ranks directly (gtopk, twophase) in a job without MPI (``horovodrun --gloo``).

    Example::

        hvd.init()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           named_parameters=model.named_parameters(),
                                           compression="topk:density=0.01")
""".format(arguments=ARGUMENTS_DOC.rstrip("\n"))

