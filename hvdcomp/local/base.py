"""What every local-update method shares: H inner steps without communication, then the
pseudo-gradient Δ = θ_start − θ_local averaged by the hvdcomp pipeline and an outer step on θ_start.

The round, for a model with parameters θ (one rank's view; ``Δ̄`` is the average over ranks)::

    θ_local ← θ_start                           every rank starts the round from the same point
    H × inner.step()                            the user's torch.optim optimizer, no collective
    Δ = θ_start − θ_local                       (float32 for half-precision parameters)
    Δ̄ = mean over ranks of C(Δ + e)            any hvdcomp method C, with its error feedback e
    θ_start ← outer.step(θ_start, Δ̄)           e.g. SGD: θ_start − α·Δ̄
    θ_local ← θ_start

Δ travels through a :class:`hvdcomp.reducer.Reducer` over copies of θ_start whose ``.grad`` holds
Δ, for every registered method, step-wide ones included; the average stays in ``.grad`` for the
outer optimizer, a plain ``torch.optim`` optimizer over the same tensors.

A round whose Δ is non-finite on any rank is dropped on every rank (the pipeline's per-step
agreement, :mod:`hvdcomp.agreement`): no outer step, the method's staged state rolled back, the
mode's own state restored (:meth:`LocalUpdate._drop_round`), every rank restarts from θ_start and
clears the inner-optimizer state of each parameter whose state holds a NaN or Inf
(:meth:`LocalUpdate._restart`); ``skipped_rounds`` counts them. ``docs/local-update.md`` ("How Δ
travels") has the details and the memory each wrapper takes.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..agreement import check_consistency, check_same_start, digest
from ..checks import check_count, check_real
from ..comm import resolve_group
from ..comm.group import FollowsWorld, ProcessGroup, instance_prefix
from ..compressors.base import Compressor
from ..config import Settings, check_method, name_parameters
from ..memory import Wrapper
from ..metrics import PhaseTimer, RecordLog
from ..spec import resolve_compression
from ..reducer import Reducer, check_free, claim, release
from ..step import LocalOptimizerSurface
from .checkpoint import Checkpoints

__all__ = ["LocalUpdate", "check_carries_delta"]

log = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


def check_carries_delta(method, outer: torch.optim.Optimizer) -> None:
    """Refuse a method whose average is not an estimate of the mean pseudo-gradient: the one
    place that reads how a method's payloads combine.

    Raises:
        ValueError: a majority vote (``signsgd``: the aggregate is a sign in {−1, +1} per element,
            whatever Δ's size), or a method that applies momentum itself (DGC) with an outer
            optimizer that does too.
    """
    base = method
    while isinstance(base, Wrapper):
        base = base.inner
    if isinstance(base, Compressor) and base.majority_vote:
        raise ValueError(f"'{method.name}' averages by majority vote: its result is a sign per element, not "
                         "the mean pseudo-gradient (Δ's size is lost). Carry Δ with a method whose average "
                         "estimates the mean, e.g. 'none', 'fp16', 'topk:density=0.01' or 'efsignsgd'")
    check_method(method, outer, "tensor")


_OUTER_LR_HINT = " (1.0 with momentum 0 is plain averaging of the ranks' parameters)"

#: the pipeline's settings a local-update wrapper sets itself (not passed through)
_SET_BY_WRAPPER = ("hvd", "timer", "backward_passes_per_step")


def _pipeline_arguments() -> List[str]:
    """What ``**pipeline`` may hold: the Reducer's settings (:meth:`hvdcomp.config.Settings.validate`)
    less those the wrapper sets, and ``process_group`` (a ``torch.distributed`` group)."""
    return [n for n in inspect.signature(Settings.validate).parameters if n not in _SET_BY_WRAPPER] + ["process_group"]


def check_pipeline_arguments(cls, pipeline: Dict[str, Any]) -> None:
    """Refuse keyword arguments that neither the wrapper nor the pipeline takes, before anything is
    built, naming the close matches and the accepted ones.

    Raises:
        ValueError: an unknown argument.
    """
    pipe = _pipeline_arguments()
    unknown = [k for k in pipeline if k not in pipe]
    if not unknown:
        return
    accepted: List[str] = []  # the keyword arguments of the constructors along the MRO, then the pipeline's
    for init in (k.__dict__["__init__"] for k in cls.__mro__[:-1] if "__init__" in k.__dict__):
        accepted += [p.name for p in inspect.signature(init).parameters.values() if p.name not in accepted
                     and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                     and p.name not in ("self", "optimizer", "named_parameters")]
    accepted += [n for n in pipe if n not in accepted]
    near = {k: difflib.get_close_matches(k, accepted, n=2, cutoff=0.5) for k in unknown}
    hints = "; ".join(f"{k!r}: did you mean {' or '.join(map(repr, m))}?" for k, m in near.items() if m)
    inner = [k for k in unknown if k in ("lr", "momentum", "weight_decay", "betas", "eps")]
    raise ValueError(f"{cls.__name__} got unknown argument(s) {unknown}" + (f" ({hints})" if hints else "")
                     + (f"; {inner} set the inner optimizer: give them to it (e.g. torch.optim.SGD(params, "
                        f"lr=0.1)), or the outer_* arguments for the outer step" if inner else "")
                     + f". Accepted: {accepted}")


def _plain(value):
    """``value`` as numbers, strings, None, lists and dicts (for comparing settings across ranks)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return type(value).__name__


def _flat(settings: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested settings as one level of dotted keys (``outer.param_groups.0.lr``), so that a
    difference is named by its key; ``parameters`` stays a list."""
    out: Dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if key != "parameters" and isinstance(value, dict):
            out.update(_flat(value, name + "."))
        elif key != "parameters" and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                out.update(_flat(v, f"{name}.{i}."))
        else:
            out[name] = value
    return out


def optimizer_settings(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """An optimizer's class and every parameter group's settings (all but ``params``), as plain
    values: what ranks must share of an optimizer that updates the shared parameters."""
    return {"class": type(optimizer).__name__,
            "param_groups": [{k: _plain(v) for k, v in sorted(g.items()) if k != "params"}
                             for g in optimizer.param_groups]}


class LocalUpdate(Checkpoints, FollowsWorld, LocalOptimizerSurface):
    """Base of the local-update wrappers (:class:`hvdcomp.local.DiLoCo`, ``SparseLoCo``, ``CO2``,
    ``LocalAdaAlter``): see the module docstring for the round.

    Args:
        optimizer: the inner optimizer, any ``torch.optim.Optimizer`` over the model's parameters;
            it runs every step with no communication.
        named_parameters: ``model.named_parameters()`` (names key the method's state; the same on
            every rank); parameters are named by position without it.
        local_steps: H ≥ 1, inner steps per round (``step()`` calls; a step a ``GradScaler`` skips
            is not counted).
        outer_optimizer: ``f(tensors) -> torch.optim.Optimizer`` over the copies of θ_start.
        compression: the method that carries Δ (an :class:`hvdcomp.Compressor`, a spec such as
            ``"topk:density=0.01"``, a step-wide method, or Horovod's ``hvd.Compression``).
        host_copy: keep θ_start and Δ in host memory (default: for CUDA parameters); the method
            then compresses on the host.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (new by default; ``.timer``): rounds charge
            ``outer`` (Δ, the outer step, copies) and the pipeline's phases to it.
        backward_passes_per_step: accepted for Horovod compatibility, only 1: accumulate by calling
            ``backward()`` several times before ``step()`` (H counts steps, not backward passes).
        chunk_size: split each Δ into consecutive chunks of this many elements, each compressed as
            its own tensor (SparseLoCo's top-k per chunk); None: one tensor per parameter.
        history_limit: round records kept in :attr:`history` (the most recent; default 1000,
            None: every one); older ones are rolled up (:class:`hvdcomp.metrics.RecordLog`), so
            :meth:`report` still covers every round while memory stays flat.
        **pipeline: further :func:`hvdcomp.DistributedOptimizer` arguments for the reduction of Δ
            (``process_set``, ``allgather``, ``cost_model``, ``bucket_bytes``, ``nonfinite``, ...).

    Raises:
        ValueError: ``local_steps`` not an integer ≥ 1, ``backward_passes_per_step`` ≠ 1, an outer
            learning rate that is not a finite number > 0, ``chunk_size`` < 1, a method that cannot
            carry Δ (:func:`check_carries_delta`), or anything :func:`hvdcomp.DistributedOptimizer`
            refuses: each raised before any collective. Then, on every rank: ranks that disagree
            on the set-up (H, ``chunk_size``, the outer optimizer's class and parameter-group
            settings, the wrapper and its own settings, the parameters), naming the differences
            (one object allgather; skipped with ``check_consistency=False``, as the pipeline's).
        RuntimeError: no process group (neither ``hvd.init()`` nor ``init_process_group`` ran), or
            the launcher started several tasks that the group does not join
            (:func:`hvdcomp.comm.resolve_group`, :func:`hvdcomp.launch.start_frontend`).
    """

    algorithm = "local"

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, *, local_steps: int,
                 outer_optimizer: Callable[[List[torch.Tensor]], torch.optim.Optimizer], compression="none",
                 host_copy: Optional[bool] = None, timer: Optional[PhaseTimer] = None,
                 backward_passes_per_step: int = 1, chunk_size: Optional[int] = None,
                 history_limit: Optional[int] = 1000, **pipeline):
        check_pipeline_arguments(type(self), pipeline)
        local_steps = check_count(local_steps, "local_steps (H, inner steps per round)", 1)
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step must be 1 with local-update training: no step "
                             "communicates, so accumulate locally by calling backward() several times before "
                             f"step() (local_steps counts step() calls); got {backward_passes_per_step!r}")
        if chunk_size is not None:
            chunk_size = check_count(chunk_size, "chunk_size", 1, " (elements), or None")
        self._rounds_log = RecordLog(history_limit)
        self.inner, self.local_steps, self.chunk_size = optimizer, local_steps, chunk_size
        self.prefix = instance_prefix("local")
        self.timer = timer if timer is not None else PhaseTimer()
        names = name_parameters(optimizer.param_groups, named_parameters)
        self._params = [(names[p], p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if host_copy is None:
            host_copy = any(p.is_cuda for _, p in self._params)
        with torch.no_grad():
            self._anchor = {n: p.detach().to(device="cpu" if host_copy else p.device, copy=True,
                                              dtype=torch.float32 if p.dtype in _HALF else p.dtype).requires_grad_()
                            for n, p in self._params}
        self._delta = {n: torch.zeros_like(a) for n, a in self._anchor.items()}
        self.outer = outer_optimizer(list(self._anchor.values()))
        for group in self.outer.param_groups:
            check_real(group.get("lr"), "the outer learning rate", lambda v: v > 0, "> 0 and finite", _OUTER_LR_HINT)
        method = resolve_compression(compression)
        check_carries_delta(method, self.outer)
        check_free(method)
        where = pipeline.pop("process_group", None)
        if where is not None and pipeline.get("process_set") is not None:
            raise ValueError("give process_set (Horovod) or process_group (torch.distributed), not both")
        group = resolve_group(where if where is not None else pipeline.get("process_set"),
                              frontend=f"hvdcomp.local.{type(self).__name__}")
        settings = Settings.validate(getattr(group, "hvd", None), timer=self._sync_timer(), **pipeline)
        # under elastic Horovod (only modes in hvdcomp.launch.ELASTIC_FRONTENDS get here) nothing
        # collective runs now: a new worker builds its optimizer during the others' reset
        self._init_world(group, f"hvdcomp.local.{type(self).__name__}")
        self._check = settings.check_consistency
        if settings.check_consistency and not self._elastic:
            self._check_setup(group)
        names_c, self._carriers, self._carrier_grads = self._make_carriers()
        order = self._carriers[::-1]  # (the expected backward order of one parameter group)
        self.sync = Reducer(order, dict(zip(self._carriers, names_c)), method, group, settings, self._sync_timer(),
                            self.prefix)
        claim(self.sync.compression, self)
        self.steps = self.round_step = self.rounds = self.skipped_rounds = 0
        self._closed = False
        self._started = False  # θ_start taken from the model (at the first step: after the user's broadcast)
        self._loaded = False  # a checkpoint was loaded: the ranks' counters are compared at the next step
        self._saved_size = 0  # the world size the loaded checkpoint was saved at (0: unknown)

    # ---- construction helpers ------------------------------------------------------------------
    def _setup(self) -> Dict[str, Any]:
        """What every rank must share (compared at construction by :meth:`_check_setup`): the
        wrapper and H, the chunking, the outer optimizer (class, every parameter-group setting),
        the mode's own settings (:meth:`_mode_setup`) and the parameters (names, shapes, dtypes).
        The method that carries Δ is the pipeline's to compare."""
        return {"wrapper": type(self).__name__, "local_steps": self.local_steps, "chunk_size": self.chunk_size,
                "outer": optimizer_settings(self.outer), **self._mode_setup(),
                "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._params]}

    def _mode_setup(self) -> Dict[str, Any]:
        """The mode's settings that every rank must share besides the outer optimizer's (none here)."""
        return {}

    def _check_setup(self, group: ProcessGroup) -> None:
        """Every rank must build the same wrapper (:meth:`_setup`); one object allgather, before
        the pipeline is built.

        Raises:
            ValueError: on every rank, naming the settings that differ and the ranks.
        """
        if group.size > 1:
            check_consistency(group, _flat(_plain(self._setup())), f"{self.prefix}.setup",
                              setup="the local-update set-up (build the same wrapper with the same local_steps, "
                                    "chunk_size, outer optimizer and settings on every rank)")

    def _make_carriers(self):
        """(names, tensors, their ``.grad``) the pipeline reduces: the copies of θ_start with Δ,
        or, with ``chunk_size``, views of them cut into chunks (no extra memory)."""
        names, carriers, grads = [], [], []
        for n, a in self._anchor.items():
            if self.chunk_size is None or a.numel() <= self.chunk_size:
                names.append(n)
                carriers.append(a)
                grads.append(self._delta[n])
                continue
            flat, dflat = a.detach().view(-1), self._delta[n].view(-1)
            for k, start in enumerate(range(0, a.numel(), self.chunk_size)):
                stop = min(start + self.chunk_size, a.numel())
                names.append(f"{n}#{k}")
                carriers.append(flat[start:stop].requires_grad_())
                grads.append(dflat[start:stop])
        return names, carriers, grads

    def _sync_timer(self) -> PhaseTimer:
        """The timer the reduction records into (the caller's thread: ``self.timer``)."""
        return self.timer

    # ---- torch.optim-like surface: LocalOptimizerSurface's over the inner optimizer, and these ------
    _local_optimizer = "inner"

    @property
    def anchors(self) -> Dict[str, torch.Tensor]:
        """θ_start by parameter name (float32 or the parameter's dtype; on the host with
        ``host_copy``): the parameters at the start of the round, that the outer step updates."""
        return dict(self._anchor)

    @property
    def pseudo_gradients(self) -> Dict[str, torch.Tensor]:
        """The send buffers of Δ = θ_start − θ_local by parameter name (the anchors' shapes and
        dtypes), written at each outer step; never the live parameters."""
        return dict(self._delta)

    @property
    def compression(self):
        """The method that carries Δ (the pipeline's, after ``transport="auto"``)."""
        return self.sync.compression

    @property
    def transport(self):
        """How Δ travels (:class:`hvdcomp.plan.TransportPlan`)."""
        return self.sync.transport

    def step(self, closure=None):
        """One inner step; after the H-th of a round, the round's reduction and outer step.

        Returns:
            What the inner optimizer's ``step`` returns (the closure's loss).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("this local-update optimizer was closed; build a new one to keep training")
        self._follow_world()
        if not self._started:
            self._start_training()
        loss = self.inner.step(closure)
        self.steps += 1
        self.round_step += 1
        if self.round_step >= self.local_steps:
            self._end_round()
        return loss

    def reset(self) -> None:
        """Follow elastic Horovod's reset (:meth:`hvdcomp.comm.group.FollowsWorld.reset`; register it
        on the ``hvd.elastic.TorchState(model=model, optimizer=inner)``): the pipeline is rebuilt
        over the new world (:meth:`hvdcomp.reducer.Reducer.resize`) and every rank joins it at its
        next step (:meth:`_join_world`); docs/robustness.md, "Elastic Horovod".

        Raises:
            ValueError: the mode runs on ``torch.distributed`` (elastic Horovod only).
            RuntimeError: after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("this local-update optimizer was closed; build a new one to keep training")
        super().reset()

    def _world_group(self) -> ProcessGroup:
        return self.sync.group

    def _resize(self, group) -> None:
        self.sync.resize(group)
        self.round_step = 0

    def _world_state(self) -> Any:
        """The mode's state that every rank takes from the holder when it joins a world
        (:meth:`_join_world`; picklable); None here."""
        return None

    def _load_world_state(self, state: Any) -> None:
        """Take the holder's :meth:`_world_state` (on every rank, the holder included, where the
        mode also drops what the round in progress changed)."""

    @torch.no_grad()
    def _join_world(self) -> None:
        """Elastic Horovod, the first step of a (re)started world, on every rank alike: the
        set-up agreement, then θ_start, the outer optimizer's state, the round counters and the
        mode's :meth:`_world_state` from the lowest-numbered rank that held them (rank 0 of a fresh
        job), and every rank restarts the round from θ_start."""
        group = self.sync.group
        if self._check:
            self._check_setup(group)
        holds = self._started or self._loaded  # (θ_start of a run, or of a checkpoint loaded)
        self._loaded = False
        if not holds:
            for n, p in self._params:
                self._anchor[n].copy_(p)
        if group.size > 1:
            held = group.allgather_object(holds, name=f"{self.prefix}.join")
            root = next((r for r, h in enumerate(held) if h), 0)
            for n, a in self._anchor.items():
                a.copy_(group.broadcast(a.detach().contiguous(), root, f"{self.prefix}.anchor.{n}"))
            mine = (self.outer.state_dict(), self.steps, self.rounds, self.skipped_rounds, self._world_state())
            outer, self.steps, self.rounds, self.skipped_rounds, mode = group.broadcast_object(
                mine if group.rank == root else None, root, f"{self.prefix}.outer")
            if group.rank != root:
                self.outer.load_state_dict(outer)
        else:
            mode = self._world_state()
        self._load_world_state(mode)
        for n, p in self._params:
            p.copy_(self._anchor[n])
        self.round_step, self._started, self._joining = 0, True, False

    def _start_training(self) -> None:
        """At the first step (of this optimizer, or after :meth:`load_state_dict`), on every rank:
        θ_start ← the model's parameters (``hvd.broadcast_parameters`` may have run after
        construction) unless a checkpoint was loaded, and every rank must start alike: the same
        θ_start, and after a load, every rank a checkpoint of the same step (one object allgather;
        a rank that failed mid-round leaves per-rank checkpoints of different steps). A resume at
        a larger world size runs :meth:`_resume_resized`.

        Raises:
            RuntimeError: on every rank, when the ranks' parameters differ.
            ValueError: on every rank, when some ranks loaded a checkpoint and others did not, or
                the checkpoints are of different steps or θ_start (naming each rank's step and
                the fix); after the job grew, unless they are of one round's end and the new ranks
                hold its θ_start.
        """
        loaded, self._loaded = self._loaded, False
        if not loaded:
            with torch.no_grad():
                for n, p in self._params:
                    self._anchor[n].copy_(p)
        self._started = True
        group = self.sync.group
        if group.size <= 1:
            return
        start = digest({n: a.detach() for n, a in self._anchor.items()})
        every = group.allgather_object((loaded, start, self._saved_size if loaded else 0,
                                        (self.steps, self.round_step, self.rounds)), name=f"{self.prefix}.start")
        if not all(e[0] for e in every) and {e[2] for e in every} - {0, group.size}:
            return self._resume_resized(every)  # (the job grew)
        if any(e[0] for e in every) and not all(e[0] for e in every):
            raise ValueError(f"rank(s) {[r for r, e in enumerate(every) if e[0]]} loaded a checkpoint and rank(s) "
                             f"{[r for r, e in enumerate(every) if not e[0]]} did not: load one on every rank "
                             "(opt.load_state_dict), or on one rank and then opt.broadcast_state(root_rank)")
        if loaded:
            counters = {"parameters": [], "steps": self.steps, "round_step": self.round_step, "rounds": self.rounds,
                        "theta_start": start[:12]}
            check_consistency(group, counters, f"{self.prefix}.loaded",
                              setup="the checkpoint each rank loaded (resume every rank from a checkpoint of the same "
                                    "step: save at a round's end, when opt.round_step == 0, or after "
                                    "torch.distributed.barrier() / hvd.join(), so that no rank saves a step another "
                                    "did not finish)")
        else:
            check_same_start([e[1] for e in every], "local-update training")

    def _resume_resized(self, every: List[tuple]) -> None:
        """A resume from per-rank checkpoints saved at a smaller world size (some ranks have none);
        ``every``: each rank's (loaded, θ_start digest, world size saved at, (steps, round step,
        rounds)). The checkpoints must be of the same round's end and a rank without one must
        hold their θ_start (it loaded rank 0's model); then every rank joins as under elastic
        Horovod (:meth:`_join_world`), taking the outer state and counters from the lowest rank
        that loaded.

        Raises:
            ValueError: on every rank, naming each rank's checkpoint and the fix, otherwise.
        """
        held = {r: e[1:] for r, e in enumerate(every) if e[0]}
        first = next(iter(held.values()))
        fresh = [r for r, e in enumerate(every) if not e[0]]
        if len(set(held.values())) > 1 or first[2][1] != 0 or any(every[r][1] != first[0] for r in fresh):
            ranks = [f"rank {r}: saved at {e[1]} ranks, step {e[2][0]}, round step {e[2][1]}" for r, e in held.items()]
            ranks += [f"rank {r}: no checkpoint, parameters {'==' if every[r][1] == first[0] else '!='} θ_start"
                      for r in fresh]
            raise ValueError(f"resuming at {len(every)} ranks from checkpoints saved at another world size needs "
                             "every checkpoint of the same round's end (save when opt.round_step == 0) and, on a "
                             "rank without its own, the model loaded from rank 0's checkpoint: " + "; ".join(ranks))
        self._started, self._loaded = False, every[self.sync.group.rank][0]
        self._join_world()

    # ---- the round -------------------------------------------------------------------------------
    def _end_round(self) -> None:
        """Δ, its reduction, the outer step (or the drop of the round), and the restart of every
        rank from θ_start."""
        with self.timer.phase("outer"), torch.no_grad():
            for n, p in self._params:  # Δ = θ_start − θ_local into the send buffers
                a = self._anchor[n]
                torch.sub(a, p.detach().to(a.device, a.dtype), out=self._delta[n])
        record = {"step": self.steps, "inner_steps": self.round_step, **self._reduce()}
        with self.timer.phase("outer"):
            if record["skipped"]:
                self._drop_round()
            else:
                self._outer_step()
            self._restart()
        self._close_round(record)
        self.round_step = 0

    def _reduce(self) -> Dict[str, Any]:
        """Average Δ over the ranks (the pipeline, in this thread); returns the round's record:
        bytes and seconds per phase it added to :attr:`timer`, and whether it was skipped."""
        before_s, before_b = dict(self.timer.seconds), self._bytes(self.timer)
        t0 = time.perf_counter()
        skipped = self._run_sync()
        record = {"wall_s": time.perf_counter() - t0, "skipped": skipped}
        record.update({f"{k}_s": v - before_s.get(k, 0.0) for k, v in self.timer.seconds.items()
                       if k in ("compress", "communicate", "decompress")})
        record.update({k: v - b for (k, v), b in zip(self._bytes(self.timer).items(), before_b.values())})
        return record

    def _load_carriers(self) -> None:
        """The send buffers into the ``.grad`` of the tensors the pipeline reduces."""
        for c, g in zip(self._carriers, self._carrier_grads):
            c.grad = g

    def _run_sync(self) -> bool:
        """The reduction of Δ over the carriers (:meth:`hvdcomp.reducer.Reducer.reduce`); True if
        the ranks skipped the round (a non-finite Δ somewhere)."""
        self._load_carriers()
        return not self.sync.reduce()

    @staticmethod
    def _bytes(timer: PhaseTimer) -> Dict[str, int]:
        return {"bytes_sent": timer.bytes_sent, "bytes_received": timer.bytes_received,
                "dense_bytes": timer.dense_bytes}

    def _outer_step(self) -> None:
        """The outer optimizer's step with the averaged Δ in ``.grad`` of the copies of θ_start."""
        for n, a in self._anchor.items():
            a.grad = self._delta[n]
        self.outer.step()

    def _drop_round(self) -> None:
        """The ranks dropped this round (a non-finite Δ somewhere; see the module docstring): no
        outer step, and what the mode changed besides the parameters goes back to the round's
        start. Nothing here; modes with such state override it (LocalAdaAlter, CO2)."""

    @torch.no_grad()
    def _restart(self) -> None:
        """θ_local ← θ_start on every rank, and this rank's inner-optimizer state that holds a
        NaN or Inf cleared (:meth:`_clear_nonfinite_inner_state`): every round ends here."""
        for n, p in self._params:
            p.copy_(self._anchor[n])
        self._clear_nonfinite_inner_state()

    @torch.no_grad()
    def _clear_nonfinite_inner_state(self) -> List[str]:
        """Clear the inner optimizer's whole state of each parameter where some floating-point
        tensor of it holds a NaN or Inf (this rank only; ``torch.optim`` re-creates it at the
        parameter's next step). Returns the names of the parameters cleared (a warning lists them)."""
        checked: Dict[torch.device, List] = {}  # device -> [(position, finite flag)]
        for i, (_, p) in enumerate(self._params):
            for t in (self.inner.state.get(p) or {}).values():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    checked.setdefault(t.device, []).append((i, t.isfinite().all()))
        bad = {i for rows in checked.values()
               for (i, _), ok in zip(rows, torch.stack([f for _, f in rows]).tolist()) if not ok}
        cleared = []
        for i in sorted(bad):
            name, p = self._params[i]
            del self.inner.state[p]
            cleared.append(name)
        if cleared:
            log.warning("hvdcomp.local: the inner optimizer's state of %s held NaN/Inf on this rank: cleared "
                        "(re-created at the next step); training restarts from the global parameters", cleared)
        return cleared

    def _close_round(self, record: Dict[str, Any]) -> None:
        """Count the round ``record`` describes (dropped where ``skipped``) and keep the record."""
        self.rounds += 1
        self.skipped_rounds += bool(record["skipped"])
        self._rounds_log.append({"round": self.rounds, **record})

    @property
    def history(self) -> List[Dict[str, Any]]:
        """The most recent round records, one per round (at most ``2·history_limit``; older ones
        are rolled up into :meth:`report`'s sums): ``round``, ``step``, ``inner_steps``,
        ``skipped``, ``wall_s``, the reduction's seconds per phase and its bytes."""
        return self._rounds_log.records

    def flush(self) -> None:
        """End the current round now (after fewer than H inner steps, if any were taken), so the
        model holds the global parameters; e.g. before the final evaluation. Collective: call it
        on every rank at the same step."""
        if self.round_step:
            self._end_round()

    # ---- the global model ------------------------------------------------------------------------
    @contextlib.contextmanager
    def global_parameters(self):
        """Inside the block the model holds θ_start (the same on every rank), e.g. to evaluate or
        save the global model mid-round; the local parameters come back on exit. Costs one
        temporary copy of the parameters."""
        with torch.no_grad():
            saved = [p.detach().clone() for _, p in self._params]
            for n, p in self._params:
                p.copy_(self._anchor[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), s in zip(self._params, saved):
                    p.copy_(s)

    # ---- description and instrumentation -----------------------------------------------------------
    def describe(self) -> Dict[str, Any]:
        """JSON-able description: algorithm, H, the outer optimizer and the method."""
        outer = {k: v for k, v in self.outer.defaults.items() if isinstance(v, (int, float, bool, str))}
        return {"algorithm": self.algorithm, "local_steps": self.local_steps, "chunk_size": self.chunk_size,
                "outer": {"class": type(self.outer).__name__, **outer}, "compression": self.compression.describe()}

    def report(self) -> Dict[str, float]:
        """Per-round and per-step figures of the rounds so far: bytes sent / received / dense
        (their fp32 size) per round and per inner step, seconds per round of each phase of the
        reduction, of the outer phase, and (CO2) of communication exposed and hidden behind the
        inner steps; the inner steps' ``compute`` seconds per step where :attr:`timer` recorded
        steps. Numbers only (same keys on every rank). Bytes of synchronous steps outside the
        rounds (Local AdaAlter's warm-up) are reported as ``warmup_<key>`` and counted in the
        per-step figures (and so in ``ratio_vs_dense_per_step``), not in the per-round ones."""
        history, steps, warmup = self._rounds_log, self.steps, self._warmup_traffic() or {}
        per, sums = max(1, steps), history.sums()
        out: Dict[str, float] = {"inner_steps": steps, "rounds": self.rounds, "local_steps": self.local_steps,
                                 "skipped_rounds": self.skipped_rounds}
        keys = set(sums) - {"round", "step", "inner_steps"}
        for k in sorted(keys | set(warmup)):
            total = sums.get(k, 0.0)
            out[f"{k}_per_round"] = total / max(1, len(history))
            out[f"{k}_per_step"] = (total + warmup.get(k, 0)) / per
        for k, v in warmup.items():
            out[f"warmup_{k}"] = v
        # fp32 bytes synchronous training sends per step / these
        if out.get("bytes_sent_per_step") and "dense_bytes_per_round" in out:
            out["ratio_vs_dense_per_step"] = out["dense_bytes_per_round"] / out["bytes_sent_per_step"]
        if self.timer.steps:  # (every step the timer recorded, rolled-up ones included)
            per_step = self.timer.totals()
            out["compute_s_per_step"] = per_step.get("compute", 0.0)
            out["outer_s_per_step"] = per_step.get("outer", 0.0)
        return out

    def _warmup_traffic(self) -> Optional[Dict[str, int]]:
        """Bytes sent and received by synchronous steps outside the rounds (none by default)."""
        return None

    def close(self) -> None:
        """Stop communicating (the pipeline's :meth:`close`); idempotent. Collective."""
        if not self._closed:
            self.sync.close()
            release(self.sync.compression, self)
            self._closed = True

