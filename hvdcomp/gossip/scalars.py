"""Numbers as gossip's constructors take them: a Python ``int`` or ``float``, a numpy scalar
(``np.float32(0.5)``, ``np.int64(8)``) or a 0-d tensor / array (``torch.tensor(0.5)``) are the
same number (a training script often computes γ or a size with numpy or torch). Booleans, strings
and tensors or arrays with a dimension are not numbers here."""
from __future__ import annotations

import numbers
from typing import Optional, Union

import numpy as np
import torch

__all__ = ["as_scalar"]


def as_scalar(value, integer: bool = False) -> Optional[Union[int, float]]:
    """``value`` as a Python number, or None when it is not one real number.

    Args:
        value: a Python int or float, a numpy scalar, or a 0-d tensor or numpy array.
        integer: accept integral values only (Python and numpy integers, integer tensors) and
            return an ``int``; otherwise any real value, returned as a ``float``.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        if integer and value.is_floating_point():
            return None
        value = value.item()
    elif isinstance(value, np.ndarray):
        if value.ndim != 0:
            return None
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        return None
    if integer:
        return int(value) if isinstance(value, numbers.Integral) else None
    return float(value) if isinstance(value, numbers.Real) else None
