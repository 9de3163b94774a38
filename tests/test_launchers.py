"""The training script under Horovod's own launcher, with MPI and with Gloo (mpi4py unusable: the
Horovod allgather path carries sparse payloads). Both runs see the same data and seeds, so they
must reach the same validation perplexity, and each records its launcher. Which launcher started
a process (hvdcomp.launch.detect_launch), from the variables each sets and from real launches."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from hvdcomp.launch import HOROVODRUN_OMPI, check_frontend_launch, check_launch, detect_launch
from mpirun import MPI_ENV, ROOT, TINY_SHAKESPEARE

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def horovodrun(tmp_path, *flags, timeout=420):
    out = tmp_path / "run"
    cmd = [HOROVODRUN, *flags, "-np", "2", "-H", "localhost:2", sys.executable,
           os.path.join(ROOT, "mpi_scripts", "train_lm.py"), "--compressor", "topk:density=0.01",
           "--model", "small", "--epochs", "1", "--max-steps", "2", "--data", TINY_SHAKESPEARE,
           "--output", str(out), "--no-progress"]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        logs, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"horovodrun timed out: {' '.join(cmd)}\n{proc.communicate()[0][-4000:]}")
    assert proc.returncode == 0, logs[-4000:]
    with open(out / "results.json") as f:
        return json.load(f)


def test_horovodrun_mpi_and_gloo_agree(tmp_path):
    mpi = horovodrun(tmp_path / "mpi")
    gloo = horovodrun(tmp_path / "gloo", "--gloo")
    assert mpi["config"]["world_size"] == gloo["config"]["world_size"] == 2
    assert mpi["config"]["transport"] == "mpi4py-allgather (1 bucket(s))"
    assert gloo["config"]["transport"] == "horovod-allgather (1 bucket(s))"
    assert mpi["best_val_ppl"] == gloo["best_val_ppl"], (mpi["best_val_ppl"], gloo["best_val_ppl"])
    assert (mpi["launcher"], gloo["launcher"]) == ("horovodrun", "horovod-gloo")


# ---- which launcher started a process (results.json's "launcher") ------------------------------
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
OMPI_ENV = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
SRUN_ENV = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("env,expected", [
    (TORCHRUN_ENV, ("torchrun", 1, 2, 1)),                                  # was "none", 0, 1, 0
    ({**SRUN_ENV, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", **TORCHRUN_ENV}, ("torchrun", 1, 2, 1)),  # torchrun in srun
    ({k: TORCHRUN_ENV[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, ("env", 1, 2, 1)),  # another env:// launcher
    (OMPI_ENV, ("openmpi", 1, 2, 1)),
    ({**OMPI_ENV, **HOROVODRUN_OMPI}, ("horovodrun", 1, 2, 1)),            # was "openmpi"
    ({**OMPI_ENV, "OMPI_MCA_pml": "ob1"}, ("openmpi", 1, 2, 1)),           # one of horovodrun's three: mpirun
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1"}, ("horovod-gloo", 1, 2, 1)),
    (SRUN_ENV, ("slurm", 1, 2, 1)),
    ({}, ("none", 0, 1, 0)),
])
def test_detect_launch_names_the_launcher(env, expected):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == expected


def test_horovod_under_torchrun_is_refused_naming_the_ddp_front_end():
    with pytest.raises(RuntimeError, match="would train its own copy") as err:
        check_launch(1, TORCHRUN_ENV)
    assert "hvdcomp.ddp.register" in str(err.value) and "torchrun" in str(err.value)
    check_launch(2, TORCHRUN_ENV)


HOROVOD_GLOO_ENV = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1"}


@pytest.mark.parametrize("env,runtime,frontend,fragments", [
    # the Horovod/MPI modes under torchrun: the MPI command; the DDP front-end only for the Horovod front-end
    (TORCHRUN_ENV, "horovod", "hvdcomp.local.DiLoCo", ["(torchrun) started 2 tasks but Horovod sees 1 rank",
                                                      "launch hvdcomp.local.DiLoCo with `mpirun -np 2 python"]),
    (TORCHRUN_ENV, "mpi", "hvdcomp.gossip.GossipOptimizer", ["the MPI world (mpi4py) sees 1 rank", "`horovodrun -np 2"]),
    ({k: TORCHRUN_ENV[k] for k in ("RANK", "WORLD_SIZE")}, "horovod", "hvdcomp.adaptive_opt.OneBitAdam",
     ["RANK/WORLD_SIZE", "`mpirun -np 2"]),
    # mpi4py under horovodrun --gloo: no MPI job
    (HOROVOD_GLOO_ENV, "mpi", "hvdcomp.lowrank.ABTraining", ["(horovodrun --gloo) started 2 tasks",
                                                            "without --gloo, or `mpirun -np 2"]),
    # the DDP front-end with a process group of one rank
    (OMPI_ENV, "torch.distributed", "the DDP front-end", ["(mpirun) started 2 tasks but torch.distributed sees 1",
                                                          "hvdcomp.ddp.init_process_group()", "`torchrun --nproc_per_node 2"]),
    (SRUN_ENV, "torch.distributed", "the DDP front-end", ["(srun)", "hvdcomp.ddp.init_process_group()"]),
    (TORCHRUN_ENV, "torch.distributed", "the DDP front-end", ["without rank= and world_size="]),
    (OMPI_ENV, "mpi", "hvdcomp.gossip.GossipOptimizer", ["mpi4py.get_config()"]),
])
def test_each_front_end_refuses_a_launch_that_cannot_work(env, runtime, frontend, fragments):
    """A launcher that started 2 tasks and a front-end whose runtime sees 1 rank: refused with the
    launcher, the front-end and the command that works; the same launch is accepted when the
    runtime sees the 2 ranks (and any launch of one task is)."""
    with pytest.raises(RuntimeError, match="would train its own copy of the model with") as err:
        check_frontend_launch(frontend, runtime, 1, env)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))
    assert "hvdcomp.ddp.register" not in str(err.value)  # (only the Horovod front-end has a DDP counterpart)
    assert check_frontend_launch(frontend, runtime, 2, env).size == 2
    assert check_frontend_launch(frontend, runtime, 1, {}).launcher == "none"
    with pytest.raises(ValueError, match="runtime must be one of"):
        check_frontend_launch(frontend, "nccl", 1, env)


def test_real_launches_refuse_what_cannot_work():
    """Started for real at 2 ranks (tests/launch_checks.py). Under torchrun, every Horovod/MPI
    front-end is refused naming `mpirun -np 2` (before: OneBitAdam, GossipOptimizer and
    ABTraining were accepted, each rank training alone; DiLoCo was refused only by its inner
    DistributedOptimizer, naming the DDP front-end, which has no DiLoCo) and the DDP front-end
    accepted. Under mpirun, the DDP front-end on a process group of one rank per process is
    refused naming hvdcomp.ddp.init_process_group() (before: accepted) and the Horovod one accepted."""
    script = os.path.join(ROOT, "tests", "launch_checks.py")
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    bindir = os.path.dirname(sys.executable)
    runs = {"torchrun": [os.path.join(bindir, "torchrun"), "--standalone", "--nproc_per_node", "2", script, "torchrun"],
            "mpirun": ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, script, "mpirun"]}
    out = {}
    for name, cmd in runs.items():
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                             timeout=180)
        assert res.returncode == 0, (cmd, res.stdout[-3000:])
        out[name] = res.stdout  # (the ranks' lines may interleave: count occurrences)
    for frontend in ("DistributedOptimizer", "DiLoCo", "OneBitAdam", "GossipOptimizer", "ABTraining"):
        refused = re.findall(rf"REFUSED {frontend}: .*?`mpirun -np 2 python", out["torchrun"])
        assert len(refused) == 2 and f"ACCEPTED {frontend}" not in out["torchrun"], (frontend, out["torchrun"][-3000:])
    assert out["torchrun"].count("ACCEPTED ddp.register") == 2, out["torchrun"][-3000:]
    assert len(re.findall(r"REFUSED ddp.register: .*?hvdcomp\.ddp\.init_process_group\(\)", out["mpirun"])) == 2, \
        out["mpirun"][-3000:]
    assert out["mpirun"].count("ACCEPTED DistributedOptimizer") == 2, out["mpirun"][-3000:]


def test_torchrun_and_mpirun_are_recorded_by_name(tmp_path):
    """A script printing detect_launch().launcher, started for real by torchrun (it printed
    "none") and mpirun, one process each; horovodrun over MPI and Gloo: test_horovodrun_mpi_and_gloo_agree;
    srun: tests/test_ddp.py's stand-in and tests/test_slurm.py."""
    script = tmp_path / "which.py"
    script.write_text("from hvdcomp.launch import detect_launch\nprint(f'LAUNCHER={detect_launch().launcher}')\n")
    bindir = os.path.dirname(sys.executable)
    launches = {
        "torchrun": [os.path.join(bindir, "torchrun"), "--standalone", "--nproc_per_node", "1"],
        "openmpi": ["mpirun", "-np", "1"],
    }
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    for expected, launcher in launches.items():
        cmd = [*launcher, *([] if expected == "torchrun" else [sys.executable]), str(script)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                             timeout=120)
        assert out.returncode == 0, (cmd, out.stdout[-3000:])
        assert f"LAUNCHER={expected}\n" in out.stdout, (expected, out.stdout[-3000:])


