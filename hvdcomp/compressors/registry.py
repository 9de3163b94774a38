"""Name → method class registry: methods register themselves under a name; :func:`create` builds
one from its name and arguments. What wraps it (error feedback) and what carries it (a transport)
is decided above, in :mod:`hvdcomp.spec`."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Type

_REGISTRY: Dict[str, type] = {}

__all__ = ["register", "available", "compressor_class", "create"]

#: spec keys of the sparse wire coding and average (:mod:`hvdcomp.compressors.sparse`), applied by ``set_wire``
WIRE_KEYS = ("values", "index", "average")


def register(name: str) -> Callable[[Type], Type]:
    """Class decorator: make a method class (a :class:`hvdcomp.Compressor`, or a step-wide method
    of :mod:`hvdcomp.transports`) reachable by ``name``.

    Raises:
        ValueError: if another class is already registered under ``name``.
    """

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"compressor name '{name}' is already taken by {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list:
    """Sorted list of registered method names."""
    return sorted(_REGISTRY)


def compressor_class(name: str) -> type:
    """The class registered under ``name`` (not an instance: for reading its constructor's
    arguments and defaults).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor '{name}'; available: {', '.join(available())}")
    return _REGISTRY[name]


def create(name: str, **kwargs: Any):
    """An instance of the method registered under ``name``, built with ``kwargs`` (its
    constructor's arguments, plus the sparse wire coding ``values`` / ``index`` / ``average`` for
    methods with ``set_wire``). No error feedback is added (see :func:`hvdcomp.get_compressor`).

    Raises:
        ValueError: unknown name, unknown argument (the message lists the accepted ones), wire
            keys for a method without a wire coding, or a value out of range (raised by the
            method's constructor).
    """
    cls = compressor_class(name)
    kwargs = dict(kwargs)
    wire = {k: kwargs.pop(k) for k in WIRE_KEYS if k in kwargs}
    if wire and not hasattr(cls, "set_wire"):
        raise ValueError(f"argument(s) {sorted(wire)} set the sparse wire coding; '{name}' is not "
                         "a sparsifier (topk, threshold, sidco, dgc accept values=fp16/int2/stat2, "
                         "index=compact and average=senders)")
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self" and params[p].kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"compressor '{name}' got unknown argument(s) {unknown}; "
                         f"accepted: {accepted + ['ef']}")
    method = cls(**kwargs)
    if wire:
        method.set_wire(**wire)
    return method
