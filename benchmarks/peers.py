"""The end-to-end benchmark's contenders other than hvdcomp (the *peers*), in one place.

Used by the driver (``netem_e2e.py``: what each contender's ``mpirun`` gets), the worker
(``e2e_lm.py``: which code path a contender runs, and a check that its launch settings arrived)
and the report (``mpi_scripts/report.py speed``: which contenders are stock Horovod, how they are named).

Peers:

* ``horovod:none`` / ``horovod:fp16``: stock ``hvd.DistributedOptimizer`` with
  ``hvd.Compression.none`` / ``hvd.Compression.fp16``, Open MPI's default allreduce algorithm;
* ``horovod-ring:none`` / ``horovod-ring:fp16``: the same, with Open MPI's ring allreduce forced
  (:data:`RING_ALLREDUCE_ENV`, given to that contender's ``mpirun`` only). Horovod's MPI controller
  reduces a fused buffer with ``MPI_Allreduce`` on a duplicate of ``MPI_COMM_WORLD``, so Open MPI's
  ``coll/tuned`` algorithm choice applies to it (checked with Open MPI's pml monitoring in
  ``tests/test_benchmarks.py``: with the setting, each rank sends its allreduce data to one
  neighbour only, float32 and float16 alike);
* ``ddp:none`` / ``ddp:fp16`` / ``ddp:powersgd``: PyTorch DDP on gloo (not affected by Open MPI
  settings).

hvdcomp itself runs as ``hvdcomp:<spec>`` (the Horovod front-end) or ``hvdcomp-ddp:<spec>`` (DDP
on gloo with hvdcomp's communication hook, :mod:`hvdcomp.ddp`; ``@bucket`` as for hvdcomp).
"""
from __future__ import annotations

from typing import Dict, Tuple

#: Open MPI MCA settings that force the ring allreduce (``coll_tuned`` algorithm 4; the forced
#: choice is honoured only with dynamic rules on). On the emulated 10 Mbit/s links this halves stock
#: Horovod's step on the medium LSTM (49.3 -> 24.6 s, issue 17).
RING_ALLREDUCE_ENV: Dict[str, str] = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
}

#: contender family -> (code path the worker runs, extra environment for that family's ranks)
FAMILIES: Dict[str, Tuple[str, Dict[str, str]]] = {
    "hvdcomp": ("hvdcomp", {}),
    "horovod": ("horovod", {}),
    "horovod-ring": ("horovod", RING_ALLREDUCE_ENV),
    "ddp": ("ddp", {}),
    "hvdcomp-ddp": ("hvdcomp-ddp", {}),
}

#: every peer, in report order
PEERS = ("horovod:none", "horovod:fp16", "horovod-ring:none", "horovod-ring:fp16",
         "ddp:none", "ddp:fp16", "ddp:powersgd")

#: stock Horovod's configurations: every "x faster than Horovod" is against the fastest of these
STOCK_HOROVOD = tuple(p for p in PEERS if FAMILIES[p.split(":", 1)[0]][0] == "horovod")

#: stock Horovod's uncompressed configurations
STOCK_HOROVOD_DENSE = tuple(p for p in STOCK_HOROVOD if p.endswith(":none"))


def split(contender: str) -> Tuple[str, str]:
    """``"horovod-ring:fp16"`` -> ``("horovod-ring", "fp16")``.

    Raises:
        ValueError: an unknown family, or an unknown peer variant (hvdcomp specs are not checked
        here; the worker validates them with :func:`hvdcomp.get_compressor`).
    """
    family, _, variant = contender.partition(":")
    if family not in FAMILIES:
        raise ValueError(f"unknown contender {contender!r}: use hvdcomp:<spec> or one of {', '.join(PEERS)}")
    if family not in ("hvdcomp", "hvdcomp-ddp") and contender not in PEERS:
        raise ValueError(f"unknown contender {contender!r}: use hvdcomp:<spec> or one of {', '.join(PEERS)}")
    return family, variant


def hvdcomp_options(variant: str) -> Tuple[str, Dict[str, str]]:
    """An hvdcomp contender's variant -> (compressor spec, extra DistributedOptimizer keywords):
    ``"topk:density=0.01@bucket"`` -> ``("topk:density=0.01", {"granularity": "bucket"})``;
    ``@unfused`` -> ``{"fuse_tensors": False}`` (per tensor, one call and one payload per
    gradient); ``@tensor`` or nothing: the defaults (per tensor, fused where the method can).

    Raises:
        ValueError: a suffix other than ``@tensor`` / ``@bucket`` / ``@unfused``.
    """
    spec, at, variant_name = variant.partition("@")
    options = {"tensor": {}, "bucket": {"granularity": "bucket"}, "unfused": {"fuse_tensors": False}}
    if at and variant_name not in options:
        raise ValueError(f"unknown variant {variant_name!r} in {variant!r}: use <spec>@bucket, "
                         "<spec>@unfused or <spec>@tensor")
    return spec, dict(options[variant_name]) if at else {}


def code_path(contender: str) -> str:
    """Which training path the worker runs: ``"hvdcomp"``, ``"horovod"``, ``"ddp"`` or
    ``"hvdcomp-ddp"``."""
    return FAMILIES[split(contender)[0]][0]


def launch_env(contender: str) -> Dict[str, str]:
    """Environment that this contender's ranks (and only its ranks) get on top of the shared one."""
    return dict(FAMILIES[split(contender)[0]][1])


def missing_launch_env(contender: str, env: Dict[str, str]) -> Dict[str, str]:
    """The contender's own settings (:func:`launch_env`) that ``env`` lacks or has with another value."""
    return {k: v for k, v in launch_env(contender).items() if env.get(k) != v}


def foreign_env_keys(contender: str) -> Tuple[str, ...]:
    """Variables some other family sets for its ranks but this contender must not see."""
    own = launch_env(contender)
    return tuple(sorted({k for _, env in FAMILIES.values() for k in env if k not in own}))


def label(contender: str) -> str:
    """Display name: ``"horovod-ring:fp16"`` -> ``"Horovod ring fp16"``."""
    for prefix, shown in (("hvdcomp-ddp:", "hvdcomp DDP "), ("hvdcomp:", "hvdcomp "), ("horovod-ring:", "Horovod ring "),
                          ("horovod:", "Horovod "), ("ddp:", "DDP ")):
        if contender.startswith(prefix):
            return shown + contender[len(prefix):]
    return contender
