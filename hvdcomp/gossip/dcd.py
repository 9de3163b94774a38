"""DCD-PSGD and ECD-PSGD: decentralized SGD with difference or extrapolation compression.

Tang, Gan, Zhang, Zhang and Liu, "Communication Compression for Decentralized Training",
NeurIPS 2018 (Algorithms 1 and 2). Both need an *unbiased* compressor (E[C(v)] = v: ``none``,
``qsgd``, ``terngrad:clip_sigmas=0``); neither has a consensus step size. Both keep the weighted
sum ``s_i = Σ_j w_ij y_j`` of the replicas y_j (self included), started exactly by one
uncompressed exchange of the initial models (:meth:`DCDGossip.setup`). With Δ_i = x_i^{after} − x_i
(the local optimizer step)::

    DCD:  z_i = (s_i − x_i) + Δ_i;  x_i ← x_i + C(z_i);  s_i ← s_i + Σ_j w_ij C(z_j)
    ECD:  x_i ← s_i + Δ_i;  z_i = (1 − t/2)·x_i^{old} + (t/2)·x_i;
          s_i ← (1 − 2/t)·s_i + (2/t)·Σ_j w_ij C(z_j)        (t = 1, 2, ... the step)

The next gradient is taken at x_i, known locally, so overlapping the exchange with the next
forward and backward changes nothing. How each behaves with coarse compressors:
``docs/gossip.md`` ("Tuning γ").
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .base import (EncodedModel, GossipMethod, Payload, compressor_kind, decode_scales, gossip_compressor,
                   is_unbiased)
from .topology import Topology

__all__ = ["DCDGossip", "ECDGossip"]


class _Replicas(GossipMethod):
    """Shared by DCD-PSGD and ECD-PSGD: the unbiased compressor, ``s``, the exact set-up."""

    needs_previous = True
    needs_setup = True
    paper = "Tang et al., NeurIPS 2018"

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], topology: Topology, rank: int,
                 compression="none", consensus_step: Optional[float] = None):
        super().__init__(params, names, topology, rank)
        if consensus_step is not None:
            raise ValueError(f"{self.title} has no consensus step size; leave consensus_step unset "
                             "(it is Choco-SGD's γ)")
        self.compressor = gossip_compressor(compression)
        bound = compressor_kind(self.compressor)
        if not is_unbiased(bound):
            name = self.compressor.name
            raise ValueError(f"{self.title} ({self.paper}) needs an unbiased compressor (E[C(v)] = v), but '{name}' "
                             f"is biased ({bound.statement}): use qsgd, terngrad:clip_sigmas=0 or none, or "
                             "method='choco', which converges with biased compressors")
        self.scales = decode_scales(self.compressor, params, rescale_unbiased=False)
        self.s: Optional[List[torch.Tensor]] = None
        self._sent: Optional[EncodedModel] = None

    def describe(self):
        return {"method": self.name, "compression": self.compressor.describe()}

    def _send(self, params, previous, message, absorb) -> Payload:
        """The outgoing loop both methods share: per tensor k, ``z = message(k, p, x)`` is encoded,
        then ``absorb(k, p, x, C(z))`` updates ``p`` and ``s`` with the decoded value; returns the
        payload (kept for :meth:`incoming`)."""
        self._require_setup()
        if previous is None:
            raise ValueError(f"{self.title} needs the parameters from before the local step (previous)")
        sent = EncodedModel(self.compressor, self.scales)
        for k, (name, p, x) in enumerate(zip(self.names, params, previous)):
            sent.add(message(k, p, x), name)
            absorb(k, p, x, sent.decode(sent.last(), k, p))
        self._sent = sent
        return sent.payload

    @torch.no_grad()
    def setup(self, params, received: Dict[int, Payload]) -> None:
        """``s_i = Σ_j w_ij x_j`` from the exact initial models (j = i and the neighbours)."""
        peers = self.topology.all_neighbors(self.rank)
        missing = [j for j in peers if j not in received]
        if missing:
            raise ValueError(f"{self.title} set-up: no initial model from neighbour rank(s) {missing}")
        s = []
        for k, p in enumerate(params):
            acc = p.detach().clone().mul_(self.topology.weight(self.rank, self.rank))
            for j in peers:
                acc.add_(received[j][k].to(p.device, p.dtype).view(p.shape), alpha=self.topology.weight(self.rank, j))
            s.append(acc)
        self.s = s

    def _require_setup(self):
        if self.s is None:
            raise RuntimeError(f"{self.title}: call setup() with the neighbours' initial models before the first step")

    @torch.no_grad()
    def absorb(self, params, received: Dict[int, Payload], round=0) -> None:
        """``s_i += c·Σ_{j≠i} w_ij C(z_j)`` (c = 1 for DCD, 2/t for ECD); ends the step. The
        parameters were updated in :meth:`outgoing`: nothing is staged for :meth:`apply`."""
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError(f"{self.title}.incoming without a preceding outgoing")
        c = self._neighbour_factor()
        for j in self.peers():
            pieces = sent.pieces(received[j])
            w = self.weight(j) * c
            for k, p in enumerate(params):
                self.s[k].add_(sent.decode(pieces[k], k, p), alpha=w)
        self.steps += 1

    def state_dict(self):
        self._require_setup()
        return {"steps": self.steps, "s": [t.clone() for t in self.s], "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state):
        self.s = [t.clone() for t in state["s"]]
        self.compressor.load_state_dict(state["compressor"])
        self.steps = int(state["steps"])


class DCDGossip(_Replicas):
    """One rank of DCD-PSGD (see the module docstring).

    Args:
        params, names, topology, rank: see :class:`hvdcomp.gossip.base.GossipMethod` (static
            topology).
        compression: an unbiased compressor spec or instance (``none``, ``qsgd``, ...).
        consensus_step: must stay None (DCD and ECD have none).

    State (per rank): ``s`` (tensors shaped like the parameters), the compressor's, ``steps``.

    Raises:
        ValueError: a biased compressor, a consensus step, a time-varying topology.
    """

    name = "dcd"
    title = "DCD-PSGD"

    def _neighbour_factor(self) -> float:
        return 1.0

    @torch.no_grad()
    def outgoing(self, params, previous, round=0) -> Payload:
        """``z = (s − x) + Δ``; ``x ← x + C(z)``; ``s += w_ii C(z)``; returns C(z)'s payload."""
        w_self = self.weight(self.rank)

        def message(k, p, x):
            return (self.s[k] - x).add_(p.detach() - x)

        def absorb(k, p, x, d):
            p.copy_(x + d)
            self.s[k].add_(d, alpha=w_self)

        return self._send(params, previous, message, absorb)


class ECDGossip(_Replicas):
    """One rank of ECD-PSGD (see the module docstring); arguments, state and errors as
    :class:`DCDGossip`'s."""

    name = "ecd"
    title = "ECD-PSGD"

    def _neighbour_factor(self) -> float:
        return 2.0 / (self.steps + 1)

    @torch.no_grad()
    def outgoing(self, params, previous, round=0) -> Payload:
        """``x ← s + Δ``; ``z = (1 − t/2)·x_old + (t/2)·x``; ``s ← (1 − 2/t)·s + (2/t)·w_ii C(z)``."""
        t = self.steps + 1
        w_self = self.weight(self.rank)

        def message(k, p, x):
            new = self.s[k] + (p.detach() - x)
            p.copy_(new)
            return (x * (1.0 - t / 2.0)).add_(new, alpha=t / 2.0)

        def absorb(k, p, x, d):
            self.s[k].mul_(1.0 - 2.0 / t).add_(d, alpha=w_self * 2.0 / t)

        return self._send(params, previous, message, absorb)
