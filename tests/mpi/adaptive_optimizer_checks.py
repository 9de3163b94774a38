"""Multi-rank checks of hvdcomp.adaptive_opt over Horovod and MPI, run by
tests/test_mpi_adaptive_optimizers.py.

Usage: mpirun -np N python tests/mpi/adaptive_optimizer_checks.py CHECK [CHECK ...]
Each check raises (non-zero exit) on failure and prints "OK <check>" on rank 0.
"""
import io
import re
import sys

import pytest
import torch
import horovod.torch as hvd

import hvdcomp
from hvdcomp.adaptive_opt import CompressedAMSGrad, OneBitAdam, OneBitLamb, ZeroOneAdam, is_variance_step
from hvdcomp.adaptive_opt.base import ONEBIT_SPEC
from hvdcomp.metrics import PhaseTimer
from tests.onebit_reference import OneBitLambReference, compressed_allreduce


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def backward(model, step, poison=False):
    """This rank's batch of ``step`` through ``model``; ``poison``: the loss times NaN."""
    x, y = batch(hvd.rank(), step)
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss * float("nan") if poison else loss).backward()


def rank_gradients(model, params, rank, step):
    """Rank ``rank``'s gradients of ``step`` (its batch of :func:`backward`) at ``params`` (by
    name, in ``model``'s order), computed here for any rank."""
    x, y = batch(rank, step)
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, leaves, (x,)), y)
    return list(torch.autograd.grad(loss, list(leaves.values())))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_every_rank(t, what):
    every = hvd.allgather(t.reshape(1, -1), name=f"same.{what}")
    assert all(torch.equal(row, every[0]) for row in every), f"{what}: ranks differ"


def gathered(t, name):
    """Every rank's copy of the 1-D ``t``, in rank order."""
    return list(hvd.allgather(t.reshape(1, -1), name=name))


def saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def check_warmup_equals_adam_then_switch():
    """For λ = 0 and λ = 0.1: the first freeze_step = 3 steps equal torch.optim.Adam / AdamW over
    hvdcomp.DistributedOptimizer(compression="none") bit for bit (parameters and moments); step 4
    equals the reference built from that Adam state, every rank's local momentum (allgathered)
    and the plain-tensor compressed allreduce; every rank holds the same parameters."""
    for wd, cls in ((0.0, torch.optim.Adam), (0.1, torch.optim.AdamW)):
        a, b = small_model(), small_model()
        lr, (b1, b2), eps = 0.01, (0.9, 0.99), 1e-8
        opt = OneBitAdam(a.named_parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, freeze_step=3)
        ref = hvdcomp.DistributedOptimizer(cls(b.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd),
                                           named_parameters=b.named_parameters(), compression="none")
        for step in range(1, 4):
            backward(a, step)
            backward(b, step)
            opt.step()
            ref.step()
            assert torch.equal(flat(a), flat(b)), f"step {step} (weight decay {wd}): differs from {cls.__name__}"
            assert opt.last_step_kind == "warmup"
        for pa, pb in zip(a.parameters(), b.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[pa][key], ref.state[pb][key]), key
        backward(a, 4)
        x0 = flat(a).clone()
        m0 = torch.cat([ref.state[p]["exp_avg"].reshape(-1) for p in b.parameters()])
        v0 = torch.cat([ref.state[p]["exp_avg_sq"].reshape(-1) for p in b.parameters()])
        g = torch.cat([p.grad.reshape(-1) for p in a.parameters()])
        opt.step()
        assert opt.last_step_kind == "onebit" and opt.step_count() == 4
        local = m0.mul(b1).add_(g, alpha=1 - b1)
        m, _, _ = compressed_allreduce(gathered(local, f"local.{wd}"), [None] * hvd.size(), [None] * hvd.size())
        m = m * (v0 != 0)
        want = x0 * (1 - lr * wd) - lr / (1 - b1 ** 4) * m / (v0.sqrt() / (1 - b2 ** 3) ** 0.5 + eps)
        torch.testing.assert_close(flat(a), want, rtol=1e-6, atol=1e-8)
        same_on_every_rank(flat(a), f"switch.{wd}")
        opt.close()
        ref.close()


