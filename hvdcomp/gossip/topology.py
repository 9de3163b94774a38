"""Communication graphs for decentralized training, as data: who talks to whom, with what weight.

A :class:`Topology` holds, for ``size`` ranks, the neighbours of every rank and a *mixing matrix*
W (``size × size`` float64): rank i's gossip average is ``Σ_j W[i, j] x_j``. Every W built here is
symmetric, doubly stochastic (entries ≥ 0), connected (over one period, for a time-varying graph)
and aperiodic (spectral gap ρ = 1 − max(|λ₂(W)|, |λₙ(W)|) > 0: uncompressed gossip contracts the
disagreement by 1 − ρ per step); a violation raises ``ValueError`` naming the rank or edge at
fault and the fix.

Graphs (:func:`make_topology` names): ``ring``, ``torus`` (``torus:RxC``), ``exponential`` (the
one-peer exponential graph, time-varying: rank i pairs with ``i XOR 2^(t mod log2 n)``, n a power
of two; Ying, Yuan, Chen, Hu, Pan and Yin, "Exponential Graph is Provably Efficient for
Decentralized Deep Training", NeurIPS 2021), ``complete``, or neighbour lists
(:func:`from_adjacency`). Weights of a static graph: ``"metropolis"`` (``W[i, j] = 1/(1 +
max(d_i, d_j))``, the default) or ``"uniform"`` (``1/(d + 1)``, regular graphs only); Xiao and
Boyd, "Fast linear iterations for distributed averaging", 2004. Degrees and gaps:
``docs/gossip.md`` ("Topologies").
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..checks import as_number, check_choice, check_count

__all__ = ["Topology", "ring", "torus", "exponential", "complete", "from_adjacency", "from_weights",
           "make_topology", "TOPOLOGIES"]

#: tolerance of the symmetric / doubly stochastic checks (float64 sums of a row)
TOLERANCE = 1e-12
#: smallest spectral gap accepted: a gap at or below it is a periodic (or disconnected) W, whose
#: gossip never reaches consensus (float64 eigenvalues of such a W are within ~1e-15 of ±1); a
#: Metropolis ring of n ranks has ρ ≈ 13/n², above this bound up to n ≈ 360,000
GAP_TOLERANCE = 1e-10


class Topology:
    """Neighbours and mixing weights of ``size`` ranks; static (``period == 1``) or time-varying.

    Build one with :func:`ring`, :func:`torus`, :func:`exponential`, :func:`complete`,
    :func:`from_adjacency`, :func:`from_weights` or :func:`make_topology`.

    Args:
        name: a label (``"ring"``, ``"torus 2x4"``, ...), for logs and results.
        matrices: one ``size × size`` mixing matrix per round of the period (float64), each
            symmetric and doubly stochastic; the graph of the union of their edges must be connected.

    Attributes:
        name, size, period: as given (``period = len(matrices)``).
        time_varying: ``period > 1``.
        spectral_gap: ρ ∈ [0, 1]. Static: ``1 − max(|λ₂|, |λₙ|)`` of W. Time-varying: the per-step
            rate of one period, ``1 − ‖W_{P−1}···W_0 − J‖₂^(1/P)`` (J: the averaging matrix).
        beta: ``‖I − W‖₂`` (static; the largest over the rounds otherwise), the other constant of
            Choco-SGD's step-size bound.

    Raises:
        ValueError: a matrix that is not square ``size × size``, not symmetric, not doubly
            stochastic, with a negative entry, a disconnected union graph (the message names the
            offending rank, edge or components), or a spectral gap ρ ≤ :data:`GAP_TOLERANCE`
            (a periodic W, e.g. a bipartite graph with zero self-weights: eigenvalue −1, no
            consensus; the message gives ρ and |λ₂|).
    """

    def __init__(self, name: str, matrices: Sequence[np.ndarray]):
        if not matrices:
            raise ValueError("a topology needs at least one mixing matrix")
        mats = [np.array(m, dtype=np.float64) for m in matrices]
        size = mats[0].shape[0] if mats[0].ndim == 2 else -1
        for t, w in enumerate(mats):
            _check_mixing(w, size, f"{name} (round {t})" if len(mats) > 1 else name)
        self.name = name
        self.size = size
        self.period = len(mats)
        self.time_varying = self.period > 1
        self._mats = mats
        for w in mats:
            w.setflags(write=False)
        self._neighbors = [[tuple(int(j) for j in np.flatnonzero(w[i]) if j != i) for i in range(size)]
                           for w in mats]
        _check_connected([sorted(set().union(*(set(nb[i]) for nb in self._neighbors))) for i in range(size)], name)
        self.spectral_gap = _spectral_gap(mats)
        _check_gap(self.spectral_gap, name, self.period)
        self.beta = max(float(np.linalg.norm(np.eye(size) - w, 2)) for w in mats) if size else 0.0

    # ---- queries ------------------------------------------------------------------------------
    def matrix(self, step: int = 0) -> np.ndarray:
        """The mixing matrix used at ``step`` (read-only float64, ``size × size``)."""
        return self._mats[step % self.period]

    def neighbors(self, rank: int, step: int = 0) -> Tuple[int, ...]:
        """Ranks that ``rank`` exchanges with at ``step`` (ascending, never ``rank`` itself)."""
        return self._neighbors[step % self.period][self._rank(rank)]

    def all_neighbors(self, rank: int) -> Tuple[int, ...]:
        """Every rank that ``rank`` exchanges with at some step of the period (ascending)."""
        r = self._rank(rank)
        return tuple(sorted(set().union(*(set(nb[r]) for nb in self._neighbors))))

    def weight(self, i: int, j: int, step: int = 0) -> float:
        """``W[i, j]`` at ``step`` (``j == i``: the self-weight)."""
        return float(self._mats[step % self.period][self._rank(i), self._rank(j)])

    def degree(self, rank: int, step: int = 0) -> int:
        """Number of neighbours of ``rank`` at ``step``."""
        return len(self.neighbors(rank, step))

    def max_degree(self) -> int:
        """The largest number of neighbours of any rank at any step."""
        return max((len(nb[i]) for nb in self._neighbors for i in range(self.size)), default=0)

    def fingerprint(self) -> str:
        """SHA-256 of the matrices' bytes: equal on two ranks iff they built the same topology."""
        h = hashlib.sha256(f"{self.size}/{self.period}".encode())
        for w in self._mats:
            h.update(np.ascontiguousarray(w).tobytes())
        return h.hexdigest()

    def describe(self) -> Dict[str, object]:
        """JSON-able summary: name, size, period, degrees, spectral gap, β, fingerprint."""
        degrees = sorted({len(nb[i]) for nb in self._neighbors for i in range(self.size)})
        return {"name": self.name, "size": self.size, "period": self.period, "degrees": degrees,
                "spectral_gap": self.spectral_gap, "beta": self.beta, "fingerprint": self.fingerprint()[:16]}

    def __repr__(self) -> str:
        return (f"Topology({self.name!r}, size={self.size}, period={self.period}, "
                f"spectral_gap={self.spectral_gap:.4g})")

    def _rank(self, rank: int) -> int:
        value = as_number(rank, integer=True)
        if value is None or not 0 <= value < self.size:
            raise ValueError(f"rank {rank!r} is outside this {self.size}-rank topology")
        return value


