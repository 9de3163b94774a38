"""1-bit LAMB: an uncompressed LAMB warm-up, then the variance and the layer-wise trust ratios
frozen, and the momentum averaged by a 1-bit compressed allreduce with worker and server error
feedback; a fresh variance, rebuilt from the averaged momenta, rescales each frozen ratio within
clamps.

Li, Awan, Tang, Rajbhandari and He, "1-bit LAMB: Communication Efficient Large-Scale
Large-Batch Training with LAMB's Convergence Speed", arXiv:2104.06069, 2021;
LAMB: You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
ICLR 2020. The steps and defaults follow DeepSpeed's ``OnebitLamb``.

Per tensor (layer) x with this rank's gradient g_r, γ, (β1, β2), ε, λ, T = ``freeze_step``:

* **warm-up**, t = 1..T, on the averaged gradient ḡ (through :func:`hvdcomp.DistributedOptimizer`
  with ``warmup_compression``): ``m ← β1·m + (1 − β1)·ḡ``, ``v ← β2·v + (1 − β2)·ḡ²``,
  ``u = m/(sqrt(v) + ε) + λ·x``, trust ratio ``r = clamp(‖x‖/‖u‖, min_coeff, max_coeff)`` (1 where
  a norm is 0), ``x ← x − γ·r·u``; the frozen ratio ``r̄ ← β_c·r̄ + (1 − β_c)·r`` (r̄ = 0 at
  first; ratios equal to 1 are left out, as DeepSpeed); at t = T the fresh variance
  ``v_fresh = v``;
* **compressed**, t > T: at the first such step each tensor's momentum scale
  ``s = mean_tensors(rms(m)) / rms(m)`` (rms = ‖m‖/√numel; 1 for an all-zero momentum) is fixed;
  ``m_r = s·(β1·m + (1 − β1)·g_r)``, ``m ← M ⊙ C(m_1..m_N)/s`` (mask M as 1-bit Adam's), the
  gradient it implies ``g̃ = (m − β1·m_prev)/(1 − β1)`` updates ``v_fresh`` (β2), and with the
  frozen v: ``u = m/(sqrt(v) + ε) + λ·x``; the factor ``f = max(elementwise
  (sqrt(v) + ε)/(sqrt(v_fresh) + ε))`` (with λ > 0 blended towards 1 by
  ``ρ = min(1, ‖m/(sqrt(v)+ε)‖/‖u‖)``: ``f·ρ + 1 − ρ``), clamped to [factor_min, factor_max] and to
  within ±``factor_threshold`` of the previous step's f; ``x ← x − γ·r̄·f·u``.

No bias correction (as DeepSpeed's). ``1/(1 − coeff_beta)`` should not exceed ``freeze_step``
(r̄ starts at 0).

Example::

    hvd.init()
    opt = hvdcomp.adaptive_opt.OneBitLamb(model.named_parameters(), lr=11e-3, max_coeff=0.3,
                                          freeze_step=1000)
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from ..checks import check_bool, check_count, check_range
from .base import AdaptiveOptimizer
from .onebit_adam import adam_state, check_adam_hyper

__all__ = ["OneBitLamb", "Lamb"]


def check_lamb_hyper(lr, betas, eps, weight_decay, max_coeff, min_coeff, where: str = "") -> dict:
    """Adam's ranges (:func:`~hvdcomp.adaptive_opt.onebit_adam.check_adam_hyper`) and the trust
    ratio's clamps, ``0 < min_coeff <= max_coeff``; returns them as plain numbers.

    Raises:
        ValueError: naming the argument (and ``where``).
    """
    out = check_adam_hyper(lr, betas, eps, weight_decay, where)
    out["max_coeff"] = check_range(max_coeff, f"max_coeff{where}", 0.0, low_open=True)
    out["min_coeff"] = check_range(min_coeff, f"min_coeff{where}", 0.0, out["max_coeff"], low_open=True,
                                   hint=f" (0 < min_coeff <= max_coeff = {out['max_coeff']:g})")
    return out


class Lamb(torch.optim.Optimizer):
    """LAMB (no bias correction) recording what 1-bit LAMB freezes: the moving average of the
    trust ratios (``lamb_coeff_freeze``) and, at step ``freeze_step``, a copy of the variance
    (``exp_avg_sq_fresh``). The warm-up of :class:`OneBitLamb`, which wraps it in
    :func:`hvdcomp.DistributedOptimizer`; a local optimizer by itself.

    Args:
        params: parameters or groups. lr, betas, eps, weight_decay, max_coeff, min_coeff: LAMB's.
        coeff_beta: β_c of the trust-ratio average.
        freeze_step: the step at which the variance is copied.

    Raises:
        ValueError: out-of-range settings.
        TypeError: a sparse gradient at ``step()``.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_coeff=10.0,
                 min_coeff=0.01, coeff_beta=0.9, freeze_step=1):
        hyper = check_lamb_hyper(lr, betas, eps, weight_decay, max_coeff, min_coeff)
        self.coeff_beta = check_range(coeff_beta, "coeff_beta", 0.0, 1.0, high_open=True)
        self.freeze_step = check_count(freeze_step, "freeze_step", 1)
        super().__init__(params, hyper)
        for i, group in enumerate(self.param_groups):  # (per-group settings: the same ranges)
            check_lamb_hyper(*(group[k] for k in ("lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff")),
                             where=f" (parameter group {i})")

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step on ``p.grad`` (see the :mod:`~hvdcomp.adaptive_opt.onebit_lamb` docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("LAMB does not take sparse gradients: use nn.Embedding(sparse=False)")
                st = self.state[p]
                if len(st) == 0:
                    st.update(lamb_state(p))
                st["step"] += 1
                st["exp_avg"].mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                if int(st["step"]) == self.freeze_step:
                    st["exp_avg_sq_fresh"].copy_(st["exp_avg_sq"])
                update = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + g["eps"])
                if g["weight_decay"]:
                    update.add_(p, alpha=g["weight_decay"])
                w_norm, u_norm = float(p.norm()), float(update.norm())  # trust ratio: 1 where a norm is 0
                ratio = 1.0 if w_norm == 0.0 or u_norm == 0.0 else min(max(w_norm / u_norm, g["min_coeff"]),
                                                                       g["max_coeff"])
                if ratio != 1.0:
                    beta_c = self.coeff_beta
                    st["lamb_coeff_freeze"] = beta_c * st["lamb_coeff_freeze"] + (1.0 - beta_c) * ratio
                p.add_(update, alpha=-g["lr"] * ratio)
        return loss


