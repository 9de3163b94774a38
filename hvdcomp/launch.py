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
import shlex
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Dict, Optional

import torch

__all__ = ["LaunchInfo", "detect_launch", "launched_tasks", "check_launch", "check_frontend_launch",
           "start_frontend", "launch_fix", "select_device", "abort_on_uncaught_exception", "MPI_ENV", "recorded_env",
           "RUNTIMES", "ABORT_ENV", "elastic_launch", "ELASTIC_FRONTENDS"]


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


#: what a front-end's ranks must join: Horovod (``hvd.init()``: hvdcomp.DistributedOptimizer and the
#: modes built on it), an mpi4py world (``MPI.COMM_WORLD``: gossip's neighbour exchanges,
#: AB-training), or a torch.distributed process group (the DDP front-end)
RUNTIMES = ("horovod", "mpi", "torch.distributed")

#: why Horovod saw one rank although the launcher started several, by launcher
_HOROVOD_ALONE = {
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
}

#: each launcher as a user knows it (messages)
LAUNCHER_NAMES = {"torchrun": "torchrun", "horovodrun": "horovodrun", "horovod-gloo": "horovodrun --gloo",
                  "openmpi": "mpirun", "mpich": "mpirun (MPICH/Hydra)", "slurm": "srun",
                  "env": "a launcher that sets RANK/WORLD_SIZE", "none": "python"}

#: the Horovod front-end's name in messages (it alone has a DDP counterpart)
HOROVOD_FRONTEND = "the Horovod front-end (hvdcomp.DistributedOptimizer)"


#: the variable ``horovodrun`` sets in every worker of an elastic job (``--min-np``/``--max-np``/
#: ``--host-discovery-script``), where the world size may change while the job runs
ELASTIC_ENV = "HOROVOD_ELASTIC"

#: the front-ends that follow a world-size change under elastic Horovod (they rebuild what depends
#: on the size at Horovod's reset: docs/robustness.md, "Elastic Horovod"); every other one refuses
#: such a job at construction (:func:`check_frontend_launch`)
ELASTIC_FRONTENDS = (HOROVOD_FRONTEND, "hvdcomp.local.DiLoCo", "hvdcomp.local.SparseLoCo",
                     "hvdcomp.local.CO2", "hvdcomp.local.LocalAdaAlter", "hvdcomp.adaptive_opt.OneBitAdam",
                     "hvdcomp.adaptive_opt.ZeroOneAdam", "hvdcomp.adaptive_opt.OneBitLamb",
                     "hvdcomp.adaptive_opt.CompressedAMSGrad", "hvdcomp.gossip.GossipOptimizer")


def elastic_launch(environ=None) -> bool:
    """Whether this process is a worker of an elastic Horovod job (``horovodrun --min-np/--max-np
    /--host-discovery-script`` sets ``HOROVOD_ELASTIC=1``)."""
    env = os.environ if environ is None else environ
    return env.get(ELASTIC_ENV, "0").strip() == "1"


def _script() -> str:
    """This process's command line as a user would retype it (``python train.py --lr 0.1``)."""
    argv = [a for a in sys.argv if a] or ["train.py"]
    if argv[0] in ("-c", "-m"):
        argv = ["train.py"]
    return "python " + " ".join(shlex.quote(a) for a in argv)


