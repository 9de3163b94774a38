"""1-bit Adam: an uncompressed Adam warm-up, then the variance frozen and the momentum averaged
by a 1-bit compressed allreduce with worker and server error feedback.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed", ICML 2021 (arXiv:2102.02888); the settings
and the mask follow the authors' implementation (DeepSpeed's ``OnebitAdam``).

With parameters x, this rank's gradient g_r, learning rate γ, betas (β1, β2), ``eps`` ε,
``weight_decay`` λ and T = ``freeze_step``:

* steps t = 1..T (warm-up): ``torch.optim.AdamW`` on the gradient averaged over the ranks, through
  :func:`hvdcomp.DistributedOptimizer` with compression ``warmup_compression``, bit for bit
  ``hvdcomp.DistributedOptimizer(torch.optim.AdamW(...))``;
* steps t > T: ``m_r = β1·m + (1 − β1)·g_r`` on each rank; ``m = M ⊙ C(m_1, ..., m_N)``, the
  compressed allreduce (:class:`hvdcomp.transports.twophase.TwoPhaseCompressor`, base
  ``efsignsgd``, the whole model as one vector); then
  ``x ← x·(1 − γλ) − γ/(1 − β1^t) · m / (sqrt(v_T)/sqrt(1 − β2^T) + ε)``.

M is 0 where the frozen variance is exactly 0, times the user's ``momentum_masks``. The choices
(bias correction, the scale, the mask) and how they differ from DeepSpeed's:
``docs/adaptive-optimizers.md``. ``momentum_averaging="exact"`` is the ablation: the momentum
averaged by a float32 allreduce. Wire per rank and compressed step: about n/8 bytes (n
parameters); the warm-up's 4n.

Example::

    hvd.init()
    opt = hvdcomp.adaptive_opt.OneBitAdam(model.named_parameters(), lr=1e-3, freeze_step=2000)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch

from ..checks import check_bool, check_choice, check_count, check_range
from ..spec import get_compressor
from .base import AdaptiveOptimizer

__all__ = ["OneBitAdam", "check_adam_hyper", "check_betas", "MOMENTUM_AVERAGING"]

#: how 1-bit Adam averages the momentum after the warm-up: the compressed allreduce, or the ablation
MOMENTUM_AVERAGING = ("onebit", "exact")


def check_betas(betas, where: str = "") -> Tuple[float, float]:
    """(β1, β2): two real numbers in [0, 1) (a tuple or list).

    Raises:
        ValueError: naming ``betas`` (and ``where``, e.g. a parameter group).
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas{where} must be two numbers in [0, 1), e.g. betas=(0.9, 0.999), got {betas!r}")
    return tuple(check_range(b, f"betas[{i}]{where}", 0.0, 1.0, high_open=True, hint=" (e.g. betas=(0.9, 0.999))")
                 for i, b in enumerate(betas))


def check_adam_hyper(lr: float, betas, eps: float, weight_decay: float, where: str = "") -> dict:
    """Adam's hyper-parameter ranges (:mod:`hvdcomp.checks`): ``lr``, ``eps`` and
    ``weight_decay`` finite numbers >= 0, ``betas`` two numbers in [0, 1). ``where`` names the
    parameter group in messages. Returns them as plain floats.

    Raises:
        ValueError: naming the argument, its range and the value.
    """
    return {"lr": check_range(lr, f"lr{where}", 0.0), "betas": check_betas(betas, where),
            "eps": check_range(eps, f"eps{where}", 0.0), "weight_decay": check_range(weight_decay, f"weight_decay{where}", 0.0)}


