"""PhaseTimer accounting (with a fake clock) and atomic JSON writes."""
import json

import pytest
import torch

from hvdcomp.metrics import PhaseTimer, write_json_atomic


def test_phases_are_exclusive():
    clock = iter([0.0, 0.0, 1.0, 1.5, 4.0, 4.25, 5.0, 5.0, 5.0])
    t = PhaseTimer(cuda_sync=False, clock=lambda: next(clock))  # begin at 0.0
    with t.phase("compute"):                         # 0.0
        pass                                         # (outer paused during nested)
        with t.phase("compress"):                    # 1.0
            pass
        # compress ends 1.5
    # compute ends 4.0 -> compute = (1.0 - 0) + (4.0 - 1.5) = 3.5
    with t.phase("communicate"):                     # 4.25
        pass                                         # ends 5.0
    t.add_bytes(sent=10, received=40, dense=100)
    rec = t.end_step()                               # wall = 5.0
    assert rec["compute"] == 3.5 and rec["compress"] == 0.5 and rec["communicate"] == 0.75
    assert rec["decompress"] == 0.0 and rec["wall"] == 5.0
    assert (rec["bytes_sent"], rec["bytes_received"], rec["dense_bytes"]) == (10, 40, 100)


def test_totals_are_per_step_means():
    t = PhaseTimer(cuda_sync=False)
    t.history = [{"compute": 1.0, "bytes_sent": 10}, {"compute": 3.0, "bytes_sent": 30},
                 {"compute": 5.0, "bytes_sent": 50}]
    assert t.totals(skip_first=1) == {"compute": 4.0, "bytes_sent": 40.0, "steps": 2}


def test_write_json_atomic(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json_atomic(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


class _FakeEvent:
    """Stands in for torch.cuda.Event: records the fake device clock when record() is called."""

    device_clock = [0.0]  # milliseconds

    def record(self):
        self.t = self.device_clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, later):
        return later.t - self.t


def test_event_timing_charges_device_time_between_boundaries_without_syncs():
    """Events mode: each slice between phase boundaries is charged the device time between the
    events recorded at its ends (here 2 + 5 ms compute around a 3 ms compress, then 4 ms
    communicate); host-clock slices are not used for phases, only for the wall time."""
    dev = _FakeEvent.device_clock
    dev[0] = 0.0
    t = PhaseTimer(event_factory=_FakeEvent, clock=lambda: 0.0)
    assert t.uses_events and not t.cuda_sync
    with t.phase("compute"):          # device at 0
        dev[0] = 2.0
        with t.phase("compress"):     # 2
            dev[0] = 5.0
        dev[0] = 10.0                 # compress ended at 5; compute runs 5..10
    dev[0] = 11.0                     # outside any phase: not charged
    with t.phase("communicate"):      # 11
        dev[0] = 15.0
    rec = t.end_step()
    assert abs(rec["compute"] - 0.007) < 1e-12 and abs(rec["compress"] - 0.003) < 1e-12
    assert abs(rec["communicate"] - 0.004) < 1e-12 and rec["decompress"] == 0.0
    # the next step starts from a fresh start event
    with t.phase("compute"):
        dev[0] = 16.5
    assert abs(t.end_step()["compute"] - 0.0015) < 1e-12


def test_phases_are_profiler_ranges_only_while_a_profiler_runs():
    """Under torch.profiler each phase is a range named hvdcomp.<phase>, nested as the phases
    are; without a profiler no range is opened (the timer's stack holds None)."""
    timer = PhaseTimer(cuda_sync=False)
    with timer.phase("compress"):
        assert timer._stack[-1][2] is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timer.begin_step()
        with timer.phase("compute"):
            with timer.phase("compress"):
                torch.ones(3).sum()
            with timer.phase("communicate"):
                pass
        timer.end_step()
    events = {e.name: e for e in prof.events() if e.name.startswith("hvdcomp.")}
    assert set(events) == {"hvdcomp.compute", "hvdcomp.compress", "hvdcomp.communicate"}
    outer, inner = events["hvdcomp.compute"].time_range, events["hvdcomp.compress"].time_range
    assert outer.start <= inner.start and inner.end <= outer.end


def test_both_front_ends_show_their_phases_in_a_profiler_trace():
    from tests.mpirun import check
    out = check(2, ["tests/mpi/profiler_checks.py"], timeout=180)
    assert "OK horovod" in out and "OK ddp" in out, out[-3000:]


def test_history_is_bounded_and_totals_cover_every_step():
    """10 000 steps of step i sending i bytes, history_limit 100: at most 200 records are ever
    held, yet sums and totals are the closed forms over all steps (Σi = n(n−1)/2), skipping the
    first ones too; the last records are the newest."""
    n = 10_000
    t = PhaseTimer(cuda_sync=False, clock=lambda: 0.0, history_limit=100)
    held = 0
    for i in range(n):
        t.add_bytes(sent=i)
        t.end_step()
        held = max(held, len(t.history))
    assert held <= 200 and t.steps == n and t.history[-1]["bytes_sent"] == n - 1
    assert t.sums()["bytes_sent"] == n * (n - 1) // 2
    tot = t.totals(skip_first=3)
    assert tot["steps"] == n - 3 and tot["bytes_sent"] == (n * (n - 1) // 2 - 3) / (n - 3)
    with pytest.raises(ValueError, match="skip_first=9"):
        t.sums(skip_first=9)
    with pytest.raises(ValueError, match="history_limit"):
        PhaseTimer(history_limit=0)
    assert len(PhaseTimer(history_limit=None).history) == 0


def test_events_never_resolved_by_end_step_stay_bounded():
    """A loop that never calls begin_step()/end_step() (the local-update and adaptive examples)
    keeps at most MAX_MARKS + 1 events; the device time is still charged: 3 ms of compress per
    iteration over 5000 iterations."""
    dev = _FakeEvent.device_clock
    dev[0] = 0.0
    t = PhaseTimer(event_factory=_FakeEvent, clock=lambda: 0.0)
    most = 0
    for _ in range(5000):
        with t.phase("compress"):
            dev[0] += 3.0
        dev[0] += 1.0
        most = max(most, len(t._marks))
    assert most <= PhaseTimer.MAX_MARKS + 1
    assert abs(t.end_step()["compress"] - 5000 * 0.003) < 1e-9