def launch_fix(launcher: str, runtime: str, frontend: str, tasks: int) -> str:
    """The sentence that says why ``frontend`` (which runs on ``runtime``, one of
    :data:`RUNTIMES`) sees one rank when ``launcher`` started ``tasks`` tasks, and the command
    that would work."""
    cmd, name = _script(), LAUNCHER_NAMES.get(launcher, launcher)
    mpi = f"`mpirun -np {tasks} {cmd}` or `horovodrun -np {tasks} {cmd}`"
    if runtime == "torch.distributed":
        if launcher in ("torchrun", "env"):
            return ("the default process group has one rank: call torch.distributed.init_process_group(backend) "
                    "without rank= and world_size= (torchrun sets RANK and WORLD_SIZE), or "
                    "hvdcomp.ddp.init_process_group()")
        return (f"{name} started the processes but no torch.distributed process group joins them: call "
                f"hvdcomp.ddp.init_process_group() before DistributedDataParallel(model) (it reads {name}'s "
                f"rank variables), or launch with `torchrun --nproc_per_node {tasks} {cmd[len('python '):]}`")
    if launcher in ("torchrun", "env"):
        who = "torchrun" if launcher == "torchrun" else "RANK/WORLD_SIZE (set by the launcher)"
        fix = (f"{who} starts torch.distributed ranks, which Horovod and MPI do not join: launch {frontend} "
               f"with {mpi}")
        if frontend == HOROVOD_FRONTEND:
            fix += ", or under torchrun use the DDP front-end (hvdcomp.ddp.register; train_lm.py --frontend ddp)"
        return fix
    if runtime == "mpi":
        if launcher == "horovod-gloo":
            return (f"horovodrun --gloo starts no MPI job, and {frontend} exchanges through mpi4py: run "
                    f"`horovodrun -np {tasks} {cmd}` without --gloo, or `mpirun -np {tasks} {cmd}`")
        return (f"{name} started the processes but mpi4py's MPI world has one rank: build mpi4py against "
                f"the MPI of this mpirun (`python -c 'import mpi4py; print(mpi4py.get_config())'`) and launch "
                f"with `mpirun -np {tasks} {cmd}`")
    return _HOROVOD_ALONE[launcher]


def launched_tasks(environ=None) -> LaunchInfo:
    """:func:`detect_launch`, with ``size`` the number of tasks of this launch (under ``srun``
    the step's, ``SLURM_STEP_NUM_TASKS``, rather than the allocation's)."""
    env = os.environ if environ is None else environ
    info = detect_launch(env)
    if info.launcher == "slurm":
        info.size = int(env.get("SLURM_STEP_NUM_TASKS", info.size))
    return info


def check_frontend_launch(frontend: str, runtime: str, size: int, environ=None) -> LaunchInfo:
    """Refuse a launch that cannot work for ``frontend``: the launcher started N > 1 tasks but
    the runtime the front-end joins sees one rank (each task would train its own copy), e.g. the
    Horovod front-end under ``torchrun``.

    Args:
        frontend: the front-end's name, for the message (e.g. ``"hvdcomp.local.DiLoCo"``).
        runtime: what its ranks join, one of :data:`RUNTIMES`.
        size: the ranks that runtime sees (``hvd.size()``, ``MPI.COMM_WORLD.Get_size()``,
            ``torch.distributed.get_world_size()``; 1 where it is not initialised).
        environ: the environment to read (``os.environ`` by default).

    Under elastic Horovod (:func:`elastic_launch`), a front-end that cannot follow a change of the
    world size (not in :data:`ELASTIC_FRONTENDS`) is refused too, whatever the size.

    Returns:
        The launch (:func:`launched_tasks`).

    Raises:
        RuntimeError: naming the launcher, the task count, the front-end and the command that
            would work (:func:`launch_fix`); or, under elastic Horovod, naming the front-end and
            the two fixes (a fixed ``-np``, or a front-end that follows size changes).
        ValueError: an unknown ``runtime``.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    env = os.environ if environ is None else environ
    if elastic_launch(env) and frontend not in ELASTIC_FRONTENDS:
        supported = " or ".join(ELASTIC_FRONTENDS) or "none of hvdcomp's front-ends yet"
        raise RuntimeError(f"{frontend} cannot follow a change of the world size, and this job runs under elastic "
                           f"Horovod ({ELASTIC_ENV}=1: horovodrun with --min-np/--max-np/--host-discovery-script): "
                           f"launch with a fixed number of workers (`horovodrun -np N {_script()}`, without "
                           f"--min-np, --max-np and --host-discovery-script), or train with a front-end that "
                           f"follows size changes ({supported}; docs/robustness.md, \"Elastic Horovod\")")
    info = launched_tasks(env)
    if info.size > 1 and size == 1:
        seen = {"horovod": "Horovod", "mpi": "the MPI world (mpi4py)",
                "torch.distributed": "torch.distributed"}[runtime]
        raise RuntimeError(f"the launcher ({LAUNCHER_NAMES.get(info.launcher, info.launcher)}) started {info.size} "
                           f"tasks but {seen} sees 1 rank, "
                           f"so each task would train its own copy of the model with {frontend}: "
                           f"{launch_fix(info.launcher, runtime, frontend, info.size)}")
    return info


def check_launch(horovod_size: int, environ=None) -> None:
    """:func:`check_frontend_launch` for the Horovod front-end (``horovod_size``: ``hvd.size()``)."""
    check_frontend_launch(HOROVOD_FRONTEND, "horovod", horovod_size, environ)


def start_frontend(frontend: str, runtime: str, size: int, environ=None) -> LaunchInfo:
    """What every front-end does at construction, before any collective: refuse a launch that
    cannot work (:func:`check_frontend_launch`), then make an uncaught exception on this rank
    end the whole job (:func:`abort_on_uncaught_exception`) unless the environment sets
    ``HVDCOMP_ABORT_ON_EXCEPTION=0``. Idempotent; called by ``hvdcomp.DistributedOptimizer``,
    ``hvdcomp.ddp.register``, the modes of ``hvdcomp.local`` and ``hvdcomp.adaptive_opt``,
    ``hvdcomp.gossip.GossipOptimizer`` and ``hvdcomp.lowrank.ABTraining``.

    Args, Returns, Raises: as :func:`check_frontend_launch`.
    """
    env = os.environ if environ is None else environ
    info = check_frontend_launch(frontend, runtime, size, env)
    if env.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no", "off"):
        abort_on_uncaught_exception(env)
    return info


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


#: the environment variable that turns the front-ends' abort-on-exception off (``0``)
ABORT_ENV = "HVDCOMP_ABORT_ON_EXCEPTION"
_abort_hook = None  # the installed hook (once per process)


def _end_job(info: LaunchInfo) -> None:
    """End this rank so that the launcher ends the others: ``MPI_Abort`` on the world where MPI
    runs this job (mpirun, horovodrun over MPI, an MPI job under srun), else exit status 1
    without the interpreter's finalization (torchrun's agent then stops the other workers)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the job alive
            pass
    if info.size > 1 and info.launcher in MPI_LAUNCHERS:
        try:
            mpi = sys.modules.get("mpi4py.MPI")
            if mpi is None:  # Horovod may run MPI without mpi4py imported: join its MPI, never start one
                hvd = sys.modules.get("horovod.torch")
                if hvd is not None and hvd.is_initialized() and hvd.mpi_enabled() and hvd.mpi_built():
                    from mpi4py import MPI as mpi
            if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Abort(1)
        except Exception:  # noqa: BLE001 - no MPI to abort: the launcher ends the job when this rank exits
            pass
    os._exit(1)