def adam_state(p: torch.Tensor) -> dict:
    """Fresh Adam state of ``p`` as ``torch.optim.Adam`` makes it (step: a 0-d CPU tensor)."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return {"step": torch.tensor(0.0, dtype=scalar),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


class OneBitAdam(AdaptiveOptimizer):
    """1-bit Adam (see the module docstring).

    Args:
        named_parameters: ``model.named_parameters()`` (or groups of ``(name, parameter)``).
        lr, betas, eps, weight_decay: Adam's (weight decay decoupled, as AdamW).
        freeze_step: T, the warm-up steps (uncompressed Adam) before the variance freezes (the
            authors: 15-25 % of the training steps; ``docs/adaptive-optimizers.md``, "Choosing
            ``freeze_step``").
        momentum_masks: ``{parameter name: tensor of 0/1}`` (the parameter's shape): coordinates
            whose momentum is dropped after the warm-up, on top of the zero-variance mask.
        mask_zero_variance: also mask coordinates whose frozen variance is exactly 0 (default).
        momentum_averaging: ``"onebit"`` (default: the compressed allreduce) or ``"exact"`` (the
            ablation: a float32 allreduce of the momentum; its steps are ``"full"``).
        warmup_compression: the warm-up's compression (an hvdcomp spec; default ``"none"``).
        process_set, timer, nonfinite, backward_passes_per_step, comm: see
            :class:`hvdcomp.adaptive_opt.base.AdaptiveOptimizer`.

    State (per parameter, torch's Adam keys): ``step``, ``exp_avg`` (m: after the warm-up the
    averaged momentum, identical on every rank), ``exp_avg_sq`` (v; frozen after the warm-up);
    per rank: the compressed allreduce's residuals.

    Raises:
        ValueError: ``freeze_step < 1``, Adam's ranges (:func:`check_adam_hyper`), bad masks, an
            unknown ``momentum_averaging``, and those of :class:`~hvdcomp.adaptive_opt.base.AdaptiveOptimizer`.
    """

    def __init__(self, named_parameters, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_step: int,
                 momentum_masks: Optional[Dict[str, torch.Tensor]] = None,
                 mask_zero_variance: bool = True, momentum_averaging: str = "onebit",
                 warmup_compression: str = "none", process_set=None, timer=None,
                 nonfinite: str = "skip", backward_passes_per_step: int = 1, comm=None):
        hyper = check_adam_hyper(lr, betas, eps, weight_decay)
        self.momentum_averaging = check_choice(momentum_averaging, "momentum_averaging", MOMENTUM_AVERAGING,
                                               " ('exact' is the float32 ablation of the compressed allreduce)")
        self.freeze_step = self.warmup_steps = check_count(
            freeze_step, "freeze_step", 1, " (the uncompressed warm-up that sets the variance frozen afterwards)")
        self.mask_zero_variance = check_bool(mask_zero_variance, "mask_zero_variance")
        super().__init__(named_parameters, hyper,
                         process_set=process_set, timer=timer, nonfinite=nonfinite,
                         warmup_compression=warmup_compression, backward_passes_per_step=backward_passes_per_step,
                         comm=comm, momentum_masks=momentum_masks)
        if momentum_averaging == "exact":
            self._plan = replace(self._plan, collective="allreduce")

    def _hyper(self):
        return {"freeze_step": self.freeze_step, "mask_zero_variance": self.mask_zero_variance,
                "momentum_averaging": self.momentum_averaging}

    @property
    def compression(self):
        """The method averaging now: the warm-up's while it runs, else the compressed allreduce
        (``hvdcomp`` ``none`` with ``momentum_averaging="exact"``)."""
        if self.momentum_averaging == "exact" and not self.warmup.running:
            return get_compressor("none")
        return super().compression

    def _init_state(self, p):
        return adam_state(p)

    def _make_warmup(self):
        d = self.defaults
        return torch.optim.AdamW(self.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                                 weight_decay=d["weight_decay"])

    def _step_after_warmup(self, t, grads):
        pairs = self.each()
        local = [self.state[p]["exp_avg"].mul(g["betas"][0]).add_(grad, alpha=1.0 - g["betas"][0])
                 for (p, g), grad in zip(pairs, grads)]
        averaged = (self.averaging.full(local) if self.momentum_averaging == "exact"
                    else self.averaging.compressed("momentum", local))
        if averaged is None:
            return None
        step = t + 1
        for (p, g), m in zip(pairs, averaged):
            (beta1, beta2), lr = g["betas"], g["lr"]
            st = self.state[p]
            m.mul_(self.momentum_mask(p))
            st["exp_avg"].copy_(m)
            if g["weight_decay"]:
                p.mul_(1.0 - lr * g["weight_decay"])
            denom = st["exp_avg_sq"].sqrt().div_((1.0 - beta2 ** self.freeze_step) ** 0.5).add_(g["eps"])
            p.addcdiv_(st["exp_avg"], denom, value=-lr / (1.0 - beta1 ** step))
        self._advance()
        return "full" if self.momentum_averaging == "exact" else "onebit"
