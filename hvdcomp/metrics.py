"""Per-step instrumentation: phase timers (seconds), bytes on the wire, results JSON.

Phases are timed *exclusively*: a phase started inside another (compression inside a backward
hook, inside ``compute``) pauses the outer clock, so the phases of a step add up to its wall time.
Standard phases: ``compute`` (forward + backward), ``compress``, ``communicate`` (in, or waiting
for, collectives), ``decompress`` (decode and aggregation). Under a profiler each phase is also a
range ``hvdcomp.<phase>`` (``torch.profiler``; NVTX under ``emit_nvtx()``); without one, a phase
boundary costs one check.
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
from torch.profiler import record_function

from .checks import check_bool, check_count, check_optional

_profiling = torch._C._autograd._profiler_enabled  # (a C call: whether torch.profiler / emit_nvtx records)

__all__ = ["PhaseTimer", "RecordLog", "PHASES", "write_json_atomic", "reduce_across_ranks"]

PHASES = ("compute", "compress", "communicate", "decompress")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RecordLog:
    """Records (dicts) appended one per step or round, held in bounded memory: the last ``limit``
    in :attr:`records`, older ones rolled up into per-key sums of their numbers, so :meth:`sums`
    and ``len()`` cover every record ever appended however long the run. The one roll-up of
    :class:`PhaseTimer` (step records) and of the local-update optimizers (round records).

    Records are rolled up in batches, once ``2·limit`` are held (amortised O(1) per append; at
    most ``2·limit`` records are ever held). Booleans and non-numbers are kept in the records
    but not summed.

    Args:
        limit: records kept (the most recent); None keeps every one.
        head: the first ``head`` records are kept aside when the first ones are rolled up
            (:attr:`head`), so that sums can leave out warm-up records.

    Raises:
        ValueError: ``limit`` not an integer ≥ 1 (or None).
    """

    __slots__ = ("limit", "head_size", "records", "head", "_rolled", "rolled_count")

    def __init__(self, limit: Optional[int] = 1000, head: int = 0):
        self.limit = check_optional(limit, check_count, "history_limit", 1, " or None (keep every record)")
        self.head_size = head
        self.records: List[Dict[str, Any]] = []
        self.head: List[Dict[str, Any]] = []  # once records are rolled up: the first head_size ones
        self._rolled: Dict[str, float] = defaultdict(int)  # sums over records dropped from `records`
        self.rolled_count = 0

    def append(self, record: Dict[str, Any]) -> None:
        """Add ``record``; roll the oldest up once ``2·limit`` are held."""
        self.records.append(record)
        if self.limit is not None and len(self.records) >= 2 * self.limit:
            if not self.rolled_count:
                self.head = self.records[:self.head_size]
            dropped, self.records = self.records[:-self.limit], self.records[-self.limit:]
            self.rolled_count += len(dropped)
            for r in dropped:
                for k, v in r.items():
                    if _is_number(v):
                        self._rolled[k] += v

    def replace(self, records: List[Dict[str, Any]]) -> None:
        """Hold exactly ``records`` (nothing rolled up)."""
        self.records, self.head, self.rolled_count = list(records), [], 0
        self._rolled = defaultdict(int)

    def __len__(self) -> int:
        """Records appended so far (held or rolled up)."""
        return self.rolled_count + len(self.records)

    def sums(self) -> Dict[str, float]:
        """Per-key sums of the numbers over every record appended."""
        out: Dict[str, float] = defaultdict(int, self._rolled)
        for r in self.records:
            for k, v in r.items():
                if _is_number(v):
                    out[k] += v
        return dict(out)

    def first(self, n: int) -> List[Dict[str, Any]]:
        """The first ``n`` records appended.

        Raises:
            ValueError: ``n`` > ``head`` once records were rolled up.
        """
        if not self.rolled_count:
            return self.records[:n]
        if n > self.head_size:
            raise ValueError(f"skip_first={n}: only the first {self.head_size} records are kept once older ones "
                             "are rolled up (history_limit)")
        return self.head[:n]


class PhaseTimer:
    """Accumulates exclusive seconds per phase and bytes per step.

    Args:
        cuda_sync: how GPU work is charged to phases. ``None`` (default): with CUDA available,
            *events*: a CUDA event is recorded at each phase boundary (no host sync) and the
            device time between consecutive events is charged to the phase active in between,
            resolved once in :meth:`end_step` (one sync per step, where the step ends anyway);
            without CUDA, the host clock. ``True``: ``torch.cuda.synchronize()`` at every
            boundary (exact attribution, but it serialises what the optimizer overlaps).
            ``False``: the host clock only.
        clock: a function returning seconds (default ``time.perf_counter``).
        event_factory: makes the boundary events in events mode (default
            ``torch.cuda.Event(enable_timing=True)``; tests pass a fake). Each needs
            ``record()``, ``synchronize()`` and ``elapsed_time(later) -> milliseconds``.
        history_limit: step records kept in :attr:`history` (the most recent ones; default
            1000, None: every one). Older records are rolled up into per-key sums, so
            :meth:`totals` and :meth:`sums` cover every step while memory stays flat over
            arbitrarily long runs.

    Use ``begin_step()``, ``with timer.phase(name): ...``, ``add_bytes(...)``, ``end_step()``;
    ``history`` holds one dict per finished step (the last ``history_limit``), ``steps`` counts
    them all; :attr:`events`, what the pipeline decided (:meth:`event`), outside the sums. Without
    ``end_step()``, events mode resolves every :attr:`MAX_MARKS` boundaries (one host sync).

    Raises:
        ValueError: ``history_limit`` not an integer ≥ 1 (or None).
    """

    #: events mode: boundaries recorded before they are resolved without an end_step()
    MAX_MARKS = 4096
    #: at most this many :attr:`events` are kept (the newest)
    MAX_EVENTS = 1000
    #: first step records kept aside, so totals(skip_first) can leave out warm-up steps
    HEAD = 8

    def __init__(self, cuda_sync: Optional[bool] = None, clock=time.perf_counter, event_factory=None,
                 history_limit: Optional[int] = 1000):
        self._log = RecordLog(history_limit, head=self.HEAD)
        self.history_limit = self._log.limit
        self.clock = clock
        self.cuda_sync = bool(check_optional(cuda_sync, check_bool, "cuda_sync", " or None (events with CUDA)"))
        use_events = event_factory is not None or (cuda_sync is None and torch.cuda.is_available())
        self._event_factory = None
        if use_events:
            self._event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self.events: List[Dict[str, Any]] = []
        self._phases: Dict[str, "_Phase"] = {}
        self._stack: List[list] = []  # [name, start_of_current_slice, profiler range or None]
        self._marks: List[tuple] = []  # events mode: (event, phase charged for the slice ending here)
        self._begin_step_values()

    @property
    def history(self) -> List[Dict[str, Any]]:
        """The most recent step records (at most ``2·history_limit``; :class:`RecordLog`)."""
        return self._log.records

    @history.setter
    def history(self, records: List[Dict[str, Any]]) -> None:
        self._log.replace(records)

    @property
    def uses_events(self) -> bool:
        """Whether GPU phases are timed with events (see the class docstring)."""
        return self._event_factory is not None

    def _begin_step_values(self):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dense_bytes = 0
        self._t0 = self.clock()
        if self._event_factory is not None:
            self._marks = [(self._record(), None)]

    def _record(self):
        event = self._event_factory()
        event.record()
        return event

    def _boundary(self, now: float) -> None:
        """Close the slice of the phase on top of the stack at ``now``."""
        if not self._stack:
            if self._event_factory is not None:
                self._marks.append((self._record(), None))
            return
        top = self._stack[-1]
        if self._event_factory is not None:
            self._marks.append((self._record(), top[0]))
            if len(self._marks) > self.MAX_MARKS:  # (no end_step in sight: resolve, keep the last)
                self._charge_marks()
        else:
            self.seconds[top[0]] += now - top[1]

    def begin_step(self) -> None:
        """Start a new step (discards a step begun but not ended)."""
        self._begin_step_values()

    def phase(self, name: str) -> "_Phase":
        """Charge the enclosed wall time (minus nested phases) to ``name``: ``with timer.phase(name):``.

        The context object is cached per name (a few hundred hooks call this every step)."""
        ctx = self._phases.get(name)
        if ctx is None:
            ctx = self._phases[name] = _Phase(self, name)
        return ctx

    def _enter(self, name: str) -> None:
        if self.cuda_sync:
            torch.cuda.synchronize()
        now = self.clock()
        self._boundary(now)
        span = None
        if _profiling():
            span = record_function(f"hvdcomp.{name}")
            span.__enter__()
        self._stack.append([name, now, span])

    def _exit(self) -> None:
        if self.cuda_sync:
            torch.cuda.synchronize()
        now = self.clock()
        self._boundary(now)
        span = self._stack.pop()[2]
        if span is not None:
            span.__exit__(None, None, None)
        if self._stack:
            self._stack[-1][1] = now

    def _resolve_events(self) -> None:
        """Events mode: charge the device time between consecutive boundaries (one sync)."""
        self._marks.append((self._record(), self._stack[-1][0] if self._stack else None))
        self._charge_marks()

    def _charge_marks(self) -> None:
        """Charge the slices between the recorded boundaries (waits for the last), keeping only
        the last boundary as the start of the next slice."""
        self._marks[-1][0].synchronize()
        for (start, _), (end, phase) in zip(self._marks, self._marks[1:]):
            if phase is not None:
                self.seconds[phase] += start.elapsed_time(end) / 1000.0
        self._marks = self._marks[-1:]

    def add_bytes(self, sent: int = 0, received: int = 0, dense: int = 0) -> None:
        """Record bytes this rank put on / took off the wire, and the dense fp32 equivalent."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.dense_bytes += int(dense)

    def event(self, kind: str, record: Dict[str, Any]) -> None:
        """Keep ``record`` (a JSON-able dict the pipeline may still complete, e.g. a decision's
        measured step time) in :attr:`events` as ``{"kind", "timer_step", "record"}``
        (``timer_step``: steps ended so far). Not part of :meth:`sums` or :meth:`totals`. Bounded:
        past :attr:`MAX_EVENTS` the oldest half is dropped (a results file keeps what it needs of
        them as they come)."""
        self.events.append({"kind": kind, "timer_step": self.steps, "record": record})
        if len(self.events) > self.MAX_EVENTS:
            del self.events[: self.MAX_EVENTS // 2]

    def end_step(self) -> Dict[str, Any]:
        """Close the step, append its record to ``history`` and return it."""
        if self._event_factory is not None:
            self._resolve_events()
        rec = {p: self.seconds.get(p, 0.0) for p in PHASES}
        rec.update({k: v for k, v in self.seconds.items() if k not in rec})
        rec["wall"] = self.clock() - self._t0
        rec["bytes_sent"] = self.bytes_sent
        rec["bytes_received"] = self.bytes_received
        rec["dense_bytes"] = self.dense_bytes
        self._log.append(rec)
        self._begin_step_values()
        return rec

    @property
    def steps(self) -> int:
        """Steps ended so far (in :attr:`history` or rolled up)."""
        return len(self._log)

    def sums(self, skip_first: int = 0) -> Dict[str, float]:
        """Per-key sums (seconds, bytes) over every ended step but the first ``skip_first``.

        Raises:
            ValueError: ``skip_first`` larger than :attr:`HEAD` once old records were rolled up.
        """
        out = self._log.sums()
        for r in self._log.first(skip_first) if skip_first else ():
            for k, v in r.items():
                if k in out and _is_number(v):
                    out[k] -= v
        return out

    def totals(self, skip_first: int = 0) -> Dict[str, float]:
        """Per-step means (seconds, bytes) over every ended step but the first ``skip_first``
        (all of them when there are no more), and ``steps``, the count averaged over."""
        if skip_first >= self.steps:
            skip_first = 0
        if not self.steps:
            return {"steps": 0}
        n = self.steps - skip_first
        out = {k: v / n for k, v in sorted(self.sums(skip_first).items())}
        out["steps"] = n
        return out


class _Phase:
    """``with timer.phase(name):`` without a generator (re-entrant: nesting is kept by the timer)."""

    __slots__ = ("timer", "name")

    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.timer._enter(self.name)
        return self

    def __exit__(self, *exc):
        self.timer._exit()
        return False


def reduce_across_ranks(values: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """min / mean / max over ranks of each numeric value (collective over the job's group,
    :func:`hvdcomp.comm.resolve_group`: Horovod's, else ``torch.distributed``'s; none: this
    process alone).

    Every rank must call it with the same keys. Returns ``{key: {"min", "mean", "max"}}``.
    """
    from .comm import resolve_group

    keys = sorted(values)
    local = torch.tensor([[float(values[k]) for k in keys]], dtype=torch.float64)
    try:
        group = resolve_group()
    except RuntimeError:  # (neither Horovod nor torch.distributed is initialised)
        group = None
    allv = torch.cat(group.allgather_object(local, "hvdcomp.metrics.reduce")) if group and group.size > 1 else local
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
