"""How an optimizer's compressed gradients travel: one transport per route and module, one
interface (:class:`~hvdcomp.transports.base.Transport`: ``start(u)``, ``finish()``, ``busy``,
``reset``), each over a :class:`hvdcomp.comm.group.ProcessGroup`; gossip's rounds travel by
:mod:`.neighbor`. docs/transports.md and docs/architecture.md say what each does and how to add one.

=====================  ==================================================  ============================
route                  transport                                           module
=====================  ==================================================  ============================
``allreduce``          Horovod ``allreduce_async`` of a ``MEAN`` or        :mod:`.allreduce`
                       ``SUM`` payload
``decoded-allreduce``  decode locally, Horovod dense fp32 allreduce        :mod:`.allreduce`
``allgather``          bucketed variable-size allgather, then aggregate    :mod:`.allgather`
``batched``            a step-wide method with its own collectives:        :mod:`.powersgd`,
                       PowerSGD, global top-k, CLT-k, two-phase            :mod:`.gtopk`, :mod:`.cltk`,
                                                                           :mod:`.twophase`
=====================  ==================================================  ============================
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
