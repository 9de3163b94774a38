"""``compression="auto"`` (hvdcomp/auto.py): the decision rule on hand-worked cost tables, the
pricing of the candidates in closed form, phases (Accordion) and drift on a policy driven by hand,
a switch mid-run keeping error feedback exact (one rank, torch.distributed gloo), and at 2 ranks
under mpirun the whole loop: agreement, the hand-worked choice, re-decision when the link slows,
the exactness of a switch on the mean over ranks, a leader's top-k measured across the ranks
(tests/mpi/auto_checks.py); the same through the DDP hook (tests/ddp_checks.py check_auto,
check_auto_var), under ddp.join() and with a skipped step (check_auto_join); checkpoints mid-probe
and skipped steps in one process, both front-ends."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import hvdcomp
from hvdcomp.auto import Auto, Policy, Row, comm_seconds, decide, memories
from hvdcomp.comm.costmodel import CostModel

from mpirun import check as mpirun_check

# ---- a hand-worked cost table -----------------------------------------------------------------------
# One 1024 x 1024 weight and its bias: n = 1 049 600 float32 elements, on p = 4 ranks.
SHAPES = [torch.Size([1024, 1024]), torch.Size([1024])]
N = 1024 * 1024 + 1024
P = 4
SLOW = CostModel(1e-3, 8e-7)    # 10 Mbit/s: 8e-7 s per byte, 1 ms latency
FAST = CostModel(1e-5, 8e-10)   # 10 Gbit/s


def ring_allreduce(model, nbytes, p=P):
    """Thakur et al.'s ring allreduce: 2(p-1) messages, 2(p-1)/p of the bytes each way."""
    return 2 * (p - 1) * model.alpha + 2 * (p - 1) / p * nbytes * model.beta


def hand_comm(label, model):
    """Communication seconds per step of each candidate, worked out from the methods' papers."""
    if label == "none":          # fp32 gradient, one (fused) allreduce
        return ring_allreduce(model, 4 * N)
    if label == "fp16":          # half the bytes
        return ring_allreduce(model, 2 * N)
    if label == "powersgd:matrix_rank=2":
        # P of the matrix (r·n = 2048 floats) with the uncompressed bias (1024 floats), then Q (r·m = 2048)
        return ring_allreduce(model, 4 * (2048 + 1024)) + ring_allreduce(model, 4 * 2048)
    if label == "cltk:density=0.01":
        k = math.ceil(0.01 * N)  # the leader's k int32 positions by binomial broadcast, k float32 values by allreduce
        return 2 * model.alpha + 2 * 4 * k * model.beta + ring_allreduce(model, 4 * k)
    if label == "cltk:density=0.01,leader=variance":  # VAR-Topk: cltk after an allreduce of P float32
        return hand_comm("cltk:density=0.01", model) + ring_allreduce(model, 4 * P)
    raise KeyError(label)


LABELS = ["none", "fp16", "powersgd:matrix_rank=2", "cltk:density=0.01"]
CODE = [0.0, 0.01, 0.05, 0.03]           # measured encode + decode seconds (posed)
ERRORS = [0.0, 1e-4, 0.6, 0.8]           # measured relative errors (posed)


def test_candidates_priced_in_closed_form():
    methods = [hvdcomp.get_compressor(label) for label in LABELS]
    for model in (SLOW, FAST):
        for label, method in zip(LABELS, methods):
            method.bind_group(P)
            got = comm_seconds(method, model, P, SHAPES, 25 * 2**20)
            assert got == pytest.approx(hand_comm(label, model), rel=1e-9), (label, model)
    var = hvdcomp.get_compressor("cltk:density=0.01,leader=variance")  # VAR-Topk, a candidate priced like the rest
    var.bind_group(P)
    assert comm_seconds(var, SLOW, P, SHAPES, 25 * 2**20) == pytest.approx(
        hand_comm("cltk:density=0.01,leader=variance", SLOW), rel=1e-9)
    # the numbers the next test decides on, by hand: on the slow link none 5.044 s, fp16 2.525 s,
    # PowerSGD rank 2 0.03658 s, cltk 0.1256 s
    assert hand_comm("none", SLOW) == pytest.approx(6e-3 + 1.5 * 4 * N * 8e-7)
    assert hand_comm("powersgd:matrix_rank=2", SLOW) == pytest.approx(0.036576)
    assert hand_comm("cltk:density=0.01", SLOW) == pytest.approx(0.1255552, rel=1e-6)


