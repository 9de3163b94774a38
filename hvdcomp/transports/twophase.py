"""``twophase``: a compressed allreduce for quantizers, with error feedback on both sides.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021 (DeepSpeed's compressed allreduce); worker and server error feedback as in Zheng,
Huang and Kwok, "Communication-Efficient Distributed Blockwise Momentum SGD with Error-Feedback",
NeurIPS 2019.

Each rank cuts the whole model's compensated gradient ``acc`` into p chunks and compresses them
with the quantizer ``Q`` (``base``): (1) all-to-all: rank j averages the p payloads of chunk j,
``m_j = (1/p)·Σ_r decode(Q(acc_r[j]))``; (2) rank j sends ``Q(m_j + s_j)`` and keeps the server
residual ``s_j ← m_j + s_j − decode(Q(m_j + s_j))``; (3) allgather of the p chunks, decoded by
every rank. Worker residual: ``acc − decode(Q(acc))``; nothing is lost:
``p·result + p·Σ_j (s_j new − s_j old) + Σ_r worker residual_r = Σ_r acc_r``.

Wire per rank and step for a B-byte payload: (p−1)/p·B in the all-to-all and B/p to the allgather
(plus size headers), whatever p is. Needs MPI (``mpirun`` / ``horovodrun --mpi`` with mpi4py) for
the all-to-all, or elastic Horovod (Horovod's).
"""
from __future__ import annotations

import inspect
from typing import List

import torch

from ..comm.exchange import pack_payload, unpack_payload
from ..compressors.registry import compressor_class, create, register
from ..memory import Residuals
from ..plan import StepRoute, register_step_route
from .stepwide import FlatStepMethod, StepTransport

__all__ = ["TwoPhaseCompressor", "QUANTIZERS"]

#: Quantizers ``base`` may name: their ``aggregate`` is the mean of their decodes, and a
#: payload's decoding context depends on the chunk's size only.
QUANTIZERS = ("qsgd", "terngrad", "efsignsgd")


