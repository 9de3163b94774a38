"""How an optimizer's compressed gradients travel: one transport per module.

:class:`hvdcomp.DistributedOptimizer` keeps the Horovod-style facade (hooks, ``synchronize``,
``step``, ``state_dict``); :mod:`hvdcomp.plan` decides each compression unit's route; the
transports here carry the payloads of one route each, with the same small interface:

- ``start`` a unit's payload (from backward's hook, or from ``synchronize`` for the rest),
- ``finish`` the step's collectives, writing each averaged result into its unit's target
  (:class:`Units`),
- ``busy`` (collectives in flight or payloads queued) and ``reset`` (drop a step in progress).

=====================  ==================================================  ============================
route                  transport                                           module
=====================  ==================================================  ============================
``allreduce``          Horovod ``allreduce_async`` of a summable payload   :mod:`.allreduce`
``decoded-allreduce``  decode locally, Horovod dense fp32 allreduce        :mod:`.allreduce`
``allgather``          bucketed variable-size allgather, then aggregate    :mod:`.allgather`
``batched``            the compressor's own step-wide collectives          :mod:`.batched`
                       (PowerSGD, global top-k, CLT-k, two-phase)
=====================  ==================================================  ============================

Adding a transport means one module here plus its route in :mod:`hvdcomp.plan`.
"""
from .allgather import AllgatherTransport
from .allreduce import AllreduceTransport
from .batched import BatchedTransport
from .units import Units

__all__ = ["Units", "AllreduceTransport", "AllgatherTransport", "BatchedTransport"]