def test_rule_compresses_hard_on_a_slow_link_and_stays_dense_on_a_fast_one():
    compute = 1.0
    slow = [Row(label, hand_comm(label, SLOW), code, err) for label, code, err in zip(LABELS, CODE, ERRORS)]
    # predicted steps: none 6.044, fp16 3.535, PowerSGD 1.0866, cltk 1.1556: only PowerSGD within 1.1 s
    choice = decide(slow, compute, slack=1.1, tolerance=1.0)
    assert choice["label"] == "powersgd:matrix_rank=2" and choice["predicted_step_s"] == pytest.approx(1.086576)
    assert "within 1.1x" in choice["reason"]
    # a looser slack admits cltk too: the least error of the two (PowerSGD's 0.6) still wins
    assert decide(slow, compute, slack=1.2, tolerance=1.0)["label"] == "powersgd:matrix_rank=2"
    # an error tolerance of 0.5 leaves out both compressors: of none and fp16, the fastest (fp16)
    tight = decide(slow, compute, slack=1.1, tolerance=0.5)
    assert tight["label"] == "fp16" and "fastest" in tight["reason"] and "tolerance" in tight["reason"]
    fast = [Row(label, hand_comm(label, FAST), code, err) for label, code, err in zip(LABELS, CODE, ERRORS)]
    # none: 1 + 6e-5 + 1.5·4N·8e-10 = 1.0051 s <= 1.1 s with error 0: stay dense
    assert decide(fast, compute, slack=1.1, tolerance=1.0)["label"] == "none"
    # compute too short to hide anything: none within slack, the fastest predicted step
    assert decide(slow, 0.01, slack=1.1, tolerance=1.0)["label"] == "powersgd:matrix_rank=2"
    assert "fastest" in decide(slow, 0.01, slack=1.1, tolerance=1.0)["reason"]


def test_rule_ties_and_unpriced_rows():
    rows = [Row("a", None, 0.0, 0.0), Row("b", 0.1, 0.0, 0.5), Row("c", 0.1, 0.0, 0.5)]
    assert decide(rows, 1.0, 1.1, 1.0)["label"] == "b"  # a has no price; b and c tie: the earlier
    with pytest.raises(ValueError, match="no candidate"):
        decide([Row("a", None, 0.0, 0.0)], 1.0, 1.1, 1.0)


START, SLOWER = CostModel(1.0, 1.0), CostModel(2.0, 2.0)  # (keys of the posed prices)


def _policy(comm, code, errors, drift=0.0, remeasure=None, **settings):
    auto = Auto(candidates=[f"topk:density={d}" for d in (0.5, 0.1, 0.01)][:len(code)], **settings)
    models = iter(remeasure or [])
    policy = Policy(auto, auto.candidates, lambda model: comm[model], START, lambda: next(models), drift)
    policy.start()
    policy.probed(3, 1.0, code, errors)
    return policy


def test_accordion_critical_regime_compresses_less():
    # A: predicted 1.3 s, error 0.2; B: predicted 1.05 s, error 0.7. Critical (slack 1.5): A; stable (1.1): B
    policy = _policy({START: [0.3, 0.05]}, [0.0, 0.0], [0.2, 0.7], accordion=0.5, critical_slack=1.5)
    assert policy.regime == "critical" and policy.decisions[-1]["chosen"] == "topk:density=0.5"
    assert policy.window(13, 1.3, 1.0, 0.3, norm=10.0) is None           # the first norm: nothing to compare
    decision = policy.window(23, 1.3, 1.0, 0.3, norm=9.0)                  # |10 - 9| / 10 = 0.1 < 0.5: stable
    assert decision["cause"] == "phase" and decision["chosen"] == "topk:density=0.1"
    assert policy.decisions[1]["measured_step_s"] == 1.3                     # the probe's decision, measured
    assert policy.window(33, 1.05, 1.0, 0.05, norm=8.5) is None           # 0.056: still stable
    decision = policy.window(43, 1.05, 1.0, 0.05, norm=20.0)               # 1.35 >= 0.5: critical again
    assert decision["cause"] == "phase" and decision["regime"] == "critical"
    assert decision["chosen"] == "topk:density=0.5"


