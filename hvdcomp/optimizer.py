"""hvdcomp.DistributedOptimizer: Horovod's ``DistributedOptimizer`` with gradient compression,
a drop-in with the same arguments, methods and recipes (``docs/horovod-recipes.md``).

The Horovod facade over the :class:`~hvdcomp.reducer.Reducer`: backward's hooks hand it each
gradient, ``synchronize()`` (called by ``step()``) finishes and agrees on the step, ``step()``
applies it and commits the compressor state, ``zero_grad()`` or a new backward before ``step()``
discards it (one gradient's path: ``docs/architecture.md``). Time and bytes per phase go to
``optimizer.timer`` (:class:`hvdcomp.metrics.PhaseTimer`).
"""
from __future__ import annotations

import logging
import warnings
from typing import Iterable, Optional, Tuple

import torch

from .comm import resolve_group
from .comm.group import HorovodGroup, horovod, instance_prefix
from .config import (ARGUMENTS_DOC, DEFAULT_BUCKET_BYTES, OPTIMIZER_ENV, Settings, adasum_compression, check_method,
                     name_parameters)
from .launch import HOROVOD_FRONTEND, start_frontend
from .metrics import PhaseTimer
from .rebuild import keeping_class, template
from .spec import resolve_compression
from .reducer import Reducer, check_free, claim, release
from .step import SkipSynchronize, Status, skipped_steps_of

__all__ = ["DistributedOptimizer", "distributed", "wrap", "resolve_compression", "DEFAULT_BUCKET_BYTES", "OPTIMIZER_ENV"]

log = logging.getLogger(__name__)

