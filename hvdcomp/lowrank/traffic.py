"""AB-training's traffic: its collectives with their bytes per stage, and the whole-run summary
over ranks against full-rank data parallelism.

Bytes are counted by the one mpi4py byte layer, :class:`hvdcomp.comm.exchange.MPIExchange`
(hvdcomp's convention, at the collective: an Allreduce of n bytes sends n and receives n on every
rank, a broadcast sends n at its root and receives n everywhere). :class:`Traffic` attributes
what each collective moved to an AB-training stage, and to "between nodes" when its communicator
holds ranks of more than one node. Every Allreduce carries one packed fp32 buffer per
communicator and step.

Results written before the stage rename used "phase" (and "group" for a rank group) in their
keys; :func:`read` reads both, and the dicts this module returns answer the old keys for one
release (:class:`RenamedKeys`, with a DeprecationWarning).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Dict, List, Sequence

import torch

from ..comm.exchange import MPIExchange
from ..comm.torchdist import TorchDistExchange, TorchDistGroup
from .layout import RankLayout

__all__ = ["Traffic", "traffic_summary", "RenamedKeys", "RENAMED", "read"]

#: keys of AB-training's results before the rename -> their names now
RENAMED = {"bytes_by_phase": "bytes_by_stage", "internode_bytes_by_phase": "internode_bytes_by_stage",
           "steps_by_phase": "steps_by_stage", "bytes_by_phase_mean": "bytes_by_stage_mean",
           "between_nodes_by_phase_mean": "between_nodes_by_stage_mean", "group": "rank_group",
           "groups": "rank_groups", "n_groups": "n_rank_groups"}
_OLD = {new: old for old, new in RENAMED.items()}


def read(d: dict, key: str, default=None):
    """``d[key]``, or the value under ``key``'s spelling before the rename (results files written
    before it), or ``default``."""
    if key in d:
        return d[key]
    return d.get(_OLD.get(key, key), default)


class RenamedKeys(dict):
    """A results dict that also answers the keys of :data:`RENAMED`'s old spellings (deprecated,
    one release: ``d["bytes_by_phase"]`` and ``d.get("bytes_by_phase")`` give
    ``d["bytes_by_stage"]`` with a DeprecationWarning; ``in`` and iteration see the new keys only,
    and JSON holds only them)."""

    def __missing__(self, key):
        new = RENAMED.get(key)
        if new is None or not dict.__contains__(self, new):
            raise KeyError(key)
        warnings.warn(f"AB-training results: {key!r} is renamed {new!r} (AB-training's stages are no longer "
                      "called phases, its rank groups no longer groups); the old key goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self[new]

    def get(self, key, default=None):
        if dict.__contains__(self, key) or dict.__contains__(self, RENAMED.get(key, "")):
            return self[key]
        return default


class Traffic:
    """The collectives of one AB-training job on its three communicators, and the bytes each
    stage moved on this rank.

    Scopes: ``"world"`` (every rank of the process set), ``"rank-group"`` (this rank's rank
    group), ``"trainers"`` (the ranks training the same factor, mode "ab").

    Args:
        world: the job's mpi4py communicator (AB-training's duplicate of the process set's), or
            its :class:`~hvdcomp.comm.torchdist.TorchDistGroup` under torchrun.
        layout: where the ranks of ``world`` sit (:class:`hvdcomp.lowrank.layout.RankLayout`).
        timer: the :class:`hvdcomp.metrics.PhaseTimer` charged with the ``communicate`` seconds
            and the bytes.

    Attributes:
        exchanges: scope -> :class:`hvdcomp.comm.exchange.MPIExchange` (its byte counters).
        bytes_by_stage, internode_bytes_by_stage: bytes sent per stage, all and in collectives
            whose communicator spans nodes.
        steps_by_stage: optimizer steps per stage.

    Collective over ``world`` (two ``Split``, or one ``new_group`` per rank group and factor).
    """

    def __init__(self, world, layout: RankLayout, timer):
        nodes = layout.nodes
        members = {"world": list(range(layout.size)), "rank-group": layout.rank_group_members(),
                   "trainers": layout.trainers()}
        if hasattr(world, "ranks"):  # a torch.distributed group: one sub-group per rank group / factor
            self.exchanges = {scope: TorchDistExchange(group, nodes=[nodes[r] for r in members[scope]])
                              for scope, group in _torch_scopes(world, layout).items()}
        else:
            rank = layout.rank
            rank_group = world.Split(color=layout.rank_group_index, key=rank)
            trainers = world.Split(color=0 if layout.trains == "A" else 1, key=rank)
            self.exchanges = {"world": MPIExchange(world, nodes=nodes),
                              "rank-group": MPIExchange(rank_group, nodes=[nodes[r] for r in members["rank-group"]]),
                              "trainers": MPIExchange(trainers, nodes=[nodes[r] for r in members["trainers"]])}
        self.timer = timer
        self.bytes_by_stage: Dict[str, int] = defaultdict(int)
        self.internode_bytes_by_stage: Dict[str, int] = defaultdict(int)
        self.steps_by_stage: Dict[str, int] = defaultdict(int)

    def _run(self, scope: str, stage: str, collective: str, *args) -> None:
        ex = self.exchanges[scope]
        sent, received = ex.bytes_sent, ex.bytes_received
        with self.timer.phase("communicate"):
            getattr(ex, collective)(*args)
        sent, received = ex.bytes_sent - sent, ex.bytes_received - received
        self.timer.add_bytes(sent=sent, received=received)
        self.bytes_by_stage[stage] += sent
        if ex.spans_nodes:
            self.internode_bytes_by_stage[stage] += sent

    def allreduce_mean(self, tensors: List[torch.Tensor], scope: str, stage: str) -> None:
        """Average ``tensors`` in place over the ranks of ``scope`` with one Allreduce of a packed
        fp32 buffer (each tensor any shape and floating dtype; nothing runs for an empty list)."""
        if not tensors:
            return
        flat = _pack(tensors)
        self._run(scope, stage, "allreduce_", flat)
        arr = flat.numpy()
        arr /= self.exchanges[scope].size
        _unpack(flat, tensors)

    def broadcast(self, tensors: List[torch.Tensor], root: int, stage: str) -> None:
        """Rank ``root``'s ``tensors`` (a rank of the world scope) on every rank, one packed fp32
        broadcast."""
        if not tensors:
            return
        flat = _pack(tensors)
        self._run("world", stage, "broadcast_", flat, root)
        _unpack(flat, tensors)

    def agree_max(self, values: Sequence[int], stage: str) -> List[int]:
        """The maximum over all ranks of each integer of ``values`` (one int64 Allreduce)."""
        agreed = torch.tensor(list(values), dtype=torch.int64)
        self._run("world", stage, "allreduce_", agreed, "max")
        return agreed.tolist()

    def report(self, dense_bytes: int) -> dict:
        """Bytes sent by stage (all, between nodes), steps by stage, ``dense_bytes`` (what
        full-rank data parallelism would send), the totals and this rank's traffic ratio."""
        sent = sum(self.bytes_by_stage.values())
        return {"bytes_by_stage": dict(self.bytes_by_stage),
                "internode_bytes_by_stage": dict(self.internode_bytes_by_stage),
                "steps_by_stage": dict(self.steps_by_stage), "dense_bytes": dense_bytes, "bytes_sent": sent,
                "internode_bytes_sent": sum(self.internode_bytes_by_stage.values()),
                "traffic_ratio": dense_bytes / sent if sent else None}


