"""What the compressed adaptive optimizers share: parameters and their names, the kinds of step,
checkpoints. The warm-up optimizer is :mod:`hvdcomp.adaptive_opt.warmup`'s; the collectives after
it (the compressed allreduce, the step agreement, the non-finite verdict) are
:mod:`hvdcomp.adaptive_opt.averaging`'s.

An optimizer here is a ``torch.optim.Optimizer`` that averages over the ranks by itself (do not
wrap it in :func:`hvdcomp.DistributedOptimizer`). Each step is one of these kinds
(:attr:`AdaptiveOptimizer.last_step_kind`): ``"warmup"`` (the warm-up optimizer's step through a
:func:`hvdcomp.DistributedOptimizer` with ``warmup_compression``), ``"full"`` (one float32
allreduce of the whole model at ``step()``), ``"onebit"`` (one compressed allreduce of the whole
model: :class:`hvdcomp.transports.twophase.TwoPhaseCompressor`, base ``efsignsgd``), ``"local"``
(no communication) or ``"sync"`` (a local step, then the update since the last synchronisation
averaged by a compressed allreduce); None: skipped.

State: ``state_dict()["state"]`` is torch's per-parameter state (shared by every rank, plus 0/1
Adam's per-rank buffers between synchronisations); ``state_dict()["hvdcomp"]`` the per-rank
residuals of each compressed allreduce and the warm-up compression's state. Resume recipes,
elastic Horovod and non-finite gradients (every averaged result is identical on every rank, so
the ranks skip or raise alike without an extra collective): ``docs/adaptive-optimizers.md``.
"""
from __future__ import annotations

import abc
import logging
from dataclasses import replace
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..agreement import NonFiniteGuard, check_consistency
from ..comm import resolve_group
from ..comm.group import FollowsWorld, instance_prefix
from ..comm.stepcomm import StepComm
from ..metrics import PhaseTimer
from ..plan import BATCHED, TransportPlan
from ..step import SkipSynchronize
from .averaging import ONEBIT_SPEC, Averaging
from .warmup import WarmupStage

__all__ = ["AdaptiveOptimizer", "named_groups", "check_masks", "ONEBIT_SPEC"]

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.float64)


def named_groups(named_parameters, frozen: Optional[List[str]] = None) -> Tuple[List[dict], Dict[torch.Tensor, str]]:
    """Parameter groups and parameter names from ``model.named_parameters()``, or from a list of
    group dicts whose ``"params"`` are ``(name, parameter)`` pairs (other keys: per-group
    hyper-parameters, as for any torch optimizer). The groups hold the parameters that require
    gradients; the names of those that do not are appended to ``frozen`` (when given).

    Raises:
        ValueError: not (name, parameter) pairs, repeated names or parameters, no parameters.
    """
    items = list(named_parameters)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    names: Dict[torch.Tensor, str] = {}
    out = []
    for g in groups:
        pairs = list(g.get("params", ()))
        if any(not isinstance(t, tuple) or len(t) != 2 or not isinstance(t[1], torch.Tensor) for t in pairs):
            raise ValueError("pass model.named_parameters() (or groups whose 'params' are (name, parameter) "
                             "pairs): the compressed allreduce keeps its residuals by parameter name")
        for n, p in pairs:
            if n in names.values() or p in names:
                raise ValueError(f"parameter {n!r} is named or listed twice")
            names[p] = n
            if not p.requires_grad and frozen is not None:
                frozen.append(n)
        out.append({**g, "params": [p for _, p in pairs if p.requires_grad]})
    if not names:
        raise ValueError("the optimizer got no parameters")
    return out, names


