"""Fault handling: non-finite gradients, disagreeing ranks, checkpoints, accumulation, huge
messages and failing ranks (under mpirun with timeouts); launch detection; property tests over
random shapes, dtypes and values for every registered method."""
import copy
import functools
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import hvdcomp
from hvdcomp.compressors import PayloadKind
from hvdcomp.transports import StepMethod
from hvdcomp.comm.allgatherv import plan_rounds
from hvdcomp.launch import check_launch, detect_launch
from tests.mpirun import MPI_ENV, ROOT, check, mpirun

CHECKS = ["nonfinite_skip", "nonfinite_raise", "powersgd_verdict_rides", "disagreeing_ranks", "disagreeing_transport", "checkpoint_bit_identical",
          "accumulation_frozen_unused_unnamed", "allgather_in_rounds"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_faults_under_mpirun(ranks):
    out = check(ranks, ["tests/mpi/reliability_checks.py", *CHECKS], timeout=300)
    for name in CHECKS:
        assert f"OK {name}" in out, out[-3000:]


FAILURE = os.path.join(ROOT, "tests", "mpi", "failure_checks.py")
BIN = os.path.dirname(sys.executable)


def _launch(launcher: str, frontend: str, timeout: float = 120, *args):
    """``launcher`` (mpirun, horovodrun or torchrun) at 2 ranks of tests/mpi/failure_checks.py
    ``frontend``; returns (exit status, output, the time it ended)."""
    if launcher == "mpirun":
        res = mpirun(2, [FAILURE, frontend, *args], timeout=timeout)
        return res.returncode, res.stdout, time.time()
    cmd = {"horovodrun": [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable],
           "torchrun": [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2"]}[launcher]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    proc = subprocess.Popen([*cmd, FAILURE, frontend, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{launcher} {frontend}: the job hung ({timeout} s)\n{proc.communicate()[0][-4000:]}")
    return proc.returncode, out, time.time()


@pytest.mark.parametrize("launcher,frontend", [
    ("mpirun", "horovod"), ("mpirun", "gossip"), ("mpirun", "horovod-thread"), ("horovodrun", "local"),
    ("torchrun", "ddp")])
def test_failing_rank_ends_the_job_within_30_s(launcher, frontend):
    """Rank 1 raises at step 2 (in a thread for horovod-thread) in a script that installs nothing:
    the front-end's hook ends the job within 30 s of the failure (MPI_Abort under mpirun and
    horovodrun; an exit without finalization under torchrun, whose agent stops the other
    worker). Before (HVDCOMP_ABORT_ON_EXCEPTION=0 here), mpirun with Horovod or gossip, mpi4py
    imported first, hung past 100 s."""
    rc, out, ended = _launch(launcher, frontend)
    assert rc != 0 and "UNREACHABLE" not in out, out[-3000:]
    assert "injected failure at step 2" in out, out[-3000:]
    assert re.search(r"hvdcomp: rank 1 of 2 \(\S+\) failed with an uncaught exception", out), out[-3000:]
    failed_at = float(re.search(r"FAILING AT (\d+\.\d+)", out).group(1))
    assert ended - failed_at < 30, ended - failed_at


RESTART = os.path.join(ROOT, "tests", "mpi", "restart_checks.py")


def _torchrun_restart(modes, directory, fail_at, *flags, ranks=2):
    """tests/mpi/restart_checks.py ``modes`` (one, or several comma-separated, side by side) at
    ``ranks`` ranks under torchrun; returns (exit status, rank 0's PARAMS line split: (sha256, sum,
    step resumed from) or None (several modes: {mode: that}), output)."""
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(ranks), RESTART, modes,
           str(directory), str(fail_at), *flags]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"torchrun {modes}: hung\n{proc.communicate()[0][-4000:]}")
    lines = {}
    for mode in modes.split(","):
        line = re.search(rf"^PARAMS {mode} (\S+) (\S+) (\d+)$", out, re.M)
        lines[mode] = line.groups() if line else None
    return proc.returncode, lines if "," in modes else lines[modes], out


#: the modes of the torchrun restart tests, side by side in each launch (the launches, not the
#: steps, take the time)
RESTART_MODES = ["ddp-topk", "diloco-topk"]


