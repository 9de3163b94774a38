"""2-rank checks of ``compression="auto"``, run by tests/test_auto.py.

Usage: mpirun -np 2 python tests/mpi/auto_checks.py
Each check raises (non-zero exit) on failure; rank 0 prints "auto checks passed" at the end.
"""
import copy

import horovod.torch as hvd
import torch

import hvdcomp
from hvdcomp.auto import Auto, memories
from hvdcomp.comm.costmodel import CostModel


class Clock:
    """A clock the loop advances: ``compute`` seconds per step, the link's seconds in synchronize."""

    now = 0.0

    def __call__(self):
        return self.now


def model_64(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 64)  # a 64 x 64 weight and its bias: n = 4160 float32


def batch(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)


def check_decide_agree_and_redecide():
    """On 2 ranks, compute 1 s per step (a fake clock), a given fast link (α 1 µs, β 1e-10 s/B):
    none costs 2α + 16 640 B·β = 3.66 µs: predicted 1.0000037 s within 1.1 s, error 0: ``none``.
    The link then slows 500x (the exposed time from 1 ms to 0.5 s): measured again (α 1 ms,
    β 1e-4 s/B), none costs 2 ms + 1.664 s (predicted 2.666 s); PowerSGD rank 1 sends P (64 floats)
    with the bias (64) and Q (64): 4α + 768 B·β = 0.0808 s, predicted 1.0808 s within 1.1 s: it
    switches, on both ranks at the same step."""
    clock = Clock()
    fast, slow = CostModel(1e-6, 1e-10), CostModel(1e-3, 1e-4)
    model = model_64()
    auto = Auto(candidates=["none", "powersgd:matrix_rank=1"], probe=2, window=2, warmup=1, interval=0,
                accordion=0, drift=2, clock=clock, measure=lambda: slow)
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=auto,
                                       cost_model=(fast.alpha, fast.beta))
    link = [0.001]
    synchronize = opt.reducer._synchronize

    def over_the_link():
        clock.now += link[0]
        return synchronize()

    opt.reducer._synchronize = over_the_link
    for step in range(14):
        if step == 9:
            link[0] = 0.5
        clock.now += 1.0
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    decisions = opt.auto.decisions
    got = [(d["step"], d["cause"], d["chosen"]) for d in decisions]
    assert got == [(0, "start", "none"), (2, "probe", "none"), (9, "drift", "powersgd:matrix_rank=1")], got
    probe, drift = decisions[1], decisions[2]
    assert abs(probe["table"]["none"]["comm_s"] - (2e-6 + 16640e-10)) < 1e-12, probe["table"]
    assert abs(probe["predicted_step_s"] - (1.0 + 2e-6 + 16640e-10)) < 1e-9
    assert probe["compute_s"] == 1.0 and abs(probe["measured_step_s"] - 1.001) < 1e-9, probe
    assert abs(drift["table"]["none"]["comm_s"] - (2e-3 + 1.664)) < 1e-9, drift["table"]
    assert abs(drift["table"]["powersgd:matrix_rank=1"]["comm_s"] - (4e-3 + 768e-4)) < 1e-9, drift["table"]
    assert drift["cost_model"] == {"alpha_s": 1e-3, "beta_s_per_byte": 1e-4}
    assert opt.compression.name == "powersgd"
    every = hvd.allgather_object(got, name="auto.decisions")
    assert every[0] == every[1], every
    opt.close()


def _residuals(method):
    out = {}
    for mem in memories(method):
        out.update({n: e.detach().reshape(-1).clone() for n, e in mem.committed.items()})
    return out