def lamb_state(p: torch.Tensor) -> dict:
    """Fresh 1-bit LAMB state of ``p``: Adam's, the fresh variance, the trust-ratio average, the
    previous factor and the momentum scale (0 until it is fixed at the first compressed step)."""
    return {**adam_state(p), "exp_avg_sq_fresh": torch.zeros_like(p, memory_format=torch.preserve_format),
            "lamb_coeff_freeze": 0.0, "last_factor": 1.0, "scaling_coeff": 0.0}


class OneBitLamb(AdaptiveOptimizer):
    """1-bit LAMB (see the module docstring).

    Args:
        named_parameters: ``model.named_parameters()`` (or groups of ``(name, parameter)``).
        lr, betas, eps, weight_decay: LAMB's (weight decay inside the update, as LAMB).
        freeze_step: T, the warm-up steps (15-25 % of the run per the authors; 1000 in their BERT
            example).
        max_coeff, min_coeff: the clamp of the trust ratio.
        coeff_beta: β_c of the frozen trust-ratio average.
        factor_max, factor_min, factor_threshold: the clamps of the factor after the warm-up.
        momentum_masks, mask_zero_variance, warmup_compression, process_set, timer, nonfinite, backward_passes_per_step, comm: as
            :class:`~hvdcomp.adaptive_opt.onebit_adam.OneBitAdam`.

    State per parameter: Adam's keys (v frozen after the warm-up), ``exp_avg_sq_fresh``,
    ``lamb_coeff_freeze`` (r̄), ``last_factor``, ``scaling_coeff`` (s); all identical on every
    rank. Per rank: the compressed allreduce's residuals.

    Raises:
        ValueError: ``freeze_step < 1``, bad clamps, and those of 1-bit Adam.
    """

    def __init__(self, named_parameters, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_step: int, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, momentum_masks: Optional[Dict[str, torch.Tensor]] = None,
                 mask_zero_variance: bool = True, warmup_compression: str = "none", process_set=None, timer=None,
                 nonfinite: str = "skip", backward_passes_per_step: int = 1, comm=None):
        hyper = check_lamb_hyper(lr, betas, eps, weight_decay, max_coeff, min_coeff)
        self.freeze_step = self.warmup_steps = check_count(freeze_step, "freeze_step", 1)
        self.coeff_beta = check_range(coeff_beta, "coeff_beta", 0.0, 1.0, high_open=True)
        self.factor_max = check_range(factor_max, "factor_max", 1.0)
        self.factor_min = check_range(factor_min, "factor_min", 0.0, 1.0, low_open=True)
        self.factor_threshold = check_range(factor_threshold, "factor_threshold", 0.0, 1.0, high_open=True)
        self.mask_zero_variance = check_bool(mask_zero_variance, "mask_zero_variance")
        super().__init__(named_parameters, hyper,
                         process_set=process_set, timer=timer, nonfinite=nonfinite,
                         warmup_compression=warmup_compression, backward_passes_per_step=backward_passes_per_step,
                         comm=comm, momentum_masks=momentum_masks)

    def _check_hyper(self, group, where):
        group.update(check_lamb_hyper(*(group[k] for k in ("lr", "betas", "eps", "weight_decay", "max_coeff",
                                                           "min_coeff")), where=where))

    def _hyper(self):
        return {k: getattr(self, k) for k in ("freeze_step", "coeff_beta", "factor_max", "factor_min",
                                              "factor_threshold", "mask_zero_variance")}

    def _init_state(self, p):
        return lamb_state(p)

    def _make_warmup(self):
        d = self.defaults
        return Lamb(self.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                    max_coeff=d["max_coeff"], min_coeff=d["min_coeff"], coeff_beta=self.coeff_beta,
                    freeze_step=self.freeze_step)

    def _fix_scales(self) -> None:
        """At the first compressed step: each tensor's momentum scale s (module docstring)."""
        rms = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(max(1, p.numel())) for p in self.order]
        united = sum(rms) / len(rms)
        for p, r in zip(self.order, rms):
            self.state[p]["scaling_coeff"] = united / r if r > 0 else 1.0

    def _factor(self, st, g, prelim, update, denom) -> float:
        fresh = st["exp_avg_sq_fresh"].sqrt().add_(g["eps"])
        factor = float((denom / fresh).max())
        if g["weight_decay"]:
            u_norm = float(update.norm())
            ratio = min(1.0, float(prelim.norm()) / u_norm) if u_norm > 0 else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = st["last_factor"]
        return min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))

    def _step_after_warmup(self, t, grads):
        if any(self.state[p]["scaling_coeff"] == 0.0 for p in self.order):  # the first compressed step
            self._fix_scales()
        pairs = self.each()
        local = [self.state[p]["exp_avg"].mul(g["betas"][0]).add_(grad, alpha=1.0 - g["betas"][0])
                 .mul_(self.state[p]["scaling_coeff"]) for (p, g), grad in zip(pairs, grads)]
        averaged = self.averaging.compressed("momentum", local)
        if averaged is None:
            return None
        for (p, g), m in zip(pairs, averaged):
            st = self.state[p]
            beta1, beta2 = g["betas"]
            m.div_(st["scaling_coeff"]).mul_(self.momentum_mask(p))
            implied = (m - st["exp_avg"] * beta1).div_(1.0 - beta1)
            st["exp_avg_sq_fresh"].mul_(beta2).addcmul_(implied, implied, value=1.0 - beta2)
            st["exp_avg"].copy_(m)
            denom = st["exp_avg_sq"].sqrt().add_(g["eps"])
            prelim = st["exp_avg"] / denom
            update = prelim.add(p, alpha=g["weight_decay"]) if g["weight_decay"] else prelim
            factor = self._factor(st, g, prelim, update, denom)
            st["last_factor"] = factor
            p.add_(update, alpha=-g["lr"] * st["lamb_coeff_freeze"] * factor)
        self._advance()
        return "onebit"
