"""``GossipOptimizer``: decentralized training, in place of ``hvdcomp.DistributedOptimizer``.

Gradients are not averaged. Each step, the wrapped optimizer takes its *local* step, then the
gossip method mixes the model with the neighbours' through the neighbour transport. With
``overlap=True`` (default) the exchange started at the end of a step completes in the background
and is applied at the next ``step()`` (exact for DCD/ECD, the authors' "parallel" form for
Choco-SGD and PowerGossip). Non-finite gradients, checkpoints and which model to evaluate:
``docs/gossip.md``.

Example::

    from mpi4py import MPI            # first: MPI_THREAD_MULTIPLE for the background thread
    import torch, horovod.torch as hvd
    import hvdcomp.gossip

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvdcomp.gossip.GossipOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
        named_parameters=model.named_parameters(), method="choco", topology="ring",
        compression="sign", consensus_step=0.45)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    with opt.average_model():
        evaluate(model)
"""
from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional

import torch

from ..agreement import NonFiniteGuard, check_consistency
from ..metrics import PhaseTimer
from ..step import LocalOptimizerSurface
from ..transports.neighbor import NeighborTransport, neighbor_edges
from ..comm import resolve_group
from ..comm.group import FollowsWorld, instance_prefix
from .base import GossipMethod
from .choco import ChocoGossip
from .dcd import DCDGossip, ECDGossip
from .powergossip import PowerGossip
from ..checks import check_bool, check_range
from ..config import name_parameters
from .topology import make_topology

__all__ = ["GossipOptimizer", "METHODS", "make_method"]

#: ``method=`` names
METHODS = {"choco": ChocoGossip, "dcd": DCDGossip, "ecd": ECDGossip, "powergossip": PowerGossip}


def make_method(method: str, params, names, topology, rank, compression=None, consensus_step=None,
                **kwargs) -> GossipMethod:
    """The :class:`~hvdcomp.gossip.base.GossipMethod` of one rank for ``method`` (a key of
    :data:`METHODS`); ``kwargs`` go to its constructor (PowerGossip: ``power_iterations``,
    ``warm_start``, ``seed``).

    Raises:
        ValueError: unknown method, or what the method's constructor raises.
    """
    if method not in METHODS:
        raise ValueError(f"unknown gossip method {method!r}; use one of {', '.join(METHODS)}")
    return METHODS[method](params, names, topology, rank, compression=compression,
                           consensus_step=consensus_step, **kwargs)