def check_switch_exact_on_the_mean():
    """top-k (allgather, error feedback) for 2 steps, then PowerSGD: over the ranks,
    mean(sent) + mean(new residual) = mean(gradient + old residual) on the step after the switch."""
    model = model_64(1)
    auto = Auto(candidates=["topk:density=0.1", "powersgd:matrix_rank=1"], probe=50, interval=0)
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=auto,
                                       cost_model=(1e-6, 1e-10))
    if opt.compression.name != "topk":
        opt.auto.switch(0)

    def step(k):
        x, y = batch(100 + k)
        ref = copy.deepcopy(model)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        g = {n: p.grad.reshape(-1).clone() for n, p in ref.named_parameters()}
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        sent = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
        with opt.skip_synchronize():
            opt.step()
        return g, sent

    step(0)
    step(1)
    old = _residuals(opt.compression)
    assert max(float(e.abs().max()) for e in old.values()) > 1e-3
    opt.auto.switch(1)
    g, sent = step(2)
    new = _residuals(opt.compression)
    mean = lambda t, name: hvd.allreduce(t, name=name, op=hvd.Average)  # noqa: E731
    for n in g:
        lhs = sent[n] + mean(new.get(n, torch.zeros_like(sent[n])), f"new.{n}")
        rhs = mean(g[n] + old[n], f"old.{n}")
        assert torch.allclose(lhs, rhs, rtol=0, atol=1e-5), (n, float((lhs - rhs).abs().max()))
        # without the carry the old residual would be missing: the check would be off by its mean
        assert float(mean(old[n], f"gap.{n}").abs().max()) > 1e-5 or n == "bias"
    opt.close()


def check_leader_topk_measured_across_ranks():
    """cltk (cyclic leader) and VAR-Topk at density 0.1 on ``model_64`` (n = 4160, k = 416), rank 1's
    loss 10x rank 0's, lr 0, a fast posed link (the least error wins): the probe (steps 1-2) runs
    each leader's top-k with the group's collectives; its error, Σ_r ‖kept_r‖² / Σ_r ‖p_r‖² (kept_r:
    rank r's compensated gradient off the leader's positions), equals the one worked out here from
    every rank's gradient (allgathered from a copy of the model) within 1e-5: VAR-Topk's leader is
    rank 1 at both steps, cyclic's rank 0 then rank 1; VAR-Topk's error is the smaller, and chosen."""
    from tests.simworld import leader_topk_error

    labels = ["cltk:density=0.1", "cltk:density=0.1,leader=variance"]
    clock = Clock()
    model = model_64()
    reference = copy.deepcopy(model)
    auto = Auto(candidates=labels, probe=2, window=2, warmup=1, interval=0, accordion=0, clock=clock)
    opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), compression=auto,
                                       cost_model=(1e-6, 1e-10))
    scale = 1.0 + 9.0 * hvd.rank()
    for step in range(4):
        clock.now += 1.0
        x, y = batch(step)
        opt.zero_grad()
        (torch.nn.functional.mse_loss(model(x), y) * scale).backward()
        opt.step()
    got = [(d["step"], d["cause"], d["chosen"]) for d in opt.auto.decisions]
    table = opt.auto.decisions[1]["table"]
    grads = {}
    for step in (1, 2):
        reference.zero_grad()
        x, y = batch(step)
        (torch.nn.functional.mse_loss(reference(x), y) * scale).backward()
        mine = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        grads[step] = hvd.allgather(mine.unsqueeze(0), name=f"var.grads.{step}")  # (rank r's in row r)
    for label in labels:
        want = leader_topk_error([list(grads[1]), list(grads[2])], 0.1, label.endswith("variance"))
        assert abs(table[label]["error"] - want) <= 1e-5 * want, (label, table[label], want)
    assert table[labels[1]]["error"] < table[labels[0]]["error"], table
    assert got == [(0, "start", labels[0]), (2, "probe", labels[1])], got
    opt.close()


if __name__ == "__main__":
    hvd.init()
    check_decide_agree_and_redecide()
    check_switch_exact_on_the_mean()
    check_leader_topk_measured_across_ranks()
    if hvd.rank() == 0:
        print("auto checks passed", flush=True)