def abort_on_uncaught_exception(environ=None) -> bool:
    """Make an uncaught exception on this rank end the whole job at once, instead of leaving the
    other ranks waiting in a collective for this one (under ``mpirun`` until an outside timeout:
    ``MPI_Finalize`` at this rank's exit waits for them too).

    Wraps ``sys.excepthook`` and ``threading.excepthook`` (``SystemExit`` in a thread excepted):
    a line naming the rank, the hook it replaced, then ``MPI_Abort`` where MPI runs the job
    (:data:`MPI_LAUNCHERS`), else exit status 1 without finalization (docs/robustness.md, "A
    failing rank"). Installed by the front-ends (:func:`start_frontend`), once per process, in a
    job of several ranks only. Returns whether the hook is installed.
    """
    global _abort_hook
    if _abort_hook is not None:
        return True
    info = launched_tasks(environ)
    if info.size <= 1:
        return False
    previous_sys, previous_thread = sys.excepthook, threading.excepthook
    header = (f"hvdcomp: rank {info.rank} of {info.size} ({LAUNCHER_NAMES.get(info.launcher, info.launcher)}) "
              f"failed with an uncaught exception; "
              f"ending the whole job ({ABORT_ENV}=0 leaves it to the launcher):\n")

    def hook(exc_type, exc, tb):
        try:
            sys.stderr.write(header)
            previous_sys(exc_type, exc, tb)
        except Exception:  # noqa: BLE001 - still end the job
            traceback.print_exception(exc_type, exc, tb)
        _end_job(info)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return previous_thread(args)
        try:
            sys.stderr.write(header.replace("exception;", f"exception in thread {getattr(args.thread, 'name', '?')};"))
            previous_thread(args)
        except Exception:  # noqa: BLE001
            traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
        _end_job(info)

    sys.excepthook, threading.excepthook = hook, thread_hook
    _abort_hook = hook
    return True
