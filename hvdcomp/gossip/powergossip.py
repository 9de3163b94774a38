"""PowerGossip: rank-1 power iteration on each edge's model difference.

Vogels, Karimireddy and Jaggi, "Practical Low-Rank Communication Compression in Decentralized
Deep Learning", NeurIPS 2020.

For an edge (i, j) with i > j and a parameter seen as a matrix X (``shape[0] × rest``, in its
logical row-major order whatever its memory layout), let D = X_i − X_j. Both ends hold the same
vector v (drawn from a generator seeded by the edge) and run one *half* power iteration per
exchange, alternating sides:

* v on the right (n entries): each end sends a = X v̂ (v̂ = v/‖v‖); both compute u = a_i − a_j =
  D v̂ in the same order (bit-identical), take D ≈ u v̂ᵀ, and keep v ← u;
* v on the left (m entries): each end sends a = Xᵀ v̂; u = Dᵀ v̂, D ≈ v̂ uᵀ, v ← u.

Then ``X_i ← X_i − γ·w_ij·D̃`` and ``X_j ← X_j + γ·w_ij·D̃`` (γ = 1), which keeps the network
average. The vector is warm-started from the previous exchange. 1-D parameters are sent
uncompressed and averaged as in plain gossip. Works on time-varying graphs. Bytes: ``docs/gossip.md``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .base import GossipMethod, Payload, check_consensus_step
from ..checks import check_bool, check_count, check_seed
from .topology import Topology

__all__ = ["PowerGossip", "edge_seed"]


def edge_seed(seed: int, i: int, j: int) -> int:
    """The seed of edge {i, j}'s generator: the same at both ends, different for every edge."""
    lo, hi = min(i, j), max(i, j)
    return (int(seed) * 1_000_003 + lo * 65_537 + hi + 1) & ((1 << 63) - 1)


class _Edge:
    """State of one edge at one end: the warm vectors (one per matrix), the half iterations done
    (which side the vectors are on), the edge's generator."""

    __slots__ = ("vectors", "halves", "generator")

    def __init__(self, seed: int):
        self.vectors: List[torch.Tensor] = []
        self.halves = 0
        self.generator = torch.Generator().manual_seed(seed)


