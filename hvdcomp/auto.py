"""``compression="auto"``: the method, its setting and its collective chosen from the measured link,
the measured compute and the training phase, and changed at step boundaries as they change
(docs/auto.md: the rule, what is measured, phases, drift, switching, checkpoints).

:func:`decide` (pure) picks, among the candidates whose measured relative compression error is at
most ``tolerance``, the one with the least error whose predicted step
``compute + code(c) + comm(c)`` (seconds; ``comm``: :func:`comm_seconds`, the α-β cost model) is
within ``slack`` of the compute-only step, else the fastest predicted; ``critical_slack`` replaces
``slack`` in Accordion's critical regime (Agarwal et al., "Accordion: Adaptive Gradient
Communication via Critical Learning Regime Identification", MLSys 2021). :class:`AutoState`
measures and switches, the same way on every rank; a switch carries the old method's residuals
into the next step's gradient, so ``sent + new residual = gradient + old residual``. Decisions are
in :attr:`AutoState.decisions`.
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .checks import check_count, check_range
from .comm.costmodel import CostModel, measure_cost_model
from .comm.stepcomm import StepComm
from .compressors.base import Compressor, Method
from .memory import Residuals
from .metrics import PhaseTimer
from .plan import HOROVOD_KINDS, predict_step_seconds, step_route_of

__all__ = ["Auto", "AutoState", "Policy", "Row", "decide", "comm_seconds", "powersgd_collectives",
           "DEFAULT_CANDIDATES", "memories", "flush_problem"]

log = logging.getLogger(__name__)

#: the candidates of ``compression="auto"`` when none are given (dense first: ties go to the earlier)
DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:matrix_rank=4", "powersgd:matrix_rank=2", "powersgd:matrix_rank=1",
                      "qsgd", "topk:density=0.01", "topk:density=0.001", "cltk:density=0.01",
                      "cltk:density=0.01,leader=variance", "gtopk:density=0.01")


# ---- what a method keeps: residuals that a switch carries over --------------------------------------
def memories(method) -> List[Residuals]:
    """Every error-feedback memory (:class:`hvdcomp.memory.Residuals`) of ``method`` and of the
    methods it wraps (:meth:`~hvdcomp.compressors.state.StagedState.staged_children`)."""
    out, stack = [], [method]
    while stack:
        m = stack.pop()
        out += [v for v in vars(m).values() if isinstance(v, Residuals)]
        stack.extend(m.staged_children())
    return out


def flush_problem(method) -> Optional[str]:
    """Why ``method`` cannot be a candidate of ``auto`` (its state could not be carried over
    exactly at a switch), or None where it can."""
    if isinstance(method, Auto):
        return "'auto' cannot be a candidate of itself"
    if method.owns_momentum:
        return (f"'{method.name}' applies momentum itself (its velocity is not a residual a switch can carry "
                "into the next gradient)")
    mems = memories(method)
    if any(m.beta for m in mems):
        return f"'{method.name}' keeps a moving average of its errors (beta > 0), not a residual to carry over"
    if len(mems) > 1:
        return (f"'{method.name}' keeps residuals besides each gradient's own (twophase's server residual), "
                "which a switch cannot hand to the next gradient")
    return None


# ---- pricing -------------------------------------------------------------------------------------------
def powersgd_collectives(method, shapes: Sequence[torch.Size]):
    """The collectives of one PowerSGD step for gradients of ``shapes`` (float32): one allreduce
    of every compressed matrix's P (r·n floats) with the uncompressed tensors, then one of every
    Q (r·m floats), r = min(rank, n, m) (:class:`hvdcomp.transports.powersgd.PowerSGDCompressor`;
    its ``start_step`` of dense steps is not priced). A list of ``(kind, bytes, calls)``."""
    first = second = 0
    for shape in shapes:
        n, m = method.matrix_shape(shape)
        if method.compressible(shape):
            r = min(method.matrix_rank, n, m)
            first, second = first + r * n, second + r * m
        else:
            first += math.prod(shape)
    out = [("allreduce", 4.0 * first, 1)]
    return out + ([("allreduce", 4.0 * second, 1)] if second else [])


def comm_seconds(method, model: CostModel, p: int, shapes: Sequence[torch.Size], bucket_bytes: int,
                 horovod_latency: float = 0.0) -> Optional[float]:
    """Communication seconds of one step of ``method`` on ``p`` ranks, gradients of ``shapes``,
    priced by ``model`` (:func:`hvdcomp.plan.predict_step_seconds`: the optimizer's routes and
    buckets; PowerSGD by :func:`powersgd_collectives`), plus ``horovod_latency`` seconds per
    Horovod collective. None where the bytes depend on the data (e.g. a threshold)."""
    if getattr(method, "name", "") == "powersgd" and step_route_of(method) is not None:
        if p <= 1:
            return 0.0
        return sum(model.seconds(kind, p, nbytes, calls) + (calls * horovod_latency if kind in HOROVOD_KINDS else 0.0)
                   for kind, nbytes, calls in powersgd_collectives(method, shapes))
    return predict_step_seconds(method, model, p, [math.prod(s) for s in shapes], bucket_bytes, horovod_latency)


# ---- the rule ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One candidate as the rule sees it.

    Attributes:
        label: the candidate's spec, e.g. ``"topk:density=0.01"``.
        comm_s: predicted communication seconds per step (:func:`comm_seconds`), or None
            (unpriced: left out).
        code_s: measured encode + decode seconds per step.
        error: measured relative compression error ``‖C(p) − p‖ / ‖p‖`` (with error feedback).
    """

    label: str
    comm_s: Optional[float]
    code_s: float
    error: float

    def predicted(self, compute_s: float) -> float:
        """Predicted seconds of a step: ``compute_s + code_s + comm_s``."""
        return compute_s + self.code_s + self.comm_s


