"""``adaptive``: per-layer compression settings chosen by dynamic programming under a byte budget.

Alimohammadi, Markov, Frantar and Alistarh, "L-GreCo: Layerwise-Adaptive Gradient Compression for
Efficient and Accurate Deep Learning", MLSys 2024.

A wrapper around a per-tensor method ``base`` with one knob (:data:`KNOBS`). Each layer l gets
the candidate c_l minimising Σ_l err_l(c_l) (the mean over ranks of ‖x_l − C_c(x_l)‖²) subject
to Σ_l bytes_l(c_l) ≤ the uniform setting's bytes (:func:`choose_settings`). Every ``every``
encodes of a name the errors of all candidates are measured and travel as one extra ``(C,)
float32`` tensor at the end of the payload, so every rank re-plans on the same mean table,
without a collective of its own. The schedule and the program in full: docs/methods.md,
"Per-layer settings".
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional

import numpy as np
import torch

from .base import Compressor, ErrorBound
from .registry import compressor_class, create, register
from .topk import check_density
from ..checks import check_choice, check_count, check_int

__all__ = ["AdaptiveCompressor", "choose_settings", "KNOBS"]

#: base method → the argument the wrapper varies per layer. Bases must compress one tensor at a
#: time (not batched), keep no residual of their own, and know their payload bytes in advance.
KNOBS = {"topk": "density", "randomk": "density", "qsgd": "levels"}

#: default candidates as multiples of the uniform setting
DEFAULT_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


def choose_settings(errors: np.ndarray, costs: np.ndarray, uniform: int,
                    resolution: Optional[int] = None) -> np.ndarray:
    """The per-layer candidate minimising total error within the uniform choice's total bytes.

    Args:
        errors: ``(L, C)`` float64, error of candidate c on layer l (finite, ≥ 0).
        costs: ``(L, C)`` integer bytes of candidate c on layer l (≥ 0).
        uniform: column index of the uniform setting; the budget is ``costs[:, uniform].sum()``.
        resolution: R, the number of byte units (default min(budget, max(4096, 64·L)): whole bytes,
            so exact, for budgets up to that; otherwise each layer may lose up to one unit,
            at most L/R ≤ 1/64 of the budget in all).

    Returns:
        ``(L,)`` int64 candidate indices: a plan with ``Σ costs ≤ budget`` and
        ``Σ errors ≤ Σ errors[:, uniform]``; among plans whose costs fit in R units of
        ``budget / R`` bytes (rounded up), one of least error (ties: lowest candidate index,
        then fewest units).

    Raises:
        ValueError: shapes disagree or ``uniform`` is out of range.
    """
    errors = np.asarray(errors, dtype=np.float64)
    costs = np.asarray(costs, dtype=np.int64)
    if errors.shape != costs.shape or errors.ndim != 2 or not 0 <= uniform < errors.shape[1]:
        raise ValueError(f"choose_settings needs errors and costs of one (L, C) shape and "
                         f"0 <= uniform < C, got {errors.shape}, {costs.shape}, uniform={uniform}")
    layers, ncand = errors.shape
    fallback = np.full(layers, uniform, dtype=np.int64)
    budget = int(costs[:, uniform].sum())
    if layers == 0 or budget == 0:
        return fallback
    res = int(resolution or min(budget, max(4096, 64 * layers)))
    unit = budget / res
    weights = np.ceil(costs / unit - 1e-9).astype(np.int64)  # (rounding noise must not add a unit)
    best = np.full(res + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((layers, res + 1), dtype=np.int16)
    for layer in range(layers):
        new = np.full(res + 1, np.inf)
        for c in range(ncand):
            w = int(weights[layer, c])
            if w > res:
                continue
            shifted = np.full(res + 1, np.inf)
            shifted[w:] = best[:res + 1 - w] + errors[layer, c]
            better = shifted < new
            new[better] = shifted[better]
            choice[layer, better] = c
        best = new
    end = int(np.argmin(best))
    if not np.isfinite(best[end]) or best[end] >= errors[:, uniform].sum():
        return fallback
    plan = np.empty(layers, dtype=np.int64)
    for layer in range(layers - 1, -1, -1):
        c = int(choice[layer, end])
        plan[layer] = c
        end -= int(weights[layer, c])
    return plan


def _parse_candidates(candidates, budget, knob: str) -> List:
    if candidates is None:
        values = [budget * f for f in DEFAULT_FACTORS]
    elif isinstance(candidates, str):
        values = [float(v) for v in candidates.split("/") if v.strip()]
    elif isinstance(candidates, (int, float)):
        values = [candidates]
    else:
        values = list(candidates)
    if knob == "density":
        values = [min(1.0, float(v)) for v in values]
    else:
        values = [max(1, int(round(float(v)))) for v in values]
    values.append(budget)
    return sorted(set(values))


@register("adaptive")
class AdaptiveCompressor(Compressor):
    """Per-layer settings of ``base`` chosen by dynamic programming (docs/methods.md, "Per-layer settings").

    Args:
        base: a method of :data:`KNOBS` (``topk``, ``randomk``, ``qsgd``).
        budget: the uniform setting of the base's knob (density for top-k / random-k, levels for
            QSGD); its bytes are the budget. Default: the base method's own default (top-k:
            density 0.01).
        candidates: the settings a layer may get, ``"0.0025/0.005/0.01/0.02/0.04"`` in a spec
            (``/``-separated) or a list; default ``budget × {1/4, 1/2, 1, 2, 4}`` (densities
            capped at 1, levels rounded to integers ≥ 1). ``budget`` is always a candidate.
        every: measure and re-plan every ``every`` steps (≥ 1).
        **base_args: the base method's other arguments (e.g. ``bucket=512`` for QSGD).

    Transport: the base method's (allreduce for random-k, allgather for top-k and QSGD).

    State (:meth:`state_dict`, all identical on every rank): ``steps`` (encodes per name),
    ``errors`` (name → (round, (C,) float64 mean errors) of the last measurement), ``plan``
    (name → candidate index), ``plan_round``, and each candidate's own state.

    Raises:
        ValueError: ``base`` not in :data:`KNOBS`, ``budget`` out of the base's range,
            ``every < 1``, bad ``candidates``, or the base's own argument errors.
    """

    name = "adaptive"
    aggregate_is_mean = False  # the measured errors must travel with the payload
    shared_state_keys = ("steps", "numels", "errors", "plan", "plan_round")

    def __init__(self, base: str = "topk", budget=None, candidates=None, every: int = 200, **base_args):
        check_choice(base, "base", tuple(sorted(KNOBS)), " (per-tensor methods with one knob and known payload "
                                                           "bytes, e.g. 'adaptive:base=topk')")
        self.knob = KNOBS[base]
        if budget is None:  # the base method's own default setting
            budget = inspect.signature(compressor_class(base).__init__).parameters[self.knob].default
        if self.knob in base_args:
            raise ValueError(f"adaptive sets {self.knob} per layer: give the uniform value as budget=, "
                             f"not {self.knob}=")
        every = check_count(every, "every", 1, " (steps between re-plans)")
        if self.knob == "density":  # (candidates above 1 are capped; the uniform setting must be valid)
            budget = check_density(budget, "budget")
        else:
            budget = check_int(budget, "budget", 1, 32767, f" (the uniform {self.knob})")
        self.base, self.every, self.base_args = base, every, dict(base_args)
        try:
            self.settings = _parse_candidates(candidates, budget, self.knob)
        except (TypeError, ValueError):
            raise ValueError(f"candidates must be numbers separated by '/', e.g. "
                             f"candidates=0.005/0.01/0.02, got {candidates!r}") from None
        self.budget = self.settings[self.settings.index(
            min(1.0, float(budget)) if self.knob == "density" else max(1, int(round(float(budget)))))]
        self.uniform = self.settings.index(self.budget)
        self.methods = [create(base, **{self.knob: s}, **base_args) for s in self.settings]
        if any(not isinstance(m, Compressor) or m.builtin_error_feedback for m in self.methods):  # pragma: no cover - KNOBS
            raise ValueError(f"adaptive cannot wrap '{base}'")
        self.payload_kind = self.methods[0].payload_kind
        self.default_error_feedback = self.methods[0].default_error_feedback
        self.steps: Dict[str, int] = {}
        self.errors: Dict[str, tuple] = {}
        self.plan: Dict[str, int] = {}
        self.numels: Dict[str, int] = {}
        self.plan_round = -1

    def describe(self):
        return {"name": self.name, "base": self.base, "budget": self.budget, "every": self.every,
                "candidates": self.settings, **self.base_args}

    @property
    def error_bound(self):
        """None: its density follows error-feedback statistics from earlier calls."""
        return ErrorBound("none", "it adapts its density from error-feedback statistics of earlier calls: use topk")

    def nominal_ratio(self, numel):
        """None: each layer's setting changes with the plan."""
        return None

    def expected_payload_bytes(self, numel):
        """None: the bytes follow the plan (at most the uniform setting's over all layers)."""
        return None

    def bind_group(self, size):
        super().bind_group(size)
        for m in self.methods:
            m.bind_group(size)

    def set_epoch(self, epoch):
        for m in self.methods:
            m.set_epoch(epoch)

    # ---- the plan ---------------------------------------------------------------------------------
    def setting_of(self, name: str):
        """The knob value layer ``name`` uses now (the uniform budget until a plan exists)."""
        return self.settings[self.plan.get(name, self.uniform)]

    def _replan(self, wanted: int) -> None:
        """Solve the program on the measurements of round ``wanted`` (layers measured in it, in
        name order; others keep the uniform setting)."""
        names = sorted(n for n, (r, _) in self.errors.items() if r == wanted)
        plan = {}
        if names:
            errors = np.stack([self.errors[n][1] for n in names])
            errors = np.nan_to_num(errors, nan=np.finfo(np.float64).max, posinf=np.finfo(np.float64).max)
            costs = np.array([[m.expected_payload_bytes(self.numels[n]) or 0 for m in self.methods]
                              for n in names], dtype=np.int64)
            plan = dict(zip(names, choose_settings(errors, costs, self.uniform).tolist()))
        self.plan, self.plan_round = plan, wanted

    # ---- Compressor API ----------------------------------------------------------------------------
    def _encode(self, tensor, name=None):
        if name is None:
            raise ValueError("adaptive chooses a setting per parameter and needs its name: use "
                             "hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        t = self._get("steps", name, 0)
        self._put("steps", name, t + 1)
        self.numels[name] = tensor.numel()
        if t >= 1 and (t - 1) // self.every != self.plan_round:
            self._replan((t - 1) // self.every)
        chosen = self.plan.get(name, self.uniform)
        payload, ctx = self.methods[chosen].encode(tensor, name)
        measuring = t % self.every == 0
        if measuring:
            x = tensor.detach().to(torch.float64)
            errs = []
            for c, method in enumerate(self.methods):
                if c == chosen:
                    dec = method.decode([p.clone() for p in payload], ctx)
                else:
                    p_c, ctx_c = method.encode(tensor, name)
                    dec = method.decode(p_c, ctx_c)
                errs.append(float((x - dec.to(torch.float64)).pow(2).sum()))
            payload = list(payload) + [torch.tensor(errs, dtype=torch.float32, device=tensor.device)
                                       .clamp(max=torch.finfo(torch.float32).max)]
        return payload, (chosen, ctx, measuring, name, t // self.every)

    def _unwrap(self, payloads, ctx):
        """The chosen method and ``payloads`` without their error tables; on measuring steps the
        mean over ranks of the tables is kept for the next plan (after an allreduce the one table
        is the mean already)."""
        chosen, _, measuring, name, rnd = ctx
        if measuring:
            mean = torch.stack([p[-1].to(torch.float64).cpu() for p in payloads]).mean(0).numpy()
            self._put("errors", name, (rnd, mean))
            payloads = [p[:-1] for p in payloads]
        return self.methods[chosen], payloads

    def decode(self, payload, ctx):
        """The base method's decode of ``payload`` (:meth:`_unwrap`)."""
        method, (payload,) = self._unwrap([payload], ctx)
        return method.decode(payload, ctx[1])

    def decode_into(self, out, payload, ctx):
        method, (payload,) = self._unwrap([payload], ctx)
        return method.decode_into(out, payload, ctx[1])

    def aggregate(self, payloads, ctx):
        """The base method's aggregate of every rank's payload (:meth:`_unwrap`)."""
        method, payloads = self._unwrap(payloads, ctx)
        return method.aggregate(payloads, ctx[1])

    def aggregate_into(self, out, payloads, ctx):
        method, payloads = self._unwrap(payloads, ctx)
        return method.aggregate_into(out, payloads, ctx[1])

    def residual_(self, p, payload, ctx):
        """The base method's residual of this rank's own payload (nothing is recorded)."""
        return self.methods[ctx[0]].residual_(p, payload[:-1] if ctx[2] else payload, ctx[1])

    # ---- staged state and checkpoints ------------------------------------------------------------
    def staged_children(self):
        """The candidate methods: their state is part of this method's step."""
        return self.methods

    def rescale_state(self, factor):
        for m in self.methods:
            m.rescale_state(factor)

    def state_dict(self):
        return {"steps": dict(self.steps), "numels": dict(self.numels),
                "errors": {n: (r, e.copy()) for n, (r, e) in self.errors.items()},
                "plan": dict(self.plan), "plan_round": self.plan_round,
                "candidates": [m.state_dict() for m in self.methods]}

    def load_state_dict(self, state):
        self._check_state_keys(state, "steps", "numels", "errors", "plan", "plan_round", "candidates")
        self.steps = dict(state.get("steps", {}))
        self.numels = dict(state.get("numels", {}))
        self.errors = {n: (r, np.array(e, dtype=np.float64)) for n, (r, e) in state.get("errors", {}).items()}
        self.plan = dict(state.get("plan", {}))
        self.plan_round = int(state.get("plan_round", -1))
        for m, s in zip(self.methods, state.get("candidates", [{}] * len(self.methods))):
            m.load_state_dict(s)
