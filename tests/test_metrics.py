"""PhaseTimer accounting (with a fake clock) and atomic JSON writes."""
import json

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