@register("twophase")
class TwoPhaseCompressor(FlatStepMethod):
    """Compressed allreduce (all-to-all, average, re-compress, allgather) of a quantizer; see the
    module docstring.

    Args:
        base: the quantizer, one of :data:`QUANTIZERS` (default ``efsignsgd``: 1-bit Adam's scaled
            sign, one scale per chunk).
        **base_args: the quantizer's own arguments (e.g. ``levels=16`` for QSGD), as in
            ``"twophase:base=qsgd,levels=16"``.

    State, all per rank: ``residual`` per parameter name (worker, per element: kept through any
    change of the world), ``server`` (this rank's chunk, per device: dropped at the first step in
    another world, elastic Horovod's other size or rank number, size 1 too), ``server_chunk``
    (``[rank, size]`` of that chunk) and the quantizer's state (its per-rank generator).

    Raises:
        ValueError: ``base`` not a quantizer of :data:`QUANTIZERS`, or bad ``base_args`` (the
            quantizer's own message).
    """

    name = "twophase"

    def __init__(self, base: str = "efsignsgd", **base_args):
        super().__init__()
        if base not in QUANTIZERS:
            raise ValueError(f"twophase compresses with a quantizer whose average is the mean of its "
                             f"decodes: base must be one of {', '.join(QUANTIZERS)}; got {base!r}")
        self.base = create(base, **base_args)
        self.server_memory = Residuals(self, "server")  # this rank's chunk, per device
        self.server_chunk = None  # (rank, size) the server residual is the chunk of; None: not known

    def describe(self):
        return {"name": self.name, "base": self.base.describe()}

    def nominal_ratio(self, numel):
        return self.base.nominal_ratio(numel)

    def staged_children(self):
        """The quantizer: its generators are part of this method's step (staged, rolled back, saved)."""
        return (self.base,)

    @staticmethod
    def chunk_bounds(n: int, p: int) -> List[int]:
        """p + 1 boundaries of the contiguous chunks of n elements (sizes differ by at most 1)."""
        return [j * n // p for j in range(p + 1)]

    def reduce_flat(self, acc, comm, timer):
        p, me = comm.size, comm.rank
        if self.server_chunk != (me, p):  # (a residual of another partition, or of another chunk)
            if self.server_chunk is not None:
                self.server_memory.load({})
            self.server_chunk = (me, p)
        bounds = self.chunk_bounds(acc.numel(), p)
        chunks = [acc[bounds[j]:bounds[j + 1]] for j in range(p)]
        with timer.phase("compress"):
            encoded = [self.base.encode(c, f"chunk{j}") for j, c in enumerate(chunks)]
            residual = torch.cat([c - self.base.decode(*e).to(torch.float32) for c, e in zip(chunks, encoded)])
        if p == 1:  # nothing to average: the quantized gradient itself, no server side
            return acc - residual, residual
        x = comm.point_to_point
        if x is None:
            raise RuntimeError("twophase exchanges chunks all-to-all through MPI: launch with mpirun or "
                               "horovodrun --mpi (mpi4py installed); or use the quantizer alone")
        sent0, received0 = x.bytes_sent, x.bytes_received
        with timer.phase("communicate"):
            received = x.alltoall([pack_payload(e[0]) for e in encoded])
        with timer.phase("compress"):
            ctx = encoded[me][1]
            mean = torch.zeros(bounds[me + 1] - bounds[me], dtype=torch.float32, device=acc.device)
            for data in received:
                mean += self.base.decode(unpack_payload(data, acc.device), ctx).to(torch.float32).reshape(-1)
            mean /= p
            key = str(acc.device)
            old = self.server_memory.get(key)  # server-side error feedback on this rank's chunk
            target = mean if old is None or old.numel() != mean.numel() else mean + old
            payload, _ = self.base.encode(target, f"server{me}")
            self.server_memory.keep(key, target - self.base.decode(payload, ctx).to(torch.float32).reshape(-1))
        with timer.phase("communicate"):
            gathered = x.allgather(pack_payload(payload))
        timer.add_bytes(sent=x.bytes_sent - sent0, received=x.bytes_received - received0)
        with timer.phase("decompress"):
            result = torch.cat([self.base.decode(unpack_payload(g, acc.device), encoded[j][1]).to(torch.float32)
                                .reshape(-1) for j, g in enumerate(gathered)])
        return result, residual

    def rescale_state(self, factor):
        super().rescale_state(factor)
        self.server_memory.rescale(factor)

    def state_dict(self):
        return {**super().state_dict(), "server": self.server_memory.state(),
                "server_chunk": list(self.server_chunk or ()), "base": self.base.state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict({k: v for k, v in state.items() if k == "residual"})
        self._check_state_keys(state, "residual", "server", "server_chunk", "base")
        self.server_memory.load(state.get("server", {}))
        chunk = tuple(int(v) for v in state.get("server_chunk", ()))
        self.server_chunk = chunk or None  # (none saved: the loaded residual is taken for this rank's chunk)
        self.base.load_state_dict(state.get("base", {}))


def _collectives(method, numels, p, bucket_bytes):
    """All-to-all of the quantized model (B bytes, p chunks) and allgather of one re-quantized
    chunk (B/p bytes) per rank, each with its counts exchange (2 calls); None where the
    quantizer's size depends on the data."""
    wire = method.base.expected_payload_bytes(sum(numels))
    if wire is None:
        return None
    return [("alltoall", float(wire), 2), ("allgather", float(wire) / max(1, p), 2)]


def _alternative(compression):
    """The two-phase compressed allreduce of the same quantizer with the same settings, for
    ``qsgd``, ``terngrad`` and ``efsignsgd`` (``transport="auto"``)."""
    desc = compression.describe()
    if desc.get("name") not in QUANTIZERS:
        return None
    # the quantizer's constructor arguments among its description (not derived values such as bits)
    takes = inspect.signature(compressor_class(desc["name"]).__init__).parameters
    return TwoPhaseCompressor(base=desc["name"], **{k: v for k, v in desc.items() if k in takes and k != "ef"})


register_step_route(StepRoute(TwoPhaseCompressor, "alltoall+allgather", _collectives, needs_point_to_point=True,
                              alternative=_alternative, build=StepTransport))