class PowerGossip(GossipMethod):
    """One rank of PowerGossip (see the module docstring).

    Args:
        params, names, topology, rank: see :class:`hvdcomp.gossip.base.GossipMethod` (static or
            time-varying topology).
        compression: must be None or ``"none"``: the power iteration is the compression.
        consensus_step: γ ∈ (0, 1], the share of the estimated difference each end moves
            (default 1, the paper's value: no hyper-parameter to tune).
        power_iterations: half iterations (exchanges) per step (1, as the authors; 2 gives one full
            power iteration per step at twice the messages).
        warm_start: start each half iteration from the previous result (True, the paper) or from a
            fresh draw of the edge's generator.
        seed: base seed of the edge generators (the same on every rank).

    State (per rank): per neighbour ever used, the vectors, the count of half iterations and the
    generator state; ``steps``; the moves absorbed but not yet applied (``staged``: per edge and
    matrix u and v̂, per 1-D parameter the difference, with their step sizes).

    Raises:
        ValueError: a compressor given, γ outside (0, 1], ``power_iterations`` not an integer
            >= 1, ``seed`` not an integer (numpy and 0-d tensor numbers are accepted).
    """

    name = "powergossip"
    supports_time_varying = True

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], topology: Topology, rank: int,
                 compression=None, consensus_step: Optional[float] = None, power_iterations: int = 1,
                 warm_start: bool = True, seed: int = 0):
        super().__init__(params, names, topology, rank)
        if compression not in (None, "none") and getattr(compression, "name", None) != "none":
            raise ValueError("PowerGossip compresses each edge's model difference by its own rank-1 power iteration; "
                             f"leave the compressor at 'none' (got {compression!r})")
        self.gamma = check_consensus_step(1.0 if consensus_step is None else consensus_step, "PowerGossip")
        self.rounds = check_count(power_iterations, "power_iterations", 1)
        self.warm_start = check_bool(warm_start, "warm_start")
        self.seed = check_seed(seed)
        self.matrices = [k for k, p in enumerate(params) if p.dim() >= 2]
        self.vectors = [k for k, p in enumerate(params) if p.dim() < 2]
        self.shapes = [(p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 else None for p in params]
        self.edges: Dict[int, _Edge] = {}
        self._pending: Optional[dict] = None
        self._staged: List[dict] = []  # absorbed, not yet applied (see apply)

    def describe(self):
        return {"method": self.name, "consensus_step": self.gamma, "power_iterations": self.rounds,
                "warm_start": self.warm_start, "seed": self.seed}

    # ---- the shared vectors -------------------------------------------------------------------
    def _edge(self, j: int, like: Sequence[torch.Tensor]) -> _Edge:
        edge = self.edges.get(j)
        if edge is None:
            edge = self.edges[j] = _Edge(edge_seed(self.seed, self.rank, j))
            edge.vectors = [self._draw(edge, self.shapes[k][1], like[k]) for k in self.matrices]
        return edge

    @staticmethod
    def _draw(edge: _Edge, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(n, generator=edge.generator, dtype=like.dtype).to(like.device)

    def edge_vectors(self, j: int) -> List[torch.Tensor]:
        """The current vectors of the edge to neighbour ``j`` (one per matrix parameter; empty before
        the edge's first exchange): equal, bit for bit, at both ends."""
        edge = self.edges.get(j)
        return [] if edge is None else list(edge.vectors)

    def _unit(self, edge: _Edge, v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """v/‖v‖; a zero (or non-finite) vector is redrawn from the edge's generator (both ends
        hold the same v, so both redraw alike)."""
        norm = torch.linalg.vector_norm(v)
        if not bool(torch.isfinite(norm)) or float(norm) == 0.0:
            v = self._draw(edge, v.numel(), like)
            norm = torch.linalg.vector_norm(v)
        return v / norm

    # ---- protocol ---------------------------------------------------------------------------
    @torch.no_grad()
    def outgoing(self, params, previous=None, round=0) -> Dict[int, Payload]:
        """Per neighbour: X v̂ or Xᵀ v̂ of every matrix, then (round 0) the 1-D parameters."""
        out, units = {}, {}
        for j in self.peers():
            edge = self._edge(j, params)
            right = edge.halves % 2 == 0  # the vectors are on the right: send X v̂
            msg, unit_vectors = [], []
            for v_index, k in enumerate(self.matrices):
                m, n = self.shapes[k]
                x = params[k].detach().reshape(m, n)
                v = edge.vectors[v_index]
                if not self.warm_start:
                    v = self._draw(edge, n if right else m, params[k])
                u = self._unit(edge, v, params[k])
                unit_vectors.append(u)
                msg.append(torch.mv(x, u) if right else torch.mv(x.t(), u))
            if round == 0:
                msg.extend(params[k].detach().reshape(-1).clone() for k in self.vectors)
            out[j], units[j] = msg, (right, unit_vectors)
        self._pending = {"units": units, "own": out, "round": round}
        return out

    @torch.no_grad()
    def absorb(self, params, received: Dict[int, Payload], round=0) -> None:
        """Per neighbour: u = a_hi − a_lo; keep v ← u; stage the move by ∓γ·w·(u v̂ᵀ or v̂ uᵀ) and
        the 1-D parameters' step toward the neighbour's (:meth:`apply`)."""
        pending, self._pending = self._pending, None
        if pending is None or pending["round"] != round:
            raise RuntimeError("PowerGossip.incoming without the matching outgoing")
        n_mat = len(self.matrices)
        staged = []
        for j in self.peers():
            edge = self.edges[j]
            right, unit_vectors = pending["units"][j]
            own, theirs = pending["own"][j], received[j]
            expected = n_mat + (len(self.vectors) if round == 0 else 0)
            if len(theirs) != expected:
                raise ValueError(f"PowerGossip: rank {j} sent {len(theirs)} tensors, expected {expected}: the ranks "
                                 "run different models")
            higher = self.rank > j
            step = self.gamma * self.weight(j)
            for v_index, k in enumerate(self.matrices):
                a_own, a_their = own[v_index], theirs[v_index].to(own[v_index].device, own[v_index].dtype)
                u = a_own - a_their if higher else a_their - a_own  # D v̂ (or Dᵀ v̂), D = X_hi − X_lo
                staged.append({"k": k, "u": u, "v": unit_vectors[v_index], "right": right,
                               "alpha": -step if higher else step})
                edge.vectors[v_index] = u
            if round == 0:
                for v_index, k in enumerate(self.vectors):
                    mine = own[n_mat + v_index]
                    other = theirs[n_mat + v_index].to(mine.device, mine.dtype)
                    staged.append({"k": k, "diff": other - mine, "alpha": step})
            edge.halves += 1
        self._staged = staged
        if round == self.rounds - 1:
            self.steps += 1

    @torch.no_grad()
    def apply(self, params) -> None:
        """Add the staged moves: ``X ← X ∓ γ·w·(u v̂ᵀ or v̂ uᵀ)`` per edge and matrix (the estimate
        in the parameter's logical shape, so any memory layout, e.g. ``channels_last``, takes it
        element by element), ``x ← x + γ·w·(x_j − x)`` for the 1-D parameters."""
        staged, self._staged = self._staged, []
        for term in staged:
            p = params[term["k"]]
            if "diff" in term:
                update = term["diff"]
            else:
                u, v_hat = term["u"], term["v"]
                update = torch.outer(u, v_hat) if term["right"] else torch.outer(v_hat, u)
            p.add_(update.view(p.shape), alpha=term["alpha"])

    # ---- per-rank state ---------------------------------------------------------------------
    def state_dict(self):
        return {"steps": self.steps,
                "edges": {int(j): {"vectors": [v.clone() for v in e.vectors], "halves": e.halves,
                                   "generator": e.generator.get_state()} for j, e in self.edges.items()},
                "staged": [{key: (val.clone() if torch.is_tensor(val) else val) for key, val in term.items()}
                           for term in self._staged]}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])
        self._staged = [dict(term) for term in state.get("staged", [])]
        self.edges = {}
        for j, rec in state["edges"].items():
            edge = _Edge(edge_seed(self.seed, self.rank, int(j)))
            edge.vectors = [v.clone() for v in rec["vectors"]]
            edge.halves = int(rec["halves"])
            edge.generator.set_state(rec["generator"])
            self.edges[int(j)] = edge
