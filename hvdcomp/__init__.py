"""hvdcomp: gradient compression for data-parallel PyTorch training on Horovod and MPI, and on
PyTorch DDP.

Entry points, re-exported here:

* :func:`DistributedOptimizer`: the Horovod front-end, in place of ``hvd.DistributedOptimizer``;
* :func:`get_compressor` (``"topk:density=0.01"`` → a method with its error feedback),
  :func:`parse_spec`, :func:`available` (the registered names);
* :class:`Compressor` and :func:`register`: a method of your own (``docs/adding-a-method.md``);
  :class:`ErrorFeedback`, the residual memory every method uses;
* :class:`PhaseTimer`: seconds per phase and bytes per step (``opt.timer``);
* :class:`Auto` (``compression="auto"``): the method chosen, and changed, from the measured link,
  compute and training phase (:mod:`hvdcomp.auto`).

The other front-ends and modes are subpackages: :mod:`hvdcomp.ddp` (a DDP communication hook),
:mod:`hvdcomp.local` (local updates: DiLoCo, ...), :mod:`hvdcomp.adaptive_opt` (1-bit Adam, ...),
:mod:`hvdcomp.gossip` (decentralized training), :mod:`hvdcomp.lowrank` (AB-training).
"""
from .compressors import Compressor, available, register
from .memory import ErrorFeedback
from .metrics import PhaseTimer
from .spec import get_compressor, parse_spec
from . import transports  # noqa: F401  (registers the transports and the step-wide methods)
from .optimizer import DistributedOptimizer
from .auto import Auto

__version__ = "0.1.0"
__all__ = ["Auto", "Compressor", "ErrorFeedback", "DistributedOptimizer", "PhaseTimer", "available",
           "get_compressor", "parse_spec", "register", "__version__"]
