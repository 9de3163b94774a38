"""hvdcomp.DistributedOptimizer: Horovod-style data-parallel optimizer with gradient compression.

One gradient's path (see the class docstring for the API):

1. backward fires a post-accumulate-grad hook on the parameter (after ``backward_passes_per_step``
   passes); the hook **compresses** it (``Compressor.encode``, error feedback included);
2. summable payloads start a Horovod ``allreduce_async`` (``op=Average``) at once (Horovod fuses
   them into its fusion buffer). Payloads that need an allgather wait for the rest of their
   **bucket** (consecutive gradients in backward order, ``bucket_bytes`` of dense gradient per
   bucket); a complete bucket is packed into one buffer with a header of per-tensor counts and
   moved by one variable-size allgather on a background thread (mpi4py), buckets in one fixed
   order on every rank so collectives match. A gradient whose compressed payload would cost
   more to allgather than its dense form costs to allreduce (α-β cost model, see
   :mod:`hvdcomp.comm.costmodel`) is decoded locally and allreduced instead: same result;
3. ``synchronize()`` (called by ``step()``) launches what backward did not reach (unused
   parameters contribute zeros), waits for every collective (**communicate**: only the time
   the training thread waits, i.e. communication on the critical path), rebuilds the averaged
   gradient (``decode`` / ``aggregate``: **decompress**) and writes it into ``p.grad``.

Time and bytes per phase go to ``optimizer.timer`` (:class:`hvdcomp.metrics.PhaseTimer`).
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .comm import make_allgatherer
from .comm.costmodel import CostModel, measure_cost_model
from .compressors import Compressor, get_compressor
from .compressors.fp16 import FP16Compressor
from .compressors.none import NoneCompressor
from .metrics import PhaseTimer

__all__ = ["DistributedOptimizer", "resolve_compression", "make_buckets", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # as PyTorch DDP's bucket_cap_mb=25

log = logging.getLogger(__name__)


def make_buckets(sizes: List[int], bucket_bytes: int) -> List[List[int]]:
    """Group consecutive items into buckets of at most ``bucket_bytes`` (bytes).

    Args:
        sizes: bytes of each item, in launch order.
        bucket_bytes: cap per bucket; an item larger than the cap gets a bucket of its own.

    Returns:
        Lists of item positions, covering every item once, in order.
    """
    buckets, current, filled = [], [], 0
    for i, nbytes in enumerate(sizes):
        if current and filled + nbytes > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += nbytes
    if current:
        buckets.append(current)
    return buckets


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


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (as Horovod does)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 allgather, timer, nonfinite="skip", check_consistency=True,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, cost_model="measure"):
        super(self.__class__, self).__init__(params)
        import horovod.torch as hvd

        self._hvd = hvd
        self.compression = compression
        self.timer = timer if timer is not None else PhaseTimer()
        self.backward_passes_per_step = backward_passes_per_step
        self._names = self._name_parameters(named_parameters)
        # expected backward order: last parameters first. Fixed, identical on every rank.
        self._order: List[torch.nn.Parameter] = [
            p for g in reversed(self.param_groups) for p in reversed(g["params"]) if p.requires_grad]
        self._delay: Dict[torch.Tensor, int] = {p: backward_passes_per_step for p in self._order}
        self._encoded: Dict[torch.Tensor, tuple] = {}    # payloads waiting for their bucket
        self._inflight: Dict[torch.Tensor, tuple] = {}   # launched allreduces
        self._bucket_handles: Dict[int, object] = {}     # launched bucket allgathers
        self._next_bucket = 0
        self.bucket_bytes = bucket_bytes
        self._synchronized = False
        self._should_synchronize = True
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._local_bad = None      # device flag: a non-finite gradient was seen on this rank
        self._step_open = False     # compressor state updates are staged until the step is judged
        self._skip_next = False
        if check_consistency and hvd.size() > 1:  # before any collective that ranks might not share
            self._check_consistency()
        # also carries the per-step non-finite flags (mpi4py: no Horovod cycle-time wait)
        self._gatherer = make_allgatherer(allgather) if hvd.size() > 1 or not compression.summable else None
        self.cost_model = self._resolve_cost_model(cost_model)
        self.routes = self._plan_routes()  # name -> "allreduce" | "allgather"
        gathered = [p for p in self._order if self.routes[self._names[p]] == "allgather"]
        self._buckets: List[List[torch.nn.Parameter]] = [
            [gathered[i] for i in b]
            for b in make_buckets([p.numel() * p.element_size() for p in gathered], bucket_bytes)]
        self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b}
        self._bucket_dense = [sum(p.numel() * 4 for p in b) for b in self._buckets]
        self._waiting = [len(b) for b in self._buckets]  # gradients each bucket still waits for
        if gathered:
            log.info("hvdcomp: %d gradient(s) in %d allgather bucket(s) of <= %.1f MB (%s), %d by allreduce",
                     len(gathered), len(self._buckets), bucket_bytes / 1e6, self._gatherer.kind,
                     len(self._order) - len(gathered))
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
                or self._hvd.size() == 1
                or all(comp.expected_payload_bytes(p.numel()) is None for p in self._order)):
            return None
        if isinstance(cost_model, CostModel):
            return cost_model
        if isinstance(cost_model, (tuple, list)):
            return CostModel(float(cost_model[0]), float(cost_model[1]))
        return measure_cost_model(self._gatherer.probe, self._hvd.size(), agree=self._gatherer.agree)

    def _plan_routes(self) -> Dict[str, str]:
        """Per parameter name: how its payload travels (identical on every rank)."""
        comp, size = self.compression, self._hvd.size()
        routes = {}
        for p in self._order:
            route = "allreduce" if comp.summable else "allgather"
            sparse = None if self.cost_model is None else comp.expected_payload_bytes(p.numel())
            if sparse is not None:
                route = self.cost_model.choose(sparse, p.numel() * p.element_size(), size)
            routes[self._names[p]] = route
        return routes

    def _signature(self) -> dict:
        return {"compression": {"class": type(self.compression).__name__, **self.compression.describe()},
                "backward_passes_per_step": self.backward_passes_per_step,
                "parameters": [(self._names[p], tuple(p.shape), str(p.dtype)) for p in self._order]}

    def _check_consistency(self) -> None:
        """All ranks must agree on the compressor and the parameter list (names, shapes, order)."""
        mine = self._signature()
        every = self._hvd.allgather_object(mine, name="hvdcomp.consistency")
        diffs = []
        for rank, other in enumerate(every):
            if other == every[0]:
                continue
            for key in ("compression", "backward_passes_per_step"):
                if other[key] != every[0][key]:
                    diffs.append(f"rank {rank} {key} {other[key]} != rank 0 {every[0][key]}")
            a, b = every[0]["parameters"], other["parameters"]
            if len(a) != len(b):
                diffs.append(f"rank {rank} has {len(b)} parameters, rank 0 has {len(a)}")
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is not None:
                diffs.append(f"parameter #{first}: rank {rank} {b[first]} != rank 0 {a[first]}")
        if diffs:
            raise ValueError("ranks disagree on the training set-up (build the same model and "
                             "compressor on every rank): " + "; ".join(diffs[:10]))

    # ---- backward hooks --------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to "
                "step() or synchronize(). Increase backward_passes_per_step to accumulate "
                "gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] == 0 and not self.compression.batched:
            self._launch(p)

    def _encode(self, p: torch.Tensor):
        """Check p.grad for non-finite values (flag only, no host sync) and compress it."""
        if p.grad is None:  # not used in this rank's graph: other ranks may have used it
            p.grad = torch.zeros_like(p)
        with self.timer.phase("compress"):
            if self.nonfinite != "ignore":
                if not self._step_open:
                    self.compression.begin_step()
                    self._step_open = True
                bad = ~torch.isfinite(p.grad).all()
                self._local_bad = bad if self._local_bad is None else self._local_bad | bad
            return self.compression.encode(p.grad, self._names[p])

    def _launch(self, p: torch.Tensor) -> None:
        """Compress p.grad and start its allreduce, or queue it for its bucket's allgather."""
        name = self._names[p]
        payload, ctx = self._encode(p)
        if self.compression.summable:
            with self.timer.phase("communicate"):
                op = self._hvd.Sum if self.compression.allreduce_op == "sum" else self._hvd.Average
                handles = [self._hvd.allreduce_async(t, op=op, name=f"hvdcomp.{name}.{i}")
                           for i, t in enumerate(payload)]
            nbytes = sum(t.numel() * t.element_size() for t in payload)
            self._inflight[p] = ("allreduce", handles, ctx, nbytes, nbytes)
        elif self.routes[name] == "allreduce":  # cheaper to average the decoded payload densely
            with self.timer.phase("decompress"):
                dense = self.compression.decode(payload, ctx)
            with self.timer.phase("communicate"):
                handle = self._hvd.allreduce_async(dense, op=self._hvd.Average, name=f"hvdcomp.{name}.dense")
            nbytes = dense.numel() * dense.element_size()
            self._inflight[p] = ("dense", [handle], ctx, nbytes, nbytes)
        else:
            self._encoded[p] = (payload, ctx)
            self._waiting[self._bucket_of[p]] -= 1
            self._start_buckets(flush=False)

    def _start_buckets(self, flush: bool) -> None:
        """Start the allgather of each complete bucket, in the fixed bucket order."""
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if self._waiting[self._next_bucket] and not flush:
                return
            for p in bucket:  # flush: unused parameters (or fewer backward passes) send zeros
                if p not in self._encoded:
                    self._encoded[p] = self._encode(p)
            tensors = [t for p in bucket for t in self._encoded[p][0]]
            with self.timer.phase("communicate"):
                handle = self._gatherer.start(tensors, f"bucket{self._next_bucket}")
            self._bucket_handles[self._next_bucket] = handle
            self._next_bucket += 1

    def _finish_bucket(self, index: int) -> None:
        """Wait for bucket ``index``, aggregate each gradient of it and write ``p.grad``."""
        bucket = self._buckets[index]
        handle = self._bucket_handles.pop(index)
        with self.timer.phase("communicate"):
            gathered = self._gatherer.finish(handle)
        with self.timer.phase("decompress"):
            start = 0
            for p in bucket:
                payload, ctx = self._encoded.pop(p)
                stop = start + len(payload)
                self.compression.aggregate_into(p.grad, [rank_tensors[start:stop] for rank_tensors in gathered], ctx)
                start = stop
        self.timer.add_bytes(sent=handle.bytes_sent, received=handle.bytes_received,
                             dense=self._bucket_dense[index])
        self._waiting[index] = len(bucket)

    # ---- synchronisation ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient's collective and write the averaged gradients into ``p.grad``.

        Parameters whose hook did not fire (unused in this step, or fewer backward passes than
        ``backward_passes_per_step``) are sent now with their current (or zero) gradient, so all
        ranks take part in the same collectives.
        """
        if self.compression.batched:
            self._synchronize_batched()
            return
        for p in self._order:  # allreduces backward did not start; buckets are flushed below
            if p not in self._bucket_of and p not in self._inflight:
                self._launch(p)
        self._start_buckets(flush=True)
        for index in range(len(self._buckets)):
            self._finish_bucket(index)
        for p in self._order:
            if p in self._bucket_of:
                self._delay[p] = self.backward_passes_per_step
                continue
            kind, handles, ctx, sent, received = self._inflight.pop(p)
            with self.timer.phase("communicate"):
                outputs = [self._hvd.synchronize(h) for h in handles]
            with self.timer.phase("decompress"):
                if kind == "allreduce":
                    self.compression.decode_into(p.grad, outputs, ctx)
                else:
                    p.grad.copy_(outputs[0])
            self.timer.add_bytes(sent=sent, received=received, dense=p.numel() * 4)
            self._delay[p] = self.backward_passes_per_step
        self._next_bucket = 0
        self._judge_step()
        self._synchronized = True

    def _judge_step(self, local_bad=None) -> bool:
        """Agree over all ranks whether any gradient was non-finite; commit or roll back the
        compressor's staged state. Returns True when the step is to be skipped.

        Raises:
            FloatingPointError: on every rank, with ``nonfinite="raise"``.
        """
        if self.nonfinite == "ignore":
            return False
        bad = local_bad if local_bad is not None else self._local_bad
        self._local_bad = None
        flags = [int(bool(bad)) if bad is not None else 0]
        if self._hvd.size() > 1:
            with self.timer.phase("communicate"):
                flags = self._gatherer.allgather_int(flags[0])
        ranks = [r for r, f in enumerate(flags) if f]
        if self._step_open:
            (self.compression.rollback if ranks else self.compression.commit)()
            self._step_open = False
        if not ranks:
            return False
        if self.nonfinite == "raise":
            raise FloatingPointError(f"non-finite gradient (NaN or Inf) on rank(s) {ranks}; no update "
                                     "was applied. Lower the learning rate, check the loss, or use "
                                     "nonfinite='skip' to skip such steps.")
        self._skip_next = True
        self.skipped_steps += 1
        log.warning("hvdcomp: non-finite gradient on rank(s) %s: step skipped on every rank "
                    "(compressor state kept as before the step)", ranks)
        return True

    def _allreduce_mean(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """One blocking Horovod allreduce (average), timed and counted."""
        with self.timer.phase("communicate"):
            out = self._hvd.allreduce(tensor, op=self._hvd.Average, name=f"hvdcomp.{name}")
        nbytes = tensor.numel() * tensor.element_size()
        self.timer.add_bytes(sent=nbytes, received=nbytes)
        return out

    def _synchronize_batched(self) -> None:
        """Batched compressors (PowerSGD) reduce every gradient of the step at once."""
        params = self._order  # expected backward order, as PyTorch DDP's rebuilt buckets hold them
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bad = None
        if self.nonfinite != "ignore":
            bad = any(not torch.isfinite(p.grad).all() for p in params)
        if self._judge_step(bad):   # skipped: PowerSGD's state is untouched
            for p in params:
                self._delay[p] = self.backward_passes_per_step
            self._synchronized = True
            return
        grads = self.compression.reduce_batch([(self._names[p], p.grad) for p in params],
                                              self._allreduce_mean, self.timer)
        with self.timer.phase("decompress"):
            for p, g in zip(params, grads):
                p.grad.copy_(g)
        for p in self._order:
            self.timer.add_bytes(dense=p.numel() * 4)
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip ``synchronize()`` (call it yourself first, e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """``synchronize()`` unless inside :meth:`skip_synchronize`, then the wrapped step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(); this can cause training slowdown.")
            self.synchronize()
        self._synchronized = False
        if self._skip_next:  # a non-finite gradient somewhere: no rank updates
            self._skip_next = False
            return None
        return super(self.__class__, self).step(closure)

    def state_dict(self):
        """The wrapped optimizer's state plus the compressor's (residuals, momenta, Q, RNG states)
        under ``"hvdcomp"``: tensors, numbers and strings only (loads with ``weights_only=True``)."""
        sd = super(self.__class__, self).state_dict()
        sd["hvdcomp"] = {"compression": self.compression.state_dict(), "skipped_steps": self.skipped_steps}
        return sd

    def load_state_dict(self, state_dict):
        """Inverse of :meth:`state_dict`."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdcomp", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            self.compression.load_state_dict(extra["compression"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))

    def zero_grad(self, set_to_none: bool = True):
        """As the wrapped optimizer's, but refuses while collectives are in flight."""
        if self._inflight or self._encoded or self._bucket_handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited "
                                 "as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the optimizer then no longer communicates)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                         compression="none",
                         backward_passes_per_step: int = 1,
                         allgather: str = "auto",
                         timer: Optional[PhaseTimer] = None,
                         nonfinite: str = "skip",
                         check_consistency: bool = True,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         cost_model="measure") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are compressed and averaged over all Horovod ranks.

    Same family as ``horovod.torch.DistributedOptimizer``: communication starts from gradient hooks
    during backward; ``step()`` synchronizes first (or use ``synchronize()`` +
    ``skip_synchronize()`` to clip the averaged gradients). The returned object is an instance
    of a subclass of ``optimizer``'s class holding the same parameter groups.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (its state is not carried over, as in Horovod).
        named_parameters: ``model.named_parameters()``; names key compressor state and must be
            the same on every rank. Without it parameters are named by position.
        compression: an :class:`hvdcomp.Compressor`, a spec such as ``"topk:density=0.01"``, or
            ``hvd.Compression.none`` / ``hvd.Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally before communicating.
        allgather: transport for non-summable payloads: ``"auto"`` (mpi4py ``Allgatherv`` under
            MPI, Horovod allgather otherwise), ``"mpi4py"`` or ``"horovod"``.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` to record into (a new one by default;
            available as ``optimizer.timer``).
        nonfinite: what a NaN/Inf gradient on any rank does: ``"skip"`` (default: every rank
            skips the step; error-feedback memory, momenta and step counters stay as before it),
            ``"raise"`` (``FloatingPointError`` on every rank) or ``"ignore"`` (no check).
        check_consistency: at construction, verify (one allgather) that every rank has the same
            compressor and parameter list (names, shapes, dtypes, order).
        bucket_bytes: bytes of dense gradient per allgather bucket (default 25 MiB, as DDP);
            each bucket's payloads travel in one collective as soon as the bucket is complete.
        cost_model: how payloads that need an allgather choose between allgather and
            allreduce of their local decode, per gradient: ``"measure"`` (default: α and β timed
            with a few allgathers at construction, rank 0's values used everywhere), ``"off"``
            (always allgather), a :class:`hvdcomp.comm.costmodel.CostModel` or an
            ``(alpha_seconds, beta_seconds_per_byte)`` pair. Only compressors whose
            ``aggregate`` is the mean of ``decode`` are routed; the result is the same either way.

    Raises:
        ValueError: bad ``named_parameters``, ``backward_passes_per_step < 1``, unknown
            ``nonfinite``, or ranks that disagree on the compressor or the parameters (raised on
            every rank, naming the difference).
        TypeError: unsupported ``compression``.
        ValueError: a compressor that applies momentum itself (DGC) with an optimizer that also
            applies momentum.
        RuntimeError: Horovod is not initialised (call ``hvd.init()`` first).
        ValueError: ``bucket_bytes < 1`` or an unknown ``cost_model``.

    Example::

        hvd.init()
        opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           named_parameters=model.named_parameters(),
                                           compression="topk:density=0.01")
    """
    import horovod.torch as hvd

    if not hvd.is_initialized():
        raise RuntimeError("Horovod is not initialised: call hvd.init() before hvdcomp.DistributedOptimizer")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if nonfinite not in ("skip", "raise", "ignore"):
        raise ValueError(f"nonfinite must be 'skip', 'raise' or 'ignore', got {nonfinite!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer (bytes), e.g. 25 * 2**20; got {bucket_bytes!r}")
    if not (cost_model in ("measure", "off") or isinstance(cost_model, CostModel)
            or (isinstance(cost_model, (tuple, list)) and len(cost_model) == 2)):
        raise ValueError("cost_model must be 'measure', 'off', a CostModel or an (alpha_seconds, "
                         f"beta_seconds_per_byte) pair; got {cost_model!r}")
    if isinstance(cost_model, (tuple, list)):
        cost_model = CostModel(float(cost_model[0]), float(cost_model[1]))  # ValueError if out of range
    compression = resolve_compression(compression)
    if compression.owns_momentum:
        for group in optimizer.param_groups:
            beta = group.get("momentum", 0.0) or (group.get("betas") or (0.0,))[0]
            if beta:
                raise ValueError(
                    f"'{compression.name}' applies momentum itself (momentum correction), but the "
                    f"optimizer also applies momentum {beta}: momentum would be applied twice. Create "
                    "the optimizer without momentum, e.g. torch.optim.SGD(params, lr=..., momentum=0).")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               allgather, timer, nonfinite, check_consistency, bucket_bytes, cost_model)
