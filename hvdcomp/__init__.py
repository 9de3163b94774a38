"""hvdcomp: gradient compression for data-parallel PyTorch training on Horovod and MPI.

Main entry points: :func:`get_compressor` (``"topk:density=0.01"``), :class:`Compressor`,
:class:`ErrorFeedback` and :func:`DistributedOptimizer` (the Horovod front-end).
"""
from .compressors import Compressor, available, register
from .memory import ErrorFeedback
from .metrics import PhaseTimer
from .spec import get_compressor, parse_spec
from . import transports  # noqa: F401  (registers the transports and the step-wide methods)
from .optimizer import DistributedOptimizer
from . import local  # noqa: F401,E402  (local-update training: hvdcomp.local)

__version__ = "0.1.0"
__all__ = ["Compressor", "ErrorFeedback", "DistributedOptimizer", "PhaseTimer", "available",
           "get_compressor", "parse_spec", "register", "__version__"]