def decide(rows: Sequence[Row], compute_s: float, slack: float, tolerance: float) -> dict:
    """The rule of the module docstring: among the rows with ``error <= tolerance`` (all rows if
    none is), the least error whose predicted step is within ``slack`` times ``compute_s``; where
    none is, the fastest predicted step. Ties go to the earlier row. Rows whose ``comm_s`` is None
    are left out.

    Returns:
        ``{"index", "label", "predicted_step_s", "error", "reason"}`` (index into ``rows``).

    Raises:
        ValueError: no row has a price.
    """
    priced = [(i, r) for i, r in enumerate(rows) if r.comm_s is not None]
    if not priced:
        raise ValueError("auto: no candidate has a predicted communication time")
    admissible = [(i, r) for i, r in priced if r.error <= tolerance] or priced
    limit = slack * compute_s
    within = [(i, r) for i, r in admissible if r.predicted(compute_s) <= limit]
    if within:
        i, r = min(within, key=lambda ir: (ir[1].error, ir[1].predicted(compute_s), ir[0]))
        reason = (f"least error ({r.error:.3g}) of the {len(within)} candidate(s) predicted within {slack:g}x "
                  f"the compute-only step ({r.predicted(compute_s):.4g} s <= {limit:.4g} s)")
    else:
        i, r = min(admissible, key=lambda ir: (ir[1].predicted(compute_s), ir[1].error, ir[0]))
        reason = (f"none predicted within {slack:g}x the compute-only step ({limit:.4g} s): the fastest "
                  f"predicted step ({r.predicted(compute_s):.4g} s)")
    if len(admissible) < len(priced):
        reason += f"; {len(priced) - len(admissible)} candidate(s) above the error tolerance {tolerance:g} left out"
    return {"index": i, "label": r.label, "predicted_step_s": r.predicted(compute_s), "error": r.error,
            "reason": reason}


# ---- the user's object ---------------------------------------------------------------------------------
def _specs(candidates) -> List[str]:
    if candidates is None:
        return list(DEFAULT_CANDIDATES)
    if isinstance(candidates, str):  # the spec string's form: '+' between candidates, ';' between arguments
        candidates = [c for c in candidates.split("+") if c.strip()]
    if not isinstance(candidates, (list, tuple)) or not all(isinstance(c, str) for c in candidates) or not candidates:
        raise ValueError("auto: candidates must be a non-empty list of spec strings, e.g. ['fp16', "
                         "'powersgd:matrix_rank=2', 'topk:density=0.01'] (in a spec string: "
                         "'auto:candidates=fp16+powersgd:matrix_rank=2+topk:density=0.01')")
    out = [c.strip().replace(";", ",") for c in candidates]
    dups = sorted({c for c in out if out.count(c) > 1})
    if dups:
        raise ValueError(f"auto: candidate(s) {dups} listed twice; list each once")
    return out


def _number(name: str, value, low: float, integer: bool = False, above: bool = False):
    """``value`` checked by :mod:`hvdcomp.checks` (an integer ≥ ``low``, or a finite number ≥ or,
    with ``above``, > ``low``)."""
    if integer:
        return check_count(value, f"auto: {name}", int(low))
    return check_range(value, f"auto: {name}", low, low_open=above)


