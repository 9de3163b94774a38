"""The training script under Horovod's own launcher, with MPI and with Gloo (mpi4py unusable: the
Horovod allgather path carries sparse payloads). Both runs see the same data and seeds, so they
must reach the same validation perplexity."""
import json
import os
import signal
import subprocess
import sys

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
