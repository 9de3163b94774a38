"""Local-update training: H inner steps without communication, then compressed pseudo-gradients.

One wrapper per algorithm around the user's inner ``torch.optim`` optimizer: :class:`DiLoCo`
(outer Nesterov step; plain averaging with ``outer_lr=1, outer_momentum=0, nesterov=False``),
:class:`SparseLoCo` (decaying error feedback, sparse 2-bit Δ), :class:`CO2` (averaging overlapped
with the next round, applied one round late; :class:`CO2Momentum`) and :class:`LocalAdaAlter`
(:class:`AdaAlter` local steps). :func:`from_spec` builds one from a spec string such as
``"diloco:outer_lr=0.7"``. Trade-offs: ``docs/local-update.md``.
"""
from __future__ import annotations

from typing import Dict, Type

from ..spec import parse_spec
from .adaalter import AdaAlter, LocalAdaAlter
from .base import LocalUpdate, check_carries_delta
from .co2 import CO2, CO2Momentum
from .outer import DiLoCo, SparseLoCo

__all__ = ["LocalUpdate", "DiLoCo", "SparseLoCo", "CO2", "CO2Momentum", "AdaAlter", "LocalAdaAlter",
           "ALGORITHMS", "from_spec", "check_carries_delta"]

#: spec name -> wrapper class (``average`` is DiLoCo with outer SGD lr 1, momentum 0: local SGD)
ALGORITHMS: Dict[str, Type[LocalUpdate]] = {"diloco": DiLoCo, "average": DiLoCo, "sparseloco": SparseLoCo,
                                            "co2": CO2, "adaalter": LocalAdaAlter}


def from_spec(spec: str, optimizer, named_parameters=None, **kwargs) -> LocalUpdate:
    """The wrapper a spec names, e.g. ``"diloco"``, ``"average"``, ``"co2:gap_penalty=2,clip=0.1"``,
    ``"sparseloco:form=flat"``: the spec's keys are the class's keyword arguments, ``kwargs`` the
    rest (``local_steps``, ``compression``, ...).

    Raises:
        ValueError: an unknown name (the message lists the known ones), an argument given twice,
            and whatever the class refuses.
        TypeError: an argument the class does not take.
    """
    name, args = parse_spec(spec)
    if name not in ALGORITHMS:
        raise ValueError(f"unknown local-update algorithm {name!r} in {spec!r}: use one of {sorted(ALGORITHMS)}")
    if name == "average":
        args = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, **args}
    twice = sorted(set(args) & set(kwargs))
    if twice:
        raise ValueError(f"argument(s) {twice} given both in {spec!r} and as keywords")
    return ALGORITHMS[name](optimizer, named_parameters, **args, **kwargs)