_CLOSED = ("this DistributedOptimizer was closed (close() stopped its communication): build a new one "
           "to keep training distributed")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (as Horovod does): backward hooks into the
    :class:`hvdcomp.reducer.Reducer`, and the step applied where the reducer says it goes ahead."""

    def __init__(self, params, named_parameters, compression, settings: Settings, group=None):
        super(self.__class__, self).__init__(params)
        s = settings
        self.settings = s
        self.timer = s.timer if s.timer is not None else PhaseTimer()
        self.backward_passes_per_step, self.op = s.backward_passes_per_step, s.op
        self.gradient_predivide_factor, self.sparse_as_dense = s.gradient_predivide_factor, s.sparse_as_dense
        self.bucket_bytes, self.nonfinite, self.granularity = s.bucket_bytes, s.nonfinite, s.granularity
        self.group = group if group is not None else HorovodGroup(s.process_set)
        names = name_parameters(self.param_groups, named_parameters)
        # expected backward order: last parameters first. Fixed, identical on every rank.
        order = [p for g in reversed(self.param_groups) for p in reversed(g["params"]) if p.requires_grad]
        self.reducer = Reducer(order, names, compression, self.group, s, self.timer, instance_prefix())
        self._sync_on_step = True  # (the class is built from this one's __dict__: no inherited default)
        self._hook_handles = ([p.register_post_accumulate_grad_hook(self.reducer.gradient_ready) for p in order]
                              if self.reducer.active or self.reducer.elastic else [])

    compression = property(lambda self: self.reducer.compression, doc="The method (after ``transport='auto'``).")
    transport = property(lambda self: self.reducer.transport, doc="How each gradient travels (:class:`~hvdcomp.plan.TransportPlan`).")
    cost_model = property(lambda self: self.reducer.cost_model, doc="The α-β model that routed gradients, or None.")
    auto = property(lambda self: self.reducer.auto,
                    doc="With ``compression='auto'``: its :class:`~hvdcomp.auto.AutoState` (``.decisions``, "
                        "``.describe()``); else None.")
    skipped_steps = skipped_steps_of(lambda self: self.reducer.life)

    # ---- synchronisation ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient's collective and write the averaged gradients into ``p.grad``
        (:meth:`hvdcomp.reducer.Reducer.synchronize`: parameters whose hook did not fire are sent
        with their current or zero gradient; a second call before ``step()`` does nothing).

        Raises:
            RuntimeError: the optimizer was closed (:meth:`close`).
        """
        if self.reducer.status is Status.CLOSED:
            raise RuntimeError(_CLOSED)
        self.reducer.synchronize()

    skip_synchronize = SkipSynchronize.skip_synchronize

    def step(self, closure=None):
        """``synchronize()`` unless inside :meth:`skip_synchronize` (or already synchronized),
        then the wrapped optimizer's step, and the compressor state of this step is committed.

        After a skipped (non-finite) step nothing is updated and ``None`` is returned.

        Raises:
            RuntimeError: the optimizer was closed (:meth:`close`), also inside
                :meth:`skip_synchronize`.
        """
        reducer = self.reducer
        if reducer.status is Status.CLOSED:
            raise RuntimeError(_CLOSED)
        if self._sync_on_step:
            if reducer.current.synced:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); the synchronized gradients are applied "
                              "as they are (not compressed and sent again).")
            else:
                reducer.synchronize()
        if not reducer.take():  # a non-finite gradient somewhere: no rank updates
            return None
        result = super(self.__class__, self).step(closure)
        reducer.commit(self)
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
        self.reducer.restart(passes)

    def state_dict(self):
        """The wrapped optimizer's state plus the compressor's (residuals, momenta, Q, RNG states)
        under ``"hvdcomp"``: tensors, numbers and strings only (loads with ``weights_only=True``).

        Saved on every rank (``torch.save(opt.state_dict(), f"ckpt.{hvd.rank()}.pt")``) and loaded
        by each rank from its own file, it resumes bit-identically; saved on rank 0 only and
        restored with Horovod's broadcast recipe, the shared part of the compressor state is
        broadcast at the first step and other ranks' per-rank state starts fresh."""
        sd = super(self.__class__, self).state_dict()
        sd["hvdcomp"] = self.reducer.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        """Inverse of :meth:`state_dict`; like Horovod's, it also drops a step in progress."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdcomp", None)
        self.reducer.reset()
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            self.reducer.load_state_dict(extra)

    def zero_grad(self, set_to_none: bool = True):
        """As the wrapped optimizer's, but refuses while a backward's gradients are pending (as
        Horovod does); after ``synchronize()`` without ``step()`` the synchronized update is
        discarded, leaving no trace in compressor state."""
        reducer = self.reducer
        if reducer.status is Status.BACKWARD or reducer.busy:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited "
                                 "as it can cause a race condition.")
        if reducer.current.synced or reducer.life.staged:
            reducer.discard()
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def reset(self) -> None:
        """Follow elastic Horovod's reset (workers lost or added): register it once,
        ``state.register_reset_callbacks([optimizer.reset])``, on the
        ``hvd.elastic.TorchState(model=..., optimizer=optimizer)`` of ``@hvd.elastic.run``. Runs no
        collective: the pipeline is rebuilt over the new world at the next step, and the
        compressor state carries over (:meth:`hvdcomp.reducer.Reducer.resize`). Without the
        callback a change of size or rank is noticed at the next step, but a worker replaced at
        the same size is not.

        Raises:
            RuntimeError: the optimizer was closed (:meth:`close`).
            ValueError: ``compression='auto'`` (refused under elastic Horovod at construction).
        """
        if self.reducer.status is Status.CLOSED:
            raise RuntimeError(_CLOSED)
        self.reducer.resize(HorovodGroup(self.settings.process_set))
        if not self._hook_handles:  # (a job of one rank without compression had none)
            self._hook_handles = [p.register_post_accumulate_grad_hook(self.reducer.gradient_ready)
                                  for p in self.reducer.order]

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the optimizer then no longer communicates)."""
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []

    def close(self) -> None:
        """Stop communicating: detach the backward hooks and stop the allgather's background
        thread. Call it on every rank of the process set, between steps; idempotent. Afterwards
        ``synchronize()`` and ``step()`` raise, and the compressor, with its state, may serve a
        new optimizer (the MPI communicators stay until ``MPI_Finalize``:
        :meth:`hvdcomp.comm.allgatherv.MPIAllgatherer.close`).

        Raises:
            RuntimeError: a step is in progress (backward ran, its gradients are not
                synchronized and applied yet): call ``step()`` (or ``synchronize()`` and
                ``zero_grad()``) first, on every rank.
        """
        reducer = self.reducer
        if reducer.status is Status.CLOSED:
            return
        if reducer.status is not Status.IDLE or reducer.busy:
            raise RuntimeError("close() during a step: backward's gradients are not synchronized and "
                               "applied yet. Call optimizer.step() (or synchronize() and zero_grad()) "
                               "first, on every rank.")
        self.remove_hooks()
        reducer.close()
        release(self.compression, self)  # the compressor (and its state) may serve a new one


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
    return wrap(optimizer, named_parameters, compression, settings, HorovodGroup(process_set))


