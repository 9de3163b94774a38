"""Issue 57, item 8: a non-finite step's message names the ranks whose own gradient was non-finite,
and no rank where the NaN was only seen in an averaged result every rank holds (a gradient
averaged in place by ``none``): it used to name every rank. One process: NonFiniteGuard with the
ranks' exchange simulated; the DDP front-end at 2 ranks (tests/ddp_checks.py nonfinite-names).
The Horovod front-end: tests/mpi/reliability_checks.py (nonfinite_raise) and 1-bit Adam's warm-up
in tests/mpi/adaptive_optimizer_checks.py (nonfinite_warmup_names_the_right_rank)."""
import logging

import pytest
import torch

from hvdcomp.agreement import NonFiniteGuard
from tests.test_ddp import ddp_checks

NAN = torch.tensor([1.0, float("nan")])
FINE = torch.tensor([1.0, 2.0])


def exchange_with(other_rows, rank):
    """The allgather of :meth:`NonFiniteGuard.agree` on simulated ranks: this rank's row at
    ``rank``, the others' rows given."""
    def exchange(mine):
        rows = list(other_rows)
        rows.insert(rank, list(mine))
        return rows
    return exchange


def test_a_ranks_own_gradient_names_that_rank():
    guards = [NonFiniteGuard("skip"), NonFiniteGuard("skip")]
    guards[0].observe([FINE])
    guards[1].observe([NAN])
    rows = [[0, 0, 1], [1, 0, 1]]  # what each rank contributes: [non-finite, loaded, passes]
    for r, guard in enumerate(guards):
        verdict = guard.agree(exchange_with([rows[1 - r]], r), False, 1)
        assert (verdict.skip, verdict.bad_ranks, verdict.averaged) == (True, [1], False)


@pytest.mark.parametrize("summed", [False, True])
def test_an_averaged_result_names_no_rank(summed, caplog):
    """Every rank sees the NaN in the averaged result (``averaged=True``): skipped on every rank,
    naming none (before: ranks [0, 1]); with nonfinite="raise" the error says the rank is not
    known."""
    for r in range(2):
        guard = NonFiniteGuard("skip")
        guard.observe([NAN], averaged=True)
        with caplog.at_level(logging.WARNING, logger="hvdcomp.agreement"):
            verdict = (guard.agree_summed([2.0, 0.0, 2.0, 2.0], None, False, 1) if summed
                       else guard.agree(exchange_with([[0, 0, 1]], r), False, 1))
        assert (verdict.skip, verdict.bad_ranks, verdict.averaged) == (True, [], True)
        assert "not known" in caplog.text and "rank(s) [" not in caplog.text
        caplog.clear()
    guard = NonFiniteGuard("raise")
    guard.observe([NAN], averaged=True)
    guard.observe([FINE])
    with pytest.raises(FloatingPointError, match="in an averaged result .*not known") as err:
        guard.agree(exchange_with([[0, 0, 1]], 0), False, 1)
    assert "rank(s)" not in str(err.value)


def test_both_kinds_in_one_step_and_a_clean_step():
    guard = NonFiniteGuard("raise")
    guard.observe([NAN])
    guard.observe([NAN], averaged=True)
    with pytest.raises(FloatingPointError, match=r"on rank\(s\) \[0\] and in an averaged result"):
        guard.agree(exchange_with([[0, 0, 1]], 0), False, 1)
    guard.observe([FINE])
    guard.observe([FINE], averaged=True)
    assert guard.agree(exchange_with([[0, 0, 1]], 0), False, 1).skip is False


def test_ddp_front_end_names_the_rank_or_none():
    ddp_checks(2, "nonfinite-names")


def test_the_verdict_riding_on_a_first_allreduce():
    """Issue 59 (:meth:`NonFiniteGuard.riding`): on 2 simulated ranks, rank 1's gradient NaN,
    the verdict row [1, loaded, passes, passes², non-finite] of each rank is appended to the first
    allreduce; its mean (the sum over 2 ranks / 2) hands back the tensor's own mean and a sum with
    a non-finite count, so the allgather follows and names rank 1; clean sums: no allgather, no skip;
    the second call passes through; "ignore" appends nothing."""
    from hvdcomp.agreement import StepSkipped

    rows = [[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0, 1.0]]
    for bad in (True, False):
        guard, sent, gathers = NonFiniteGuard("skip"), [], []
        guard.observe([NAN if bad else FINE])
        other = torch.tensor([10.0, 20.0] + rows[0])  # rank 0's tensor and row

        def mean(t, name):
            sent.append((name, t.tolist()))
            return (t + other) / 2 if len(sent) == 1 else t

        def exchange(mine):
            gathers.append(list(mine))
            return [[0, 0, 1], list(mine)]

        call = guard.riding(mean, 2, exchange, False, 1)
        if bad:
            with pytest.raises(StepSkipped) as info:
                call(torch.tensor([2.0, 4.0]), "p")
            assert info.value.verdict.bad_ranks == [1] and gathers == [[1, 0, 1]]
        else:
            assert call(torch.tensor([2.0, 4.0]), "p").tolist() == [6.0, 12.0] and gathers == []
            assert call(torch.tensor([1.0]), "q").tolist() == [1.0]
        assert sent[0] == ("p", [2.0, 4.0] + rows[1 if bad else 0])
    ignored = NonFiniteGuard("ignore").riding(lambda t, name: t, 2, None, False, 1)
    assert ignored(torch.tensor([3.0]), "p").tolist() == [3.0]
