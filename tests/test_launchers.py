"""The training script under Horovod's own launcher, with MPI and with Gloo (mpi4py unusable: the
Horovod allgather path carries sparse payloads). Both runs see the same data and seeds, so they
must reach the same validation perplexity, and each records its launcher. Which launcher started
a process (hvdcomp.launch.detect_launch), from the variables each sets and from real launches."""
import json
import os
import signal
import subprocess
import sys

import pytest

from hvdcomp.launch import HOROVODRUN_OMPI, check_launch, detect_launch
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
