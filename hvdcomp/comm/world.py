"""The world a process belongs to: Horovod's world size and rank, or a simulated one.

Compressors and transports read the world through :func:`world_size` and :func:`rank` only, so
that tests can simulate N ranks in one process (:func:`simulated_world`): one compressor instance
per simulated rank, each encoding and decoding under its own ``simulated_world``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch.distributed as dist

__all__ = ["world_size", "rank", "simulated_world"]

#: (world size, rank) set by :func:`simulated_world`; consulted before Horovod.
_simulated: Optional[Tuple[int, int]] = None


@contextlib.contextmanager
def simulated_world(size: int, rank: int) -> Iterator[None]:
    """Make :func:`world_size` and :func:`rank` return ``size`` and ``rank`` inside the block.

    For simulating N ranks in one process (the numerics tests build one compressor instance per
    simulated rank and encode/decode each under its own ``simulated_world``). Blocks nest; the
    previous values come back on exit. Process-wide, not per thread: simulate one rank at a time.

    Raises:
        ValueError: ``size < 1`` or ``rank`` outside ``[0, size)``.
    """
    global _simulated
    if not (isinstance(size, int) and isinstance(rank, int) and size >= 1 and 0 <= rank < size):
        raise ValueError(f"simulated_world needs an integer size >= 1 and 0 <= rank < size, got ({size!r}, {rank!r})")
    previous, _simulated = _simulated, (size, rank)
    try:
        yield
    finally:
        _simulated = previous


def _horovod_or(getter: str, default: int) -> int:
    """Horovod's ``size()`` / ``rank()`` when Horovod is installed and initialised, else
    ``torch.distributed``'s default group's (the DDP front-end), else ``default`` (Horovod is
    optional here: the DDP front-end and single-process tests run without it)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        hvd = None
    if hvd is not None and hvd.is_initialized():
        return getattr(hvd, getter)()
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() if getter == "size" else dist.get_rank()
    return default


def world_size() -> int:
    """Number of ranks in Horovod's global process set (else in ``torch.distributed``'s default
    group), read now (never cached).

    Returns 1 when neither is initialised, so compressors can be used in a single process; inside
    :func:`simulated_world`, the simulated size.
    """
    return _simulated[0] if _simulated is not None else _horovod_or("size", 1)


def rank() -> int:
    """This process's Horovod rank (else its ``torch.distributed`` rank; 0 when neither is
    initialised; the simulated rank inside :func:`simulated_world`)."""
    return _simulated[1] if _simulated is not None else _horovod_or("rank", 0)
