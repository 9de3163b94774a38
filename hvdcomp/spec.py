"""From what a user writes to the objects that compress: ``"topk:density=0.01"`` → method +
memory, whose transport the plan then picks (:mod:`hvdcomp.plan`).

A spec is ``name[:key=value,...]``: ``name`` is a registered method (``hvdcomp.available()``),
the keys are its constructor's arguments, plus ``ef`` (error feedback: :class:`hvdcomp.
ErrorFeedback` around the method; default: the method's ``default_error_feedback``) and, for
sparsifiers, the wire coding ``values`` / ``index``. Names of step-wide methods (``powersgd``,
``gtopk``, ``cltk``, ``twophase``) name the method together with its own transport
(:mod:`hvdcomp.transports`); their error feedback is built in.
"""
from __future__ import annotations

from typing import Any, Dict

from .checks import check_bool, check_optional
from .compressors.base import Compressor, Method
from .compressors.fp16 import FP16Compressor
from .compressors.none import NoneCompressor
from .compressors.registry import compressor_class, create
from .memory import ErrorFeedback

__all__ = ["parse_spec", "get_compressor", "resolve_compression"]


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
        ValueError: for an empty name, an argument without ``=``, or a key given twice.
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
        key = key.strip()
        if key in kwargs:
            raise ValueError(f"'{key}' is given twice in compressor spec '{spec}': give each argument once")
        kwargs[key] = _parse_value(value)
    return name.strip(), kwargs


def get_compressor(spec: str, **kwargs: Any):
    """Build a compressor from a registered name or a command-line spec string.

    ``get_compressor("topk", density=0.01)`` and ``get_compressor("topk:density=0.01")`` are the
    same. The extra keyword ``ef`` (bool) wraps the method in :class:`hvdcomp.ErrorFeedback`; its
    default is the method's ``default_error_feedback`` (on for top-k; a wrapper such as ``adaptive``
    takes its base method's). Sparsifiers also accept the wire-coding keywords ``values``
    (``fp32``/``fp16``) and ``index`` (``int``/``compact``), see :mod:`hvdcomp.compressors.sparse`.

    Returns:
        A :class:`hvdcomp.Compressor` (per-tensor methods, error feedback included), a
        step-wide method of :mod:`hvdcomp.transports` (``powersgd``, ``gtopk``, ``cltk``,
        ``twophase``), or for ``"auto[:...]"`` an :class:`hvdcomp.auto.Auto` (the reducer's choice
        among methods).

    Raises:
        ValueError: unknown method name, unknown argument (the message lists accepted ones), or a
            value out of range (raised by the method's constructor).
    """
    name, spec_kwargs = parse_spec(spec)
    overlap = set(spec_kwargs) & set(kwargs)
    if overlap:
        raise ValueError(f"argument(s) {sorted(overlap)} given both in the spec '{spec}' and as keywords")
    spec_kwargs.update(kwargs)
    if name == "auto":  # not a method: the reducer's choice among methods (hvdcomp.auto)
        from .auto import Auto

        return Auto(**spec_kwargs)
    cls = compressor_class(name)
    ef = spec_kwargs.pop("ef", None)
    if ef is True and cls.builtin_error_feedback:
        raise ValueError(f"'{name}' keeps its own residual (error feedback is built in); drop ef=true")
    ef = check_optional(ef, check_bool, "ef", " (error feedback: ef=true or ef=false)")
    method = create(name, **spec_kwargs)
    if ef is None:  # the instance's default: a wrapper (adaptive) takes its base method's
        ef = method.default_error_feedback
    return ErrorFeedback(method) if ef else method


def resolve_compression(compression) -> Method:
    """Accept an hvdcomp method (a :class:`hvdcomp.Compressor` or a step-wide method), a spec
    string (``"topk:density=0.01"``) or Horovod's ``hvd.Compression.none`` /
    ``hvd.Compression.fp16``.

    Raises:
        TypeError: anything else.
    """
    if isinstance(compression, Method):
        return compression
    if isinstance(compression, str):
        return get_compressor(compression)
    try:
        import horovod.torch as hvd
    except ImportError:  # (Horovod is optional: the DDP front-end runs without it)
        hvd = None
    if hvd is not None and compression is hvd.Compression.none:
        return NoneCompressor()
    if hvd is not None and compression is hvd.Compression.fp16:
        return FP16Compressor()
    raise TypeError(f"compression must be an hvdcomp.Compressor, a spec string such as "
                    f"'topk:density=0.01', or hvd.Compression.none/fp16; got {compression!r}")


def is_per_tensor(compression) -> bool:
    """Whether ``compression`` compresses each gradient on its own (a :class:`Compressor`), rather
    than a whole step at once with its own transport."""
    return isinstance(compression, Compressor)