class Auto(Method):
    """``compression="auto"``: the :class:`~hvdcomp.reducer.Reducer` chooses among ``candidates``
    and changes its choice at step boundaries (see the module docstring for the rule).

    Spec string: ``auto[:candidates=A+B+...,slack=1.1,tolerance=1.0,interval=200,window=10,
    probe=3,accordion=0.5,critical_slack=1.5,drift=2,warmup=1]`` (``+`` between candidates, ``;`` between
    one candidate's arguments, e.g. ``topk:density=0.01;values=fp16``).

    Args:
        candidates: spec strings (default :data:`DEFAULT_CANDIDATES`). Each is built fresh for
            every optimizer. Candidates that cannot run in a job (PowerSGD with
            ``granularity="bucket"``, gtopk without MPI point-to-point) are left out there, with
            the reason in ``optimizer.auto.excluded``.
        slack: the predicted step may be this many times the compute-only step (≥ 1). Higher
            compresses less (less error, slower steps).
        tolerance: candidates whose measured relative error exceeds it are left out (unless all
            do). 1.0 leaves out only methods whose error exceeds the gradient itself.
        interval: steps between re-probes (errors and coding costs measured again, then
            re-decided); 0: only at the start.
        window: steps per measurement window (drift and phase checks; one small allgather each).
        probe: steps of a probe (each candidate compresses a copy of the gradients each step).
        accordion: Accordion's η: a regime is critical when the norm of the window's summed
            gradient changes by at least this fraction; 0 turns phase detection off.
        critical_slack: the slack in a critical regime (≥ ``slack``: less compression; default
            the larger of 1.5 and ``slack``).
        drift: re-measure the link when the measured/predicted exposed-time ratio moves by more
            than this factor (> 1); 0 off; None (default): 2 with a measured cost model, off with
            a given one.
        warmup: steps left out of measurements at the start and after each decision.
        clock: seconds (default ``time.perf_counter``); a simulation or a test passes its own.
        measure: ``f() -> CostModel`` replacing the allgather probe when the link is measured
            again (a simulation or a test; it must return the same on every rank).

    Raises:
        ValueError: a bad option or candidate (naming the fix), e.g. a candidate whose state a
            switch could not carry over (DGC's momentum, lowbit's averaged errors, twophase's
            server residual), a candidate listed twice, ``slack < 1``.

    Example::

        opt = hvdcomp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression="auto")
        ...
        print(opt.auto.decisions[-1])   # step, chosen, predicted and measured step time, why
    """

    name = "auto"

    def __init__(self, candidates=None, slack: float = 1.1, tolerance: float = 1.0, interval: int = 200,
                 window: int = 10, probe: int = 3, accordion: float = 0.5, critical_slack: Optional[float] = None,
                 drift: Optional[float] = None, warmup: int = 1, clock: Optional[Callable[[], float]] = None,
                 measure: Optional[Callable[[], CostModel]] = None):
        self.candidates = _specs(candidates)
        self.slack = _number("slack", slack, 1.0)
        self.tolerance = _number("tolerance", tolerance, 0.0, above=True)
        self.interval = _number("interval", interval, 0, integer=True)
        self.window = _number("window", window, 1, integer=True)
        self.probe = _number("probe", probe, 1, integer=True)
        self.accordion = _number("accordion", accordion, 0.0)
        self.critical_slack = (max(1.5, self.slack) if critical_slack is None
                               else _number("critical_slack", critical_slack, self.slack))
        self.drift = None if drift is None else _number("drift", drift, 0.0)
        if self.drift is not None and 0 < self.drift <= 1:
            raise ValueError(f"auto: drift must be 0 (off) or a factor > 1, e.g. 2; got {drift!r}")
        self.warmup = _number("warmup", warmup, 0, integer=True)
        if self.interval and self.interval < self.warmup + self.probe:
            raise ValueError(f"auto: interval {self.interval} is shorter than a probe (warmup + probe = "
                             f"{self.warmup + self.probe} steps): give interval=0 or >= {self.warmup + self.probe}")
        self.clock = clock or time.perf_counter
        self.measure = measure
        for spec, method in zip(self.candidates, self.instances()):  # (ValueError for a bad spec, now)
            problem = flush_problem(method)
            if problem is not None:
                raise ValueError(f"auto: candidate '{spec}' cannot be switched to and from exactly: {problem}; "
                                 "drop it from candidates")

    def instances(self) -> List[Method]:
        """A fresh instance of every candidate, in order."""
        from .spec import get_compressor

        return [get_compressor(spec) for spec in self.candidates]

    def describe(self):
        return {"name": self.name, "candidates": list(self.candidates), "slack": self.slack,
                "tolerance": self.tolerance, "interval": self.interval, "window": self.window, "probe": self.probe,
                "accordion": self.accordion, "critical_slack": self.critical_slack, "drift": self.drift,
                "warmup": self.warmup}

    def encode(self, tensor, name=None, segments=None):
        """Refused: ``auto`` is a choice among methods, made by the reducer.

        Raises:
            TypeError: always (naming the front-ends that take it).
        """
        raise TypeError("compression='auto' chooses among methods at step boundaries: pass it to "
                        "hvdcomp.DistributedOptimizer (or a training mode built on it); it has no payload of its own")

    decode = compress = decompress = encode


