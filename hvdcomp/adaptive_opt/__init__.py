"""Compressed adaptive optimizers: 1-bit Adam, 0/1 Adam, 1-bit LAMB, and AMSGrad on a two-way
compressed gradient (Zhong et al.), each in place of ``hvd.DistributedOptimizer(...)``::

    opt = hvdcomp.adaptive_opt.OneBitAdam(model.named_parameters(), lr=1e-3, freeze_step=2000)

They average over the ranks themselves (do not wrap them in a ``DistributedOptimizer``). When to
use which: ``docs/adaptive-optimizers.md``; what they share: :mod:`hvdcomp.adaptive_opt.base`.
"""
from __future__ import annotations

from typing import Callable, Dict

from .base import AdaptiveOptimizer
from .compressed_amsgrad import CompressedAMSGrad
from .onebit_adam import OneBitAdam
from .onebit_lamb import Lamb, OneBitLamb
from .zeroone_adam import ZeroOneAdam, is_sync_step, is_variance_step, local_interval, step_kinds

__all__ = ["AdaptiveOptimizer", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "CompressedAMSGrad",
           "is_variance_step", "is_sync_step", "local_interval", "step_kinds", "OPTIMIZERS", "make_optimizer"]

#: command-line names (``train_lm.py --optimizer``) -> constructors
OPTIMIZERS: Dict[str, Callable] = {"onebit-adam": OneBitAdam, "zeroone-adam": ZeroOneAdam,
                                   "onebit-lamb": OneBitLamb, "compressed-amsgrad": CompressedAMSGrad}
#: the argument each takes for its freeze step (``--freeze-step``)
_FREEZE = {"onebit-adam": "freeze_step", "onebit-lamb": "freeze_step", "zeroone-adam": "var_freeze_step"}


def make_optimizer(name: str, named_parameters, lr: float, freeze_step: int = 0, **kwargs):
    """The optimizer ``name`` of :data:`OPTIMIZERS` (a command-line front-end).

    Args:
        name: ``onebit-adam``, ``zeroone-adam``, ``onebit-lamb`` or ``compressed-amsgrad``.
        named_parameters: ``model.named_parameters()``.
        lr: the learning rate.
        freeze_step: 1-bit Adam's and 1-bit LAMB's ``freeze_step``, 0/1 Adam's
            ``var_freeze_step`` (0: the optimizer's default; required by 1-bit Adam and LAMB).
        **kwargs: the optimizer's other arguments (e.g. ``local_step_scaler=1000``).

    Raises:
        ValueError: an unknown name, ``freeze_step`` given to ``compressed-amsgrad``, a missing
            ``freeze_step``, and the optimizer's own errors.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: one of {', '.join(OPTIMIZERS)}")
    if freeze_step:
        if name not in _FREEZE:
            raise ValueError(f"{name} has no freeze step (it compresses from the first step)")
        kwargs[_FREEZE[name]] = freeze_step
    elif name in ("onebit-adam", "onebit-lamb"):
        raise ValueError(f"{name} needs a freeze step (its uncompressed warm-up): e.g. 15-25 % of the steps")
    return OPTIMIZERS[name](named_parameters, lr=lr, **kwargs)
