"""Base classes of every hvdcomp method: :class:`Method` (state, description) and
:class:`Compressor` (a per-tensor method: encode / decode / aggregate / residual).

A compressor turns one gradient tensor into a *payload* (a list of 1-D tensors that travel) plus a
*context* (what stays local, e.g. the shape), and back. It subclasses Horovod's ``Compressor``, so
dense, mean-payload compressors also work with a stock ``hvd.DistributedOptimizer(compression=...)``.
A method says what its payloads are (:class:`PayloadKind`), never how they travel: the transports
(:mod:`hvdcomp.transports`) declare the kinds they carry and the plan (:mod:`hvdcomp.plan`) picks one.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..comm.world import rank, simulated_world, world_size
from .state import StagedState

try:  # Horovod is a hard runtime dependency of the optimizer, not of the compressors' maths.
    from horovod.torch.compression import Compressor as _HorovodCompressor
except ImportError:  # pragma: no cover - exercised only where Horovod is not installed
    class _HorovodCompressor:  # type: ignore[no-redef]
        """Stand-in so that compressors can be used without Horovod (the DDP front-end, tests)."""

Payload = List[torch.Tensor]

__all__ = ["Method", "Compressor", "PayloadKind", "AggregateInto", "Payload", "ErrorBound", "world_size", "rank",
           "simulated_world", "cast_saturating", "copy_saturating_", "float32_flat", "write_back"]


class PayloadKind(str, enum.Enum):
    """What a compressor's payloads are. ``MEAN``: payloads of different ranks average
    elementwise and ``decode`` is linear in the payload; ``SUM``: payloads are summed over ranks
    and ``decode`` receives the sum (sign votes); ``GATHERED``: payloads differ in size or meaning
    per rank (top-k values and indices, per-rank scales): every rank receives all of them and
    :meth:`Compressor.aggregate` combines them."""

    MEAN = "mean"
    SUM = "sum"
    GATHERED = "gathered"


@dataclass(frozen=True)
class ErrorBound:
    """What one call of a method guarantees about its error on a tensor v of n elements, used
    alone (no error feedback): what decentralized methods (:mod:`hvdcomp.gossip`) need to know.

    Attributes:
        kind: ``"exact"`` (C(v) = v); ``"unbiased"`` (E[C(v)] = v and E‖C(v) − v‖² ≤ ω(n)‖v‖²);
            ``"contraction"`` (E‖C(v) − v‖² ≤ (1 − δ(n))‖v‖², δ(n) ∈ (0, 1]); ``"none"``
            (neither: a biased method without a contraction, or one that keeps state between
            calls).
        statement: the bound in words, or for ``"none"`` why there is none and what to use.
        omega: ``n -> ω`` for ``"unbiased"``.
        delta: ``n -> δ`` for ``"contraction"`` (a lower bound over all v; in expectation for
            randomized methods).
    """

    kind: str
    statement: str
    omega: Optional[Callable[[int], float]] = None
    delta: Optional[Callable[[int], float]] = None


def cast_saturating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, finite values clamped to ``dtype``'s finite range first when ``dtype``
    is a narrower floating type (float32 → float16: 1e5 becomes 65504, not inf). NaN stays NaN,
    and ±inf stays ±inf: an overflow upstream stays loud instead of becoming a finite value.
    """
    if (dtype.is_floating_point and tensor.is_floating_point() and dtype != tensor.dtype
            and torch.finfo(dtype).max < torch.finfo(tensor.dtype).max):
        limit = torch.finfo(dtype).max
        tensor = torch.where(tensor.isinf(), tensor, tensor.clamp(-limit, limit))
    return tensor.to(dtype)