# ---- the policy: agreed numbers in, decisions out (no collectives) -------------------------------------
class Policy:
    """The decisions of one reducer's ``auto``, from numbers every rank agrees on (pure: no
    collectives, no clock), so that every rank decides alike and a test can drive it by hand.

    Args:
        auto: the :class:`Auto` settings.
        labels: the candidates' labels, in order.
        price: ``f(cost_model) -> [comm seconds or None per candidate]``.
        model: the :class:`~hvdcomp.comm.costmodel.CostModel` at start.
        remeasure: ``f() -> CostModel``: measure the link again (collective; called on every rank
            at the same step, since its inputs are agreed).
        drift: the drift factor in force (0: off).

    Attributes:
        current: index of the candidate in use.
        regime: ``"critical"`` or ``"stable"`` (Accordion; always ``"stable"`` with ``accordion=0``).
        decisions: one dict per decision (see :meth:`decide`).
    """

    def __init__(self, auto: Auto, labels: List[str], price, model: CostModel, remeasure, drift: float):
        self.auto, self.labels, self.price, self.remeasure, self.drift = auto, labels, price, remeasure, drift
        self.model = model
        self.comm = price(model)
        self.current = 0
        self.compute_s = 0.0
        self.code_s: List[float] = [0.0] * len(labels)
        self.errors: Optional[List[float]] = None
        self.regime = "critical" if auto.accordion else "stable"  # (Accordion starts critical)
        self.previous_norm: Optional[float] = None
        self.calibration: Optional[float] = None  # measured / predicted exposed seconds, first window
        self.decisions: List[dict] = []

    def start(self) -> dict:
        """The first choice, before anything is measured: the fastest predicted communication
        (ties: the earlier candidate); it runs while the probe measures."""
        priced = [(c, i) for i, c in enumerate(self.comm) if c is not None]
        if not priced:
            raise ValueError("auto: no candidate has a predicted communication time")
        self.current = min(priced)[1]
        return self._record(0, "start", {"index": self.current, "label": self.labels[self.current],
                                         "predicted_step_s": None, "error": None,
                                         "reason": "fastest predicted communication while compute, coding "
                                                   "costs and errors are measured"})

    def rows(self) -> List[Row]:
        """The table the rule sees now."""
        errors = self.errors or [0.0] * len(self.labels)
        return [Row(label, comm, code, err) for label, comm, code, err in zip(self.labels, self.comm, self.code_s, errors)]

    def decide(self, step: int, cause: str) -> dict:
        """Apply :func:`decide` to the current table, regime and cost model; records the decision
        (``step``: the committed step after which it applies; ``cause``: ``"probe"``,
        ``"phase"`` or ``"drift"``) and makes it current."""
        slack = self.auto.critical_slack if self.regime == "critical" else self.auto.slack
        choice = decide(self.rows(), self.compute_s, slack, self.auto.tolerance)
        self.current = choice["index"]
        self.calibration = None
        return self._record(step, cause, choice)

    def _record(self, step: int, cause: str, choice: dict) -> dict:
        rows = self.rows()
        record = {"step": step, "cause": cause, "chosen": choice["label"], "regime": self.regime,
                  "compute_s": self.compute_s, "predicted_step_s": choice["predicted_step_s"],
                  "error": choice["error"], "reason": choice["reason"], "measured_step_s": None,
                  "cost_model": {"alpha_s": self.model.alpha, "beta_s_per_byte": self.model.beta},
                  "table": {r.label: {"comm_s": r.comm_s, "code_s": r.code_s, "error": r.error,
                                      "predicted_step_s": None if r.comm_s is None else r.predicted(self.compute_s)}
                            for r in rows}}
        self.decisions.append(record)
        return record

    def probed(self, step: int, compute_s: float, code_s: List[float], errors: List[float]) -> dict:
        """A probe ended (agreed numbers): new measurements, then a decision."""
        self.compute_s, self.code_s, self.errors = compute_s, list(code_s), list(errors)
        return self.decide(step, "probe")

    def predicted_exposed(self) -> float:
        """Predicted seconds a step of the current candidate spends beyond compute (code + comm)."""
        return self.code_s[self.current] + (self.comm[self.current] or 0.0)

    def window(self, step: int, step_s: float, compute_s: float, exposed_s: float,
               norm: Optional[float]) -> Optional[dict]:
        """A window ended (agreed medians: step, compute-only and exposed seconds; the norm of the
        window's summed averaged gradient, or None). Fills the last decision's measured step
        time, checks the regime and the link; returns a new decision, or None."""
        last = self.decisions[-1]
        if last["measured_step_s"] is None:
            last["measured_step_s"], last["measured_exposed_s"] = step_s, exposed_s
        self.compute_s = compute_s
        cause = None
        if norm is not None and self.auto.accordion:
            if self.previous_norm is not None:
                rate = abs(self.previous_norm - norm) / self.previous_norm if self.previous_norm > 0 else math.inf
                regime = "critical" if rate >= self.auto.accordion else "stable"
                if regime != self.regime:
                    self.regime, cause = regime, "phase"
            self.previous_norm = norm
        predicted = self.predicted_exposed()
        if cause is None and self.drift and self.errors is not None:
            ratio = exposed_s / predicted if predicted > 0 else math.inf
            if self.calibration is None:
                self.calibration = ratio
            elif self.calibration not in (0.0, math.inf):
                moved = max(ratio / self.calibration, self.calibration / ratio) if ratio > 0 else math.inf
                noise = 0.05 * compute_s + 1e-3
                if moved > self.drift and abs(exposed_s - self.calibration * predicted) > noise:
                    self.model = self.remeasure()
                    self.comm = self.price(self.model)
                    cause = "drift"
        if cause is None or self.errors is None:
            return None
        return self.decide(step, cause)


# ---- the glue: what the reducer calls ------------------------------------------------------------------
def _one_rank_comm() -> StepComm:
    """The collectives of a step-wide method's step on one rank (the identity)."""
    return StepComm(lambda tensor, name: tensor, 0, 1, lambda tensor, root, name: tensor)


#: what a checkpoint keeps of the policy and of the probe and window in progress (AutoState.state_dict)
_POLICY = ("compute_s", "code_s", "errors", "regime", "previous_norm", "calibration", "decisions")
_SCHEDULE = ("probe_origin", "next_probe", "window_origin", "records", "probe_records", "probe_code", "probe_err2",
             "probe_norm2", "sum_grad")