def run(opt, model, start, stop):
    for step in range(start, stop):
        backward(model, step)
        opt.step()


def check_resume_before_at_after_freeze():
    """Per-rank checkpoints after steps 2, 3 and 4 (freeze_step = 3), loaded on every rank into
    fresh optimizers on fresh models: steps to 7 equal the uninterrupted run bit for bit."""
    model = small_model()
    opt = OneBitAdam(model.named_parameters(), lr=0.01, freeze_step=3)
    ckpts = {}
    for step in range(1, 8):
        run(opt, model, step, step + 1)
        if step in (2, 3, 4):
            ckpts[step] = saved({"model": model.state_dict(), "opt": opt.state_dict()})
    straight = flat(model)
    opt.close()
    for cut in (2, 3, 4):
        ckpt = saved(ckpts[cut])  # (a copy: the loaded optimizer updates its tensors in place, as torch's)
        m2 = small_model(seed=5)
        o2 = OneBitAdam(m2.named_parameters(), lr=0.01, freeze_step=3)
        m2.load_state_dict(ckpt["model"])
        o2.load_state_dict(ckpt["opt"])
        run(o2, m2, cut + 1, 8)
        assert torch.equal(flat(m2), straight), f"resumed after step {cut}: differs"
        assert o2.step_count() == 7
        o2.close()
    # a checkpoint past the warm-up loaded (on every rank) into a running warm-up: the step that
    # follows finishes what the hooks started, uses the averaged gradient, and closes the warm-up
    m3 = small_model()
    o3 = OneBitAdam(m3.named_parameters(), lr=0.01, freeze_step=3)
    run(o3, m3, 1, 3)
    ckpt = saved(ckpts[4])
    m3.load_state_dict(ckpt["model"])
    o3.load_state_dict(ckpt["opt"])
    run(o3, m3, 5, 7)
    got = (o3.step_count(), o3.last_step_kind, o3.warmup.running)
    assert got == (6, "onebit", False), got
    same_on_every_rank(flat(m3), "abandoned")
    o3.close()


def check_rank0_recipe():
    """Horovod's recipe (rank 0 loads, then broadcast_parameters + broadcast_optimizer_state) from
    checkpoints before and after freeze_step: no hang, every rank at the same step with the same
    parameters after every following step."""
    model = small_model()
    opt = OneBitAdam(model.named_parameters(), lr=0.01, freeze_step=3)
    ckpts = {}
    for step in range(1, 6):
        run(opt, model, step, step + 1)
        ckpts[step] = saved({"model": model.state_dict(), "opt": opt.state_dict()})
    opt.close()
    for cut in (2, 5):
        m2 = small_model(seed=7 + hvd.rank())  # fresh ranks hold other weights until the broadcast
        o2 = OneBitAdam(m2.named_parameters(), lr=0.01, freeze_step=3)
        if hvd.rank() == 0:
            m2.load_state_dict(ckpts[cut]["model"])
            o2.load_state_dict(ckpts[cut]["opt"])
        hvd.broadcast_parameters(m2.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(o2, root_rank=0)
        for step in range(cut + 1, cut + 4):
            run(o2, m2, step, step + 1)
            same_on_every_rank(flat(m2), f"rank0.{cut}.{step}")
            assert o2.step_count() == step
        o2.close()


def check_refusals():
    """On every rank: backward_passes_per_step, sparse gradients, a set-up that differs between ranks."""
    model = small_model()
    with pytest.raises(ValueError, match="backward_passes_per_step=1"):
        OneBitAdam(model.named_parameters(), freeze_step=2, backward_passes_per_step=2)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = OneBitAdam(emb.named_parameters(), freeze_step=2)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    opt.close()
    with pytest.raises(ValueError, match="ranks disagree"):
        OneBitAdam(model.named_parameters(), freeze_step=2 + hvd.rank())


def check_zeroone_bytes():
    """0/1 Adam through Horovod and MPI, bytes per step from its timer: 4n at variance steps, a
    1-bit payload (between n/8 and n/4) at the other steps up to F and at synchronisations, 0 at
    local steps; parameters identical on every rank after each synchronisation."""
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 80)
    n = sum(p.numel() for p in model.parameters())
    timer = PhaseTimer(cuda_sync=False)
    opt = ZeroOneAdam(model.named_parameters(), lr=1e-3, var_freeze_step=12, var_update_scaler=2,
                      local_step_scaler=2, local_step_clipper=4, timer=timer)
    for step in range(1, 31):
        timer.begin_step()
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        model.zero_grad()
        model(torch.randn(4, 100, generator=g)).pow(2).mean().backward()
        opt.step()
        sent = timer.end_step()["bytes_sent"]
        if step == 1:  # the one-off agreement on the step and the parameters' digest: one allreduce of
            sent -= 8 * 34 * hvd.size()  # a (ranks, 2 + 32) float64 matrix
        kind = opt.last_step_kind
        if step <= 12:
            assert kind == ("full" if is_variance_step(step, 12, 2) else "onebit"), (step, kind)
        else:
            assert kind in ("local", "sync"), (step, kind)
        if kind == "full":
            assert sent == 4 * n, (step, sent)
        elif kind == "local":
            assert sent == 0, (step, sent)
        else:
            assert n / 8 < sent < n / 4, (step, kind, sent)
        if kind in ("full", "onebit", "sync"):
            same_on_every_rank(flat(model), f"zeroone.{step}")
    assert opt.last_step_kind in ("local", "sync")


