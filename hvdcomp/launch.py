"""What the launcher tells a process: rank, world size, local rank, and which device to use.

Read from the environment (no MPI call), so it works before ``hvd.init()`` and tells why a run
is single-process. Recognised launchers (:func:`detect_launch`, the name results files record):
``torchrun`` (``TORCHELASTIC_RUN_ID`` with ``RANK``…), Horovod's ``horovodrun`` over Open MPI
(``horovodrun``) and over Gloo (``horovod-gloo``: ``HOROVOD_RANK``…), Open MPI's ``mpirun``
(``openmpi``), MPICH/Intel MPI (Hydra: ``mpich``, ``PMI_RANK``…), SLURM ``srun`` (``slurm``,
``SLURM_PROCID``…), another launcher that sets ``torch.distributed``'s ``RANK`` and
``WORLD_SIZE`` (``env``), or none (``none``: a plain ``python`` start).
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Dict, Optional

import torch

__all__ = ["LaunchInfo", "detect_launch", "check_launch", "select_device", "abort_on_uncaught_exception",
           "MPI_ENV", "recorded_env"]


def _read_env_file(path: str) -> Dict[str, str]:
    """``KEY=VALUE`` lines of ``path`` (``#`` comments and blank lines skipped)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                out[key.strip()] = value.strip()
    return out


#: the Open MPI / Horovod environment of every hvdcomp launch (``hvdcomp/mpi.env``, its one definition)
MPI_ENV: Dict[str, str] = _read_env_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi.env"))

#: environment variables recorded with every result: the user-facing launch settings
RECORDED_ENV_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT", "HOROVOD_", "OMP_NUM_THREADS",
                         "MASTER_ADDR", "MASTER_PORT", "GLOO_", "TORCH_DISTRIBUTED_", "NETEM_")
#: OMPI_MCA_* variables that Open MPI itself sets for every launched process (not settings)
OMPI_INTERNAL = ("OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir",
                 "OMPI_MCA_mpi_oversubscribe", "OMPI_MCA_shmem_RUNTIME_QUERY_hint", "OMPI_MCA_ras_",
                 "OMPI_MCA_plm", "OMPI_MCA_routed", "OMPI_MCA_btl_base_", "OMPI_MCA_state_",
                 "OMPI_MCA_rmaps_", "OMPI_MCA_hwloc_", "OMPI_MCA_ras", "OMPI_MCA_grpcomm",
                 "OMPI_MCA_errmgr", "OMPI_MCA_odls", "OMPI_MCA_iof", "OMPI_MCA_filem",
                 "OMPI_MCA_dfs", "OMPI_MCA_schizo", "OMPI_MCA_rtc", "OMPI_MCA_oob_base_")


