"""An adaptive method on a two-way compressed gradient: the gradient compressed on every worker
with error feedback, averaged, compressed again with server-side error feedback
(:mod:`hvdcomp.transports.twophase`), and ``torch.optim.AdamW(amsgrad=True)`` run on the
identical result on every rank.

After Zhong, Xie, Zheng and Lin, "Compressed Communication for Distributed Training: Adaptive
Methods and System", arXiv:2105.07829, 2021 (the BytePS-Compress paper). Only its abstract could
be read: the update rule's details (AMSGrad's maximum, ε and bias correction as torch's, error
feedback not scaled by the learning rate, the compressor) are choices made here, listed in
``docs/adaptive-optimizers.md``. With a 1-bit quantizer the second moment is the squared chunk
scale, so the per-coordinate adaptivity is lost within a chunk.

Example::

    hvd.init()
    opt = hvdcomp.adaptive_opt.CompressedAMSGrad(model.named_parameters(), lr=1e-3)
"""
from __future__ import annotations

import torch

from ..transports.twophase import TwoPhaseCompressor
from ..optimizer import distributed as distributed_optimizer
from ..spec import get_compressor
from .base import ONEBIT_SPEC, named_groups
from ..checks import check_bool
from .onebit_adam import check_adam_hyper

__all__ = ["CompressedAMSGrad"]


def CompressedAMSGrad(named_parameters, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                      weight_decay: float = 0.0, *, amsgrad: bool = True, compression: str = ONEBIT_SPEC,
                      **distributed) -> torch.optim.Optimizer:
    """AMSGrad on the two-way compressed gradient (see the module docstring): an
    :func:`hvdcomp.DistributedOptimizer` over ``torch.optim.AdamW(amsgrad=True)`` with the
    two-phase compressed allreduce, so it takes every recipe of that optimizer (``synchronize``,
    ``skip_synchronize``, checkpoints, ``backward_passes_per_step``, ...).

    Args:
        named_parameters: ``model.named_parameters()`` (or groups of ``(name, parameter)``).
        lr, betas, eps, weight_decay: AdamW's (weight decay decoupled).
        amsgrad: AMSGrad's maximum of the second moments (default; False: Adam).
        compression: a two-phase spec, ``"twophase:base=<quantizer>[,...]"`` (default
            ``"twophase:base=efsignsgd"``; e.g. ``"twophase:base=qsgd,levels=16"``).
        **distributed: keyword arguments of :func:`hvdcomp.DistributedOptimizer` (``process_set``,
            ``timer``, ``nonfinite``, ``backward_passes_per_step``, ...).

    Returns:
        The :func:`hvdcomp.DistributedOptimizer`.

    Raises:
        ValueError: ``compression`` is not a two-phase spec (two-way compression with server
            error feedback is twophase's), Adam's ranges, and those of
            :func:`hvdcomp.DistributedOptimizer`.
    """
    hyper = check_adam_hyper(lr, betas, eps, weight_decay)
    amsgrad = check_bool(amsgrad, "amsgrad")
    method = get_compressor(compression) if isinstance(compression, str) else compression
    if not isinstance(method, TwoPhaseCompressor):
        raise ValueError("the two-way compressed gradient (worker and server error feedback) is hvdcomp's "
                         f"twophase compressed allreduce: give compression='twophase:base=<quantizer>', got "
                         f"{compression!r}")
    groups, names = named_groups(named_parameters)
    for i, group in enumerate(groups):  # (AdamW checks the defaults only, not a group's own settings)
        where = f" (parameter group {i})"
        mine = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
        group.update(check_adam_hyper(**{**hyper, **mine}, where=where) if mine else {})
        if "amsgrad" in group:
            group["amsgrad"] = check_bool(group["amsgrad"], f"amsgrad{where}")
    inner = torch.optim.AdamW(groups, amsgrad=amsgrad, **hyper)
    return distributed_optimizer(inner, [(n, p) for p, n in names.items()], method,
                                 distributed.pop("process_set", None), "hvdcomp.adaptive_opt.CompressedAMSGrad",
                                 **distributed)