def test_drift_remeasures_and_redecides():
    # start: the link prices A at 0.02 s and B at 0.01 s (both within slack: A, the least error);
    # then the exposed time grows 20x: measured again, the link prices A at 1.0 s: B
    comm = {START: [0.02, 0.01], SLOWER: [1.0, 0.05]}
    policy = _policy(comm, [0.0, 0.0], [0.2, 0.7], drift=2.0, remeasure=[SLOWER], accordion=0)
    assert policy.decisions[-1]["chosen"] == "topk:density=0.5"
    assert policy.window(13, 1.03, 1.0, 0.03, None) is None   # calibrates: measured / predicted = 1.5
    assert policy.window(23, 1.04, 1.0, 0.04, None) is None   # 2.0 / 1.5: within the factor 2
    decision = policy.window(33, 1.4, 1.0, 0.4, None)          # 20 / 1.5 = 13x: re-measured
    assert decision["cause"] == "drift" and decision["chosen"] == "topk:density=0.1"
    assert policy.model == SLOWER and decision["table"]["topk:density=0.5"]["comm_s"] == 1.0
    # with a given link (drift off) the same slowdown changes nothing
    still = _policy(comm, [0.0, 0.0], [0.2, 0.7], drift=0.0, accordion=0)
    for step, exposed in ((13, 0.03), (23, 0.04), (33, 0.4)):
        assert still.window(step, 1.0 + exposed, 1.0, exposed, None) is None


def test_settings_are_validated_with_the_fix():
    for kwargs, words in (({"slack": 0.9}, "slack must be >= 1 and finite, got 0.9"),
                          ({"candidates": ["fp16", "fp16"]}, "listed twice"),
                          ({"candidates": ["dgc"]}, "applies momentum itself"),
                          ({"candidates": ["twophase"]}, "server residual"),
                          ({"candidates": []}, "non-empty list"),
                          ({"drift": 1.0}, "drift must be 0"),
                          ({"interval": 2}, "shorter than a probe"),
                          ({"window": 0}, "window must be an integer >= 1")):
        with pytest.raises(ValueError, match=words):
            Auto(**kwargs)
    spec = hvdcomp.get_compressor("auto:candidates=fp16+powersgd:matrix_rank=2+topk:density=0.01;values=fp16,slack=1.2")
    assert isinstance(spec, Auto) and spec.slack == 1.2
    assert spec.candidates == ["fp16", "powersgd:matrix_rank=2", "topk:density=0.01,values=fp16"]
    with pytest.raises(TypeError, match="chooses among methods"):
        spec.encode(torch.zeros(3))
    assert "auto" not in hvdcomp.available()  # (not a method: the reducer's choice among them)


# ---- one rank, torch.distributed: the reducer's switch --------------------------------------------------
@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _residuals(method):
    out = {}
    for mem in memories(method):
        out.update({n: e.detach().reshape(-1).clone() for n, e in mem.committed.items()})
    return out


