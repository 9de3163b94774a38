"""hvdcomp.DistributedOptimizer: Horovod's ``DistributedOptimizer`` with gradient compression.

A drop-in for ``hvd.DistributedOptimizer``: same arguments (``named_parameters``, ``compression``,
``backward_passes_per_step``, ``op``, ``gradient_predivide_factor``, ``groups``,
``sparse_as_dense``, ``process_set``), same methods (``synchronize``, ``skip_synchronize``,
``step``, ``zero_grad``, ``set_backward_passes_per_step``, ``state_dict``), same recipes (AMP,
clipping, accumulation, resume with ``hvd.broadcast_optimizer_state``, several optimizers).

One gradient's path:

1. backward fires a post-accumulate-grad hook on the parameter (after ``backward_passes_per_step``
   passes); the hook **compresses** it (``Compressor.encode``, error feedback included) — once
   per synchronized step, whatever the recipe;
2. its payload travels on the route planned at construction (:mod:`hvdcomp.plan`; public as
   ``optimizer.transport``), carried by that route's transport (:mod:`hvdcomp.transports`, one
   module each): Horovod ``allreduce_async`` for summable payloads; a bucketed variable-size
   allgather for the others (:mod:`hvdcomp.comm.allgather`); a local decode allreduced densely
   where the α-β cost model says that is cheaper (same result); or a batched compressor's own
   step-wide collectives;
3. ``synchronize()`` (called by ``step()``) sends what backward did not reach (unused parameters
   send zeros), waits, rebuilds the averaged gradient (``decode`` / ``aggregate``) into
   ``p.grad``, and agrees with every rank on the step (:mod:`hvdcomp.guard`: non-finite
   gradients, restored state, accumulation settings).

Compressor state (residuals, momenta, counters, generators) follows what is *applied*: a step's
updates are staged when it is compressed, committed when ``step()`` applies the update, and
dropped when the synchronized gradient is discarded (``zero_grad()`` or a new backward before
``step()``, a skipped non-finite step, a ``GradScaler`` overflow). With a ``GradScaler`` the state
follows loss-scale changes (:mod:`hvdcomp.amp`).

Time and bytes per phase go to ``optimizer.timer`` (:class:`hvdcomp.metrics.PhaseTimer`).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import logging
import os
import time
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from .amp import LossScaleTracker
from .comm import make_allgatherer
from .comm.costmodel import CostModel, measure_cost_model
from .comm.group import Group
from .comm.exchange import MPIExchange
from .comm.step import StepComm
from .compressors import Compressor, get_compressor
from .compressors.fp16 import FP16Compressor
from .compressors.none import NoneCompressor
from .compressors.segments import Segments
from .guard import NONFINITE_MODES, NonFiniteGuard
from .launch import check_launch
from .metrics import PhaseTimer
from .plan import (TransportPlan, choose_transport, fuse_units, make_buckets, make_units, plan_transport,
                   split_groups)
from .transports import AllgatherTransport, AllreduceTransport, BatchedTransport, Units

__all__ = ["DistributedOptimizer", "resolve_compression", "make_buckets", "DEFAULT_BUCKET_BYTES",
           "OPTIMIZER_ENV"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # as PyTorch DDP's bucket_cap_mb=25
OPTIMIZER_ENV = ("HVDCOMP_ALLGATHER",)  # environment overrides that must agree across ranks

log = logging.getLogger(__name__)

_ids = itertools.count()  # creation order of optimizers: identical on every rank, names collectives


def resolve_compression(compression) -> Compressor:
    """Accept an hvdcomp compressor, a spec string (``"topk:density=0.01"``) or Horovod's
    ``hvd.Compression.none`` / ``hvd.Compression.fp16``.

    Raises:
        TypeError: anything else.
    """
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, str):
        return get_compressor(compression)
    try:
        import horovod.torch as hvd

        if compression is hvd.Compression.none:
            return NoneCompressor()
        if compression is hvd.Compression.fp16:
            return FP16Compressor()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"compression must be an hvdcomp.Compressor, a spec string such as "
                    f"'topk:density=0.01', or hvd.Compression.none/fp16; got {compression!r}")


def _digest(obj) -> str:
    """A stable hash of a state dict (tensors, numbers, strings)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (as Horovod does)."""

    def __init__(self, params, named_parameters, compression, settings):
        super(self.__class__, self).__init__(params)
        import horovod.torch as hvd

        s = settings
        self._hvd = hvd
        self.compression = compression
        self.timer = s["timer"] if s["timer"] is not None else PhaseTimer()
        self.backward_passes_per_step = s["backward_passes_per_step"]
        self.op = s["op"]
        self.gradient_predivide_factor = s["gradient_predivide_factor"]
        self.sparse_as_dense = s["sparse_as_dense"]
        self.bucket_bytes = s["bucket_bytes"]
        self.nonfinite = s["nonfinite"]
        self.group = Group(s["process_set"])
        compression.bind_group(self.group.size)
        self._prefix = f"hvdcomp.{next(_ids)}"
        self._names = self._name_parameters(named_parameters)
        # expected backward order: last parameters first. Fixed, identical on every rank.
        self._order: List[torch.nn.Parameter] = [
            p for g in reversed(self.param_groups) for p in reversed(g["params"]) if p.requires_grad]
        # per-parameter state of the hot path, by position in _order (no tensor hashing per hook)
        self._pos: Dict[int, int] = {id(p): i for i, p in enumerate(self._order)}
        self._delay: List[int] = [self.backward_passes_per_step] * len(self._order)
        self.granularity = s["granularity"]
        self._hooks_fired = 0             # since the last synchronize: a backward is in progress
        self._sparse: List[tuple] = []  # (parameter, its sparse gradient) of this step
        self._guard = NonFiniteGuard(self.nonfinite)
        self._loss_scale = LossScaleTracker(s["grad_scaler"])
        # the step in progress ("round"): staged compressor state, collectives in flight
        self._round_open = False          # compressor state of this step is staged
        self._synced = False              # synchronize() done; the update is not applied yet
        self._skip = False                # the ranks agreed to skip this step (non-finite)
        self._transports: list = []       # the transports this optimizer uses (hvdcomp.transports)
        self._should_synchronize = True
        self._state_agreed = False        # compressor state agreed across ranks (first step)
        self._loaded = False              # load_state_dict() ran before the first step
        self._loaded_since_step = False   # ... or since the previous step
        self.skipped_steps = 0
        self._gatherer = None
        self._closed = False              # close() stopped communication for good
        self.cost_model = None
        self.transport = TransportPlan({self._names[p]: "local" for p in self._order})
        # as Horovod: processes outside the set train locally, and a job of one rank without
        # compression leaves the gradients exactly as backward made them
        self._passthrough = not self.group.included or (
            self.group.size == 1 and type(compression) is NoneCompressor)
        if self._passthrough:
            return
        if s["check_consistency"] and self.group.size > 1:  # before any collective ranks might not share
            self._check_consistency(s)
        # the gatherer also carries the per-step agreement (mpi4py: no Horovod cycle-time wait)
        if self.group.size > 1 or not (compression.summable or compression.batched):
            self._gatherer = make_allgatherer(s["allgather"], self.group)
        choice: Dict[str, float] = {}
        if s["transport"] == "auto" and self.group.size > 1:  # the cost model picks the transport
            if isinstance(s["cost_model"], CostModel):  # given: Horovod's collectives priced by it alone
                model, wait = s["cost_model"], 0.0
            else:
                model = measure_cost_model(self._gatherer.probe, self.group.size, agree=self._gatherer.agree)
                wait = self._measure_horovod_latency()
            chosen, choice = choose_transport(compression, model, self.group.size,
                                              [p.numel() for p in self._order], self.bucket_bytes,
                                              horovod_latency=wait,
                                              point_to_point=getattr(self._gatherer, "comm", None) is not None)
            if chosen is not compression:
                log.info("hvdcomp: transport='auto' replaces %s by %s (predicted %s)", compression.name,
                         chosen.name, {k: f"{v * 1e3:.3g} ms" for k, v in choice.items()})
                compression = self.compression = chosen
                compression.bind_group(self.group.size)
            s = dict(s, cost_model=model)  # measured once
        self.cost_model = self._resolve_cost_model(s["cost_model"])
        if compression.batched:
            self._step_comm = self._make_step_comm()
        names = [self._names[p] for p in self._order]
        groups = s["groups"]
        if isinstance(groups, list):  # parameters -> names (frozen ones dropped, as Horovod)
            if any(p not in self._names for g in groups for p in g):
                raise ValueError("groups lists a tensor that is not among the optimizer's parameters")
            groups = [[self._names[p] for p in g if id(p) in self._pos] for g in groups]
        groups = None if groups is None else split_groups(names, groups)
        # compression units: a gradient each, flattened buckets of gradients (granularity "bucket"),
        # or gradients compressed per tensor in one call per bucket (fused, :func:`fuse_units`)
        params = [(names[i], p.numel(), p.element_size(), f"{p.dtype}/{p.device}")
                  for i, p in enumerate(self._order)]
        gatherer = self._gatherer.kind if self._gatherer is not None else "none"
        fuse = (s["fuse_tensors"] and self.granularity == "tensor" and compression.segmentable
                and type(compression) is not NoneCompressor)
        if fuse:  # routes and allgather buckets per gradient, then the fused units within them
            self.transport = plan_transport([p[:3] for p in params], compression, self.cost_model,
                                            self.group.size, self.bucket_bytes, groups, gatherer,
                                            self.group.ranks)
            units = fuse_units(params, self.transport, self.bucket_bytes, groups)
        else:
            units = make_units(params, self.granularity, self.bucket_bytes, groups)
        self._unit_name: List[str] = [name for name, _ in units]
        self._members: List[List[int]] = [members for _, members in units]
        self._unit_of: List[int] = [0] * len(self._order)
        for u, members in enumerate(self._members):
            for i in members:
                self._unit_of[i] = u
        self._unit_wait = [len(m) for m in self._members]   # gradients each unit still waits for
        numel = [sum(self._order[i].numel() for i in m) for m in self._members]
        esize = [self._order[m[0]].element_size() for m in self._members]
        if fuse:
            at = {names[i]: u for u, m in enumerate(self._members) for i in m}
            self._segments = [None if len(m) == 1 else
                              Segments([names[i] for i in m], [self._order[i].shape for i in m])
                              for m in self._members]
            self._route: List[str] = [self.transport.routes[names[m[0]]] for m in self._members]
        else:
            self.transport = plan_transport(
                list(zip(self._unit_name, numel, esize)), compression, self.cost_model, self.group.size,
                self.bucket_bytes, groups if self.granularity == "tensor" else None, gatherer, self.group.ranks)
            at = {n: u for u, n in enumerate(self._unit_name)}
            self._segments = [None] * len(units)
            self._route = [self.transport.routes[n] for n in self._unit_name]
        self.transport.units = {self._unit_name[u]: [names[i] for i in m]
                                for u, m in enumerate(self._members) if len(m) > 1}
        self.transport.choice = choice
        buckets = [list(dict.fromkeys(at[n] for n in b)) for b in self.transport.buckets]
        self._units = Units(self._order, self._members, self._unit_name, self._segments, self._prefix,
                            self._gradient)
        # the transports (hvdcomp.transports), one per kind of route this optimizer's units take
        hvd, scale = self._hvd, self._result_scale()
        self._allreduce = AllreduceTransport(
            self.group, self.timer, compression, self._units, self._allreduce_args(),
            hvd.Sum if self.op is hvd.Sum else hvd.Average,
            compression.allreduce_op == "sum" and self.op is hvd.Sum, scale)
        self._allgather = AllgatherTransport(self._gatherer, self.timer, compression, self._units, buckets,
                                             self._prefix, self._encode, scale)
        self._batched = BatchedTransport(self.timer, compression, self._step_comm, scale) \
            if compression.batched else None
        self._transports = [t for t in (self._allreduce, self._allgather, self._batched) if t is not None]
        self._direct = type(compression) is NoneCompressor and self.granularity == "tensor"
        # every gradient reduced in place (none): the per-step agreement travels as sums with them
        # (results of float32/float64 gradients are exactly the allreduced averages: checked on them)
        self._summed_agreement = (self._direct and self.nonfinite != "ignore" and self.group.size > 1
                                  and all(p.dtype in (torch.float32, torch.float64) for p in self._order))
        self._agreement = None  # its handle, from the step's first allreduce to the agreement
        log.info("hvdcomp: %s", self.transport)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._order]

    # ---- set-up --------------------------------------------------------------------------------
    def _name_parameters(self, named_parameters) -> Dict[torch.Tensor, str]:
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            return {p: f"param.{i}" for i, p in enumerate(all_params)}
        named = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                             "usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names must be unique; repeated: {dups}")
        by_param = {p: n for n, p in named}
        missing = [i for i, p in enumerate(all_params) if p not in by_param]
        if missing:
            raise ValueError(f"named_parameters does not name optimizer parameter(s) at position(s) "
                             f"{missing[:10]}; pass model.named_parameters() of the model whose "
                             "parameters the optimizer holds")
        return {p: by_param[p] for p in all_params}

    def _resolve_cost_model(self, cost_model) -> Optional[CostModel]:
        """The α-β model that routes non-summable payloads, or None where routing cannot apply."""
        comp = self.compression
        if (cost_model == "off" or comp.summable or comp.batched or not comp.aggregate_is_mean
                or self.group.size == 1
                or all(comp.expected_payload_bytes(p.numel()) is None for p in self._order)):
            return None
        if isinstance(cost_model, CostModel):
            return cost_model
        return measure_cost_model(self._gatherer.probe, self.group.size, agree=self._gatherer.agree)

    def _measure_horovod_latency(self, calls: int = 5) -> float:
        """Seconds of one tiny Horovod allreduce in this group (its cycle time and negotiation):
        the median of ``calls`` after one untimed, rank 0's value on every rank."""
        probe = torch.zeros(1)
        times = []
        for k in range(calls + 1):
            t0 = time.perf_counter()
            self.group.allreduce(probe, f"{self._prefix}.latency.{k}", self._hvd.Sum)
            times.append(time.perf_counter() - t0)
        mine = sorted(times[1:])[calls // 2]
        return float(self._gatherer.agree(np.array([mine]))[0])

    def _make_step_comm(self) -> StepComm:
        """The collectives of a batched compressor's step (:class:`hvdcomp.comm.step.StepComm`):
        Horovod allreduce and broadcast within the group, point-to-point messages on a duplicate
        of the mpi4py allgather's communicator (under MPI).

        Raises:
            RuntimeError: the compressor needs point-to-point messages and the ranks have no MPI.
        """
        p2p = None
        comm = getattr(self._gatherer, "comm", None)
        if self.compression.needs_point_to_point and self.group.size > 1:
            if comm is None:
                raise RuntimeError(f"'{self.compression.name}' messages ranks point to point through MPI, "
                                   "but this job has no usable mpi4py communicator (Horovod started with "
                                   "gloo, or allgather='horovod'): launch with mpirun or horovodrun --mpi "
                                   "with mpi4py installed, or use cltk or topk")
            p2p = MPIExchange(comm.Dup())
        return StepComm(self._allreduce_mean, self.group.rank, self.group.size, self._broadcast, p2p)

    def _broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """One blocking Horovod broadcast from ``root`` (a rank in the group), timed and counted."""
        with self.timer.phase("communicate"):
            out = self.group.broadcast(tensor, root, f"{self._prefix}.{name}")
        nbytes = tensor.numel() * tensor.element_size()
        self.timer.add_bytes(sent=nbytes if self.group.rank == root else 0, received=nbytes)
        return out

    def _signature(self, s) -> dict:
        """Everything that must be identical on every rank (compared at construction)."""
        cost = s["cost_model"]
        return {"compression": {"class": type(self.compression).__name__, **self.compression.describe()},
                "backward_passes_per_step": self.backward_passes_per_step,
                "op": str(self.op), "gradient_predivide_factor": self.gradient_predivide_factor,
                "sparse_as_dense": self.sparse_as_dense, "nonfinite": self.nonfinite,
                "bucket_bytes": self.bucket_bytes, "allgather": s["allgather"],
                "granularity": self.granularity, "fuse_tensors": s["fuse_tensors"],
                "transport": s["transport"],
                "cost_model": (cost.alpha, cost.beta) if isinstance(cost, CostModel) else cost,
                "groups": s["groups"] if not isinstance(s["groups"], list)
                else [[self._names.get(p) for p in g] for g in s["groups"]],
                "environment": {k: os.environ.get(k) for k in OPTIMIZER_ENV},
                "optimizer_index": self._prefix,
                "parameters": [(self._names[p], tuple(p.shape), str(p.dtype)) for p in self._order]}

    def _check_consistency(self, s) -> None:
        """All ranks must agree on every setting and the parameter list (names, shapes, order).

        Raises:
            ValueError: on every rank, naming the first differences.
        """
        every = self.group.allgather_object(self._signature(s), name=f"{self._prefix}.consistency")
        diffs = []
        for rank, other in enumerate(every):
            if other == every[0]:
                continue
            for key in other:
                if key != "parameters" and other[key] != every[0][key]:
                    diffs.append(f"rank {rank} {key} {other[key]} != rank 0 {every[0][key]}")
            a, b = every[0]["parameters"], other["parameters"]
            if len(a) != len(b):
                diffs.append(f"rank {rank} has {len(b)} parameters, rank 0 has {len(a)}")
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is not None:
                diffs.append(f"parameter #{first}: rank {rank} {b[first]} != rank 0 {a[first]}")
        if diffs:
            raise ValueError("ranks disagree on the training set-up (build the same model, "
                             "compressor and optimizer settings on every rank, in the same order): "
                             + "; ".join(diffs[:10]))

    def _agree_state(self) -> None:
        """At the first step: make compressor state that must be identical on every rank so.

        Horovod's resume recipe loads a checkpoint on rank 0 only, then broadcasts parameters and
        optimizer state. Compressor state has two parts (:meth:`hvdcomp.Compressor.shared_state`):
        the shared part (step counters, PowerSGD's Q, warm-up epoch) is broadcast here from the
        first rank that loaded; the per-rank part (residuals, momenta, per-rank generators) stays
        as each rank has it: restored where a rank loaded its own, fresh (zero) elsewhere.

        Raises:
            RuntimeError: ranks that loaded checkpoints whose shared state differs, or fresh ranks
                whose shared state differs (compressors built with different seeds).
        """
        self._state_agreed = True
        self._loaded_since_step = False
        if self.group.size == 1:
            return
        shared = self.compression.shared_state()
        every = self.group.allgather_object((self._loaded, _digest(shared)), name=f"{self._prefix}.state")
        loaders = [r for r, (loaded, _) in enumerate(every) if loaded]
        pool = loaders or list(range(len(every)))
        if len({every[r][1] for r in pool}) > 1:
            raise RuntimeError(f"compressor state that must be identical on every rank (step counters, "
                               f"shared factors) differs between ranks {pool}: load the same checkpoint "
                               "everywhere, or on rank 0 only (it is then broadcast at the first step)")
        if loaders and len(loaders) < len(every):
            root = loaders[0]
            state = self.group.broadcast_object((shared, self.skipped_steps) if self.group.rank == root else None,
                                                root, name=f"{self._prefix}.shared")
            if not self._loaded:
                self.compression.load_shared_state(state[0])
                self.skipped_steps = state[1]
            log.info("hvdcomp: compressor state shared from rank %d (per-rank state kept where "
                     "loaded, fresh elsewhere)", root)

    # ---- the step in progress ------------------------------------------------------------------
    def _open_round(self) -> None:
        """First compression of a step: agree on state (once), follow the loss scale, stage."""
        if self._round_open:
            return
        if not self._state_agreed:
            self._agree_state()
        factor = self._loss_scale.factor()
        if factor is not None:
            self.compression.rescale_state(factor)
        self.compression.begin_step()
        self._round_open = True

    def _discard_round(self) -> None:
        """The synchronized (or partly compressed) gradient will not be applied: drop its
        staged compressor state, so it leaves no trace."""
        if self._busy():
            raise AssertionError("a step was discarded while collectives were in flight; call "
                                 "optimizer.synchronize() first")
        if self._round_open:
            self.compression.rollback()
        self._round_open = self._synced = self._skip = False
        self._guard.reset()

    # ---- backward hooks --------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if self._synced:  # a new backward after synchronize() without step(): that update is dropped
            self._discard_round()
        i = self._pos[id(p)]
        if self._delay[i] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to "
                "step() or synchronize(). Increase backward_passes_per_step to accumulate "
                "gradients locally.")
        self._delay[i] -= 1
        self._hooks_fired += 1
        if self._delay[i] == 0:
            u = self._unit_of[i]
            self._unit_wait[u] -= 1
            if self._unit_wait[u] == 0 and self._route[u] != "batched":
                self._launch(u)

    def _gradient(self, p: torch.Tensor) -> torch.Tensor:
        """``p.grad`` ready to compress: zeros for a parameter this rank did not use (other ranks
        may have), a sparse gradient made dense (Horovod's ``sparse_as_dense`` semantics)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            self._sparse.append((p, p.grad))
            p.grad = p.grad.to_dense()
        return p.grad

    def _busy(self) -> bool:
        """Whether any transport has payloads queued or collectives in flight."""
        return any(t.busy for t in self._transports)

    def _encode(self, u: int):
        """Compress unit ``u`` (finiteness is checked once per step, see :meth:`synchronize`)."""
        self._open_round()
        return self.compression.encode(self._units.tensor(u), self._unit_name[u], self._segments[u])

    def _allreduce_args(self) -> tuple:
        """(op, prescale, postscale) for Horovod's allreduce of a summable payload: ``op`` and
        ``gradient_predivide_factor`` as Horovod applies them."""
        hvd = self._hvd
        if self.op is hvd.Sum or self.compression.allreduce_op == "sum":
            return hvd.Sum, 1.0, 1.0
        f = self.gradient_predivide_factor
        return hvd.Average, 1.0 / f, f

    def _launch(self, u: int) -> None:
        """Compress unit ``u`` and hand its payload to its route's transport. Timed as
        ``compress`` (queueing an asynchronous collective included), except ``none``'s direct
        path, which like stock Horovod's hook counts as compute."""
        route = self._route[u]
        if self._direct:  # none on one gradient: Horovod's own path, nothing to encode, and (as for
            # stock Horovod) queueing the allreduce is charged to compute: no timer entry per tensor
            grad = self._units.tensor(u)
            if grad.dtype in (torch.float32, torch.float64) and grad.is_contiguous():  # (none sends
                # half-precision gradients as float32: their sums would overflow in fp16)
                self._open_round()
                self._allreduce.start_in_place(u, grad)
                self._launch_agreement()
                return
        with self.timer.phase("compress"):
            payload, ctx = self._encode(u)
            if route == "allreduce":
                self._allreduce.start(u, payload, ctx)
                return
        if route == "decoded-allreduce":  # cheaper to average the decoded payload densely
            self._allreduce.start_decoded(u, payload, ctx)
        else:
            self._allgather.queue(u, payload, ctx)

    def _result_scale(self) -> float:
        """Factor from the mean the aggregation computes to what ``op`` asks for (Sum: × size)."""
        return float(self.group.size) if self.op is self._hvd.Sum else 1.0

    # ---- synchronisation ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient's collective and write the averaged gradients into ``p.grad``.

        Parameters whose hook did not fire (unused in this step, or fewer backward passes than
        ``backward_passes_per_step``) are sent now with their current (or zero) gradient, so all
        ranks take part in the same collectives. Calling it again before ``step()`` (with no
        backward in between) does nothing: a gradient is compressed once per step.
        """
        if self._closed:
            raise RuntimeError(_CLOSED)
        if self._passthrough:
            self._synced = True
            return
        if self._synced:
            return
        if self.compression.batched:
            self._synchronize_batched()
            return
        # every local gradient's finiteness, in one fused check: the inputs are intact until the
        # collectives finish, except those reduced in place (none, granularity "tensor") by
        # backward's hooks, checked on their results (identical on every rank) below
        # (none on float32/float64 gradients: every result is the plain allreduced average,
        # identical on every rank, so all are checked after instead, and nothing before)
        if self._summed_agreement:
            in_place = range(len(self._order))
        else:
            in_place = [self._members[u][0] for u in self._allreduce.in_place_units()
                        if len(self._members[u]) == 1]
            skip = set(in_place)
            self._guard.observe([p.grad for i, p in enumerate(self._order) if p.grad is not None and i not in skip])
        units = range(len(self._members))
        gathered = self._allgather.bucket_of
        for u in units:  # allreduces backward did not start; allgather buckets are flushed below
            if gathered[u] < 0 and u not in self._allreduce.inflight:
                self._launch(u)
        self._launch_agreement()
        self._allgather.start(flush=True)
        self._allgather.finish()
        self._allreduce.finish([u for u in units if gathered[u] < 0])
        # results identical on every rank: in place, or a saturated payload reported overflowed
        overflowed = [i for u in self._allreduce.overflowed for i in self._members[u]]
        self._guard.observe([self._order[i].grad for i in [*in_place, *overflowed]])
        self._end_synchronize()

    def _launch_agreement(self) -> None:
        """Start this step's agreement as a small summed allreduce that Horovod fuses with the
        gradients' (``none`` on float32/float64 gradients, see :mod:`hvdcomp.guard`); once a step."""
        if self._summed_agreement and self._agreement is None:
            row = self._guard.summary(self._loaded_since_step, self.backward_passes_per_step)
            self._agreement = self.group.allreduce_async(torch.tensor(row, dtype=torch.float64),
                                                         f"{self._prefix}.agree", self._hvd.Sum)

    def _end_synchronize(self) -> None:
        """Reset the accumulation counters, agree on the step with every rank, and give sparse
        gradients back their layout (as Horovod's ``sparse_as_dense``: the optimizer sees the
        gradient layout it would see without Horovod)."""
        self._delay = [self.backward_passes_per_step] * len(self._order)
        self._unit_wait = [len(m) for m in self._members]
        self._hooks_fired = 0
        self._synced = True
        self._agree_step()
        self._restore_sparse(self._sparse)
        self._sparse = []

    @staticmethod
    def _restore_sparse(pairs) -> None:
        """Write the averaged dense gradient back into the original sparse one, as Horovod does."""
        for p, sparse in pairs:
            p.grad = sparse.zero_().add_(p.grad.to_sparse())

    def _agree_step(self) -> None:
        """The per-step agreement (:mod:`hvdcomp.guard`); a non-finite step is skipped here."""
        if self.nonfinite == "ignore":
            return
        if self._agreement is not None:
            with self.timer.phase("communicate"):
                sums = self.group.synchronize(self._agreement).tolist()
                self._agreement = None
                verdict = self._guard.agree_summed(sums, self._gatherer.allgather_ints,
                                                   self._loaded_since_step, self.backward_passes_per_step)
        elif self.group.size > 1:
            with self.timer.phase("communicate"):
                verdict = self._guard.agree(self._gatherer.allgather_ints, self._loaded_since_step,
                                            self.backward_passes_per_step)
        else:
            verdict = self._guard.agree(lambda v: [list(v)], self._loaded_since_step,
                                        self.backward_passes_per_step)
        self._loaded_since_step = False
        if verdict.skip:
            if self._round_open:
                self.compression.rollback()
            self._round_open = False
            self._skip = True
            self.skipped_steps += 1
            # as an allreduced Inf would: every gradient reads non-finite, so a GradScaler sees the
            # overflow (and lowers its scale) even where a compressor saturated the values
            for p in self._order:
                p.grad.fill_(float("nan"))

    def _allreduce_mean(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """One blocking Horovod allreduce (average) within the group, timed and counted."""
        with self.timer.phase("communicate"):
            out = self.group.allreduce(tensor, f"{self._prefix}.{name}", self._hvd.Average)
        nbytes = tensor.numel() * tensor.element_size()
        self.timer.add_bytes(sent=nbytes, received=nbytes)
        return out

    def _synchronize_batched(self) -> None:
        """Batched compressors (PowerSGD) reduce every gradient of the step at once."""
        params = self._order  # expected backward order, as PyTorch DDP's rebuilt buckets hold them
        self._open_round()
        self._guard.observe([self._gradient(p) for p in params])
        sparse, self._sparse = self._sparse, []
        self._end_synchronize()
        if self._skip:  # PowerSGD's state is untouched
            self._restore_sparse(sparse)
            return
        self._batched.finish([(self._names[p], p) for p in params])
        self._restore_sparse(sparse)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip ``synchronize()`` (call it yourself first, e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """``synchronize()`` unless inside :meth:`skip_synchronize` (or already synchronized),
        then the wrapped optimizer's step, and the compressor state of this step is committed.

        After a skipped (non-finite) step nothing is updated and ``None`` is returned.

        Raises:
            RuntimeError: the optimizer was closed (:meth:`close`), also inside
                :meth:`skip_synchronize`.
        """
        if self._closed:
            raise RuntimeError(_CLOSED)
        if self._should_synchronize:
            if self._synced:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); the synchronized gradients are applied "
                              "as they are (not compressed and sent again).")
            else:
                self.synchronize()
        self._synced = False
        if self._skip:  # a non-finite gradient somewhere: no rank updates
            self._skip = False
            return None
        result = super(self.__class__, self).step(closure)
        if self._round_open:
            if self.compression.has_scaled_state:
                self._loss_scale.discover(self)
            self.compression.commit()
            self._round_open = False
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
        self._delay = [passes] * len(self._order)
        self._unit_wait = [len(m) for m in getattr(self, "_members", [])]

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
        for t in self._transports:
            t.reset()
        self._hooks_fired, self._agreement = 0, None
        self._unit_wait = [len(m) for m in getattr(self, "_members", [])]
        self._discard_round()
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            self.compression.load_state_dict(extra["compression"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            self._loaded = True
            self._loaded_since_step = self._state_agreed

    def zero_grad(self, set_to_none: bool = True):
        """As the wrapped optimizer's, but refuses while a backward's gradients are pending (as
        Horovod does); after ``synchronize()`` without ``step()`` the synchronized update is
        discarded, leaving no trace in compressor state."""
        if self._hooks_fired or self._busy():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited "
                                 "as it can cause a race condition.")
        if self._synced or self._round_open:
            self._discard_round()
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the optimizer then no longer communicates)."""
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []

    def close(self) -> None:
        """Stop communicating: detach the backward hooks and stop the allgather transport's
        background thread (one per optimizer that allgathers under MPI). For programs that build
        many optimizers in one process (hyper-parameter sweeps, a new optimizer per phase); a job
        that builds one can leave it to process exit.

        Call it on every rank of the process set, between steps. Idempotent. Afterwards
        ``synchronize()`` and ``step()`` raise (nothing trains on un-averaged gradients by mistake),
        and the compressor, with its state (residuals, momenta), may be handed to a new optimizer.

        The MPI communicators the optimizer made (an allgather duplicate, a hierarchical
        allgather's node and leader communicators, a process set's, a point-to-point duplicate for
        gtopk and two-phase) stay until ``MPI_Finalize``: freeing them crashed Open MPI 4.1.4 while
        Horovod's thread drives MPI progress (see
        :meth:`hvdcomp.comm.allgather.MPIAllgatherer.close`). MPI caps their number (thousands),
        so thousands of optimizers should not share one process.

        Raises:
            RuntimeError: a step is in progress (backward ran, its gradients are not
                synchronized and applied yet): call ``step()`` (or ``synchronize()`` and
                ``zero_grad()``) first, on every rank.
        """
        if self._closed:
            return
        if self._hooks_fired or self._busy() or self._synced:
            raise RuntimeError("close() during a step: backward's gradients are not synchronized and "
                               "applied yet. Call optimizer.step() (or synchronize() and zero_grad()) "
                               "first, on every rank.")
        self.remove_hooks()
        if self._gatherer is not None:
            self._gatherer.close()
        owner = _owners.get(self.compression)
        if owner is not None and owner() is self:  # the compressor (and its state) may serve a new one
            del _owners[self.compression]
        self._closed = True


_owners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # compressor -> optimizer using it
ADASUM_METHODS = ("none", "fp16")  # methods op=hvd.Adasum runs with (as stock Horovod's Adasum optimizer)


def _adasum_compression(compression):
    """Horovod's own compression for ``op=hvd.Adasum`` (stock's Adasum optimizer compresses
    parameter deltas): ``none`` and ``fp16`` (spec, hvdcomp compressor without error feedback, or
    ``hvd.Compression.none`` / ``fp16``).

    Raises:
        ValueError: any other method, naming the supported ones.
    """
    import horovod.torch as hvd

    if compression in (hvd.Compression.none, hvd.Compression.fp16):
        return compression
    comp = resolve_compression(compression)
    if type(comp) is NoneCompressor:
        return hvd.Compression.none
    if type(comp) is FP16Compressor:
        return hvd.Compression.fp16
    raise ValueError(f"op=hvd.Adasum combines parameter deltas (Horovod's Adasum optimizer), which "
                     f"'{comp.name}' ({comp.describe()}) does not compress; Adasum runs with compression "
                     f"{' or '.join(repr(m) for m in ADASUM_METHODS)} (without error feedback). Use "
                     "op=hvd.Average (or hvd.Sum) for other methods.")


_CLOSED = ("this DistributedOptimizer was closed (close() stopped its communication): build a new one "
           "to keep training distributed")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                         compression="none",
                         backward_passes_per_step: int = 1,
                         op=None,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups=None,
                         sparse_as_dense: bool = False,
                         process_set=None,
                         *,
                         allgather: str = "auto",
                         timer: Optional[PhaseTimer] = None,
                         nonfinite: str = "skip",
                         check_consistency: bool = True,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         cost_model="measure",
                         grad_scaler=None,
                         granularity: str = "tensor",
                         fuse_tensors: bool = True,
                         transport: str = "planned") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are compressed and averaged over Horovod ranks.

    Takes ``hvd.DistributedOptimizer``'s arguments, in its order, plus hvdcomp's own (keyword
    only); the returned object is an instance of a subclass of ``optimizer``'s class holding the
    same parameter groups. Communication starts from gradient hooks during backward; ``step()``
    synchronizes first (or use ``synchronize()`` + ``skip_synchronize()`` to clip or unscale the
    averaged gradients).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (its state is not carried over, as in Horovod).
        named_parameters: ``model.named_parameters()``; names key compressor state and must be
            the same on every rank. Two optimizers may use the same names (e.g. a GAN's G and D).
            Without it parameters are named by position.
        compression: an :class:`hvdcomp.Compressor`, a spec such as ``"topk:density=0.01"``, or
            ``hvd.Compression.none`` / ``hvd.Compression.fp16``. One compressor per optimizer.
        backward_passes_per_step: backward passes accumulated locally before communicating.
        op: ``hvd.Average`` (default) or ``hvd.Sum`` (the sum over ranks, for every method).
            ``hvd.Adasum`` combines parameter deltas, not gradients: with ``none`` or ``fp16``
            (no error feedback; ``hvd.Compression.none`` / ``fp16`` alike) this returns stock
            Horovod's own Adasum optimizer (``hvd.DistributedOptimizer(..., op=hvd.Adasum)``;
            ``fp16`` as stock's float16 cast of the delta), so results are stock's bit for bit,
            and hvdcomp's keyword-only arguments do not apply to it (no ``timer``; non-finite
            values are not checked, as stock). Other methods are refused (``ValueError``).
        gradient_predivide_factor: as Horovod: summable payloads are divided by it before the
            allreduce and multiplied by it / size after (``op=Average`` only). Allgathered
            payloads are averaged in float32 locally, where it changes nothing.
        num_groups: deprecated Horovod alias of ``groups`` (an int).
        groups: as Horovod: an int k (gradients in k groups) or a list of lists of parameters
            fused together; for allgathered payloads each group is one bucket (``bucket_bytes``
            is then not used). Results do not depend on it.
        sparse_as_dense: accepted for compatibility; sparse gradients (``Embedding(sparse=True)``)
            are always made dense before compression, as Horovod does with ``True``.
        process_set: a Horovod ``ProcessSet``: gradients are averaged over its ranks only, and
            every collective of the optimizer and its compressor stays inside it; processes
            outside it train locally (as Horovod).
        allgather: transport for non-summable payloads: ``"auto"`` (mpi4py ``Allgatherv`` under
            MPI, Horovod allgather otherwise), ``"mpi4py"``, ``"hierarchical"`` (mpi4py,
            node-aware: gathered inside each node, exchanged between node leaders, broadcast back;
            same results) or ``"horovod"``.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` to record into (a new one by default;
            available as ``optimizer.timer``).
        nonfinite: what a NaN/Inf gradient on any rank does: ``"skip"`` (default: every rank
            skips the step; compressor state stays as before it; every ``.grad`` reads NaN so a
            ``GradScaler`` sees the overflow), ``"raise"`` (``FloatingPointError`` on every rank)
            or ``"ignore"`` (no check and no per-step agreement). **This is where hvdcomp
            differs from stock Horovod on purpose**: stock applies a non-finite step (NaN/Inf
            reach the parameters), the default ``"skip"`` leaves the parameters as they were;
            ``nonfinite="ignore"`` reproduces stock's behaviour (with ``none``, bit for bit).
        check_consistency: at construction, verify (one allgather) that every rank has the same
            settings and parameter list (names, shapes, dtypes, order).
        bucket_bytes: bytes of dense gradient per allgather bucket (default 25 MiB, as DDP).
        cost_model: how payloads that need an allgather choose between allgather and
            allreduce of their local decode, per gradient: ``"measure"`` (default: α and β timed
            with a few allgathers at construction), ``"off"`` (always allgather), a
            :class:`hvdcomp.comm.costmodel.CostModel` or an ``(alpha_seconds,
            beta_seconds_per_byte)`` pair. Only compressors whose ``aggregate`` is the mean of
            ``decode`` are routed; the result is the same either way.
        grad_scaler: the ``torch.amp.GradScaler`` of an AMP loop, so that compressor state kept
            in gradient units follows loss-scale changes; found automatically when omitted (see
            :mod:`hvdcomp.amp`).
        granularity: what the compressor sees as one tensor: ``"tensor"`` (default: each
            gradient, as the methods' papers do) or ``"bucket"`` (as PyTorch DDP's comm hooks:
            consecutive gradients of one dtype, up to ``bucket_bytes`` or one Horovod ``group``,
            are copied into one flat buffer and compressed together; state such as error-feedback
            residuals is kept per bucket, named ``bucket<k>``). ``"bucket"`` removes the fixed
            cost per tensor on models with many small tensors, and changes what a method selects:
            top-k keeps the largest entries of the bucket, not of each layer; QSGD, signSGD and
            the casts are unchanged up to their scales. Refused for PowerSGD (it needs each
            gradient's matrix shape); no effect on gtopk and cltk (they select over the whole
            model).
        fuse_tensors: with ``granularity="tensor"`` and a method that can (``segmentable``: top-k
            with ``select=exact``, fp16, bf16, threshold, and these with error feedback), the
            gradients of one bucket (one allgather bucket, or up to ``bucket_bytes`` of
            consecutive allreduced gradients) are copied into one flat buffer and compressed in
            one vectorised call, each gradient still by its own rules (its own top-k, fp16
            scale, residual): the same results as one call per gradient, without the fixed
            cost per gradient, and one payload per bucket on the wire. ``False``: one call and
            one payload per gradient, each sent as soon as backward produced it.
        transport: ``"planned"`` (default: the method's own transport, routed as above) or
            ``"auto"``: the cost model (measured, or ``cost_model`` given) first picks, among the
            transports that carry the same kind of compression, the one with the least predicted
            communication per step (:func:`hvdcomp.plan.choose_transport`): top-k with error
            feedback by allgather, ``gtopk`` or ``cltk``; QSGD, TernGrad or EF-signSGD by allgather
            or ``twophase``. ``optimizer.compression`` is then the chosen method and
            ``optimizer.transport.choice`` holds every candidate's predicted seconds.

    Raises:
        ValueError: Horovod is not initialised (as stock Horovod raises), bad
            ``named_parameters``, ``backward_passes_per_step < 1``, unknown
            ``nonfinite``, ``op`` not Average/Sum/Adasum (or Adasum with a method other than
            ``none``/``fp16``), ``gradient_predivide_factor`` with
            ``op != Average``, bad ``groups``, ``bucket_bytes < 1``, an unknown ``cost_model``
            or ``granularity`` (or ``"bucket"`` with PowerSGD), an unknown ``transport`` (or
            ``"auto"`` with ``cost_model="off"``), a compressor already used by another optimizer, a compressor that applies momentum
            (DGC) with an optimizer that also does, or ranks that disagree on any setting
            (raised on every rank, naming the difference).
        TypeError: unsupported ``compression`` or ``grad_scaler``.
        RuntimeError: the launcher started several tasks but Horovod sees one (see
            :func:`hvdcomp.launch.check_launch`), or a method that messages ranks directly (gtopk, twophase) in a job without MPI (``horovodrun --gloo``).

    Example::

        hvd.init()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           named_parameters=model.named_parameters(),
                                           compression="topk:density=0.01")
    """
    import horovod.torch as hvd
    from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

    if not hvd.is_initialized():  # ValueError, the type stock Horovod raises here
        raise ValueError("Horovod is not initialised: call hvd.init() before hvdcomp.DistributedOptimizer")
    check_launch(hvd.size())
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be 'skip', 'raise' or 'ignore', got {nonfinite!r}")
    op = hvd.Average if op is None else op
    if op is hvd.Adasum:
        return hvd.DistributedOptimizer(optimizer, named_parameters, _adasum_compression(compression),
                                        backward_passes_per_step, op, gradient_predivide_factor, num_groups,
                                        groups, sparse_as_dense,
                                        hvd.global_process_set if process_set is None else process_set)
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
    gradient_predivide_factor = float(gradient_predivide_factor)
    if gradient_predivide_factor != 1.0 and op is not hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average (as in Horovod)")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if num_groups:
        warnings.warn("num_groups has been replaced by groups (as in Horovod)", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor")
    if isinstance(groups, list):
        if any(not isinstance(p, torch.Tensor) for g in groups for p in g):
            raise ValueError("groups must consist of torch.Tensor (lists of the model's parameters)")
    if granularity not in ("tensor", "bucket"):
        raise ValueError(f"granularity must be 'tensor' or 'bucket', got {granularity!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer (bytes), e.g. 25 * 2**20; got {bucket_bytes!r}")
    if not (cost_model in ("measure", "off") or isinstance(cost_model, CostModel)
            or (isinstance(cost_model, (tuple, list)) and len(cost_model) == 2)):
        raise ValueError("cost_model must be 'measure', 'off', a CostModel or an (alpha_seconds, "
                         f"beta_seconds_per_byte) pair; got {cost_model!r}")
    if isinstance(cost_model, (tuple, list)):
        cost_model = CostModel(float(cost_model[0]), float(cost_model[1]))  # ValueError if out of range
    if transport not in ("planned", "auto"):
        raise ValueError(f"transport must be 'planned' or 'auto', got {transport!r}")
    if transport == "auto" and cost_model == "off":
        raise ValueError("transport='auto' lets the cost model choose: give cost_model='measure' (default) "
                         "or (alpha_seconds, beta_seconds_per_byte), not 'off'")
    compression = resolve_compression(compression)
    if granularity == "bucket" and compression.batched and not compression.whole_model:
        raise ValueError(f"granularity='bucket' flattens gradients, but '{compression.name}' needs "
                         "each gradient's matrix shape: use granularity='tensor'")
    owner = _owners.get(compression)
    if owner is not None and owner() is not None:
        raise ValueError(f"this '{compression.name}' compressor already serves another "
                         "DistributedOptimizer; its state is keyed by parameter name, so give each "
                         "optimizer its own (e.g. pass the spec string, or a new get_compressor(...))")
    if compression.owns_momentum:
        for group in optimizer.param_groups:
            beta = group.get("momentum", 0.0) or (group.get("betas") or (0.0,))[0]
            if beta:
                raise ValueError(
                    f"'{compression.name}' applies momentum itself (momentum correction), but the "
                    f"optimizer also applies momentum {beta}: momentum would be applied twice. Create "
                    "the optimizer without momentum, e.g. torch.optim.SGD(params, lr=..., momentum=0).")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state() initialises the state of a fresh optimizer with a *local* step
    # of the wrapped optimizer only when it recognises a Horovod DistributedOptimizer by its module;
    # otherwise it calls step() on the fresh ranks only, and a synchronising step on a subset of the
    # ranks deadlocks. hvdcomp's optimizer is of that family, so it says so.
    cls.__module__ = _HorovodOptimizer.__module__
    settings = dict(backward_passes_per_step=backward_passes_per_step, op=op,
                    gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                    sparse_as_dense=bool(sparse_as_dense), process_set=process_set, allgather=allgather,
                    timer=timer, nonfinite=nonfinite, check_consistency=check_consistency,
                    bucket_bytes=bucket_bytes, cost_model=cost_model, grad_scaler=grad_scaler,
                    granularity=granularity, fuse_tensors=bool(fuse_tensors), transport=transport)
    opt = cls(optimizer.param_groups, named_parameters, compression, settings)
    _owners[opt.compression] = weakref.ref(opt)  # (transport="auto" may have chosen another)
    return opt
