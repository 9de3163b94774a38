"""α-β (latency-bandwidth) cost model of the collectives, used to route each gradient.

Hockney's model: m bytes between two ranks cost ``α + m·β`` seconds. With the ring algorithms
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005), on p ranks an allreduce of n bytes costs ``2(p-1)·α + 2(p-1)/p·n·β`` and an allgather
of m bytes per rank ``(p-1)·α + (p-1)·m·β`` (hvdcomp adds a counts exchange, ``(p-1)·α``). A
sparse payload beats allreducing the dense tensor only while ``m/n < 2/p`` (top-k with 8-byte
entries: density below ``1/p``); past that the gradient is decoded locally and allreduced (same
result, :attr:`hvdcomp.Compressor.aggregate_is_mean`).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Iterable, Sequence, Tuple

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["CostModel", "measure_cost_model", "fit_alpha_beta", "collective_terms", "COLLECTIVES"]

#: Collectives :func:`collective_terms` models (the ring ones, and those of the scale-out transports).
COLLECTIVES = ("allreduce", "allgather", "sparse-allreduce", "broadcast", "alltoall")


def collective_terms(kind: str, p: int, nbytes: float) -> Tuple[float, float]:
    """``(latency terms, byte terms)`` of one collective on ``p`` ranks, on the critical path of
    a rank: its time is ``latency_terms·α + byte_terms·β``.

    Args:
        kind: one of :data:`COLLECTIVES`:

            * ``"allreduce"`` (``nbytes``: the tensor), ``"allgather"`` (``nbytes``: one rank's
              contribution): the rings of the module docstring;
            * ``"sparse-allreduce"``: gTop-k's recursive doubling
              (:func:`hvdcomp.comm.sparse_allreduce.global_topk`), ``nbytes`` = one rank's k
              entries: log2(q) exchanges of ``nbytes`` (q: the largest power of two ≤ p), plus,
              where p ≠ q, the fold (in, and the result back) and the surviving positions
              (half an entry each): 3 more messages, 2.5·``nbytes``;
            * ``"broadcast"``: binomial tree, ⌈log2 p⌉ steps of ``nbytes``;
            * ``"alltoall"``: pairwise exchange of a rank's ``nbytes`` cut into p parts:
              (p−1) messages, (p−1)/p·``nbytes``.
        p: number of ranks; one rank costs nothing.
        nbytes: bytes (see ``kind``).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {COLLECTIVES}, got {kind!r}")
    if p <= 1:
        return 0.0, 0.0
    if kind == "allgather":
        return p - 1, (p - 1) * nbytes
    if kind == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) / p * nbytes
    if kind == "sparse-allreduce":
        q = 1 << (int(p).bit_length() - 1)
        rounds, fold = q.bit_length() - 1, q != p
        return rounds + 3 * fold, (rounds + 2.5 * fold) * nbytes
    if kind == "broadcast":
        steps = math.ceil(math.log2(p))
        return steps, steps * nbytes
    return p - 1, (p - 1) / p * nbytes


@dataclass(frozen=True)
class CostModel:
    """Latency ``alpha`` (seconds per message) and inverse bandwidth ``beta`` (seconds per byte).

    Raises:
        ValueError: a negative or non-finite ``alpha`` or ``beta``.
    """

    alpha: float
    beta: float

    def __post_init__(self):
        for key in ("alpha", "beta"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"cost model {key} must be a finite number >= 0 (seconds"
                                 f"{' per byte' if key == 'beta' else ''}), got {v!r}")

    def seconds(self, kind: str, p: int, nbytes: float, calls: int = 1) -> float:
        """Seconds for ``calls`` collectives of ``kind`` (see :func:`collective_terms`) moving
        ``nbytes`` in all (latency paid per call)."""
        a, b = collective_terms(kind, p, nbytes)
        return calls * a * self.alpha + b * self.beta

    def allreduce(self, nbytes: float, p: int) -> float:
        """Seconds for a ring allreduce of ``nbytes`` on ``p`` ranks (0 for one rank)."""
        return self.seconds("allreduce", p, nbytes)

    def allgather(self, nbytes_per_rank: float, p: int, counts_exchange: bool = True) -> float:
        """Seconds for a ring allgather of ``nbytes_per_rank`` from each of ``p`` ranks, plus the
        counts exchange of hvdcomp's variable-size allgather when ``counts_exchange``."""
        return self.seconds("allgather", p, nbytes_per_rank, calls=2 if counts_exchange else 1)

    def choose(self, sparse_bytes: float, dense_bytes: float, p: int) -> str:
        """``"allgather"`` (send the compressed payload) or ``"allreduce"`` (decode locally and
        allreduce ``dense_bytes``), whichever the model predicts to be faster; ties (within a
        relative 1e-6, e.g. bf16 on 4 ranks) gather."""
        if self.allreduce(dense_bytes, p) < self.allgather(sparse_bytes, p) * (1 - 1e-6):
            return "allreduce"
        return "allgather"


