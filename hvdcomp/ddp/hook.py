"""hvdcomp's methods as a PyTorch DDP communication hook (the DDP front-end).

``register(ddp_model, "topk:density=0.01", optimizer=opt)`` registers :func:`hvdcomp_hook` with
``ddp_model.register_comm_hook(state, hook)``. DDP calls the hook once per gradient bucket during
backward, in bucket order, with a ``torch.distributed.GradBucket``; the hook returns a
``torch.futures.Future`` of the averaged bucket. One bucket's path:

1. **compress**: the bucket's units (:mod:`hvdcomp.ddp.layout`: each gradient by its own rules,
   several in one vectorised call where the method can) are encoded with the compressor's own
   ``encode``, error feedback included, under their parameter names;
2. **communicate** (:mod:`hvdcomp.transports.torchdist`): summable payloads start a summed
   ``all_reduce`` at once; other payloads start their counts exchange, and their data gather starts
   at the next bucket's hook (when the counts are in); batched methods (PowerSGD, gtopk, cltk,
   twophase) wait for the last bucket and reduce every gradient of the step in one call of their
   ``reduce_batch`` (their own collectives over ``torch.distributed``);
3. at the **last bucket** (``bucket.is_last()``) the hook waits for the step's collectives, agrees
   with every rank on the step (non-finite gradients, restored state: :mod:`hvdcomp.agreement`),
   **decompresses** every bucket into its buffer (``decode`` / ``aggregate``), and completes every
   bucket's future; DDP then copies the buffers into ``p.grad``.

All collectives are issued from the thread that runs the hooks, in bucket order (never from
future callbacks), so every rank issues the same sequence.

State follows what is applied. A step's compressor updates (residuals, momenta, counters,
generator states) are staged when its first bucket is compressed (``begin_step``), committed when
the optimizer applies the update, and rolled back otherwise (``rollback``):

* how the hook learns the step was applied: ``register(..., optimizer=opt)`` (or
  :meth:`HookState.attach`) replaces ``opt.step`` by a bound method that calls the original step
  and then commits. ``GradScaler.step(opt)`` calls it only when no gradient overflowed;
* a step that is not applied (``GradScaler`` found an overflow and skipped ``opt.step``;
  ``zero_grad()`` and a new backward without ``step()``) is rolled back when the next backward
  reaches its first bucket;
* a non-finite gradient on any rank (``nonfinite="skip"``, the default): every rank rolls back,
  every bucket's result is NaN (a ``GradScaler`` sees the overflow and lowers its scale), and the
  wrapped ``opt.step()`` returns None without updating; ``nonfinite="raise"`` raises
  ``FloatingPointError`` on every rank instead;
* without an optimizer the state is committed when the last bucket is reduced (a finite step the
  training loop then discards still counts; non-finite steps still leave no trace).

With a ``torch.amp.GradScaler``, state kept in gradient units follows loss-scale changes
(:mod:`hvdcomp.amp`: given as ``grad_scaler=``, or found at the first applied step).

Time and bytes per phase go to ``state.timer`` (:class:`hvdcomp.metrics.PhaseTimer`); the hooks
run inside ``loss.backward()``, so wrap forward and backward in ``timer.phase("compute")`` and
the compress / communicate / decompress slices are charged to their own phases.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..amp import LossScaleTracker
from ..compressors import Compressor
from ..plan import step_route_of
from ..spec import get_compressor
from ..agreement import NONFINITE_MODES, NonFiniteGuard
from ..metrics import PhaseTimer
from ..transports.torchdist import Exchange, TorchDistGroup, payload_kind
from .layout import GRANULARITIES, BucketLayout, plan_bucket

__all__ = ["HookState", "register", "hvdcomp_hook"]

log = logging.getLogger(__name__)

_owners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # compressor -> the state using it
_DIRECT_DTYPES = (torch.float32, torch.float64)  # none: DDP's own path (half precision goes as float32)


def _digest(obj) -> str:
    """A stable hash of a state dict (tensors, numbers, strings)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


