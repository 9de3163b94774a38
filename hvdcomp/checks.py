"""Validation of the arguments users give hvdcomp's public constructors and spec strings: the one
place that says what a number, a count, a switch or a choice is.

What counts as what:

* a **real number**: a Python ``int`` or ``float``, a numpy scalar (``np.float32(0.5)``,
  ``np.int64(8)``) or a 0-d tensor / array (``torch.tensor(0.5)``): a training script often
  computes a hyper-parameter with numpy or torch. Not a bool (``density=True`` is a mistake, not
  1.0), not a string (``"0.5"``), not a tensor or array with a dimension. NaN and ±inf are refused
  unless a check says otherwise.
* an **integer**: as above, of an integral type (Python, numpy or integer tensor); ``2.0`` is not
  one (a count written as a float is usually a computed ratio gone wrong).
* a **switch**: ``True`` or ``False`` (or ``np.bool_``); strings (``"no"``, truthy in Python) and
  numbers are refused. Spec strings already turn ``true``/``false``/``yes``/``no``/``on``/``off``
  into booleans (:func:`hvdcomp.spec.parse_spec`).
* a **choice**: one of a fixed set of values, compared with ``==`` (strings usually).

Every check returns the value as a plain Python ``float`` / ``int`` / ``bool`` and raises
``ValueError`` with one message shape, ``"<what> must be <rule>, got <value>!r<hint>"``, where
``what`` names the argument as the user wrote it and ``hint`` may say how to fix it. The checks
read no state and run before anything is built, so the same arguments fail alike on every rank,
before any collective.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
import torch

__all__ = ["as_number", "check_real", "check_range", "check_int", "check_count", "check_bool", "check_choice",
           "check_optional", "check_seed", "real_rule", "SEED_MAX"]

Number = Union[int, float]


def as_number(value, integer: bool = False) -> Optional[Number]:
    """``value`` as a Python number, or None when it is not one real number (see the module
    docstring: bools, strings and tensors or arrays with a dimension are not numbers).

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


def _fail(what: str, rule: str, value, hint: str):
    raise ValueError(f"{what} must be {rule}, got {value!r}{hint}")


def check_real(value, what: str, accept: Optional[Callable[[float], bool]] = None, rule: str = "a finite number",
               hint: str = "", *, finite: bool = True) -> float:
    """``value`` as a float, if it is a real number (:func:`as_number`), finite (unless
    ``finite=False``) and ``accept(value)``.

    Raises:
        ValueError: ``"{what} must be {rule}, got {value!r}{hint}"``.
    """
    number = as_number(value)
    if number is None or (finite and not math.isfinite(number)) or math.isnan(number) \
            or (accept is not None and not accept(number)):
        _fail(what, rule, value, hint)
    return number


def real_rule(low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False,
              high_open: bool = False) -> str:
    """The words for a range: ``"in (0, 1]"``, ``">= 0 and finite"``, ``"a finite number"``."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g} and finite"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g} and finite"
    return "a finite number"


def check_range(value, what: str, low: Optional[float] = None, high: Optional[float] = None, *,
                low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """:func:`check_real` within ``[low, high]`` (either end open, either end absent).

    Raises:
        ValueError: e.g. ``"density must be in (0, 1], got 1.5 (e.g. density=0.01 keeps 1 %)"``.
    """
    def accept(v: float) -> bool:
        if low is not None and (v <= low if low_open else v < low):
            return False
        return not (high is not None and (v >= high if high_open else v > high))

    return check_real(value, what, accept, real_rule(low, high, low_open, high_open), hint)


def check_int(value, what: str, low: Optional[int] = None, high: Optional[int] = None, hint: str = "") -> int:
    """``value`` as an int, if it is an integer (:func:`as_number` with ``integer=True``) in
    ``[low, high]``.

    Raises:
        ValueError: ``"{what} must be an integer >= {low}, got {value!r}{hint}"`` (or ``in
            [low, high]``, ``<= high``, ``an integer``).
    """
    number = as_number(value, integer=True)
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        if low is not None and high is not None:
            rule = f"an integer in [{low}, {high}]"
        elif low is not None:
            rule = f"an integer >= {low}"
        elif high is not None:
            rule = f"an integer <= {high}"
        else:
            rule = "an integer"
        _fail(what, rule, value, hint)
    return number


def check_count(value, what: str, low: int, hint: str = "") -> int:
    """:func:`check_int` with a lower bound only (the common case: steps, sizes, ranks)."""
    return check_int(value, what, low, None, hint)


def check_bool(value, what: str, hint: str = "") -> bool:
    """``value`` if it is ``True`` or ``False`` (or a numpy bool).

    Raises:
        ValueError: ``"{what} must be True or False, got {value!r}{hint}"`` (a string such as
            ``"no"`` is truthy in Python, so it is refused rather than read).
    """
    if not isinstance(value, (bool, np.bool_)):
        _fail(what, "True or False", value, hint)
    return bool(value)


def check_choice(value, what: str, choices: Iterable[Any], hint: str = "") -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: ``"{what} must be one of <choices>, got {value!r}{hint}"``.
    """
    choices = tuple(choices)
    try:
        ok = any(type(value) is type(c) and value == c for c in choices)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not a choice
        ok = False
    if not ok:
        _fail(what, "one of " + ", ".join(c if isinstance(c, str) else repr(c) for c in choices), value, hint)
    return value


#: the largest seed (random draws are seeded with seed·1000003 + a rank term, which must fit
#: torch.Generator.manual_seed's 64 bits)
SEED_MAX = 2**32 - 1


def check_seed(value, what: str = "seed") -> int:
    """A random seed: an integer in [0, :data:`SEED_MAX`].

    Raises:
        ValueError: as :func:`check_int`.
    """
    return check_int(value, what, 0, SEED_MAX)


def check_optional(value, check: Callable[..., Any], *args, **kwargs):
    """None, or ``check(value, *args, **kwargs)``."""
    return None if value is None else check(value, *args, **kwargs)