def distributed(optimizer: torch.optim.Optimizer, named_parameters=None, compression="none", where=None,
                frontend: str = "hvdcomp.DistributedOptimizer", **settings) -> torch.optim.Optimizer:
    """:func:`DistributedOptimizer` over whichever group the job runs on
    (:func:`hvdcomp.comm.resolve_group` of ``where``: a Horovod process set, a ``torch.distributed``
    process group, or None), for the training modes that run under either launcher.

    Raises:
        RuntimeError: no process group (:func:`hvdcomp.comm.resolve_group`).
        ValueError, TypeError: as :func:`DistributedOptimizer`.
    """
    group = resolve_group(where, frontend=frontend)
    hvd = getattr(group, "hvd", None)
    s = Settings.validate(hvd, process_set=where if hvd is not None else None, **settings)
    return wrap(optimizer, named_parameters, compression, s, group)


def wrap(optimizer: torch.optim.Optimizer, named_parameters, compression, settings: Settings, group):
    """``optimizer`` as a subclass of its class whose gradients the :class:`~hvdcomp.reducer.Reducer`
    averages over ``group`` (any :class:`~hvdcomp.comm.group.ProcessGroup`): what
    :func:`DistributedOptimizer` returns over a Horovod process set, and what the training modes
    use over whichever group they run on (the adaptive optimizers' warm-up,
    :func:`hvdcomp.adaptive_opt.CompressedAMSGrad`).

    Raises:
        ValueError, TypeError: as :func:`DistributedOptimizer` (the method's, the rebuild's).
    """
    compression = resolve_compression(compression)
    check_method(compression, optimizer, settings.granularity)
    check_free(compression)
    # (keeping_class: the user's constructor-set attributes and defaults survive the rebuild)
    cls = type(optimizer.__class__.__name__, (keeping_class(optimizer),), dict(_DistributedOptimizer.__dict__))
    if getattr(group, "hvd", None) is not None:
        # hvd.broadcast_optimizer_state() initialises the state of a fresh optimizer with a *local* step
        # of the wrapped optimizer only when it recognises a Horovod DistributedOptimizer by its module;
        # otherwise it calls step() on the fresh ranks only, and a synchronising step on a subset of the
        # ranks deadlocks. hvdcomp's optimizer is of that family, so it says so.
        from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer
        cls.__module__ = _HorovodOptimizer.__module__
    opt = cls(optimizer.param_groups, named_parameters, compression, settings, group)
    claim(opt.compression, opt)  # (transport="auto" may have chosen another)
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
            ranks that disagree on any setting (raised on every rank, naming the difference), or,
            under elastic Horovod (``HOROVOD_ELASTIC=1``), ``compression="auto"`` or a
            ``process_set`` other than the whole job.
        TypeError: unsupported ``compression`` or ``grad_scaler``.
        RuntimeError: the launcher started several tasks but Horovod sees one (see :func:`hvdcomp.launch.start_frontend`), or a method that messages
            ranks directly (gtopk, twophase) in a job without MPI (``horovodrun --gloo``), or gtopk
            (sends and receives) under elastic Horovod.

    Under elastic Horovod (``horovodrun --min-np/--max-np``), register ``optimizer.reset`` as a reset
    callback of the ``hvd.elastic.TorchState`` that holds it (docs/robustness.md, "Elastic
    Horovod"); the set-up collectives then run at the first step instead of here.

    Example::

        hvd.init()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           named_parameters=model.named_parameters(),
                                           compression="topk:density=0.01")
""".format(arguments=ARGUMENTS_DOC.rstrip("\n"))

