"""Simulate N Horovod ranks in one process (test helper).

Each simulated rank has its own compressor instance, built and used inside
``hvdcomp.compressors.simulated_world(N, rank)`` so that ``world_size()`` / ``rank()`` (and every
per-rank random generator) see that rank. Payloads are combined the way the transports combine
them:

* summable payloads: :func:`horovod_allreduce`, a model of Horovod's CPU (MPI) allreduce: a sum
  in rank order in the payload's dtype (float16: each pairwise addition in float32, rounded back
  to float16, as Horovod's float16 MPI op does; Open MPI's ring allreduce adds the ranks one
  after another), then for ``op=Average`` a multiplication by float32(1/N) rounded back to the
  payload dtype (Horovod's post-scale);
* other payloads: every rank's payload goes to :meth:`Compressor.aggregate` (the allgather path);
* PowerSGD (``reduce_batch``): the N instances run in lock-step in N threads; their
  ``allreduce_mean`` calls meet at a barrier, where :func:`horovod_allreduce` averages them.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from hvdcomp.comm.stepcomm import StepComm
from hvdcomp.compressors import PayloadKind
from hvdcomp.compressors import simulated_world
from hvdcomp.metrics import PhaseTimer

__all__ = ["horovod_allreduce", "SimulatedRanks", "fp16_sequential_sum", "ThreadNetwork", "run_ranks", "step_comms",
           "leader_topk_error"]

TIMEOUT_S = 60  # a simulated rank waiting longer than this for a message fails the test


class ThreadNetwork:
    """Point-to-point messages among ``size`` simulated ranks running in threads of one process
    (:class:`hvdcomp.comm.exchange.PointToPoint` endpoints; unbounded queues, so a send
    never blocks). ``sent[r]`` / ``received[r]`` count each rank's bytes, ``pair_bytes`` each
    (source, destination)'s; ``nodes`` (node id per rank) is what the endpoints report as their
    hosts. A receive waiting more than :data:`TIMEOUT_S` raises ``queue.Empty`` (a hang fails the
    test)."""

    def __init__(self, size: int, nodes=None):
        import queue

        self.size = size
        self.nodes = list(nodes) if nodes is not None else None  # node id per rank (hierarchical)
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
        self.sent = [0] * size
        self.received = [0] * size
        self.pair_bytes = {}  # (source, destination) -> bytes sent

    def endpoint(self, rank: int):
        net = self

        class Endpoint:
            def __init__(self):
                self.rank, self.size, self.nodes = rank, net.size, net.nodes

            @property
            def bytes_sent(self):
                return net.sent[rank]

            @property
            def bytes_received(self):
                return net.received[rank]

            def send(self, data, dest):
                assert data.dtype == torch.uint8 and data.dim() == 1
                net.sent[rank] += data.numel()
                net.pair_bytes[(rank, dest)] = net.pair_bytes.get((rank, dest), 0) + data.numel()
                net.queues[(rank, dest)].put(data.clone())

            def recv(self, source, max_bytes):
                data = net.queues[(source, rank)].get(timeout=TIMEOUT_S)
                assert data.numel() <= max_bytes, f"message of {data.numel()} B > max_bytes {max_bytes}"
                net.received[rank] += data.numel()
                return data

            def sendrecv(self, data, partner, max_bytes):
                self.send(data, partner)
                return self.recv(partner, max_bytes)

            def alltoall(self, parts):
                assert len(parts) == net.size
                for j, part in enumerate(parts):
                    if j != rank:
                        self.send(part, j)
                return [parts[j].clone() if j == rank else self.recv(j, 1 << 40) for j in range(net.size)]

            def allgather(self, data):
                return self.alltoall([data] * net.size)

        return Endpoint()


def step_comms(size: int, nodes=None) -> List[StepComm]:
    """One :class:`StepComm` per simulated rank, for ranks running in threads (:func:`run_ranks`):
    ``allreduce_mean`` and ``broadcast`` meet at a barrier (the mean by :func:`horovod_allreduce`),
    point-to-point messages go through one :class:`ThreadNetwork`. Every comm has ``barrier``
    (abort it when a rank fails) and ``network`` attributes."""
    barrier = threading.Barrier(size)
    contributions: List[Optional[torch.Tensor]] = [None] * size
    shared = {}
    network = ThreadNetwork(size, nodes)

    def allreduce_mean_for(r):
        def allreduce_mean(flat, name):
            contributions[r] = flat.clone()
            if barrier.wait() == 0:
                shared["out"] = horovod_allreduce(contributions, "average")
            barrier.wait()
            out = shared["out"].clone()
            barrier.wait()  # everyone has its copy before the next round overwrites it
            return out
        return allreduce_mean

    def broadcast_for(r):
        def broadcast(tensor, root, name):
            if r == root:
                shared["bcast"] = tensor.clone()
            barrier.wait()
            out = shared["bcast"].clone()
            barrier.wait()
            return out
        return broadcast

    comms = []
    for r in range(size):
        comm = StepComm(allreduce_mean_for(r), r, size, broadcast_for(r), network.endpoint(r))
        comm.barrier, comm.network = barrier, network
        comms.append(comm)
    return comms


def run_ranks(size: int, fn) -> list:
    """``fn(rank)`` for every rank in its own thread; their results in rank order (the first
    exception is re-raised; a thread still running after :data:`TIMEOUT_S` fails)."""
    results: list = [None] * size
    errors: List[BaseException] = []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        if t.is_alive():
            raise TimeoutError(f"a simulated rank did not finish within {TIMEOUT_S} s")
    if errors:
        raise errors[0]
    return results


def fp16_sequential_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ in rank order, each addition in float32 rounded to float16 (Horovod's float16 MPI op)."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = (acc.to(torch.float32) + t.to(torch.float32)).to(torch.float16)
    return acc


def horovod_allreduce(tensors: Sequence[torch.Tensor], op: str = "average") -> torch.Tensor:
    """What Horovod's CPU allreduce returns on every rank for these per-rank tensors.

    Args:
        tensors: one tensor per rank (same shape and dtype).
        op: ``"average"`` (sum, then times 1/N in float32, or float64 for float64 payloads,
            rounded back to the dtype) or ``"sum"``.
    """
    if op not in ("average", "sum"):
        raise ValueError(f"op must be 'average' or 'sum', got {op!r}")
    dtype = tensors[0].dtype
    if dtype == torch.float16:
        acc = fp16_sequential_sum(tensors)
    else:
        acc = tensors[0].clone()
        for t in tensors[1:]:
            acc = acc + t
    if op == "sum":
        return acc
    n = len(tensors)
    if dtype == torch.float64:
        return acc * (1.0 / n)
    if not dtype.is_floating_point:
        raise TypeError(f"op=average of {dtype} payloads is not modelled")
    factor = torch.tensor(1.0 / n, dtype=torch.float32)
    return (acc.to(torch.float32) * factor).to(dtype)


class SimulatedRanks:
    """``world`` compressor instances from ``make()``, stepping together.

    Args:
        make: builds one compressor (called once per simulated rank, inside its
            ``simulated_world``).
        world: N, the simulated world size.
        saturation: also model the allreduce transport's saturation check
            (:meth:`hvdcomp.transports.allreduce.AllreduceTransport.resend_saturated`): a summable
            payload whose method reports saturation is replaced by the method's resend (reduced
            and decoded instead), or decodes to NaN where the method reports an overflow. Off:
            the reduced payload is decoded as it is (the codec alone).
    """

    def __init__(self, make: Callable[[], object], world: int, saturation: bool = False):
        self.world = world
        self.saturation = saturation
        self.actions: list = []  # with saturation: each rank's last Saturation (None: none)
        self.comps = []
        for r in range(world):
            with simulated_world(world, r):
                self.comps.append(make())

    def encode(self, grads: Sequence[torch.Tensor], name: str = "w") -> List[Tuple[list, object]]:
        """Every rank's ``encode(grads[r], name)``; payload tensors are cloned (a transport copies)."""
        out = []
        for r, (comp, g) in enumerate(zip(self.comps, grads)):
            with simulated_world(self.world, r):
                payload, ctx = comp.encode(g, name)
            out.append(([t.clone() for t in payload], ctx))
        return out

    def combine(self, encoded, ranks: Optional[Sequence[int]] = None) -> List[Optional[torch.Tensor]]:
        """The gradient each rank ends the step with (``None`` for ranks not in ``ranks``).

        Summable payloads are reduced once by :func:`horovod_allreduce` and decoded on every
        rank (decoding may record state, e.g. fp16's agreed exponent). Other payloads are
        aggregated on ``ranks`` only (default: the first and the last rank; every rank holds the
        same payloads, and aggregation records nothing, except error feedback's excess of a
        half-precision result beyond its dtype's range, which only those ranks then record).
        """
        comp0 = self.comps[0]
        if comp0.payload_kind is not PayloadKind.GATHERED:
            op = "sum" if comp0.payload_kind is PayloadKind.SUM else "average"
            reduced = [horovod_allreduce([enc[0][i] for enc in encoded], op)
                       for i in range(len(encoded[0][0]))]
            ctxs = [enc[1] for enc in encoded]
            overflow = False
            self.actions = [None] * self.world
            if self.saturation and hasattr(comp0, "saturation"):
                for r, comp in enumerate(self.comps):
                    with simulated_world(self.world, r):
                        self.actions[r] = comp.saturation([t.clone() for t in reduced], ctxs[r])
                found = [a is not None for a in self.actions]
                assert all(found) or not any(found), "simulated ranks disagree on saturation"
                if found[0] and self.actions[0].payload is None:
                    overflow = True
                elif found[0]:
                    reduced = [horovod_allreduce([a.payload[i] for a in self.actions], op)
                               for i in range(len(self.actions[0].payload))]
                    ctxs = [a.ctx for a in self.actions]
            outs = []
            for r, comp in enumerate(self.comps):
                with simulated_world(self.world, r):
                    out = comp.decode([t.clone() for t in reduced], ctxs[r])
                outs.append(out.fill_(float("nan")) if overflow else out)
            return outs
        payloads = [enc[0] for enc in encoded]
        ranks = sorted({0, self.world - 1}) if ranks is None else ranks
        outs: List[Optional[torch.Tensor]] = [None] * self.world
        for r in ranks:
            with simulated_world(self.world, r):
                outs[r] = self.comps[r].aggregate(payloads, encoded[r][1])
        return outs

    def step(self, grads: Sequence[torch.Tensor], name: str = "w") -> torch.Tensor:
        """Encode every rank's gradient and combine; returns rank 0's result (checks that every
        rank that computed one got the same, bit for bit)."""
        outs = self.combine(self.encode(grads, name))
        first = outs[0]
        for o in outs[1:]:
            if o is not None:
                assert torch.equal(o, first) or (torch.isnan(o).any() and torch.isnan(first).any()), \
                    "simulated ranks disagree on the aggregate"
        return first

    def reduce_batch(self, named_grads_per_rank: Sequence[Sequence[Tuple[str, torch.Tensor]]],
                     nodes=None) -> List[List[torch.Tensor]]:
        """A batched compressor's step (PowerSGD, gtopk, ...): every rank's ``reduce_batch`` in
        lock-step; ``nodes`` (node id per rank) is what their messages report as hosts.

        Returns every rank's list of averaged gradients.
        """
        n = self.world
        results: List[Optional[list]] = [None] * n
        errors: List[BaseException] = []
        comms = step_comms(n, nodes)
        barrier = comms[0].barrier
        self.last_network = comms[0].network

        def run(r):
            try:
                results[r] = self.comps[r].reduce_batch(list(named_grads_per_rank[r]), comms[r],
                                                        PhaseTimer(cuda_sync=False))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]