class GossipOptimizer(LocalOptimizerSurface, FollowsWorld):
    """Local optimizer step, then a compressed gossip step with the neighbours (module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (stepped locally).
        named_parameters: the model's ``named_parameters()`` (names key the per-rank state and
            compressor state; without it parameters are named ``param.<i>``).
        method: ``"choco"`` (Choco-SGD), ``"dcd"`` (DCD-PSGD), ``"ecd"`` (ECD-PSGD) or
            ``"powergossip"``.
        topology: ``"ring"``, ``"torus"``, ``"torus:RxC"``, ``"exponential"`` (PowerGossip only),
            ``"complete"``, neighbour lists, or a :class:`~hvdcomp.gossip.topology.Topology`, over
            the process set's ranks.
        compression: compressor spec or instance (``"sign"``, ``"topk:density=0.01"``, ``"qsgd"``,
            ...; :func:`hvdcomp.gossip.base.compressor_kind`); ``None``/``"none"`` for PowerGossip.
        consensus_step: Choco-SGD's γ ∈ (0, 1] (required with a compressor); PowerGossip's step
            (default 1); not accepted by DCD/ECD.
        process_set: a Horovod process set or a ``torch.distributed`` process group (default:
            every rank, through Horovod after ``hvd.init()`` or ``torch.distributed`` after
            ``init_process_group``: :func:`hvdcomp.comm.resolve_group`); ranks outside it train
            locally.
        weights: ``"metropolis"`` or ``"uniform"`` mixing weights for a static graph.
        overlap: run the exchange of a step in the background until the next ``step()``.
        timeout: seconds to wait for a neighbour before :class:`~hvdcomp.transports.neighbor.NeighborTimeoutError` names it.
        nonfinite: what a NaN/Inf gradient on any rank does, decided alike on every rank of the
            process set (:meth:`_agree_step`): ``"skip"`` (default: every rank skips the step),
            ``"raise"`` (``FloatingPointError`` on every rank, nothing changed) or ``"ignore"`` (no
            check and no agreement collective).
        **method_kwargs: PowerGossip's ``power_iterations``, ``warm_start``, ``seed``.

    Attributes:
        method: the :class:`~hvdcomp.gossip.base.GossipMethod` (one rank's state); also
            ``optimizer``, ``topology``, ``transport``, ``compression``, ``nonfinite``, ``rank``
            and ``size`` as given or resolved.
        skipped_steps: steps skipped for a non-finite gradient (saved in :meth:`state_dict`).
        timer: a :class:`hvdcomp.metrics.PhaseTimer`: compress / communicate / decompress
            seconds and exact bytes per step.

    Raises:
        ValueError: on every rank of the process set, when any rank's arguments are invalid (an
            asymmetric or disconnected graph, a rank listed twice, γ ∉ (0, 1], a refused
            compressor, an unknown ``nonfinite``, a timeout that is not a positive number, ...)
            or the ranks disagree on method, topology, γ, compressor, ``overlap``, ``nonfinite``
            or the parameters' names, shapes and dtypes (the message names the rank and the field).
        RuntimeError: Horovod not initialised, or no usable mpi4py world matching Horovod's (under
            ``torchrun`` or ``horovodrun --gloo``: :func:`hvdcomp.launch.start_frontend`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, method: str = "choco",
                 topology="ring", compression=None, consensus_step: Optional[float] = None, process_set=None,
                 weights: str = "metropolis", overlap: bool = True, timeout: float = 300.0, nonfinite: str = "skip",
                 **method_kwargs):
        self.optimizer = optimizer
        self.timer = PhaseTimer()
        self.overlap = overlap  # (checked below, with the other settings every rank agrees on)
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.prefix = instance_prefix("gossip")  # (names the collectives: two optimizers' run at once)
        self.group = resolve_group(process_set, frontend="hvdcomp.gossip.GossipOptimizer")
        self._params: List[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        names = name_parameters(optimizer.param_groups, named_parameters)
        self._names = [names[p] for p in self._params]
        if len(set(self._params)) != len(self._params):
            raise ValueError("the optimizer holds the same parameter twice; list each parameter once")
        self.method = self.transport = self.topology = self.compression = None  # (built by _build)
        self.rank, self.size = self.group.rank, self.group.size
        if not self.group.included:
            self._guard = NonFiniteGuard(nonfinite)
            self.overlap = check_bool(overlap, "overlap")
            return  # (as Horovod: a rank outside the process set trains on its own)
        self._settings = (method, topology, compression, consensus_step, weights, timeout, method_kwargs)
        # under elastic Horovod no collective now (a new worker builds this during the others' reset)
        self._init_world(self.group, "gossip")
        if not self._joining:
            self._build()

    def _build(self) -> None:
        """The transport, topology and method over the group's current ranks, the set-up
        agreement (collective) and, for DCD/ECD, the exact exchange of the initial models."""
        method, topology, compression, consensus_step, weights, timeout, method_kwargs = self._settings
        self.rank, self.size = self.group.rank, self.group.size
        comm = neighbor_edges(self.group, self.prefix)
        error, record = None, None
        try:
            self._guard = NonFiniteGuard(self.nonfinite)
            self.overlap = check_bool(self.overlap, "overlap",
                                      " (run each exchange in the background until the next step)")
            timeout = check_range(timeout, "timeout", 0.0, low_open=True, hint=" (seconds)")
        except ValueError as exc:
            error, timeout = exc, 300.0
        self.transport = NeighborTransport(comm, timeout=timeout, params=self._params, timer=self.timer)
        try:
            if error is None:
                self.topology = make_topology(topology, self.size, weights)
                self.method = make_method(method, self._params, self._names, self.topology, self.rank,
                                          compression=compression, consensus_step=consensus_step, **method_kwargs)
                self.compression = getattr(self.method, "compressor", None)
                self.transport.method = self.method
                record = {"method": self.method.describe(), "topology": self.topology.fingerprint(),
                          "overlap": self.overlap, "nonfinite": self.nonfinite, "prefix": self.prefix,
                          "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]}
        except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank has heard of it
            error = exc
        self._agree(error, record)
        if self.method.needs_setup:
            peers = self.topology.all_neighbors(self.rank)
            received = self.transport.exchange(self.method.setup_payload(self._params), peers)
            self.method.setup(self._params, received)

    # ---- elastic Horovod ----------------------------------------------------------------------
    def _world_group(self):
        return self.group

    def _resize(self, group) -> None:
        if self.transport is not None:
            self.transport.reset()  # (a failed exchange of the old world is logged, not raised)
            self.transport.close()
        self.transport = self.method = self.topology = None
        self.group = group

    def _join_world(self) -> None:
        self._joining = False
        self._build()

    # ---- construction helpers ----------------------------------------------------------------
    def _agree(self, error: Optional[BaseException], record) -> None:
        """Every rank learns every rank's construction error, then the set-up agreement
        (:func:`hvdcomp.agreement.check_consistency`); all raise together."""
        mine = {"error": None if error is None else f"{type(error).__name__}: {error}", "record": record}
        everyone = self.transport.allgather_object(mine)
        failed = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"]]
        if failed:
            r, msg = failed[0]
            raise ValueError(f"GossipOptimizer: rank {r} of the process set could not start: {msg}") from error
        gathered = SimpleNamespace(allgather_object=lambda obj, name: [e["record"] for e in everyone])
        check_consistency(gathered, record, f"{self.prefix}.setup",
                          setup="the gossip set-up (every rank must pass the same method, topology, "
                                "consensus_step, compression and model)")

    # ---- torch.optim.Optimizer-like facade: LocalOptimizerSurface's, over the wrapped optimizer ------
    def step(self, closure=None):
        """The non-finite check (:meth:`_agree_step`), the local optimizer step, then the gossip
        step; returns the closure's loss, or None for a step skipped on every rank (no trace in
        any state; an exchange in flight stays in flight).

        Raises:
            NeighborTimeoutError: a neighbour sent nothing within ``timeout`` (names the rank).
            CollectiveTimeoutError: the non-finite agreement did not complete within ``timeout``
                (some rank stopped stepping; cannot name it).
            FloatingPointError: ``nonfinite="raise"`` and a non-finite gradient on some rank (on
                every rank, naming the ranks; nothing was changed).
        """
        self._follow_world()
        if not self._agree_step():
            return None
        gossiping = self.method is not None and self.size > 1
        previous = [p.detach().clone() for p in self._params] if gossiping and self.method.needs_previous else None
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if not gossiping:
            return loss
        self.flush()
        self.transport.previous = previous
        for r in range(self.method.rounds):
            self.transport.start(r)
            if not (self.overlap and r == self.method.rounds - 1):
                self.flush()
        return loss

    def _agree_step(self) -> bool:
        """This step's non-finite verdict, the same on every rank of the process set
        (:class:`hvdcomp.agreement.NonFiniteGuard`: one fused check of the gradients per device,
        then one ``Iallgather`` of three integers per rank over the neighbour transport's
        communicator, waited for up to ``timeout``; a rank alone decides alone). Returns whether
        the step goes ahead; counts skipped steps. Why one global collective, and its price:
        ``docs/gossip.md`` ("Non-finite gradients")."""
        if self.nonfinite == "ignore":
            return True
        self._guard.observe_gradients(self._params)
        gossiping = self.method is not None and self.size > 1
        if gossiping:
            with self.timer.phase("communicate"):
                verdict = self._guard.agree(self.transport.allgather_ints, False, 1)
        else:
            verdict = self._guard.agree(lambda mine: [list(mine)], False, 1)
        if verdict.skip:
            self.skipped_steps += 1
            return False
        return True

    def flush(self) -> None:
        """Finish the exchange in flight (if any) and apply it to the model."""
        if self.method is None:
            return
        self.transport.finish()
        with self.timer.phase("decompress"):
            self.method.apply(self._params)
        self.timer.add_bytes(**self.transport.unapplied)
        self.transport.unapplied = dict.fromkeys(self.transport.unapplied, 0)

    # ---- which model to evaluate ------------------------------------------------------------
    def _mean_of_models(self) -> List[torch.Tensor]:
        if not self.group.included or self.size == 1:
            return [p.detach().clone() for p in self._params]
        out = []
        for i, p in enumerate(self._params):
            out.append(self.group.allreduce(p.detach().clone(), f"{self.prefix}.average.{i}"))
        return out

    @contextlib.contextmanager
    def average_model(self) -> Iterator[None]:
        """Inside the block, the parameters hold the network average Σ_i x_i / n (identical on every
        rank; an allreduce per parameter over the process group); the local model comes back
        after. Collective: every rank of the set must enter it. The exchange in flight stays in
        flight."""
        local = [p.detach().clone() for p in self._params]
        mean = self._mean_of_models()
        with torch.no_grad():
            for p, m in zip(self._params, mean):
                p.copy_(m)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, x in zip(self._params, local):
                    p.copy_(x)

    def with_average_model(self, fn):
        """``fn`` wrapped to run inside :meth:`average_model` (e.g. an evaluation function)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.average_model():
                return fn(*args, **kwargs)
        return wrapper

    def consensus_distance(self) -> float:
        """Σ_i ‖x_i − x̄‖² over the process set's ranks (all parameters; float64), the same on every
        rank. Collective."""
        mean = self._mean_of_models()
        local = sum(float((p.detach().double() - m.double()).pow(2).sum()) for p, m in zip(self._params, mean))
        if not self.group.included or self.size == 1:
            return local
        return float(self.group.allreduce(torch.tensor([local], dtype=torch.float64), f"{self.prefix}.consensus",
                                          average=False)[0])

    # ---- checkpoints (per rank) ------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: the wrapped optimizer's, the method's (public copies, replicas,
        edge vectors, compressor state), and the rank, size, topology and method it belongs to.
        Save it per rank and restore it on the same rank (tensors, numbers and strings only:
        ``torch.load(weights_only=True)`` reads it). Saving does not change the run: the exchange
        in flight is absorbed, its update of the parameters stays staged (in the returned state
        too) and is applied at the next :meth:`step`, as without the save."""
        if self.transport is not None:
            self.transport.finish()  # (absorbed, its update staged: applied at the next step)
        out = {"optimizer": self.optimizer.state_dict(), "rank": self.rank, "size": self.size,
               "skipped_steps": self.skipped_steps}
        if self.method is not None:
            out.update({"gossip": self.method.state_dict(), "method": self.method.describe(),
                        "topology": self.topology.fingerprint()})
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output of this same rank (after ``model.load_state_dict``
        of that rank's model).

        Raises:
            ValueError: the state belongs to another rank, size, topology or method.
        """
        for key, mine in (("rank", self.rank), ("size", self.size)):
            if state.get(key) != mine:
                raise ValueError(f"this gossip state was saved by {key} {state.get(key)}, this is {key} {mine}: "
                                 "gossip state is per rank; each rank loads the file it saved")
        if self.method is not None:
            if state.get("topology") != self.topology.fingerprint() or state.get("method") != self.method.describe():
                raise ValueError("this gossip state was saved with another topology or method "
                                 f"({state.get('method')}); resume with the same settings")
        self.flush()
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.method is not None:
            self.method.load_state_dict(state["gossip"])

    def describe(self) -> Dict[str, Any]:
        """JSON-able description (for results files)."""
        if self.method is None:
            return {"method": "local (outside the process set)"}
        return {**self.method.describe(), "topology": self.topology.describe(), "overlap": self.overlap,
                "nonfinite": self.nonfinite, "skipped_steps": self.skipped_steps, "transport": str(self.transport)}

    def close(self) -> None:
        """Finish the exchange in flight and stop the transport's thread."""
        self.flush()
        if self.transport is not None:
            self.transport.close()