@pytest.fixture(scope="module")
def failed_at_4(tmp_path_factory):
    """Every mode of RESTART_MODES at 2 ranks, rank 1 failing at step 4 (one torchrun launch): the
    directory of the per-rank checkpoints it left (each rank's of step 4: with the barrier before
    each save no rank saves a step another did not finish). Resumed at 2 ranks by
    :func:`restarted`, at 1 by :func:`resized` (each from a copy)."""
    import shutil

    tmp_path = tmp_path_factory.mktemp("failed")
    rc, _, out = _torchrun_restart(",".join(RESTART_MODES), tmp_path / "job", 4)
    assert rc != 0 and "injected failure at step 4" in out, out[-3000:]
    shutil.copytree(tmp_path / "job", tmp_path / "at4")
    return tmp_path / "at4"


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, failed_at_4):
    """Every mode of RESTART_MODES (one torchrun launch each run): (the PARAMS of the run without
    a failure, of the run resumed from :func:`failed_at_4`'s checkpoints); both runs checked to
    end so."""
    import shutil

    tmp_path = tmp_path_factory.mktemp("restart")
    modes = ",".join(RESTART_MODES)
    rc, ref, out = _torchrun_restart(modes, tmp_path / "plain", -1)
    assert rc == 0, out[-3000:]
    shutil.copytree(failed_at_4, tmp_path / "failed")
    rc, resumed, out = _torchrun_restart(modes, tmp_path / "failed", -1)
    assert rc == 0, out[-3000:]
    return ref, resumed, out


@pytest.mark.parametrize("mode", RESTART_MODES)
def test_torchrun_restart_resumes_from_per_rank_checkpoints_exactly(mode, restarted):
    """Rank 1 fails at step 4 (DiLoCo: mid-round, H = 3) and the job ends; the same torchrun
    command again: each rank loads its own last checkpoint (model, optimizer, and the DDP hook's
    ``hook.state_dict()`` / DiLoCo's ``state_dict()``: top-k residuals, θ_start, outer momentum)
    and finishes with the parameters of the run without a failure, bit for bit
    (docs/robustness.md, "Restarts"). The modes run side by side, each on its own model with its
    own checkpoints, in each launch."""
    refs, resumeds, out = restarted
    ref, resumed = refs[mode], resumeds[mode]
    assert ref is not None and ref[2] == "0", (mode, out[-3000:])
    assert resumed is not None, (mode, out[-3000:])
    assert resumed[2] == "4", (mode, resumed)  # (it resumed from step 4's checkpoint)
    assert resumed[:2] == ref[:2], (mode, resumed, ref)


