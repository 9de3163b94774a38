"""Transport planning: how each gradient travels, decided once at construction, the same on every rank.

Pure functions of the parameter shapes, the compressor, the cost model and the settings: no
communication, so every rank computes the same plan.

Routes (per parameter name):

* ``"allreduce"``: the compressed payload is summable; Horovod ``allreduce_async`` averages it.
* ``"allgather"``: the payload differs per rank (sparse indices, per-rank scales); it waits for
  its **bucket** and travels in one variable-size allgather per bucket.
* ``"decoded-allreduce"``: the payload needs an allgather, but the α-β cost model predicts that
  averaging its local decode densely is cheaper (same result): decoded, then allreduced in fp32.
* ``"batched"``: the compressor reduces all gradients of a step together with its own
  collectives, named by its ``collective`` attribute: PowerSGD (``allreduce``), gtopk
  (``sparse-allreduce``), cltk (``broadcast+allreduce``), twophase (``alltoall+allgather``).

With ``transport="auto"`` the optimizer first lets the cost model choose how a method's payloads
travel among the transports that carry the same kind of compression (:func:`choose_transport`):
top-k by allgather, global top-k by sparse allreduce (gtopk) or the leader's top-k by allreduce
(cltk); a quantizer by allgather or by the two-phase compressed allreduce (twophase).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["make_buckets", "make_units", "fuse_units", "split_groups", "TransportPlan", "plan_transport",
           "ROUTES", "transport_candidates", "predict_step_seconds", "choose_transport", "HOROVOD_KINDS"]

ROUTES = ("allreduce", "allgather", "decoded-allreduce", "batched")


def make_buckets(sizes: List[int], bucket_bytes: int) -> List[List[int]]:
    """Group consecutive items into buckets of at most ``bucket_bytes`` (bytes).

    Args:
        sizes: bytes of each item, in launch order.
        bucket_bytes: cap per bucket; an item larger than the cap gets a bucket of its own.

    Returns:
        Lists of item positions, covering every item once, in order.
    """
    buckets, current, filled = [], [], 0
    for i, nbytes in enumerate(sizes):
        if current and filled + nbytes > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += nbytes
    if current:
        buckets.append(current)
    return buckets


def make_units(params: Sequence[Tuple[str, int, int, str]], granularity: str, bucket_bytes: int,
               groups: Optional[List[List[str]]] = None) -> List[Tuple[str, List[int]]]:
    """What the compressor sees as one tensor: a *unit* per gradient, or per bucket of gradients.

    Args:
        params: ``(name, numel, element_size in bytes, layout key)`` per parameter, in launch
            order; the layout key (dtype and device) must match within a bucket.
        granularity: ``"tensor"`` (one unit per parameter) or ``"bucket"`` (consecutive
            gradients of one layout flattened together, at most ``bucket_bytes`` each, or one
            unit per group of ``groups`` split by layout).
        bucket_bytes: cap on a bucket unit's gradient bytes (a larger gradient is alone).
        groups: explicit groups of names (Horovod's ``groups``), used as bucket units.

    Returns:
        ``(unit name, member positions)`` covering every parameter once, in launch order; a
        bucket unit is named ``bucket<k>``.

    Raises:
        ValueError: unknown ``granularity``.
    """
    if granularity == "tensor":
        return [(name, [i]) for i, (name, _, _, _) in enumerate(params)]
    if granularity != "bucket":
        raise ValueError(f"granularity must be 'tensor' or 'bucket', got {granularity!r}")
    if groups is not None:
        at = {name: i for i, (name, _, _, _) in enumerate(params)}
        runs = [[at[n] for n in g] for g in groups]
    else:
        runs, start = [], 0
        for i in range(1, len(params) + 1):
            if i == len(params) or params[i][3] != params[start][3]:
                positions = list(range(start, i))
                sizes = [params[k][1] * params[k][2] for k in positions]
                runs += [[positions[k] for k in b] for b in make_buckets(sizes, bucket_bytes)]
                start = i
    units = []
    for run in runs:  # a group spanning layouts is split by layout
        by_key: Dict[str, List[int]] = {}
        for i in run:
            by_key.setdefault(params[i][3], []).append(i)
        units += list(by_key.values())
    units.sort(key=lambda members: members[0])
    return [(f"bucket{k}", members) for k, members in enumerate(units)]


def fuse_units(params: Sequence[Tuple[str, int, int, str]], plan: "TransportPlan", bucket_bytes: int,
               groups: Optional[List[List[str]]] = None) -> List[Tuple[str, List[int]]]:
    """Gradients compressed together in one call (a segmentable compressor, ``granularity="tensor"``).

    Each gradient keeps its own compression (per-tensor semantics, see
    :mod:`hvdcomp.compressors.segments`); what is fused is the work: one flat buffer and one call
    per *fused unit*. A fused unit holds gradients of one route and one layout key: those of one
    allgather bucket of ``plan``; for the other routes, consecutive gradients of at most
    ``bucket_bytes`` (within one of Horovod's ``groups`` where given).

    Args:
        params: ``(name, numel, element_size in bytes, layout key)`` per parameter, in launch order.
        plan: the per-gradient :class:`TransportPlan` (routes and allgather buckets by name).
        bucket_bytes: cap on a fused unit's gradient bytes (a larger gradient is alone).
        groups: Horovod's ``groups`` as lists of names, or None.

    Returns:
        ``(unit name, member positions)`` covering every parameter once, sorted by first member;
        a unit of one gradient has the gradient's name, others ``fused<k>``.
    """
    in_group = {n: g for g, members in enumerate(groups or []) for n in members}
    in_bucket = {n: b for b, members in enumerate(plan.buckets) for n in members}
    keys = []
    for name, _, _, layout in params:
        route = plan.routes[name]
        where = ("bucket", in_bucket[name]) if route == "allgather" else ("group", in_group.get(name))
        keys.append((route, layout, where))
    units: List[List[int]] = []
    runs: Dict[tuple, List[int]] = {}
    for i, key in enumerate(keys):  # allgather buckets: one unit per bucket and layout
        if key[0] == "allgather":
            runs.setdefault(key, []).append(i)
    units += list(runs.values())
    start = 0
    for i in range(1, len(params) + 1):  # other routes: consecutive runs of one key, capped
        if i == len(params) or keys[i] != keys[start]:
            if keys[start][0] != "allgather":
                positions = list(range(start, i))
                sizes = [params[k][1] * params[k][2] for k in positions]
                units += [[positions[k] for k in b] for b in make_buckets(sizes, bucket_bytes)]
            start = i
    units.sort(key=lambda members: members[0])
    out, fused = [], 0
    for members in units:
        if len(members) == 1:
            out.append((params[members[0]][0], members))
        else:
            out.append((f"fused{fused}", members))
            fused += 1
    return out


def split_groups(names: Sequence[str], groups) -> List[List[str]]:
    """Horovod's ``groups`` argument as lists of names, in ``names`` order.

    Args:
        names: every parameter name, in launch order.
        groups: an int k > 0 (``names`` split into k consecutive groups of near-equal length, as
            Horovod's ``split_list``) or a list of lists of names (a name listed in none forms a
            group of its own, as in Horovod).

    Returns:
        Groups covering every name once; empty groups are dropped.

    Raises:
        ValueError: a name listed twice or unknown, or k < 1.
    """
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups must be a positive integer or a list of lists of parameters; got {groups}")
        k, m = divmod(len(names), groups)
        parts = [list(names[i * k + min(i, m):(i + 1) * k + min(i + 1, m)]) for i in range(groups)]
        return [p for p in parts if p]
    position = {n: i for i, n in enumerate(names)}
    seen, out = set(), []
    for group in groups:
        for n in group:
            if n in seen:
                raise ValueError(f"a parameter can only appear once in groups; '{n}' appears twice")
            if n not in position:
                raise ValueError(f"groups lists '{n}', which the optimizer does not update")
            seen.add(n)
        if group:
            out.append(sorted(group, key=position.__getitem__))
    out += [[n] for n in names if n not in seen]
    return sorted(out, key=lambda g: position[g[0]])


@dataclass
class TransportPlan:
    """How every gradient of an optimizer travels (see the module docstring for the routes).

    Attributes:
        routes: compression unit (a parameter, or a flattened bucket ``bucket<k>`` with
            ``granularity="bucket"``) -> route.
        buckets: allgather buckets, each a list of unit names in launch order.
        allgather: the allgather transport (``"mpi4py"``, ``"horovod"`` or ``"none"``).
        ranks: global ranks of the group the gradients are averaged over.
        units: unit name -> names of the parameters it holds (only where a unit holds several):
            a flattened bucket ``bucket<k>`` (``granularity="bucket"``), or gradients compressed
            per tensor in one call, ``fused<k>`` (:func:`fuse_units`).
        collective: a batched compressor's own collectives (its ``collective`` attribute), else
            ``""``.
        choice: with ``transport="auto"``, the predicted communication seconds per step of each
            candidate (:func:`choose_transport`), by label; empty otherwise.
    """

    routes: Dict[str, str]
    buckets: List[List[str]] = field(default_factory=list)
    allgather: str = "none"
    ranks: List[int] = field(default_factory=list)
    units: Dict[str, List[str]] = field(default_factory=dict)
    collective: str = ""
    choice: Dict[str, float] = field(default_factory=dict)

    def count(self, route: str) -> int:
        """Number of gradients on ``route``."""
        return sum(1 for r in self.routes.values() if r == route)

    def describe(self) -> dict:
        """JSON-able summary: counts per route, bucket sizes, transport, group ranks."""
        return {"routes": {r: self.count(r) for r in ROUTES if self.count(r)},
                "buckets": [len(b) for b in self.buckets], "allgather": self.allgather,
                "ranks": self.ranks, "units": {u: len(m) for u, m in self.units.items()},
                **({"collective": self.collective} if self.collective else {}),
                **({"choice": self.choice} if self.choice else {})}

    def __str__(self) -> str:
        """One line for logs and results, e.g. ``mpi4py-allgather (2 bucket(s))``."""
        text = self._route_text()
        if self.choice:
            text += " [chosen by the cost model: " + ", ".join(
                f"{k} {v * 1e3:.3g} ms" for k, v in sorted(self.choice.items(), key=lambda kv: kv[1])) + "]"
        return text

    def _route_text(self) -> str:
        total = len(self.routes)
        if self.count("batched"):
            return f"{self.collective or 'allreduce'} (batched)"
        if not self.buckets and self.count("allreduce") == total:
            return "allreduce"
        text = f"{self.allgather}-allgather ({len(self.buckets)} bucket(s))"
        dense = self.count("decoded-allreduce")
        return text + (f", {dense} of {total} tensor(s) by allreduce (cost model)" if dense else "")


def plan_transport(params: Sequence[Tuple[str, int, int]], compression, cost_model, size: int,
                   bucket_bytes: int, groups: Optional[List[List[str]]] = None,
                   allgather: str = "none", ranks: Optional[List[int]] = None) -> TransportPlan:
    """Route every parameter and bucket the allgathered ones.

    Args:
        params: ``(name, numel, element_size in bytes)`` per parameter, in launch order (the
            expected backward order).
        compression: the optimizer's :class:`hvdcomp.Compressor`.
        cost_model: a :class:`hvdcomp.comm.costmodel.CostModel`, or None (no routing).
        size: number of ranks averaged over.
        bucket_bytes: dense bytes per allgather bucket.
        groups: explicit groups of names (Horovod's ``groups``): each group's allgathered
            members form one bucket, whatever ``bucket_bytes`` says.
        allgather: name of the allgather transport, for :meth:`TransportPlan.describe`.
        ranks: global ranks of the group.

    Returns:
        The :class:`TransportPlan`.
    """
    routes: Dict[str, str] = {}
    for name, numel, _ in params:
        if compression.batched:
            route = "batched"
        elif compression.summable:
            route = "allreduce"
        else:
            route = "allgather"
            payload = None if cost_model is None else compression.expected_payload_bytes(numel)
            if payload is not None and cost_model.choose(payload, numel * 4, size) == "allreduce":
                route = "decoded-allreduce"  # decoded in fp32, so the dense side is 4 bytes each
        routes[name] = route
    gathered = [(n, numel * esize) for n, numel, esize in params if routes[n] == "allgather"]
    if groups is not None:
        member = {n for n, _ in gathered}
        buckets = [[n for n in g if n in member] for g in groups]
        buckets = [b for b in buckets if b]
    else:
        buckets = [[gathered[i][0] for i in b] for b in make_buckets([s for _, s in gathered], bucket_bytes)]
    return TransportPlan(routes, buckets, allgather if buckets else "none", list(ranks or []),
                         collective=compression.collective if compression.batched else "")


# ---- choosing the transport of a method (transport="auto") ----------------------------------------
def _label(compression) -> str:
    """``name (transport)`` of a candidate, e.g. ``gtopk (sparse-allreduce)``."""
    how = compression.collective if compression.batched else (
        "allreduce" if compression.summable else "allgather")
    return f"{compression.name} ({how})"


def transport_candidates(compression) -> list:
    """The compressors that carry ``compression``'s kind of compression by other transports,
    ``compression`` itself first:

    * ``topk`` with error feedback: ``gtopk`` (global top-k by sparse allreduce; Shi et al., ICDCS
      2019) and ``cltk`` (the leader's top-k, values by allreduce; Chen et al., NeurIPS 2020), at
      the same density, both with error feedback. They select over the whole model, not per
      gradient, and send 4-byte indices and float32 values whatever top-k's wire options;
    * ``qsgd``, ``terngrad``, ``efsignsgd``: ``twophase`` with the same quantizer and settings
      (all-to-all, average, re-quantize, allgather; Tang et al., ICML 2021);
    * anything else: only itself.
    """
    import inspect

    from .compressors import get_compressor  # (the compressors import plan's helpers lazily)
    from .compressors.registry import compressor_class

    desc = compression.describe()
    out = [compression]
    if compression.name == "topk" and desc.get("ef", False):
        out += [get_compressor("gtopk", density=desc["density"]), get_compressor("cltk", density=desc["density"])]
    elif compression.name in ("qsgd", "terngrad", "efsignsgd"):
        # the quantizer's constructor arguments among its description (not derived values such as bits)
        takes = inspect.signature(compressor_class(compression.name).__init__).parameters
        args = {k: v for k, v in desc.items() if k in takes and k != "ef"}
        out.append(get_compressor("twophase", base=compression.name, **args))
    return out


#: collectives hvdcomp runs through Horovod (each call also waits for Horovod's cycle)
HOROVOD_KINDS = ("allreduce", "broadcast")


def predict_step_seconds(compression, cost_model, p: int, numels: Sequence[int], bucket_bytes: int,
                         horovod_latency: float = 0.0) -> Optional[float]:
    """Communication seconds per step that ``cost_model`` (a
    :class:`hvdcomp.comm.costmodel.CostModel`) predicts for ``compression`` on ``p`` ranks and
    gradients of ``numels`` elements (:meth:`hvdcomp.Compressor.step_collectives`, with the
    optimizer's per-gradient routing), plus ``horovod_latency`` seconds per call of a collective
    that goes through Horovod (:data:`HOROVOD_KINDS`: its cycle time and negotiation); None where
    the method's bytes depend on the data."""
    collectives = compression.step_collectives(list(numels), p, bucket_bytes, cost_model)
    if collectives is None:
        return None
    return sum(cost_model.seconds(kind, p, nbytes, calls)
               + (calls * horovod_latency if kind in HOROVOD_KINDS and p > 1 else 0.0)
               for kind, nbytes, calls in collectives)


def choose_transport(compression, cost_model, p: int, numels: Sequence[int], bucket_bytes: int,
                     margin: float = 0.01, horovod_latency: float = 0.0, point_to_point: bool = True):
    """The candidate (:func:`transport_candidates`) with the least predicted communication per
    step (:func:`predict_step_seconds`); ``compression`` itself unless another is faster by more
    than ``margin`` (relative). A pure function of its arguments, so every rank that shares the
    cost model chooses the same.

    Args:
        compression: the :class:`hvdcomp.Compressor` asked for.
        cost_model: a :class:`hvdcomp.comm.costmodel.CostModel` (α seconds, β seconds per byte).
        p: number of ranks.
        numels: elements of each gradient, in launch order.
        bucket_bytes: dense bytes per allgather bucket.
        margin: relative advantage a candidate needs over ``compression``.
        horovod_latency: seconds each Horovod collective waits besides its α-β time
            (:func:`predict_step_seconds`).
        point_to_point: whether the ranks can message each other through MPI; without it,
            candidates that need to (``needs_point_to_point``: gtopk, twophase) are left out.

    Returns:
        ``(chosen compressor, {label: predicted seconds})`` (labels such as ``"gtopk
        (sparse-allreduce)"``; candidates whose bytes depend on the data are left out).
    """
    predicted = {}
    best, best_s = compression, predict_step_seconds(compression, cost_model, p, numels, bucket_bytes,
                                                     horovod_latency)
    if best_s is not None:
        predicted[_label(compression)] = best_s
    for cand in transport_candidates(compression)[1:]:
        if cand.needs_point_to_point and not point_to_point:
            continue
        sec = predict_step_seconds(cand, cost_model, p, numels, bucket_bytes, horovod_latency)
        if sec is None:
            continue
        predicted[_label(cand)] = sec
        if best_s is None or sec < best_s * (1 - margin):
            best, best_s = cand, sec
    return best, predicted
