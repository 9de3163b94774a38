"""Mixed precision (AMP): keep compressor state in step with a ``torch.amp.GradScaler``'s loss scale.

With AMP the gradients an optimizer's hooks see are *scaled*: ``S·g`` for the loss scale ``S``.
Compressor state kept in
gradient units (error-feedback residuals, DGC momenta, PowerSGD's error) is therefore in units of
the scale of the step that produced it. When ``GradScaler.update()`` changes the scale (halved
after an overflow, doubled after ``growth_interval`` clean steps), that state is multiplied by
``S_new / S_old`` before the next step compresses anything (:meth:`hvdcomp.Compressor.
rescale_state`), so error feedback keeps ``Σ sent/S + e/S = Σ g`` in unscaled units.

The scaler is given (``grad_scaler=``) or found once, at the first applied step of an optimizer
whose compressor has such state, among the ``GradScaler`` objects alive that have unscaled or
stepped this optimizer. Reading the scale costs one ``scaler.get_scale()`` a step (a 4-byte
device-to-host copy on CUDA).
"""
from __future__ import annotations

import gc
import logging
from typing import Optional

import torch

__all__ = ["LossScaleTracker", "find_grad_scaler"]

log = logging.getLogger(__name__)


def find_grad_scaler(optimizer) -> Optional["torch.amp.GradScaler"]:
    """The enabled ``torch.amp.GradScaler`` that has recorded ``optimizer`` this iteration
    (``unscale_`` or ``step`` called on it), or None. Scans the objects alive in the process
    once (milliseconds to a few hundred ms in very large programs)."""
    key = id(optimizer)
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.amp.GradScaler):  # type(): never touches proxy objects
            states = getattr(obj, "_per_optimizer_states", None)
            if obj.is_enabled() and isinstance(states, dict) and key in states:
                return obj
    return None


class LossScaleTracker:
    """Follows a loss scaler and tells the optimizer when compressor state must be rescaled.

    Args:
        scaler: a ``torch.amp.GradScaler`` (or anything with ``get_scale() -> float`` and
            ``is_enabled() -> bool``), or None to discover one (see :func:`find_grad_scaler`).

    Attributes:
        units: the loss scale the compressor state is currently expressed in (None: unknown,
            i.e. no scaler seen yet; state is then taken to be in the current units).
    """

    def __init__(self, scaler=None):
        if scaler is not None and not (hasattr(scaler, "get_scale") and hasattr(scaler, "is_enabled")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler (get_scale(), is_enabled()); got {scaler!r}")
        self.scaler = scaler
        self.units: Optional[float] = None
        self._searched = scaler is not None

    def current(self) -> Optional[float]:
        """The scaler's scale now (float), or None without an enabled scaler."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return float(self.scaler.get_scale())

    def factor(self) -> Optional[float]:
        """``S_now / units`` when the scale changed since the state was last expressed (then
        ``units`` becomes ``S_now``); None when nothing needs rescaling. Call when a new step
        starts, before anything is compressed."""
        now = self.current()
        if now is None:
            return None
        old, self.units = self.units, now
        if old is None or old == now:
            return None
        return now / old

    def discover(self, optimizer) -> None:
        """Find the scaler driving ``optimizer`` (once; call while ``scaler.step(optimizer)``
        runs, i.e. from ``optimizer.step()``) and take its current scale as the state's units."""
        if self._searched:
            if self.scaler is not None and self.units is None:
                self.units = self.current()
            return
        self._searched = True
        self.scaler = find_grad_scaler(optimizer)
        if self.scaler is not None:
            self.units = self.current()
            log.info("hvdcomp: following the loss scale of %r (now %g) for compressor state",
                     self.scaler, self.units)