@dataclass
class _Bucket:
    """One bucket of the step in progress."""

    index: int
    buffer: torch.Tensor
    layout: BucketLayout
    future: Any
    kind: str                                   # how it travels this step (see _kind_of)
    exchange: Optional[Exchange] = None
    ctxs: List[Any] = field(default_factory=list)      # per unit: its decoding context
    lengths: List[int] = field(default_factory=list)   # per unit: its payload's tensor count
    placed: List[tuple] = field(default_factory=list)  # summable: per payload tensor (dtype, start, numel)
    dtypes: List[torch.dtype] = field(default_factory=list)  # summable: the dtype of each reduced flat


def hvdcomp_hook(state, bucket):  # (no annotations: DDP checks them, and this module's are strings)
    """The communication hook :func:`register` installs: ``state.reduce_bucket(bucket)``, a
    ``torch.futures.Future[torch.Tensor]`` of the averaged bucket."""
    return state.reduce_bucket(bucket)


class HookState:
    """Everything the DDP hook keeps: the compressor, the group, the step in progress, the timer.

    Build it with :func:`register` (which validates the arguments and registers the hook).

    Attributes:
        compression: the :class:`hvdcomp.Compressor` (its state: residuals, momenta, ...).
        group: the :class:`hvdcomp.transports.torchdist.TorchDistGroup` averaged over.
        kind: how payloads travel (:func:`hvdcomp.transports.torchdist.payload_kind`).
        granularity: ``"tensor"`` or ``"bucket"`` (:mod:`hvdcomp.ddp.layout`).
        timer: the :class:`hvdcomp.metrics.PhaseTimer` phases and bytes are recorded in.
        skipped_steps: steps skipped because some rank had a non-finite gradient.
        transport: one line saying how gradients travel, for logs and results.
    """

    def __init__(self, ddp_model, compression: Compressor, process_group, optimizer, granularity: str,
                 nonfinite: str, timer: Optional[PhaseTimer], grad_scaler, named_parameters,
                 check_consistency: bool):
        self.compression = compression
        self.kind = payload_kind(compression)
        self.group = TorchDistGroup(process_group)
        compression.bind_group(self.group.size)
        self.granularity = granularity
        self.nonfinite = nonfinite
        self.timer = timer if timer is not None else PhaseTimer()
        params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        named = list(named_parameters) if named_parameters is not None else list(ddp_model.module.named_parameters())
        by_id = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters does not name the DDP model's parameter(s) at position(s) "
                             f"{missing[:10]}; pass the wrapped model's named_parameters()")
        names = [by_id[id(p)] for p in params]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names must be unique; repeated: {dups}")
        # expected backward order (the Horovod front-end's): the reverse of model.parameters()
        self._order: List[Tuple[str, torch.nn.Parameter]] = [(by_id[id(p)], p) for p in reversed(params)]
        self._names: Dict[int, str] = {id(p): n for n, p in self._order}
        self._position: Dict[int, int] = {id(p): i for i, (_, p) in enumerate(self._order)}
        self._layouts: Dict[int, BucketLayout] = {}
        self._bucket_keys: Dict[int, Tuple[str, ...]] = {}   # granularity "bucket": layouts compressed
        self._guard = NonFiniteGuard(nonfinite)
        self._loss_scale = LossScaleTracker(grad_scaler)
        self._buckets: List[_Bucket] = []
        self._round_open = False      # compressor state of a step is staged
        self._finished = False        # the step's last bucket is reduced; the update is not applied yet
        self._skip = False            # the ranks agreed to skip this step (non-finite)
        self._backward_steps = 0      # synchronized backward passes this state reduced
        self._state_agreed = False
        self._loaded = False
        self._loaded_since_step = False
        self.skipped_steps = 0
        self._optimizer = None
        self._original_step = None
        self._step_comm = None
        self.transport = self._describe_transport()
        if check_consistency and self.group.size > 1:
            self._check_consistency(names, params)
        if optimizer is not None:
            self.attach(optimizer)

    # ---- set-up ----------------------------------------------------------------------------------
    def _describe_transport(self) -> str:
        how = {"gradient": "all_reduce of the bucket (DDP's arithmetic)",
               "average": "summed all_reduce of the payload, then 1/N",
               "sum": "summed all_reduce of the payload (votes)",
               "gather": "counts exchange + padded all_gather_into_tensor, aggregated on every rank",
               "batched": "the method's own collectives ({}) once per step".format(
                   getattr(step_route_of(self.compression), "collective", ""))}[self.kind]
        return f"torch.distributed {self.group.backend}: {how}; per DDP bucket, granularity {self.granularity}"

    @property
    def buckets(self) -> Dict[int, Tuple[str, ...]]:
        """The DDP buckets seen so far: index -> parameter names in buffer order (DDP's layout after
        its rebuild, once the second backward has run)."""
        return {k: layout.names for k, layout in sorted(self._layouts.items())}

    def describe(self) -> dict:
        """JSON-able summary: compressor, transport, group, granularity."""
        return {"compression": self.compression.describe(), "kind": self.kind, "transport": self.transport,
                "granularity": self.granularity, "nonfinite": self.nonfinite, **self.group.describe()}

    def _check_consistency(self, names, params) -> None:
        """Every rank must register the same method and settings on the same parameters.

        Raises:
            ValueError: on every rank, naming the first differences.
        """
        mine = {"compression": {"class": type(self.compression).__name__, **self.compression.describe()},
                "granularity": self.granularity, "nonfinite": self.nonfinite,
                "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)]}
        every = self.group.allgather_object(mine)
        diffs = []
        for rank, other in enumerate(every):
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
            raise ValueError("ranks disagree on the DDP hook's set-up (build the same model and call "
                             "hvdcomp.ddp.register with the same method and settings on every rank): "
                             + "; ".join(diffs[:10]))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Let ``optimizer.step()`` tell the hook that the step was applied (see the module
        docstring): ``optimizer.step`` becomes a bound method that skips a step the ranks agreed
        to skip, else calls the original and commits the compressor state of the step.

        Raises:
            ValueError: an optimizer is attached already, or the method applies momentum itself
                (DGC) and ``optimizer`` does too.
        """
        if self._optimizer is not None:
            raise ValueError("an optimizer is attached to this hook already; detach() it first")
        if self.compression.owns_momentum:
            for g in optimizer.param_groups:
                beta = g.get("momentum", 0.0) or (g.get("betas") or (0.0,))[0]
                if beta:
                    raise ValueError(
                        f"'{self.compression.name}' applies momentum itself (momentum correction), but the "
                        f"optimizer also applies momentum {beta}: momentum would be applied twice. Create "
                        "the optimizer without momentum, e.g. torch.optim.SGD(params, lr=..., momentum=0).")
        original = optimizer.step
        state = self

        def step(opt, *args, **kwargs):
            return state._apply(original, args, kwargs)

        optimizer.step = types.MethodType(step, optimizer)  # (a bound method: LR schedulers wrap it)
        self._optimizer, self._original_step = optimizer, original

    def detach(self) -> None:
        """Give the attached optimizer its own ``step`` back (state then commits at each step's
        last bucket, as without an optimizer)."""
        if self._optimizer is not None:
            self._optimizer.step = self._original_step
        self._optimizer = self._original_step = None

    def _apply(self, original, args, kwargs):
        """The attached optimizer's step: skipped (None) after a non-finite step, else applied and
        the step's compressor state committed."""
        if self._skip:
            self._skip = False
            return None
        result = original(*args, **kwargs)
        if self._round_open and self._finished:
            if self.compression.has_scaled_state:
                self._loss_scale.discover(self._optimizer)
            self.compression.commit()
            self._round_open = False
        return result

    # ---- the step in progress ------------------------------------------------------------------------
    def _open_round(self) -> None:
        """The first bucket of a backward: drop a step that was never applied, agree on state
        (once), follow the loss scale, and stage this step's updates."""
        if self._round_open:  # reduced, but the optimizer never applied it
            self.compression.rollback()
            self._round_open = False
        self._skip = self._finished = False
        self._buckets = []
        self._guard.reset()
        if not self._state_agreed:
            self._agree_state()
        factor = self._loss_scale.factor()
        if factor is not None:
            self.compression.rescale_state(factor)
        self.compression.begin_step()
        self._round_open = True

    def _agree_state(self) -> None:
        """At the first step: share the compressor state that must be identical on every rank
        (step counters, PowerSGD's Q, ...) from the first rank that loaded a checkpoint; per-rank
        state (residuals) stays as each rank has it (see the Horovod front-end's resume recipe).

        Raises:
            RuntimeError: ranks that loaded checkpoints whose shared state differs, or fresh ranks
                whose shared state differs.
        """
        self._state_agreed = True
        self._loaded_since_step = False
        if self.group.size == 1:
            return
        shared = self.compression.shared_state()
        every = self.group.allgather_object((self._loaded, _digest(shared)))
        loaders = [r for r, (loaded, _) in enumerate(every) if loaded]
        pool = loaders or list(range(len(every)))
        if len({every[r][1] for r in pool}) > 1:
            raise RuntimeError(f"compressor state that must be identical on every rank (step counters, "
                               f"shared factors) differs between ranks {pool}: load the same checkpoint "
                               "everywhere, or on rank 0 only (it is then shared at the first step)")
        if loaders and len(loaders) < len(every):
            root = loaders[0]
            got = self.group.broadcast_object((shared, self.skipped_steps) if self.group.rank == root else None, root)
            if not self._loaded:
                self.compression.load_shared_state(got[0])
                self.skipped_steps = got[1]

    def _layout(self, bucket) -> BucketLayout:
        """The bucket's units, planned once per bucket layout (DDP rebuilds its buckets once)."""
        index = bucket.index()
        params = bucket.parameters()
        key = tuple(self._names[id(p)] for p in params)
        layout = self._layouts.get(index)
        if layout is None or layout.key != key:
            layout = self._layouts[index] = plan_bucket(
                index, key, [tuple(p.shape) for p in params], [self._position[id(p)] for p in params],
                getattr(self.compression, "segmentable", False), self.granularity)
        return layout

    def _kind_of(self, layout: BucketLayout, buffer: torch.Tensor) -> str:
        """How this bucket travels this step: the method's kind; ``"gradient"`` (uncompressed, as
        DDP) for the first backward with granularity ``"bucket"`` (see :func:`register`); none on
        half-precision gradients goes by ``"average"`` (as float32, like the Horovod front-end)."""
        if self.kind == "gradient":
            return "gradient" if buffer.dtype in _DIRECT_DTYPES else "average"
        if self.granularity == "bucket" and self.kind != "batched":
            if self._backward_steps == 0:
                return "gradient" if buffer.dtype in _DIRECT_DTYPES else "plain"
            recorded = self._bucket_keys.setdefault(layout.index, layout.key)
            if recorded != layout.key:
                raise RuntimeError(
                    f"DDP bucket {layout.index} now holds other parameters than the ones its compressor "
                    f"state (granularity='bucket', kept per bucket) was built for: {list(layout.key)[:4]}... "
                    f"instead of {list(recorded)[:4]}... Use granularity='tensor' (state per parameter), or "
                    "keep DDP's bucket layout fixed (same model, bucket_cap_mb and parameter order).")
        return self.kind

    # ---- the hook ------------------------------------------------------------------------------
    def reduce_bucket(self, bucket) -> "torch.futures.Future[torch.Tensor]":
        """The DDP communication hook's body (see the module docstring).

        Args:
            bucket: a ``torch.distributed.GradBucket``: ``buffer()`` is the flat 1-D buffer of the
                local gradients of ``parameters()`` (one dtype and device).

        Returns:
            A future of the averaged buffer (same shape, dtype and device), completed when the
            step's last bucket has been reduced.

        Raises:
            TypeError: a sparse gradient bucket (use dense embeddings, or the Horovod front-end).
            FloatingPointError: ``nonfinite="raise"`` and a non-finite gradient on some rank.
        """
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise TypeError("hvdcomp's DDP hook compresses dense gradient buckets; a sparse gradient "
                            "(Embedding(sparse=True)) reached it: use sparse=False, or the Horovod front-end "
                            "(hvdcomp.DistributedOptimizer), which makes sparse gradients dense")
        if bucket.index() == 0 or not self._round_open or self._finished:
            self._open_round()
        layout = self._layout(bucket)
        devices = [buffer.device] if buffer.is_cuda else None
        entry = _Bucket(bucket.index(), buffer, layout, torch.futures.Future(devices=devices),
                        self._kind_of(layout, buffer))
        previous = self._buckets[-1] if self._buckets else None
        self._buckets.append(entry)
        if entry.kind != "gradient":  # (none: checked on the allreduced results instead)
            self._guard.observe([buffer])
        if entry.kind == "gradient":
            with self.timer.phase("communicate"):
                if self.group.size > 1:
                    buffer.mul_(1.0 / self.group.size)
                entry.exchange = self.group.allreduce([buffer])
        elif entry.kind in ("average", "sum", "plain"):
            self._start_allreduce(entry)
        elif entry.kind == "gather":
            self._start_gather(entry)
        if previous is not None and previous.kind == "gather" and not previous.exchange.data_started:
            with self.timer.phase("communicate"):  # its counts are in by now (or soon)
                self.group.start_gather_data(previous.exchange)
        if bucket.is_last():
            self._finish()
        return entry.future

    def _encode(self, entry: _Bucket) -> List[torch.Tensor]:
        """Compress the bucket's units; returns the payload tensors of all units, in order."""
        payload: List[torch.Tensor] = []
        for unit in entry.layout.units:
            if unit.segments is not None:
                p, ctx = self.compression.encode(entry.buffer, None, unit.segments)
            else:
                p, ctx = self.compression.encode(unit.view(entry.buffer), unit.name)
            entry.ctxs.append(ctx)
            entry.lengths.append(len(p))
            payload += p
        return payload

    def _start_allreduce(self, entry: _Bucket) -> None:
        """Summable payloads: one summed all_reduce per payload dtype (``"plain"``: the bucket
        as float32, the uncompressed first step of granularity ``"bucket"``)."""
        with self.timer.phase("compress"):
            if entry.kind == "plain":
                payload = [entry.buffer.to(torch.float32)]
            else:
                payload = self._encode(entry)
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for t in payload:
                group = by_dtype.setdefault(t.dtype, [])
                entry.placed.append((t.dtype, sum(x.numel() for x in group), t.numel()))
                group.append(t)
            flats = [ts[0].reshape(-1) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])
                     for ts in by_dtype.values()]
        with self.timer.phase("communicate"):
            entry.exchange = self.group.allreduce(flats)
        entry.dtypes = list(by_dtype)

    def _start_gather(self, entry: _Bucket) -> None:
        """Variable-size payloads: encode, then start the counts exchange."""
        with self.timer.phase("compress"):
            payload = self._encode(entry)
            base = entry.buffer.untyped_storage().data_ptr()
            # results are written into the buffer while this rank's own payload is read
            payload = [t.clone() if t.numel() and t.untyped_storage().data_ptr() == base else t for t in payload]
        with self.timer.phase("communicate"):
            entry.exchange = self.group.start_gather(payload)

    def _finish(self) -> None:
        """The last bucket: wait, agree on the step, decompress every bucket, complete the futures."""
        buckets = self._buckets
        try:
            with self.timer.phase("communicate"):
                for b in buckets:
                    if b.kind == "gather":
                        self.group.start_gather_data(b.exchange)
                for b in buckets:
                    if b.exchange is not None:
                        b.exchange.wait()
            skip = self._agree_step(buckets)
            if skip:
                self._skip_step(buckets)
            elif self.kind == "batched":
                self._reduce_batched(buckets)
            else:
                self._decompress(buckets)
        except BaseException as exc:
            for b in buckets:
                if not b.future.done():
                    b.future.set_exception(exc)
            self._discard()
            raise
        for b in buckets:
            if b.exchange is not None:
                self.timer.add_bytes(sent=b.exchange.sent, received=b.exchange.received)
            self.timer.add_bytes(dense=4 * b.layout.numel)
        self._backward_steps += 1
        self._finished = True
        if self._round_open and self._optimizer is None:  # nobody tells us: what was reduced counts
            self.compression.commit()
            self._round_open = False
        for b in buckets:
            b.future.set_result(b.buffer)
        self._buckets = []

    def _discard(self) -> None:
        """Drop the step in progress (an error, or a state loaded in the middle of it)."""
        if self._round_open:
            self.compression.rollback()
        self._round_open = self._finished = False
        self._buckets = []
        self._guard.reset()

    def _agree_step(self, buckets: List[_Bucket]) -> bool:
        """Whether the ranks skip this step (some rank's gradient was non-finite); raises under
        ``nonfinite="raise"`` (:mod:`hvdcomp.agreement`). ``none`` checks its allreduced results,
        identical on every rank, without an exchange."""
        loaded, self._loaded_since_step = self._loaded_since_step, False
        if self.nonfinite == "ignore":
            return False
        direct = [b.buffer for b in buckets if b.kind == "gradient"]
        if direct:
            self._guard.observe(direct)
        if self.group.size == 1 or all(b.kind == "gradient" for b in buckets):  # (results agree)
            verdict = self._guard.agree(lambda v: [list(v)], loaded, 1)
        else:
            with self.timer.phase("communicate"):
                verdict = self._guard.agree(self.group.all_gather_ints, loaded, 1)
        return verdict.skip

    def _skip_step(self, buckets: List[_Bucket]) -> None:
        """Every rank skips: state rolled back, every result NaN (a GradScaler sees the overflow)."""
        if self._round_open:
            self.compression.rollback()
        self._round_open = False
        self._skip = True
        self.skipped_steps += 1
        for b in buckets:
            b.buffer.fill_(float("nan"))

    def _decompress(self, buckets: List[_Bucket]) -> None:
        """Write every bucket's averaged result into its buffer."""
        gathered = {}
        with self.timer.phase("communicate"):
            for b in buckets:
                if b.kind == "gather":
                    gathered[b.index] = self.group.gathered(b.exchange)
        scale = 1.0 / self.group.size
        with self.timer.phase("decompress"):
            for b in buckets:
                if b.kind == "gradient":
                    continue
                if b.kind == "gather":
                    self._aggregate(b, gathered[b.index])
                    continue
                flats = dict(zip(b.dtypes, b.exchange.outputs))
                if b.kind in ("average", "plain") and self.group.size > 1:
                    for flat in flats.values():
                        flat.mul_(scale)
                if b.kind == "plain":
                    b.buffer.copy_(flats[torch.float32])
                    continue
                outputs = [flats[dtype][start:start + n] for dtype, start, n in b.placed]
                pos = 0
                for unit, ctx, length in zip(b.layout.units, b.ctxs, b.lengths):
                    target = b.buffer if unit.segments is not None else unit.view(b.buffer)
                    self.compression.decode_into(target, outputs[pos:pos + length], ctx)
                    pos += length

    def _aggregate(self, b: _Bucket, per_rank: List[List[torch.Tensor]]) -> None:
        pos = 0
        for unit, ctx, length in zip(b.layout.units, b.ctxs, b.lengths):
            target = b.buffer if unit.segments is not None else unit.view(b.buffer)
            self.compression.aggregate_into(target, [tensors[pos:pos + length] for tensors in per_rank], ctx)
            pos += length

    def _reduce_batched(self, buckets: List[_Bucket]) -> None:
        """A batched method reduces every gradient of the step at once, in the expected backward
        order (so the same as under the Horovod front-end, whatever DDP's bucket layout)."""
        views: Dict[str, torch.Tensor] = {}
        for b in buckets:
            offset = 0
            for name, shape in zip(b.layout.names, b.layout.shapes):
                n = int(torch.Size(shape).numel())
                views[name] = b.buffer[offset:offset + n].view(shape)
                offset += n
        named = [(name, views[name]) for name, _ in self._order if name in views]
        if self._step_comm is None:
            self._step_comm = self.group.step_comm(self.timer, step_route_of(self.compression).needs_point_to_point)
        grads = self.compression.reduce_batch(named, self._step_comm, self.timer)
        with self.timer.phase("decompress"):
            for (_, view), g in zip(named, grads):
                if g.data_ptr() != view.data_ptr():
                    view.copy_(g)

    # ---- loops written for the Horovod front-end ------------------------------------------------
    def synchronize(self) -> None:
        """What ``optimizer.synchronize()`` is to the Horovod front-end, for loops written for it
        (``synchronize(); clip; with skip_synchronize(): step()``): DDP's backward returns only
        after every bucket's future is complete, so the averaged gradients are in ``p.grad``
        already and there is nothing to wait for.

        Raises:
            RuntimeError: called while a backward's buckets are still being reduced (from a
                hook or another thread).
        """
        if self._buckets:
            raise RuntimeError("synchronize() during a backward: DDP is still reducing buckets; call it "
                               "after loss.backward() returns")

    @contextlib.contextmanager
    def skip_synchronize(self):
        """The Horovod front-end's ``with optimizer.skip_synchronize(): optimizer.step()``; with
        DDP, ``step()`` never synchronizes, so the block runs as it is."""
        yield

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's compressor state (committed: a step not yet applied is not included), the
        skipped-step count and, with granularity ``"bucket"``, the bucket layouts the state was
        built for: tensors, numbers and strings only (``torch.load(weights_only=True)``).

        Residuals and other per-rank state differ between ranks: save it on every rank
        (``torch.save(state.state_dict(), f"hook.{rank}.pt")``) to resume bit-identically, or on
        rank 0 only, in which case the shared part is shared at the first step and the other
        ranks' per-rank state starts fresh (as with the Horovod front-end)."""
        return {"compression": self.compression.state_dict(), "skipped_steps": self.skipped_steps,
                "granularity": self.granularity,
                "bucket_layouts": {str(k): list(v) for k, v in self._bucket_keys.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; drops a step in progress.

        Raises:
            ValueError: the state was saved with another granularity.
        """
        if state.get("granularity", self.granularity) != self.granularity:
            raise ValueError(f"this hook state was saved with granularity={state['granularity']!r}; "
                             f"register the hook with the same granularity (now {self.granularity!r})")
        self._discard()
        self.compression.load_state_dict(state["compression"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        # (granularity "bucket": a new process's DDP model rebuilds its buckets after its first
        # backward, which is again uncompressed; the layouts compressed after it must be these)
        self._bucket_keys = {int(k): tuple(v) for k, v in state.get("bucket_layouts", {}).items()}
        self._loaded = True
        self._loaded_since_step = self._state_agreed

    def __repr__(self) -> str:
        return f"HookState({self.compression!r}, {self.transport})"


def register(ddp_model, compression="none", process_group=None, *, optimizer: Optional[torch.optim.Optimizer] = None,
             granularity: str = "tensor", nonfinite: str = "skip", timer: Optional[PhaseTimer] = None,
             grad_scaler=None, named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
             check_consistency: bool = True) -> HookState:
    """Compress ``ddp_model``'s gradient buckets with an hvdcomp method (a DDP communication hook).

    Call it on every rank after wrapping the model in ``DistributedDataParallel`` and before the
    first backward; one hook per DDP model (PyTorch allows one).

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel``.
        compression: a spec such as ``"topk:density=0.01"`` (every registered method, as for the
            Horovod front-end) or an :class:`hvdcomp.Compressor` not used elsewhere.
        process_group: the ``torch.distributed`` group to average over; default the DDP model's.
        optimizer: the optimizer that applies the averaged gradients, so that a step that is not
            applied leaves no trace in compressor state (see the module docstring; recommended).
        granularity: ``"tensor"`` (default: each gradient compressed by its own rules, results
            per tensor as under the Horovod front-end) or ``"bucket"`` (each DDP bucket compressed
            as one tensor, as PyTorch's own hooks do; state per bucket). DDP rebuilds its buckets
            after the first backward, so with ``"bucket"`` the first backward is averaged
            uncompressed and compression starts at the second (as PyTorch's PowerSGD hook asks for
            ``start_powerSGD_iter >= 2``); a later change of a bucket's parameters raises.
            Refused for PowerSGD (it needs each gradient's matrix shape).
        nonfinite: ``"skip"`` (default), ``"raise"`` or ``"ignore"`` (see the module docstring).
        timer: a :class:`hvdcomp.metrics.PhaseTimer` to record into (a new one by default).
        grad_scaler: the ``torch.amp.GradScaler`` of an AMP loop, so that state in gradient units
            follows the loss scale (found at the first applied step when ``optimizer`` is given).
        named_parameters: names for the parameters (default ``ddp_model.module.named_parameters()``,
            the names the Horovod front-end is given); compressor state is keyed by them.
        check_consistency: verify (one object gather) that every rank registers the same method,
            settings and parameters.

    Returns:
        The :class:`HookState` (``.timer``, ``.compression``, ``.state_dict()``, ...).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel, or a bad ``compression``.
        ValueError: unknown ``granularity`` or ``nonfinite`` (or ``"bucket"`` with PowerSGD), a
            compressor already serving another hook, DGC with an optimizer that applies momentum,
            unnamed parameters, or ranks that disagree (raised on every rank).
        RuntimeError: ``torch.distributed`` is not initialised.

    Example::

        torch.distributed.init_process_group("gloo")          # torchrun / srun set the rank variables
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hook = hvdcomp.ddp.register(model, "topk:density=0.01", optimizer=opt)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"hvdcomp.ddp.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    if isinstance(compression, str):
        compression = get_compressor(compression)
    elif not isinstance(compression, Compressor):
        raise TypeError(f"compression must be an hvdcomp.Compressor or a spec string such as "
                        f"'topk:density=0.01'; got {compression!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be 'tensor' or 'bucket', got {granularity!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be 'skip', 'raise' or 'ignore', got {nonfinite!r}")
    if granularity == "bucket" and getattr(compression, "needs_shapes", False):
        raise ValueError(f"granularity='bucket' flattens gradients, but '{compression.name}' needs each "
                         "gradient's matrix shape: use granularity='tensor'")
    owner = _owners.get(compression)
    if owner is not None and owner() is not None:
        raise ValueError(f"this '{compression.name}' compressor already serves another hook (or optimizer); "
                         "its state is keyed by parameter name, so give each model its own (pass the spec string)")
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    state = HookState(ddp_model, compression, process_group, optimizer, granularity, nonfinite, timer,
                      grad_scaler, named_parameters, check_consistency)
    ddp_model.register_comm_hook(state, hvdcomp_hook)
    _owners[compression] = weakref.ref(state)
    log.info("hvdcomp: DDP hook %s: %s", compression.name, state.transport)
    return state
