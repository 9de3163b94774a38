"""hvdcomp.adaptive_opt on simulated ranks (threads in one process, tests/simworld.py): the 1-bit
compressed allreduce against a reference simulation written in plain tensors, error-feedback
conservation, 1-bit Adam's switch step worked by hand, 0/1 Adam's schedules against their closed
forms, 1-bit LAMB against its formulas, exact resumes, and the refusals. The warm-up (Horovod) and
the real MPI runs are in tests/test_mpi_adaptive_optimizers.py."""
from __future__ import annotations

import io
import threading

import pytest
import torch

from hvdcomp.adaptive_opt import (Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam, is_sync_step, is_variance_step, local_interval,
                                  make_optimizer, step_kinds)
from hvdcomp.adaptive_opt.base import ONEBIT_SPEC
from hvdcomp.comm.exchange import unpack_payload
from hvdcomp.comm.stepcomm import StepComm
from hvdcomp.compressors.bitpack import unpack_codes
from hvdcomp import get_compressor
from tests.onebit_reference import compressed_allreduce, scaled_sign
from tests.simworld import SimulatedRanks, step_comms

TIMEOUT_S = 120


def run_threads(n, fn):
    """``fn(rank, comm)`` on n simulated ranks in threads (comms of :func:`simworld.step_comms`);
    results in rank order. A failing rank aborts the others' barrier; a hang fails after TIMEOUT_S."""
    comms = step_comms(n)
    results, errors = [None] * n, []

    def go(r):
        try:
            results[r] = fn(r, comms[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            comms[0].barrier.abort()

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), f"a simulated rank hung for {TIMEOUT_S} s"
    if errors:
        raise errors[0]
    return results


_MODEL_LOCK = threading.Lock()  # (simulated ranks build models at once: torch's global generator)


def tiny_model(seed=0):
    with _MODEL_LOCK:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def backward(model, rank, step):
    """A per-rank, per-step batch (deterministic, so resumed runs see the same data)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- the compressed allreduce ------------------------------------------------------------------
SHAPES = {"divides": [(4, 3), (6, 2)],     # n = 24: chunks of 24/N at N = 1, 2, 3, 4
          "uneven": [(3, 5), (7,)]}        # n = 22: chunks of 22, 11/11, 7/7/8, 5/6/5/6


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_compressed_allreduce_equals_reference_simulation(ranks, layout):
    """Three steps (residuals carried): every rank's result, worker residual and server residual
    equal the plain-tensor simulation element by element."""
    shapes = SHAPES[layout]
    sim = SimulatedRanks(lambda: get_compressor(ONEBIT_SPEC), ranks)
    n = sum(torch.Size(s).numel() for s in shapes)
    worker, server = [None] * ranks, [None] * ranks
    gen = torch.Generator().manual_seed(ranks * 10 + len(layout))
    for _ in range(3):
        grads = [[(f"w{i}", torch.randn(s, generator=gen)) for i, s in enumerate(shapes)] for _ in range(ranks)]
        out = sim.reduce_batch(grads)
        flat_in = [torch.cat([g.reshape(-1) for _, g in rank_grads]) for rank_grads in grads]
        want, worker, server = compressed_allreduce(flat_in, worker, server)
        for r in range(ranks):
            got = torch.cat([t.reshape(-1) for t in out[r]])
            assert torch.equal(got, want), f"rank {r}: result differs from the reference"
            state = sim.comps[r].state_dict()
            got_worker = torch.cat([state["residual"][f"w{i}"].reshape(-1) for i in range(len(shapes))])
            assert torch.equal(got_worker, worker[r]), f"rank {r}: worker residual differs"
            if ranks > 1:
                assert torch.equal(state["server"]["cpu"], server[r]), f"rank {r}: server residual differs"
        assert want.numel() == n


class Recording:
    """A point-to-point endpoint that remembers what it sent in the all-to-all and the allgather."""

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.parts, self.gathered = None, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def alltoall(self, parts):
        self.parts = [p.clone() for p in parts]
        return self.inner.alltoall(parts)

    def allgather(self, data):
        self.gathered = data.clone()
        return self.inner.allgather(data)


def decoded(message, numel):
    """A 1-bit payload (scale, packed signs) as the message carried it, decoded in the test."""
    scale, packed = unpack_payload(message, torch.device("cpu"))
    signs = unpack_codes(packed, 1, numel).to(torch.float32) * 2 - 1
    return signs * scale.reshape(())


@pytest.mark.parametrize("ranks", [2, 4])
def test_error_feedback_conserved_exactly_on_both_sides(ranks):
    """Values on a dyadic grid (every operation exact in float32): on each worker, what it sent
    plus its new residual equals its input plus its old residual; on each server, what it sent
    plus its new residual equals the average it received plus its old residual; and over the
    step, N·result + N·Σ(server residual change) + Σ(worker residuals) = Σ(inputs + old ones)."""
    n, steps = 16, 3
    chunk = n // ranks
    grads = [[torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(100 * r + s)).float() / 4
              for r in range(ranks)] for s in range(steps)]

    def rank_fn(r, comm):
        comm.point_to_point = rec = Recording(comm.point_to_point)
        method = get_compressor(ONEBIT_SPEC)
        rows = []
        for s in range(steps):
            before = method.state_dict()
            out = method.reduce_batch([("w", grads[s][r])], comm, _timer())
            after = method.state_dict()
            rows.append((before, after, out[0], [decoded(m, chunk) for m in rec.parts], decoded(rec.gathered, chunk)))
        return rows

    per_rank = run_threads(ranks, rank_fn)
    zero = torch.zeros(n)
    for s in range(steps):
        total_in, total_out = torch.zeros(n), torch.zeros(n)
        for r in range(ranks):
            before, after, result, parts, gathered = per_rank[r][s]
            e_old, e_new = before["residual"].get("w", zero), after["residual"]["w"]
            assert torch.equal(torch.cat(parts) + e_new, grads[s][r] + e_old), f"worker {r}, step {s}"
            received = sum(per_rank[q][s][3][r] for q in range(ranks)) / ranks  # chunk r from every rank
            s_old = before["server"].get("cpu", torch.zeros(chunk))
            s_new = after["server"]["cpu"]
            assert torch.equal(gathered + s_new, received + s_old), f"server {r}, step {s}"
            total_in += grads[s][r] + e_old
            total_out += e_new
            total_out[r * chunk:(r + 1) * chunk] += ranks * (s_new - s_old)
        assert torch.equal(total_out + ranks * per_rank[0][s][2], total_in), f"step {s}: not conserved"


def _timer():
    from hvdcomp.metrics import PhaseTimer

    return PhaseTimer(cuda_sync=False)


# ---- 1-bit Adam: the switch, worked by hand ------------------------------------------------------
SWITCH_GRADIENTS = [torch.tensor([1.0, 1, -1, 2]), torch.tensor([3.0, -1, 1, 2])]


def switch_step(r, comm, **kwargs):
    """Rank r's first step after a T = 1 warm-up in the hand-worked switch-step set-up (see
    test_onebit_adam_switch_step_worked_by_hand): ``(x, opt)`` after ``opt.step()``."""
    x = torch.nn.Parameter(torch.tensor([1.0, 2, 3, 4]))
    opt = OneBitAdam([("x", x)], lr=0.375, betas=(0.5, 0.75), eps=1e-8, freeze_step=1, comm=comm, **kwargs)
    sd = opt.state_dict()
    sd["state"][0].update(step=torch.tensor(1.0), exp_avg=torch.tensor([1.0, -1, 0.5, 0]),
                          exp_avg_sq=torch.tensor([4.0, 1, 1, 0]))
    opt.load_state_dict(sd)
    x.grad = SWITCH_GRADIENTS[r].clone()
    opt.step()
    return x, opt


def test_onebit_adam_switch_step_worked_by_hand():
    """2 ranks, one parameter x = [1, 2, 3, 4] after T = 1 warm-up step with m = [1, -1, .5, 0],
    v = [4, 1, 1, 0]; β = (.5, .75), lr = .375, ε = 1e-8; gradients [1, 1, -1, 2] and [3, -1, 1, 2].

    Local momenta m_r = .5·m + .5·g: [1, 0, -.25, 1] and [2, -1, .75, 1]. Chunks [0:2], [2:4]:
    rank 0 sends [.5, .5] (scale (1+0)/2, sign(0) = +1) and [-.625, .625]; rank 1 [1.5, -1.5] and
    [.875, .875]; worker residuals [.5, -.5, .375, .375] and [.5, .5, -.125, .125]. Server 0
    averages [1, -.5], sends [.75, -.75], keeps [.25, .25]; server 1 averages [.125, .75], sends
    [.4375, .4375], keeps [-.3125, .3125]. m = [.75, -.75, .4375, .4375], masked where v = 0:
    [.75, -.75, .4375, 0]. Step t = 2: lr/(1 - .5²) = .5; denominator sqrt(v)/sqrt(1 - .75) + ε
    = [4, 2, 2, ε]; x = [1, 2, 3, 4] - .5·[.1875, -.375, .21875, 0] = [.90625, 2.1875, 2.890625, 4]."""
    def rank_fn(r, comm):
        x, opt = switch_step(r, comm)
        red = opt.state_dict()["hvdcomp"]["reducers"]["momentum"]
        return x.detach().clone(), opt.state[x]["exp_avg"].clone(), red, opt.last_step_kind, opt.step_count()

    out = run_threads(2, rank_fn)
    for r, (x, m, red, kind, t) in enumerate(out):
        assert kind == "onebit" and t == 2
        assert torch.equal(x, torch.tensor([0.90625, 2.1875, 2.890625, 4.0])), f"rank {r}: {x}"
        assert torch.equal(m, torch.tensor([0.75, -0.75, 0.4375, 0.0]))
    assert torch.equal(out[0][2]["residual"]["x"], torch.tensor([0.5, -0.5, 0.375, 0.375]))
    assert torch.equal(out[1][2]["residual"]["x"], torch.tensor([0.5, 0.5, -0.125, 0.125]))
    assert torch.equal(out[0][2]["server"]["cpu"], torch.tensor([0.25, 0.25]))
    assert torch.equal(out[1][2]["server"]["cpu"], torch.tensor([-0.3125, 0.3125]))


def test_onebit_adam_exact_ablation_is_frozen_variance_adam():
    """The switch step of test_onebit_adam_switch_step_worked_by_hand with
    ``momentum_averaging="exact"``: m = the plain mean of the local momenta [1, 0, -.25, 1] and
    [2, -1, .75, 1], [1.5, -.5, .25, 1], masked where v = 0: [1.5, -.5, .25, 0]; x = [1, 2, 3, 4]
    - .5·[1.5/4, -.5/2, .25/2, 0] = [.8125, 2.125, 2.9375, 4]. One float32 allreduce (a "full"
    step), no compressed-allreduce residuals."""
    def rank_fn(r, comm):
        x, opt = switch_step(r, comm, momentum_averaging="exact")
        return (x.detach().clone(), opt.state[x]["exp_avg"].clone(), opt.last_step_kind,
                opt.state_dict()["hvdcomp"]["reducers"], opt.compression.name, opt.transport.collective)

    for r, (x, m, kind, reducers, method, collective) in enumerate(run_threads(2, rank_fn)):
        assert kind == "full" and method == "none" and collective == "allreduce"
        assert torch.equal(x, torch.tensor([0.8125, 2.125, 2.9375, 4.0])), f"rank {r}: {x}"
        assert torch.equal(m, torch.tensor([1.5, -0.5, 0.25, 0.0]))
        assert all(not red.get("residual") for red in reducers.values()), reducers
    with pytest.raises(ValueError, match="momentum_averaging must be one of"):
        OneBitAdam([("x", torch.nn.Parameter(torch.zeros(2)))], freeze_step=1, momentum_averaging="fp16",
                   comm=step_comms(1)[0])


# ---- 0/1 Adam's schedules ----------------------------------------------------------------------------
def variance_closed_form(kappa, last):
    """k_j = 1 + κ(2^b - 1) + r·2^b for j = bκ + r (the sum of the intervals 2^⌊i/κ⌋, i < j)."""
    steps, j = set(), 0
    while True:
        b, r = divmod(j, kappa)
        k = 1 + kappa * (2 ** b - 1) + r * 2 ** b
        if k > last:
            return steps
        steps.add(k)
        j += 1


def sync_closed_form(first, alpha, clip_exp, last):
    """k_j = F + 1 + α(2^b - 1) + r·2^b for j = bα + r while 2^b < H = 2^clip_exp, then every H steps."""
    steps, j = set(), 0
    while True:
        b, r = divmod(j, alpha)
        if b < clip_exp:
            k = first + alpha * (2 ** b - 1) + r * 2 ** b
        else:
            k = first + alpha * (2 ** clip_exp - 1) + (j - clip_exp * alpha) * 2 ** clip_exp
        if k > last:
            return steps
        steps.add(k)
        j += 1


@pytest.mark.parametrize("kappa, freeze", [(16, 400), (4, 300), (1, 200)])
def test_zeroone_variance_schedule_matches_closed_form(kappa, freeze):
    want = variance_closed_form(kappa, freeze)
    assert {t for t in range(1, 450) if is_variance_step(t, freeze, kappa)} == want
    if kappa == 16:  # the first κ intervals are 1 (steps 1..17), the next κ are 2, then 4, ...
        assert sorted(want)[:20] == list(range(1, 18)) + [19, 21, 23]
        assert sorted(want)[32:35] == [49, 53, 57]


@pytest.mark.parametrize("alpha, clip_exp", [(5, 3), (1, 4), (32678, 4)])
def test_zeroone_sync_schedule_matches_closed_form(alpha, clip_exp):
    freeze = 40
    want = sync_closed_form(freeze + 1, alpha, clip_exp, 400)
    assert {t for t in range(1, 401) if is_sync_step(t, freeze, alpha, 2 ** clip_exp)} == want
    assert min(want) == freeze + 1
    full = len(variance_closed_form(16, freeze))
    assert step_kinds(400, freeze, 16, alpha, 2 ** clip_exp) == {"full": full, "onebit": freeze - full,
                                                                 "sync": len(want), "local": 400 - freeze - len(want)}


def test_zeroone_adam_runs_its_schedule_for_300_steps():
    """2 simulated ranks, 300 steps (κ = 4, F = 150, α = 5, H = 8), observed, not labelled: the
    variance changes exactly at the closed-form variance steps, which are the steps with a
    full-precision allreduce; point-to-point bytes move exactly at the other steps up to F and at
    the closed-form synchronisations; the ranks' parameters are identical after every step up to F
    and every synchronisation, and differ after local steps."""
    kappa, freeze, alpha, clip = 4, 150, 5, 8
    steps = 300
    var_steps = variance_closed_form(kappa, freeze)
    sync_steps = sync_closed_form(freeze + 1, alpha, 3, steps)

    def rank_fn(r, comm):
        calls = []  # allreduces of the whole model (not the one-off agreement on the step and parameters)
        counting = StepComm(lambda t, name: (name != "agree.start" and calls.append(name)) or comm.allreduce_mean(t, name),
                            comm.rank,
                            comm.size, comm.broadcast, comm.point_to_point)
        model = tiny_model()
        opt = ZeroOneAdam(model.named_parameters(), lr=1e-2, var_freeze_step=freeze, var_update_scaler=kappa,
                          local_step_scaler=alpha, local_step_clipper=clip, comm=counting)
        rows = []
        for t in range(1, steps + 1):
            backward(model, r, t)
            v0 = [opt.state[p]["exp_avg_sq"].clone() for p in opt.order]
            n_calls, sent = len(calls), comm.network.sent[r]
            opt.step()
            changed = any(not torch.equal(a, opt.state[p]["exp_avg_sq"]) for a, p in zip(v0, opt.order))
            rows.append((changed, len(calls) - n_calls, comm.network.sent[r] - sent,
                         torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]), opt.last_step_kind))
        return rows

    a, b = run_threads(2, rank_fn)
    for t in range(1, steps + 1):
        (changed, calls, sent, params, kind), other = a[t - 1], b[t - 1]
        assert changed == (t in var_steps), f"step {t}: variance changed {changed}"
        assert (calls == 1) == (t in var_steps) and calls <= 1, f"step {t}: {calls} allreduce(s)"
        one_bit = (t <= freeze and t not in var_steps) or t in sync_steps
        assert (sent > 0) == one_bit, f"step {t}: {sent} point-to-point bytes"
        if t <= freeze or t in sync_steps:
            assert torch.equal(params, other[3]), f"step {t}: ranks differ after a communicating step"
        else:
            assert not torch.equal(params, other[3]), f"step {t}: a local step left the ranks identical"
        assert kind == ("full" if t in var_steps else "onebit" if t <= freeze else "sync" if t in sync_steps
                        else "local")


def test_zeroone_adam_first_steps_are_adam():
    """With bias correction, 0/1 Adam's first steps (all variance steps: the gradient averaged in
    fp32) are torch.optim.Adam's on the averaged gradient. Without it (DeepSpeed's), the first step
    moves every coordinate by lr·(1 − β1)/sqrt(1 − β2) = 3.16·lr instead of Adam's lr."""
    lr, steps = 1e-2, 5

    def rank_fn(r, comm):
        out = {}
        for bias_correction in (True, False):
            model = tiny_model()
            x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            opt = ZeroOneAdam(model.named_parameters(), lr=lr, var_freeze_step=100, bias_correction=bias_correction,
                              comm=comm)
            for t in range(1, (steps if bias_correction else 1) + 1):
                backward(model, r, t)
                opt.step()
                assert opt.last_step_kind == "full"
            out[bias_correction] = (x0, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        return out

    got = run_threads(2, rank_fn)[0]
    ref, probe = tiny_model(), tiny_model()
    adam = torch.optim.Adam(ref.parameters(), lr=lr)
    for t in range(1, steps + 1):
        grads = []
        for r in range(2):
            probe.load_state_dict(ref.state_dict())
            backward(probe, r, t)
            grads.append([p.grad.clone() for p in probe.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = (g0 + g1) * 0.5
        adam.step()
    torch.testing.assert_close(got[True][1], torch.cat([p.detach().reshape(-1) for p in ref.parameters()]),
                               rtol=1e-5, atol=1e-6)
    x0, x1 = got[False]
    torch.testing.assert_close((x1 - x0).abs(), torch.full_like(x0, lr * 0.1 / 0.001 ** 0.5), rtol=1e-4, atol=1e-6)


def deepspeed_schedule(steps, freeze, kappa, alpha, clip):
    """The variance and synchronisation steps of DeepSpeed's ZeroOneAdam (written from
    deepspeed/runtime/fp16/onebit/zoadam.py), by stepping its counters call by call: call c = 1
    only sets up buffers, so hvdcomp's step t is call t + 1; a variance step is a call whose
    counter is a multiple of ``var_interval`` (doubled after every κ of them), the variance
    freezes after the call whose counter exceeds F, and from then on a call whose counter is a
    multiple of ``local_step_interval`` synchronises, the interval doubling (up to H) after every
    α calls."""
    variance, sync = set(), set()
    frozen, var_interval, var_counter, interval, counter = False, 1, 0, 1, 0
    for c in range(2, steps + 2):
        if not frozen:
            if c % var_interval == 0:
                variance.add(c - 1)
                var_counter += 1
                if var_counter == kappa:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            if c % interval == 0:
                sync.add(c - 1)
            counter += 1
            if counter == alpha:
                counter, interval = 0, min(clip, interval * 2)
        frozen = frozen or c > freeze
    return variance, sync


@pytest.mark.parametrize("freeze, kappa, alpha, clip, steps", [(40, 4, 5, 8, 300), (12, 2, 2, 4, 200),
                                                               (30, 3, 7, 12, 400), (1000, 16, 1000, 16, 10000)])
def test_zeroone_deepspeed_schedule_matches_deepspeeds_counters(freeze, kappa, alpha, clip, steps):
    """schedule="deepspeed" against DeepSpeed's counters stepped call by call (issue 57, item 16)."""
    variance, sync = deepspeed_schedule(steps, freeze, kappa, alpha, clip)
    assert {t for t in range(1, steps + 1) if is_variance_step(t, freeze, kappa, "deepspeed")} == variance
    assert {t for t in range(1, steps + 1) if is_sync_step(t, freeze, alpha, clip, "deepspeed")} == sync
    kinds = step_kinds(steps, freeze, kappa, alpha, clip, schedule="deepspeed")
    assert kinds == {"full": len(variance), "onebit": freeze - len(variance), "sync": len(sync),
                     "local": steps - freeze - len(sync)}
    if (freeze, alpha, clip) == (1000, 1000, 16):
        # DeepSpeed doubles the local interval every α steps, the paper every α synchronisations:
        # 2188 against 3250 synchronisations in 10^4 steps; at steps 3000, 5000, 9000 the interval
        # is 2/8/16 against 2/4/8 (4 from step 3001: 1000 steps at interval 1, then 1000 at 2, ...)
        assert len(sync) == 1000 + 500 + 250 + 125 + 313 == 2188
        assert step_kinds(steps, freeze, kappa, alpha, clip)["sync"] == 1000 * 3 + 2000 // 8 == 3250
        assert [local_interval(t, freeze, alpha, clip, "deepspeed") for t in (3000, 3001, 5000, 9000)] == [2, 4, 8, 16]
        assert [local_interval(t, freeze, alpha, clip) for t in (3000, 5000, 9000)] == [2, 4, 8]
    with pytest.raises(ValueError, match="schedule must be one of"):
        is_sync_step(freeze + 1, freeze, schedule="deepspeeds")


def test_zeroone_adam_runs_deepspeeds_schedule():
    """ZeroOneAdam(schedule="deepspeed") on 2 simulated ranks takes the kinds of step DeepSpeed's
    counters give (κ = 2, F = 12, α = 3, H = 4) for 60 steps."""
    variance, sync = deepspeed_schedule(60, 12, 2, 3, 4)

    def rank_fn(r, comm):
        model = tiny_model()
        opt = ZeroOneAdam(model.named_parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=2,
                          local_step_scaler=3, local_step_clipper=4, schedule="deepspeed", comm=comm)
        kinds = []
        for t in range(1, 61):
            backward(model, r, t)
            opt.step()
            kinds.append(opt.last_step_kind)
        return kinds

    want = ["full" if t in variance else "onebit" if t <= 12 else "sync" if t in sync else "local" for t in range(1, 61)]
    assert run_threads(2, rank_fn) == [want, want]
    with pytest.raises(ValueError, match="schedule must be one of"):
        ZeroOneAdam(tiny_model().named_parameters(), schedule="ds", comm=step_comms(1)[0])


def test_zeroone_adam_dropped_gradient_counts_in_every_ranks_step_sizes():
    """Issue 57, item 7. 2 simulated ranks, one parameter, F = 8 (κ = α = 2, H = 4: synchronisations
    at 9, 10, 11, 13, 15, ...). Rank 1's gradient at the local step 12 is NaN: it drops that step,
    its synchronisation at 13 sends NaN, so every rank skips 13; the one at 15 averages the
    updates of steps 12-15. Reference, from the state both ranks hold after the synchronisation
    at 11: each rank's local Adam steps (rank 1 without step 12), u_r = (x_r − x_sync)·D through
    the plain-tensor compressed allreduce (each rank's residuals as after 11), x = x_sync + c̄/D and
    m = −c̄/(η_12 + η_13 + η_14 + η_15) on every rank. Before the fix rank 1 left η_12 out of its
    sum: its momentum was 1.3x rank 0's until the next synchronisation."""
    lr, (b1, b2), eps, n = 1e-2, (0.9, 0.999), 1e-8, 10
    grads = {(r, t): torch.randn(n, generator=torch.Generator().manual_seed(100 * r + t)) for r in range(2)
             for t in range(1, 16)}
    grads[(1, 12)] = torch.full((n,), float("nan"))

    def rank_fn(r, comm):
        x = torch.nn.Parameter(torch.linspace(-1, 1, n))
        opt = ZeroOneAdam([("x", x)], lr=lr, betas=(b1, b2), eps=eps, var_freeze_step=8, var_update_scaler=2,
                          local_step_scaler=2, local_step_clipper=4, comm=comm)
        kinds, at11 = [], None
        for t in range(1, 16):
            x.grad = grads[(r, t)].clone()
            opt.step()
            kinds.append(opt.last_step_kind)
            if t == 11:
                sd = saved(opt.state_dict())
                at11 = (x.detach().clone(), sd["state"][0], sd["hvdcomp"]["reducers"]["sync"])
        return kinds, at11, x.detach().clone(), opt.state[x]["exp_avg"].clone(), opt.skipped_steps

    out = run_threads(2, rank_fn)
    assert out[0][0][8:] == ["sync", "sync", "sync", "local", "local", "local", "sync"], out[0][0]  # (13: skipped)
    x11, st11 = out[0][1][0], out[0][1][1]
    assert torch.equal(x11, out[1][1][0]) and torch.equal(st11["exp_avg"], out[1][1][1]["exp_avg"])
    k = len(variance_closed_form(2, 8))  # variance updates by F
    denom = st11["exp_avg_sq"].sqrt() / (1 - b2 ** k) ** 0.5 + eps
    eta = {t: lr / (1 - b1 ** t) for t in range(12, 16)}
    xs, ms = [x11.clone(), x11.clone()], [st11["exp_avg"].clone(), st11["exp_avg"].clone()]
    for t in (12, 13, 14, 15):
        for r in range(2):
            if (r, t) != (1, 12):  # rank 1 drops its non-finite gradient
                ms[r] = b1 * ms[r] + (1 - b1) * grads[(r, t)]
                xs[r] = xs[r] - eta[t] * ms[r] / denom
    red = [out[r][1][2] for r in range(2)]
    worker = [red[r]["residual"].get("x") for r in range(2)]
    server = [red[r]["server"].get("cpu") for r in range(2)]
    avg, _, _ = compressed_allreduce([(xs[r] - x11) * denom for r in range(2)], worker, server)
    want_x = x11 + avg / denom
    want_m = -avg / sum(eta.values())
    for r in range(2):
        _, _, x, m, skipped = out[r]
        assert skipped == 1
        torch.testing.assert_close(x, want_x, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, want_m, rtol=1e-6, atol=1e-8)
    assert torch.equal(out[0][3], out[1][3])  # the same momentum on every rank


def test_frozen_parameters_are_refused_naming_the_fix():
    """Issue 57, item 8: a parameter with requires_grad=False (dropped silently before: unfrozen
    later it never trained; all frozen, step() raised IndexError) is refused at construction."""
    for make in (lambda m, c: OneBitAdam(m.named_parameters(), freeze_step=2, comm=c),
                 lambda m, c: OneBitLamb(m.named_parameters(), freeze_step=2, comm=c),
                 lambda m, c: ZeroOneAdam(m.named_parameters(), comm=c)):
        model = tiny_model()
        model[0].weight.requires_grad_(False)
        with pytest.raises(ValueError, match=r"\['0.weight'\] have requires_grad=False.*if p.requires_grad"):
            make(model, step_comms(1)[0])
        model.requires_grad_(False)
        with pytest.raises(ValueError, match="requires_grad=False"):
            make(model, step_comms(1)[0])
        model.requires_grad_(True)
        make(model, step_comms(1)[0])  # all trainable: built


@pytest.mark.parametrize("name", ["onebit-adam", "zeroone-adam", "onebit-lamb"])
def test_ranks_that_start_from_different_parameters_raise_on_every_rank(name):
    """Issue 57, item 8: rank 1 starts from other parameters (no broadcast): both ranks raise at the
    first step (before any warm-up collective), naming rank 1 and the fix. After loading a
    checkpoint nothing is compared (0/1 Adam's ranks may differ between synchronisations)."""
    def rank_fn(r, comm):
        model = tiny_model(seed=r)
        opt = make_optimizer(name, model.named_parameters(), lr=1e-2, freeze_step=3, comm=comm)
        backward(model, r, 1)
        with pytest.raises(RuntimeError, match=r"different parameters \(rank\(s\) \[1\] differ from rank 0\)"
                                               r".*broadcast_parameters"):
            opt.step()
        if name != "zeroone-adam":  # (their warm-up needs Horovod: tests/mpi/adaptive_optimizer_checks.py)
            return None
        model = tiny_model(seed=r)
        opt = make_optimizer(name, model.named_parameters(), lr=1e-2, freeze_step=3, comm=comm)
        opt.load_state_dict(saved(opt.state_dict()))
        backward(model, r, 1)
        opt.step()
        return opt.step_count()

    assert run_threads(2, rank_fn) == ([1, 1] if name == "zeroone-adam" else [None, None])


# ---- 1-bit LAMB --------------------------------------------------------------------------------------
def test_lamb_warmup_step_matches_its_formulas():
    """Two LAMB steps on one tensor against the formulas written here (no bias correction)."""
    torch.manual_seed(3)
    x = torch.nn.Parameter(torch.randn(5))
    opt = Lamb([x], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01,
               coeff_beta=0.5, freeze_step=2)
    ref, m, v, avg = x.detach().clone(), torch.zeros(5), torch.zeros(5), 0.0
    for s in range(2):
        g = torch.randn(5)
        x.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        u = m / (v.sqrt() + 1e-6) + 0.01 * ref
        ratio = min(max(float(ref.norm() / u.norm()), 0.01), 10.0)
        avg = 0.5 * avg + 0.5 * ratio
        ref = ref - 0.1 * ratio * u
    torch.testing.assert_close(x.detach(), ref, rtol=1e-6, atol=1e-7)
    assert opt.state[x]["lamb_coeff_freeze"] == pytest.approx(avg, rel=1e-6)
    assert torch.equal(opt.state[x]["exp_avg_sq_fresh"], opt.state[x]["exp_avg_sq"])  # copied at freeze_step


def test_onebit_lamb_compressed_step_matches_its_formulas():
    """2 ranks, two tensors, the first compressed step after a warm-up state: momentum scales,
    the reference compressed allreduce, the reconstructed gradient, the factor and its clamps,
    computed here from the paper's formulas."""
    torch.manual_seed(4)
    x0 = [torch.randn(3, 2), torch.randn(4)]
    m0 = [torch.randn(3, 2) * 0.1, torch.randn(4) * 0.01]
    v0 = [torch.rand(3, 2) * 0.01, torch.rand(4) * 0.001]
    grads = [[torch.randn(3, 2), torch.randn(4)] for _ in range(2)]
    lr, b1, b2, eps, wd, coeff = 0.05, 0.9, 0.999, 1e-8, 0.01, 0.7

    def rank_fn(r, comm):
        params = [torch.nn.Parameter(x.clone()) for x in x0]
        opt = OneBitLamb([("a", params[0]), ("b", params[1])], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                         freeze_step=5, comm=comm)
        sd = opt.state_dict()
        for i in range(2):
            sd["state"][i].update(step=torch.tensor(5.0), exp_avg=m0[i].clone(), exp_avg_sq=v0[i].clone(),
                                  exp_avg_sq_fresh=v0[i].clone(), lamb_coeff_freeze=coeff)
        opt.load_state_dict(sd)
        for p, g in zip(params, grads[r]):
            p.grad = g.clone()
        opt.step()
        return [p.detach().clone() for p in params], [opt.state[p]["last_factor"] for p in params]

    out = run_threads(2, rank_fn)
    rms = [float(m.norm()) / m.numel() ** 0.5 for m in m0]
    scale = [sum(rms) / 2 / q for q in rms]
    local = [torch.cat([((b1 * m0[i] + (1 - b1) * grads[r][i]) * scale[i]).reshape(-1) for i in range(2)])
             for r in range(2)]
    avg, _, _ = compressed_allreduce(local, [None, None], [None, None])
    want, factors = [], []
    for i, (start, stop) in enumerate(((0, 6), (6, 10))):
        m = avg[start:stop].view(x0[i].shape) / scale[i]
        implied = (m - b1 * m0[i]) / (1 - b1)
        fresh = b2 * v0[i] + (1 - b2) * implied * implied
        denom = v0[i].sqrt() + eps
        prelim = m / denom
        update = prelim + wd * x0[i]
        factor = float((denom / (fresh.sqrt() + eps)).max())
        rho = min(1.0, float(prelim.norm() / update.norm()))
        factor = min(max(factor * rho + 1 - rho, 0.5), 4.0)
        factor = min(max(factor, 0.9), 1.1)  # within 10 % of the previous factor (1)
        factors.append(factor)
        want.append(x0[i] - lr * coeff * factor * update)
    for r in range(2):
        for got, w in zip(out[r][0], want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-7)
        assert out[r][1] == pytest.approx(factors, rel=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(out[r][0], out[0][0]))  # identical on every rank


# ---- resume --------------------------------------------------------------------------------------------
def _zeroone(model, comm):
    return ZeroOneAdam(model.named_parameters(), lr=1e-2, var_freeze_step=8, var_update_scaler=2,
                       local_step_scaler=2, local_step_clipper=4, comm=comm)


def _onebit_adam(model, comm):
    return OneBitAdam(model.named_parameters(), lr=1e-2, freeze_step=3, comm=comm)


def _onebit_lamb(model, comm):
    return OneBitLamb(model.named_parameters(), lr=1e-2, freeze_step=3, comm=comm)


def _warm_state(opt, model):
    """A state as after a 3-step warm-up (the warm-up itself needs Horovod: the MPI test)."""
    sd = opt.state_dict()
    gen = torch.Generator().manual_seed(7)
    for i, p in enumerate(model.parameters()):
        sd["state"][i].update(step=torch.tensor(3.0), exp_avg=torch.randn(p.shape, generator=gen) * 0.1,
                              exp_avg_sq=torch.rand(p.shape, generator=gen) * 0.01)
        if "exp_avg_sq_fresh" in sd["state"][i]:
            sd["state"][i].update(exp_avg_sq_fresh=sd["state"][i]["exp_avg_sq"].clone(), lamb_coeff_freeze=0.5)
    opt.load_state_dict(sd)


@pytest.mark.parametrize("make, start, cut", [(_zeroone, 0, 5), (_zeroone, 0, 8), (_zeroone, 0, 11),
                                              (_onebit_adam, 3, 5), (_onebit_lamb, 3, 5)],
                         ids=["zeroone-before-F", "zeroone-at-F", "zeroone-mid-local", "onebit-adam", "onebit-lamb"])
def test_resume_continues_exactly(make, start, cut):
    """Per-rank checkpoints at step ``cut``, loaded into fresh optimizers on fresh models: the
    next steps equal the uninterrupted run's, bit for bit, on every rank."""
    end = 16

    def rank_fn(r, comm):
        model = tiny_model()
        opt = make(model, comm)
        assert opt.compression.name == "twophase"  # (reading it keeps the checkpoint loadable)
        if start:
            _warm_state(opt, model)
        ckpt = None
        for t in range(start + 1, end + 1):
            backward(model, r, t)
            opt.step()
            if t == cut:
                ckpt = saved({"model": model.state_dict(), "opt": opt.state_dict()})
        straight = [p.detach().clone() for p in model.parameters()]
        model2 = tiny_model(seed=99)
        opt2 = make(model2, comm)
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        for t in range(cut + 1, end + 1):
            backward(model2, r, t)
            opt2.step()
        return straight, [p.detach().clone() for p in model2.parameters()], opt2.step_count()

    for r, (straight, resumed, t) in enumerate(run_threads(2, rank_fn)):
        assert t == end
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed)), f"rank {r}: the resumed run differs"


# ---- refusals -----------------------------------------------------------------------------------------
def test_refusals_name_the_fix():
    comm = step_comms(1)[0]
    model = tiny_model()
    with pytest.raises(ValueError, match="backward_passes_per_step=1"):
        OneBitAdam(model.named_parameters(), freeze_step=2, backward_passes_per_step=2, comm=comm)
    with pytest.raises(ValueError, match="freeze_step must be an integer >= 1"):
        OneBitAdam(model.named_parameters(), freeze_step=0, comm=comm)
    with pytest.raises(ValueError, match="named_parameters"):
        ZeroOneAdam(model.parameters(), comm=comm)
    with pytest.raises(ValueError, match="float32"):
        ZeroOneAdam(tiny_model().half().named_parameters(), comm=comm)
    with pytest.raises(ValueError, match="shape"):
        OneBitAdam(model.named_parameters(), freeze_step=2, momentum_masks={"0.bias": torch.ones(2)}, comm=comm)
    with pytest.raises(ValueError, match="not a parameter"):
        OneBitAdam(model.named_parameters(), freeze_step=2, momentum_masks={"nope": torch.ones(2)}, comm=comm)
    with pytest.raises(ValueError, match="local_step_clipper"):
        ZeroOneAdam(model.named_parameters(), local_step_clipper=0, comm=comm)
    with pytest.raises(ValueError, match="needs a freeze step"):
        make_optimizer("onebit-adam", model.named_parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="no freeze step"):
        make_optimizer("compressed-amsgrad", model.named_parameters(), lr=1e-3, freeze_step=5)
    opt = ZeroOneAdam(model.named_parameters(), comm=comm)
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = ZeroOneAdam(emb.named_parameters(), comm=step_comms(1)[0])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    with pytest.raises(ValueError, match="fixes its parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


def test_ranks_at_different_steps_raise_on_every_rank():
    """Rank 1 loads a checkpoint of another step (a wrong resume): both ranks raise at the first step."""
    def rank_fn(r, comm):
        model = tiny_model()
        opt = _zeroone(model, comm)
        if r == 1:
            sd = opt.state_dict()
            for s in sd["state"].values():
                s["step"] = torch.tensor(4.0)
            opt.load_state_dict(sd)
        backward(model, r, 1)
        with pytest.raises(RuntimeError, match="different optimizer steps"):
            opt.step()
        return True

    assert run_threads(2, rank_fn) == [True, True]


def test_nonfinite_gradient_skips_on_every_rank():
    """A NaN on one rank at a 1-bit step: every rank skips (parameters, moments and residuals
    unchanged) and counts it; the next step goes ahead."""
    def rank_fn(r, comm):
        model = tiny_model()
        opt = _zeroone(model, comm)
        for t in range(1, 4):  # variance steps 1, 2, 3 (κ = 2), then step 4 is 1-bit
            backward(model, r, t)
            opt.step()
        backward(model, r, 4)
        if r == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = saved(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
        opt.step()
        skipped = opt.last_step_kind is None and opt.skipped_steps == 1 and opt.step_count() == 3
        same = all(torch.equal(a, p) for a, p in zip(before[1], model.parameters()))
        after = saved(opt.state_dict())
        same_state = torch.equal(after["state"][0]["exp_avg"], before[0]["state"][0]["exp_avg"])
        red = after["hvdcomp"]["reducers"]["gradient"]  # its first step was rolled back: still empty
        residuals = not red["residual"] and not red["server"]
        backward(model, r, 4)
        opt.step()
        return skipped, same, same_state, residuals, opt.last_step_kind

    for row in run_threads(2, rank_fn):
        assert row == (True, True, True, True, "onebit")


def test_scaled_sign_reference_is_the_scaled_sign():
    """The reference's compressor: mean |x| times the signs, sign(0) = +1."""
    assert torch.equal(scaled_sign(torch.tensor([1.0, -3.0, 0.0, 2.0])), torch.tensor([1.5, -1.5, 1.5, 1.5]))


def test_twophase_server_residual_is_dropped_in_another_world():
    """twophase's server residual is this rank's chunk of a partition by the size, so after a world
    change (elastic Horovod) it belongs to no chunk and is dropped at the first step there, while
    the worker residual (per element) carries over. Two simulated ranks take a step; they swap
    numbers at the same size (a rank's old chunk 1 is the same length as chunk 0: kept, it would be
    added to the wrong chunk) and take another, which equals the reference simulation
    (tests/onebit_reference.py) with the worker residuals carried and no server residual, and not
    the one that keeps them; then one rank, after a checkpoint round trip (``server_chunk`` saved),
    takes a step alone: no server side at size 1, the old residual gone."""
    from hvdcomp.transports.twophase import TwoPhaseCompressor

    def step(methods, inputs):
        def rank_fn(r, comm):
            methods[r].bind_group(len(methods))
            return methods[r].reduce_batch([("x", inputs[r].clone())], comm, _timer())[0]
        return run_threads(len(methods), rank_fn)

    first = [torch.tensor([1.0, -2, 3, 0.5, 4, -1]), torch.tensor([-3.0, 1, 2, 2, -0.5, 1])]
    then = [torch.tensor([0.5, 1, -1, 2, 1, 3]), torch.tensor([2.0, -1, 0.25, -2, 1, 1])]
    methods = [TwoPhaseCompressor(), TwoPhaseCompressor()]
    out = step(methods, first)
    want, worker, server = compressed_allreduce(first, [None, None], [None, None])
    assert all(torch.equal(o, want) for o in out) and all(s.abs().sum() > 0 for s in server)
    swapped = methods[::-1]  # old rank 1 is rank 0 now
    out = step(swapped, then)
    want, _, _ = compressed_allreduce(then, worker[::-1], [None, None])
    kept, _, _ = compressed_allreduce(then, worker[::-1], server[::-1])
    assert not torch.equal(want, kept)
    assert all(torch.equal(o, want) for o in out), (out, want, kept)
    alone = TwoPhaseCompressor()
    alone.load_state_dict(swapped[0].state_dict())
    assert alone.state_dict()["server"] and alone.state_dict()["server_chunk"] == [0, 2]
    out = step([alone], [then[0]])
    assert alone.state_dict()["server"] == {} and alone.state_dict()["server_chunk"] == [0, 1]
