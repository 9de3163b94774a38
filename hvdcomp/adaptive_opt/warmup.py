"""The warm-up stage of a compressed adaptive optimizer (Tang et al. 2021, "1-bit Adam", Algorithm
1's warm-up): :class:`WarmupStage` owns the :func:`hvdcomp.DistributedOptimizer` of its leading
uncompressed steps, sharing the owner's per-parameter state so the moments carry over.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..config import Settings
from ..optimizer import wrap

__all__ = ["WarmupStage"]

log = logging.getLogger(__name__)


class WarmupStage:
    """The warm-up :func:`hvdcomp.DistributedOptimizer` of an
    :class:`~hvdcomp.adaptive_opt.base.AdaptiveOptimizer` ``owner``, while it runs.

    Args:
        owner: the adaptive optimizer (its ``_make_warmup()``, parameter ``order`` and names,
            ``state``, ``process_set``, ``timer``, ``nonfinite``, ``warmup_compression``).
    """

    def __init__(self, owner):
        self.owner = owner
        self.optimizer = None          # the warm-up hvdcomp.DistributedOptimizer, while it runs
        self._saved: dict = {}         # its compression state, loaded from a checkpoint

    @property
    def running(self) -> bool:
        """Whether the warm-up optimizer is open (built and not yet closed)."""
        return self.optimizer is not None

    def open(self):
        """The warm-up optimizer, built on first use (with the owner's state dict as its state).

        Raises:
            RuntimeError: the owner was built with ``comm=`` (no Horovod process set to warm up on).
        """
        if self.optimizer is None:
            o = self.owner
            if o.group is None:
                raise RuntimeError("the warm-up averages over the optimizer's process group: build the "
                                   "optimizer without comm=")
            settings = Settings.validate(getattr(o.group, "hvd", None), timer=o.timer, nonfinite=o.nonfinite,
                                         process_set=o.process_set if getattr(o.group, "hvd", None) else None)
            warm = wrap(o._make_warmup(), [(o._names[p], p) for p in o.order], o.warmup_compression, settings,
                        o.group)
            warm.state = o.state  # one state for both stages (torch's per-parameter dict)
            if self._saved:
                warm.compression.load_state_dict(self._saved)
                self._saved = {}
            self.optimizer = warm
        return self.optimizer

    def close(self) -> None:
        """Close the warm-up optimizer (its hooks and threads), if open; it must be idle."""
        if self.optimizer is not None:
            self.optimizer.close()
            self.optimizer = None

    def abandon(self, order) -> None:
        """A checkpoint past the warm-up was loaded into a running warm-up (on every rank alike,
        as every rank has it open): finish what backward's hooks started, keep the averaged
        gradient of each parameter of ``order`` as its ``.grad``, drop the warm-up's update and
        close it."""
        warm = self.optimizer
        warm.synchronize()
        kept = [None if p.grad is None else p.grad.clone() for p in order]
        warm.zero_grad(set_to_none=False)  # (discards the synchronized update: nothing stays staged)
        self.close()
        for p, g in zip(order, kept):
            p.grad = g
        log.warning("%s: a checkpoint past the warm-up was loaded while the warm-up ran: this step uses the "
                    "averaged gradient", type(self.owner).__name__)

    def state_dict(self) -> dict:
        """The warm-up compression's state (its live state while it runs, else the loaded one)."""
        return self.optimizer.compression.state_dict() if self.optimizer is not None else self._saved

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Inverse of :meth:`state_dict`; re-points a running warm-up optimizer at the owner's
        (new) parameter groups and state."""
        self._saved = dict(state or {})
        if self.optimizer is not None:
            self.optimizer.param_groups, self.optimizer.state = self.owner.param_groups, self.owner.state
            if self._saved:
                self.optimizer.compression.load_state_dict(self._saved)
                self._saved = {}
