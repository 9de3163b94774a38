"""Choco-SGD: compressed gossip with public copies.

Koloskova, Stich and Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms with
Compressed Communication", ICML 2019; Koloskova, Lin, Stich and Jaggi, "Decentralized Deep
Learning with Arbitrary Communication Compression", ICLR 2020.

Every rank i keeps its model x_i and a *public copy* x̂_i that its neighbours also hold. Per step,
after the local optimizer step::

    q_i  = C(x_i − x̂_i)                            (sent to every neighbour)
    x̂_j ← x̂_j + q_j          for j = i and every neighbour j
    x_i  ← x_i + γ Σ_j w_ij (x̂_j − x̂_i)             (the consensus step, γ ∈ (0, 1])

Only ``s_i = Σ_j w_ij x̂_j`` (self included) is stored (Algorithm 2 of the ICLR paper), so the
consensus step is ``x_i ← x_i + γ (s_i − x̂_i)``; x̂_i and s_i start at zero. Any contraction
compressor works; an unbiased one (QSGD) is rescaled by 1/(1 + ω). With ``none`` and γ = 1 it is
plain gossip (D-PSGD). Choosing γ: ``docs/gossip.md`` ("Tuning γ").
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .base import (EncodedModel, GossipMethod, Payload, check_consensus_step, decode_scales,
                   gossip_compressor)
from .topology import Topology

__all__ = ["ChocoGossip"]


class ChocoGossip(GossipMethod):
    """One rank of Choco-SGD's gossip (see the module docstring).

    Args:
        params, names, topology, rank: see :class:`hvdcomp.gossip.base.GossipMethod` (a static
            topology: the copies belong to a fixed set of neighbours).
        compression: a spec (``"sign"``, ``"topk:density=0.01"``, ``"qsgd"``, ...) or a
            compressor; see :func:`hvdcomp.gossip.base.compressor_kind` for what is allowed.
        consensus_step: γ ∈ (0, 1]; required unless ``compression`` is ``none`` (then 1).

    State (:meth:`state_dict`, per rank): ``x_hat`` and ``s`` (lists of tensors shaped like the
    parameters), the compressor's own state (e.g. QSGD's generator), ``steps``, and
    ``mix_pending`` (an exchange absorbed whose consensus step is not applied yet: it is
    ``γ (s − x̂)`` of the saved s and x̂, so nothing more is stored).

    Raises:
        ValueError: a refused compressor, γ missing or outside (0, 1], a time-varying topology.
    """

    name = "choco"

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], topology: Topology, rank: int,
                 compression="none", consensus_step: Optional[float] = None):
        super().__init__(params, names, topology, rank)
        self.compressor = gossip_compressor(compression)
        if consensus_step is None:
            if not self.compressor.payload_is_gradient:  # (identity: "none")
                raise ValueError(f"Choco-SGD with '{self.compressor.name}' needs consensus_step (γ in (0, 1]), e.g. "
                                 "0.45 for sign or 0.04 for top-k 1 % on a ring of 8 (docs/gossip.md)")
            consensus_step = 1.0
        self.gamma = check_consensus_step(consensus_step, "Choco-SGD")
        self.scales = decode_scales(self.compressor, params, rescale_unbiased=True)
        self.x_hat = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
        self.s = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
        self._sent: Optional[EncodedModel] = None
        self._mix_pending = False  # absorbed, not yet applied: the consensus step (see apply)

    def describe(self):
        return {"method": self.name, "consensus_step": self.gamma, "compression": self.compressor.describe()}

    @torch.no_grad()
    def outgoing(self, params, previous=None, round=0) -> Payload:
        """``q_i = C(x_i − x̂_i)`` of every parameter, end to end (the same for every neighbour)."""
        sent = EncodedModel(self.compressor, self.scales)
        for name, p, xh in zip(self.names, params, self.x_hat):
            sent.add(p.detach() - xh, name)
        self._sent = sent
        return sent.payload

    @torch.no_grad()
    def absorb(self, params, received: Dict[int, Payload], round=0) -> None:
        """Add the decoded q's to x̂_i and s_i; stages the consensus step (:meth:`apply`)."""
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("ChocoGossip.incoming without a preceding outgoing")
        peers = self.peers()
        own = sent.pieces()
        theirs = {j: sent.pieces(received[j]) for j in peers}
        w_self = self.weight(self.rank)
        weights = {j: self.weight(j) for j in peers}
        for k, p in enumerate(params):
            d = sent.decode(own[k], k, p)
            self.x_hat[k].add_(d)
            self.s[k].add_(d, alpha=w_self)
            for j in peers:
                self.s[k].add_(sent.decode(theirs[j][k], k, p), alpha=weights[j])
        self._mix_pending = True
        self.steps += 1

    @torch.no_grad()
    def apply(self, params) -> None:
        """The consensus step ``x_i += γ (s_i − x̂_i)`` (s_i and x̂_i as :meth:`absorb` left them)."""
        if not self._mix_pending:
            return
        for p, s, xh in zip(params, self.s, self.x_hat):
            p.add_(s - xh, alpha=self.gamma)
        self._mix_pending = False

    def state_dict(self):
        return {"steps": self.steps, "x_hat": [t.clone() for t in self.x_hat], "s": [t.clone() for t in self.s],
                "compressor": self.compressor.state_dict(), "mix_pending": self._mix_pending}

    def load_state_dict(self, state):
        if len(state["x_hat"]) != len(self.x_hat):
            raise ValueError(f"Choco state for {len(state['x_hat'])} tensors, this model has {len(self.x_hat)}")
        for dst, src in zip(self.x_hat + self.s, list(state["x_hat"]) + list(state["s"])):
            dst.copy_(src)
        self.compressor.load_state_dict(state["compressor"])
        self.steps = int(state["steps"])
        self._mix_pending = bool(state.get("mix_pending", False))