def _net_and_batch():
    """tests/mpi/restart_checks.py's model (seed 0) and its ``batch(rank, step)``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def batch(rank, step):
        g = torch.Generator().manual_seed(100 * rank + step)
        return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    return net, batch


def _topk_ef(value, residual, density=0.3):
    """Top-k with error feedback, by hand: (the k = ceil(ρ·n) largest entries of value +
    residual, zeros elsewhere; the new residual)."""
    acc = (value + residual).reshape(-1)
    keep = acc.abs().topk(min(acc.numel(), math.ceil(density * acc.numel()))).indices
    sparse = torch.zeros_like(acc)
    sparse[keep] = acc[keep]
    return sparse.reshape(value.shape), (acc - sparse).reshape(value.shape)


def _resume_reference(mode, checkpoints, start, steps):
    """tests/mpi/restart_checks.py's ``mode`` run from step ``start`` to ``steps`` at
    ``len(checkpoints)`` ranks, simulated in one process without hvdcomp, from the checkpoints
    saved at step ``start``: what every rank shares (model and SGD state of ddp-topk; θ_start and
    the outer Nesterov state of diloco-topk) from ``checkpoints[0]``; rank r's own top-k
    residuals (and DiLoCo's inner SGD state) from ``checkpoints[r]``, fresh where it is None."""
    net, batch = _net_and_batch()
    names = [n for n, _ in net.named_parameters()]
    first = copy.deepcopy(checkpoints[0])  # (SGD steps a loaded momentum buffer in place)

    def residuals(ck):
        if ck is None:
            return {n: torch.zeros_like(p) for n, p in net.named_parameters()}
        return dict(ck["hook"]["compression"]["residuals"] if mode == "ddp-topk" else ck["opt"]["sync"]["compression"]["residuals"])
    res = [residuals(ck) for ck in checkpoints]
    assert all(set(r) == set(names) for r in res), [sorted(r) for r in res]
    if mode == "ddp-topk":
        net.load_state_dict(first["model"])
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        opt.load_state_dict(first["opt"])
        for step in range(start, steps):
            total = {n: 0.0 for n in names}
            for rank, mine in enumerate(res):
                net.zero_grad()
                x, y = batch(rank, step)
                torch.nn.functional.mse_loss(net(x), y).backward()
                for n, p in net.named_parameters():
                    kept, mine[n] = _topk_ef(p.grad, mine[n])
                    total[n] = total[n] + kept
            for n, p in net.named_parameters():
                p.grad = total[n] / len(res)
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    anchor = [first["opt"]["anchor"][n].clone() for n in names]  # diloco-topk: H = 3
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    outer.load_state_dict(first["opt"]["outer"])
    inner = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for _ in checkpoints]
    for opt, ck in zip(inner, checkpoints):
        if ck is not None:
            opt.load_state_dict(copy.deepcopy(ck["opt"]["inner"]))
    assert steps % 3 == 0
    for round_start in range(start - start % 3, steps, 3):  # (mid-round: each rank from its own model)
        total = [0.0] * len(names)
        for rank, (opt, mine) in enumerate(zip(inner, res)):
            if round_start < start:
                net.load_state_dict(checkpoints[rank]["model"])
            else:
                with torch.no_grad():
                    for p, a in zip(net.parameters(), anchor):
                        p.copy_(a)
            for step in range(max(start, round_start), round_start + 3):
                opt.zero_grad()
                x, y = batch(rank, step)
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
            for i, (n, p) in enumerate(net.named_parameters()):
                kept, mine[n] = _topk_ef(anchor[i] - p.detach(), mine[n])
                total[i] = total[i] + kept
        for a, t in zip(anchor, total):
            a.grad = t / len(res)
        outer.step()
    return torch.cat([a.reshape(-1) for a in anchor])


#: the world-size changes of the torchrun resize tests, one chain of launches (2 -> 1 -> 2 ranks):
#: change -> (ranks saved at, ranks resumed at, step saved at, step resumed to); DiLoCo (H = 3) is
#: saved mid-round for the shrink, at a round's end for the growth
RESIZES = {"shrink": (2, 1, 4, 6), "grow": (1, 2, 6, 9)}


@pytest.fixture(scope="module")
def resized(tmp_path_factory, failed_at_4):
    """Every mode of RESTART_MODES side by side: from the checkpoints of 2 ranks at step 4
    (:func:`failed_at_4`), 1 rank resumed to step 6 (the shrink; one torchrun launch), 2 ranks
    resumed from there to step 9 (the growth, one launch; the departed rank 1's step-4 checkpoint
    removed first: the rank that joins is new). The directory holding, per change,
    ``saved-<change>`` (a copy of the checkpoints it resumed from) and ``after-<change>``."""
    import shutil

    tmp_path = tmp_path_factory.mktemp("resize")
    job, modes = tmp_path / "job", ",".join(RESTART_MODES)
    shutil.copytree(failed_at_4, job)
    for change, (before, after, saved_at, steps) in RESIZES.items():
        shutil.copytree(job, tmp_path / f"saved-{change}")
        for mode in RESTART_MODES:  # (a rank beyond the saving world's size: a new one)
            for r in range(before, 2):
                (job / mode / f"rank{r}.pt").unlink(missing_ok=True)
        rc, resumed, out = _torchrun_restart(modes, job, -1, "--steps", str(steps), ranks=after)
        assert rc == 0, out[-3000:]
        assert all(line is not None and line[2] == str(saved_at) for line in resumed.values()), (resumed, out[-3000:])
        shutil.copytree(job, tmp_path / f"after-{change}")
    return tmp_path


