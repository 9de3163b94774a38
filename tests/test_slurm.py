"""The project's SLURM batch script, submitted for real to a local SLURM cluster (CPU mode).

The cluster comes from ../shared/tools/slurm_local.sh (munge, slurmctld, 2 emulated slurmd nodes
x 2 CPUs, Open MPI with PMIx). It is brought up once for this module and always torn down.
Skipped, with the reason, where it cannot run (not root, no apt-get, tool missing).
"""
import json
import os
import shutil
import subprocess

import pytest

from tests.mpirun import ROOT, SHARED, TINY_SHAKESPEARE

TOOL = os.path.join(SHARED, "tools", "slurm_local.sh")
SCRIPT = os.path.join(ROOT, "slurm", "train_lm.sbatch")
VENV = os.path.join(ROOT, ".venv")


def _why_not():
    if not os.path.isfile(TOOL):
        return f"{TOOL} not found"
    if os.geteuid() != 0:
        return "SLURM can only be installed and started as root"
    if shutil.which("apt-get") is None:
        return "no apt-get to install SLURM"
    if not os.path.isfile(TINY_SHAKESPEARE):
        return "../shared/data not present"
    return None


def _tool(*args, timeout=240, env=None):
    return subprocess.run(["bash", TOOL, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, SLURM_LOCAL_NODES="2", SLURM_LOCAL_CPUS="2", **(env or {})))


@pytest.fixture(scope="module")
def cluster():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    try:
        up = _tool("up", timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        yield
    finally:
        _tool("down", timeout=120)


def sbatch(tmp_path, *options, **env):
    """Submit slurm/train_lm.sbatch with sbatch --wait (CPU mode, 2 nodes x 2 tasks)."""
    job_env = {"HVDCOMP_VENV": VENV, "OUTPUT_ROOT": str(tmp_path / "results"), "MODEL": "small",
               "EPOCHS": "1", "EXTRA_ARGS": "--max-steps 2", "DATA": TINY_SHAKESPEARE, **env}
    res = _tool("run", "timeout", "420", "sbatch", "--wait", "--parsable", "--gres=none", "-N", "2",
                "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                f"--output={tmp_path}/%A_%a.out", *options, SCRIPT, timeout=480, env=job_env)
    logs = "".join(open(os.path.join(tmp_path, f)).read() for f in sorted(os.listdir(tmp_path)) if f.endswith(".out"))
    assert res.returncode == 0, res.stdout + res.stderr + logs
    return res.stdout.strip().split(";")[0], logs


def load(path):
    with open(path) as f:
        return json.load(f)


def test_batch_job_runs_4_ranks_on_2_nodes(cluster, tmp_path):
    job, logs = sbatch(tmp_path, COMPRESSOR="topk:density=0.01")
    r = load(tmp_path / "results" / f"{job}_0" / "results.json")
    assert r["config"]["world_size"] == 4 and r["launcher"] == "slurm"
    assert sorted(x["rank"] for x in r["ranks"]) == [0, 1, 2, 3]
    assert sorted({x["node"] for x in r["ranks"]}) == ["n1", "n2"]
    for phase in ("compute", "compress", "communicate", "decompress"):
        assert set(r["per_step"][phase]) == {"min", "mean", "max"}     # over the 4 ranks
    assert r["config"]["transport"].startswith("mpi4py-allgather (") and "done:" in logs


def test_ddp_front_end_batch_job_runs_4_ranks_on_2_nodes_without_mpi(cluster, tmp_path):
    """HVDCOMP_FRONTEND=ddp: srun --mpi=none starts the tasks; torch.distributed (gloo) meets at
    the step's first node; hvdcomp's DDP hook carries top-k."""
    job, logs = sbatch(tmp_path, COMPRESSOR="topk:density=0.01", HVDCOMP_FRONTEND="ddp")
    r = load(tmp_path / "results" / f"{job}_0" / "results.json")
    assert r["config"]["world_size"] == 4 and r["config"]["frontend"] == "ddp"
    assert sorted(x["rank"] for x in r["ranks"]) == [0, 1, 2, 3]
    assert sorted({x["node"] for x in r["ranks"]}) == ["n1", "n2"]
    assert r["config"]["transport"].startswith("torch.distributed gloo: counts exchange")
    assert "(ddp front-end)" in logs and "done:" in logs


def test_job_array_writes_one_result_per_cell(cluster, tmp_path):
    cells = tmp_path / "cells.txt"
    cells.write_text("--compressor none\n--compressor topk:density=0.01\n")
    job, _ = sbatch(tmp_path, "--array=0-1", HVDCOMP_CELLS=str(cells), HVDCOMP_LAUNCHER="mpirun")
    methods = [load(tmp_path / "results" / f"{job}_{t}" / "results.json")["config"]["compressor_spec"]
               for t in (0, 1)]
    assert methods == ["none", "topk:density=0.01"]


@pytest.mark.parametrize("env,message", [
    ({"HVDCOMP_VENV": "/nonexistent/venv"}, "no virtualenv at '/nonexistent/venv'"),
    ({"DATA": "/nonexistent/corpus.txt"}, "data path '/nonexistent/corpus.txt' does not exist"),
    ({"HVDCOMP_LAUNCHER": "ssh"}, "HVDCOMP_LAUNCHER must be srun, mpirun or horovodrun"),
    ({"HVDCOMP_FRONTEND": "tf"}, "HVDCOMP_FRONTEND must be horovod or ddp"),
    ({"HVDCOMP_FRONTEND": "ddp", "HVDCOMP_LAUNCHER": "horovodrun"}, "HVDCOMP_FRONTEND=ddp runs without Horovod"),
])
def test_script_refuses_bad_set_up_clearly(tmp_path, env, message):
    full = dict(os.environ, HVDCOMP_VENV=VENV, OUTPUT_ROOT=str(tmp_path), DATA=__file__)
    full.update(env)
    for k in ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_NTASKS"):
        full.pop(k, None)
    res = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60, env=full)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_srun_step_asks_for_the_jobs_cpus_per_task(tmp_path):
    """From Slurm 22.05 a step does not inherit the job's --cpus-per-task: the script passes it to
    srun itself. A stand-in ``srun`` on PATH records the arguments it is given."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "srun").write_text('#!/bin/sh\necho "$@" > "$SRUN_ARGS"\nmkdir -p "$(dirname "$OUT")"; '
                               'echo {} > "$OUT"\n')
    (shim / "srun").chmod(0o755)
    out_root = tmp_path / "results"
    full = dict(os.environ, HVDCOMP_VENV=VENV, OUTPUT_ROOT=str(out_root), DATA=__file__,
                PATH=f"{shim}:{os.environ['PATH']}", SRUN_ARGS=str(tmp_path / "args"),
                SLURM_JOB_ID="77", SLURM_NTASKS="4", SLURM_CPUS_PER_TASK="6",
                OUT=str(out_root / "77_0" / "results.json"))
    full.pop("SLURM_ARRAY_TASK_ID", None)
    res = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60, env=full)
    assert res.returncode == 0, res.stdout + res.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[:3] == ["--mpi=pmix", "--kill-on-bad-exit=1", "--cpus-per-task=6"], args
