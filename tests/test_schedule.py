"""hvdcomp.lm.PlateauSchedule: warm-up, annealing on plateaus and early stopping, against
hand-worked sequences."""
import math

import pytest

from hvdcomp.lm import PlateauSchedule


def run(sched, vals):
    """(lr after each epoch, stop flag after each epoch)."""
    out = []
    for v in vals:
        stop = sched.end_epoch(v)
        out.append((sched.lr, stop))
    return out


def test_pytorch_example_rule_divides_by_4_after_every_bad_epoch():
    # word_language_model: lr /= 4 whenever validation did not improve; never stops by itself
    s = PlateauSchedule(20.0)
    assert run(s, [500, 400, 410, 390, 395, 396]) == [
        (20.0, False), (20.0, False), (5.0, False), (5.0, False), (1.25, False), (0.3125, False)]
    assert (s.best, s.best_epoch, s.anneals, s.bad_epochs) == (390, 4, 3, 2)


def test_anneal_patience_waits_and_restarts_after_each_anneal():
    s = PlateauSchedule(16.0, anneal=2, anneal_patience=1)
    # bad epochs 3,4 -> anneal at 4; 5 bad (1 since anneal) -> keep; 6 bad -> anneal; 7 improves
    lrs = [lr for lr, _ in run(s, [100, 90, 95, 96, 97, 98, 80])]
    assert lrs == [16, 16, 16, 8, 8, 4, 4]


def test_early_stop_after_patience_bad_epochs_in_a_row():
    s = PlateauSchedule(1.0, anneal=1, early_stop=2)
    assert [stop for _, stop in run(s, [10, 11, 9, 12, 13])] == [False, False, False, False, True]
    assert s.best_epoch == 3 and s.lr == 1.0


def test_no_early_stop_before_min_epochs():
    s = PlateauSchedule(1.0, anneal=1, early_stop=2, min_epochs=4)
    assert [stop for _, stop in run(s, [10, 11, 12, 13, 14])] == [False, False, False, True, True]


def test_min_improvement_is_relative():
    s = PlateauSchedule(1.0, anneal=2, min_improvement=0.01)
    s.end_epoch(100.0)
    s.end_epoch(99.5)  # less than 1 % better: a plateau, but the new best (its weights are kept)
    assert s.best == 99.5 and s.improved and s.lr == 0.5 and s.bad_epochs == 1
    s.end_epoch(98.6)  # 0.9 % below 99.5: still a plateau
    assert s.best == 98.6 and s.lr == 0.25 and s.bad_epochs == 2
    s.end_epoch(97.5)  # 1.1 % below 98.6: improving
    assert s.best == 97.5 and s.lr == 0.25 and s.bad_epochs == 0


def test_non_finite_perplexity_stops_and_is_never_best():
    s = PlateauSchedule(1.0, early_stop=10)
    assert s.end_epoch(50.0) is False
    assert s.end_epoch(math.nan) is True
    assert s.best == 50.0 and not s.improved


def test_linear_warmup_reaches_the_annealed_rate():
    s = PlateauSchedule(8.0, warmup_steps=4)
    assert [s.lr_at(i) for i in range(6)] == [2.0, 4.0, 6.0, 8.0, 8.0, 8.0]
    s.end_epoch(10.0)
    s.end_epoch(11.0)
    assert s.lr_at(1) == 1.0 and s.lr_at(100) == 2.0


def test_state_dict_round_trip_resumes_identically():
    a = PlateauSchedule(20.0, early_stop=3)
    run(a, [300, 290, 295])
    b = PlateauSchedule(20.0, early_stop=3)
    b.load_state_dict(a.state_dict())
    assert run(a, [296, 297]) == run(b, [296, 297])


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": 0.0}, "lr must be"), ({"lr": math.inf}, "lr must be"), ({"lr": 1.0, "anneal": 0.5}, "anneal must"),
    ({"lr": 1.0, "early_stop": -1}, "early_stop"), ({"lr": 1.0, "warmup_steps": 1.5}, "warmup_steps"),
    ({"lr": 1.0, "min_epochs": -2}, "min_epochs"),
    ({"lr": 1.0, "min_improvement": 1.0}, "min_improvement")])
def test_bad_settings_are_rejected_with_the_field_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlateauSchedule(**kwargs)