def test_switch_keeps_error_feedback_exact(one_rank):
    """sent + new residual = gradient + old residual, on the step after each switch (one rank:
    what is sent is the averaged gradient itself)."""
    from hvdcomp.optimizer import distributed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    names = [n for n, _ in model.named_parameters()]
    auto = Auto(candidates=["topk:density=0.1", "powersgd:matrix_rank=1", "cltk:density=0.05", "none"],
                probe=50, interval=0)  # (no decision of its own within the test)
    opt = distributed(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), auto,
                      cost_model=(1e-4, 1e-8))
    x, y = torch.randn(20, 24), torch.randn(20, 6)
    state = opt.auto
    assert opt.compression.name == "topk"  # one rank: every link is free, the first candidate

    def step():
        ref = copy.deepcopy(model)  # the local gradient, computed apart
        torch.nn.functional.mse_loss(ref(x), y).backward()
        g = {n: p.grad.reshape(-1).clone() for n, p in ref.named_parameters()}
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        sent = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
        with opt.skip_synchronize():
            opt.step()
        return g, sent

    for _ in range(2):
        step()
    for index in (1, 2, 3, 0):
        old = _residuals(opt.compression)
        assert any(float(e.abs().max()) > 1e-3 for e in old.values()) or opt.compression.name == "none"
        state.switch(index)
        assert opt.compression is state.pipelines[index].compression
        assert not _residuals(state.pipelines[index - 1 if index else 3].compression) or all(
            float(e.abs().max()) == 0 for e in _residuals(state.pipelines[index - 1 if index else 3].compression).values())
        g, sent = step()
        new = _residuals(opt.compression)
        for n in names:
            lhs = sent[n] + new.get(n, torch.zeros_like(sent[n]))
            rhs = g[n] + old.get(n, torch.zeros_like(g[n]))
            torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-6, msg=f"{n} after the switch to {index}")
        assert state.carry == {}  # the applied step took it
    # a checkpoint holds the choice, the carry and every candidate's state; it loads back
    state.switch(1)
    saved = opt.state_dict()
    assert saved["hvdcomp"]["auto"]["current"] == "powersgd:matrix_rank=1"
    assert saved["hvdcomp"]["auto"]["carry"]  # topk's residual, not applied yet
    state.switch(0)
    opt.load_state_dict(saved)
    assert opt.compression.name == "powersgd" and set(state.carry) == set(saved["hvdcomp"]["auto"]["carry"])


def test_auto_refuses_an_unpriced_setup(one_rank):
    from hvdcomp.optimizer import distributed

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="cost_model='measure'"):
        distributed(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "auto", cost_model="off")


def test_auto_decides_from_measured_compute_on_one_rank(one_rank):
    """The loop on one rank: a probe, a decision (every link is free on one rank: the least
    error, none), windows that measure it, decisions in the timer's events."""
    from hvdcomp.optimizer import distributed

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    model = torch.nn.Linear(16, 4)
    auto = Auto(candidates=["topk:density=0.25", "fp16", "none"], probe=2, window=2, warmup=1, interval=0, clock=clock)
    opt = distributed(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), auto,
                      cost_model=(1e-4, 1e-8))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(8):
        clock.now += 0.5  # half a second of compute per step
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    decisions = opt.auto.decisions
    assert [d["cause"] for d in decisions[:2]] == ["start", "probe"]
    assert decisions[0]["chosen"] == "topk:density=0.25"     # the fastest link while measuring: a tie, the first
    assert decisions[0]["route"] == str(opt.auto.pipelines[0].plan) and "allgather" in decisions[0]["route"]
    assert decisions[1]["chosen"] == "none" and decisions[1]["step"] == 2   # after warmup 1 + probe 2
    assert decisions[1]["compute_s"] == 0.5 and decisions[1]["measured_step_s"] == 0.5
    assert decisions[1]["table"]["topk:density=0.25"]["error"] > 0.3  # (a quarter of the entries kept)
    assert decisions[1]["table"]["none"]["error"] == 0.0
    assert opt.compression.name == "none"
    assert [e["record"] for e in opt.timer.events if e["kind"] == "auto"] == decisions


