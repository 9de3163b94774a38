"""What the gossip methods share: which compressors each may use, and the per-rank method interface.

Compressors in gossip compress *model differences*, and the methods keep their own memory of what
was sent (public copies, replicas), so error feedback is never added (``ef=true`` is refused).
Which compressor a method accepts follows from the bound the compressor states
(:attr:`hvdcomp.Compressor.error_bound`; :func:`compressor_kind`): Choco-SGD needs a contraction
or an unbiased one (rescaled by 1/(1 + ω)), DCD-PSGD and ECD-PSGD an unbiased one; step-wide
methods are refused. ``docs/gossip.md`` lists the bounds.

Each method is a :class:`GossipMethod`: the state of *one rank*, with no communication of its
own; :class:`hvdcomp.gossip.GossipOptimizer` moves the payloads with
:class:`hvdcomp.transports.neighbor.NeighborTransport`, and a test can move them between simulated
ranks in one process.
"""
from __future__ import annotations

import abc
import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..compressors.base import Compressor, ErrorBound
from ..memory import ErrorFeedback
from ..spec import get_compressor, parse_spec
from ..checks import check_range
from .topology import Topology

__all__ = ["compressor_kind", "is_unbiased", "gossip_compressor", "GossipMethod", "Payload", "Outgoing",
           "check_consensus_step"]

Payload = List[torch.Tensor]
#: what :meth:`GossipMethod.outgoing` returns: one payload for every neighbour, or one per neighbour
Outgoing = Union[Payload, Dict[int, Payload]]

#: short names accepted in place of registered ones
ALIASES = {"sign": "efsignsgd"}


def compressor_kind(comp) -> ErrorBound:
    """What ``comp`` guarantees, as gossip uses it: its :attr:`~hvdcomp.Compressor.error_bound`
    (kind ``"exact"``, ``"unbiased"`` with ``omega`` or ``"contraction"``).

    Raises:
        ValueError: a method without a bound (the message gives its reason and what to use), a
            step-wide method, a compressor wrapped in error feedback.
    """
    if isinstance(comp, ErrorFeedback):
        raise ValueError(f"'{comp.name}' is wrapped in error feedback; gossip's public copies already keep what "
                         "compression drops: build it with ef=false (or pass the spec string)")
    if not isinstance(comp, Compressor):
        raise ValueError(f"'{getattr(comp, 'name', comp)}' reduces a whole step with its own collectives, and gossip "
                         "sends each tensor to the neighbours: use a per-tensor compressor (topk, sign, qsgd), or "
                         "method='powergossip' for low-rank gossip")
    bound = comp.error_bound
    if bound.kind not in ("exact", "unbiased", "contraction"):
        raise ValueError(f"'{comp.name}' cannot be used for gossip: {bound.statement}")
    return bound


def is_unbiased(bound: ErrorBound) -> bool:
    """Whether E[C(v)] = v (exact or unbiased)."""
    return bound.kind in ("exact", "unbiased")


def gossip_compressor(spec: Union[str, Compressor, None]) -> Compressor:
    """The compressor a gossip method uses, from a spec string (``"topk:density=0.01"``, ``"sign"``)
    or an instance; ``None`` means ``"none"``. Error feedback is left off.

    Raises:
        ValueError: ``ef=true`` in the spec, a bad spec, or a compressor :func:`compressor_kind` refuses.
    """
    if spec is None:
        spec = "none"
    if isinstance(spec, str):
        name, kwargs = parse_spec(spec)
        name = ALIASES.get(name, name)
        if kwargs.pop("ef", False):
            raise ValueError(f"'{spec}': gossip methods keep public copies of what was sent, which does the "
                             "job of error feedback; drop ef=true")
        comp = get_compressor(name, ef=False, **kwargs)
    elif isinstance(spec, Compressor):
        comp = spec
    else:
        raise ValueError(f"compression must be a spec string like 'topk:density=0.01' or an hvdcomp.Compressor, "
                         f"got {spec!r}")
    compressor_kind(comp)
    return comp


def check_consensus_step(gamma, method: str) -> float:
    """``gamma`` (a Python, numpy or 0-d tensor number: :func:`hvdcomp.checks.as_number`) as a
    float in (0, 1].

    Raises:
        ValueError: not a finite number in (0, 1].
    """
    return check_range(gamma, f"{method}: the consensus step size γ (consensus_step)", 0.0, 1.0, low_open=True,
                       hint=" (starting points: docs/gossip.md, 'Tuning γ')")