def copy_saturating_(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out.copy_(src)`` with :func:`cast_saturating` to ``out``'s dtype. Returns ``out``."""
    if out.dtype != src.dtype:
        src = cast_saturating(src, out.dtype)
    return out.copy_(src)


def float32_flat(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a 1-D contiguous float32 tensor for a kernel to write: a view of ``out`` when it
    is contiguous float32 (the usual ``.grad``), else a new tensor (see :func:`write_back`)."""
    if out.dtype == torch.float32 and out.is_contiguous():
        return out.view(-1)
    return torch.empty(out.numel(), dtype=torch.float32, device=out.device)


def write_back(out: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Copy ``flat`` (from :func:`float32_flat`) into ``out`` unless it is ``out``'s memory; returns ``out``."""
    if out.numel() and flat.data_ptr() != out.data_ptr():
        copy_saturating_(out, flat.view(out.shape))
    return out



def check_floating(tensor: torch.Tensor, method: str) -> None:
    """Refuse an integer or bool tensor for ``method``.

    Raises:
        TypeError: such tensors have no gradients (the message says how to send them).
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"'{method}' compresses floating-point gradients, got a {tensor.dtype} "
                        "tensor; integer and bool tensors have no gradients: send them "
                        "uncompressed with hvd.allreduce or hvd.broadcast")


class Method(StagedState):
    """What every hvdcomp method has, whatever carries it: a name, a description, staged state
    (:class:`hvdcomp.compressors.state.StagedState`), checkpoints and the size of the group it
    averages over. Per-tensor methods are :class:`Compressor`; step-wide ones (PowerSGD, global
    top-k, ...) live with their transport in :mod:`hvdcomp.transports`.

    Class attributes:
        name: registry name, e.g. ``"topk"``.
        default_error_feedback: whether :func:`hvdcomp.get_compressor` wraps the method in
            :class:`hvdcomp.ErrorFeedback` unless told otherwise.
        builtin_error_feedback: the method keeps its own residual (DGC); wrapping is refused.
        owns_momentum: the method applies momentum itself; the optimizer must not (DGC).
        has_scaled_state: the method keeps state in gradient units (residuals, momenta), which
            :meth:`rescale_state` multiplies when the gradients' scale changes (AMP loss scale).
        shared_state_keys: keys of :meth:`state_dict` whose values are identical on every rank
            (step counters, shared factors, shared generators): :meth:`shared_state`.
    """

    name = "base"
    default_error_feedback = False
    builtin_error_feedback = False
    owns_momentum = False
    has_scaled_state = False
    shared_state_keys: Tuple[str, ...] = ()

    def set_epoch(self, epoch: int) -> None:
        """Called by training loops at the start of each epoch (0-based); no-op by default."""

    def nominal_ratio(self, numel: int) -> float:
        """Compression ratio in the seed study's convention (32-bit values and indices), or
        ``None`` where it depends on the data."""
        return 1.0

    def expected_payload_bytes(self, numel: int):
        """Bytes one rank sends for a tensor of ``numel`` float32 elements (from
        :meth:`nominal_ratio`), or ``None`` when that depends on the data."""
        ratio = self.nominal_ratio(numel)
        if ratio is None or numel == 0:
            return None
        return int(round(4 * numel / ratio))

    def describe(self) -> Dict[str, Any]:
        """JSON-serialisable description (name and hyper-parameters) for results files."""
        return {"name": self.name}

    # ---- the ranks payloads are averaged over -------------------------------------------------
    _group_size = None  # set by the optimizer (a process set may be smaller than the world)

    def bind_group(self, size: int) -> None:
        """Average over ``size`` ranks (set by :class:`hvdcomp.DistributedOptimizer` from its
        process set); unbound methods use Horovod's world size."""
        self._group_size = int(size)

    def group_size(self) -> int:
        """Number of ranks whose payloads are averaged: the bound group's, else
        :func:`world_size`."""
        return self._group_size if self._group_size is not None else world_size()

    # ---- state that follows the training loop --------------------------------------------------
    def rescale_state(self, factor: float) -> None:
        """Multiply state kept in gradient units by ``factor`` (e.g. ``S_new / S_old`` when an
        AMP loss scale changes); no-op for methods without such state. Applies to committed
        state; call it between steps."""

    def shared_state(self) -> Dict[str, Any]:
        """The part of :meth:`state_dict` that is identical on every rank (``shared_state_keys``),
        e.g. to broadcast it from the rank that restored a checkpoint."""
        state = self.state_dict()
        return {k: state[k] for k in self.shared_state_keys if k in state}

    def load_shared_state(self, shared: Dict[str, Any]) -> None:
        """Replace the shared part of the state by ``shared`` (from :meth:`shared_state` on
        another rank), keeping this rank's own part."""
        if shared:
            state = self.state_dict()
            state.update(shared)
            self.load_state_dict(state)

    @property
    def error_bound(self) -> ErrorBound:
        """What one call guarantees about ‖C(v) − v‖ (:class:`ErrorBound`); methods that have a
        bound override this. The default states none."""
        return ErrorBound("none", f"'{self.name}' states no bound on its error (neither unbiased nor a contraction)")

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Tensors and counters needed to resume bit-identically (empty for stateless methods)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{self.name} is stateless but got state with keys {sorted(state)}")

    def _check_state_keys(self, state: Dict[str, Any], *keys: str, hint: str = "") -> None:
        """Refuse a checkpoint (for :meth:`load_state_dict`) with keys other than ``keys``.

        Raises:
            ValueError: naming the accepted keys and the unknown ones.
        """
        unknown = sorted(set(state) - set(keys))
        if unknown:
            raise ValueError(f"{self.name} state has only the key{'s' * (len(keys) > 1)} "
                             f"{', '.join(map(repr, keys))}{hint}, got unknown key(s) {unknown}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.describe().items() if k != "name")
        return f"{type(self).__name__}({args})"


class Compressor(Method, _HorovodCompressor, metaclass=abc.ABCMeta):
    """Instance-based, name-aware per-tensor gradient compressor (subclass of Horovod's
    ``Compressor``).

    Subclasses implement :meth:`_encode` (called by :meth:`encode` after input checks) and
    :meth:`decode`; stateful ones keep their state in dictionaries keyed by parameter name
    (staged: :class:`hvdcomp.compressors.state.StagedState`) and extend :meth:`state_dict` /
    :meth:`load_state_dict`. Class attributes besides :class:`Method`'s:

    Class attributes:
        payload_kind: what the payloads are (:class:`PayloadKind`; ``MEAN`` here).
        aggregate_is_mean: :meth:`aggregate` equals the mean over ranks of :meth:`decode`, so a
            gathered payload may equally be averaged as its local decode (opt-in).
        payload_is_gradient: the payload may be the gradient itself (one tensor viewing its
            memory) and ``decode`` the identity (``none``): it can be reduced in place, as stock
            Horovod does, without a copy.
        elementwise: each output element depends on its input element only (casts, a fixed
            threshold): segments need nothing special, so such methods are segmentable as is.
        segmentable: :meth:`encode` accepts ``segments`` (:mod:`hvdcomp.compressors.segments`):
            several gradients in one flat buffer, compressed in one vectorised call with the
            result per-tensor calls would give.
        majority_vote: the aggregate is a vote (a sign per element, whatever the gradients'
            sizes), not an estimate of the mean gradient: modes that need the mean's magnitude
            (local updates' pseudo-gradient) refuse it.
    """

    payload_kind = PayloadKind.MEAN
    aggregate_is_mean = False
    majority_vote = False
    payload_is_gradient = False
    elementwise = False

    @property
    def segmentable(self) -> bool:
        """Element-wise methods, and methods that implement :meth:`_encode_segments`."""
        return self.elementwise or type(self)._encode_segments is not Compressor._encode_segments

    # ---- hvdcomp API -------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, name: str | None = None, segments=None) -> Tuple[Payload, Any]:
        """Compress ``tensor`` (any shape, floating dtype) into ``(payload, ctx)``.

        Args:
            tensor: the gradient (after any error-feedback compensation).
            name: the parameter's name; stateful methods key their state by it.
            segments: a :class:`~hvdcomp.compressors.segments.Segments`: ``tensor`` is 1-D and
                holds several gradients back to back, each compressed as :meth:`encode` would
                compress it alone under its own name (``name`` is then ignored); decoding gives
                the flat buffer of the decoded gradients. Only where :attr:`segmentable`.

        Returns:
            ``payload``: list of 1-D tensors that travel; ``ctx``: local data for :meth:`decode`.

        Raises:
            TypeError: an integer or bool tensor (those have no gradients; send them
                uncompressed with ``hvd.allreduce`` / ``hvd.broadcast``).
            ValueError: ``segments`` given to a method that is not :attr:`segmentable`, or not
                matching ``tensor``.
        """
        check_floating(tensor, self.name)
        if segments is None:
            return self._encode(tensor, name)
        if not self.segmentable:
            raise ValueError(f"'{self.name}' ({self.describe()}) cannot compress several gradients "
                             "in one call; encode them one by one")
        segments.check(tensor)
        return self._encode_segments(tensor, segments)

    def _encode_segments(self, flat: torch.Tensor, segments) -> Tuple[Payload, Any]:
        """:meth:`encode` with ``segments`` (checked, only where :attr:`segmentable`): an
        element-wise method compresses the buffer as one tensor; others override this."""
        return self._encode(flat, None)

    @abc.abstractmethod
    def _encode(self, tensor: torch.Tensor, name: str | None) -> Tuple[Payload, Any]:
        """The method itself: ``tensor`` is floating point (see :meth:`encode`)."""

    @abc.abstractmethod
    def decode(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Rebuild a dense tensor of the original shape and dtype from one payload."""

    def aggregate(self, payloads: Sequence[Payload], ctx: Any) -> torch.Tensor:
        """Average the payloads gathered from every rank (allgather path).

        Args:
            payloads: one payload per rank, in rank order.
            ctx: this rank's context (shape and dtype agree on every rank).

        Returns:
            The mean over ranks of ``decode(payload_r)``, shape and dtype of the original tensor,
            accumulated in float32 (or float64) and cast back saturating.
        """
        total = None
        for p in payloads:
            d = self.decode(p, ctx)
            if total is None:
                dtype = d.dtype
                total = d.to(torch.promote_types(d.dtype, torch.float32), copy=True)
            else:
                total.add_(d)
        return cast_saturating(total.div_(len(payloads)), dtype)

    def decode_into(self, out: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        """:meth:`decode` written into ``out`` (shape and dtype of the original tensor, e.g. the
        parameter's ``.grad``; saturated to its range, see :func:`cast_saturating`); methods that
        can avoid the temporary override this. Returns ``out``."""
        return copy_saturating_(out, self.decode(payload, ctx))

    def aggregate_into(self, out: torch.Tensor, payloads: Sequence[Payload], ctx: Any) -> torch.Tensor:
        """:meth:`aggregate` written into ``out`` (see :meth:`decode_into`). Returns ``out``."""
        return copy_saturating_(out, self.aggregate(payloads, ctx))

    def residual_(self, p: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        """What error feedback keeps: ``p - decode(payload)``.

        ``p`` is a tensor the caller owns and will not read again; methods whose payload never
        shares memory with their input may compute the result in ``p``'s memory (sparsifiers
        do, saving two full-size temporaries). This default returns a new tensor.
        """
        return p - self.decode(payload, ctx)


    # ---- Horovod's static API, for stock hvd.DistributedOptimizer ---------------------------
    def compress(self, tensor: torch.Tensor):  # type: ignore[override]
        """Horovod ``Compressor.compress``: ``tensor -> (tensor, ctx)`` for stock Horovod.

        Raises:
            TypeError: for payloads Horovod's allreduce cannot sum (sparse or per-rank scaled);
                those need :class:`hvdcomp.DistributedOptimizer`.
        """
        if self.payload_kind is not PayloadKind.MEAN:
            raise TypeError(
                f"hvdcomp compressor '{self.name}' produces a payload that Horovod's allreduce "
                "cannot sum (it needs an allgather). Use hvdcomp.DistributedOptimizer(optimizer, "
                "named_parameters=model.named_parameters(), compression=...) instead of "
                "hvd.DistributedOptimizer.")
        payload, ctx = self.encode(tensor, None)
        if len(payload) != 1:
            raise TypeError(f"hvdcomp compressor '{self.name}' sends {len(payload)} tensors; "
                            "stock Horovod can carry one. Use hvdcomp.DistributedOptimizer.")
        return payload[0], ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        """Horovod ``Compressor.decompress``: inverse of :meth:`compress` (after allreduce)."""
        return self.decode([tensor], ctx)



class AggregateInto:
    """Mixin for methods whose kernel is :meth:`Compressor.aggregate_into` (writing into a given
    tensor): ``decode``, ``aggregate`` and ``decode_into`` follow from it. The context must start
    with ``(shape, dtype, ...)``; the accumulation is in float32, then cast to ``dtype``."""

    def decode(self, payload, ctx):
        """One payload's dense tensor: :meth:`aggregate` of a single payload."""
        return self.aggregate([payload], ctx)

    def aggregate(self, payloads, ctx):
        """Mean over ``payloads`` into a new float32 tensor of the context's shape, cast (saturating)
        to its dtype."""
        shape, dtype = ctx[0], ctx[1]
        device = payloads[0][0].device if payloads else torch.device("cpu")
        out = torch.empty(shape, dtype=torch.float32, device=device)
        return cast_saturating(self.aggregate_into(out, payloads, ctx), dtype)

    def decode_into(self, out, payload, ctx):
        """:meth:`decode` written into ``out``; returns ``out``."""
        return self.aggregate_into(out, [payload], ctx)