def check_compressed_amsgrad():
    """AMSGrad on the two-way compressed gradient: two steps equal AdamW(amsgrad) applied to the
    reference compressed allreduce of the gradients; identical on every rank."""
    a, b = small_model(), small_model()
    opt = CompressedAMSGrad(a.named_parameters(), lr=0.01, weight_decay=0.01)
    ref = torch.optim.AdamW(b.parameters(), lr=0.01, weight_decay=0.01, amsgrad=True)
    worker, server = [None] * hvd.size(), [None] * hvd.size()
    backward_order = lambda m: list(m.parameters())[::-1]  # noqa: E731 (DistributedOptimizer's order: last first)
    for step in (1, 2):
        backward(a, step)
        g = torch.cat([p.grad.reshape(-1) for p in backward_order(a)])
        opt.step()
        avg, worker, server = compressed_allreduce(gathered(g, f"amsgrad.{step}"), worker, server)
        start = 0
        for p in backward_order(b):
            p.grad = avg[start:start + p.numel()].view(p.shape).clone()
            start += p.numel()
        ref.step()
        torch.testing.assert_close(flat(a), flat(b), rtol=1e-6, atol=1e-8)
        same_on_every_rank(flat(a), f"amsgrad.{step}")
    with pytest.raises(ValueError, match="twophase"):
        CompressedAMSGrad(a.named_parameters(), compression="topk:density=0.1")
    opt.close()


def check_compressed_allreduce_over_mpi():
    """The compressed allreduce over Horovod and MPI (the optimizer's own collectives) equals the
    plain-tensor simulation element by element, for 22 elements (uneven chunks) over 3 steps;
    then 1-bit Adam's compressed steps leave every rank with the same parameters."""
    model = small_model()
    opt = OneBitAdam(model.named_parameters(), lr=0.01, freeze_step=2)
    method = hvdcomp.get_compressor(ONEBIT_SPEC)
    worker, server = [None] * hvd.size(), [None] * hvd.size()
    for step in range(3):
        g = torch.Generator().manual_seed(10 * hvd.rank() + step)
        grads = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g))]
        out = method.reduce_batch(grads, opt.comm, PhaseTimer(cuda_sync=False))
        mine = torch.cat([t.reshape(-1) for _, t in grads])
        want, worker, server = compressed_allreduce(gathered(mine, f"ca.{step}"), worker, server)
        assert torch.equal(torch.cat([t.reshape(-1) for t in out]), want), f"step {step}"
        assert torch.equal(torch.cat([method.state_dict()["residual"][k].reshape(-1) for k in "ab"]),
                           worker[hvd.rank()])
        assert torch.equal(method.state_dict()["server"]["cpu"], server[hvd.rank()])
    for step in range(1, 6):
        run(opt, model, step, step + 1)
        same_on_every_rank(flat(model), f"onebit.{step}")
    assert opt.last_step_kind == "onebit"
    opt.close()


