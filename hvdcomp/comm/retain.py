"""Tensors hvdcomp hands to ``torch.distributed`` collectives, held by Python until the backend's
worker threads have let go of them, and released before the interpreter finalizes.

Why. gloo runs every collective on a worker thread that holds the collective's work object (and
through it the input and output tensors) a little after the caller's ``wait()`` returns; a later
``barrier`` even keeps earlier works until it is itself released. A tensor created in Python
whose Python references are all gone by then is freed *by that worker thread*, and freeing its
Python object needs the GIL. During normal training the worker simply waits for the GIL; but if
the main thread is already finalizing the interpreter (the script ended), the worker is ended
inside a ``noexcept`` destructor and the process aborts (SIGABRT, "terminate called without an
active exception") after all its work is done: a finished run that the launcher reports as
failed. The DDP hook creates such tensors every step (payloads, gather outputs, the per-step
agreement's integers), and so do object gathers: ``torch.distributed.all_gather_object`` makes
its own, so hvdcomp gathers and broadcasts objects over its own tensors instead
(:meth:`hvdcomp.comm.torchdist.TorchDistGroup.allgather_object`; a run's closing
``metrics.reduce_across_ranks`` followed by a ``barrier`` aborted that way).

What this does. :func:`retain` keeps a Python reference to each such tensor (one created by
hvdcomp, owned by Python alone when handed over: ``Tensor._use_count() == 1``), so that a worker
releasing the work only drops its own reference, which needs no GIL. A retained tensor is let go
once the backend holds it no more (its use count is back to 1), checked at each later
:func:`retain` (amortised; at most :data:`CAP` are held). At interpreter exit (``atexit``, which
runs before finalization, while the worker threads can still take the GIL), :func:`release_all`
waits, up to :data:`EXIT_WAIT_S` seconds, for the workers to let go of what is still held, then
drops it from the main thread. A tensor something else holds in C++ when it is handed over (a
DDP bucket buffer: the reducer frees it from the main thread) is not retained. Call
:func:`retain` right before the collective: one not yet handed over is let go at the next call.
"""
from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from typing import Deque

import torch

__all__ = ["retain", "release_all", "held", "CAP", "EXIT_WAIT_S"]

#: at most this many tensors are held (the oldest dropped first: long released by then)
CAP = 4096
#: seconds the exit handler waits for the backend's workers to let go of the last tensors
EXIT_WAIT_S = 10.0

_held: Deque[torch.Tensor] = deque()
_lock = threading.Lock()
_registered = False


def _released(t: torch.Tensor) -> bool:
    return t._use_count() <= 1  # (only this Python object's own reference is left)


def retain(*tensors: torch.Tensor) -> None:
    """Hold ``tensors`` (those a collective is about to use, each owned by Python alone) until
    the backend has let go of them; first drop the held ones it has let go of."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(release_all)
            _registered = True
        for _ in range(len(_held)):
            t = _held.popleft()
            if not _released(t):
                _held.append(t)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t._use_count() == 1:
                _held.append(t)
        while len(_held) > CAP:
            _held.popleft()


def held() -> int:
    """How many tensors are held now."""
    return len(_held)


def release_all(timeout_s: float = EXIT_WAIT_S) -> int:
    """Wait (sleeping, so the workers can take the GIL) until the backend has let go of every
    held tensor or ``timeout_s`` has passed, then drop them all; returns how many were still
    in use at the deadline. Registered with ``atexit`` by the first :func:`retain`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _lock:
            busy = sum(not _released(t) for t in _held)
            if not busy or time.monotonic() >= deadline:
                _held.clear()
                return busy
        time.sleep(0.005)
