"""AB-training: each weight factorised as W = A·B, the small factor B trained inside rank groups.

Coquelin, Flügel, Weiel, Kiefer, Öz, Debus, Streit and Götz, "AB-Training: A
Communication-Efficient Approach for Distributed Low-Rank Learning", arXiv:2405.01067 (2024);
defaults from the authors' code. Stages over optimizer steps (:mod:`hvdcomp.lowrank.schedule`):
warm-up at full rank, an exact factorisation, then cycles of grouped steps (each rank group
averages the factor it trains), a sync over all ranks, full-rank steps and a cut
(σ_i > cutoff·σ_1). Factors: :mod:`hvdcomp.lowrank.factors` and :mod:`hvdcomp.lowrank.weights`;
bytes: :mod:`hvdcomp.lowrank.traffic` (mpi4py on a duplicate of the process set's communicator
and ``Split`` sub-communicators per rank group). The stages, modes and options: docs/ab-training.md.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..checks import check_bool, check_choice, check_count, check_optional, check_range
from ..comm.group import HorovodGroup
from ..comm.torchdist import TorchDistGroup
from ..launch import start_frontend
from ..metrics import PhaseTimer
from ..step import SkipSynchronize
from .factors import factorize, kept_rank, matrix_view, model_compression, unit_singular_values_
from .layout import RankLayout, node_of_ranks
from .schedule import STAGES, Rebound, Schedule
from .traffic import RenamedKeys, Traffic, traffic_summary
from .weights import FactorizedWeight, factorizable

# the helpers lived here before the split; hvdcomp.lowrank exports them from their own modules
__all__ = ["ABTraining", "factorize", "kept_rank", "matrix_view", "model_compression", "traffic_summary",
           "unit_singular_values_"]

MODES = {"only-b": ("b", "full"), "ab": ("full", "with-stale", "only-learned")}


def _check(cutoff, mode, sync, orientation, scope, unfactorized_sync, ranks_per_node, rank_groups, comm,
           process_set) -> Tuple[str, str, str]:
    """Validate ABTraining's arguments; returns (sync, unfactorized_scope, unfactorized_sync)
    with the defaults filled in and the deprecated scope spelling ``"group"`` mapped."""
    check_range(cutoff, "cutoff", 0.0, 1.0, high_open=True, hint=" (e.g. 0.15)")
    check_choice(mode, "mode", tuple(MODES))
    sync = MODES[mode][0] if sync is None else sync
    if sync not in MODES[mode]:
        raise ValueError(f"sync={sync!r} does not fit mode={mode!r}: choose one of {list(MODES[mode])}")
    check_choice(orientation, "orientation", ("tall", "rows"), " ('tall': B the small factor)")
    if scope == "group":
        _deprecated("unfactorized_scope='group'", "unfactorized_scope='rank-group'", 4)
        scope = "rank-group"
    if scope not in ("rank-group", "world"):
        raise ValueError(f"unfactorized_scope must be 'rank-group' or 'world', got {scope!r}")
    unfactorized_sync = unfactorized_sync or ("broadcast" if mode == "only-b" else "average")
    if unfactorized_sync not in ("broadcast", "average"):
        raise ValueError(f"unfactorized_sync must be 'broadcast' or 'average', got {unfactorized_sync!r}")
    check_optional(ranks_per_node, check_count, "ranks_per_node", 1, ", or None")
    if not (isinstance(rank_groups, str) and rank_groups == "node"):
        check_count(rank_groups, "rank_groups", 1, " (or 'node')")
    if comm is not None and process_set is not None:
        raise ValueError("give either comm (an mpi4py communicator) or process_set (a Horovod process "
                         "set), not both")
    return sync, scope, unfactorized_sync


def _job_comm(MPI, comm, process_set):
    """(the mpi4py communicator AB-training runs on, whether this process takes part): ``comm``;
    else the process set's members (``COMM_WORLD`` for none); ``COMM_SELF`` for a process outside
    the set, which trains locally, as Horovod does."""
    if comm is not None:
        return comm, True
    if process_set is None:
        return MPI.COMM_WORLD, True
    members = HorovodGroup(process_set)     # the process set seen from this process
    if not members.included:
        return MPI.COMM_SELF, False
    mpi_comm = members.mpi_comm()
    if mpi_comm is None:  # pragma: no cover (mpi4py imported by the caller)
        raise RuntimeError("AB-training needs an mpi4py communicator of the process set")
    return mpi_comm, True


def _torch_world(where):
    """The ``torch.distributed`` group AB-training runs on, or None for MPI: ``where`` is a
    ``torch.distributed`` process group, or None in a job where ``torch.distributed`` is
    initialised and Horovod is not (torchrun, srun)."""
    import torch.distributed as dist

    if where is not None:
        if dist.is_available() and isinstance(where, dist.ProcessGroup):
            return TorchDistGroup(where)
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        import horovod.torch as hvd

        if hvd.is_initialized() and not (hvd.size() == 1 and dist.get_world_size() > 1):
            return None
    except ImportError:
        pass
    return TorchDistGroup()


def _deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"AB-training: {old} is renamed {new} (AB-training's stages are no longer called phases, "
                  "its rank groups no longer groups); the old spelling goes in the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def _renamed(old: str, new: str) -> property:
    """A read-only attribute ``old`` that warns and gives ``new`` (one release)."""
    def get(self):
        _deprecated(f"ABTraining.{old}", f"ABTraining.{new}")
        return getattr(self, new)
    return property(get, doc=f"Deprecated spelling of :attr:`{new}` (one release).")


class ABTraining(SkipSynchronize):
    """Drives AB-training of ``model`` over MPI ranks; replaces a DistributedOptimizer.

    Use it as hvdcomp's optimizer: ``zero_grad()``, backward, ``synchronize()``, optionally
    ``clip_grad_norm_(ab.parameters(), c)``, ``step()``.

    Args:
        model: the model (identical on every rank at start).
        optimizer_factory: ``f(params) -> torch.optim.Optimizer``, called once with every model
            parameter and every factor (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=3e-3,
            weight_decay=0.1)``, the authors' VGG16 setting).
        rank_groups: ``"node"`` (default: the ranks of a node form a rank group, the authors'
            group_size on their 4-GPU nodes; one on a single machine without ``ranks_per_node``)
            or a number G of rank groups dividing the world size S (ranks ``[g·S/G, (g+1)·S/G)``
            form rank group g). ``groups=`` is its deprecated spelling (one release).
        ranks_per_node: emulate a node layout of ranks ``[i·R, (i+1)·R)`` on node i (for
            ``rank_groups="node"`` and the between-node byte counts); None: the machine's own.
        warmup_steps, steps_between_syncs, full_rank_steps: the stages (docs/ab-training.md).
        cutoff: keep σ_i > cutoff·σ_1 when factorising after a full-rank stage.
        cut_first: also cut at the first factorisation after warm-up (the authors' is exact).
        mode: ``"only-b"`` or ``"ab"`` (docs/ab-training.md).
        sync: what the sync averages: ``"b"`` (only-b's default) or ``"full"`` (W) in mode
            only-b; ``"full"`` (default), ``"with-stale"`` or ``"only-learned"`` in mode ab.
        orientation: ``"tall"`` (B the small factor) or ``"rows"``.
        unfactorized_scope: where 1-D and full-rank parameters are averaged while grouped:
            ``"rank-group"`` (the authors') or ``"world"`` (``"group"``: deprecated spelling).
        unfactorized_sync: how those parameters agree again at the sync when averaged in the
            rank groups: ``"broadcast"`` (from rank 0; default in mode only-b) or ``"average"``
            (default in mode ab).
        reset_optimizer: clear the optimizer state at every switch instead of carrying it.
        ramp_steps, ramp_start_lr: the learning-rate rebound after each switch
            (:class:`hvdcomp.lowrank.schedule.Rebound`).
        full_rank: parameter names that are never factorised (the authors keep the first layer
            and the classifier).
        base_lr: the rate the rebound climbs back to (update it for schedules).
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (a new one by default).
        comm: an mpi4py communicator to run on (default: the process set's).
        process_set: a Horovod process set; AB-training then runs on the mpi4py communicator of
            its members (:meth:`hvdcomp.comm.group.Group.mpi_comm`) and never averages with a rank
            outside it. A process outside the set trains locally, as Horovod's optimizer does.

    Raises:
        ValueError: bad schedule numbers, ``rank_groups`` not dividing the world size, an unknown
            mode, sync, orientation or scope, mode "ab" with fewer than 2 rank groups, ``comm``
            and ``process_set`` both given, ``groups`` and ``rank_groups`` both given, unknown
            ``full_rank`` names.
        RuntimeError: mpi4py unusable, or the launcher started several tasks and the MPI world has
            one rank (``torchrun``, ``horovodrun --gloo``: :func:`hvdcomp.launch.start_frontend`).
    """

    STAGES = STAGES
    PHASES = STAGES  # deprecated spelling of STAGES (one release)

    def __init__(self, model: torch.nn.Module,
                 optimizer_factory: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer],
                 rank_groups: Union[int, str] = "node", warmup_steps: int = 100, steps_between_syncs: int = 100,
                 full_rank_steps: int = 10, cutoff: float = 0.15, mode: str = "only-b", sync: Optional[str] = None,
                 orientation: str = "tall", unfactorized_scope: str = "rank-group",
                 unfactorized_sync: Optional[str] = None, cut_first: bool = False, reset_optimizer: bool = False,
                 ramp_steps: int = 20, ramp_start_lr: float = 1e-5, full_rank: Sequence[str] = (),
                 base_lr: float = 0.1, ranks_per_node: Optional[int] = None, timer: Optional[PhaseTimer] = None,
                 comm=None, process_set=None, groups: Union[int, str, None] = None):
        if groups is not None:
            if rank_groups != "node":
                raise ValueError("give rank_groups (groups is its deprecated spelling), not both")
            _deprecated("groups=", "rank_groups=")
            rank_groups = groups
        self.schedule = Schedule(warmup_steps, steps_between_syncs, full_rank_steps)
        self.rebound = Rebound(ramp_steps, ramp_start_lr)
        cut_first, reset_optimizer = check_bool(cut_first, "cut_first"), check_bool(reset_optimizer, "reset_optimizer")
        base_lr = check_range(base_lr, "base_lr", 0.0, low_open=True)
        sync, unfactorized_scope, unfactorized_sync = _check(
            cutoff, mode, sync, orientation, unfactorized_scope, unfactorized_sync, ranks_per_node, rank_groups,
            comm, process_set)
        torch_world = None if comm is not None else _torch_world(process_set)
        if torch_world is not None:            # torchrun / srun: torch.distributed, no MPI
            import torch.distributed as dist

            start_frontend("hvdcomp.lowrank.ABTraining", "torch.distributed", dist.get_world_size())
            self.world, self.included = torch_world, True
            nodes = node_of_ranks(torch_world, ranks_per_node)
            self.layout = RankLayout.build(nodes, torch_world.rank, rank_groups, mode)
        else:
            try:
                from mpi4py import MPI
            except ImportError as exc:  # pragma: no cover
                raise RuntimeError(f"AB-training under MPI needs mpi4py ({exc}); under torchrun it runs on "
                                   "torch.distributed (init_process_group first)") from None
            start_frontend("hvdcomp.lowrank.ABTraining", "mpi", MPI.COMM_WORLD.Get_size())
            base, self.included = _job_comm(MPI, comm, process_set)
            self.world = base.Dup()
            if self.included:
                nodes = node_of_ranks(self.world, ranks_per_node)
                self.layout = RankLayout.build(nodes, self.world.Get_rank(), rank_groups, mode)
            else:                                  # outside the process set: one local rank group
                self.layout = RankLayout.local()
        self.timer = timer if timer is not None else PhaseTimer()
        self.traffic = Traffic(self.world, self.layout, self.timer)
        self.model, self.mode, self.sync_mode, self.cutoff = model, mode, sync, float(cutoff)
        self.rank_groups, self.orientation = rank_groups, orientation
        self.cut_first = cut_first
        self.unfactorized_scope, self.unfactorized_sync = unfactorized_scope, unfactorized_sync
        self.reset_optimizer, self.ranks_per_node = reset_optimizer, ranks_per_node
        self.base_lr = base_lr
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        unknown = set(full_rank) - {n for n, _ in self.named}
        if unknown:
            raise ValueError(f"full_rank names {sorted(unknown)} are not parameters of the model")
        self.full_rank = tuple(full_rank)
        self.factorized = [FactorizedWeight(n, p, orientation) for n, p in factorizable(model, self.named, full_rank)]
        fact_ids = {id(f.param) for f in self.factorized}
        self.always_full = [(n, p) for n, p in self.named if id(p) not in fact_ids]
        params = [p for _, p in self.named] + [t for f in self.factorized for t in (f.a, f.b)]
        self.optimizer: torch.optim.Optimizer = optimizer_factory(params)
        self.step_count = 0
        self.stage: Optional[str] = None
        self.cycle: Optional[int] = None
        self.dense_bytes_per_step = 4 * sum(p.numel() for _, p in self.named)
        self.ranks_kept: Dict[str, int] = {}
        self.compression_history: List[dict] = []
        self._enter(self.stage_at(0))

    # the schedule's numbers, the layout's and the ledgers', read where they live
    warmup_steps = property(lambda self: self.schedule.warmup_steps)
    steps_between_syncs = property(lambda self: self.schedule.steps_between_syncs)
    full_rank_steps = property(lambda self: self.schedule.full_rank_steps)
    ramp_steps = property(lambda self: self.rebound.ramp_steps)
    ramp_start_lr = property(lambda self: self.rebound.ramp_start_lr)
    nodes = property(lambda self: self.layout.nodes, doc="Node index of every rank.")
    n_rank_groups = property(lambda self: self.layout.n_rank_groups)
    rank_group_index = property(lambda self: self.layout.rank_group_index, doc="This rank's rank group.")
    bytes_by_stage = property(lambda self: self.traffic.bytes_by_stage)
    internode_bytes_by_stage = property(lambda self: self.traffic.internode_bytes_by_stage)
    steps_by_stage = property(lambda self: self.traffic.steps_by_stage)
    # deprecated spellings (one release)
    phase, phase_at = _renamed("phase", "stage"), _renamed("phase_at", "stage_at")
    bytes_by_phase = _renamed("bytes_by_phase", "bytes_by_stage")
    internode_bytes_by_phase = _renamed("internode_bytes_by_phase", "internode_bytes_by_stage")
    steps_by_phase = _renamed("steps_by_phase", "steps_by_stage")
    groups, n_groups = _renamed("groups", "rank_groups"), _renamed("n_groups", "n_rank_groups")
    group_index = _renamed("group_index", "rank_group_index")

    def stage_at(self, step: int) -> Tuple[str, int]:
        """(stage, cycle) for a 0-based optimizer step (:meth:`Schedule.stage_at`)."""
        return self.schedule.stage_at(step)

    def trains(self) -> str:
        """Which factor this rank's rank group trains while grouped: ``"A"`` or ``"B"``."""
        return self.layout.trains

    def describe(self) -> dict:
        """The configuration and schedule, for results files."""
        return RenamedKeys(
            name="ab-training", rank_groups=self.rank_groups, n_rank_groups=self.n_rank_groups, mode=self.mode,
            sync=self.sync_mode, orientation=self.orientation, cutoff=self.cutoff, cut_first=self.cut_first,
            unfactorized_scope=self.unfactorized_scope, unfactorized_sync=self.unfactorized_sync,
            reset_optimizer=self.reset_optimizer, warmup_steps=self.warmup_steps,
            steps_between_syncs=self.steps_between_syncs, full_rank_steps=self.full_rank_steps,
            ramp_steps=self.ramp_steps, ramp_start_lr=self.ramp_start_lr, ranks_per_node=self.ranks_per_node,
            nodes=self.layout.n_nodes, factorized=[f.name for f in self.factorized], full_rank=list(self.full_rank))

    # ---- switches -------------------------------------------------------------------------------
    def _factorize_all(self, cut: bool) -> None:
        """Factorise every weight (exactly, or keeping σ_i > cutoff·σ_1 with the rank agreed over
        all ranks) and fit the factors' optimizer state to the new shapes."""
        with self.timer.phase("compress"):
            mats = [f.matrix().to(torch.float32) for f in self.factorized]
            ranks = [kept_rank(torch.linalg.svdvals(m), self.cutoff) if cut else min(f.dims)
                     for f, m in zip(self.factorized, mats)]
        if cut and self.factorized:
            ranks = self.traffic.agree_max(ranks, "sync")    # the kept rank: max over ranks
        with self.timer.phase("compress"):
            for f, m, k in zip(self.factorized, mats, ranks):
                f.refactorize(m, k, self.optimizer)
                self.ranks_kept[f.name] = int(k)
        comp = model_compression(self.named, self.ranks_kept)
        self.compression_history.append({"step": self.step_count, "ranks": dict(self.ranks_kept), **comp})

    def _sync(self) -> None:
        """End of a grouped stage: make every factorised weight and every parameter trained in the
        rank groups identical on all ranks (counted in stage ``"sync"``)."""
        fs, t = self.factorized, self.traffic
        if self.sync_mode == "full":
            t.allreduce_mean([f.param.data for f in fs], "world", "sync")
        else:
            if self.sync_mode == "b":
                t.allreduce_mean([f.b.data for f in fs], "world", "sync")
            elif self.sync_mode == "with-stale":
                t.allreduce_mean([x.data for f in fs for x in (f.a, f.b)], "world", "sync")
            else:  # only-learned: each factor averaged over its trainers, then sent to every rank
                if self.layout.trainer_rank_groups() > 1:
                    t.allreduce_mean([f.a.data if self.trains() == "A" else f.b.data for f in fs], "trainers", "sync")
                first = self.layout.first_trainer()
                t.broadcast([f.a.data for f in fs], first["A"], "sync")
                t.broadcast([f.b.data for f in fs], first["B"], "sync")
            for f in fs:
                f.apply_factors()
        if self.unfactorized_scope == "rank-group" and self.n_rank_groups > 1:
            tensors = [p.data for _, p in self.always_full]
            if self.unfactorized_sync == "broadcast":
                t.broadcast(tensors, 0, "sync")
            else:
                t.allreduce_mean(tensors, "world", "sync")

    def _enter(self, now: Tuple[str, int]) -> None:
        """Switch stage if the schedule says so: sync after grouped, factorise before grouped."""
        previous = (self.stage, self.cycle)
        if not Schedule.is_switch(previous, now):
            return
        if previous[0] == "grouped":
            self._sync()
        if now[0] == "grouped":
            first = not self.compression_history
            self._factorize_all(cut=self.cut_first or not first)
        if self.stage is not None:
            self.rebound.restart()
            if self.reset_optimizer:
                self.optimizer.state.clear()
        self.stage, self.cycle = now

    # ---- the optimizer-like interface -----------------------------------------------------------
    @property
    def param_groups(self):
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    def parameters(self) -> List[torch.nn.Parameter]:
        """Parameters trained in the current stage (clip these): every model parameter in
        full-rank stages; the unfactorised ones and the trained factors while grouped."""
        if self.stage != "grouped":
            return [p for _, p in self.named]
        return [p for _, p in self.always_full] + [f.a if self.trains() == "A" else f.b for f in self.factorized]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the factors' gradients."""
        self.model.zero_grad(set_to_none=set_to_none)
        for f in self.factorized:
            f.a.grad = f.b.grad = None

    def synchronize(self) -> None:
        """Average gradients: over all ranks in full-rank stages; while grouped, the trained
        factor's gradient (and, scope "rank-group", the unfactorised parameters') within the rank
        group. Gradients of weights not trained in the stage are set to None."""
        for _, p in self.named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.stage != "grouped":
            self.traffic.allreduce_mean([p.grad for _, p in self.named], "world", self.stage)
        else:
            with self.timer.phase("compress"):
                grads = [f.factor_gradient(self.trains()) for f in self.factorized]
            rest = [p.grad for _, p in self.always_full]
            if self.unfactorized_scope == "world":
                self.traffic.allreduce_mean(rest, "world", "grouped")
            else:
                grads = grads + rest
            self.traffic.allreduce_mean(grads, "rank-group", "grouped")
        self.timer.add_bytes(dense=self.dense_bytes_per_step)

    def current_lr(self) -> float:
        """The learning rate of the next step: ``base_lr``, or the rebound's while it lasts."""
        return self.rebound.lr(self.base_lr)

    def step(self) -> None:
        """Optimizer step at :meth:`current_lr`, then W = A·B, then advance the schedule."""
        lr = self.current_lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        if self.stage == "grouped":
            for f in self.factorized:
                f.apply_factors()
        self.traffic.steps_by_stage[self.stage] += 1
        self.step_count += 1
        self.rebound.advance(self.base_lr)
        self._enter(self.stage_at(self.step_count))

    def model_compression(self) -> dict:
        """The model size now: :func:`hvdcomp.lowrank.model_compression` with the kept ranks while
        grouped, the full model (ratio 1) in full-rank stages."""
        return model_compression(self.named, self.ranks_kept if self.stage == "grouped" else {})

    def communication_report(self) -> dict:
        """This rank's bytes sent per stage (all, and in collectives spanning nodes), the dense
        bytes full-rank data parallelism would send (every gradient, fp32, every step), the
        traffic ratio of this rank, and the model compression: at the last factorisation
        (``model_compression``, the paper's 44.14:1 kind) and at every one (``compression_history``).
        Combine the reports of all ranks with :func:`hvdcomp.lowrank.traffic_summary`."""
        last = self.compression_history[-1] if self.compression_history else model_compression(self.named, {})
        return RenamedKeys(
            **self.traffic.report(self.dense_bytes_per_step * self.step_count), nodes=self.layout.n_nodes,
            node=self.nodes[self.layout.rank], rank_group=self.rank_group_index,
            ranks_kept=dict(self.ranks_kept),
            model_compression={k: last[k] for k in ("full_parameters", "parameters", "ratio")},
            compression_history=list(self.compression_history))
