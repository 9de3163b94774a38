"""The batched transport: compressors that reduce every gradient of a step at once with their
own collectives (PowerSGD's two allreduces, global top-k's recursive doubling, CLT-k's leader
broadcast, the two-phase compressed allreduce), through :class:`hvdcomp.comm.step.StepComm`."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["BatchedTransport"]


class BatchedTransport:
    """Carries ``batched``-route compressors (``Compressor.batched``): nothing starts during
    backward; :meth:`finish` hands every ``(name, gradient)`` to ``compression.reduce_batch``.

    Args:
        timer: the optimizer's :class:`hvdcomp.metrics.PhaseTimer`.
        compression: the batched :class:`hvdcomp.Compressor`.
        step_comm: the collectives it may use (:class:`hvdcomp.comm.step.StepComm`).
        scale: the group size for ``op=Sum``, else 1 (``reduce_batch`` returns means).
    """

    busy = False  # never holds a step in progress between calls

    def __init__(self, timer, compression, step_comm, scale: float):
        self.timer, self.compression, self.step_comm, self.scale = timer, compression, step_comm, scale

    def reset(self) -> None:
        """Nothing to drop: a batched step runs within one call."""

    def finish(self, named_params: Sequence[Tuple[str, torch.nn.Parameter]]) -> None:
        """Reduce every gradient (``p.grad``, any shape and float dtype) and write the averaged
        result back into ``p.grad``; counts the fp32-equivalent dense bytes."""
        grads = self.compression.reduce_batch([(n, p.grad) for n, p in named_params], self.step_comm, self.timer)
        with self.timer.phase("decompress"):
            for (_, p), g in zip(named_params, grads):
                p.grad.copy_(g)
                if self.scale != 1.0:
                    p.grad.mul_(self.scale)
        for _, p in named_params:
            self.timer.add_bytes(dense=p.numel() * 4)