class _Clock:
    """A fake clock: the training loop adds half a second of compute per iteration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


#: probes at steps 1-2 and 6-7 (warm-up 1, re-probe every 5), windows of 2, Accordion on
RESUME_SETTINGS = dict(probe=2, warmup=1, window=2, interval=5, accordion=0.5)
RESUME_CANDIDATES = ["topk:density=0.25", "powersgd:matrix_rank=1", "topk:density=0.5"]


def _auto_run(front_end, steps, nan_before=None, resume=None, candidates=RESUME_CANDIDATES, **settings):
    """One rank, Linear 24→32→6, SGD, ``compression="auto"`` through ``front_end`` (``"horovod"``:
    hvdcomp.DistributedOptimizer over torch.distributed; ``"ddp"``: the hook) with a given cost
    model and a fake clock, on the data of ``steps``. ``nan_before=s``: one extra iteration with a
    NaN loss before step ``s`` (skipped). ``resume``: a checkpoint of :func:`_checkpoint` to load
    first. Returns ``(module, opt, state)``, ``state`` the optimizer or the hook."""
    import hvdcomp.ddp
    from hvdcomp.optimizer import distributed

    clock = _Clock()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    auto = Auto(candidates=candidates, clock=clock, **(settings or RESUME_SETTINGS))
    if front_end == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = hvdcomp.ddp.register(model, auto, optimizer=opt, cost_model=(1e-4, 1e-8))
    else:
        model = module
        opt = state = distributed(torch.optim.SGD(module.parameters(), lr=0.05), module.named_parameters(), auto,
                                  cost_model=(1e-4, 1e-8))
    if resume is not None:
        module.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        if front_end == "ddp":
            state.load_state_dict(resume["hook"])
    for step in steps:
        for bad in ((True, False) if step == nan_before else (False,)):
            clock.now += 0.5
            opt.zero_grad()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(20, 24, generator=g), torch.randn(20, 6, generator=g)
            (torch.nn.functional.mse_loss(model(x), y) * (float("nan") if bad else 1.0)).backward()
            opt.step()
    return module, opt, state


def _checkpoint(module, opt, state):
    """What a training script saves, through ``torch.save`` and back with ``weights_only=True``."""
    import io

    buf = io.BytesIO()
    saved = {"model": module.state_dict(), "opt": opt.state_dict()}
    if state is not opt:
        saved["hook"] = state.state_dict()
    torch.save(saved, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _held(state):
    """What auto holds that later decisions depend on."""
    auto = state.auto
    policy = auto.policy
    return {"decisions": policy.decisions, "regime": policy.regime, "previous_norm": policy.previous_norm,
            "compute_s": policy.compute_s, "errors": policy.errors, "steps": auto.steps,
            "current": auto.labels[policy.current]}


@pytest.mark.parametrize("front_end", ["horovod", "ddp"])
def test_a_checkpoint_mid_probe_resumes_as_the_uninterrupted_run(one_rank, front_end):
    """A checkpoint after step 1 (in the first probe) and after step 6 (in the re-probe), loaded
    into a fresh run that goes on to step 12: parameters and every decision (measured errors,
    compute, regime, Accordion's norm) = the uninterrupted run's. Before, a checkpoint held only
    the choice, the carry and the candidates' state: the resumed run lost the probe's sums and the
    one-rank copies' residuals (the error of top-k 25 % read 0.59, not 0.71), the decisions so far,
    and its schedule (no re-probe, no window: 2 decisions after the resume against 3)."""
    whole = _auto_run(front_end, range(12))
    assert [d["cause"] for d in whole[2].auto.decisions][:3] == ["start", "probe", "probe"]
    for k in (2, 7):
        first = _auto_run(front_end, range(k))
        assert first[2].auto._probing(k - 1) and first[2].auto._probing(k)  # (mid-probe)
        resumed = _auto_run(front_end, range(k, 12), resume=_checkpoint(*first))
        for a, b in zip(whole[0].parameters(), resumed[0].parameters()):
            assert torch.equal(a, b), (k, float((a - b).abs().max()))
        assert _held(resumed[2]) == _held(whole[2]), k


@pytest.mark.parametrize("front_end", ["horovod", "ddp"])
def test_a_skipped_step_in_a_probe_leaves_the_decision_as_without_it(one_rank, front_end):
    """A NaN loss in the one-step probe (step 1): skipped, and the run = the one without that
    iteration: parameters, decisions and the compute they measured (the step after the skip
    counted two waits and was left out of the probe: the decision's compute-only step read 0.0,
    not 0.5 s). The DDP hook with a joined rank: tests/ddp_checks.py check_auto_join."""
    settings = dict(probe=1, warmup=1, window=2, interval=4, accordion=0.5)
    clean = _auto_run(front_end, range(8), **settings)
    bad = _auto_run(front_end, range(8), nan_before=1, **settings)
    skipped = bad[2].skipped_steps if front_end == "ddp" else bad[2].reducer.life.skipped_steps
    assert skipped == 1
    assert clean[2].auto.decisions[1]["compute_s"] == 0.5
    for a, b in zip(clean[0].parameters(), bad[0].parameters()):
        assert torch.equal(a, b)
    assert _held(bad[2]) == _held(clean[2])


def test_ddp_hook_compresses_on_a_slow_link_stays_dense_on_a_fast_one_and_switches_exactly():
    """compression="auto" through the DDP hook, 2 ranks over gloo: the closed-form prices and the
    decisions of the Horovod front-end's check below, on a posed 10 Mbit/s and 10 Gbit/s link,
    recorded in the timer's events and the same on both ranks; a top-k -> PowerSGD switch keeps
    error feedback exact on the mean over ranks (tests/ddp_checks.py check_auto)."""
    from test_ddp import ddp_checks

    ddp_checks(2, "auto")


def test_ddp_join_and_a_skipped_step_leave_auto_as_explicit_zeros_and_as_without_that_step():
    """auto under ``ddp.join()`` while it probes, switches and re-probes (rank 0 joined) = the run
    where rank 0 trains on with zero gradients: decisions, Accordion's norm, parameters and state
    bit for bit (a joined rank took its norm from its stale ``.grad``: a spurious "phase" switch at
    step 10, 5 decisions against 4). A NaN on rank 1 in the re-probe, rank 0 joined: skipped on
    every rank, the run = the one without that iteration (the joined rank counted the skipped
    step as a boundary and the next window's allgather hung). A finite step rank 1 discards there:
    a step on both ranks, the run = the one without join whose hook has no optimizer (before:
    only the joined rank counted it; the next probe's gather hung, timed out after 120 s)
    (tests/ddp_checks.py check_auto_join)."""
    from test_ddp import ddp_checks

    ddp_checks(2, "auto-join", timeout=120)


def test_a_leader_topk_is_measured_across_the_ranks_so_var_topk_can_win():
    """cltk (cyclic) against VAR-Topk, 2 ranks over gloo, rank 1's gradient 10x rank 0's: each
    probe error equals the one worked out in one process from both ranks' gradients (cyclic 0.834,
    VAR-Topk 0.769) and VAR-Topk is chosen. Measured as on one rank (each rank's own top-k), both
    read 0.764 and the tie went to cyclic (tests/ddp_checks.py check_auto_var; the Horovod
    front-end's twin in tests/mpi/auto_checks.py)."""
    from test_ddp import ddp_checks

    ddp_checks(2, "auto-var", timeout=120)


def test_two_ranks_agree_decide_redecide_and_switch_exactly():
    out = mpirun_check(2, ["tests/mpi/auto_checks.py"], timeout=240)
    assert "auto checks passed" in out, out[-3000:]


def test_train_lm_records_decisions_and_the_report_plots_them(tmp_path):
    """mpi_scripts/train_lm.py --compressor auto on a posed 1 Mbit/s-like link at 2 ranks: the
    dense gradient (4.3 MB: 35 s by the model; slow enough that a loaded CI machine's compute
    cannot hide it) cannot hide behind the measured compute, so auto
    compresses; every decision is in results.json, and the report tabulates and plots them."""
    import json
    import os

    from mpirun import TINY_SHAKESPEARE

    if not os.path.isfile(TINY_SHAKESPEARE):
        pytest.skip("../shared/data not present")
    spec = "auto:candidates=none+powersgd:matrix_rank=1+topk:density=0.01,probe=2,window=2,interval=0"
    out = mpirun_check(2, ["mpi_scripts/train_lm.py", "--compressor", spec, "--cost-model", "1e-3,8e-6",
                           "--epochs", "1", "--max-steps", "7", "--no-progress", "--data", TINY_SHAKESPEARE,
                           "--output", str(tmp_path / "run")], timeout=400)
    assert "SUMMARY method=auto:" in out
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["config"]["compressor"]["name"] == "auto"
    decisions = r["auto"]["decisions"]
    assert [d["cause"] for d in decisions[:2]] == ["start", "probe"] and decisions[1]["step"] == 2
    assert decisions[1]["chosen"] != "none", decisions[1]
    none = decisions[1]["table"]["none"]
    assert none["comm_s"] == pytest.approx(2e-3 + 4 * (10000 * 100 + 4 * 4 * 100 * 100 + 4 * 4 * 100) * 8e-6)
    assert decisions[1]["measured_step_s"] is not None and decisions[1]["compute_s"] > 0
    from mpi_scripts import report

    assert report.main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "What compression='auto' decided" in text and f"`{decisions[1]['chosen']}`" in text
    assert (tmp_path / "report" / "auto_choice.png").stat().st_size > 1000