class GossipMethod(abc.ABC):
    """One rank's state in a decentralized method; communication is the caller's.

    The caller runs, once per optimizer step, after the local optimizer step::

        for r in range(method.rounds):
            out = method.outgoing(params, previous, r)    # payload(s) for method.peers()
            method.incoming(params, {peer: payload received from peer}, r)

    (with overlap, the last round's ``incoming`` may come just before the next step's first
    ``outgoing``; ``incoming`` is :meth:`absorb` then :meth:`apply`, which a caller may separate:
    a checkpoint in between holds the staged update). A neighbour's payload has the dtypes and tensor count of the payload sent to it.
    Methods with :attr:`needs_setup` first exchange :meth:`setup_payload` once (exactly) and call
    :meth:`setup` with what the neighbours sent.

    Args:
        params: the model's parameters (any shapes, one floating dtype per tensor), in the same
            order on every rank; the method updates them in place.
        names: their names (state and compressor state are keyed by them).
        topology: the graph (``topology.size`` ranks).
        rank: this rank's index in the topology.

    Attributes:
        steps: gossip steps completed (chooses the round of a time-varying topology; saved).
        rounds: exchanges per step.
        needs_previous: ``outgoing`` needs ``previous``, the parameters before the local step.
        needs_setup: an exact exchange of the initial models is needed before the first step.
        supports_time_varying: the method works on a time-varying topology.

    Raises:
        ValueError: names and params of different lengths, a non-floating parameter, a
            time-varying topology for a method that needs a fixed one, a rank outside the topology.
    """

    name = "abstract"
    rounds = 1
    needs_previous = False
    needs_setup = False
    supports_time_varying = False

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], topology: Topology, rank: int):
        params = list(params)
        names = list(names)
        if len(params) != len(names):
            raise ValueError(f"{len(params)} parameters but {len(names)} names")
        for n, p in zip(names, params):
            if not p.is_floating_point():
                raise ValueError(f"parameter '{n}' is {p.dtype}; gossip averages floating-point parameters only")
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a hvdcomp.gossip.topology.Topology, got {topology!r}")
        if not 0 <= rank < topology.size:
            raise ValueError(f"rank {rank} is outside the {topology.size}-rank topology")
        if topology.time_varying and not self.supports_time_varying:
            raise ValueError(f"{self.name} keeps copies of a fixed set of neighbours' models, so it needs a static "
                             f"topology; '{topology.name}' changes every step: use ring, torus, complete or an "
                             "adjacency, or method='powergossip'")
        self.names = names
        self.topology = topology
        self.rank = int(rank)
        self.steps = 0

    # ---- the graph at this step --------------------------------------------------------------
    def peers(self) -> Tuple[int, ...]:
        """The neighbours of this rank at the current step (ascending)."""
        return self.topology.neighbors(self.rank, self.steps)

    def weight(self, j: int) -> float:
        """The mixing weight ``W[rank, j]`` at the current step."""
        return self.topology.weight(self.rank, j, self.steps)

    # ---- protocol ---------------------------------------------------------------------------
    def setup_payload(self, params: Sequence[torch.Tensor]) -> Payload:
        """The exact initial models for :meth:`setup` (1-D copies of the parameters)."""
        return [p.detach().reshape(-1).clone() for p in params]

    def setup(self, params: Sequence[torch.Tensor], received: Dict[int, Payload]) -> None:
        """Initialise from the neighbours' exact initial models (only where :attr:`needs_setup`)."""

    @abc.abstractmethod
    def outgoing(self, params: Sequence[torch.Tensor], previous: Optional[Sequence[torch.Tensor]],
                 round: int = 0) -> Outgoing:
        """Compute what this rank sends at this step's ``round`` (may update ``params``)."""

    def incoming(self, params: Sequence[torch.Tensor], received: Dict[int, Payload], round: int = 0) -> None:
        """Take in what the neighbours sent in ``round`` and apply it: :meth:`absorb` then
        :meth:`apply`. The last round ends the step (:attr:`steps` + 1)."""
        self.absorb(params, received, round)
        self.apply(params)

    @abc.abstractmethod
    def absorb(self, params: Sequence[torch.Tensor], received: Dict[int, Payload], round: int = 0) -> None:
        """The first half of :meth:`incoming`: what the neighbours sent in ``round`` goes into the
        method's state (public copies, replicas, edge vectors) and the parameters' update is
        *staged* (kept in the state, :meth:`state_dict` included) for :meth:`apply`; ``params``
        are read for their shapes, dtypes and devices only. The last round ends the step.

        Between the two halves nothing the method holds changes and the parameters may change
        (the next local optimizer step, with overlap), so a checkpoint taken between them (the
        exchange in flight absorbed, its update not yet applied) resumes on the same trajectory
        as a run that never saved."""

    def apply(self, params: Sequence[torch.Tensor]) -> None:
        """The second half of :meth:`incoming`: add the staged update to ``params`` (in place, the
        additions in the order :meth:`incoming` makes them, so the result is the same bit for
        bit); nothing when none is staged. Methods whose exchange updates only their own state
        (DCD-PSGD, ECD-PSGD) stage nothing."""

    def describe(self) -> Dict[str, Any]:
        """JSON-able hyper-parameters (the consistency check compares them across ranks)."""
        return {"method": self.name}

    # ---- per-rank state ---------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state (tensors and numbers): restore it on the same rank."""
        return {"steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (from the same rank)."""
        self.steps = int(state["steps"])


class EncodedModel:
    """One rank's compressed tensors of a step: the payload that travels (all tensors' payloads
    end to end), and what is kept locally to decode it and the neighbours' payloads.

    Args:
        compressor: the method's compressor.
        scales: per tensor, the factor applied after decoding (Choco-SGD's 1/(1 + ω) for an
            unbiased compressor; 1 otherwise).
    """

    def __init__(self, compressor: Compressor, scales: Sequence[float]):
        self.compressor, self.scales = compressor, list(scales)
        self.payload: Payload = []
        self.ctxs: List[Any] = []
        self.lengths: List[int] = []

    def add(self, tensor: torch.Tensor, name: str) -> None:
        """Compress the next tensor (in parameter order) and append its payload."""
        q, ctx = self.compressor.encode(tensor, name)
        self.payload.extend(t.reshape(-1) for t in q)
        self.ctxs.append(ctx)
        self.lengths.append(len(q))

    def last(self) -> List[torch.Tensor]:
        """The payload of the tensor added last."""
        return self.payload[len(self.payload) - self.lengths[-1]:]

    def pieces(self, flat: Optional[Sequence[torch.Tensor]] = None) -> List[List[torch.Tensor]]:
        """``flat`` (a neighbour's payload; this rank's own when None) cut per tensor.

        Raises:
            ValueError: a payload of another number of tensors (the ranks run different models).
        """
        flat = self.payload if flat is None else flat
        if len(flat) != sum(self.lengths):
            raise ValueError(f"a neighbour's payload has {len(flat)} tensors, this rank expected "
                             f"{sum(self.lengths)}: the ranks run different models or compressors")
        ends = list(itertools.accumulate(self.lengths))
        return [list(flat[e - n:e]) for n, e in zip(self.lengths, ends)]

    def decode(self, piece: Sequence[torch.Tensor], k: int, like: torch.Tensor) -> torch.Tensor:
        """Tensor ``k``'s dense value from its payload ``piece``: shape, dtype and device of
        ``like``, times ``scales[k]``."""
        piece = [t.to(like.device) for t in piece]
        out = self.compressor.decode(piece, self.ctxs[k]).reshape(like.shape).to(like.dtype)
        if self.scales[k] != 1.0:
            out = out.mul_(self.scales[k])
        return out


def decode_scales(compressor: Compressor, params: Sequence[torch.Tensor], rescale_unbiased: bool) -> List[float]:
    """Per tensor: ``1/(1 + ω(numel))`` for an unbiased compressor when ``rescale_unbiased`` (a
    contraction, as Choco-SGD needs), else 1."""
    kind = compressor_kind(compressor)
    if kind.kind == "unbiased" and rescale_unbiased:
        return [1.0 / (1.0 + kind.omega(p.numel())) for p in params]
    return [1.0] * len(params)