def _torch_scopes(world, layout: RankLayout) -> dict:
    """The world, rank-group and trainers groups of this rank over ``torch.distributed``
    (:class:`~hvdcomp.comm.torchdist.TorchDistGroup` each): every rank makes every sub-group, in
    the same order (``new_group`` is collective over the world)."""
    import torch.distributed as dist

    mine = {"world": world}
    for scope, of in (("rank-group", layout.rank_group_of), ("trainers", layout.trainer_of)):
        for color in sorted(set(of)):
            ranks = [world.ranks[r] for r in range(layout.size) if of[r] == color]
            pg = dist.new_group(ranks, backend="gloo")
            if of[layout.rank] == color:
                mine[scope] = TorchDistGroup(pg)
    return mine


def _pack(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors])


def _unpack(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def traffic_summary(reports: Sequence[dict]) -> dict:
    """Whole-run traffic over all ranks from every rank's :meth:`ABTraining.communication_report`
    (or any dict with the same byte keys, before or after the stage rename), against full-rank
    data parallelism.

    Full-rank data parallelism sends ``dense_bytes`` per rank (every gradient, fp32, every step),
    all of it in collectives that span the nodes when the layout has more than one node.

    Returns:
        ``ranks``, ``nodes``, ``dense_bytes`` (per rank), ``bytes_sent_mean`` and
        ``bytes_between_nodes_mean`` (bytes per rank, mean over ranks), per-stage means of both
        (``bytes_by_stage_mean``, ``between_nodes_by_stage_mean``), the per-rank lists,
        ``ratio_mean`` = dense / mean sent, and (more than one node) ``ratio_between_nodes`` =
        dense / mean sent between nodes and ``reduction_between_nodes`` = 1 − that quotient's
        inverse (the paper's "network traffic reduced by x %").

    Raises:
        ValueError: no reports, or reports of different runs (dense bytes or node counts differ).
    """
    if not reports:
        raise ValueError("traffic_summary needs one report per rank, got none")
    if len({r["dense_bytes"] for r in reports}) != 1 or len({r.get("nodes", 1) for r in reports}) != 1:
        raise ValueError("traffic_summary: the reports disagree on dense_bytes or nodes: give one run's "
                         "reports, one per rank")
    n, dense, nodes = len(reports), reports[0]["dense_bytes"], reports[0].get("nodes", 1)
    sent = [r["bytes_sent"] for r in reports]
    between = [r.get("internode_bytes_sent", r["bytes_sent"] if nodes > 1 else 0) for r in reports]

    def stage_mean(key):
        out: Dict[str, float] = defaultdict(float)
        for r in reports:
            for stage, b in read(r, key, {}).items():
                out[stage] += b / n
        return dict(out)

    mean_sent, mean_between = sum(sent) / n, sum(between) / n
    out = RenamedKeys(
        ranks=n, nodes=nodes, dense_bytes=dense, bytes_sent_mean=mean_sent, bytes_between_nodes_mean=mean_between,
        bytes_by_stage_mean=stage_mean("bytes_by_stage"),
        between_nodes_by_stage_mean=stage_mean("internode_bytes_by_stage"),
        bytes_sent_per_rank=sent, bytes_between_nodes_per_rank=between,
        ratio_mean=dense / mean_sent if mean_sent else None, ratio_between_nodes=None, reduction_between_nodes=None)
    if nodes > 1 and dense:
        out["ratio_between_nodes"] = dense / mean_between if mean_between else math.inf
        out["reduction_between_nodes"] = 1.0 - mean_between / dense
    return out
