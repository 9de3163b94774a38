"""The torch.distributed transport: compressed payloads over a ``torch.distributed`` process group
(gloo on CPU, NCCL on CUDA), for the DDP front-end (:mod:`hvdcomp.ddp`). No Horovod, no MPI.

How a payload travels depends on its kind, read from the compressor in one place
(:func:`payload_kind`):

============  ==================================================================================  ============
kind          collectives on the group                                                            methods
============  ==================================================================================  ============
``gradient``  the bucket itself, as DDP's own path: ``× 1/N``, then a summed ``all_reduce``       ``none``
              in place (bit-identical to DDP without a hook)
``average``   summed ``all_reduce`` of the payload (one per dtype), then ``× 1/N`` (Horovod's     fp16, bf16,
              ``op=Average``: sum, then post-scale); ``decode`` of the mean                       (ef) ...
``sum``       summed ``all_reduce``; ``decode`` receives the sum (sign votes)                     signsgd
``gather``    counts exchange (``all_gather_into_tensor`` of int64 element counts), then          top-k, DGC,
              every rank's payload bytes padded to the largest rank's and gathered with           QSGD, ...
              one ``all_gather_into_tensor``; aggregated on every rank
``batched``   the method's own step-wide collectives through the group's                          PowerSGD,
              :class:`~hvdcomp.comm.step.StepComm` (``all_reduce``,                               gtopk, cltk,
              ``broadcast``, point-to-point messages)                                             twophase
============  ==================================================================================  ============

A method that can saturate (fp16's scaled steps, with or without error feedback) is asked after
the ``average`` / ``sum`` all_reduce whether the reduced payload saturated
(``compression.saturation``, as the Horovod front-end's allreduce transport asks): a replacement
payload travels by one more summed :meth:`TorchDistTransport.allreduce` (``× 1/N`` as the first),
issued in bucket and unit order (:meth:`hvdcomp.ddp.buckets.BucketPath.check_saturation`).

The gather's data phase uses ``all_gather_into_tensor`` with padding rather than ``all_gather``
into a list of tensors (:data:`GATHER_INTO_TENSOR`): a quick ratio on gloo, 2 and 4 ranks on a
loaded 2-core machine (not evidence of speed), put the two within noise of each other (list /
into-tensor 0.6–1.4 from 4 KiB to 4 MiB); one contiguous output is also NCCL's native form. Top-k
payloads have the same size on every rank, so they carry no padding.

The group and its collectives are :class:`hvdcomp.comm.torchdist.TorchDistGroup`; the step-wide
methods' :class:`~hvdcomp.comm.step.StepComm` comes from it (``TorchDistGroup.step_comm``).

Byte counters (:class:`Exchange` results) count what each collective moves for this rank: an
``all_reduce`` of B bytes sends and receives B (as the Horovod front-end counts it); a gather sends
its counts (8 bytes per payload tensor) and its padded data (each payload tensor's bytes padded to a
multiple of 8, so that every tensor starts aligned in the buffer; then the whole to the largest
rank's), and receives those of the other
N − 1 ranks: the bytes that arrive from the network. The Horovod front-end's allgather counts
differ here: its ``bytes_received`` is the whole gathered buffer, this rank's own payload included
(N/(N − 1) times this count for equal payloads without padding; :mod:`hvdcomp.comm.allgather`), so compare
``bytes_sent`` across the two front-ends. Point-to-point messages count their size headers
(8 bytes each).

All collectives of a step are issued from the thread that runs DDP's communication hooks, in
bucket order, so every rank issues them in the same order (issuing them from future callbacks,
which run on gloo's worker threads in completion order, is what makes collectives mismatch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from ..comm.torchdist import TorchDistGroup
from ..compressors.base import PayloadKind
from ..plan import step_route_of
from .stepwide import StepMethod

__all__ = ["payload_kind", "KINDS", "IN_PLACE_DTYPES", "describe", "Exchange", "TorchDistTransport",
           "GATHER_INTO_TENSOR"]

KINDS = ("gradient", "average", "sum", "gather", "batched")

#: dtypes ``none`` reduces in place as DDP does (half-precision gradients travel as ``average``,
#: in float32, as under the Horovod front-end: their sums could overflow)
IN_PLACE_DTYPES = (torch.float32, torch.float64)

_BY_PAYLOAD = {PayloadKind.MEAN: "average", PayloadKind.SUM: "sum", PayloadKind.GATHERED: "gather"}

#: data phase of a gather: True: padded ``all_gather_into_tensor`` (one output buffer); False:
#: ``all_gather`` into a list of per-rank tensors (same padding; gloo needs equal sizes either way)
GATHER_INTO_TENSOR = True

_ALIGN = 8  # bytes: each payload tensor starts at a multiple of 8, so a uint8 slice views any dtype


def payload_kind(compression) -> str:
    """How ``compression``'s payloads travel (one of :data:`KINDS`, see the module docstring).

    The one place that reads what the method's payloads are, in the core's terms: a
    :class:`~hvdcomp.transports.stepwide.StepMethod` (``batched``), a payload that is the gradient
    itself (``Compressor.payload_is_gradient``: ``none``, reduced in place, as the core's allreduce
    transport does), else its :class:`~hvdcomp.compressors.base.PayloadKind`.

    Raises:
        TypeError: ``compression="auto"`` (a choice among methods that the
            :class:`~hvdcomp.reducer.Reducer` makes; the DDP hook takes one method).
    """
    if getattr(compression, "name", None) == "auto":
        raise TypeError("compression='auto' is chosen and switched by hvdcomp.reducer.Reducer, which "
                        "hvdcomp.DistributedOptimizer and the training modes (hvdcomp.local) use; the DDP hook "
                        "takes one method: give it a spec such as 'powersgd:matrix_rank=2'")
    if isinstance(compression, StepMethod):
        return "batched"
    if compression.payload_is_gradient:
        return "gradient"
    return _BY_PAYLOAD[compression.payload_kind]


def describe(kind: str, compression) -> str:
    """How payloads of ``kind`` travel (one phrase, for logs and results files)."""
    if kind == "batched":
        return f"the method's own collectives ({step_route_of(compression).collective}) once per step"
    return {"gradient": "all_reduce of the bucket (DDP's arithmetic)",
            "average": "summed all_reduce of the payload, then 1/N",
            "sum": "summed all_reduce of the payload (votes)",
            "gather": "counts exchange + padded all_gather_into_tensor, aggregated on every rank"}[kind]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class Exchange:
    """One bucket's collectives in flight.

    Attributes:
        works: the ``torch.distributed`` work handles to wait for.
        outputs: what the collectives write (reduced payload tensors, or a gather's buffers).
        sent, received: bytes this rank puts on / takes off the wire (see the module docstring).
        payload: the payload tensors (a gather: this rank's, to pack once the counts are known).
        counts: a gather's gathered element counts, ``(size, tensors)`` int64, once exchanged.
        data_started: a gather's data phase has started
            (:meth:`TorchDistTransport.start_gather_data`).
    """

    works: List[Any] = field(default_factory=list)
    outputs: List[torch.Tensor] = field(default_factory=list)
    sent: int = 0
    received: int = 0
    payload: Sequence[torch.Tensor] = ()
    counts: Optional[torch.Tensor] = None
    data_started: bool = False

    def wait(self) -> None:
        """Wait for every collective of the exchange (blocking; CUDA: stream-ordered)."""
        for w in self.works:
            w.wait()
        self.works = []


class TorchDistTransport:
    """How payloads of each kind travel over a :class:`~hvdcomp.comm.torchdist.TorchDistGroup`
    (see the module docstring): the summed ``all_reduce`` of summable payloads, and the counts
    exchange and padded data gather of variable-size ones; every call starts collectives and
    returns an :class:`Exchange` (bytes counted as the module docstring says).

    Args:
        group: the :class:`~hvdcomp.comm.torchdist.TorchDistGroup` averaged over.
    """

    def __init__(self, group: TorchDistGroup):
        self.group = group
        self.size, self.rank, self.device = group.size, group.rank, group.device

    # ---- summable payloads ----------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor]) -> Exchange:
        """Start a summed ``all_reduce`` of each tensor, in place (asynchronous)."""
        ex = Exchange(outputs=list(tensors))
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            ex.sent += nbytes
            ex.received += nbytes
            if self.size > 1:
                ex.works.append(self.group.all_reduce_async(t))
        return ex

    # ---- variable-size payloads -------------------------------------------------------------------
    def start_gather(self, payload: Sequence[torch.Tensor]) -> Exchange:
        """Start the counts exchange of a gather (asynchronous); :meth:`start_gather_data` sends
        the data once the counts are in, :meth:`gathered` cuts the result per rank.

        ``payload``: 1-D tensors, the same number and dtypes on every rank (sizes may differ)."""
        ex = Exchange(payload=list(payload))
        mine = torch.tensor([t.numel() for t in payload], dtype=torch.int64, device=self.device)
        if self.size == 1:
            ex.counts = mine.view(1, -1)
            return ex
        every = torch.empty(self.size * len(payload), dtype=torch.int64, device=self.device)
        ex.works.append(self.group.all_gather_into_async(every, mine))
        ex.counts = every.view(self.size, len(payload))
        ex.sent += mine.numel() * 8
        ex.received += (self.size - 1) * mine.numel() * 8
        return ex

    def start_gather_data(self, ex: Exchange) -> None:
        """Wait for ``ex``'s counts, then start the padded data gather (asynchronous). Idempotent."""
        if ex.data_started:
            return
        ex.wait()
        ex.data_started = True
        if self.size == 1:
            return
        sizes = [t.element_size() for t in ex.payload]
        per_rank = [sum(_padded(c * s) for c, s in zip(row, sizes)) for row in ex.counts.tolist()]
        width = max(per_rank)
        device = ex.payload[0].device if ex.payload else self.device
        parts = []
        for t in ex.payload:
            raw = t.detach().contiguous().view(-1).view(torch.uint8)
            parts.append(raw)
            pad = _padded(raw.numel()) - raw.numel()
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        filled = sum(p.numel() for p in parts)
        if width > filled:
            parts.append(torch.zeros(width - filled, dtype=torch.uint8, device=device))
        mine = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
        if width:
            if GATHER_INTO_TENSOR:
                out = torch.empty(self.size * width, dtype=torch.uint8, device=device)
                ex.works.append(self.group.all_gather_into_async(out, mine))
            else:
                pieces = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(self.size)]
                ex.works.append(self.group.all_gather_async(pieces, mine))
                out = pieces
            ex.outputs = [out]
        ex.sent += width
        ex.received += (self.size - 1) * width

    def gathered(self, ex: Exchange) -> List[List[torch.Tensor]]:
        """Every rank's payload (rank order) of a finished gather: views of the received buffer
        (this rank's own payload as given)."""
        ex.wait()
        if self.size == 1:
            return [list(ex.payload)]
        counts = ex.counts.tolist()
        dtypes = [t.dtype for t in ex.payload]
        sizes = [t.element_size() for t in ex.payload]
        width = max(sum(_padded(c * s) for c, s in zip(row, sizes)) for row in counts)
        out = []
        for r, row in enumerate(counts):
            if r == self.rank:
                out.append(list(ex.payload))
                continue
            if not width:
                out.append([torch.zeros(0, dtype=d, device=t.device) for d, t in zip(dtypes, ex.payload)])
                continue
            buf = ex.outputs[0][r] if isinstance(ex.outputs[0], list) else ex.outputs[0][r * width:(r + 1) * width]
            pos, tensors = 0, []
            for c, s, d in zip(row, sizes, dtypes):
                tensors.append(buf[pos:pos + c * s].view(d))
                pos += _padded(c * s)
            out.append(tensors)
        return out
