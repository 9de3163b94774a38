"""Multi-rank checks of local-update training (hvdcomp.local), run by tests/test_local_update.py.

Usage: mpirun -np N python tests/mpi/local_checks.py CHECK [CHECK ...] [--grid GRID.json --out DIR]
Each check raises (non-zero exit) on failure and prints "OK <check>" on rank 0. ``traces`` writes
each rank's per-step parameters for every configuration of GRID.json to DIR/traces.<rank>.pt;
the test compares them with its own single-process simulation of the ranks.
"""
from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE for CO2's reduction thread)

import argparse
import io
import json
import os
import time

import pytest
import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.local import CO2, AdaAlter, CO2Momentum, DiLoCo, LocalAdaAlter, SparseLoCo, from_spec


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def inner_step(model, opt, step, nan=None):
    """One step on this rank's batch; ``nan`` = [rank, step]: that rank's gradient gets a NaN in
    one element of the weight's gradient at that step."""
    x, y = batch(hvd.rank(), step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if nan is not None and list(nan) == [hvd.rank(), step]:
        model.weight.grad[0, 0] = float("nan")
    opt.step()


def inner_optimizer(kind, params, lr):
    """As tests/test_local_update.py's."""
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


def same_on_all_ranks(t, name):
    return torch.equal(hvd.broadcast(t, 0, name=name), t)


def build(config, model):
    """The wrapper of one grid configuration (see tests/test_local_update.py's GRID)."""
    c = dict(config)
    algorithm, inner_lr, kind = c.pop("algorithm"), c.pop("inner_lr"), c.pop("inner", None)
    c.pop("steps")
    c.pop("nan", None)
    c.pop("reference", None)
    co2_outer = c.pop("co2_outer", None)
    kwargs = {"cost_model": "off", **c}
    if co2_outer:  # CO2's outer update on DiLoCo's (undelayed) rounds
        kwargs["outer_optimizer"] = lambda t: CO2Momentum(t, *co2_outer)
    if algorithm == "adaalter":
        inner = AdaAlter(model.parameters(), lr=inner_lr, eps=kwargs.pop("eps"))
        return LocalAdaAlter(inner, model.named_parameters(), **kwargs)
    inner = inner_optimizer(kind, model.parameters(), inner_lr)
    return from_spec(algorithm, inner, model.named_parameters(), **kwargs)


# ---- golden traces --------------------------------------------------------------------------------
def check_traces(grid_path, out_dir):
    """Per-step local parameters of every configuration, written for the test to compare."""
    with open(grid_path) as f:
        grid = json.load(f)
    traces = []
    for config in grid:
        model = tiny_model()
        opt = build(config, model)
        steps = []
        for step in range(config["steps"]):
            inner_step(model, opt, step, config.get("nan"))
            steps.append(flat(model))
            if config["algorithm"] == "co2" and "nan" in config:  # no pending update from a dropped round:
                state = opt.state_dict()  # (joins the reduction in flight: the trajectory is the same)
                pending = list(state["pending"]["delta"].values()) + list(opt.pseudo_gradients.values())
                assert all(bool(t.isfinite().all()) for t in pending), (step, state["pending"])
        opt.flush()
        traces.append({"steps": torch.stack(steps), "final": flat(model), "rounds": opt.rounds,
                       "skipped": opt.skipped_rounds})
        assert same_on_all_ranks(flat(model), f"traces.final.{len(traces)}")
        opt.close()
    torch.save(traces, os.path.join(out_dir, f"traces.{hvd.rank()}.pt"))


# ---- equivalence with synchronous training ---------------------------------------------------------
def check_equivalence():
    """H = 1, SGD inner, no compression, outer SGD lr 1 without momentum == synchronous hvdcomp
    'none' (within float32 rounding: Δ = θ − (θ − ηg) is ηg up to an ulp of θ)."""
    models = [tiny_model(), tiny_model()]
    local = DiLoCo(torch.optim.SGD(models[0].parameters(), lr=0.1), models[0].named_parameters(), local_steps=1,
                   outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    sync = hvdcomp.DistributedOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1),
                                        named_parameters=models[1].named_parameters(), compression="none")
    for step in range(6):
        for model, opt in zip(models, (local, sync)):
            inner_step(model, opt, step)
        a, b = flat(models[0]), flat(models[1])
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (step, (a - b).abs().max())
    assert local.rounds == 6 and not torch.equal(flat(models[0]), flat(tiny_model()))
    assert same_on_all_ranks(flat(models[0]), "equivalence")
    local.close()