@pytest.mark.parametrize("change", sorted(RESIZES))
@pytest.mark.parametrize("mode", RESTART_MODES)
def test_torchrun_resume_at_another_world_size_keeps_each_ranks_residual(mode, change, resized):
    """Per-rank checkpoints saved at one world size; torchrun again at another (an elastic job after
    a membership change) resumes from them: 2 ranks to step 4 (where rank 1 failed, in
    test_torchrun_restart_resumes_from_per_rank_checkpoints_exactly), 1 rank on to step 6 (the shrink;
    DiLoCo, H = 3, mid-round), 2 ranks on to step 9 (the growth, from a round's end); the modes side
    by side in each launch. A rank that saved a checkpoint loads its own (its top-k residual;
    DiLoCo's inner optimizer and local progress), a new rank starts them fresh (zero residual) and
    takes what every rank shares from rank 0 (the DDP hook: the script loads rank 0's model and
    optimizer, the compressor's shared state follows at the first step; DiLoCo: the model
    (θ_start), then outer momentum and counters at the first step). The end of each change equals
    a one-process simulation from the checkpoints it resumed from (docs/robustness.md,
    "Restarts"). Before, DiLoCo refused 1 -> 2 ("rank(s) [0] loaded a checkpoint and rank(s) [1]
    did not")."""
    before, after, saved_at, steps = RESIZES[change]
    saved = [torch.load(resized / f"saved-{change}" / mode / f"rank{r}.pt", weights_only=True) if r < before else None
             for r in range(after)]
    assert all(ck is None or ck["step"] == saved_at for ck in saved), [ck and ck["step"] for ck in saved]
    expected = _resume_reference(mode, saved, saved_at, steps)
    final = torch.load(resized / f"after-{change}" / mode / "final.pt", weights_only=True)
    assert torch.allclose(final, expected, rtol=0, atol=1e-6), (mode, change, (final - expected).abs().max())
    key = ("hook", "compression") if mode == "ddp-topk" else ("opt", "sync", "compression")
    zeroed = copy.deepcopy(saved[0])
    for r in functools.reduce(dict.__getitem__, key, zeroed)["residuals"].values():
        r.zero_()
    control = _resume_reference(mode, [zeroed] + saved[1:], saved_at, steps)
    assert not torch.allclose(final, control, rtol=0, atol=1e-4), (mode, change)  # (rank 0's residual carried over matters)


def test_local_update_resume_at_another_world_size_mid_round_is_refused(tmp_path):
    """DiLoCo saved at 1 rank mid-round (step 4, H = 3), resumed at 2: the round in progress is
    one rank's local progress, which a new rank cannot share; both ranks raise at the first step,
    naming each rank's checkpoint and the fix (before: "rank(s) [0] loaded a checkpoint and rank(s)
    [1] did not", pointing at broadcast_state)."""
    rc, _, out = _torchrun_restart("diloco-topk", tmp_path, -1, "--steps", "4", ranks=1)
    assert rc == 0, out[-3000:]
    rc, resumed, out = _torchrun_restart("diloco-topk", tmp_path, -1, "--steps", "6", ranks=2)
    assert rc != 0 and resumed is None, out[-3000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: ValueError: resuming at 2 ranks from checkpoints saved at another world "
                         r"size needs every checkpoint of the same round's end \(save when opt.round_step == 0\)", out), \
            out[-3000:]
    assert "rank 0: saved at 1 ranks, step 4, round step 1; rank 1: no checkpoint, parameters" in out, out[-3000:]


def test_local_update_ranks_resumed_from_different_steps_are_refused(tmp_path):
    """DiLoCo communicates once a round, so without a barrier before saving, rank 0 finishes (and
    saves) step 4 while rank 1 fails in it: resumed so, the ranks would average rounds of different
    steps (before: the run went on, rank 0 one local step ahead). At the first step after loading,
    every rank raises naming each rank's step and the fix."""
    rc, _, out = _torchrun_restart("diloco-topk", tmp_path, 4, "--no-barrier")
    assert rc != 0 and "injected failure at step 4" in out, out[-3000:]
    rc, resumed, out = _torchrun_restart("diloco-topk", tmp_path, -1, "--no-barrier")
    assert rc != 0 and resumed is None, out[-3000:]
    assert "ranks disagree on the checkpoint each rank loaded" in out, out[-3000:]
    assert "rank 1 steps 4 != rank 0 5" in out, out[-3000:]
    assert "opt.round_step == 0" in out, out[-3000:]