# ---- checks ---------------------------------------------------------------------------------------
def _check_mixing(w: np.ndarray, size: int, name: str) -> None:
    """Square, finite, non-negative, symmetric, doubly stochastic (see :class:`Topology`)."""
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] != size or size < 1:
        raise ValueError(f"{name}: a mixing matrix must be square, size x size with size >= 1; got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name}: the mixing matrix has non-finite entries")
    if (w < -TOLERANCE).any():
        i, j = map(int, np.argwhere(w < -TOLERANCE)[0])
        raise ValueError(f"{name}: negative mixing weight W[{i}, {j}] = {w[i, j]:g}; weights must be >= 0")
    asym = np.abs(w - w.T)
    if (asym > TOLERANCE).any():
        i, j = map(int, np.unravel_index(np.argmax(asym), w.shape))
        raise ValueError(f"{name}: not symmetric: W[{i}, {j}] = {w[i, j]:g} but W[{j}, {i}] = {w[j, i]:g}; "
                         f"rank {i} and rank {j} must weigh their edge equally (an undirected graph)")
    rows = w.sum(axis=1)
    bad = np.flatnonzero(np.abs(rows - 1.0) > TOLERANCE)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}: not doubly stochastic: row {i} sums to {rows[i]:.15g}, not 1; "
                         "use weights='metropolis' or rescale the row")


