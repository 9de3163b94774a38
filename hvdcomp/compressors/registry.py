"""Name → compressor class registry, and the ``name:key=value,...`` command-line syntax."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Type

_REGISTRY: Dict[str, type] = {}

__all__ = ["register", "get_compressor", "parse_spec", "available", "compressor_class"]


def register(name: str) -> Callable[[Type], Type]:
    """Class decorator: make a :class:`hvdcomp.Compressor` subclass reachable by ``name``.

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
    """The :class:`hvdcomp.Compressor` subclass registered under ``name`` (not an instance: for
    reading its constructor's arguments and defaults).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor '{name}'; available: {', '.join(available())}")
    return _REGISTRY[name]


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def parse_spec(spec: str) -> tuple:
    """Split ``"topk:density=0.01,ef=false"`` into ``("topk", {"density": 0.01, "ef": False})``.

    Raises:
        ValueError: for an empty name or an argument without ``=``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compressor spec must be a non-empty string like 'topk:density=0.01', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    kwargs: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"malformed argument '{item}' in compressor spec '{spec}': "
                             "write key=value pairs separated by commas, e.g. 'topk:density=0.01'")
        kwargs[key.strip()] = _parse_value(value)
    return name.strip(), kwargs


def get_compressor(spec: str, **kwargs: Any):
    """Build a compressor from a registered name or a command-line spec string.

    ``get_compressor("topk", density=0.01)`` and ``get_compressor("topk:density=0.01")`` are the
    same. The extra keyword ``ef`` (bool) wraps the method in :class:`hvdcomp.ErrorFeedback`; its
    default is the method's ``default_error_feedback`` (on for top-k; a wrapper such as ``adaptive``
    takes its base method's). Sparsifiers also accept
    the wire-coding keywords ``values`` (``fp32``/``fp16``) and ``index`` (``int``/``compact``),
    see :mod:`hvdcomp.compressors.sparse`.

    Raises:
        ValueError: unknown method name, unknown argument (the message lists accepted ones), or a
            value out of range (raised by the method's constructor).
    """
    from ..memory import ErrorFeedback  # local import: memory imports base

    name, spec_kwargs = parse_spec(spec)
    overlap = set(spec_kwargs) & set(kwargs)
    if overlap:
        raise ValueError(f"argument(s) {sorted(overlap)} given both in the spec '{spec}' and as keywords")
    spec_kwargs.update(kwargs)
    cls = compressor_class(name)
    ef = spec_kwargs.pop("ef", None)
    if ef is True and cls.builtin_error_feedback:
        raise ValueError(f"'{name}' keeps its own residual (error feedback is built in); drop ef=true")
    if ef is not None and not isinstance(ef, bool):
        raise ValueError(f"ef must be true or false, got {ef!r}")
    from .sparse import SparseCompressor  # local import: sparse imports base

    wire = {k: spec_kwargs.pop(k) for k in ("values", "index") if k in spec_kwargs}
    if wire and not issubclass(cls, SparseCompressor):
        raise ValueError(f"argument(s) {sorted(wire)} set the sparse wire coding; '{name}' is not "
                         "a sparsifier (topk, threshold, dgc accept values=fp16 and index=compact)")
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self" and params[p].kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = [k for k in spec_kwargs if k not in accepted]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"compressor '{name}' got unknown argument(s) {unknown}; "
                         f"accepted: {accepted + ['ef']}")
    comp = cls(**spec_kwargs)
    if wire:
        comp.set_wire(**wire)
    if ef is None:  # the instance's default: a wrapper (adaptive) takes its base method's
        ef = comp.default_error_feedback
    return ErrorFeedback(comp) if ef else comp