@pytest.mark.parametrize("launcher,frontend", [("mpirun", "horovod"), ("horovodrun", "local"), ("torchrun", "ddp")])
def test_killed_rank_ends_the_job_within_30_s(launcher, frontend):
    """Rank 1 SIGKILLs itself at step 2 (no exception, no hook runs: the OOM killer's case): the
    launcher ends the job within 30 s, the other rank blocked in a collective included."""
    rc, out, ended = _launch(launcher, frontend, 120, "kill")
    assert rc != 0 and "UNREACHABLE" not in out, out[-3000:]
    failed_at = float(re.search(r"FAILING AT (\d+\.\d+)", out).group(1))
    assert ended - failed_at < 30, ended - failed_at


def _hook_run(env_extra, code):
    """A fresh interpreter that looks like rank 0 of 2 under mpirun (no MPI started), runs
    ``code`` and raises; returns (exit status, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "PYTHONPATH": ROOT, **env_extra})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, proc.stderr


HOOK_SCRIPT = """
import sys, threading
from hvdcomp.launch import start_frontend
def mine(t, v, tb):
    print("USER HOOK", v, file=sys.stderr)
sys.excepthook = mine
start_frontend("x", "horovod", 2)
first = sys.excepthook
start_frontend("x", "horovod", 2)
print("IDEMPOTENT", sys.excepthook is first, sys.excepthook is not mine,
      threading.excepthook is not threading.__excepthook__, file=sys.stderr)
raise ValueError("boom")
"""


def test_front_end_hook_chains_and_opts_out():
    """start_frontend installs the hook once (a second call changes nothing), the user's own
    sys.excepthook still runs, and the exit skips the interpreter's finalization (an atexit
    handler does not run); HVDCOMP_ABORT_ON_EXCEPTION=0 leaves Python's behaviour as it was."""
    code = HOOK_SCRIPT.replace("import sys, threading", "import atexit, sys, threading\n"
                               "atexit.register(lambda: print('ATEXIT', file=sys.stderr))")
    rc, err = _hook_run({}, code)
    assert rc == 1 and "IDEMPOTENT True True True" in err, err
    assert "hvdcomp: rank 0 of 2 (mpirun) failed" in err and "USER HOOK boom" in err and "ATEXIT" not in err, err
    rc, err = _hook_run({"HVDCOMP_ABORT_ON_EXCEPTION": "0"}, code)
    assert rc == 1 and "IDEMPOTENT True False False" in err and "hvdcomp: rank" not in err, err
    assert "USER HOOK boom" in err and "ATEXIT" in err, err


# ---- huge messages: planned, not allocated ------------------------------------------------------
@pytest.mark.parametrize("counts", [[3_000_000_000, 0, 5_000_000_000], [2**31 - 1, 1], [10, 20, 30],
                                    [0, 0], [4_294_967_296] * 4])
def test_allgather_rounds_fit_in_int_and_cover_every_byte(counts):
    limit = 2**31 - 1
    rounds = plan_rounds(counts, limit)
    if sum(counts) <= limit:
        assert len(rounds) == 1
    covered = {r: 0 for r in range(len(counts))}
    base = [sum(counts[:r]) for r in range(len(counts))]
    for rnd in rounds:
        assert sum(c for _, c, _ in rnd) <= limit                  # counts and displacements fit
        for r, (src, c, dst) in enumerate(rnd):
            assert dst == base[r] + src and c >= 0
            if c:
                assert src == covered[r]                           # contiguous, no gap, no overlap
                covered[r] += c
    assert [covered[r] for r in range(len(counts))] == counts


# ---- launch detection -----------------------------------------------------------------------------
@pytest.mark.parametrize("env,expected", [
    ({}, ("none", 0, 1, 0)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ("openmpi", 3, 8, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}, ("mpich", 2, 4, 0)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1"}, ("mpich", 2, 4, 1)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0"}, ("slurm", 5, 6, 2)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0"}, ("none", 0, 1, 0)),  # batch script itself
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1"}, ("horovod-gloo", 1, 2, 1)),
])
def test_launch_detection(env, expected):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == expected


@pytest.mark.parametrize("env", [{"PMI_RANK": "x", "PMI_SIZE": "4"}, {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}])
def test_launch_detection_rejects_garbage(env):
    with pytest.raises(ValueError):
        detect_launch(env)


