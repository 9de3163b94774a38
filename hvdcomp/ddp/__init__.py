"""The DDP front-end: every hvdcomp method as a PyTorch ``DistributedDataParallel`` communication
hook over ``torch.distributed`` (gloo, NCCL), launched by ``torchrun`` or ``srun``; no Horovod.
``register(ddp_model, "topk:density=0.01", optimizer=opt)`` -> :class:`HookState`
(:mod:`~hvdcomp.ddp.hook`; bucket units: :mod:`~hvdcomp.ddp.layout`; the step:
:mod:`~hvdcomp.ddp.cycle`; the buckets' transport: :mod:`~hvdcomp.ddp.buckets`; set-up:
:mod:`~hvdcomp.ddp.runtime`). See docs/ddp.md.
"""
from .hook import HookState, hvdcomp_hook, register
from .layout import BucketLayout, Unit, plan_bucket
from .runtime import init_process_group

__all__ = ["register", "HookState", "hvdcomp_hook", "plan_bucket", "BucketLayout", "Unit", "init_process_group"]
