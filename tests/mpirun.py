"""Launch a worker script under ``mpirun -np N`` with a hard timeout (a hang fails, never blocks)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
TINY_SHAKESPEARE = os.path.join(SHARED, "data", "tinyshakespeare", "input.txt")

from hvdcomp.launch import MPI_ENV  # noqa: E402  (the one definition: hvdcomp/mpi.env)


def mpirun(np_: int, args, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """Run ``mpirun -np np_ python args...``; kill the whole process group after ``timeout`` s.

    Returns the completed process (stdout and stderr merged into ``stdout``).
    Raises ``AssertionError`` with the output when the run times out.
    """
    if shutil.which("mpirun") is None:
        raise AssertionError("mpirun not found: run `make install` first")
    full_env = {**os.environ, **MPI_ENV, **(env or {})}  # later entries override
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
           sys.executable, *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def check(np_: int, args, timeout: float = 300, env=None) -> str:
    """:func:`mpirun` and assert exit status 0; returns the output."""
    res = mpirun(np_, args, timeout=timeout, env=env)
    assert res.returncode == 0, f"exit {res.returncode}: {' '.join(res.args)}\n{res.stdout[-8000:]}"
    return res.stdout