# ---- elastic Horovod (HOROVOD_ELASTIC=1): front-ends that cannot follow a size change refuse ----
ELASTIC_ENV = {**HOROVOD_GLOO_ENV, "HOROVOD_ELASTIC": "1"}
NOT_ELASTIC = ["hvdcomp.lowrank.ABTraining", "the DDP front-end (hvdcomp.ddp.register)"]


@pytest.mark.parametrize("frontend", NOT_ELASTIC)
@pytest.mark.parametrize("size", [1, 2])
def test_elastic_horovod_refuses_front_ends_that_cannot_follow_a_size_change(monkeypatch, frontend, size):
    """Under elastic Horovod (horovodrun --min-np/--max-np sets HOROVOD_ELASTIC=1) a front-end that
    cannot rebuild for a new world size is refused at construction, whatever the size now, naming
    the fixes (before: accepted; DiLoCo then died in KeyError: 0 after a scale-down). The same
    launch without HOROVOD_ELASTIC is accepted."""
    from hvdcomp.launch import start_frontend

    monkeypatch.setenv("HVDCOMP_ABORT_ON_EXCEPTION", "0")
    for key, value in ELASTIC_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="cannot follow a change of the world size") as err:
        start_frontend(frontend, "horovod", size)  # (os.environ: what a real worker reads)
    for fragment in (frontend, "HOROVOD_ELASTIC=1", "without --min-np, --max-np and --host-discovery-script",
                     "docs/robustness.md"):
        assert fragment in str(err.value), (fragment, str(err.value))
    monkeypatch.delenv("HOROVOD_ELASTIC")
    assert start_frontend(frontend, "horovod", 2).launcher == "horovod-gloo"


@pytest.mark.parametrize("frontend", ["the Horovod front-end (hvdcomp.DistributedOptimizer)", "hvdcomp.local.DiLoCo",
                                      "hvdcomp.local.SparseLoCo", "hvdcomp.local.CO2",
                                      "hvdcomp.local.LocalAdaAlter", "hvdcomp.adaptive_opt.OneBitAdam", "hvdcomp.adaptive_opt.ZeroOneAdam",
                                      "hvdcomp.adaptive_opt.OneBitLamb", "hvdcomp.adaptive_opt.CompressedAMSGrad",
                                      "hvdcomp.gossip.GossipOptimizer"])
def test_elastic_horovod_accepts_the_front_ends_that_follow(monkeypatch, frontend):
    """hvdcomp.DistributedOptimizer, the local-update modes, the adaptive optimizers and gossip follow
    a size change
    (tests/test_elastic.py): accepted."""
    from hvdcomp.launch import start_frontend

    monkeypatch.setenv("HVDCOMP_ABORT_ON_EXCEPTION", "0")
    for key, value in ELASTIC_ENV.items():
        monkeypatch.setenv(key, value)
    assert start_frontend(frontend, "horovod", 2).launcher == "horovod-gloo"
