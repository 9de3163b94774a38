"""Multi-rank checks of hvdcomp.gossip.GossipOptimizer (decentralized training over MPI).

Usage: mpirun -np N python tests/mpi/gossip_checks.py CHECK[,CHECK...] OUTDIR

Checks:
  runs       every configuration of CONFIGS (that fits N ranks) for STEPS steps; each rank saves
             its final parameters and byte counts to OUTDIR/<config>-r<rank>.pt, for the test's
             single-process reference (tests/test_mpi_gossip.py) to compare bit for bit
  bad_input  invalid arguments on all or one rank: every rank raises (prints "OK bad_input ...")
  checkpoint per-rank state_dict (through torch.save / torch.load(weights_only=True)) after every
             step: each rank saves its final parameters (OUTDIR/<config>-saved-...), and a run
             resumed on fresh objects from the mid-flight checkpoint of step SAVE_AT saves its own
             (OUTDIR/<config>-resumed-...): the test compares both with the reference run that
             never saved
  nonfinite  an Inf in rank BAD_RANK's gradient at step BAD_STEP, STEPS + 1 steps: with
             nonfinite="skip" (default) and "raise" every rank skips (raises at) that step and the
             final parameters (OUTDIR/<config>-nonfinite-<mode>-...) are the reference's of STEPS
             steps; with "ignore" the NaN reaches every rank
  single     one rank: every method reduces to the local optimizer step
  two_instances  two optimizers (TWO_CONFIGS, each on its own model) stepped in turn, their
             exchanges in flight together, over Horovod's collectives (the edge layer of elastic
             Horovod and horovodrun --gloo): each ends equal, bit for bit, to the same
             configuration trained alone in this job (saved as OUTDIR/two-<config>-...; before: both ran under the same Horovod
             names, "a tensor with the same name as another tensor that is currently being
             processed", or the two exchanges matched each other)
  stall      rank 2 stops stepping: the others' next non-finite agreement raises
             CollectiveTimeoutError (then abort_on_uncaught_exception ends the job)
  stall_ignore  the same with nonfinite="ignore" (no agreement): its neighbours' next exchange
             raises NeighborTimeoutError naming rank 2
"""
import io
import os
import sys
import time

from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE)
import numpy as np
import torch
import horovod.torch as hvd

import hvdcomp.gossip
from hvdcomp.launch import abort_on_uncaught_exception

STEPS = 6
SHAPES = {"w1": (6, 5), "b1": (5,), "w2": (3, 5)}
PATH4 = [[1], [0, 2], [1, 3], [2]]  # ranks with 1 and 2 neighbours
# name -> (ranks it runs at, GossipOptimizer keywords); the reference in the test mirrors these
CONFIGS = {
    "choco-sign-ring": ((2, 4), dict(method="choco", topology="ring", compression="sign", consensus_step=0.45)),
    "choco-topk-ring": ((2, 4), dict(method="choco", topology="ring", compression="topk:density=0.2",
                                     consensus_step=0.3)),
    "choco-qsgd-ring": ((2, 4), dict(method="choco", topology="ring", compression="qsgd:levels=4,block=8",
                                     consensus_step=0.5)),
    "choco-sign-path": ((4,), dict(method="choco", topology=PATH4, compression="sign", consensus_step=0.4)),
    "choco-sign-ring-sync": ((2, 4), dict(method="choco", topology="ring", compression="sign", consensus_step=0.45,
                                          overlap=False)),
    "dcd-qsgd-ring": ((2, 4), dict(method="dcd", topology="ring", compression="qsgd:levels=16,block=8")),
    "ecd-qsgd-ring": ((2, 4), dict(method="ecd", topology="ring", compression="qsgd:levels=16,block=8")),
    "powergossip-ring": ((2, 4), dict(method="powergossip", topology="ring")),
    "powergossip-exp-2it": ((4,), dict(method="powergossip", topology="exponential", power_iterations=2)),
}
#: configurations of the checkpoint and nonfinite checks (2 ranks)
CHECKPOINT_CONFIGS = ("choco-sign-ring", "choco-qsgd-ring", "choco-topk-ring", "powergossip-ring", "dcd-qsgd-ring",
                      "ecd-qsgd-ring")