def _check_connected(adjacency: List[Sequence[int]], name: str) -> None:
    """Raise unless the undirected graph of ``adjacency`` has one component (listed otherwise)."""
    size = len(adjacency)
    component = [-1] * size
    count = 0
    for start in range(size):
        if component[start] >= 0:
            continue
        stack, component[start] = [start], count
        while stack:
            i = stack.pop()
            for j in adjacency[i]:
                if component[j] < 0:
                    component[j] = count
                    stack.append(j)
        count += 1
    if count > 1:
        parts = [[i for i in range(size) if component[i] == c] for c in range(count)]
        shown = "; ".join(str(p) if len(p) <= 8 else f"[{p[0]}, ... {len(p)} ranks]" for p in parts[:4])
        raise ValueError(f"{name}: the graph is disconnected ({count} components: {shown}); models in "
                         "different components never agree: add an edge between them")


def _check_gap(gap: float, name: str, period: int) -> None:
    """Raise unless the spectral gap ``gap`` is above :data:`GAP_TOLERANCE`."""
    if gap > GAP_TOLERANCE:
        return
    gap_text, rate_text = f"{round(gap, 12):.3g}", f"{round(1 - gap, 12):.12g}"  # (float64 noise of ±1 shown as 0, 1)
    what = (f"W has spectral gap {gap_text} (|λ₂| = {rate_text}, the second-largest eigenvalue modulus)"
            if period == 1 else
            f"the product of the {period} rounds' matrices contracts the disagreement by {rate_text} per step "
            f"(spectral gap {gap_text})")
    raise ValueError(f"{name}: {what}: gossip x ← W x never reaches consensus. A connected W with an eigenvalue "
                     "−1 is periodic: a bipartite graph with zero self-weights (e.g. a ring of 4 where each rank "
                     "gives ½ to each neighbour and 0 to itself) swaps values between its halves for ever. Give "
                     "every rank a positive self-weight, e.g. the lazy matrix (I + W)/2, or build the weights with "
                     "weights='metropolis'")


def _spectral_gap(mats: Sequence[np.ndarray]) -> float:
    size = mats[0].shape[0]
    if size == 1:
        return 1.0
    if len(mats) == 1:
        ev = np.sort(np.abs(np.linalg.eigvalsh(mats[0])))[::-1]  # |λ|, largest (1) first
        return float(max(0.0, 1.0 - ev[1]))
    prod = np.eye(size)
    for w in mats:
        prod = w @ prod
    rate = float(np.linalg.norm(prod - np.full((size, size), 1.0 / size), 2))
    return float(max(0.0, 1.0 - rate ** (1.0 / len(mats))))


