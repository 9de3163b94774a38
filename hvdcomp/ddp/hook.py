"""hvdcomp's methods as a PyTorch DDP communication hook (the DDP front-end; docs/ddp.md).

``register(ddp_model, "topk:density=0.01", optimizer=opt)`` registers :func:`hvdcomp_hook`. DDP
calls it once per gradient bucket during backward, in bucket order; it returns a
``torch.futures.Future`` of the averaged bucket. Each bucket becomes a unit of the step's
:class:`~hvdcomp.ddp.buckets.BucketTransport` and is started as it comes; at the last bucket
(``bucket.is_last()``) the transport finishes, the ranks agree on the step
(:mod:`hvdcomp.ddp.cycle` over :mod:`hvdcomp.agreement`; a step-wide method reduces the step after
that agreement, or with it riding on its first allreduce) and the futures are completed.

State follows what is applied (docs/ddp.md, "State follows what is applied"): a step's
compressor updates are staged at its first bucket and committed when the attached optimizer's
``step()`` applies it, when a second synchronized backward accumulates onto it, at its last
bucket without an optimizer or on a joined rank (``ddp_model.join()``); they are rolled back when
the step is discarded (gradients zeroed without ``step()``) or skipped (a non-finite gradient on
some rank: every bucket reads NaN, ``nonfinite="raise"`` raises instead). DDP's Python reducer
(compiled autograd) is refused (:data:`PYTHON_REDUCER_FIX`). With a ``GradScaler`` state in
gradient units follows the loss scale (:mod:`hvdcomp.amp`); time and bytes go to ``state.timer``.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from ..auto import Auto, AutoState
from ..comm.torchdist import TorchDistGroup
from ..config import Settings, check_method
from ..launch import start_frontend
from ..metrics import PhaseTimer
from ..agreement import StepSkipped, check_consistency
from ..plan import in_place
from ..reducer import check_free, claim
from ..spec import resolve_compression
from ..step import SkipSynchronize, skipped_steps_of
from .buckets import Bucket, BucketTransport
from .cycle import StepCycle
from .layout import BucketLayout, Layouts

__all__ = ["HookState", "register", "hvdcomp_hook"]

log = logging.getLogger(__name__)


#: what to do where DDP runs its Python reducer (compiled autograd)
PYTHON_REDUCER_FIX = (
    "DDP's Python reducer (torch._dynamo.config.optimize_ddp = 'python_reducer', for compiled autograd) "
    "calls a comm hook once per parameter with (grad, param) inside the traced backward and ignores what it "
    "returns; hvdcomp's hook compresses whole buckets and keeps per-step state, so it cannot run there. "
    "Build the DistributedDataParallel model with optimize_ddp left at 'ddp_optimizer' (the default; "
    "torch.compile(model) works with hvdcomp's hook at DDP's bucket boundaries), or without compiled autograd")


def hvdcomp_hook(state, bucket):  # (no annotations: DDP checks them, and this module's are strings)
    """The communication hook :func:`register` installs: ``state.reduce_bucket(bucket)``, a
    ``torch.futures.Future[torch.Tensor]`` of the averaged bucket."""
    return state.reduce_bucket(bucket)


class _ShadowingJoinHook(JoinHook):
    """DDP's own join hook (``_DDPJoinHook``), with the hook's step cycle told when a joined rank
    shadows a step (:meth:`hvdcomp.ddp.cycle.StepCycle.shadowing`)."""

    def __init__(self, inner: JoinHook, cycle: StepCycle):
        self.inner, self.cycle = inner, cycle

    def main_hook(self) -> None:
        with self.cycle.shadowing():
            self.inner.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.cycle.joining = None  # (every rank: the join context ends)
        self.inner.post_hook(is_last_joiner)


class HookState(SkipSynchronize):
    """Everything the DDP hook keeps (built by :func:`register`): the bucket layouts
    (:class:`hvdcomp.ddp.layout.Layouts`), the step in progress
    (:class:`hvdcomp.ddp.cycle.StepCycle`) and the transport (:class:`hvdcomp.ddp.buckets.BucketTransport`).

    Attributes:
        compression: the :class:`hvdcomp.Compressor` (its state: residuals, momenta, ...).
        group: the :class:`hvdcomp.comm.torchdist.TorchDistGroup` averaged over.
        granularity: ``"tensor"`` or ``"bucket"`` (:mod:`hvdcomp.ddp.layout`).
        nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"``.
        timer: the :class:`hvdcomp.metrics.PhaseTimer` phases and bytes are recorded in.
        transport: one line saying how gradients travel, for logs and results.
        pipe: the :class:`~hvdcomp.ddp.buckets.BucketTransport` the buckets travel by (with
            ``compression="auto"``, the candidate's in use).
        auto: with ``compression="auto"``, its :class:`hvdcomp.auto.AutoState` (candidates,
            ``decisions``), else None.
    """

    def __init__(self, ddp_model, compression, process_group, optimizer, settings: Settings, named_parameters):
        if isinstance(compression, Auto) and settings.granularity != "tensor":
            raise ValueError("compression='auto' carries each parameter's residual across a switch: use "
                             "granularity='tensor' (state per parameter), not 'bucket'")
        self.group, self.settings, self.prefix = TorchDistGroup(process_group), settings, "hvdcomp.ddp"
        self.granularity, self.nonfinite = settings.granularity, settings.nonfinite
        self.timer = settings.timer if settings.timer is not None else PhaseTimer()
        self._layouts = Layouts(ddp_model.module, named_parameters, self.granularity)
        self.order = [p for _, p in self._layouts.order]
        self.names = {p: n for n, p in self._layouts.order}
        self._cycle = StepCycle(self.group, self.nonfinite, settings.grad_scaler, self.timer, compression)
        self.compression, self.auto = compression, None
        if settings.check_consistency and self.group.size > 1:  # (before any other collective)
            check_consistency(self.group, settings.signature(compression, self.names, self.order, self.prefix),
                              "hvdcomp.ddp.consistency", setup="the DDP hook's set-up (build the same model and "
                              "call hvdcomp.ddp.register with the same method and settings on every rank)")
        if isinstance(compression, Auto):  # every candidate built; the first choice installed
            self.auto = self._cycle.auto = AutoState(compression, self, build=self._candidate)
            self.install(self.auto.pipeline)
        else:
            self.install(self._candidate(0, compression))
        if optimizer is not None:
            self.attach(optimizer)

    def _candidate(self, k: int, method, settings=None, gatherer=None) -> BucketTransport:
        """The transport the hook runs ``method`` with."""
        method.bind_group(self.group.size)
        return BucketTransport(method, self.group, self.timer, [n for n, _ in self._layouts.order], self.granularity)

    def install(self, pipe: BucketTransport) -> None:
        """Run ``pipe`` (its method) from the next step on (between steps: ``compression="auto"``'s
        switch, :class:`hvdcomp.auto.AutoState`)."""
        self.pipe = pipe
        self.compression, self.transport = pipe.compression, pipe.plan
        self._cycle.life.use(pipe.compression)

    @property
    def between_steps(self) -> bool:
        """No step's state is staged (``compression="auto"`` switches only then)."""
        return not self._cycle.life.staged

    # ---- set-up ----------------------------------------------------------------------------------
    @property
    def buckets(self) -> Dict[int, Tuple[str, ...]]:
        """The DDP buckets seen so far: index -> parameter names in buffer order (DDP's layout after
        its rebuild, once the second backward has run)."""
        return self._layouts.seen()

    skipped_steps = skipped_steps_of(lambda self: self._cycle.life)

    def describe(self) -> dict:
        """JSON-able summary: compressor, transport, group, granularity."""
        return {"compression": self.compression.describe(), "route": self.pipe.route,
                "transport": self.transport,
                "granularity": self.granularity, "nonfinite": self.nonfinite, **self.group.describe(),
                **({"auto": self.auto.describe()} if self.auto is not None else {})}

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Let ``optimizer.step()`` tell the hook that the step was applied (see the module
        docstring): ``optimizer.step`` becomes a bound method that skips a step the ranks agreed
        to skip, else calls the original and commits the compressor state of the step.

        Raises:
            ValueError: an optimizer is attached already, or the method applies momentum itself
                (DGC) and ``optimizer`` does too.
        """
        if self._cycle.optimizer is not None:
            raise ValueError("an optimizer is attached to this hook already; detach() it first")
        check_method(self.compression, optimizer, self.granularity)
        self._cycle.attach(optimizer)

    def detach(self) -> None:
        """Give the attached optimizer its own ``step`` and ``zero_grad`` back (state then commits
        at each step's last bucket, as without an optimizer)."""
        self._cycle.detach()

    def _watch(self, ddp_model) -> None:
        """Tell the step cycle what the training loop does outside the hook: a forward pre-hook on
        the DDP model (were the gradients zeroed since a step that was reduced and not applied?)
        and, for ``ddp_model.join()``, the model's ``join_hook`` wrapped so that the cycle knows
        when DDP shadows a step on a joined rank (``Join`` calls ``joinable.join_hook(**kwargs)``)."""
        cycle, params = self._cycle, self._layouts.params

        def grads_zeroed() -> bool:  # (stops at the first non-zero gradient)
            return not any(bool(p.grad.any()) for p in params if p.grad is not None)

        @torch.compiler.disable
        def before_forward(module, args):
            cycle.forward_starts(grads_zeroed)

        ddp_model.register_forward_pre_hook(before_forward)
        model = weakref.ref(ddp_model)

        def join_hook(**kwargs):  # (every rank: ``Join`` is made)
            cycle.joining = model
            return _ShadowingJoinHook(DistributedDataParallel.join_hook(model(), **kwargs), cycle)

        ddp_model.join_hook = join_hook

    # ---- the hook ------------------------------------------------------------------------------
    def _raw(self, layout: BucketLayout, buffer: torch.Tensor) -> bool:
        """Whether this bucket's gradients travel as they are this step: ``none`` (but in float32 on
        half-precision gradients: by its own encode, as the Horovod front-end), and the first
        backward of granularity ``"bucket"`` (see :func:`register`)."""
        if self.pipe.deferred:  # (a step-wide method reduces the whole step at the last bucket)
            return False
        if self.compression.payload_is_gradient:
            return in_place(self.compression, buffer.dtype)
        if self.granularity == "bucket":
            if self._cycle.backward_steps == 0:
                return True
            self._layouts.check_recorded(layout)
        return False

    def reduce_bucket(self, bucket) -> "torch.futures.Future[torch.Tensor]":
        """The DDP communication hook's body (see the module docstring).

        Args:
            bucket: a ``torch.distributed.GradBucket``: ``buffer()`` is the flat 1-D buffer of the
                local gradients of ``parameters()`` (one dtype and device).

        Returns:
            A future of the averaged buffer (same shape, dtype and device), completed when the
            step's last bucket has been reduced.

        Raises:
            TypeError: a sparse gradient bucket (use dense embeddings, or the Horovod front-end),
                or a ``(grad, param)`` pair from DDP's Python reducer (:data:`PYTHON_REDUCER_FIX`).
            FloatingPointError: ``nonfinite="raise"`` and a non-finite gradient on some rank.
        """
        if isinstance(bucket, tuple):  # DDP's Python reducer: (grad, param) per parameter
            raise TypeError(f"hvdcomp's DDP hook was called with a (grad, param) pair, not a GradBucket: "
                            f"{PYTHON_REDUCER_FIX}")
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise TypeError("hvdcomp's DDP hook compresses dense gradient buckets; a sparse gradient "
                            "(Embedding(sparse=True)) reached it: use sparse=False, or the Horovod front-end "
                            "(hvdcomp.DistributedOptimizer), which makes sparse gradients dense")
        cycle, auto = self._cycle, self.auto
        t0 = auto.clock() if auto is not None else 0.0
        if cycle.needs_open(bucket.index()):
            cycle.open()
            self.pipe.reset()
        layout = self._layouts.of(bucket, self.pipe.fused)
        if auto is not None:  # (a switch's carry into the gradients; a probe's copy of them)
            auto.add_carry(zip(layout.names, layout.views(buffer)))
        devices = [buffer.device] if buffer.is_cuda else None
        raw = self._raw(layout, buffer)
        entry = Bucket(buffer, layout, torch.futures.Future(devices=devices), raw)
        path = self.pipe
        path.buckets.append(entry)
        if not entry.in_place:  # (none: checked on the allreduced results instead)
            cycle.life.guard.observe([buffer])
        path.start(len(path.buckets) - 1)
        if bucket.is_last():
            self._finish(t0)
        elif auto is not None:
            auto.hook_s += auto.clock() - t0
        return entry.future

    def _finish(self, t0: float) -> None:
        """The last bucket: the transport's :meth:`~BucketTransport.finish` (wait, resend a
        saturated payload or read it NaN, decompress every bucket), the step's agreement (a
        step-wide method's finish after it, as the Reducer's deferred transports), complete the
        futures."""
        cycle, path = self._cycle, self.pipe
        buckets = path.buckets
        try:
            if not path.deferred:
                path.finish()
                cycle.life.guard.observe(path.overflowed, averaged=True)
            if path.verdict_rides:
                try:
                    path.finish(cycle.life.riding(self.group.size, self.group.allgather_ints, 1))
                except StepSkipped:
                    cycle.skip(buckets)
            elif cycle.agree(buckets):
                cycle.skip(buckets)
            elif path.deferred:
                path.finish()
        except BaseException as exc:
            for b in buckets:
                if not b.future.done():
                    b.future.set_exception(exc)
            cycle.discard()
            path.reset()
            raise
        if self.auto is not None:  # (the last bucket, with the step's wait: auto's "synchronize")
            self.auto.synced(self.auto.clock() - t0)
        cycle.reduced(buckets)
        path.reset()
        for b in buckets:
            b.future.set_result(b.buffer)

    # ---- loops written for the Horovod front-end (with SkipSynchronize.skip_synchronize) --------
    def synchronize(self) -> None:
        """Nothing to wait for (DDP's backward returns with the averaged gradients in ``p.grad``):
        loops written for the Horovod front-end run unchanged.

        Raises:
            RuntimeError: called while a backward's buckets are still being reduced (from a
                hook or another thread).
        """
        if self.pipe.buckets:
            raise RuntimeError("synchronize() during a backward: DDP is still reducing buckets; call it "
                               "after loss.backward() returns")

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's committed compressor state, the skipped-step count and, with granularity
        ``"bucket"``, the bucket layouts the state was built for: tensors, numbers and strings
        only. Save it on every rank to resume bit-identically (docs/ddp.md, "Checkpoints")."""
        return {**self._cycle.life.state_dict(self.auto), "granularity": self.granularity,
                "bucket_layouts": self._layouts.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; drops a step in progress.

        Raises:
            ValueError: the state was saved with another granularity.
        """
        if state.get("granularity", self.granularity) != self.granularity:
            raise ValueError(f"this hook state was saved with granularity={state['granularity']!r}; "
                             f"register the hook with the same granularity (now {self.granularity!r})")
        self._cycle.discard()
        self.pipe.reset()
        self._cycle.life.load_state_dict(state, self.auto)
        self._layouts.load_state_dict(state.get("bucket_layouts", {}))

    def __repr__(self) -> str:
        return f"HookState({self.compression!r}, {self.transport})"


def check_optimizer_of(ddp_model, optimizer) -> None:
    """The optimizer given to :func:`register` must be a ``torch.optim.Optimizer`` over the DDP
    model's parameters (the hook commits state when it steps: over another model's, error
    feedback would be rolled back every step).

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: it holds none of the model's parameters, naming the fix.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be the torch.optim.Optimizer that steps the DDP model's parameters, got "
                        f"{type(optimizer).__name__}")
    mine = {id(p) for p in ddp_model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(id(p) in mine for p in held):
        raise ValueError("the optimizer given to hvdcomp.ddp.register holds none of the DDP model's parameters (it "
                         "steps another model's), so the hook would never see its gradients applied and would drop "
                         "its error feedback every step: build it over this model, e.g. "
                         "torch.optim.SGD(ddp_model.parameters(), lr=...), after wrapping the model in DDP")


def register(ddp_model, compression="none", process_group=None, *, optimizer: Optional[torch.optim.Optimizer] = None,
             granularity: str = "tensor", nonfinite: str = "skip", timer: Optional[PhaseTimer] = None,
             grad_scaler=None, named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
             check_consistency: bool = True, cost_model="measure") -> HookState:
    """Compress ``ddp_model``'s gradient buckets with an hvdcomp method (a DDP communication hook).

    Call it on every rank after wrapping the model in ``DistributedDataParallel`` and before the
    first backward; one hook per DDP model (PyTorch allows one).

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel``.
        compression: a spec such as ``"topk:density=0.01"`` (every registered method, as for the
            Horovod front-end), or an hvdcomp method (a :class:`hvdcomp.Compressor` or a
            step-wide method) not used elsewhere (:func:`hvdcomp.spec.resolve_compression`).
        process_group: the ``torch.distributed`` group to average over; default the DDP model's.
        optimizer: the optimizer that applies the averaged gradients (recommended): its ``step``
            and ``zero_grad`` are wrapped to tell the hook, so that a discarded step leaves no
            trace in compressor state.
        granularity: ``"tensor"`` (default: each gradient by its own rules, as under the Horovod
            front-end) or ``"bucket"`` (each DDP bucket as one tensor, as PyTorch's own hooks;
            state per bucket; the first backward, before DDP rebuilds its buckets, uncompressed;
            refused for PowerSGD): :mod:`hvdcomp.ddp.layout`.
        nonfinite: ``"skip"`` (default), ``"raise"`` or ``"ignore"`` (as the Horovod front-end's).
        timer: a :class:`hvdcomp.metrics.PhaseTimer` to record into (a new one by default).
        grad_scaler: the ``torch.amp.GradScaler`` of an AMP loop, so that state in gradient units
            follows the loss scale (found at the first applied step when ``optimizer`` is given).
        named_parameters: names for the parameters (default ``ddp_model.module.named_parameters()``,
            the names the Horovod front-end is given); compressor state is keyed by them.
        check_consistency: verify (one object gather) that every rank registers the same method,
            settings and parameters.
        cost_model: what prices ``compression="auto"``'s candidates (:class:`hvdcomp.auto.Auto`,
            granularity ``"tensor"`` only; docs/auto.md): ``"measure"`` (default) or
            ``(alpha_seconds, beta_seconds_per_byte)``; unused by a named method.

    Returns:
        The :class:`HookState` (``.timer``, ``.compression``, ``.state_dict()``, ...).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel, a bad ``compression``, or an
            ``optimizer`` that is not a ``torch.optim.Optimizer``.
        ValueError: unknown ``granularity`` or ``nonfinite`` (or ``"bucket"`` with PowerSGD),
            ``check_consistency`` not a bool, an ``optimizer`` over another model's parameters
            (:func:`check_optimizer_of`), a compressor already serving another hook, DGC with an
            optimizer that applies momentum, unnamed parameters, ranks that disagree (raised on
            every rank), or a model built for DDP's Python reducer (:data:`PYTHON_REDUCER_FIX`).
        RuntimeError: ``torch.distributed`` is not initialised, or the launcher started several
            tasks and the default process group has one rank (:func:`hvdcomp.launch.start_frontend`).

    Example::

        torch.distributed.init_process_group("gloo")          # torchrun / srun set the rank variables
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hook = hvdcomp.ddp.register(model, "topk:density=0.01", optimizer=opt)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"hvdcomp.ddp.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    start_frontend("the DDP front-end (hvdcomp.ddp.register)", "torch.distributed",
                   dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
    compression = resolve_compression(compression)
    settings = Settings.validate(None, nonfinite=nonfinite, check_consistency=check_consistency, cost_model=cost_model,
                                 granularity=granularity, grad_scaler=grad_scaler, timer=timer)
    if optimizer is not None:
        check_optimizer_of(ddp_model, optimizer)
    check_method(compression, None, granularity)
    check_free(compression)
    if getattr(ddp_model, "_use_python_reducer", False):
        raise ValueError(PYTHON_REDUCER_FIX)
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    state = HookState(ddp_model, compression, process_group, optimizer, settings, named_parameters)
    ddp_model.register_comm_hook(state, hvdcomp_hook)
    state._watch(ddp_model)
    claim(compression, state)
    log.info("hvdcomp: DDP hook %s: %s", compression.name, state.transport)
    return state
