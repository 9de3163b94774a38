"""How an optimizer's compressed gradients travel: one transport per module, one interface.

:class:`hvdcomp.DistributedOptimizer` keeps the Horovod-style facade (hooks, ``synchronize``,
``step``, ``state_dict``); :mod:`hvdcomp.plan` gives each compression unit its route; the
transports here carry the units of one route each through the same small interface
(:class:`~hvdcomp.transports.base.Transport`):

- ``start(u)``: compress unit ``u`` (the method's ``encode``) and start its collective (from
  backward's hook, or from ``synchronize`` for the rest),
- ``finish()``: wait, and write each averaged result into its unit's target and ``p.grad``,
- ``busy`` (collectives in flight or payloads queued) and ``reset`` (drop a step in progress).

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

Every transport runs over a :class:`hvdcomp.comm.group.ProcessGroup` (Horovod's or
``torch.distributed``'s). The DDP front-end (:mod:`hvdcomp.ddp`) moves its buckets by these
transports too (:class:`hvdcomp.ddp.buckets.BucketTransport`: each DDP bucket appended as it
comes, ``Transport.add_bucket``, its units views of the bucket's buffer).

The decentralized front-end (:mod:`hvdcomp.gossip`) moves each rank's payload to its graph
neighbours only with :mod:`.neighbor`, a ``Transport`` too: its units are the gossip rounds of a
step (``start(r)`` asks the gossip method for round ``r``'s payload, ``finish()`` hands the
neighbours' payloads to the method), over the same group interface (point-to-point per edge on a
background thread, exact bytes, a timeout naming a silent neighbour).

Adding a transport is one new module here: a :class:`~hvdcomp.transports.base.Transport`
subclass, registered with the plan by :func:`hvdcomp.plan.register_route` (what it carries, what
it costs, how to build it) or :func:`hvdcomp.plan.register_step_route`, and imported below.
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
