"""How an optimizer's compressed gradients travel: one transport per route and module, one
interface (:class:`~hvdcomp.transports.base.Transport`: ``start(u)``, ``finish()``, ``busy``,
``reset``), each over a :class:`hvdcomp.comm.group.ProcessGroup`. Routes ``allreduce`` and
``decoded-allreduce``: :mod:`.allreduce`; ``allgather``: :mod:`.allgather`; ``batched`` (step-wide
methods): :mod:`.powersgd`, :mod:`.gtopk`, :mod:`.cltk`, :mod:`.twophase`; gossip's rounds:
:mod:`.neighbor`. The table, the DDP buckets and how to add a transport: docs/transports.md,
docs/architecture.md.
"""
from .base import Transport, Wiring
from .units import Units
from .allreduce import AllreduceTransport, DecodedAllreduceTransport
from .allgather import AllgatherTransport
from .stepwide import FlatStepMethod, SparseStepMethod, StepMethod, StepTransport
from .powersgd import PowerSGDCompressor
from .gtopk import GlobalTopKCompressor
from .cltk import CyclicLeaderTopKCompressor
from .twophase import TwoPhaseCompressor

__all__ = ["Transport", "Wiring", "Units", "AllreduceTransport", "DecodedAllreduceTransport",
           "AllgatherTransport", "StepMethod", "FlatStepMethod", "SparseStepMethod", "StepTransport",
           "PowerSGDCompressor", "GlobalTopKCompressor", "CyclicLeaderTopKCompressor", "TwoPhaseCompressor"]
