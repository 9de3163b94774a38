"""``torch.distributed`` set-up for the DDP front-end, from the launcher's environment, and the
few Horovod-style calls a training script makes, so one script runs under either front-end.

Launchers (:func:`launch_info`): ``torchrun``, or any launcher that sets ``torch.distributed``'s
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; SLURM ``srun``
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``; the rendezvous host is the step's
first node), and the others :func:`hvdcomp.launch.detect_launch` knows (``mpirun``: set
``MASTER_ADDR`` when the ranks span several hosts). A plain ``python`` start is a job of one rank.
The launcher's name is :func:`~hvdcomp.launch.detect_launch`'s (what results files record).
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ..comm.retain import retain
from ..comm.torchdist import TorchDistGroup
from ..launch import LaunchInfo, detect_launch

__all__ = ["DistLaunch", "launch_info", "init_process_group", "TorchDistCollectives", "DEFAULT_PORT"]

DEFAULT_PORT = 29500  # torchrun's default rendezvous port


@dataclass
class DistLaunch(LaunchInfo):
    """Where this process sits in the job (:class:`hvdcomp.launch.LaunchInfo`), and where the
    ranks meet.

    Attributes:
        launcher: :func:`hvdcomp.launch.detect_launch`'s name: ``"torchrun"``, ``"slurm"``,
            ``"openmpi"``, ``"env"`` (``RANK``/``WORLD_SIZE`` set by another launcher), ... or
            ``"none"`` (one rank).
        rank, size, local_rank: this process's global rank, the world size, its rank on its node.
        master_addr, master_port: the rendezvous host and TCP port (rank 0 listens there).
    """

    master_addr: str
    master_port: int


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``n[1-4],m7`` -> ``n1``): ``scontrol show hostnames``
    where SLURM's tools are on PATH, else the list's first entry expanded by hand."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}: set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launch_info(environ=None) -> DistLaunch:
    """Rank, world size, local rank and rendezvous address from the launcher's environment.

    ``MASTER_ADDR`` / ``MASTER_PORT`` always win where set. Otherwise: under ``srun`` the step's
    first node (``SLURM_LAUNCH_NODE_IPADDR`` where that name does not resolve) and port
    ``20000 + job id mod 40000``; under another launcher whose ranks all run
    on one host, 127.0.0.1 and :data:`DEFAULT_PORT`.

    Raises:
        ValueError: inconsistent rank variables, or ranks on several hosts under a launcher other
            than torchrun/srun without ``MASTER_ADDR``.
    """
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    info = detect_launch(env)
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or any env:// launcher): its variables win
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        if not 0 <= rank < size:
            raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={size})")
        return DistLaunch(info.launcher, rank, size, int(env.get("LOCAL_RANK", 0)), addr or "127.0.0.1",
                          int(port or DEFAULT_PORT))
    size = info.size
    if info.launcher == "slurm":
        size = int(env.get("SLURM_STEP_NUM_TASKS", size))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        if addr is None:
            addr = _first_host(nodelist)
            try:
                socket.gethostbyname(addr)
            except OSError:  # a node name that does not resolve: the host srun was started on
                addr = env.get("SLURM_LAUNCH_NODE_IPADDR", addr)
        port = port or 20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 40000
    elif addr is None:
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("MPI_LOCALNRANKS", size)))
        if local != size:
            raise ValueError(f"{info.launcher} started {size} ranks on several hosts: set MASTER_ADDR to rank 0's "
                             "host (and MASTER_PORT) for torch.distributed, or launch with torchrun or srun")
        addr = "127.0.0.1"
    return DistLaunch(info.launcher, info.rank, size, info.local_rank, addr, int(port or DEFAULT_PORT))


def init_process_group(backend: Optional[str] = None, timeout_s: float = 1800.0, environ=None) -> DistLaunch:
    """``torch.distributed.init_process_group`` from the launcher's environment (:func:`launch_info`).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...; default NCCL when CUDA is available (and NCCL
            built in), else gloo.
        timeout_s: seconds a collective may wait before the job fails.
        environ: the environment to read (``os.environ`` by default).

    Returns:
        The :class:`DistLaunch` it used (already initialised: returns the current group's).

    Raises:
        ValueError: see :func:`launch_info`.
    """
    import torch.distributed as dist

    info = launch_info(environ)
    if dist.is_initialized():
        return info
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.launcher == "torchrun":  # its agent may serve the store: join it the standard way
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    elif info.size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                rank=info.rank, world_size=info.size, timeout=timeout)
    return info


class TorchDistCollectives:
    """The Horovod calls a training script makes outside the optimizer, over ``torch.distributed``
    (the default group): ``rank()``, ``size()``, ``local_rank()``, ``allreduce``,
    ``allgather_object``, ``broadcast_parameters`` (names as in ``horovod.torch``).

    Args:
        info: the :class:`DistLaunch` of :func:`init_process_group`.
    """

    Sum = "sum"
    Average = "average"

    def __init__(self, info: DistLaunch):
        import torch.distributed as dist

        self.dist, self.info = dist, info
        self.group = TorchDistGroup()  # the default group
        self.device = self.group.device

    def rank(self) -> int:
        return self.dist.get_rank()

    def size(self) -> int:
        return self.dist.get_world_size()

    def local_rank(self) -> int:
        return self.info.local_rank

    def allreduce(self, tensor: torch.Tensor, op: str = Average, name: Optional[str] = None) -> torch.Tensor:
        """The sum (``op=Sum``) or mean (default) of ``tensor`` over the ranks, as a new tensor
        (``name`` is accepted for Horovod compatibility and unused)."""
        out = tensor.detach().to(self.device, copy=True)
        retain(out)  # (held until gloo's worker lets go: hvdcomp/comm/retain.py)
        self.dist.all_reduce(out)
        if op == self.Average:
            out = out / self.size()
        return out.to(tensor.device)

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        return self.group.allgather_object(obj, name)

    def broadcast_parameters(self, params: Dict[str, torch.Tensor], root_rank: int = 0) -> None:
        """Overwrite ``params`` (a state dict) with rank ``root_rank``'s values, in place."""
        for _, value in sorted(params.items()):
            if isinstance(value, torch.Tensor):
                buf = value.detach().to(self.device)
                retain(buf)
                self.dist.broadcast(buf, src=root_rank)
                if buf.data_ptr() != value.data_ptr():
                    value.detach().copy_(buf)