def fit_alpha_beta(samples: Iterable[Tuple[float, float, float]], small_bytes: float = 4096) -> CostModel:
    """Fit ``seconds = a·alpha + b·beta`` (both >= 0) in two stages that stay meaningful when
    small messages travel faster than the link's sustained rate (e.g. a token-bucket burst):
    alpha from the small messages (at most ``small_bytes`` per message, or else the smallest),
    beta by least squares on the others (absolute error: the large messages decide the
    bandwidth), alternating a few times so that each accounts for the other's term.

    Args:
        samples: ``(a, b, seconds)`` triples, where ``a`` counts latency terms and ``b`` bytes
            terms of a measured operation (e.g. ring allgather of m bytes on p ranks:
            ``a = p-1``, ``b = (p-1)·m``).
        small_bytes: largest bytes per message (``b/a``) counted as latency-bound.

    Returns:
        The fitted :class:`CostModel`.

    Raises:
        ValueError: fewer than two samples, or all of the same size.
    """
    rows = np.array(list(samples), dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] < 2:
        raise ValueError("fitting alpha and beta needs at least two measurements (a, b, seconds)")
    a, b, t = rows[:, 0], rows[:, 1], rows[:, 2]
    per_msg = b / np.maximum(a, 1e-12)
    small = per_msg <= max(small_bytes, per_msg.min())
    large = ~small
    if not large.any():
        raise ValueError("fitting beta needs measurements with more than "
                         f"{small_bytes:g} bytes per message")
    alpha, beta = 0.0, 0.0
    for _ in range(20):
        beta = max(0.0, float(np.sum(b[large] * (t[large] - a[large] * alpha)) / np.sum(b[large] ** 2)))
        alpha = max(0.0, float(np.median((t[small] - b[small] * beta) / np.maximum(a[small], 1e-12))))
    return CostModel(alpha, beta)


def measure_cost_model(gather, size: int, sizes: Sequence[int] = (8, 65536, 262144),
                       repeats: int = 3, agree=None) -> CostModel:
    """Measure α and β with allgathers of a few message sizes at start-up.

    Args:
        gather: callable ``gather(nbytes)`` that allgathers ``nbytes`` bytes from every rank
            and returns when done (blocking), on the communicator the payloads will use.
        size: number of ranks p (>= 2).
        sizes: bytes per rank to time (the smallest sets α, the others β).
        repeats: timings per size; the fastest is kept.
        agree: callable mapping this rank's ``[alpha, beta]`` (numpy float64) to the values every
            rank will use (e.g. an allreduce-max); without it each rank keeps its own, which can
            make ranks route differently — pass one under MPI.

    Returns:
        A :class:`CostModel` (identical on every rank when ``agree`` is given).
    """
    samples = []
    for nbytes in sizes:
        gather(nbytes)  # warm-up (connections, buffers)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            gather(nbytes)
            best = min(best, time.perf_counter() - t0)
        samples.append((*collective_terms("allgather", size, nbytes), best))
    model = fit_alpha_beta(samples)
    values = np.array([model.alpha, model.beta], dtype=np.float64)
    if agree is not None:
        values = np.asarray(agree(values), dtype=np.float64)
    model = CostModel(float(values[0]), float(values[1]))
    log.info("hvdcomp cost model: alpha %.1f us, beta %.3g s/B (%.1f MB/s)", model.alpha * 1e6,
             model.beta, 1e-6 / model.beta if model.beta else float("inf"))
    return model
