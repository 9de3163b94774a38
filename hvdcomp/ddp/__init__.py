"""The DDP front-end: every hvdcomp method as a PyTorch ``DistributedDataParallel`` communication
hook, over ``torch.distributed`` (gloo, NCCL), launched by ``torchrun`` or ``srun``; no Horovod.

* :func:`register` (:mod:`hvdcomp.ddp.hook`): ``register(ddp_model, "topk:density=0.01",
  optimizer=opt)`` -> :class:`HookState`;
* :mod:`hvdcomp.ddp.layout`: what is compressed as one tensor inside a DDP bucket (``granularity``),
  and the model's parameter names and bucket layouts;
* :mod:`hvdcomp.ddp.cycle`: the step in progress (staged state, the ranks' agreement, commit or
  rollback);
* :mod:`hvdcomp.ddp.buckets`: the step's buckets, carried by the core's transports;
* :mod:`hvdcomp.ddp.runtime`: ``torch.distributed`` set-up from the launcher's environment.

See docs/ddp.md.
"""
from .hook import HookState, hvdcomp_hook, register
from .layout import BucketLayout, Unit, plan_bucket
from .runtime import init_process_group

__all__ = ["register", "HookState", "hvdcomp_hook", "plan_bucket", "BucketLayout", "Unit", "init_process_group"]