# ---- weights ----------------------------------------------------------------------------------
def _mixing_from_adjacency(adjacency: List[Sequence[int]], weights: str, name: str) -> np.ndarray:
    size = len(adjacency)
    deg = [len(a) for a in adjacency]
    w = np.zeros((size, size), dtype=np.float64)
    if weights == "metropolis":
        for i, nbrs in enumerate(adjacency):
            for j in nbrs:
                w[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
    elif weights == "uniform":
        if len(set(deg)) > 1:
            lo, hi = deg.index(min(deg)), deg.index(max(deg))
            raise ValueError(f"{name}: weights='uniform' (1/(degree+1)) is symmetric only on a regular graph, "
                             f"but rank {lo} has {deg[lo]} neighbours and rank {hi} has {deg[hi]}; "
                             "use weights='metropolis'")
        for i, nbrs in enumerate(adjacency):
            for j in nbrs:
                w[i, j] = 1.0 / (deg[i] + 1)
    else:
        raise ValueError(f"weights must be 'metropolis' or 'uniform', got {weights!r}")
    for i in range(size):
        w[i, i] = 1.0 - w[i].sum()
    return w


def _check_adjacency(adjacency: List[Sequence[int]], name: str) -> List[List[int]]:
    """Validate neighbour lists: integer ranks in range, none listed twice, symmetric; a rank that
    lists itself is dropped (the self-weight always comes from the diagonal). Returns sorted lists."""
    size = len(adjacency)
    if size < 1:
        raise ValueError(f"{name}: an adjacency needs at least one rank")
    out = []
    for i, nbrs in enumerate(adjacency):
        try:
            nbrs = list(nbrs)
        except TypeError:
            raise ValueError(f"{name}: rank {i}'s neighbours must be a list of ranks, got {nbrs!r}") from None
        seen = set()
        for j in nbrs:
            if isinstance(j, bool) or not isinstance(j, (int, np.integer)):
                raise ValueError(f"{name}: rank {i} lists {j!r}, not an integer rank")
            if not 0 <= j < size:
                raise ValueError(f"{name}: rank {i} lists rank {j}, outside 0..{size - 1}")
            if j in seen:
                raise ValueError(f"{name}: rank {i} lists rank {j} twice; list each neighbour once")
            seen.add(int(j))
        seen.discard(i)  # a self-loop: the diagonal weight covers it
        out.append(sorted(seen))
    for i, nbrs in enumerate(out):
        for j in nbrs:
            if i not in out[j]:
                raise ValueError(f"{name}: not symmetric: rank {i} lists rank {j} but rank {j} does not list "
                                 f"rank {i}; gossip edges are undirected: add {i} to rank {j}'s neighbours")
    return out


# ---- builders ---------------------------------------------------------------------------------
def from_adjacency(adjacency, weights: str = "metropolis", name: str = "adjacency") -> Topology:
    """A static topology from neighbour lists or an adjacency matrix.

    Args:
        adjacency: neighbour lists (a list, ``adjacency[i]`` = the ranks rank i exchanges with, or
            a dict ``{rank: [ranks]}`` with every rank as a key), or a square numpy 0/1 (bool) array
            (nonzero ``[i, j]``: an edge; the diagonal is ignored). A rank listing itself is
            accepted and ignored: its self-weight is the diagonal of W.
        weights: ``"metropolis"`` or ``"uniform"`` (see the module docstring).
        name: label of the topology.

    Raises:
        ValueError: a rank listed twice, a rank out of range, an asymmetric adjacency (i lists j,
            j does not list i), a disconnected graph, ``weights="uniform"`` on an irregular graph,
            a non-square or non-0/1 array, a dict missing ranks.
    """
    if isinstance(adjacency, np.ndarray):
        a = adjacency
        if a.ndim != 2 or a.shape[0] != a.shape[1]:
            raise ValueError(f"{name}: an adjacency matrix must be square, got shape {a.shape}")
        if not np.isin(a, (0, 1)).all():
            raise ValueError(f"{name}: an adjacency matrix holds 0/1 (or bool) entries; for weights use from_weights()")
        adjacency = [[int(j) for j in np.flatnonzero(a[i])] for i in range(a.shape[0])]
    elif isinstance(adjacency, dict):
        missing = sorted(set(range(len(adjacency))) - set(adjacency))
        if missing:
            raise ValueError(f"{name}: the adjacency dict must have every rank 0..{len(adjacency) - 1} as a key; "
                             f"missing {missing[:8]}")
        adjacency = [adjacency[i] for i in range(len(adjacency))]
    elif not isinstance(adjacency, (list, tuple)):
        raise ValueError(f"{name}: an adjacency is a list of neighbour lists, a dict or a numpy 0/1 array; "
                         f"got {type(adjacency).__name__}")
    nbrs = _check_adjacency(list(adjacency), name)
    _check_connected(nbrs, name)
    return Topology(name, [_mixing_from_adjacency(nbrs, weights, name)])


def from_weights(matrix, name: str = "weights") -> Topology:
    """A static topology from a given mixing matrix (``size × size``; symmetric, doubly
    stochastic, non-negative, connected).

    Raises:
        ValueError: as :class:`Topology`.
    """
    return Topology(name, [np.asarray(matrix, dtype=np.float64)])


def ring(size: int, weights: str = "metropolis") -> Topology:
    """Ring: rank i exchanges with i − 1 and i + 1 (mod size); one neighbour at 2 ranks, none at 1.

    Raises:
        ValueError: ``size < 1``.
    """
    size = _check_size(size)
    adj = [sorted({(i - 1) % size, (i + 1) % size} - {i}) for i in range(size)]
    return from_adjacency(adj, weights, name="ring")


def torus(size: int, shape: Optional[Tuple[int, int]] = None, weights: str = "metropolis") -> Topology:
    """2-D torus ``rows × cols`` (ranks row-major): rank (r, c) exchanges with (r ± 1, c) and
    (r, c ± 1) modulo the sides. ``shape`` defaults to the factorisation of ``size`` closest to a
    square (rows ≤ cols). A side of 2 gives one neighbour along it, a side of 1 none (a prime size
    is a ring).

    Raises:
        ValueError: ``size < 1``, or ``shape`` whose product is not ``size``.
    """
    size = _check_size(size)
    if shape is None:
        rows = max(d for d in range(1, int(math.isqrt(size)) + 1) if size % d == 0)
        shape = (rows, size // rows)
    sides = [as_number(s, integer=True) for s in shape]
    if len(sides) != 2 or None in sides:
        raise ValueError(f"torus shape must be two integers (rows, cols), got {shape!r}")
    rows, cols = sides
    if rows < 1 or cols < 1 or rows * cols != size:
        raise ValueError(f"torus shape {shape} must have rows * cols == {size} ranks")
    adj = []
    for i in range(size):
        r, c = divmod(i, cols)
        nb = {((r + 1) % rows) * cols + c, ((r - 1) % rows) * cols + c,
              r * cols + (c + 1) % cols, r * cols + (c - 1) % cols}
        adj.append(sorted(nb - {i}))
    return from_adjacency(adj, weights, name=f"torus {rows}x{cols}")


def exponential(size: int) -> Topology:
    """One-peer exponential graph (time-varying, symmetric form): at step t, rank i pairs with
    ``i XOR 2^(t mod log2 size)``, weights ½ and ½. Each round's graph is a perfect matching (not
    connected by itself); the union over the period of log2(size) rounds is the hypercube, and the
    product of one period's matrices is exactly the averaging matrix (spectral gap 1 per period).

    Raises:
        ValueError: ``size`` not a power of two (use ``ring`` or ``torus``).
    """
    size = _check_size(size)
    if size & (size - 1):
        raise ValueError(f"the one-peer exponential graph needs a power-of-two number of ranks, got {size}; "
                         "use topology='ring' or 'torus' (or a user adjacency)")
    if size == 1:
        return Topology("exponential", [np.ones((1, 1))])
    mats = []
    for k in range(size.bit_length() - 1):
        w = np.zeros((size, size))
        for i in range(size):
            w[i, i] = w[i, i ^ (1 << k)] = 0.5
        mats.append(w)
    return Topology("exponential", mats)


def complete(size: int) -> Topology:
    """Complete graph: every rank exchanges with every other, ``W = 1/size`` everywhere.

    Raises:
        ValueError: ``size < 1``.
    """
    size = _check_size(size)
    return Topology("complete", [np.full((size, size), 1.0 / size)])


def _check_size(size) -> int:
    """``size`` (a Python, numpy or 0-d tensor integer) as an int >= 1."""
    return check_count(size, "a topology's number of ranks (size)", 1)


#: names :func:`make_topology` accepts
TOPOLOGIES = ("ring", "torus", "exponential", "complete")


def make_topology(spec: Union[str, Topology, Sequence, np.ndarray], size: int,
                  weights: str = "metropolis") -> Topology:
    """The topology of ``size`` ranks that ``spec`` names.

    Args:
        spec: ``"ring"``, ``"torus"``, ``"torus:RxC"``, ``"exponential"``, ``"complete"``; a
            :class:`Topology` (returned after a size check); or an adjacency for
            :func:`from_adjacency` (neighbour lists or a 0/1 matrix).
        size: number of ranks (the process set's size).
        weights: ``"metropolis"`` or ``"uniform"`` for the static graphs (ignored by
            ``exponential`` and ``complete``, whose weights are fixed).

    Raises:
        ValueError: an unknown name, or a topology / adjacency of another size.
    """
    check_choice(weights, "weights", ("metropolis", "uniform"))
    if isinstance(spec, Topology):
        topo = spec
    elif isinstance(spec, str):
        name, _, arg = spec.strip().partition(":")
        if name == "ring" and not arg:
            topo = ring(size, weights)
        elif name == "torus":
            shape = None
            if arg:
                try:
                    shape = tuple(int(v) for v in arg.lower().split("x"))
                    assert len(shape) == 2
                except (ValueError, AssertionError):
                    raise ValueError(f"torus shape must be written ROWSxCOLS, e.g. 'torus:2x4', got {spec!r}") from None
            topo = torus(size, shape, weights)
        elif name == "exponential" and not arg:
            topo = exponential(size)
        elif name == "complete" and not arg:
            topo = complete(size)
        else:
            raise ValueError(f"unknown topology {spec!r}; use one of {', '.join(TOPOLOGIES)} "
                             "(torus:RxC for a given shape), or pass neighbour lists")
    else:
        topo = from_adjacency(spec, weights)
    if topo.size != size:
        raise ValueError(f"the topology {topo.name!r} has {topo.size} ranks but the job (process set) has "
                         f"{size}; build it for {size} ranks")
    return topo