class ScaledSGD(torch.optim.SGD):
    """SGD whose step multiplies each gradient by ``scale``, an attribute outside the groups."""

    def __init__(self, params, lr=1e-3, scale=1.0):
        super().__init__(params, lr=lr)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.scale)
        return super().step(closure)


def check_rebuilt_optimizer_keeps_its_arguments():
    """Issue 57, item 6: hvdcomp.DistributedOptimizer over a user optimizer whose constructor sets
    an attribute outside the groups (scale = 3) and an lr other than the class default: the
    rebuilt optimizer keeps both (stock's recipe gave scale 1 and lr 1e-3), and its step is
    x − lr·scale·ḡ with ḡ the mean of every rank's gradient (computed here); add_param_group
    is refused naming the fix; Horovod's own rebuild (op=Adasum) keeps them too."""
    model = small_model()
    opt = hvdcomp.DistributedOptimizer(ScaledSGD(model.parameters(), lr=0.5, scale=3.0),
                                       named_parameters=model.named_parameters())
    assert (opt.scale, opt.defaults["lr"], type(opt).__name__) == (3.0, 0.5, "ScaledSGD"), (opt.scale, opt.defaults)
    x0 = flat(model).clone()
    params = dict(model.named_parameters())
    grads = [torch.cat([g.reshape(-1) for g in rank_gradients(model, params, r, 1)]) for r in range(hvd.size())]
    backward(model, 1)
    opt.step()
    torch.testing.assert_close(flat(model), x0 - 0.5 * 3.0 * sum(grads) / hvd.size(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="Add every group to the optimizer before wrapping it"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    opt.close()
    other = small_model()
    ada = hvdcomp.DistributedOptimizer(ScaledSGD(other.parameters(), lr=0.5, scale=3.0),
                                       named_parameters=other.named_parameters(), op=hvd.Adasum)
    assert (ada.scale, ada.defaults["lr"]) == (3.0, 0.5), (ada.scale, ada.defaults)


def check_onebit_lamb_against_deepspeed_formulas():
    """Issue 57, item 6, through the real construction path (the warm-up's Lamb rebuilt by
    hvdcomp.DistributedOptimizer): 1-bit LAMB with freeze_step=20, coeff_beta=0.5 and λ = 0.01
    over 20 warm-up and 5 compressed steps equals OneBitLambReference (DeepSpeed's formulas,
    every rank's gradients computed here at the reference's parameters) after every step:
    parameters, the frozen trust-ratio averages, the fresh variance at the freeze, each
    compressed step's factors. Before the fix the warm-up ran with freeze_step=1 and
    coeff_beta=0.9 and the factors climbed 1.1, 1.21, ..."""
    model = small_model()
    freeze, kw = 20, dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01,
                          coeff_beta=0.5)
    opt = OneBitLamb(model.named_parameters(), freeze_step=freeze, **kw)
    ref = OneBitLambReference(list(model.parameters()), hvd.size(), freeze_step=freeze, **kw)
    names = [n for n, _ in model.named_parameters()]
    factors = []
    for step in range(1, freeze + 6):
        grads = [rank_gradients(model, dict(zip(names, ref.x)), r, step) for r in range(hvd.size())]
        backward(model, step)
        opt.step()
        ref.step(grads)
        assert opt.last_step_kind == ("warmup" if step <= freeze else "onebit"), (step, opt.last_step_kind)
        torch.testing.assert_close(flat(model), torch.cat([x.reshape(-1) for x in ref.x]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step}: {m}")
        states = [opt.state[p] for p in model.parameters()]
        if step == freeze:
            assert [s["lamb_coeff_freeze"] for s in states] == pytest.approx(ref.coeff, rel=1e-5), ref.coeff
            for s, v in zip(states, ref.v_fresh):
                torch.testing.assert_close(s["exp_avg_sq_fresh"], v, rtol=1e-5, atol=1e-12)
        if step > freeze:
            got = [s["last_factor"] for s in states]
            assert got == pytest.approx(ref.last_factor, rel=1e-5), (step, got, ref.last_factor)
            factors.append(got[0])
    same_on_every_rank(flat(model), "lamb")
    if hvd.rank() == 0:
        print(f"1-bit LAMB factors of the first tensor after the warm-up: {[round(f, 4) for f in factors]}", flush=True)
    opt.close()


def check_nonfinite_warmup_names_the_right_rank():
    """Issue 57, item 8: a NaN on the last rank only during 1-bit Adam's warm-up, nonfinite="raise".
    With the warm-up's 'none' the gradients are averaged in place: the error says the rank is not
    known and names none (before: every rank, [0, 1]); with 'fp16' (each rank's own gradient is
    checked before it is compressed) it names the last rank only. No rank updates."""
    last = hvd.size() - 1
    for method in ("none", "fp16"):
        model = small_model()
        opt = OneBitAdam(model.named_parameters(), lr=0.01, freeze_step=3, nonfinite="raise", warmup_compression=method)
        before = flat(model).clone()
        backward(model, 1, poison=hvd.rank() == last)
        with pytest.raises(FloatingPointError) as err:
            opt.step()
        message = str(err.value)
        if method == "none":
            assert "not known" in message and "rank(s) [" not in message, message
        else:
            assert f"rank(s) [{last}]" in message and "rank(s) [0, " not in message, message
        assert torch.equal(flat(model), before)
        opt.zero_grad()
        opt.close()


def check_ranks_that_disagree_on_parameters():
    """Issue 57, item 8, over Horovod: ranks that start from different parameters raise at the first
    step on every rank, naming the other ranks, for the three optimizers (and train after
    hvd.broadcast_parameters); a frozen parameter is refused at construction on every rank (the
    same one everywhere: the fix named; on one rank only: the ranks disagree)."""
    others = list(range(1, hvd.size()))
    for cls, kw in ((OneBitAdam, dict(freeze_step=2)), (ZeroOneAdam, dict(var_freeze_step=2)),
                    (OneBitLamb, dict(freeze_step=2))):
        model = small_model(seed=hvd.rank())
        opt = cls(model.named_parameters(), lr=0.01, **kw)
        backward(model, 1)
        with pytest.raises(RuntimeError, match=re.escape(f"different parameters (rank(s) {others} differ from rank 0)")):
            opt.step()
        opt.close()
        model = small_model(seed=hvd.rank())
        opt = cls(model.named_parameters(), lr=0.01, **kw)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        run(opt, model, 1, 4)
        same_on_every_rank(flat(model), f"broadcast.{cls.__name__}")
        opt.close()
    model = small_model()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"\['0.weight'\] have requires_grad=False"):
        OneBitAdam(model.named_parameters(), freeze_step=2)
    model[0].weight.requires_grad_(hvd.rank() != 0)
    with pytest.raises(ValueError, match="ranks disagree.*frozen"):
        OneBitAdam(model.named_parameters(), freeze_step=2)


CHECKS = {f.__name__[len("check_"):]: f for f in [
    check_warmup_equals_adam_then_switch, check_resume_before_at_after_freeze, check_rank0_recipe,
    check_refusals, check_zeroone_bytes, check_compressed_amsgrad, check_compressed_allreduce_over_mpi,
    check_rebuilt_optimizer_keeps_its_arguments, check_onebit_lamb_against_deepspeed_formulas,
    check_nonfinite_warmup_names_the_right_rank, check_ranks_that_disagree_on_parameters]}

if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
