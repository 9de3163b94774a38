"""Building an optimizer's pipeline once, at construction: the cost model, the method
``transport="auto"`` picks, the compression units, the plan, and one transport per route used.

Nothing here runs per step; the optimizer (:mod:`hvdcomp.optimizer`) then hands each unit to
``transports[route_of[u]]``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch

from .comm.costmodel import CostModel, measure_cost_model
from .comm.stepcomm import StepComm
from .compressors.rng import DrawOrder
from .compressors.segments import Segments, needs_draw_order
from .plan import (TransportPlan, choose_transport, fuse_units, fuses, in_place, make_units, plan_transport, routes,
                   split_groups, step_route_of)
from .spec import is_per_tensor
from .transports import Units, Wiring

__all__ = ["Pipeline", "assemble", "step_comm_of"]

log = logging.getLogger(__name__)


@dataclass
class Pipeline:
    """What :func:`assemble` builds for one optimizer.

    Attributes:
        compression: the method (the one asked for, or the one ``transport="auto"`` chose).
        plan: the :class:`hvdcomp.plan.TransportPlan` (public as ``optimizer.transport``).
        cost_model: the α-β model that routed gradients, or None.
        units: the :class:`hvdcomp.transports.units.Units`.
        transports: one transport per route used, bucketed routes first (finished first).
        transport_of: per unit, the transport that carries it.
        eager: per unit, whether backward's hook starts it (not for step-wide transports, which
            start nothing before ``synchronize``).
        flush_order: the order ``synchronize()`` starts the units backward did not reach: units on
            other routes in launch order, then bucketed ones in bucket order.
        gatherer: the variable-size allgather, or None.
        deferred: the step is agreed on before anything travels (step-wide transports).
        summed_agreement: every gradient is reduced in place by one allreduce (``none`` on
            float32/float64): the per-step agreement travels as sums with them
            (:meth:`hvdcomp.agreement.NonFiniteGuard.agree_summed`).
        draw_order: where fused units hold gradients of a method that draws from a generator
            at each call, the step's order of one call per gradient
            (:class:`hvdcomp.compressors.rng.DrawOrder`, kept by the optimizer's
            :class:`hvdcomp.step.StepState`), else None.
    """

    compression: object
    plan: TransportPlan
    cost_model: Optional[CostModel]
    units: Units
    transports: list
    transport_of: list
    eager: List[bool]
    flush_order: List[int]
    gatherer: object = None
    deferred: bool = False
    summed_agreement: bool = False
    draw_order: Optional[DrawOrder] = None


def _routing_cost_model(settings, compression, group, order, gatherer) -> Optional[CostModel]:
    """The α-β model that routes gathered payloads, or None where routing cannot apply (only
    methods whose aggregate is the mean of their decodes can travel either way)."""
    cost_model = settings.cost_model
    carriers = [r for r in routes().values() if is_per_tensor(compression) and r.carries(compression)]
    if (cost_model == "off" or len(carriers) < 2 or group.size == 1
            or all(compression.expected_payload_bytes(p.numel()) is None for p in order)):
        return None
    if isinstance(cost_model, CostModel):
        return cost_model
    return measure_cost_model(gatherer.probe, group.size, agree=gatherer.agree)


def step_comm_of(compression, group, timer, gatherer, prefix: str) -> StepComm:
    """The collectives of a step-wide method's step (:meth:`hvdcomp.comm.group.ProcessGroup.step_comm`:
    the group's allreduce and broadcast, timed and counted), with point-to-point messages beside
    the allgather's channel where the method needs them.

    Raises:
        RuntimeError: the method's transport needs point-to-point messages and the ranks have none.
    """
    p2p = None
    route = step_route_of(compression)
    if route.needs_point_to_point and group.size > 1:
        p2p = group.point_to_point(gatherer)
        if p2p is None or (route.needs_messages and not getattr(p2p, "messages", True)):
            raise RuntimeError(f"'{compression.name}' messages ranks point to point through MPI, "
                               "but this job has no usable mpi4py communicator (Horovod started with "
                               "gloo or elastic, or allgather='horovod'): launch with mpirun or "
                               "horovodrun --mpi with mpi4py installed, or use cltk or topk")
    return group.step_comm(timer, prefix, p2p)


def assemble(settings, compression, group, order: List[torch.nn.Parameter], names: Dict, prefix: str,
             timer, gatherer=None) -> Pipeline:
    """Build the pipeline of an optimizer over ``order`` (its parameters in expected backward
    order) averaging over ``group`` (see :class:`Pipeline`). Collective over the group: every
    rank calls it with the same arguments. ``gatherer``: an allgatherer of the group to use
    (several pipelines of one reducer share one: ``compression="auto"``), else one is made.

    Raises:
        RuntimeError: a step-wide method that needs MPI point-to-point messages without MPI.
        ValueError: ``groups`` that list a tensor the optimizer does not hold; granularity
            ``"bucket"`` with a step-wide method that needs each gradient's shape.
    """
    per_tensor = is_per_tensor(compression)
    gathered = per_tensor and any(r.bucketed and r.carries(compression) for r in routes().values())
    if gatherer is None and (group.size > 1 or gathered):  # (it also carries the per-step agreement)
        gatherer = group.allgatherer(settings.allgather, prefix)
    choice: Dict[str, float] = {}
    if settings.transport == "auto" and group.size > 1:  # the cost model picks the transport
        if isinstance(settings.cost_model, CostModel):  # given: Horovod's collectives priced by it alone
            model, wait = settings.cost_model, 0.0
        else:
            model = measure_cost_model(gatherer.probe, group.size, agree=gatherer.agree)
            wait = group.latency(prefix)
        chosen, choice = choose_transport(compression, model, group.size, [p.numel() for p in order],
                                          settings.bucket_bytes, horovod_latency=wait,
                                          point_to_point=getattr(gatherer, "comm", None) is not None)
        if chosen is not compression:
            log.info("hvdcomp: transport='auto' replaces %s by %s (predicted %s)", compression.name,
                     chosen.name, {k: f"{v * 1e3:.3g} ms" for k, v in choice.items()})
            compression = chosen
            compression.bind_group(group.size)
            per_tensor = is_per_tensor(compression)
        settings = replace(settings, cost_model=model)  # measured once
    cost_model = _routing_cost_model(settings, compression, group, order, gatherer) if per_tensor else None
    unit_names = [names[p] for p in order]
    groups = settings.groups
    if isinstance(groups, list):  # parameters -> names (frozen ones dropped, as Horovod)
        held = {id(p) for p in order}
        if any(p not in names for g in groups for p in g):
            raise ValueError("groups lists a tensor that is not among the optimizer's parameters")
        groups = [[names[p] for p in g if id(p) in held] for g in groups]
    groups = None if groups is None else split_groups(unit_names, groups)
    # compression units: a gradient each, flattened buckets of gradients (granularity "bucket"),
    # or gradients compressed per tensor in one call per bucket (fused, plan.fuse_units)
    params = [(unit_names[i], p.numel(), p.element_size(), f"{p.dtype}/{p.device}") for i, p in enumerate(order)]
    allgather = gatherer.kind if gatherer is not None else "none"
    fuse = settings.fuse_tensors and fuses(compression, settings.granularity)
    if fuse:  # routes and buckets per gradient, then the fused units within them
        plan = plan_transport([p[:3] for p in params], compression, cost_model, group.size,
                              settings.bucket_bytes, groups, allgather, group.ranks)
        units = fuse_units(params, plan, settings.bucket_bytes, groups)
    else:
        units = make_units(params, settings.granularity, settings.bucket_bytes, groups)
    members = [m for _, m in units]
    names_of = [n for n, _ in units]
    if fuse:
        segments = [None if len(m) == 1 else Segments([unit_names[i] for i in m], [order[i].shape for i in m])
                    for m in members]
        route_of = [plan.routes[unit_names[m[0]]] for m in members]
        at = {unit_names[i]: u for u, m in enumerate(members) for i in m}
    else:
        numel = [sum(order[i].numel() for i in m) for m in members]
        esize = [order[m[0]].element_size() for m in members]
        plan = plan_transport(list(zip(names_of, numel, esize)), compression, cost_model, group.size,
                              settings.bucket_bytes, groups if settings.granularity == "tensor" else None,
                              allgather, group.ranks)
        segments = [None] * len(units)
        route_of = [plan.routes[n] for n in names_of]
        at = {n: u for u, n in enumerate(names_of)}
    plan.units = {names_of[u]: [unit_names[i] for i in m] for u, m in enumerate(members) if len(m) > 1}
    plan.choice = choice
    buckets = [list(dict.fromkeys(at[n] for n in b)) for b in plan.buckets]
    unit_set = Units(order, members, names_of, segments, prefix)
    step_route = step_route_of(compression)
    wiring = Wiring(group, timer, compression, unit_set, prefix, op_sum=settings.op_sum,
                    predivide=settings.gradient_predivide_factor, gatherer=gatherer, buckets=buckets,
                    names=unit_names,
                    step_comm=step_comm_of(compression, group, timer, gatherer, prefix) if step_route else None,
                    direct=compression.payload_is_gradient and settings.granularity == "tensor" if per_tensor
                    else False,
                    units_of_route={r: [u for u, x in enumerate(route_of) if x == r] for r in set(route_of)})
    builders = {name: r.build for name, r in routes().items()}
    by_route: Dict[str, object] = {}
    bucketed = [name for name, r in routes().items() if r.bucketed]
    for name in sorted(dict.fromkeys(route_of), key=lambda r: r not in bucketed):
        by_route[name] = step_route.build(wiring) if step_route is not None else builders[name](wiring)
    in_buckets = {u for b in buckets for u in b}
    flush_order = [u for u in range(len(units)) if u not in in_buckets] + [u for b in buckets for u in b]
    summed = (wiring.direct and settings.nonfinite != "ignore" and group.size > 1
              and all(in_place(compression, p.dtype) for p in order))
    draw_order = None
    if fuse and needs_draw_order(compression):  # fused units take the draws one call per gradient takes
        gathered = {n for b in plan.buckets for n in b}
        position = {n: i for i, n in enumerate(unit_names)}
        flush = ([i for i, n in enumerate(unit_names) if n not in gathered]
                 + [position[n] for b in plan.buckets for n in b])
        draw_order = DrawOrder(unit_names, [p.numel() for p in order], [p.device for p in order], flush)
    if hasattr(compression, "bind_draw_order"):
        compression.bind_draw_order(draw_order)
    return Pipeline(compression, plan, cost_model, unit_set, list(by_route.values()),
                    [by_route[r] for r in route_of], [step_route is None] * len(units), flush_order,
                    gatherer, deferred=step_route is not None, summed_agreement=summed,
                    draw_order=draw_order)
