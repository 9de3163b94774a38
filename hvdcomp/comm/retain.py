"""Tensors hvdcomp hands to ``torch.distributed`` collectives, held by Python until the backend's
worker threads have let go of them, and released before the interpreter finalizes (why: gloo's
worker freeing a Python tensor while the interpreter finalizes aborts a finished run;
docs/ddp.md, "A clean exit").

:func:`retain` keeps a reference to each tensor owned by Python alone when handed over
(``Tensor._use_count() == 1``; one held in C++, such as a DDP bucket buffer, is not retained), and
lets it go once the backend holds it no more, checked at each later call (at most :data:`CAP` are
held). At exit (``atexit``) :func:`release_all` waits up to :data:`EXIT_WAIT_S` seconds for the
workers, then drops the rest from the main thread. Call :func:`retain` right before the
collective.
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