def leader_topk_error(steps: Sequence[Sequence[torch.Tensor]], density: float, variance: bool) -> float:
    """The relative error ``sqrt(Σ ‖kept_r‖² / Σ ‖p_r‖²)`` of the allreduce-compatible top-k with
    error feedback over ``steps`` (per step, every rank's flat gradient, rank order; residuals
    from zero): ``p_r`` = rank r's gradient + residual, ``kept_r`` = ``p_r`` off the leader's top-k
    positions (its new residual). Leader of step t: rank t mod N (cyclic, CLT-k), or with
    ``variance`` VAR-Topk's, the largest smoothed gradient norm Σ_j w_j·‖g‖ / Σ_j w_j with
    w_j = (1 − 0.001)^j, j = 1 for the newest step, ties to the lower rank."""
    import math

    from hvdcomp.compressors.topk import num_kept

    n, numel = len(steps[0]), steps[0][0].numel()
    residual = [torch.zeros(numel) for _ in range(n)]
    norms: List[List[float]] = [[] for _ in range(n)]
    err2 = norm2 = 0.0
    for t, g in enumerate(steps):
        p = [g[r] + residual[r] for r in range(n)]
        leader = t % n
        if variance:
            stats = []
            for r in range(n):
                norms[r].append(float(g[r].norm()))
                w = [(1 - 0.001) ** j for j in range(1, len(norms[r]) + 1)]
                stats.append(sum(a * b for a, b in zip(w, reversed(norms[r]))) / sum(w))
            leader = max(range(n), key=lambda r: (stats[r], -r))
        idx = p[leader].abs().topk(num_kept(numel, density)).indices
        for r in range(n):
            residual[r] = p[r].clone()
            residual[r][idx] = 0.0
            err2 += float(residual[r].square().sum())
            norm2 += float(p[r].square().sum())
    return math.sqrt(err2 / norm2)