SAVE_AT = 3  # the resumed run starts from the checkpoint taken after this many steps
NONFINITE_CONFIGS = ("choco-sign-ring", "choco-qsgd-ring", "powergossip-ring", "dcd-qsgd-ring")
BAD_STEP, BAD_RANK = 2, 1  # (0-based step index)
PROCESS_SET = [1, 2, 3]  # the 4-rank run also trains one configuration inside this process set
SET_CONFIG = dict(method="choco", topology="ring", compression="topk:density=0.2", consensus_step=0.3)


def make_params(rank):
    """The test's model: per-rank initial values (seed 10 + global rank)."""
    g = torch.Generator().manual_seed(10 + rank)
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g)) for n, s in SHAPES.items()}


def targets(rank):
    """Per-rank minimisers c_r of f_r(x) = ½‖x − c_r‖² (seed 1000 + global rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def train(params, opt, rank, steps=STEPS):
    c = targets(rank)
    for _ in range(steps):
        opt.timer.begin_step()
        for n, p in params.items():
            p.grad = p.detach() - c[n]
        opt.step()
        opt.timer.end_step()


def inner(params):
    return torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9, weight_decay=1e-3)


def check_runs(outdir, process_set=None):
    rank, size = hvd.rank(), hvd.size()
    for name, (sizes, kwargs) in CONFIGS.items():
        if size not in sizes:
            continue
        params = make_params(rank)
        opt = hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(), **kwargs)
        train(params, opt, rank)
        opt.timer.begin_step()
        opt.flush()
        opt.timer.end_step()
        timer_sent = sum(rec["bytes_sent"] for rec in opt.timer.history)
        torch.save({"params": {n: p.detach() for n, p in params.items()}, "bytes_sent": opt.transport.bytes_sent,
                    "bytes_received": opt.transport.bytes_received, "timer_sent": timer_sent},
                   os.path.join(outdir, f"{name}-np{size}-r{rank}.pt"))
        opt.close()
    if process_set is not None:
        params = make_params(rank)
        opt = hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(),
                                             process_set=process_set, **SET_CONFIG)
        train(params, opt, rank)
        opt.flush()
        torch.save({"params": {n: p.detach() for n, p in params.items()}},
                   os.path.join(outdir, f"set-np{size}-r{rank}.pt"))
    print(f"OK runs rank {rank}", flush=True)


def expect_error(label, fn, *words):
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        assert all(w in msg for w in words), (label, msg)
        print(f"OK bad_input {label} rank {hvd.rank()}: {msg[:120]}", flush=True)
        return
    raise AssertionError(f"{label}: no error on rank {hvd.rank()}")


def check_bad_input(outdir):
    rank = hvd.rank()

    def build(**kwargs):
        params = make_params(rank)
        return hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(), **kwargs)

    expect_error("gamma_everywhere", lambda: build(compression="sign", consensus_step=1.5), "(0, 1]")
    expect_error("gamma_one_rank", lambda: build(compression="sign", consensus_step=1.5 if rank == 1 else 0.5),
                 "rank 1")
    expect_error("gamma_disagree", lambda: build(compression="sign", consensus_step=0.4 + 0.1 * rank),
                 "disagree", "consensus_step")
    expect_error("asymmetric", lambda: build(topology=[[1], []]), "not symmetric")
    expect_error("listed_twice", lambda: build(topology=[[1, 1], [0]]), "twice")
    expect_error("disconnected", lambda: build(topology=[[], []]), "disconnected")
    expect_error("biased_dcd", lambda: build(method="dcd", compression="topk:density=0.1"), "unbiased")
    expect_error("compression_disagree", lambda: build(compression="sign" if rank == 0 else "topk:density=0.1",
                                                       consensus_step=0.4), "disagree", "topk")
    expect_error("nonfinite_unknown", lambda: build(nonfinite="maybe" if rank == 1 else "skip"), "rank 1", "nonfinite")
    expect_error("nonfinite_disagree", lambda: build(nonfinite="skip" if rank == 0 else "raise"), "disagree",
                 "nonfinite")
    expect_error("timeout_one_rank", lambda: build(timeout=0 if rank == 1 else 30.0), "rank 1", "timeout")
    # numbers from numpy and 0-d tensors are numbers
    opt = build(compression="sign", consensus_step=np.float32(0.5), timeout=torch.tensor(30.0))
    assert opt.method.gamma == 0.5 and opt.transport.timeout == 30.0
    opt.close()
    print(f"OK bad_input numbers rank {rank}:", flush=True)


TWO_CONFIGS = ("choco-topk-ring", "powergossip-ring")


def check_two_instances(outdir):
    import hvdcomp.gossip.optimizer as gossip_optimizer
    from hvdcomp.transports.neighbor import HorovodEdges

    gossip_optimizer.neighbor_edges = lambda group, *prefix: HorovodEdges(group, *prefix)  # (no MPI edges)
    rank = hvd.rank()

    def build(name):
        params = make_params(rank)
        return params, hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(),
                                                      **CONFIGS[name][1])
    alone = []
    for name in TWO_CONFIGS:
        params, opt = build(name)
        train(params, opt, rank)
        opt.flush()
        opt.close()
        alone.append(params)
    runs = [build(name) for name in TWO_CONFIGS]
    c = targets(rank)
    for _ in range(STEPS):
        for params, opt in runs:  # (overlap: each exchange still in flight at the other's step)
            for n, p in params.items():
                p.grad = p.detach() - c[n]
            opt.step()
    for (params, opt), ref, name in zip(runs, alone, TWO_CONFIGS):
        opt.flush()
        opt.close()
        for n in SHAPES:
            assert torch.equal(params[n], ref[n]), (name, n, (params[n] - ref[n]).abs().max())
        save_params(params, outdir, f"two-{name}")
    print(f"OK two_instances rank {rank}", flush=True)


def save_params(params, outdir, label, **extra):
    torch.save({"params": {n: p.detach().clone() for n, p in params.items()}, **extra},
               os.path.join(outdir, f"{label}-np{hvd.size()}-r{hvd.rank()}.pt"))


def check_checkpoint(outdir):
    """Save after every step (the exchange in flight, with overlap); resume from step SAVE_AT."""
    rank = hvd.rank()
    for name in CHECKPOINT_CONFIGS:
        kwargs = CONFIGS[name][1]
        params = make_params(rank)
        opt = hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(), **kwargs)
        c = targets(rank)
        checkpoint = None
        for t in range(STEPS):
            for n, p in params.items():
                p.grad = p.detach() - c[n]
            opt.step()
            buf = io.BytesIO()
            torch.save({"model": {n: p.detach() for n, p in params.items()}, "gossip": opt.state_dict()}, buf)
            if t == SAVE_AT - 1:
                checkpoint = buf.getvalue()
        opt.flush()
        save_params(params, outdir, f"{name}-saved")
        opt.close()
        state = torch.load(io.BytesIO(checkpoint), weights_only=True)
        params2 = make_params(rank + 100)  # other values: everything must come from the checkpoint
        with torch.no_grad():
            for n, p in params2.items():
                p.copy_(state["model"][n])
        opt2 = hvdcomp.gossip.GossipOptimizer(inner(params2), named_parameters=params2.items(), **kwargs)
        opt2.load_state_dict(state["gossip"])
        train(params2, opt2, rank, steps=STEPS - SAVE_AT)
        opt2.flush()
        save_params(params2, outdir, f"{name}-resumed")
        wrong = dict(state["gossip"], rank=(rank + 1) % hvd.size())
        try:
            opt2.load_state_dict(wrong)
        except ValueError as exc:
            assert "per rank" in str(exc), exc
        else:
            raise AssertionError("another rank's state was accepted")
        opt2.close()
        print(f"OK checkpoint {name} rank {rank}", flush=True)


def check_nonfinite(outdir):
    """An Inf on rank BAD_RANK at step BAD_STEP, then training goes on (STEPS + 1 steps)."""
    rank = hvd.rank()
    runs = [(mode, name) for mode in ("skip", "raise") for name in NONFINITE_CONFIGS] + [("ignore", "choco-sign-ring")]
    for mode, name in runs:
        kwargs = dict(CONFIGS[name][1])
        if mode != "skip":  # (skip: the default)
            kwargs["nonfinite"] = mode
        params = make_params(rank)
        opt = hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(), **kwargs)
        c = targets(rank)
        raised = None
        for t in range(STEPS + 1):
            for n, p in params.items():
                p.grad = p.detach() - c[n]
            if t == BAD_STEP and rank == BAD_RANK:
                params["w1"].grad[0, 0] = float("inf")
            try:
                opt.step()
            except FloatingPointError as exc:
                raised = str(exc)
        opt.flush()
        save_params(params, outdir, f"{name}-nonfinite-{mode}", skipped=getattr(opt, "skipped_steps", None),
                    raised=raised)
        opt.close()
        print(f"OK nonfinite {mode} {name} rank {rank}: {raised}", flush=True)


def check_single(outdir):
    """One rank: no neighbours, every method is the local optimizer step (SGD: w − lr·g)."""
    for method, kwargs in (("choco", dict(compression="sign", consensus_step=0.5)), ("dcd", dict(compression="qsgd")),
                           ("ecd", dict(compression="qsgd")), ("powergossip", {})):
        w = torch.nn.Parameter(torch.ones(3, 2))
        opt = hvdcomp.gossip.GossipOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                             method=method, **kwargs)
        for _ in range(2):
            w.grad = torch.ones(3, 2)
            opt.step()
        opt.flush()
        assert torch.allclose(w.detach(), torch.full((3, 2), 0.8)), (method, w)
        with opt.average_model():
            assert torch.allclose(w.detach(), torch.full((3, 2), 0.8))
        assert opt.consensus_distance() == 0.0
        print(f"OK single {method}", flush=True)


def check_stall(outdir, nonfinite="skip"):
    rank = hvd.rank()
    params = make_params(rank)
    opt = hvdcomp.gossip.GossipOptimizer(inner(params), named_parameters=params.items(), method="choco",
                                         topology="ring", compression="sign", consensus_step=0.45, timeout=3.0,
                                         nonfinite=nonfinite)
    if rank == 2:
        print("rank 2 stalls", flush=True)
        time.sleep(120)
    train(params, opt, rank, steps=3)
    print(f"rank {rank} finished without noticing the stalled neighbour", flush=True)


if __name__ == "__main__":
    checks, outdir = sys.argv[1].split(","), sys.argv[2]
    abort_on_uncaught_exception()  # a failed check ends the job instead of hanging the other ranks
    ps = None
    if "runs" in checks and MPI.COMM_WORLD.Get_size() == 4:
        ps = hvd.ProcessSet(PROCESS_SET)
        hvd.init(process_sets=[ps])
    else:
        hvd.init()
    for check in checks:
        if check == "runs":
            check_runs(outdir, ps)
        else:
            {"bad_input": check_bad_input, "checkpoint": check_checkpoint, "nonfinite": check_nonfinite,
             "stall": check_stall, "stall_ignore": lambda d: check_stall(d, nonfinite="ignore"),
             "single": check_single, "two_instances": check_two_instances}[check](outdir)