def recorded_env(environ=None) -> Dict[str, str]:
    """The launch settings of this process's environment, for results files (sorted by name):
    :data:`RECORDED_ENV_PREFIXES`, without what Open MPI sets internally."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env)
            if k.startswith(RECORDED_ENV_PREFIXES) and not k.startswith(OMPI_INTERNAL)}

# (launcher, rank, size, local rank) variable names, most specific first: torchrun's elastic agent
# names itself (TORCHELASTIC_RUN_ID) and may run inside srun or mpirun, whose variables the ranks
# then inherit; plain RANK / WORLD_SIZE (the env:// variables anyone may set) come last
_SCHEMES = [
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("horovod-gloo", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("env", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
]

#: the Open MPI settings ``horovodrun`` passes to every ``mpirun`` it starts (``-mca pml ob1
#: -mca btl ^openib --tag-output``, horovod/runner/mpi_run.py): how its ranks tell it from a
#: plain ``mpirun``
HOROVODRUN_OMPI = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib", "OMPI_MCA_orte_tag_output": "1"}

#: launchers whose ranks are MPI processes (an uncaught exception aborts the MPI job)
MPI_LAUNCHERS = ("openmpi", "horovodrun", "mpich", "slurm", "horovod-gloo")


@dataclass
class LaunchInfo:
    """``launcher``: ``"torchrun"``, ``"horovodrun"``, ``"horovod-gloo"``, ``"openmpi"``,
    ``"mpich"``, ``"slurm"``, ``"env"`` (see the module docstring), or ``"none"`` for a plain
    ``python`` start (rank 0 of 1)."""

    launcher: str
    rank: int
    size: int
    local_rank: int


def detect_launch(environ=None) -> LaunchInfo:
    """Rank, world size and local rank from the launcher's environment variables.

    ``torchrun`` is recognised by its agent's ``TORCHELASTIC_RUN_ID`` (it wins over the variables
    of an ``srun`` or ``mpirun`` that started torchrun); ``horovodrun`` over Open MPI by the
    settings it passes to ``mpirun`` (:data:`HOROVODRUN_OMPI`: an ``mpirun`` given those three
    by hand is recorded as ``horovodrun`` too; over MPICH it is recorded as ``mpich``). A SLURM
    allocation alone (``SLURM_PROCID`` without ``SLURM_STEP_ID``, i.e. the batch script itself)
    is not a parallel launch. MPICH's ``MPI_LOCALRANKID`` may be missing; then
    ``PMI_LOCAL_RANK`` is used, else 0.

    Raises:
        ValueError: a variable holds something other than an integer, or rank >= size.
    """
    env = os.environ if environ is None else environ
    for launcher, r, s, lr in _SCHEMES:
        if r in env and s in env:
            if (launcher == "slurm" and "SLURM_STEP_ID" not in env) or \
                    (launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in env):
                continue
            try:
                rank, size = int(env[r]), int(env[s])
                local = int(env.get(lr, env.get("PMI_LOCAL_RANK", 0)))
            except ValueError:
                raise ValueError(f"launcher variables {r}={env.get(r)!r} {s}={env.get(s)!r} are not integers") from None
            if not 0 <= rank < size:
                raise ValueError(f"{r}={rank} is not in [0, {s}={size})")
            if launcher == "openmpi" and all(env.get(k) == v for k, v in HOROVODRUN_OMPI.items()):
                launcher = "horovodrun"
            return LaunchInfo(launcher, rank, size, local)
    return LaunchInfo("none", 0, 1, 0)


_LAUNCH_FIXES = {
    "slurm": "srun started the tasks without wiring them into one MPI job: use `srun --mpi=pmix` "
             "(Open MPI built with PMIx; `srun --mpi=list` shows the plugins your site has) or run "
             "`mpirun` inside the allocation",
    "openmpi": "mpirun started the processes but Horovod did not join them: check that Horovod was "
               "built with MPI (`horovodrun --check-build`) and that HOROVOD_CONTROLLER is not set "
               "to gloo without horovodrun",
    "horovodrun": "horovodrun started the processes over mpirun but Horovod did not join them: check that "
                  "Horovod was built with MPI (`horovodrun --check-build`), or run `horovodrun --gloo`",
    "mpich": "the MPI launcher (Hydra/PMI) differs from the MPI library Horovod loads: launch with "
             "the mpirun of the MPI that Horovod and mpi4py were built against",
    "horovod-gloo": "horovodrun started the processes but Horovod initialised alone: do not set "
                    "HOROVOD_CONTROLLER/HOROVOD_CPU_OPERATIONS by hand under horovodrun",
    "torchrun": "torchrun starts torch.distributed ranks, which Horovod does not join: launch the Horovod "
                "front-end with mpirun or horovodrun, or under torchrun use the DDP front-end "
                "(hvdcomp.ddp.register; train_lm.py --frontend ddp)",
    "env": "RANK/WORLD_SIZE describe a torch.distributed job, which Horovod does not join: launch the "
           "Horovod front-end with mpirun or horovodrun, or use the DDP front-end (hvdcomp.ddp.register)",
}


def check_launch(horovod_size: int, environ=None) -> None:
    """Refuse to train N independent copies: the launcher started several tasks, Horovod sees one.

    Args:
        horovod_size: ``hvd.size()`` after ``hvd.init()``.
        environ: the environment to read (``os.environ`` by default).

    Raises:
        RuntimeError: the launcher's variables (torchrun, SLURM, Open MPI, PMI, Horovod Gloo; see
            :func:`detect_launch`) give a job of N > 1 tasks but Horovod has one rank; the
            message names the launcher and the likely fix.
    """
    env = os.environ if environ is None else environ
    info = detect_launch(env)
    size = info.size
    if info.launcher == "slurm":  # the step's own task count (SLURM_NTASKS may be the allocation's)
        size = int(env.get("SLURM_STEP_NUM_TASKS", size))
    if size > 1 and horovod_size == 1:
        raise RuntimeError(f"the launcher ({info.launcher}) started {size} tasks but Horovod sees 1 "
                           f"rank, so each task would train its own copy of the model: "
                           f"{_LAUNCH_FIXES[info.launcher]}")


def select_device(prefer: str = "auto", local_rank: Optional[int] = None) -> torch.device:
    """The device this rank trains on: ``cuda:<local rank mod GPU count>`` when CUDA is available
    (``prefer="auto"`` or ``"cuda"``), else the CPU.

    Raises:
        RuntimeError: ``prefer="cuda"`` on a machine without a usable GPU.
        ValueError: unknown ``prefer``.
    """
    if prefer not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {prefer!r}")
    if prefer == "cpu" or (prefer == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no GPU "
                           "(check CUDA_VISIBLE_DEVICES and that a CUDA build of torch is installed)")
    if local_rank is None:
        local_rank = detect_launch().local_rank
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def abort_on_uncaught_exception() -> None:
    """Make an uncaught exception on any rank end the whole MPI job at once.

    Without this, ranks blocked in a collective wait for the failed rank until the launcher
    notices its exit (or forever, if the exception is raised in a thread). The hook prints the
    traceback with the rank, then calls ``MPI.COMM_WORLD.Abort(1)`` when more than one rank runs
    under an MPI launcher (:data:`MPI_LAUNCHERS`; under torchrun the process exits and torchrun's
    agent stops the others).
    Installs ``sys.excepthook`` and ``threading.excepthook``; idempotent.
    """
    if getattr(sys.excepthook, "_hvdcomp", False):
        return
    info = detect_launch()

    def hook(exc_type, exc, tb):
        sys.stderr.write(f"hvdcomp: rank {info.rank} of {info.size} failed; aborting the job:\n")
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        sys.stderr.flush()
        if info.size > 1 and info.launcher in MPI_LAUNCHERS:
            try:
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(1)
            except Exception:  # noqa: BLE001 - no MPI: the launcher ends the job when we exit
                pass
        os._exit(1)

    hook._hvdcomp = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    threading.excepthook = lambda args: hook(args.exc_type, args.exc_value, args.exc_traceback)
