"""What the launcher tells a process: rank, world size, local rank, and which device to use.

Read from the environment (no MPI call), so it works before ``hvd.init()`` and tells why a run
is single-process. Recognised launchers: Open MPI (``mpirun``/``horovodrun``), MPICH/Intel MPI
(Hydra: ``PMI_RANK``…), SLURM ``srun`` (``SLURM_PROCID``…), and Horovod's Gloo launcher
(``HOROVOD_RANK``…).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["LaunchInfo", "detect_launch", "check_launch", "select_device", "abort_on_uncaught_exception",
           "require_horovod", "HOROVOD_MISSING"]

#: what the Horovod front-end says where Horovod cannot be imported
HOROVOD_MISSING = ("hvdcomp.DistributedOptimizer is the Horovod front-end and needs Horovod, which is not "
                   "importable here ({error}). Build it with `make install` (scripts/install.sh; "
                   "HVDCOMP_HOROVOD=0 skips it), or use the DDP front-end, which needs no Horovod: "
                   "hvdcomp.ddp.register(DistributedDataParallel(model), 'topk:density=0.01', optimizer=opt) "
                   "(docs/ddp.md)")


def require_horovod():
    """``horovod.torch``, imported.

    Raises:
        ImportError: Horovod is not installed (or its extension does not load); the message names
            the two fixes (build it, or use :mod:`hvdcomp.ddp`).
    """
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ImportError(HOROVOD_MISSING.format(error=exc)) from exc
    return hvd

# (launcher, rank, size, local rank) variable names, most specific first
_SCHEMES = [
    ("horovod-gloo", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
]


@dataclass
class LaunchInfo:
    """``launcher`` is ``"none"`` for a plain ``python`` start (rank 0 of 1)."""

    launcher: str
    rank: int
    size: int
    local_rank: int


def detect_launch(environ=None) -> LaunchInfo:
    """Rank, world size and local rank from the launcher's environment variables.

    A SLURM allocation alone (``SLURM_PROCID`` without ``SLURM_STEP_ID``, i.e. the batch script
    itself) is not a parallel launch. MPICH's ``MPI_LOCALRANKID`` may be missing; then
    ``PMI_LOCAL_RANK`` is used, else 0.

    Raises:
        ValueError: a variable holds something other than an integer, or rank >= size.
    """
    env = os.environ if environ is None else environ
    for launcher, r, s, lr in _SCHEMES:
        if r in env and s in env:
            if launcher == "slurm" and "SLURM_STEP_ID" not in env:
                continue
            try:
                rank, size = int(env[r]), int(env[s])
                local = int(env.get(lr, env.get("PMI_LOCAL_RANK", 0)))
            except ValueError:
                raise ValueError(f"launcher variables {r}={env.get(r)!r} {s}={env.get(s)!r} are not integers") from None
            if not 0 <= rank < size:
                raise ValueError(f"{r}={rank} is not in [0, {s}={size})")
            return LaunchInfo(launcher, rank, size, local)
    return LaunchInfo("none", 0, 1, 0)


_LAUNCH_FIXES = {
    "slurm": "srun started the tasks without wiring them into one MPI job: use `srun --mpi=pmix` "
             "(Open MPI built with PMIx; `srun --mpi=list` shows the plugins your site has) or run "
             "`mpirun` inside the allocation",
    "openmpi": "mpirun started the processes but Horovod did not join them: check that Horovod was "
               "built with MPI (`horovodrun --check-build`) and that HOROVOD_CONTROLLER is not set "
               "to gloo without horovodrun",
    "mpich": "the MPI launcher (Hydra/PMI) differs from the MPI library Horovod loads: launch with "
             "the mpirun of the MPI that Horovod and mpi4py were built against",
    "horovod-gloo": "horovodrun started the processes but Horovod initialised alone: do not set "
                    "HOROVOD_CONTROLLER/HOROVOD_CPU_OPERATIONS by hand under horovodrun",
}


def check_launch(horovod_size: int, environ=None) -> None:
    """Refuse to train N independent copies: the launcher started several tasks, Horovod sees one.

    Args:
        horovod_size: ``hvd.size()`` after ``hvd.init()``.
        environ: the environment to read (``os.environ`` by default).

    Raises:
        RuntimeError: the launcher's variables (SLURM, Open MPI, PMI, Horovod Gloo; see
            :func:`detect_launch`) give a job of N > 1 tasks but Horovod has one rank; the
            message names the launcher, the variable and the likely fix.
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
    traceback with the rank, then calls ``MPI.COMM_WORLD.Abort(1)`` when more than one rank runs.
    Installs ``sys.excepthook`` and ``threading.excepthook``; idempotent.
    """
    import sys
    import threading
    import traceback

    if getattr(sys.excepthook, "_hvdcomp", False):
        return
    info = detect_launch()

    def hook(exc_type, exc, tb):
        sys.stderr.write(f"hvdcomp: rank {info.rank} of {info.size} failed; aborting the job:\n")
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        sys.stderr.flush()
        if info.size > 1:
            try:
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(1)
            except Exception:  # noqa: BLE001 - no MPI: the launcher ends the job when we exit
                pass
        os._exit(1)

    hook._hvdcomp = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    threading.excepthook = lambda args: hook(args.exc_type, args.exc_value, args.exc_traceback)