@pytest.mark.parametrize("env,fix", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}, "srun --mpi=pmix"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "horovodrun --check-build"),
    ({"PMI_RANK": "0", "PMI_SIZE": "3"}, "the mpirun of the MPI"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "HOROVOD_CONTROLLER"),
])
def test_launch_check_refuses_independent_copies(env, fix):
    """The launcher started N > 1 tasks but Horovod sees one rank: a clear error naming the fix."""
    with pytest.raises(RuntimeError, match="would train its own copy") as err:
        check_launch(1, env)
    assert fix in str(err.value)


@pytest.mark.parametrize("env,size", [
    ({}, 1),                                                                        # plain python
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}, 1),          # the batch script
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "1"}, 1),  # srun -n 1
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, 4),               # wired correctly
])
def test_launch_check_accepts_consistent_jobs(env, size):
    check_launch(size, env)


# ---- property tests -------------------------------------------------------------------------------
PER_TENSOR = [n for n in hvdcomp.available() if not isinstance(hvdcomp.get_compressor(n), StepMethod)]
SPECIAL = [0.0, -0.0, 1e-45, -1e-40, 1e38, -1e38, 3.0, float("nan"), float("inf"), float("-inf")]


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    n = math.prod(shape)
    kind = draw(st.sampled_from(["normal", "special", "equal"]))
    if kind == "normal":
        vals = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=n, max_size=n))
    elif kind == "special":
        vals = draw(st.lists(st.sampled_from(SPECIAL), min_size=n, max_size=n))
    else:
        vals = [draw(st.sampled_from(SPECIAL))] * n
    return torch.tensor(vals, dtype=torch.float32).reshape(shape).to(dtype)


@pytest.mark.parametrize("name", PER_TENSOR)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors())
@example(x=torch.full((4,), 1e38))
@example(x=torch.tensor([-3e38, 3e38, 1e-45, 0.0]))
@example(x=torch.full((2, 3), 7.0, dtype=torch.float16))
@example(x=torch.tensor(2.5))
def test_every_method_is_total(name, x):
    """Finite input: finite output of the same shape and dtype, and never an unexpected exception.
    Non-finite input: the output has the right shape and dtype (the optimizer skips such steps)."""
    comp = hvdcomp.get_compressor(name)
    payload, ctx = comp.encode(x, "p")
    out = comp.decode(payload, ctx)
    assert out.shape == x.shape and out.dtype == x.dtype
    agg = comp.aggregate([payload, payload], ctx) if comp.payload_kind is PayloadKind.GATHERED else out
    assert agg.shape == x.shape
    if torch.isfinite(x).all():
        assert torch.isfinite(out).all(), (name, x, out)


@pytest.mark.parametrize("name", hvdcomp.available())
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_and_bool_tensors_refused_clearly(name, dtype):
    with pytest.raises(TypeError, match="floating-point gradients"):
        hvdcomp.get_compressor(name).encode(torch.ones(4).to(dtype), "p")


@pytest.mark.parametrize("name", PER_TENSOR)
def test_non_contiguous_and_zero_dim(name):
    comp = hvdcomp.get_compressor(name)
    x = torch.arange(12.0).reshape(3, 4).t()                 # non-contiguous view
    payload, ctx = comp.encode(x, "nc")
    assert comp.decode(payload, ctx).shape == (4, 3)
    payload, ctx = comp.encode(torch.tensor(-1.5), "scalar")  # 0-d
    assert comp.decode(payload, ctx).shape == ()


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=4),
       rank=st.integers(1, 3), big=st.booleans())
def test_powersgd_is_total(shapes, rank, big):
    """PowerSGD (batched API) on random shapes: right shapes and dtypes, finite output."""
    from hvdcomp.metrics import PhaseTimer

    comp = hvdcomp.get_compressor("powersgd", matrix_rank=rank)
    gen = torch.Generator().manual_seed(len(shapes))
    grads = [(f"p{i}", torch.randn(s, generator=gen) * (1e30 if big else 1.0)) for i, s in enumerate(shapes)]
    for _ in range(2):
        out = comp.reduce_batch(grads, lambda x, n: x.clone(), PhaseTimer(cuda_sync=False))
        for (_, g), o in zip(grads, out):
            assert o.shape == g.shape and o.dtype == g.dtype and torch.isfinite(o).all()
