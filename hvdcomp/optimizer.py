"""hvdcomp.DistributedOptimizer: Horovod-style data-parallel optimizer with gradient compression.

One gradient's path (see the class docstring for the API):

1. backward fires a post-accumulate-grad hook on the parameter (after ``backward_passes_per_step``
   passes); the hook **compresses** it (``Compressor.encode``, error feedback included);
2. summable payloads start a Horovod ``allreduce_async`` (``op=Average``) at once; payloads that
   need an allgather start a variable-size allgather (mpi4py ``Allgather`` of counts, then
   ``Iallgatherv``), in one fixed parameter order on every rank so collectives match;
3. ``synchronize()`` (called by ``step()``) launches what backward did not reach (unused
   parameters contribute zeros), waits for every collective (**communicate**), rebuilds the
   averaged gradient (``decode`` / ``aggregate``: **decompress**) and writes it into ``p.grad``.

Time and bytes per phase go to ``optimizer.timer`` (:class:`hvdcomp.metrics.PhaseTimer`).
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .comm import make_allgatherer
from .compressors import Compressor, get_compressor
from .compressors.fp16 import FP16Compressor
from .compressors.none import NoneCompressor
from .metrics import PhaseTimer

__all__ = ["DistributedOptimizer", "resolve_compression"]

log = logging.getLogger(__name__)


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
                 allgather, timer, nonfinite="skip", check_consistency=True):
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
        self._encoded: Dict[torch.Tensor, tuple] = {}    # sparse payloads waiting for their turn
        self._inflight: Dict[torch.Tensor, tuple] = {}   # launched collectives
        self._next_gather = 0                             # index into _gather_order
        self._gather_order = [] if compression.summable else list(self._order)
        self._synchronized = False
        self._should_synchronize = True
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._local_bad = None      # device flag: a non-finite gradient was seen on this rank
        self._step_open = False     # compressor state updates are staged until the step is judged
        self._skip_next = False
        if check_consistency and hvd.size() > 1:  # before any collective that ranks might not share
            self._check_consistency()
        self._gatherer = None if compression.summable else make_allgatherer(allgather)
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
        if p in self._inflight or p in self._encoded or self._delay[p] <= 0:
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
        """Compress p.grad and start its collective (or queue it for its turn in the gather order)."""
        name = self._names[p]
        payload, ctx = self._encode(p)
        if self.compression.summable:
            with self.timer.phase("communicate"):
                op = self._hvd.Sum if self.compression.allreduce_op == "sum" else self._hvd.Average
                handles = [self._hvd.allreduce_async(t, op=op, name=f"hvdcomp.{name}.{i}")
                           for i, t in enumerate(payload)]
            nbytes = sum(t.numel() * t.element_size() for t in payload)
            self._inflight[p] = ("allreduce", handles, ctx, nbytes, nbytes)
        else:
            self._encoded[p] = (payload, ctx)
            self._start_gathers(flush=False)

    def _start_gathers(self, flush: bool) -> None:
        """Start allgathers in the fixed order while the next one in line is encoded."""
        while self._next_gather < len(self._gather_order):
            p = self._gather_order[self._next_gather]
            if p not in self._encoded:
                if not flush:
                    return
                self._launch_encode_only(p)
            payload, ctx = self._encoded.pop(p)
            with self.timer.phase("communicate"):
                handle = self._gatherer.start(payload, self._names[p])
            self._inflight[p] = ("allgather", handle, ctx, None, None)
            self._next_gather += 1

    def _launch_encode_only(self, p):
        self._encoded[p] = self._encode(p)

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
        for p in self._order:
            if p not in self._inflight and p not in self._encoded:
                if self.compression.summable:
                    self._launch(p)
                else:
                    self._launch_encode_only(p)
        if not self.compression.summable:
            self._start_gathers(flush=True)
        for p in self._order:
            kind, handle, ctx, sent, received = self._inflight.pop(p)
            if kind == "allreduce":
                with self.timer.phase("communicate"):
                    outputs = [self._hvd.synchronize(h) for h in handle]
                with self.timer.phase("decompress"):
                    grad = self.compression.decode(outputs, ctx)
            else:
                with self.timer.phase("communicate"):
                    gathered = self._gatherer.finish(handle)
                sent, received = handle.bytes_sent, handle.bytes_received
                with self.timer.phase("decompress"):
                    grad = self.compression.aggregate(gathered, ctx)
            with self.timer.phase("decompress"):
                p.grad.copy_(grad)
            self.timer.add_bytes(sent=sent, received=received, dense=p.numel() * 4)
            self._delay[p] = self.backward_passes_per_step
        self._next_gather = 0
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
        flag = torch.tensor([int(bool(bad))] if bad is not None else [0], dtype=torch.int32)
        self._local_bad = None
        if self._hvd.size() > 1:
            with self.timer.phase("communicate"):
                flag = self._hvd.allgather(flag, name="hvdcomp.nonfinite")
        ranks = [r for r, f in enumerate(flag.tolist()) if f]
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
        if self._inflight or self._encoded:
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
                         check_consistency: bool = True) -> torch.optim.Optimizer:
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

    Raises:
        ValueError: bad ``named_parameters``, ``backward_passes_per_step < 1``, unknown
            ``nonfinite``, or ranks that disagree on the compressor or the parameters (raised on
            every rank, naming the difference).
        TypeError: unsupported ``compression``.
        ValueError: a compressor that applies momentum itself (DGC) with an optimizer that also
            applies momentum.
        RuntimeError: Horovod is not initialised (call ``hvd.init()`` first).

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
               allgather, timer, nonfinite, check_consistency)
