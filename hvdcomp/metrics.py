"""Per-step instrumentation: phase timers (seconds), bytes on the wire, results JSON.

Phases are timed *exclusively*: when a phase starts inside another (compression inside a
backward hook, inside the ``compute`` phase), the outer clock pauses, so the phases of a step add
up to its wall time and ``compute`` is forward+backward without the hook work.

Standard phase names: ``compute`` (forward + backward), ``compress``, ``communicate`` (time this
rank spends in, or waiting for, collectives), ``decompress`` (decode and aggregation).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

__all__ = ["PhaseTimer", "PHASES", "write_json_atomic", "reduce_across_ranks"]

PHASES = ("compute", "compress", "communicate", "decompress")


class PhaseTimer:
    """Accumulates exclusive seconds per phase and bytes per step.

    Args:
        cuda_sync: call ``torch.cuda.synchronize()`` at phase boundaries so GPU work is charged
            to the phase that queued it (costs a device sync per phase; default: when CUDA is
            available).
        clock: a function returning seconds (default ``time.perf_counter``).

    Use ``begin_step()``, ``with timer.phase(name): ...``, ``add_bytes(...)``, ``end_step()``;
    ``history`` holds one dict per finished step.
    """

    def __init__(self, cuda_sync: Optional[bool] = None, clock=time.perf_counter):
        self.clock = clock
        self.cuda_sync = torch.cuda.is_available() if cuda_sync is None else cuda_sync
        self.history: List[Dict[str, Any]] = []
        self._stack: List[list] = []  # [name, start_of_current_slice]
        self._begin_step_values()

    def _begin_step_values(self):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dense_bytes = 0
        self._t0 = self.clock()

    def begin_step(self) -> None:
        """Start a new step (discards a step begun but not ended)."""
        self._begin_step_values()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Charge the enclosed wall time (minus nested phases) to ``name``."""
        if self.cuda_sync:
            torch.cuda.synchronize()
        now = self.clock()
        if self._stack:
            outer = self._stack[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()
            now = self.clock()
            cur = self._stack.pop()
            self.seconds[cur[0]] += now - cur[1]
            if self._stack:
                self._stack[-1][1] = now

    def add_bytes(self, sent: int = 0, received: int = 0, dense: int = 0) -> None:
        """Record bytes this rank put on / took off the wire, and the dense fp32 equivalent."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.dense_bytes += int(dense)

    def end_step(self) -> Dict[str, Any]:
        """Close the step, append its record to ``history`` and return it."""
        rec = {p: self.seconds.get(p, 0.0) for p in PHASES}
        rec.update({k: v for k, v in self.seconds.items() if k not in rec})
        rec["wall"] = self.clock() - self._t0
        rec["bytes_sent"] = self.bytes_sent
        rec["bytes_received"] = self.bytes_received
        rec["dense_bytes"] = self.dense_bytes
        self.history.append(rec)
        self._begin_step_values()
        return rec

    def totals(self, skip_first: int = 0) -> Dict[str, float]:
        """Per-step means over ``history[skip_first:]`` (seconds, bytes) and ``steps``."""
        rows = self.history[skip_first:] or self.history
        if not rows:
            return {"steps": 0}
        keys = sorted({k for r in rows for k in r})
        out = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
        out["steps"] = len(rows)
        return out


def reduce_across_ranks(values: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """min / mean / max over ranks of each numeric value (Horovod allgather; collective).

    Every rank must call it with the same keys. Returns ``{key: {"min", "mean", "max"}}``.
    """
    import horovod.torch as hvd

    keys = sorted(values)
    local = torch.tensor([[float(values[k]) for k in keys]], dtype=torch.float64)
    allv = hvd.allgather(local, name="hvdcomp.metrics.reduce") if hvd.size() > 1 else local
    return {k: {"min": float(allv[:, i].min()), "mean": float(allv[:, i].mean()),
                "max": float(allv[:, i].max())} for i, k in enumerate(keys)}


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace``: never a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