# ---- CO2 --------------------------------------------------------------------------------------------
class ConstantGradient(torch.nn.Module):
    """θ ∈ R²; the 'loss' θ·c has the gradient c, chosen per rank and round (hand-worked case)."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(2))

    def loss(self, c):
        return (self.theta * c).sum()


def check_co2_hand_worked():
    """2 ranks, H = 2, inner SGD lr 0.25, gradients c(rank, round) = (1 + round)·C[rank],
    C[0] = (1, 4), C[1] = (3, −8): round r's Δ = 2·0.25·c = 0.5·c, its average over the ranks
    Δ̄_r = 0.5·(1 + r)·(2, −2) = (1 + r)·(1, −1). With α = 1, β = 0.5, λ = 2, φ = 0.75:

    * end of round 0: nothing to apply: θ_1 = θ_0 = (0, 0);
    * end of round 1: m = 0.5·0 + Δ̄_0/2 = (0.5, −0.5) (within φ); θ_2 = θ_1 − m = (−0.5, 0.5);
    * end of round 2: m = 0.5·(0.5, −0.5) + Δ̄_1/2 = (1.25, −1.25) → clipped (0.75, −0.75);
      θ_3 = (−1.25, 1.25);
    * flush: m = 0.5·(0.75, −0.75) + Δ̄_2/2 = (1.875, −1.875) → (0.75, −0.75); θ = (−2, 2).

    The update applied at the end of round r + 1 is round r's average (the round-r gradients grow
    with r, so a same-round or two-round delay gives other numbers), and the clip bites twice."""
    C = [torch.tensor([1.0, 4.0]), torch.tensor([3.0, -8.0])][hvd.rank()]
    model = ConstantGradient()
    opt = CO2(torch.optim.SGD(model.parameters(), lr=0.25), model.named_parameters(), local_steps=2,
              outer_lr=1.0, outer_momentum=0.5, gap_penalty=2.0, clip=0.75)
    expected_after_round = {1: [0.0, 0.0], 2: [-0.5, 0.5], 3: [-1.25, 1.25]}
    for step in range(6):
        rnd = step // 2
        opt.zero_grad()
        model.loss((1 + rnd) * C).backward()
        opt.step()
        if step % 2 == 1:  # a round ended: the model restarted from θ_{r+1}
            assert model.theta.tolist() == expected_after_round[rnd + 1], (rnd, model.theta.tolist())
        else:  # mid-round: one local step from θ_r
            start = expected_after_round.get(rnd, [0.0, 0.0])
            assert model.theta.tolist() == (torch.tensor(start) - 0.25 * (1 + rnd) * C).tolist()
    opt.flush()
    assert model.theta.tolist() == [-2.0, 2.0], model.theta.tolist()
    momentum = opt.outer.state[opt.outer.param_groups[0]["params"][0]]["momentum_buffer"]
    assert momentum.tolist() == [0.75, -0.75]  # clipped: 1.875 without the clip
    assert [r["round"] for r in opt.history] == [1, 2, 3]
    opt.close()


def check_co2_no_training_on_inflight_tensors():
    """While a reduction is in flight (slowed down to span the next round's inner steps), the live
    parameters share no memory with anything the reduction touches, and the result is bitwise the
    one without the slow-down: the reduction never writes the parameters being trained on."""
    results = []
    for slow in (False, True):
        model = tiny_model()
        opt = CO2(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), local_steps=3,
                  compression="topk:density=0.5", outer_lr=0.7, outer_momentum=0.5, clip=0.5, cost_model="off")
        if slow:
            reduce_of_sync = opt.sync.reduce

            def slow_step(*a, **k):
                time.sleep(0.4)
                return reduce_of_sync(*a, **k)

            opt.sync.reduce = slow_step
        alive = []
        for step in range(9):
            inner_step(model, opt, step)
            if slow:
                time.sleep(0.25)  # a round of inner steps (0.75 s) outlasts the reduction (0.4 s)
            if opt.reduction_running is not None:
                alive.append(opt.reduction_running)
                touched = {t.untyped_storage().data_ptr() for t in [*opt.pseudo_gradients.values(),
                                                                    *opt.anchors.values()]}
                touched |= {e.untyped_storage().data_ptr() for e in opt.compression.memory.committed.values()}
                live = {p.untyped_storage().data_ptr() for p in model.parameters()}
                assert not touched & live
        if slow:
            assert sum(alive) >= 2, alive  # the reduction really overlapped inner steps
            # rounds 1 and 2's reductions (>= the 0.4 s slow-down) each ran behind a whole round
            # of inner steps (0.75 s): mostly hidden, little of it waited for at the join
            for rec in opt.history[:2]:
                assert rec["wall_s"] >= 0.4 and rec["hidden_s"] > 0.3 and rec["exposed_s"] < rec["hidden_s"], rec
        opt.flush()
        results.append(flat(model))
        opt.close()
    assert torch.equal(results[0], results[1]), (results[0] - results[1]).abs().max()


# ---- bad input ----------------------------------------------------------------------------------------
def check_co2_two_instances():
    """Two CO2 optimizers (each on its own model) stepped in turn, H = 1: each round's reduction
    runs on its thread while the other's starts, over Horovod's allgather (``allgather="horovod"``,
    the path of horovodrun --gloo). Each ends equal, bit for bit, to the same optimizer trained
    alone in this job (before: the two reductions' per-round agreement ran under one Horovod name,
    and round 2 failed with "a tensor with the same name as another tensor that is currently being
    processed")."""
    def build(seed):
        model = tiny_model(seed)
        return model, CO2(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), local_steps=1,
                          compression="topk:density=0.5", allgather="horovod", cost_model="off")

    alone = []
    for seed in (0, 1):
        model, opt = build(seed)
        for step in range(4):
            inner_step(model, opt, 10 * seed + step)
        opt.flush()
        opt.close()
        alone.append(flat(model))
    runs = [build(seed) for seed in (0, 1)]
    for step in range(4):
        for seed, (model, opt) in enumerate(runs):
            inner_step(model, opt, 10 * seed + step)
    for (model, opt), ref in zip(runs, alone):
        opt.flush()
        opt.close()
        assert torch.equal(flat(model), ref), (flat(model) - ref).abs().max()


def check_bad_input():
    """Each refused at construction, with a message naming the fix, on every rank (no hang)."""
    model = tiny_model()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    names = lambda: model.named_parameters()  # noqa: E731
    cases = [
        (lambda: DiLoCo(sgd(), names(), local_steps=0), "local_steps .* integer >= 1"),
        (lambda: CO2(sgd(), names(), local_steps=2.5), "local_steps .* integer >= 1"),
        (lambda: DiLoCo(sgd(), names(), local_steps=4, outer_lr=0.0), "outer learning rate must be > 0"),
        (lambda: DiLoCo(sgd(), names(), local_steps=4, outer_lr=-1.0), "outer learning rate must be > 0"),
        (lambda: CO2(sgd(), names(), local_steps=4, outer_lr=0.0), "outer learning rate must be > 0"),
        (lambda: DiLoCo(sgd(), names(), local_steps=4,
                        outer_optimizer=lambda t: torch.optim.SGD(t, lr=0.0)), "outer learning rate must be > 0"),
        (lambda: DiLoCo(sgd(), names(), local_steps=4, compression="signsgd"), "majority vote"),
        (lambda: CO2(sgd(), names(), local_steps=4, compression="signsgd:vote=allgather"), "majority vote"),
        (lambda: DiLoCo(sgd(), names(), local_steps=4, compression="dgc:density=0.1"), "momentum would be applied twice"),
        (lambda: SparseLoCo(sgd(), names(), local_steps=4, compression="fp16"), "keeps none"),
        (lambda: SparseLoCo(sgd(), names(), local_steps=4, beta=1.5), r"beta .* must be in \[0, 1\]"),
        (lambda: SparseLoCo(sgd(), names(), local_steps=4, chunk_size=0), "chunk_size must be an integer >= 1"),
        (lambda: DiLoCo(sgd(), names(), local_steps=4, backward_passes_per_step=2), "backward_passes_per_step"),
        (lambda: CO2(sgd(), names(), local_steps=4, gap_penalty=0.5), "gap penalty"),
        (lambda: from_spec("lookahead", sgd(), names(), local_steps=4), "unknown local-update algorithm"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match="wraps hvdcomp.local.AdaAlter"):
        LocalAdaAlter(sgd(), names())
    # ranks that start from different parameters (no broadcast): refused at the first step, on every rank
    other = tiny_model(seed=hvd.rank())
    opt = DiLoCo(torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(), local_steps=2)
    with pytest.raises(RuntimeError, match=r"different parameters .* hvd.broadcast_parameters"):
        inner_step(other, opt, 0)
    opt.close()
    # nothing was left half-built: a good one still works and agrees across ranks
    opt = DiLoCo(sgd(), names(), local_steps=2)
    for step in range(2):
        inner_step(model, opt, step)
    assert opt.rounds == 1 and same_on_all_ranks(flat(model), "bad_input.after")
    opt.close()


# ---- ranks that disagree ---------------------------------------------------------------------------------
def check_disagreement():
    """Ranks that build different set-ups are refused at construction, on every rank, with a
    ValueError naming the setting and the values (before: H = 2 on rank 0 and 3 on rank 1
    averaged rounds of different lengths and then hung or ended in HorovodInternalError;
    different outer learning rates moved θ_start apart with no error). Then a set-up every rank
    shares still trains to one global model."""
    model = tiny_model()
    r = hvd.rank()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    names = lambda: model.named_parameters()  # noqa: E731
    cases = [
        (lambda: DiLoCo(sgd(), names(), local_steps=2 + r), r"rank 1 local_steps 3 != rank 0 2"),
        (lambda: DiLoCo(sgd(), names(), local_steps=2, outer_lr=(0.7, 0.5)[r]),
         r"rank 1 outer\.param_groups\.0\.lr 0\.5 != rank 0 0\.7"),
        (lambda: DiLoCo(sgd(), names(), local_steps=2, outer_optimizer=lambda t: (torch.optim.SGD, torch.optim.Adam)[r](
            t, lr=0.7)), r"rank 1 outer\.class Adam != rank 0 SGD"),
        (lambda: CO2(sgd(), names(), local_steps=2, gap_penalty=1.0 + r), r"gap_penalty 2\.0 != rank 0 1\.0"),
        (lambda: CO2(sgd(), names(), local_steps=2, clip=None if r == 0 else 0.5), r"clip 0\.5 != rank 0 None"),
        (lambda: SparseLoCo(sgd(), names(), local_steps=2, beta=(0.9, 0.95)[r]), r"rank 1 beta 0\.95 != rank 0 0\.9"),
        (lambda: SparseLoCo(sgd(), names(), local_steps=2, chunk_size=4 + r), r"rank 1 chunk_size 5 != rank 0 4"),
        (lambda: LocalAdaAlter(AdaAlter(model.parameters(), lr=0.1), names(), warmup_steps=r),
         r"rank 1 warmup_steps 1 != rank 0 0"),
        (lambda: LocalAdaAlter(AdaAlter(model.parameters(), lr=0.1, eps=1.0 + r), names()),
         r"rank 1 inner\.param_groups\.0\.eps 2\.0 != rank 0 1\.0"),
        (lambda: (DiLoCo, CO2)[r](sgd(), names(), local_steps=2), r"rank 1 wrapper CO2 != rank 0 DiLoCo"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match="ranks disagree on the local-update set-up.*" + message):
            make()
    opt = DiLoCo(sgd(), names(), local_steps=2)
    for step in range(4):
        inner_step(model, opt, step)
    assert opt.rounds == 2 and same_on_all_ranks(flat(model), "disagreement.after")
    opt.close()


# ---- checkpoints ----------------------------------------------------------------------------------------
def _diloco(model):
    return DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.01), model.named_parameters(), local_steps=3,
                  compression="topk:density=0.5", cost_model="off")  # (Nesterov momentum 0.9, lr 0.7)


def _co2(model):
    return CO2(torch.optim.AdamW(model.parameters(), lr=0.01), model.named_parameters(), local_steps=3,
               compression="topk:density=0.5", outer_lr=0.7, outer_momentum=0.5, clip=0.2, cost_model="off")


def _sparseloco(model):
    return SparseLoCo(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(),
                      local_steps=3, compression="topk:density=0.5", beta=0.9, chunk_size=4, cost_model="off")


def _adaalter(model):
    return LocalAdaAlter(AdaAlter(model.parameters(), lr=0.05, eps=1.0), model.named_parameters(), local_steps=3,
                         warmup_steps=1)


def _save(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def check_resume_mid_round():
    """Every rank saves its own checkpoint at step 4 (mid-round 2, round 1's average still to
    apply for CO2); a fresh run that loads it (weights_only) and goes on ends bitwise where the
    uninterrupted run ends."""
    for make in (_diloco, _co2, _sparseloco, _adaalter):
        model = tiny_model()
        opt = make(model)
        for step in range(4):
            inner_step(model, opt, step)
        saved = _save(model, opt)
        for step in range(4, 10):
            inner_step(model, opt, step)
        opt.flush()
        uninterrupted = flat(model)
        opt.close()
        ckpt = torch.load(io.BytesIO(saved), weights_only=True)
        model = tiny_model(seed=1)  # (other weights: the checkpoint must bring them)
        opt = make(model)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        for step in range(4, 10):
            inner_step(model, opt, step)
        opt.flush()
        assert torch.equal(flat(model), uninterrupted), (make.__name__, (flat(model) - uninterrupted).abs().max())
        opt.close()


def check_resume_broadcast():
    """Horovod's recipe: rank 0 loads the mid-round checkpoint (step 7: round 3 begun, round 2's
    average still to apply, the outer momentum already set by round 1's), then
    broadcast_parameters + broadcast_state: every rank holds exactly what rank 0's checkpoint
    holds (θ_start, counters, the average to apply, the outer momentum, the inner AdamW moments,
    the model), and training goes on to one global model."""
    model = tiny_model()
    opt = _co2(model)
    for step in range(7):
        inner_step(model, opt, step)
    saved = _save(model, opt)
    opt.close()
    model = tiny_model(seed=2)
    opt = _co2(model)
    if hvd.rank() == 0:
        ckpt = torch.load(io.BytesIO(saved), weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.broadcast_state(root_rank=0)
    assert (opt.steps, opt.round_step, opt.rounds, opt.pending) == (7, 1, 2, True)
    full = torch.load(io.BytesIO(hvd.broadcast_object(saved, 0, name="bcast.ckpt")), weights_only=True)
    assert torch.equal(flat(model), torch.cat([v.reshape(-1) for v in full["model"].values()]))
    ckpt = full["opt"]
    for n, a in opt.anchors.items():
        assert torch.equal(a.detach(), ckpt["anchor"][n]), n
        assert torch.equal(opt.pseudo_gradients[n], ckpt["pending"]["delta"][n]), n
    outer, inner = ckpt["outer"]["state"], ckpt["inner"]["state"]
    assert len(outer) == len(inner) == 2
    for i, (a, p) in enumerate(zip(opt.outer.param_groups[0]["params"], model.parameters())):
        assert torch.equal(opt.outer.state[a]["momentum_buffer"], outer[i]["momentum_buffer"]), i
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.inner.state[p][k], inner[i][k]), (i, k)
    for step in range(7, 12):
        inner_step(model, opt, step)
    opt.flush()
    assert same_on_all_ranks(flat(model), "bcast.final")
    opt.close()


# ---- AMP ---------------------------------------------------------------------------------------------------
def check_grad_scaler():
    """A GradScaler drives the wrapper as it drives any optimizer: a step it skips (an Inf
    gradient) is not an inner step, so rounds still take H applied steps. PyTorch's AMP clipping
    recipe (unscale_, clip, step) clips the inner step: the first step moves θ by exactly
    −lr·g·c/‖g‖ (g the unscaled gradient, c the clip norm, ‖g‖ > c)."""
    model = tiny_model()
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), local_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    clip = 0.1
    for step in range(5):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1:
            model.bias.grad.fill_(float("inf"))
        before = flat(model)
        if step == 0:  # the reference, from the model's own gradient of the unscaled loss
            ref = tiny_model()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
            assert g.norm() > clip
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        if step == 0:
            assert torch.allclose(flat(model) - before, -0.05 * g * (clip / g.norm()), rtol=1e-5, atol=1e-7)
    assert (opt.steps, opt.rounds, opt.round_step) == (4, 2, 0), (opt.steps, opt.rounds)
    assert same_on_all_ranks(flat(model), "amp")
    opt.close()


def check_half_precision():
    """bfloat16 parameters: θ_start and Δ are kept in float32 (the outer step does not round to
    bfloat16 every round), the model gets θ_start rounded to bfloat16; DiLoCo and CO2 alike."""
    for cls in (DiLoCo, CO2):
        model = tiny_model().to(torch.bfloat16)
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), local_steps=2,
                  outer_lr=0.7, outer_momentum=0.5, **({"nesterov": False} if cls is DiLoCo else {}))
        for step in range(6):
            x, y = batch(hvd.rank(), step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
        opt.flush()
        for n, p in model.named_parameters():
            a = opt.anchors[n]
            assert a.dtype == torch.float32 and opt.pseudo_gradients[n].dtype == torch.float32
            assert torch.equal(p.detach(), a.detach().to(torch.bfloat16))
        assert opt.rounds == 3 and same_on_all_ranks(flat(model).float(), f"half.{cls.__name__}")
        opt.close()


def check_adaalter_bytes():
    """Local AdaAlter's traffic, by hand for Linear(3, 2) (8 float32 values, 32 bytes): 2
    synchronous warm-up steps allreduce the gradients (2 × 32 bytes), then 2 rounds of H = 3 each
    average Δ ('none': 32 bytes) and the accumulators (32 bytes). Per step: (64 + 2·64) / 8 = 24
    bytes against 32 for synchronous fp32 training."""
    model = tiny_model()
    opt = LocalAdaAlter(AdaAlter(model.parameters(), lr=0.05, eps=1.0), model.named_parameters(), local_steps=3,
                        warmup_steps=2, cost_model="off")
    for step in range(8):
        inner_step(model, opt, step)
    r = opt.report()
    assert (r["rounds"], r["inner_steps"]) == (2, 8), r
    assert (r["warmup_bytes_sent"], r["bytes_sent_per_round"], r["accumulator_bytes_per_round"]) == (64, 64, 32), r
    assert r["bytes_sent_per_step"] == r["bytes_received_per_step"] == 24 and r["dense_bytes_per_round"] == 32, r
    # dense: what synchronous fp32 training sends, the warm-up's 2 × 32 and Δ's 32 per round
    assert (r["warmup_dense_bytes"], r["dense_bytes_per_step"]) == (64, (64 + 2 * 32) / 8), r
    assert r["ratio_vs_dense_per_step"] == 32 / 24, r
    opt.close()


CHECKS = {f.__name__[len("check_"):]: f for f in [
    check_half_precision, check_adaalter_bytes,
    check_equivalence, check_co2_hand_worked, check_co2_no_training_on_inflight_tensors, check_co2_two_instances,
    check_bad_input,
    check_disagreement,
    check_resume_mid_round, check_resume_broadcast, check_grad_scaler]}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checks", nargs="+")
    parser.add_argument("--grid")
    parser.add_argument("--out")
    args = parser.parse_args()
    hvd.init()
    for name in args.checks:
        if name == "traces":
            check_traces(args.grid, args.out)
        else:
            CHECKS[name]()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
