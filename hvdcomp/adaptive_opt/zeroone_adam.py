"""0/1 Adam: the variance updated on a sparser and sparser schedule, 1-bit compressed steps in
between, and after the variance freezes, local steps with 1-bit synchronisations at growing
intervals.

Lu, Li, Zhang, De Sa and He, "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam", arXiv:2202.06009, 2022; the steps and defaults follow DeepSpeed's ``ZeroOneAdam``.

With parameters x, this rank's gradient g_r, learning rate γ_t, betas (β1, β2), ``eps`` ε,
``weight_decay`` λ, F = ``var_freeze_step``, κ = ``var_update_scaler``, α = ``local_step_scaler``
and H = ``local_step_clipper``, step t (from 1):

* **variance steps** T_v (:func:`is_variance_step`): k_0 = 1, k_{j+1} = k_j + 2^⌊j/κ⌋, up to F.
  The gradient is averaged in full precision (one fp32 allreduce), ``m ← β1·m + (1 − β1)·ḡ``,
  ``v ← β2·v + (1 − β2)·ḡ²``;
* **other steps up to F**: the gradient is averaged by the 1-bit compressed allreduce
  (:class:`hvdcomp.transports.twophase.TwoPhaseCompressor`, base ``efsignsgd``, its own residuals),
  masked, ``m ← β1·m + (1 − β1)·ĝ``; v unchanged;
  both: ``x ← x·(1 − γλ) − η·m/D`` with ``η = γ/(1 − β1^t)`` and
  ``D = sqrt(v)/sqrt(1 − β2^k) + ε``, k the variance updates so far (``bias_correction=False``:
  η = γ, D = sqrt(v) + ε, as DeepSpeed);
* **after F** (v frozen, so D is): every step is local, ``m ← β1·m + (1 − β1)·g_r``,
  ``x ← x·(1 − γλ) − η·m/D``, and at the **synchronisation steps** T_u
  (:func:`is_sync_step`: k_0 = F + 1, k_{j+1} = k_j + min(2^⌊j/α⌋, H)) the update since the last
  one, ``u = x − x_sync``, is averaged as ``c = u ⊙ D`` by a second compressed allreduce (its own
  residuals, fresh at F); then ``x = x_sync + c̄/D``, ``m = −c̄/Ση`` (the step sizes since the last
  synchronisation), ``x_sync = x``.

The averaged values are masked as 1-bit Adam's (0 where the variance is exactly 0, times
``momentum_masks``). A non-finite local gradient after F is dropped by its rank, and its next
synchronisation sends NaN, so every rank skips (or raises at) that synchronisation alike.
``schedule="deepspeed"``, bias correction and the defaults against DeepSpeed's code:
``docs/adaptive-optimizers.md``. Wire per rank and step: 4n bytes at variance steps, about n/8 at
compressed steps and synchronisations, nothing at local steps.

Example::

    hvd.init()
    opt = hvdcomp.adaptive_opt.ZeroOneAdam(model.named_parameters(), lr=1e-3, var_freeze_step=1000,
                                           local_step_scaler=1000)
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..checks import check_bool, check_choice, check_count
from .base import AdaptiveOptimizer
from .onebit_adam import adam_state, check_adam_hyper

__all__ = ["ZeroOneAdam", "is_variance_step", "is_sync_step", "variance_updates", "local_interval", "step_kinds",
           "SCHEDULES"]


#: the schedules :class:`ZeroOneAdam` offers (``schedule=``)
SCHEDULES = ("paper", "deepspeed")


def _check_schedule(schedule: str) -> None:
    check_choice(schedule, "schedule", SCHEDULES)


def _variance_steps(last: int, kappa: int, schedule: str):
    """The variance steps up to ``last`` (1-based), ascending (:func:`is_variance_step`).
    ``"deepspeed"``, in DeepSpeed's counter c = t + 1: κ steps at interval 1 (c = 2 .. κ + 1),
    then κ multiples of 2 after the last one, κ multiples of 4 after that, ..."""
    if schedule == "paper":
        t, j = 1, 0
        while t <= last:
            yield t
            t, j = t + 2 ** (j // kappa), j + 1
        return
    c, interval = 1, 1  # c: DeepSpeed's counter of the last variance step so far
    while True:
        for _ in range(kappa):
            c = (c // interval + 1) * interval
            if c - 1 > last:
                return
            yield c - 1
        interval *= 2


def is_variance_step(t: int, var_freeze_step: int, var_update_scaler: int = 16, schedule: str = "paper") -> bool:
    """Whether 0/1 Adam updates the variance at step ``t`` (1-based), t ≤ F (F = ``var_freeze_step``).

    ``schedule="paper"``: t = k_j with k_0 = 1, k_{j+1} = k_j + 2^⌊j/κ⌋ (κ = ``var_update_scaler``).
    ``"deepspeed"``: DeepSpeed's rule, in its step counter c = t + 1 (its first ``step()`` call
    only sets up its buffers): the interval doubles after every κ variance updates, and a
    variance step is a multiple of the current interval.

    Raises:
        ValueError: an unknown ``schedule``.
    """
    _check_schedule(schedule)
    return 1 <= t <= var_freeze_step and t in _variance_steps(t, var_update_scaler, schedule)


def variance_updates(t: int, var_freeze_step: int, var_update_scaler: int = 16, schedule: str = "paper") -> int:
    """How many of steps 1..t are variance steps (:func:`is_variance_step`)."""
    _check_schedule(schedule)
    return sum(1 for _ in _variance_steps(min(t, var_freeze_step), var_update_scaler, schedule))


def local_interval(t: int, var_freeze_step: int, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                   schedule: str = "paper") -> int:
    """The local interval (steps between synchronisations) in force at step ``t`` > F.

    ``schedule="paper"``: min(2^⌊j/α⌋, H) for the j-th synchronisation interval: it doubles
    after every α *synchronisations*. ``"deepspeed"``: min(2^⌊(t − F − 1)/α⌋, H): it doubles
    after every α *steps* after F, so it reaches H sooner.

    Raises:
        ValueError: ``t`` ≤ F, an unknown ``schedule``.
    """
    _check_schedule(schedule)
    if t <= var_freeze_step:
        raise ValueError(f"step {t} is not after var_freeze_step {var_freeze_step}: no local interval")
    alpha, clip = local_step_scaler, local_step_clipper
    if schedule == "deepspeed":
        return min(2 ** min((t - var_freeze_step - 1) // alpha, clip.bit_length()), clip)
    return _paper_interval(t - var_freeze_step - 1, alpha, clip)[1]


def _paper_interval(offset: int, alpha: int, clip: int):
    """(steps since the start of its run of equal intervals, that interval) of the step ``offset``
    steps after F + 1, under the published rule (each interval repeated α times, doubling up to H)."""
    start, b = 0, 0
    while True:
        interval = min(2 ** b, clip)
        if interval == clip or offset < start + alpha * interval:
            return offset - start, interval
        start += alpha * interval
        b += 1


def is_sync_step(t: int, var_freeze_step: int, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 schedule: str = "paper") -> bool:
    """Whether 0/1 Adam synchronises at step ``t`` (1-based); no step up to F is one (they all
    communicate).

    ``schedule="paper"``: t = k_j with k_0 = F + 1, k_{j+1} = k_j + min(2^⌊j/α⌋, H)
    (α = ``local_step_scaler``, H = ``local_step_clipper``). ``"deepspeed"``: DeepSpeed's rule,
    in its step counter c = t + 1: c is a multiple of the interval in force
    (:func:`local_interval`, which doubles every α steps).

    Raises:
        ValueError: an unknown ``schedule``.
    """
    _check_schedule(schedule)
    if t <= var_freeze_step:
        return False
    if schedule == "deepspeed":
        return (t + 1) % local_interval(t, var_freeze_step, local_step_scaler, local_step_clipper, schedule) == 0
    into, interval = _paper_interval(t - var_freeze_step - 1, local_step_scaler, local_step_clipper)
    return into % interval == 0


def step_kinds(steps: int, var_freeze_step: int, var_update_scaler: int = 16, local_step_scaler: int = 32678,
               local_step_clipper: int = 16, schedule: str = "paper") -> Dict[str, int]:
    """How many of steps 1..``steps`` are variance steps (``"full"``: 4 bytes per parameter and
    rank), 1-bit steps up to F (``"onebit"``: about 1/8 byte), synchronisations (``"sync"``:
    about 1/8 byte) and local steps (``"local"``: none), under ``schedule``: what a run's volume
    will be."""
    _check_schedule(schedule)
    kinds = {"full": 0, "onebit": 0, "sync": 0, "local": 0}
    variance = set(_variance_steps(min(steps, var_freeze_step), var_update_scaler, schedule))
    for t in range(1, steps + 1):
        if t <= var_freeze_step:
            kinds["full" if t in variance else "onebit"] += 1
        else:
            sync = is_sync_step(t, var_freeze_step, local_step_scaler, local_step_clipper, schedule)
            kinds["sync" if sync else "local"] += 1
    return kinds


class ZeroOneAdam(AdaptiveOptimizer):
    """0/1 Adam (see the module docstring).

    Args:
        named_parameters: ``model.named_parameters()`` (or groups of ``(name, parameter)``).
        lr, betas, eps, weight_decay: Adam's (weight decay decoupled).
        bias_correction: Adam's bias correction (the variance by its number of updates); False:
            none, as DeepSpeed.
        var_freeze_step: F, the last step that may update the variance (usually the end of the
            learning-rate warm-up; larger than the run: the variance never freezes and no local
            step is taken).
        var_update_scaler: κ, variance updates per interval before the interval doubles (16 works
            for BERT, GPT and ImageNet according to the authors).
        local_step_scaler: α, synchronisations per local interval before it doubles.
        local_step_clipper: H, the longest local interval (steps).
        schedule: ``"paper"`` (default: the published rules) or ``"deepspeed"`` (DeepSpeed's
            code): :func:`is_variance_step`, :func:`is_sync_step`.
        momentum_masks: ``{parameter name: tensor of 0/1}``: coordinates whose averaged values are
            dropped, on top of the zero-variance mask.
        process_set, timer, nonfinite, backward_passes_per_step, comm: see
            :class:`hvdcomp.adaptive_opt.base.AdaptiveOptimizer`.

    State per parameter: ``step``, ``exp_avg`` (m), ``exp_avg_sq`` (v), ``params_at_sync``
    (x at the last synchronisation) and ``lr_sum`` (Ση since, the same on every rank); m and x
    differ between ranks between synchronisations. Per rank: the residuals of both compressed allreduces.

    Raises:
        ValueError: F, κ, α or H < 1, an unknown ``schedule``, Adam's ranges, bad masks, and those of
            :class:`~hvdcomp.adaptive_opt.base.AdaptiveOptimizer`.
    """

    _reducer_keys = ("gradient", "sync")

    def __init__(self, named_parameters, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, bias_correction: bool = True,
                 schedule: str = "paper", momentum_masks: Optional[Dict[str, torch.Tensor]] = None, process_set=None, timer=None,
                 nonfinite: str = "skip", backward_passes_per_step: int = 1, comm=None):
        hyper = check_adam_hyper(lr, betas, eps, weight_decay)
        self.var_freeze_step = check_count(var_freeze_step, "var_freeze_step", 1)
        self.var_update_scaler = check_count(var_update_scaler, "var_update_scaler", 1)
        self.local_step_scaler = check_count(local_step_scaler, "local_step_scaler", 1)
        self.local_step_clipper = check_count(local_step_clipper, "local_step_clipper", 1)
        self.bias_correction = check_bool(bias_correction, "bias_correction")
        _check_schedule(schedule)
        self.schedule = schedule
        self._poisoned = False  # a local gradient was non-finite since the last synchronisation
        super().__init__(named_parameters, hyper,
                         process_set=process_set, timer=timer, nonfinite=nonfinite,
                         backward_passes_per_step=backward_passes_per_step, comm=comm, momentum_masks=momentum_masks)

    def _hyper(self):
        return {k: getattr(self, k) for k in ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                                              "local_step_clipper", "bias_correction", "schedule")}

    def _init_state(self, p):
        return {**adam_state(p), "params_at_sync": p.detach().clone(), "lr_sum": 0.0}

    def _step_after_warmup(self, t, grads):
        step = t + 1
        if step <= self.var_freeze_step:
            return self._communicating_step(step, grads)
        return self._local_step(step, grads)

    def _communicating_step(self, step, grads):
        """A step up to F: full precision (variance steps) or 1-bit, then Adam's update."""
        full = is_variance_step(step, self.var_freeze_step, self.var_update_scaler, self.schedule)
        averaged = self.averaging.full(grads) if full else self.averaging.compressed("gradient", grads)
        if averaged is None:
            return None
        for (p, g), a in zip(self.each(), averaged):
            st = self.state[p]
            beta1, beta2 = g["betas"]
            if full:
                st["exp_avg_sq"].mul_(beta2).addcmul_(a, a, value=1.0 - beta2)
            else:
                a = a.mul_(self.momentum_mask(p))
            st["exp_avg"].mul_(beta1).add_(a, alpha=1.0 - beta1)
        if full:
            self._variance_changed()
        for p, g in self.each():
            self._adam_update(p, g, step, self._denominator(p, g, step))
            if step == self.var_freeze_step:  # local steps start from here
                self.state[p]["params_at_sync"].copy_(p)
        self._advance()
        return "full" if full else "onebit"

    def _step_size(self, g, step: int) -> float:
        """η: the learning rate, over ``1 − β1^t`` with bias correction."""
        return g["lr"] / (1.0 - g["betas"][0] ** step) if self.bias_correction else g["lr"]

    def _denominator(self, p, g, step: int) -> torch.Tensor:
        """D: ``sqrt(v)/sqrt(1 − β2^k) + ε`` (k variance updates so far), or ``sqrt(v) + ε``."""
        root = self.state[p]["exp_avg_sq"].sqrt()
        if self.bias_correction:
            k = variance_updates(step, self.var_freeze_step, self.var_update_scaler, self.schedule)
            root.div_((1.0 - g["betas"][1] ** k) ** 0.5)
        return root.add_(g["eps"])

    def _adam_update(self, p, g, step: int, denom: torch.Tensor) -> None:
        if g["weight_decay"]:
            p.mul_(1.0 - g["lr"] * g["weight_decay"])
        p.addcdiv_(self.state[p]["exp_avg"], denom, value=-self._step_size(g, step))

    def _local_step(self, step, grads):
        """A step after F: local Adam update; at a synchronisation, the averaged update since the last one."""
        finite = self.nonfinite == "ignore" or all(bool(torch.isfinite(x).all()) for x in grads)
        if not finite:  # dropped here; the next synchronisation makes every rank see it
            self._poisoned = True
        pairs = self.each()
        denoms = [self._denominator(p, g, step) for p, g in pairs]  # (constant after F)
        for (p, g), grad, d in zip(pairs, grads, denoms):
            st = self.state[p]
            st["lr_sum"] += self._step_size(g, step)  # every rank counts every step, one it dropped too
            if finite:
                st["exp_avg"].mul_(g["betas"][0]).add_(grad, alpha=1.0 - g["betas"][0])
                self._adam_update(p, g, step, d)
        if not is_sync_step(step, self.var_freeze_step, self.local_step_scaler, self.local_step_clipper,
                            self.schedule):
            self._advance()
            return "local"
        updates = [(p - self.state[p]["params_at_sync"]).mul_(d) for (p, _), d in zip(pairs, denoms)]
        if self._poisoned:
            for u in updates:
                u.fill_(float("nan"))
        self._poisoned = False
        averaged = self.averaging.compressed("sync", updates)
        if averaged is None:  # skipped on every rank: the local steps go on
            self._advance()
            return "local"
        for (p, _), c, d in zip(pairs, averaged, denoms):
            st = self.state[p]
            c.mul_(self.momentum_mask(p))
            p.copy_(st["params_at_sync"]).addcdiv_(c, d)
            st["params_at_sync"].copy_(p)
            if st["lr_sum"] > 0:
                st["exp_avg"].copy_(c).div_(-st["lr_sum"])
            st["lr_sum"] = 0.0
        self._advance()
        return "sync"