class AutoState:
    """``auto`` inside a front-end: every candidate's pipeline, the step clock, the probes and
    windows, the carry of a switch, and the :class:`Policy`.

    Built by the front-end (collective: every rank builds the same pipelines, and measures the
    link unless a cost model is given): the :class:`~hvdcomp.reducer.Reducer`, or the DDP hook
    (:class:`hvdcomp.ddp.hook.HookState`). It calls :meth:`prepare` (or :meth:`add_carry`) before
    gradients are compressed, :meth:`synced` after the step's wait, :meth:`boundary` once a step
    is applied, :meth:`discarded` when one is not.

    Args:
        auto: the :class:`Auto` settings.
        reducer: the front-end: its ``group``, ``settings``, ``order``, ``names``, ``timer``,
            ``prefix``, ``pipe`` (the candidate in use), ``install(pipe)`` and ``between_steps``.
        build: ``f(k, method, settings, gatherer)`` -> candidate ``k``'s pipeline (its
            ``compression`` and ``plan``); default :func:`hvdcomp.assembly.assemble`'s.

    Attributes:
        pipelines: one :class:`hvdcomp.assembly.Pipeline` per candidate left in.
        labels: their labels; ``excluded``: label -> why it was left out.
        policy: the :class:`Policy`; ``decisions``: its decisions.
        carry: parameter name -> residual of a previous method, added to the next step's gradient.
        steps: steps applied so far.

    Raises:
        ValueError: ``cost_model="off"`` (the candidates are priced by the cost model), or no
            candidate left.
    """

    def __init__(self, auto: Auto, reducer, build=None):
        from dataclasses import replace

        from .assembly import assemble
        from .config import check_method

        if build is None:
            def build(k, method, planned, gatherer):
                return assemble(planned, method, reducer.group, reducer.order, reducer.names,
                                f"{reducer.prefix}.auto{k}", reducer.timer, gatherer=gatherer)

        self.auto, self.reducer, self.clock = auto, reducer, auto.clock
        group, settings = reducer.group, reducer.settings
        if settings.cost_model == "off":
            raise ValueError("compression='auto' prices its candidates with the cost model: give cost_model='measure' "
                             "(default) or (alpha_seconds, beta_seconds_per_byte), not 'off'")
        self.order, self.names = reducer.order, reducer.names
        self.by_name = {reducer.names[p]: p for p in reducer.order}
        self.shapes = [p.shape for p in reducer.order]
        self.gatherer = group.allgatherer(settings.allgather, reducer.prefix)
        given = isinstance(settings.cost_model, CostModel)
        self.horovod_latency = 0.0
        if given:
            model = settings.cost_model
        elif group.size > 1:
            model = self._measure()
        else:
            model = CostModel(0.0, 0.0)
        point_to_point = group.size == 1 or group.backend != "horovod" or getattr(self.gatherer, "comm", None) is not None
        self.excluded: Dict[str, str] = {}
        kept = []
        for spec, method in zip(auto.candidates, auto.instances()):
            route = step_route_of(method)
            if route is not None and route.needs_point_to_point and not point_to_point:
                self.excluded[spec] = "needs MPI point-to-point messages (launch with mpirun or horovodrun --mpi)"
                continue
            try:
                check_method(method, None, settings.granularity)
            except ValueError as exc:
                self.excluded[spec] = str(exc)
                continue
            kept.append((spec, method))
        if not kept:
            raise ValueError(f"compression='auto': no candidate can run in this job ({self.excluded})")
        self.labels = [s for s, _ in kept]
        planned = replace(settings, cost_model=model, transport="planned")
        self.pipelines = [build(k, method, planned, self.gatherer) for k, (_, method) in enumerate(kept)]
        fresh = dict(zip(auto.candidates, auto.instances()))
        self.shadows = [fresh[label] for label in self.labels]  # the probes' copies
        # (a leader's top-k, cltk and VAR-Topk, is measured across the ranks: on one rank every
        # leader rule gives the same top-k; the others as on one rank)
        self.across = [getattr(s, "leader", None) is not None and group.size > 1 for s in self.shadows]
        for s, across in zip(self.shadows, self.across):
            s.bind_group(group.size if across else 1)
        self.p, self.bucket_bytes = group.size, settings.bucket_bytes
        drift = auto.drift if auto.drift is not None else (0.0 if given else 2.0)
        self.policy = Policy(auto, self.labels, self._price, model, self._remeasure, drift)
        first = self.policy.start()
        first["route"] = str(self.pipeline.plan)
        self.carry: Dict[str, torch.Tensor] = {}
        self.steps = 0
        self.probe_origin: Optional[int] = 0  # the step the probe in progress starts at (its first `warmup` not measured)
        self.next_probe: Optional[int] = None  # the step the next probe starts at
        self.window_origin: Optional[int] = None  # the first step of the window in progress
        self.records: List[tuple] = []  # this window's (step_s, compute_s, exposed_s) of valid steps
        self.probe_records: List[float] = []
        self.probe_code = [0.0] * len(self.labels)
        self.probe_err2 = [0.0] * len(self.labels)
        self.probe_norm2 = [0.0] * len(self.labels)
        self.snapshot: Optional[Dict[str, torch.Tensor]] = None
        self.sum_grad: Optional[List[torch.Tensor]] = None
        self._reset_step()
        self.snapshot = {} if self._probing(0) else None
        self.mark = self.clock()
        self._event(self.policy.decisions[-1])

    # ---- measurements ----------------------------------------------------------------------------------
    def _measure(self) -> CostModel:
        """α-β by the allgather probe (or ``Auto(measure=...)``) and the wait of a tiny allreduce."""
        if self.auto.measure is not None:
            return self.auto.measure()
        group = self.reducer.group
        model = measure_cost_model(self.gatherer.probe, group.size, agree=self.gatherer.agree)
        self.horovod_latency = group.latency(f"{self.reducer.prefix}.auto.latency") if group.backend == "horovod" else 0.0
        return model

    def _remeasure(self) -> CostModel:
        model = self._measure()
        log.info("hvdcomp auto: link measured again: alpha %.3g s, beta %.3g s/B", model.alpha, model.beta)
        return model

    def _price(self, model: CostModel) -> List[Optional[float]]:
        return [comm_seconds(pipe.compression, model, self.p, self.shapes, self.bucket_bytes, self.horovod_latency)
                for pipe in self.pipelines]

    @property
    def decisions(self) -> List[dict]:
        """Every decision so far (see :meth:`Policy.decide`)."""
        return self.policy.decisions

    @property
    def cost_model(self) -> CostModel:
        """The α-β model in force."""
        return self.policy.model

    @property
    def pipeline(self):
        """The pipeline of the candidate in use."""
        return self.pipelines[self.policy.current]

    def _reset_step(self) -> None:
        self.hook_s = self.sync_s = 0.0
        self.syncs, self.valid, self.in_sync = 0, True, False

    def _probing(self, step: int) -> bool:
        if self.probe_origin is None:
            return False
        first = self.probe_origin + self.auto.warmup
        return first <= step < first + self.auto.probe

    # ---- hooks of the reducer ----------------------------------------------------------------------------
    def prepare(self, u: int) -> None:
        """Unit ``u`` is about to be compressed: add the carry of a switch into its gradients, and
        in a probe step keep a copy of them."""
        units = self.pipeline.units
        self.add_carry((self.names[self.order[i]], units.gradient(self.order[i])) for i in units.members[u])

    def add_carry(self, named) -> None:
        """``(name, gradient)`` pairs about to be compressed: add the carry of a switch into each
        gradient (in place), and in a probe step keep a copy of it."""
        for name, g in named:
            carry = self.carry.get(name)
            if carry is not None:
                g.add_(carry.to(g.dtype).reshape(g.shape))
            if self.snapshot is not None:
                self.snapshot[name] = g.detach().clone()

    def rescale(self, factor: float) -> None:
        """The loss scale changed by ``factor``: the carry is in gradient units too."""
        for c in self.carry.values():
            c.mul_(factor)

    def synced(self, seconds: float) -> None:
        """``synchronize`` took ``seconds``."""
        self.sync_s += seconds
        self.syncs += 1

    def discarded(self) -> None:
        """The step in progress will not be applied: its time is not a step's."""
        self.valid = False

    def skipped(self) -> None:
        """The step in progress was skipped on every rank (a non-finite gradient somewhere): not a
        step (no boundary: probes, windows and decisions stay at the same steps on every rank, a
        joined DDP rank's shadow step included), and its time is not the next step's."""
        self._reset_step()
        self.snapshot = {} if self._probing(self.steps) else None
        self.mark = self.clock()

    def boundary(self, applied: Optional[Callable[[], Dict[str, torch.Tensor]]] = None) -> None:
        """A step was applied (every rank, at the same step): measure it, and at a probe's or a
        window's end agree, decide, and switch. ``applied``: where ``.grad`` does not hold the
        step's averaged gradients (a DDP step committed at its last bucket: a joined rank's shadow
        step, or no optimizer attached), a function returning them (parameter name -> tensor),
        called only where Accordion's norm reads them; None: ``.grad``."""
        now = self.clock()
        step = self.steps
        self.steps += 1
        self.carry = {}  # (the applied step carried it)
        step_s = now - self.mark
        valid = self.valid and self.syncs == 1
        exposed = self.sync_s + self.hook_s
        record = (step_s, step_s - exposed, exposed) if valid else None
        self._reset_step()
        if self.auto.accordion and self.window_origin is not None and step >= self.window_origin:
            self._accumulate(applied() if applied is not None else None)
        if self._probing(step):
            self._shadow(step, record)
            if step == self.probe_origin + self.auto.warmup + self.auto.probe - 1:
                self._end_probe(step)
        elif self.window_origin is not None and step >= self.window_origin:
            if record is not None:
                self.records.append(record)
            if (step - self.window_origin + 1) % self.auto.window == 0:
                self._end_window(step)
        if self.next_probe is not None and self.steps == self.next_probe:
            self._start_probe(self.steps)
        self.snapshot = {} if self._probing(self.steps) else None
        self.mark = self.clock()

    # ---- probes and windows ------------------------------------------------------------------------------
    def _start_probe(self, step: int) -> None:
        self.probe_origin, self.next_probe = step, None
        self.probe_records = []
        self.probe_code = [0.0] * len(self.labels)
        self.probe_err2 = [0.0] * len(self.labels)
        self.probe_norm2 = [0.0] * len(self.labels)

    def _shadow(self, step: int, record) -> None:
        """Compress this step's gradient copy with every candidate, as on one rank, or, for a
        leader's top-k (:attr:`across`), with the group's collectives (docs/auto.md): then
        collective, called by every rank at the same step, a joined DDP rank too."""
        if record is not None:
            self.probe_records.append(record[1])
        grads = self.snapshot or {}
        if not grads:
            return
        named = [(self.names[p], grads[self.names[p]]) for p in self.order if self.names[p] in grads]
        cuda = any(g.is_cuda for _, g in named)
        for k, shadow in enumerate(self.shadows):
            before = {}
            for mem in memories(shadow):
                before.update({n: e.detach().reshape(-1).float().clone() for n, e in mem.committed.items()})
            if cuda:
                torch.cuda.synchronize()
            t0 = self.clock()
            shadow.begin_step()
            if isinstance(shadow, Compressor):
                outs = []
                for name, g in named:
                    payload, ctx = shadow.encode(g, name)
                    outs.append(shadow.decode(payload, ctx))
            else:
                timer = PhaseTimer(cuda_sync=False, clock=self.clock)
                comm = (self.reducer.group.step_comm(timer, f"{self.reducer.prefix}.auto.shadow{k}")
                        if self.across[k] else _one_rank_comm())
                outs = shadow.reduce_batch(named, comm, timer)
                t0 += timer.seconds["communicate"]  # (coding costs only)
            shadow.commit()
            if cuda:
                torch.cuda.synchronize()
            self.probe_code[k] += self.clock() - t0
            kept = {}
            if self.across[k]:
                for mem in memories(shadow):
                    kept.update({n: e.detach().reshape(-1).float() for n, e in mem.committed.items()})
            for (name, g), out in zip(named, outs):
                p = g.reshape(-1).float()
                e = before.get(name)
                if e is not None and e.numel() == p.numel():
                    p = p + e
                left = kept[name] if name in kept else out.reshape(-1).float() - p
                self.probe_err2[k] += float(left.square().sum())
                self.probe_norm2[k] += float(p.square().sum())

    def _end_probe(self, step: int) -> None:
        probed = max(1, self.auto.probe)
        mine = {"compute": statistics.median(self.probe_records) if self.probe_records else 0.0,
                "code": [c / probed for c in self.probe_code], "err2": self.probe_err2, "norm2": self.probe_norm2}
        every = self.reducer.group.allgather_object(mine, f"{self.reducer.prefix}.auto.probe.{step}")
        compute = max(m["compute"] for m in every)
        code = [max(m["code"][k] for m in every) for k in range(len(self.labels))]
        errors = []
        for k in range(len(self.labels)):
            norm2 = sum(m["norm2"][k] for m in every)
            errors.append(math.sqrt(sum(m["err2"][k] for m in every) / norm2) if norm2 > 0 else 0.0)
        self.probe_origin = None
        if self.auto.interval:  # the next decision `interval` steps after this one
            self.next_probe = step + 1 + self.auto.interval - self.auto.warmup - self.auto.probe
        self._apply(self.policy.probed(step, compute, code, errors))

    def _end_window(self, step: int) -> None:
        rows = self.records
        mine = {"valid": len(rows),
                "step": statistics.median(r[0] for r in rows) if rows else 0.0,
                "compute": statistics.median(r[1] for r in rows) if rows else 0.0,
                "exposed": statistics.median(r[2] for r in rows) if rows else 0.0,
                "norm": (math.sqrt(sum(float(b.square().sum()) for b in self.sum_grad))
                         if self.sum_grad is not None else None)}
        every = self.reducer.group.allgather_object(mine, f"{self.reducer.prefix}.auto.window.{step}")
        self.records, self.sum_grad = [], None
        self.window_origin = step + 1
        if min(m["valid"] for m in every) == 0:  # (a window of skipped or discarded steps: nothing measured)
            return
        decision = self.policy.window(step, max(m["step"] for m in every), max(m["compute"] for m in every),
                                      max(m["exposed"] for m in every), every[0]["norm"])
        if decision is not None:
            self._apply(decision)

    def _accumulate(self, applied: Optional[Dict[str, torch.Tensor]]) -> None:
        """Add the applied (averaged) gradient to the window's sum (Accordion's norm)."""
        if applied is None:
            grads = [p.grad.detach() for p in self.order if p.grad is not None and not p.grad.is_sparse]
        else:
            grads = [applied[self.names[p]].detach().view_as(p) for p in self.order if self.names[p] in applied]
        if not grads:
            return
        if self.sum_grad is None:
            self.sum_grad = [g.float().clone() for g in grads]
        elif len(self.sum_grad) == len(grads):
            torch._foreach_add_(self.sum_grad, [g.float() for g in grads])

    # ---- switching ---------------------------------------------------------------------------------------
    def _apply(self, decision: dict) -> None:
        """Install the decision's candidate (at the boundary, between steps) and record it."""
        index = self.labels.index(decision["chosen"])
        decision["route"] = str(self.pipelines[index].plan)
        if self.reducer.pipe is not self.pipelines[index]:
            self.switch(index)
        self.window_origin = self.steps + self.auto.warmup
        self.records, self.sum_grad = [], None
        self._event(decision)
        log.info("hvdcomp auto: step %d: %s (%s) - %s", decision["step"], decision["chosen"], decision["route"],
                 decision["reason"])

    def switch(self, index: int) -> None:
        """Use candidate ``index`` from the next step on: the residuals of the method in use are
        taken out of it into the carry (added to the next step's gradients), then the reducer
        installs the new pipeline. Call between steps (every rank at the same step).

        Raises:
            AssertionError: a step is in progress.
        """
        reducer = self.reducer
        if not reducer.between_steps:
            raise AssertionError("auto: a method is switched between steps only (after step() applied one)")
        old = reducer.pipe
        for name, e in self.take_residuals(old).items():
            self.carry[name] = self.carry[name] + e if name in self.carry else e
        self.policy.current = index
        reducer.install(self.pipelines[index])

    def take_residuals(self, pipe) -> Dict[str, torch.Tensor]:
        """The committed residuals of ``pipe``'s method by parameter name (each in its parameter's
        shape, float32 or the residual's dtype), removed from the method."""
        out: Dict[str, torch.Tensor] = {}
        for mem in memories(pipe.compression):
            for name, e in mem.committed.items():
                members = getattr(pipe.plan, "units", {}).get(name, [name])
                flat, start = e.detach().reshape(-1), 0
                for member in members:
                    p = self.by_name[member]
                    part = flat[start:start + p.numel()].reshape(p.shape).clone()
                    start += p.numel()
                    out[member] = out[member] + part if member in out else part
            mem.load({})
        return out

    # ---- records and checkpoints -------------------------------------------------------------------------
    def _event(self, decision: dict) -> None:
        timer = self.reducer.timer
        if hasattr(timer, "event"):
            timer.event("auto", decision)

    def describe(self) -> dict:
        """JSON-able: the settings, the candidates left out, the cost model and every decision."""
        return {**self.auto.describe(), "candidates": self.labels, "excluded": dict(self.excluded),
                "current": self.labels[self.policy.current], "regime": self.policy.regime,
                "cost_model": {"alpha_s": self.cost_model.alpha, "beta_s_per_byte": self.cost_model.beta},
                "horovod_latency_s": self.horovod_latency, "decisions": self.decisions}

    def state_dict(self) -> dict:
        """The choice, the carry, every candidate's state and all that later decisions depend on
        (docs/auto.md, "Checkpoints"), per rank, in tensors, numbers and strings
        (``torch.load(weights_only=True)``): a run resumed mid-probe decides as the uninterrupted run."""
        policy = self.policy
        return {"current": self.labels[policy.current], "steps": self.steps,
                "carry": {k: v.clone() for k, v in self.carry.items()},
                "candidates": {label: pipe.compression.state_dict() for label, pipe in zip(self.labels, self.pipelines)},
                "shadows": {label: shadow.state_dict() for label, shadow in zip(self.labels, self.shadows)},
                "schedule": {a: copy.deepcopy(getattr(self, a)) for a in _SCHEDULE},
                "policy": {"alpha": policy.model.alpha, "beta": policy.model.beta, "horovod_latency": self.horovod_latency,
                           **{a: copy.deepcopy(getattr(policy, a)) for a in _POLICY}}}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` (between steps; a state without the policy, from an older
        hvdcomp, restores the choice, the carry and the candidates only).

        Raises:
            ValueError: the saved choice is not among this job's candidates, or the checkpoint
                measured another number of candidates.
        """
        if state["current"] not in self.labels:
            raise ValueError(f"auto: the checkpoint's method '{state['current']}' is not among this job's candidates "
                             f"{self.labels}")
        for label, pipe in zip(self.labels, self.pipelines):
            if label in state.get("candidates", {}):
                pipe.compression.load_state_dict(state["candidates"][label])
        for label, shadow in zip(self.labels, self.shadows):
            if label in state.get("shadows", {}):
                shadow.load_state_dict(state["shadows"][label])
        self.carry = {k: v.clone() for k, v in state.get("carry", {}).items()}
        self.steps = int(state.get("steps", self.steps))
        saved, policy = state.get("policy"), self.policy
        if saved is not None:
            if saved["code_s"] and len(saved["code_s"]) != len(self.labels):
                raise ValueError(f"auto: the checkpoint measured {len(saved['code_s'])} candidates, this job has "
                                 f"{len(self.labels)} ({self.labels}): resume with the same candidates")
            policy.model = CostModel(float(saved["alpha"]), float(saved["beta"]))
            self.horovod_latency = float(saved["horovod_latency"])
            policy.comm = policy.price(policy.model)
            for a in _POLICY:
                setattr(policy, a, copy.deepcopy(saved[a]))
            for a in _SCHEDULE:
                setattr(self, a, copy.deepcopy(state["schedule"][a]))
        self._reset_step()
        self.snapshot = {} if self._probing(self.steps) else None
        self.mark = self.clock()
        index = self.labels.index(state["current"])
        policy.current = index
        self.reducer.install(self.pipelines[index])