class AdaptiveOptimizer(SkipSynchronize, torch.optim.Optimizer, FollowsWorld, metaclass=abc.ABCMeta):
    """Base of the optimizers of :mod:`hvdcomp.adaptive_opt` (see the module docstring).

    Subclasses give :meth:`_init_state` (a parameter's fresh state), :attr:`warmup_steps`
    (leading warm-up steps, 0 for none), :meth:`_make_warmup` (the local warm-up optimizer) and
    :meth:`_step_after_warmup` (one step after the warm-up).

    Args:
        named_parameters: see :func:`named_groups`.
        defaults: the hyper-parameters of every group (``lr``, ``betas``, ...).
        process_set: where to average: a Horovod process set, or a ``torch.distributed`` process
            group; by default the whole job, through Horovod after ``hvd.init()`` or through
            ``torch.distributed`` after ``init_process_group`` (:func:`hvdcomp.comm.resolve_group`).
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (one is made by default), shared with the
            warm-up optimizer: seconds per phase and bytes sent, received and ``dense`` (4 bytes
            per parameter and step: what an fp32 allreduce would carry).
        nonfinite: ``"skip"`` (default), ``"raise"`` or ``"ignore"`` (no check).
        warmup_compression: the warm-up's :func:`hvdcomp.DistributedOptimizer` compression (a spec).
        backward_passes_per_step: must be 1.
        comm: the collectives of the steps after the warm-up, a
            :class:`hvdcomp.comm.stepcomm.StepComm` (with point-to-point messages where it has more
            than one rank); default: Horovod's within ``process_set``, with an MPI duplicate of
            its communicator.
        momentum_masks: ``{parameter name: tensor of 0/1}`` (:func:`check_masks`; see
            :meth:`momentum_mask`), or None.

    Raises:
        ValueError: ``backward_passes_per_step != 1``, an unknown ``nonfinite``, a bad
            ``momentum_masks`` (:func:`check_masks`), parameters that are not float32/float64 or
            have ``requires_grad=False``, ranks that disagree on the set-up (on every rank,
            naming the difference).
        RuntimeError: Horovod is not initialised (without ``comm``), the launcher started several
            tasks that Horovod does not join (``torchrun``: :func:`hvdcomp.launch.start_frontend`),
            this process is outside ``process_set``, or a job of several ranks without MPI
            point-to-point messages (``horovodrun --gloo``).
    """

    #: leading steps run by the warm-up optimizer (set by subclasses)
    warmup_steps = 0
    #: mask coordinates whose variance is exactly 0 (:meth:`momentum_mask`)
    mask_zero_variance = True

    def __init__(self, named_parameters, defaults: dict, *, process_set=None, timer: Optional[PhaseTimer] = None,
                 nonfinite: str = "skip", warmup_compression: str = "none", backward_passes_per_step: int = 1,
                 comm: Optional[StepComm] = None, momentum_masks: Optional[Dict[str, torch.Tensor]] = None):
        if backward_passes_per_step != 1:
            raise ValueError(f"{type(self).__name__} averages the momentum once per step() and does not "
                             "accumulate: use backward_passes_per_step=1 (to accumulate, run several "
                             "backward passes and call step() once; the gradients add up in p.grad)")
        NonFiniteGuard(nonfinite)  # (refuses an unknown mode)
        self._frozen: List[str] = []
        groups, self._names = named_groups(named_parameters, self._frozen)
        super().__init__(groups, defaults)
        for i, group in enumerate(self.param_groups):  # (torch.optim checks none of a group's own settings)
            self._check_group(group, i)
        bad = [n for p, n in self._names.items() if p.dtype not in _FLOATS]
        if bad:
            raise ValueError(f"{type(self).__name__} keeps its moments in the parameters' dtype: train with "
                             f"float32 (or float64) parameters (autocast for half-precision compute); "
                             f"not float32/float64: {bad[:5]}")
        self.order = [p for g in self.param_groups for p in g["params"]]  # the same on every rank
        if self.warmup_steps:  # the warm-up optimizer's group keys, now: every rank's groups then hold
            self._make_warmup()  # the same keys whether or not it ran (hvd.broadcast_optimizer_state)
        self.nonfinite, self.warmup_compression = nonfinite, warmup_compression
        self.process_set = process_set
        self.timer = timer if timer is not None else PhaseTimer()
        self.skipped_steps, self.last_step_kind = 0, None
        self._prefix = instance_prefix("adaptive")
        self.warmup = WarmupStage(self)
        self._masks = {}
        self.group = None if comm is not None else resolve_group(
            process_set, frontend=f"hvdcomp.adaptive_opt.{type(self).__name__}")
        if self.group is not None and not self.group.included:
            raise RuntimeError(f"this process is not in process_set: build {type(self).__name__} on its "
                               "members only")
        # under elastic Horovod (only front-ends of hvdcomp.launch.ELASTIC_FRONTENDS get here) nothing
        # collective runs now: a new worker builds its optimizer while the others are in Horovod's
        # reset broadcasts; every rank joins the world at its first step (:meth:`_join_world`)
        self._init_world(self.group, type(self).__name__)
        self.comm = comm if comm is not None else self._group_comm()
        self.averaging = Averaging(self)
        for p in self.order:
            self.state[p].update(self._init_state(p))  # never empty: hvd.broadcast_optimizer_state
            # then broadcasts it instead of stepping the fresh ranks alone
        if self.group is not None and self.group.size > 1 and not self._elastic:
            check_consistency(self.group, self._signature(), f"{self._prefix}.consistency")
        if self._frozen:  # (after the set-up check: every rank raises alike)
            raise ValueError(f"{type(self).__name__} fixes the parameters it trains at construction (and later "
                             "freezes their variance), so a parameter unfrozen afterwards could never train; "
                             f"{self._frozen[:5]} have requires_grad=False. Pass the trainable ones only: "
                             "[(n, p) for n, p in model.named_parameters() if p.requires_grad]")
        self.user_masks = check_masks(momentum_masks, self._names.values(),  # by name (1: keep, 0: drop)
                                      {n: p.shape for p, n in self._names.items()})
        self._built = True
        self._plan = TransportPlan({self._names[p]: BATCHED for p in self.order}, collective="alltoall+allgather",
                                   ranks=self.group.ranks if self.group is not None else list(range(self.comm.size)))

    # ---- what subclasses give -------------------------------------------------------------------
    @abc.abstractmethod
    def _init_state(self, p: torch.Tensor) -> dict:
        """A fresh per-parameter state (with ``step``: a 0-d float tensor, as torch's Adam keeps)."""

    def _make_warmup(self) -> torch.optim.Optimizer:
        """The local warm-up optimizer over ``self.param_groups`` (only where :attr:`warmup_steps`)."""
        raise TypeError(f"{type(self).__name__} has no warm-up")

    @abc.abstractmethod
    def _step_after_warmup(self, t: int, grads: List[torch.Tensor]) -> Optional[str]:
        """Step ``t + 1`` after the warm-up with this rank's gradients (``grads``, one per
        parameter of :attr:`order`, zeros where ``p.grad`` is None); returns the step's kind, or
        None where it was skipped (non-finite)."""

    #: settings that are the optimizer's, not a parameter group's (named in the refusal)
    OPTIMIZER_WIDE = ("freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler",
                      "local_step_clipper", "bias_correction", "schedule", "coeff_beta", "factor_max", "factor_min",
                      "factor_threshold", "mask_zero_variance", "momentum_averaging", "momentum_masks")

    def _check_group(self, group: dict, index: int) -> None:
        """A parameter group's own settings: only the optimizer's per-group hyper-parameters
        (``defaults``' keys), each in its range (:meth:`_check_hyper`). Called for every group
        at construction, before anything is built.

        Raises:
            ValueError: a key the optimizer does not read per group (e.g. ``freeze_step``, which
                would be ignored), or a value out of range, naming the group.
        """
        where = f" (parameter group {index})"
        unknown = sorted(set(group) - set(self.defaults) - {"params", "name"})
        if unknown:
            wide = [k for k in unknown if k in self.OPTIMIZER_WIDE]
            raise ValueError(f"parameter group {index} sets {unknown}, which {type(self).__name__} does not read per "
                             f"group (it would be ignored); per-group settings: {sorted(self.defaults)}"
                             + (f". {wide} are the optimizer's: pass them to {type(self).__name__}(...)" if wide else ""))
        self._check_hyper(group, where)

    def _check_hyper(self, group: dict, where: str) -> None:
        """The ranges of a group's hyper-parameters (Adam's, :func:`~hvdcomp.adaptive_opt.onebit_adam.check_adam_hyper`)."""
        from .onebit_adam import check_adam_hyper
        group.update(check_adam_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], where))

    def _hyper(self) -> dict:
        """Settings every rank must share (beyond ``defaults``), for the set-up check."""
        return {}

    # ---- set-up ---------------------------------------------------------------------------------
    def _group_comm(self) -> StepComm:
        group, p2p = self.group, None
        if group.size > 1:  # (under elastic Horovod, Horovod's collectives: HorovodGroup.point_to_point)
            p2p = group.point_to_point()
            if p2p is None:
                raise RuntimeError(f"{type(self).__name__}'s compressed allreduce exchanges chunks all-to-all: "
                                   "under Horovod through MPI, so launch with mpirun or horovodrun --mpi with "
                                   "mpi4py installed (or with torchrun, torch.distributed)")
        return group.step_comm(self.timer, self._prefix, p2p)

    def _signature(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"optimizer": type(self).__name__, "groups": repr(groups), "hyper": repr(self._hyper()),
                "frozen": self._frozen,
                "nonfinite": self.nonfinite, "warmup_compression": str(self.warmup_compression),
                "parameters": [(self._names[p], tuple(p.shape), str(p.dtype)) for p in self.order]}

    @property
    def compression(self):
        """The method averaging now: the warm-up's while it runs, else the compressed allreduce."""
        return self.warmup.optimizer.compression if self.warmup.running else self.averaging.reducer(self._reducer_keys[-1])

    @property
    def transport(self) -> TransportPlan:
        """How the gradients travel now (:class:`hvdcomp.plan.TransportPlan`)."""
        return self.warmup.optimizer.transport if self.warmup.running else self._plan

    def step_count(self) -> int:
        """Applied steps so far (the per-parameter ``step`` of torch's Adam state)."""
        return int(self.state[self.order[0]]["step"])

    # ---- one step -------------------------------------------------------------------------------
    def momentum_mask(self, p: torch.Tensor) -> torch.Tensor:
        """1 where ``p``'s variance is non-zero, 0 where it is exactly zero (no rank ever had a
        gradient there: 1 bit cannot send a zero, and the update would divide by ``eps``),
        times the user's mask for ``p`` where one was given (``momentum_masks``). Cached until
        the variance changes (:meth:`_variance_changed`)."""
        mask = self._masks.get(p)
        if mask is None:
            mask = ((self.state[p]["exp_avg_sq"] != 0) if self.mask_zero_variance
                    else torch.ones_like(p, dtype=torch.bool)).to(p.dtype)
            user = self.user_masks.get(self._names[p])
            if user is not None:
                mask = mask * user.to(device=p.device, dtype=p.dtype)
            self._masks[p] = mask
        return mask

    def _variance_changed(self) -> None:
        self._masks = {}

    def synchronize(self) -> None:
        """During the warm-up: average the gradients into ``p.grad`` (the warm-up optimizer's
        ``synchronize``). Afterwards nothing is averaged before ``step()``: ``p.grad`` stays
        this rank's gradient (clipping between ``synchronize()`` and ``step()`` clips it)."""
        self._follow_world()
        self.averaging.agree_step()
        if self.step_count() < self.warmup_steps:
            self.warmup.open().synchronize()

    def zero_grad(self, set_to_none: bool = True):
        """As torch's (during the warm-up, the warm-up optimizer's, which refuses while a
        backward's gradients are in flight)."""
        if self.warmup.running:
            return self.warmup.optimizer.zero_grad(set_to_none=set_to_none)
        return super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step, of the kind the schedule gives (:attr:`last_step_kind`: see the
        module docstring; None where the step was skipped). Returns None.

        Raises:
            ValueError: a ``closure`` (compute the loss and call ``backward()`` before ``step()``).
            TypeError: a sparse gradient.
            FloatingPointError: ``nonfinite="raise"`` and a non-finite averaged value.
            RuntimeError: ranks at different steps (first step after construction or loading).
        """
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step() takes no closure: compute the loss and call "
                             "backward() before step()")
        for p in self.order:  # (before anything is sent)
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError(f"{type(self).__name__} does not take sparse gradients "
                                f"({self._names[p]!r}): use nn.Embedding(sparse=False)")
        self._follow_world()
        self.averaging.agree_step()
        t = self.step_count()
        if t < self.warmup_steps:
            warm = self.warmup.open()
            if self._sync_on_step:
                warm.step()
            else:
                with warm.skip_synchronize():
                    warm.step()
            kind = "warmup" if self.step_count() > t else None
            if kind is None:
                self.skipped_steps += 1
            elif self.step_count() >= self.warmup_steps:
                self.warmup.close()
                self._variance_changed()
                log.info("%s: warm-up done after %d steps", type(self).__name__, t + 1)
        else:
            if self.warmup.running:
                self.warmup.abandon(self.order)
            kind = self._step_after_warmup(t, [torch.zeros_like(p) if p.grad is None else p.grad for p in self.order])
            self.timer.add_bytes(dense=4 * sum(p.numel() for p in self.order))
        self.last_step_kind = kind

    # ---- elastic Horovod --------------------------------------------------------------------------
    def _world_group(self):
        return self.group

    def _resize(self, group) -> None:
        self.group = group
        self.comm = self._group_comm()
        if self.warmup.running:
            self.warmup.optimizer.reset()
        self._plan = replace(self._plan, ranks=self.group.ranks)
        self.averaging.agreed = False

    def _join_world(self) -> None:
        """The first step of a (re)started world, on every rank alike: the set-up agreement
        (collective), then every compressed allreduce bound to the new size
        (:meth:`hvdcomp.adaptive_opt.averaging.Averaging.rejoin`); the step
        agreement follows (:meth:`hvdcomp.adaptive_opt.averaging.Averaging.agree_step`)."""
        if self.group.size > 1:
            check_consistency(self.group, self._signature(), f"{self._prefix}.consistency")
        self.averaging.rejoin()
        self._joining = False

    def each(self):
        """``(parameter, its group)`` in :attr:`order`."""
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def _advance(self) -> None:
        """Count one applied step on every parameter."""
        for p in self.order:
            self.state[p]["step"] += 1

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self):
        """torch's state (shared and 0/1 Adam's per-rank buffers) plus, under ``"hvdcomp"``, the
        per-rank residuals of every compressed allreduce and the warm-up compression's state:
        tensors, numbers and strings only (see the module docstring for the resume recipes)."""
        sd = super().state_dict()
        sd["hvdcomp"] = {"reducers": {k: r.state_dict() for k, r in self.averaging.reducers.items()},
                         "warmup": self.warmup.state_dict(), "skipped_steps": self.skipped_steps}
        return sd

    def load_state_dict(self, state_dict):
        """Inverse of :meth:`state_dict` (a checkpoint of the same optimizer class and settings);
        load into a freshly built optimizer for an exact resume.

        Raises:
            ValueError: the checkpoint holds state of an unknown compressed allreduce.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdcomp", {"reducers": {}, "warmup": {}, "skipped_steps": 0})
        unknown = sorted(set(extra["reducers"]) - set(self._reducer_keys))
        if unknown:
            raise ValueError(f"checkpoint holds compressed-allreduce state {unknown} that "
                             f"{type(self).__name__} does not keep ({list(self._reducer_keys)}): "
                             "load a checkpoint of the same optimizer")
        super().load_state_dict(state_dict)  # (new group dicts and state: the warm-up shares them)
        for key in self._reducer_keys:
            self.averaging.reducer(key).load_state_dict(extra["reducers"].get(key, {}))
        self.warmup.load_state_dict(extra.get("warmup", {}))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.averaging.agreed = self.averaging.fresh = False
        self._variance_changed()

    #: the compressed allreduces the optimizer keeps (state_dict keys)
    _reducer_keys: Tuple[str, ...] = ("momentum",)

    def add_param_group(self, param_group) -> None:
        """Refused after construction (the parameter order and names are fixed).

        Raises:
            ValueError: after construction.
        """
        if getattr(self, "_built", False):
            raise ValueError(f"{type(self).__name__} fixes its parameters at construction: build a new one "
                             "with every group")
        super().add_param_group(param_group)

    def close(self) -> None:
        """Stop communicating (the warm-up optimizer's hooks and threads); call between steps on
        every rank, e.g. before building another optimizer in the same process."""
        self.warmup.close()


def check_masks(masks: Optional[Dict[str, torch.Tensor]], names: Iterable[str], shapes: Dict[str, torch.Size]):
    """The user's momentum masks, checked: known names, parameter shapes, values 0/1.

    Raises:
        ValueError: an unknown name, a wrong shape, values other than 0 and 1.
    """
    masks = dict(masks or {})
    names = set(names)
    for n, m in masks.items():
        if n not in names:
            raise ValueError(f"momentum_masks names {n!r}, which is not a parameter of the optimizer")
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(shapes[n]):
            raise ValueError(f"momentum_masks[{n!r}] must be a tensor of the parameter's shape {tuple(shapes[n])}")
        if bool(((m != 0) & (m != 1)).any()):
            raise ValueError(f"momentum_masks[{n!r}] must hold 0 (drop) and 1 (keep) only")
    return masks

