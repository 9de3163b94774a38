"""Planning: how each gradient travels, decided once at construction, the same on every rank
(pure functions of the parameter shapes, the method, the cost model and the settings), for both
front-ends: :func:`route_of` is the one routing decision, :func:`fuses` the one fusion decision.

**Routes.** Every transport module of :mod:`hvdcomp.transports` registers here what it carries
and what it costs (:func:`register_route`, :func:`register_step_route`); the plan reads this
registry only. A per-tensor method's payloads travel by the route its
:class:`~hvdcomp.compressors.base.PayloadKind` prefers (``"allreduce"``: ``MEAN``, ``SUM``;
``"allgather"``: ``GATHERED``, in buckets), unless the α-β cost model prices another route that
carries it cheaper for a gradient (``"decoded-allreduce"``: a gathered payload whose aggregate is
the mean of its decodes, decoded and allreduced in fp32). Step-wide methods (PowerSGD, gtopk,
cltk, twophase) compress a whole step with their own transport: route ``"batched"``. With
``transport="auto"`` the cost model first chooses among the transports that can carry the same
kind of compression (:func:`choose_transport`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .compressors.segments import needs_draw_order

__all__ = ["make_buckets", "make_units", "fuse_units", "route_of", "fuses", "in_place", "split_groups", "TransportPlan",
           "plan_transport", "Route", "StepRoute", "register_route", "register_step_route", "routes", "step_route_of",
           "route_names", "step_collectives", "transport_candidates", "predict_step_seconds", "choose_transport",
           "HOROVOD_KINDS", "BATCHED", "IN_PLACE_DTYPES"]

#: the route of every gradient of a step-wide method
BATCHED = "batched"

#: dtypes a gradient is reduced in place (:func:`in_place`)
IN_PLACE_DTYPES = (torch.float32, torch.float64)

#: a list of ``(collective kind, bytes, calls)`` (kinds of :data:`hvdcomp.comm.costmodel.COLLECTIVES`)
Collectives = List[Tuple[str, float, int]]


@dataclass(frozen=True)
class Route:
    """A per-gradient transport as the plan sees it.

    Attributes:
        name: the route's name in :attr:`TransportPlan.routes`.
        carries: ``f(method) -> bool``: whether it can carry this per-tensor method's payloads.
        collectives: ``f(payload_bytes, dense_bytes, bucket_bytes) -> Collectives``: what the
            gradients routed here cost in one step (payload and fp32 dense bytes per gradient).
        preferred: the route a method it carries takes unless another route's ``take_if`` says
            otherwise for that gradient.
        take_if: for a route that is not preferred, ``f(cost_model, payload_bytes, dense_bytes,
            p) -> bool``: take it for this gradient (only with a cost model).
        bucketed: its gradients travel in buckets of ``bucket_bytes`` dense bytes (one
            collective per bucket).
        build: ``f(wiring) -> transport`` (see :mod:`hvdcomp.transports`).
    """

    name: str
    carries: Callable[[Any], bool]
    collectives: Callable[[List[float], List[float], int], Collectives]
    preferred: bool = True
    bucketed: bool = False
    build: Optional[Callable] = None
    take_if: Optional[Callable[[Any, float, float, int], bool]] = None


@dataclass(frozen=True)
class StepRoute:
    """A step-wide transport: a method class that compresses a whole step, with its collectives.

    Attributes:
        method: the class of the step-wide method it carries (its instances are what users pass
            as ``compression``).
        collective: its collectives, for :attr:`TransportPlan.collective` (``"sparse-allreduce"``).
        collectives: ``f(method, numels, p, bucket_bytes) -> Collectives or None`` (None where
            the bytes depend on the data).
        needs_point_to_point: it needs :class:`hvdcomp.comm.exchange.PointToPoint` (an
            all-to-all at least): not available without MPI, except elastic Horovod's
            all-to-all.
        needs_messages: its point-to-point is sends and receives, not only an all-to-all, so
            elastic Horovod's collectives (:class:`hvdcomp.comm.exchange.HorovodExchange`)
            cannot carry it.
        alternative: ``f(compression) -> method or None``: the method of this transport that would
            carry ``compression``'s kind of compression, for ``transport="auto"``.
        build: ``f(wiring) -> transport``.
    """

    method: type
    collective: str
    collectives: Callable[[Any, Sequence[int], int, int], Optional[Collectives]]
    needs_point_to_point: bool = False
    needs_messages: bool = False
    alternative: Optional[Callable[[Any], Any]] = None
    build: Optional[Callable] = None


_ROUTES: Dict[str, Route] = {}
_STEP_ROUTES: List[StepRoute] = []


def register_route(route: Route) -> Route:
    """Add a per-gradient route (called by its transport module at import).

    Raises:
        ValueError: a route of that name exists.
    """
    if route.name in _ROUTES or route.name == BATCHED:
        raise ValueError(f"route '{route.name}' is already registered")
    _ROUTES[route.name] = route
    return route


def register_step_route(route: StepRoute) -> StepRoute:
    """Add a step-wide transport (called by its module at import)."""
    _STEP_ROUTES.append(route)
    return route


def routes() -> Dict[str, Route]:
    """The registered per-gradient routes, in registration order."""
    return dict(_ROUTES)


def step_route_of(compression) -> Optional[StepRoute]:
    """The step-wide transport that carries ``compression``, or None for a per-tensor method."""
    for route in _STEP_ROUTES:
        if isinstance(compression, route.method):
            return route
    return None


def route_names() -> List[str]:
    """Every route name a plan can hold: the registered per-gradient routes, then ``"batched"``."""
    return [*_ROUTES, BATCHED]


def route_of(compression, numel: int = 0, cost_model=None, p: int = 1) -> str:
    """How a gradient (or a DDP bucket) of ``compression`` travels, the one decision both
    front-ends read: ``"batched"`` for a step-wide method (its own collectives, once a step), else
    the route a per-tensor method's :class:`~hvdcomp.compressors.base.PayloadKind` prefers
    (``"allreduce"``: ``MEAN``, ``SUM``; ``"allgather"``: ``GATHERED``), unless ``cost_model``
    makes another route that carries it take a gradient of ``numel`` elements on ``p`` ranks.

    Raises:
        ValueError: no registered route carries the method.
    """
    if step_route_of(compression) is not None:
        return BATCHED
    candidates = [r for r in _ROUTES.values() if r.carries(compression)]
    if not candidates:
        raise ValueError(f"no transport carries '{compression.name}' ({compression.payload_kind.value} payloads)")
    payload = None if cost_model is None else compression.expected_payload_bytes(numel)
    if payload is not None:
        for route in candidates:
            if not route.preferred and route.take_if is not None and route.take_if(cost_model, payload, 4.0 * numel, p):
                return route.name
    return next((r for r in candidates if r.preferred), candidates[0]).name


def in_place(compression, dtype) -> bool:
    """Whether a gradient (or a DDP bucket) of ``dtype`` travels as it is, reduced where it lies
    as Horovod and DDP reduce it: a method whose payload is the gradient (``none``), on
    :data:`IN_PLACE_DTYPES` (a half-precision one travels as float32: its sum could overflow)."""
    return bool(getattr(compression, "payload_is_gradient", False)) and dtype in IN_PLACE_DTYPES


def fuses(compression, granularity: str = "tensor", draw_order: bool = True) -> bool:
    """Whether gradients of one bucket are compressed in one call, each by its own rules
    (:mod:`hvdcomp.compressors.segments`): a ``segmentable`` per-tensor method whose payload is
    not the gradient itself, at ``granularity="tensor"``; one that draws random numbers at each
    call only where the front-end keeps the step's draw order (``draw_order``: the Horovod
    front-end's :class:`~hvdcomp.compressors.rng.DrawOrder`; the DDP hook compresses those one
    gradient per call, in the expected backward order)."""
    return (granularity == "tensor" and step_route_of(compression) is None
            and getattr(compression, "segmentable", False) and not compression.payload_is_gradient
            and (draw_order or not needs_draw_order(compression)))


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


def _capped_runs(params, keys: list, bucket_bytes: int, keep=lambda key: True) -> List[List[int]]:
    """Runs of consecutive positions of one key (a key ``keep`` accepts), each cut into buckets of
    at most ``bucket_bytes`` gradient bytes (:func:`make_buckets`)."""
    out, start = [], 0
    for i in range(1, len(params) + 1):
        if i == len(params) or keys[i] != keys[start]:
            if keep(keys[start]):
                sizes = [params[j][1] * params[j][2] for j in range(start, i)]
                out += [[start + k for k in b] for b in make_buckets(sizes, bucket_bytes)]
            start = i
    return out


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
        runs = _capped_runs(params, [p[3] for p in params], bucket_bytes)
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
    bucketed = {r.name for r in _ROUTES.values() if r.bucketed}
    keys = []
    for name, _, _, layout in params:
        route = plan.routes[name]
        where = ("bucket", in_bucket[name]) if route in bucketed else ("group", in_group.get(name))
        keys.append((route, layout, where))
    units: List[List[int]] = []
    runs: Dict[tuple, List[int]] = {}
    for i, key in enumerate(keys):  # buckets: one unit per bucket and layout
        if key[0] in bucketed:
            runs.setdefault(key, []).append(i)
    units += list(runs.values())
    units += _capped_runs(params, keys, bucket_bytes, keep=lambda key: key[0] not in bucketed)  # other routes
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
        buckets: buckets of the bucketed route (allgather), each a list of unit names in launch
            order.
        allgather: the allgather implementation (``"mpi4py"``, ``"horovod"`` or ``"none"``).
        ranks: global ranks of the group the gradients are averaged over.
        units: unit name -> names of the parameters it holds (only where a unit holds several):
            a flattened bucket ``bucket<k>`` (``granularity="bucket"``), or gradients compressed
            per tensor in one call, ``fused<k>`` (:func:`fuse_units`).
        collective: a step-wide method's collectives (its transport's), else ``""``.
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
        return {"routes": {r: self.count(r) for r in route_names() if self.count(r)},
                "buckets": [len(b) for b in self.buckets], "allgather": self.allgather,
                "ranks": self.ranks, "units": {u: len(m) for u, m in self.units.items()},
                **({"collective": self.collective} if self.collective else {}),
                **({"choice": self.choice} if self.choice else {})}

    def __str__(self) -> str:
        """One line for logs and results, e.g. ``mpi4py-allgather (2 bucket(s))``."""
        used = list(dict.fromkeys(self.routes.values()))
        if self.count(BATCHED):
            text = f"{self.collective or 'allreduce'} (batched)"
        elif not self.buckets and len(used) == 1:
            text = used[0]
        else:
            bucketed = {r.name for r in _ROUTES.values() if r.bucketed}
            text = f"{self.allgather}-allgather ({len(self.buckets)} bucket(s))" + "".join(
                f", {self.count(r)} of {len(self.routes)} tensor(s) by {r} (cost model)" for r in used
                if r not in bucketed)
        if self.choice:
            text += " [chosen by the cost model: " + ", ".join(
                f"{k} {v * 1e3:.3g} ms" for k, v in sorted(self.choice.items(), key=lambda kv: kv[1])) + "]"
        return text


def plan_transport(params: Sequence[Tuple[str, int, int]], compression, cost_model, size: int,
                   bucket_bytes: int, groups: Optional[List[List[str]]] = None,
                   allgather: str = "none", ranks: Optional[List[int]] = None) -> TransportPlan:
    """Route every parameter (or unit) and bucket those on a bucketed route.

    Args:
        params: ``(name, numel, element_size in bytes)`` per parameter, in launch order (the
            expected backward order).
        compression: the optimizer's method (per-tensor or step-wide).
        cost_model: a :class:`hvdcomp.comm.costmodel.CostModel`, or None (each gradient takes
            its method's preferred route).
        size: number of ranks averaged over.
        bucket_bytes: dense bytes per bucket.
        groups: explicit groups of names (Horovod's ``groups``): each group's bucketed members
            form one bucket, whatever ``bucket_bytes`` says.
        allgather: name of the allgather implementation, for :meth:`TransportPlan.describe`.
        ranks: global ranks of the group.

    Returns:
        The :class:`TransportPlan`.

    Raises:
        ValueError: no registered route carries the method.
    """
    step = step_route_of(compression)
    routes_ = {name: route_of(compression, numel, cost_model, size) for name, numel, _ in params}
    bucketed = {r.name for r in _ROUTES.values() if r.bucketed}
    gathered = [(n, numel * esize) for n, numel, esize in params if routes_[n] in bucketed]
    if groups is not None:
        member = {n for n, _ in gathered}
        buckets = [[n for n in g if n in member] for g in groups]
        buckets = [b for b in buckets if b]
    else:
        buckets = [[gathered[i][0] for i in b] for b in make_buckets([s for _, s in gathered], bucket_bytes)]
    return TransportPlan(routes_, buckets, allgather if buckets else "none", list(ranks or []),
                         collective=step.collective if step is not None else "")


def step_collectives(compression, numels: Sequence[int], p: int, bucket_bytes: int, cost_model=None):
    """The collectives one step of ``compression`` costs on ``p`` ranks, for gradients of
    ``numels`` float32 elements (in launch order): a list of ``(kind, bytes, calls)`` for
    :meth:`hvdcomp.comm.costmodel.CostModel.seconds`, or ``None`` where the bytes depend on the
    data. Per-tensor methods: each gradient on the route :func:`plan_transport` gives it (with
    ``cost_model``, a gathered gradient whose decode is cheaper to allreduce is priced so), each
    route's gradients priced together (Horovod fuses allreduces: one call; buckets of
    ``bucket_bytes``: a collective and a counts exchange each). Step-wide methods: their
    transport's price. Empty gradients cost nothing."""
    step = step_route_of(compression)
    if step is not None:
        return step.collectives(compression, list(numels), p, bucket_bytes)
    numels = [n for n in numels if n > 0]
    sizes = [compression.expected_payload_bytes(n) for n in numels]
    if any(b is None for b in sizes):
        return None
    by_route: Dict[str, List[Tuple[float, float]]] = {}
    for n, b in zip(numels, sizes):
        by_route.setdefault(route_of(compression, n, cost_model, p), []).append((float(b), 4.0 * n))
    out: Collectives = []
    for name, route in _ROUTES.items():
        if name in by_route:
            payloads, dense = zip(*by_route[name])
            out += route.collectives(list(payloads), list(dense), bucket_bytes)
    return out


# ---- choosing the transport of a method (transport="auto") ----------------------------------------
def _label(compression) -> str:
    """``name (transport)`` of a candidate, e.g. ``gtopk (sparse-allreduce)``."""
    step = step_route_of(compression)
    if step is not None:
        return f"{compression.name} ({step.collective})"
    preferred = next((r for r in _ROUTES.values() if r.preferred and r.carries(compression)), None)
    return f"{compression.name} ({preferred.name if preferred else '?'})"


def transport_candidates(compression) -> list:
    """The methods that carry ``compression``'s kind of compression by other transports,
    ``compression`` itself first, then each step-wide transport's ``alternative`` in registration
    order (top-k with error feedback: gtopk, cltk; QSGD, TernGrad, EF-signSGD: twophase; see
    those modules)."""
    out = [compression]
    for route in _STEP_ROUTES:
        other = route.alternative(compression) if route.alternative is not None else None
        if other is not None:
            out.append(other)
    return out


#: collectives hvdcomp runs through Horovod (each call also waits for Horovod's cycle)
HOROVOD_KINDS = ("allreduce", "broadcast")


def predict_step_seconds(compression, cost_model, p: int, numels: Sequence[int], bucket_bytes: int,
                         horovod_latency: float = 0.0) -> Optional[float]:
    """Communication seconds per step that ``cost_model`` (a
    :class:`hvdcomp.comm.costmodel.CostModel`) predicts for ``compression`` on ``p`` ranks and
    gradients of ``numels`` elements (:func:`step_collectives`, with the optimizer's
    per-gradient routing), plus ``horovod_latency`` seconds per call of a collective that goes
    through Horovod (:data:`HOROVOD_KINDS`: its cycle time and negotiation); None where the
    method's bytes depend on the data."""
    collectives = step_collectives(compression, list(numels), p, bucket_bytes, cost_model)
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
        compression: the method asked for.
        cost_model: a :class:`hvdcomp.comm.costmodel.CostModel` (α seconds, β seconds per byte).
        p: number of ranks.
        numels: elements of each gradient, in launch order.
        bucket_bytes: dense bytes per allgather bucket.
        margin: relative advantage a candidate needs over ``compression``.
        horovod_latency: seconds each Horovod collective waits besides its α-β time
            (:func:`predict_step_seconds`).
        point_to_point: whether the ranks can message each other through MPI; without it,
            candidates whose transport needs to (gtopk, twophase) are left out.

    Returns:
        ``(chosen method, {label: predicted seconds})`` (labels such as ``"gtopk
        (sparse-allreduce)"``; candidates whose bytes depend on the data are left out).
    """
    predicted = {}
    best, best_s = compression, predict_step_seconds(compression, cost_model, p, numels, bucket_bytes,
                                                     horovod_latency)
    if best_s is not None:
        predicted[_label(compression)] = best_s
    for cand in transport_candidates(compression)[1:]:
        route = step_route_of(cand)
        if route is not None and route.needs_point_to_point and not point_to_point:
            continue
        sec = predict_step_seconds(cand, cost_model, p, numels, bucket_bytes, horovod_latency)
        if sec is None:
            continue
        predicted[_label(cand)] = sec
        if best_s is None or sec < best_s * (1 - margin):
            best, best_s = cand, sec
    return best, predicted
