"""AB-training: each weight factorised as W = A·B, the small factor B trained inside groups of ranks.

Coquelin, Flügel, Weiel, Kiefer, Öz, Debus, Streit and Götz, "AB-Training: A
Communication-Efficient Approach for Distributed Low-Rank Learning", arXiv:2405.01067 (2024).
The defaults follow the authors' code (github.com/Helmholtz-AI-Energy/AB-Training, package
``madonna``, trainer ``trainers/ab_lowrank.py``, configuration ``configs/cifar10/vgg16/``).

Schedule over optimizer steps (all counts configurable, recorded by :meth:`ABTraining.describe`)::

    warm-up     warmup_steps full-rank steps (every gradient averaged over all ranks)
    factorise   exactly (every singular value kept)
    repeat:
      grouped   steps_between_syncs steps: each group (default: the ranks of one node) averages
                the gradient of the factor it trains, of the 1-D parameters and of the layers
                kept at full rank; nothing crosses a group's boundary
      sync      B averaged over all ranks (mode "only-b"); the parameters trained inside the
                groups but never factorised taken from rank 0 (a broadcast, as the authors'
                trainer does where full-rank training resumes)
      full rank full_rank_steps steps (all ranks average every gradient)
      factorise with the cut: keep the σ_i > cutoff·σ_1

**Factors.** A weight's 2-D view is ``(out, in·kh·kw)``, transposed when it has fewer rows than
columns (``orientation="tall"``, the authors'), so it is n × m with n ≥ m. Its SVD ``U Σ Vᵀ``
gives ``A = U_k √Σ_k`` (n × k, frozen in mode "only-b") and ``B = √Σ_k V_kᵀ`` (k × m): B is the
small factor, k ≤ m = min(dims). Example: the 64 × 64 × 3 × 3 convolution ``features.7`` of
``train_cnn.py``'s DigitsVGG is viewed as 576 × 64; exactly factorised, B is 64 × 64, so a grouped
step sends 4,096 of the layer's 36,864 gradient values (1/9). ``orientation="rows"`` keeps
``(out, in·kh·kw)`` as it is (hvdcomp's earlier layout: B then is the large factor when out <
in·kh·kw). While factorised, the module keeps ``W = A·B`` as its weight; the gradient of the
trained factor follows from W's gradient (``∂A = ∂W·Bᵀ``, ``∂B = Aᵀ·∂W``), so any module (Linear,
conv, LSTM) works unchanged. Embeddings, weights whose 2-D view has a dimension of 1, 1-D
parameters and the names in ``full_rank`` are never factorised.

**Modes.** ``mode="only-b"`` (default, the authors' CIFAR-10/VGG16 runs): every rank trains B.
``mode="ab"``: the first half of the groups train A, the second half B (at least 2 groups),
with ``sync`` "full" (W = mean over ranks of A·B; hvdcomp's earlier default), "with-stale"
(W = mean(A)·mean(B), the untrained factors included) or "only-learned" (A averaged over the
A-trainers and B over the B-trainers, each broadcast from its first trainer). The unfactorised
parameters trained inside the groups are then averaged over all ranks (the authors' choice in
these modes). ``unfactorized_scope="world"`` averages them over all ranks at every grouped step
instead (hvdcomp's earlier behaviour).

**Optimizer.** One optimizer for the whole run, over every model parameter and every factor. A
parameter not trained in a phase has no gradient, so PyTorch's optimizers (SGD, Adam, AdamW)
leave it and its state alone; momentum and Adam moments are carried across switches, padded with
zeros or truncated where a factor's matrix rank changes (the authors' ``change_adam_shapes``).
``reset_optimizer=True`` clears the state at every switch instead (hvdcomp's earlier behaviour:
a new optimizer per phase). Weight decay reaches only what is trained: B while grouped, which
is what lets singular values shrink below the cut.

**Learning-rate rebound** (the authors'): at every switch the rate drops and climbs back over
``ramp_steps`` steps; the k-th step after a switch uses ``min(base_lr, k·(lr_s − ramp_start_lr)
/ ramp_steps)``, lr_s being ``base_lr`` at the switch (k = 1 … ramp_steps).

**Bytes** are counted per rank at the collective, hvdcomp's convention: an Allreduce of n bytes
sends and receives n, a broadcast sends n at its root and receives n everywhere. "Between
nodes" counts the bytes of collectives whose communicator holds ranks of more than one node
(``ranks_per_node`` emulates a node layout; otherwise the machine's own, from MPI's shared-memory
split). Every Allreduce carries one packed fp32 buffer per communicator and step; kept ranks are
agreed (max over ranks, int64 per factorised weight) at every cut.

Transport: mpi4py on a duplicate of the process set's communicator (``COMM_WORLD`` by default)
and on ``Split`` sub-communicators per group.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..metrics import PhaseTimer

__all__ = ["ABTraining", "factorize", "kept_rank", "model_compression", "traffic_summary",
           "unit_singular_values_", "matrix_view"]

MODES = {"only-b": ("b", "full"), "ab": ("full", "with-stale", "only-learned")}


def kept_rank(singular_values: torch.Tensor, cutoff: float) -> int:
    """Number of singular values σ_i > cutoff·σ_1 (at least 1; all of them when cutoff is 0)."""
    if cutoff <= 0:
        return int(singular_values.numel())
    return max(1, int((singular_values > cutoff * singular_values[0]).sum()))


def factorize(w: torch.Tensor, rank: Optional[int] = None, cutoff: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a matrix W (n × m, floating, any dtype) into A (n × k) and B (k × m), A·B ≈ W.

    ``A = U_k·√Σ_k``, ``B = √Σ_k·V_kᵀ`` from the SVD (computed in float32; LAPACK scales
    internally, so W of norm 1e-30 or 1e30 factorises as accurately as W of norm 1);
    k = ``rank`` if given, else :func:`kept_rank` of the singular values with ``cutoff``.
    A and B have W's dtype. Pass W tall (n ≥ m, see :func:`matrix_view`) for B to be the small
    factor.

    Numerically zero singular values (σ_i ≤ n_max·eps·σ_1, every one of them when W = 0, or
    when ``rank`` exceeds W's rank) would give a zero column of A *and* a zero row of B, and then
    neither factor's gradient (∂A = ∂W·Bᵀ, ∂B = Aᵀ·∂W) could ever move that direction while
    factorised. Such directions get ``A_i = U_i·√σ_1`` (``U_i`` if W = 0) and ``B_i = 0``: A·B is
    unchanged (to within those negligible σ_i) and B's gradient along U_i is not zero.

    Raises:
        ValueError: W is not 2-D or has non-finite entries.
    """
    if w.dim() != 2:
        raise ValueError(f"factorize expects a 2-D matrix, got shape {tuple(w.shape)}")
    w32 = w.detach().to(torch.float32)
    if not torch.isfinite(w32).all():
        raise ValueError("factorize: W has non-finite entries (training has diverged); "
                         "resume from a checkpoint or lower the learning rate")
    u, s, vh = torch.linalg.svd(w32, full_matrices=False)
    k = kept_rank(s, cutoff) if rank is None else int(rank)
    top = s[0] if s.numel() else s.new_zeros(())
    dead = s[:k] <= top * (max(w.shape) * torch.finfo(torch.float32).eps)
    root = s[:k].sqrt()
    a_root = torch.where(dead, top.sqrt() if top > 0 else torch.ones_like(top), root)
    b_root = torch.where(dead, torch.zeros_like(root), root)
    return (u[:, :k] * a_root).to(w.dtype), (b_root[:, None] * vh[:k]).to(w.dtype)


def matrix_view(weight: torch.Tensor, orientation: str = "tall") -> Tuple[torch.Tensor, bool]:
    """The 2-D view AB-training factorises, and whether it is transposed.

    ``weight`` (out, …) is viewed as ``(out, prod(rest))``; with ``orientation="tall"`` a view
    with fewer rows than columns is transposed, so the result is n × m with n ≥ m (the authors'
    ``get_2d_repr``); ``"rows"`` never transposes.

    Raises:
        ValueError: ``weight`` has fewer than 2 dimensions, or an unknown orientation.
    """
    if weight.dim() < 2:
        raise ValueError(f"matrix_view needs a weight of 2 or more dimensions, got shape {tuple(weight.shape)}")
    if orientation not in ("tall", "rows"):
        raise ValueError(f"orientation must be 'tall' or 'rows', got {orientation!r}")
    m = weight.reshape(weight.shape[0], -1)
    flip = orientation == "tall" and m.shape[0] < m.shape[1]
    return (m.t() if flip else m), flip


def unit_singular_values_(model: torch.nn.Module) -> List[str]:
    """Set every singular value of every weight of 2 or more dimensions to 1 (W ← U·Vᵀ), in place.

    The authors' ``init_method: ortho-sigma``: directions are kept from the initialisation, the
    spectrum starts flat, so a direction training does not strengthen falls below the cut once
    the strengthened ones grow. Returns the names changed. Call it before the parameters are
    broadcast (or on every rank with the same weights).
    """
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            m = p.reshape(p.shape[0], -1).to(torch.float32)
            u, _, vh = torch.linalg.svd(m, full_matrices=False)
            p.copy_((u @ vh).reshape(p.shape).to(p.dtype))
            changed.append(name)
    return changed


def model_compression(named_parameters: Iterable[Tuple[str, torch.Tensor]], ranks: Dict[str, int]) -> dict:
    """Model size of the factorised model against the full-rank one (the paper's 44.14:1 kind).

    Args:
        named_parameters: ``(name, tensor)`` of the full-rank model (e.g. ``model.named_parameters()``).
        ranks: matrix rank k kept per factorised weight; such a weight of 2-D view n × m counts
            ``k·(n + m)`` parameters (A and B), every other parameter its element count.

    Returns:
        ``{"full_parameters", "parameters", "ratio"}`` with ratio = full / factorised (1.0 when
        ``ranks`` is empty).

    Raises:
        ValueError: a name in ``ranks`` is not among the parameters, or a rank outside
            [1, min(n, m)].
    """
    full = fact = 0
    seen = set()
    for name, p in named_parameters:
        full += p.numel()
        if name in ranks:
            n, m = p.shape[0], p.numel() // p.shape[0]
            k = int(ranks[name])
            if not 1 <= k <= min(n, m):
                raise ValueError(f"rank {k} of {name} is outside [1, {min(n, m)}] for its {n} x {m} view")
            fact += k * (n + m)
            seen.add(name)
        else:
            fact += p.numel()
    unknown = set(ranks) - seen
    if unknown:
        raise ValueError(f"ranks given for {sorted(unknown)}, which are not parameters of the model")
    return {"full_parameters": full, "parameters": fact, "ratio": full / fact if fact else None}


def traffic_summary(reports: Sequence[dict]) -> dict:
    """Whole-run traffic over all ranks from every rank's :meth:`ABTraining.communication_report`
    (or any dict with the same byte keys), against full-rank data parallelism.

    Full-rank data parallelism sends ``dense_bytes`` per rank (every gradient, fp32, every step),
    all of it in collectives that span the nodes when the layout has more than one node.

    Returns:
        ``ranks``, ``nodes``, ``dense_bytes`` (per rank), ``bytes_sent_mean`` and
        ``bytes_between_nodes_mean`` (bytes per rank, mean over ranks), per-phase means of both,
        the per-rank lists, ``ratio_mean`` = dense / mean sent, and (more than one node)
        ``ratio_between_nodes`` = dense / mean sent between nodes and ``reduction_between_nodes``
        = 1 − that quotient's inverse (the paper's "network traffic reduced by x %").

    Raises:
        ValueError: no reports, or reports of different runs (dense bytes or node counts differ).
    """
    if not reports:
        raise ValueError("traffic_summary needs one report per rank, got none")
    if len({r["dense_bytes"] for r in reports}) != 1 or len({r.get("nodes", 1) for r in reports}) != 1:
        raise ValueError("traffic_summary: the reports disagree on dense_bytes or nodes: give one run's "
                         "reports, one per rank")
    n, dense, nodes = len(reports), reports[0]["dense_bytes"], reports[0].get("nodes", 1)
    sent = [r["bytes_sent"] for r in reports]
    between = [r.get("internode_bytes_sent", r["bytes_sent"] if nodes > 1 else 0) for r in reports]

    def phase_mean(key):
        out: Dict[str, float] = defaultdict(float)
        for r in reports:
            for phase, b in r.get(key, {}).items():
                out[phase] += b / n
        return dict(out)

    mean_sent, mean_between = sum(sent) / n, sum(between) / n
    out = {"ranks": n, "nodes": nodes, "dense_bytes": dense, "bytes_sent_mean": mean_sent,
           "bytes_between_nodes_mean": mean_between, "bytes_by_phase_mean": phase_mean("bytes_by_phase"),
           "between_nodes_by_phase_mean": phase_mean("internode_bytes_by_phase"),
           "bytes_sent_per_rank": sent, "bytes_between_nodes_per_rank": between,
           "ratio_mean": dense / mean_sent if mean_sent else None,
           "ratio_between_nodes": None, "reduction_between_nodes": None}
    if nodes > 1 and dense:
        out["ratio_between_nodes"] = dense / mean_between if mean_between else math.inf
        out["reduction_between_nodes"] = 1.0 - mean_between / dense
    return out


class _Factorized:
    """One factorised weight: the module's parameter, its 2-D view and the factors A, B."""

    __slots__ = ("name", "param", "shape", "transposed", "dims", "a", "b")

    def __init__(self, name: str, param: torch.nn.Parameter, orientation: str):
        self.name, self.param, self.shape = name, param, param.shape
        view, self.transposed = matrix_view(param.detach(), orientation)
        self.dims = tuple(view.shape)
        # placeholders (no elements) until the first factorisation gives them their shapes
        self.a = torch.nn.Parameter(param.detach().new_zeros(0))
        self.b = torch.nn.Parameter(param.detach().new_zeros(0))

    @property
    def rank(self) -> int:
        return int(self.b.shape[0]) if self.b.dim() == 2 else 0

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the weight's shape) as the oriented n × m matrix."""
        m = t.reshape(self.shape[0], -1)
        return m.t() if self.transposed else m

    def matrix(self) -> torch.Tensor:
        return self.view(self.param.detach())

    def set_weight(self, m: torch.Tensor) -> None:
        """Write the oriented n × m matrix ``m`` into the module's weight."""
        with torch.no_grad():
            self.param.copy_((m.t() if self.transposed else m).reshape(self.shape))


def _pad_or_truncate(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` resized to ``shape``: the overlap kept, new entries zero."""
    out = t.new_zeros(tuple(shape))
    overlap = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, shape))
    out[overlap] = t[overlap]
    return out


class ABTraining:
    """Drives AB-training of ``model`` over MPI ranks; replaces a DistributedOptimizer.

    Use it as hvdcomp's optimizer: ``zero_grad()``, backward, ``synchronize()``, optionally
    ``clip_grad_norm_(ab.parameters(), c)``, ``step()``.

    Args:
        model: the model (identical on every rank at start).
        optimizer_factory: ``f(params) -> torch.optim.Optimizer``, called once with every model
            parameter and every factor (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=3e-3,
            weight_decay=0.1)``, the authors' VGG16 setting).
        groups: ``"node"`` (default: the ranks of a node form a group, the authors' group_size
            on their 4-GPU nodes; one group on a single machine without ``ranks_per_node``) or a
            number of groups dividing the world size (ranks ``[g·S/G, (g+1)·S/G)`` form group g).
        ranks_per_node: emulate a node layout of ranks ``[i·R, (i+1)·R)`` on node i (for
            ``groups="node"`` and the between-node byte counts); None: the machine's own.
        warmup_steps, steps_between_syncs, full_rank_steps: the schedule (see the module doc).
            The authors' VGG16/CIFAR-10 run: 4330, 699 (= 759 − 60) and 60.
        cutoff: keep σ_i > cutoff·σ_1 when factorising after a full-rank phase (authors: 0.15).
        cut_first: also cut at the first factorisation after warm-up (the authors' is exact).
        mode: ``"only-b"`` or ``"ab"`` (see the module doc).
        sync: what the sync averages: ``"b"`` (only-b's default) or ``"full"`` (W) in mode
            only-b; ``"full"`` (default), ``"with-stale"`` or ``"only-learned"`` in mode ab.
        orientation: ``"tall"`` (B the small factor) or ``"rows"``.
        unfactorized_scope: where 1-D and full-rank parameters are averaged while grouped:
            ``"group"`` (the authors') or ``"world"``.
        unfactorized_sync: how those parameters agree again at the sync when averaged in the
            groups: ``"broadcast"`` (from rank 0; default in mode only-b) or ``"average"``
            (default in mode ab).
        reset_optimizer: clear the optimizer state at every switch instead of carrying it.
        ramp_steps, ramp_start_lr: the learning-rate rebound after each switch (authors: 267
            steps from 1e-5 on VGG16).
        full_rank: parameter names that are never factorised (the authors keep the first layer
            and the classifier).
        base_lr: the rate the rebound climbs back to (update it for schedules).
        timer: a :class:`hvdcomp.metrics.PhaseTimer` (a new one by default).
        comm: an mpi4py communicator to run on (default: the process set's).
        process_set: a Horovod process set; AB-training then runs on the mpi4py communicator of
            its members (:meth:`hvdcomp.comm.group.Group.mpi_comm`) and never averages with a rank
            outside it. A process outside the set trains locally, as Horovod's optimizer does.

    Raises:
        ValueError: bad schedule numbers, ``groups`` not dividing the world size, an unknown
            mode, sync, orientation or scope, mode "ab" with fewer than 2 groups, ``comm`` and
            ``process_set`` both given, unknown ``full_rank`` names.
        RuntimeError: mpi4py unusable (e.g. ``horovodrun --gloo``).
    """

    PHASES = ("warmup", "grouped", "sync", "full-rank")

    def __init__(self, model: torch.nn.Module,
                 optimizer_factory: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer],
                 groups: Union[int, str] = "node", warmup_steps: int = 100, steps_between_syncs: int = 100,
                 full_rank_steps: int = 10, cutoff: float = 0.1, mode: str = "only-b", sync: Optional[str] = None,
                 orientation: str = "tall", unfactorized_scope: str = "group", unfactorized_sync: Optional[str] = None,
                 cut_first: bool = False, reset_optimizer: bool = False, ramp_steps: int = 20,
                 ramp_start_lr: float = 1e-5, full_rank: Sequence[str] = (), base_lr: float = 0.1,
                 ranks_per_node: Optional[int] = None, timer: Optional[PhaseTimer] = None, comm=None,
                 process_set=None):
        for key, val, low in (("warmup_steps", warmup_steps, 0), ("steps_between_syncs", steps_between_syncs, 1),
                              ("full_rank_steps", full_rank_steps, 0), ("ramp_steps", ramp_steps, 0)):
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {val!r}")
        if not 0.0 <= float(cutoff) < 1.0:
            raise ValueError(f"cutoff must be in [0, 1) (e.g. 0.15), got {cutoff}")
        if mode not in MODES:
            raise ValueError(f"mode must be 'only-b' or 'ab', got {mode!r}")
        sync = MODES[mode][0] if sync is None else sync
        if sync not in MODES[mode]:
            raise ValueError(f"sync={sync!r} does not fit mode={mode!r}: choose one of {list(MODES[mode])}")
        if orientation not in ("tall", "rows"):
            raise ValueError(f"orientation must be 'tall' (B the small factor) or 'rows', got {orientation!r}")
        if unfactorized_scope not in ("group", "world"):
            raise ValueError(f"unfactorized_scope must be 'group' or 'world', got {unfactorized_scope!r}")
        unfactorized_sync = unfactorized_sync or ("broadcast" if mode == "only-b" else "average")
        if unfactorized_sync not in ("broadcast", "average"):
            raise ValueError(f"unfactorized_sync must be 'broadcast' or 'average', got {unfactorized_sync!r}")
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive integer or None, got {ranks_per_node!r}")
        if groups != "node" and not (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1):
            raise ValueError(f"groups must be 'node' or a positive integer, got {groups!r}")
        if comm is not None and process_set is not None:
            raise ValueError("give either comm (an mpi4py communicator) or process_set (a Horovod process "
                             "set), not both")
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover
            raise RuntimeError(f"AB-training needs mpi4py: {exc}") from None
        self.MPI = MPI
        self.included = True
        self.world = self._base_comm(comm, process_set).Dup()
        size, rank = self.world.Get_size(), self.world.Get_rank()
        self.nodes = self._node_layout(ranks_per_node if self.included else None)
        if not self.included:
            group_of = [0]                     # outside the process set: one local group
        elif groups == "node":
            group_of = list(self.nodes)
        else:
            if size % groups:
                raise ValueError(f"groups={groups} must divide the world size {size}")
            group_of = [r * groups // size for r in range(size)]
        self.n_groups = len(set(group_of))
        if mode == "ab" and self.n_groups < 2 and self.included:
            raise ValueError(f"mode='ab' trains A in half the groups and B in the other half, but this job "
                             f"has {self.n_groups} group: give groups >= 2 (or ranks_per_node for 2+ nodes)")
        self.group_index = group_of[rank]
        self.group = self.world.Split(color=self.group_index, key=rank)
        members = [r for r in range(size) if group_of[r] == self.group_index]
        self._trainer_of = ["B" if mode == "only-b" or g >= self.n_groups // 2 else "A" for g in group_of]
        peers = [r for r in range(size) if self._trainer_of[r] == self._trainer_of[rank]]
        self.trainers = self.world.Split(color=0 if self._trainer_of[rank] == "A" else 1, key=rank)
        # which of this rank's communicators hold ranks of more than one node
        self._spans = {"world": len(set(self.nodes)) > 1,
                       "group": len({self.nodes[r] for r in members}) > 1,
                       "trainers": len({self.nodes[r] for r in peers}) > 1}
        self._trainer_groups = len({group_of[r] for r in peers})
        self._first_trainer = {f: min(r for r in range(size) if self._trainer_of[r] == f)
                               for f in set(self._trainer_of)}
        self.model, self.mode, self.sync_mode, self.cutoff = model, mode, sync, float(cutoff)
        self.groups, self.orientation, self.cut_first = groups, orientation, bool(cut_first)
        self.unfactorized_scope, self.unfactorized_sync = unfactorized_scope, unfactorized_sync
        self.reset_optimizer, self.ranks_per_node = bool(reset_optimizer), ranks_per_node
        self.warmup_steps, self.steps_between_syncs = warmup_steps, steps_between_syncs
        self.full_rank_steps, self.ramp_steps, self.ramp_start_lr = full_rank_steps, ramp_steps, float(ramp_start_lr)
        self.base_lr = float(base_lr)
        self.timer = timer if timer is not None else PhaseTimer()
        embedding_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        unknown = set(full_rank) - {n for n, _ in self.named}
        if unknown:
            raise ValueError(f"full_rank names {sorted(unknown)} are not parameters of the model")
        self.full_rank = tuple(full_rank)
        self.factorized = [_Factorized(n, p, orientation) for n, p in self.named
                           if p.dim() >= 2 and min(p.shape[0], p.numel() // max(1, p.shape[0])) >= 2
                           and id(p) not in embedding_params and n not in full_rank]
        self._fact_ids = {id(f.param) for f in self.factorized}
        self.always_full = [(n, p) for n, p in self.named if id(p) not in self._fact_ids]
        params = [p for _, p in self.named] + [t for f in self.factorized for t in (f.a, f.b)]
        self.optimizer: torch.optim.Optimizer = optimizer_factory(params)
        self.step_count, self.switches, self._since_switch, self._slope = 0, 0, 0, None
        self.phase, self.cycle = None, None
        self.bytes_by_phase: Dict[str, int] = defaultdict(int)
        self.internode_bytes_by_phase: Dict[str, int] = defaultdict(int)
        self.steps_by_phase: Dict[str, int] = defaultdict(int)
        self.dense_bytes_per_step = 4 * sum(p.numel() for _, p in self.named)
        self.ranks_kept: Dict[str, int] = {}
        self.compression_history: List[dict] = []
        self._enter(self.phase_at(0))

    # ---- set-up ---------------------------------------------------------------------------------
    def _base_comm(self, comm, process_set):
        if comm is not None:
            return comm
        if process_set is None:
            return self.MPI.COMM_WORLD
        from ..comm.group import Group

        group = Group(process_set)
        if not group.included:
            self.included = False
            return self.MPI.COMM_SELF          # outside the set: train locally, as Horovod does
        members = group.mpi_comm()
        if members is None:  # pragma: no cover (mpi4py imported above)
            raise RuntimeError("AB-training needs an mpi4py communicator of the process set")
        return members

    def _node_layout(self, ranks_per_node: Optional[int]) -> List[int]:
        """Node index of every rank of ``self.world`` (nodes numbered by their lowest rank)."""
        size = self.world.Get_size()
        if ranks_per_node is not None:
            if size % ranks_per_node:
                raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world size {size}")
            return [r // ranks_per_node for r in range(size)]
        local = self.world.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.world.Get_rank())
        leader = local.allreduce(self.world.Get_rank(), op=self.MPI.MIN)
        local.Free()
        leaders = self.world.allgather(leader)
        order = sorted(set(leaders))
        return [order.index(x) for x in leaders]

    # ---- schedule ------------------------------------------------------------------------------
    def phase_at(self, step: int) -> Tuple[str, int]:
        """(phase, cycle) for a 0-based optimizer step: phase ``"warmup"``, ``"grouped"`` or
        ``"full-rank"``; cycle counts grouped+full-rank rounds (-1 during warm-up)."""
        if step < self.warmup_steps:
            return "warmup", -1
        cycle, pos = divmod(step - self.warmup_steps, self.steps_between_syncs + self.full_rank_steps)
        return ("grouped" if pos < self.steps_between_syncs else "full-rank"), cycle

    def trains(self) -> str:
        """Which factor this rank's group trains while grouped: ``"A"`` or ``"B"``."""
        return self._trainer_of[self.world.Get_rank()]

    def describe(self) -> dict:
        """The configuration and schedule, for results files."""
        return {"name": "ab-training", "groups": self.groups, "n_groups": self.n_groups, "mode": self.mode,
                "sync": self.sync_mode, "orientation": self.orientation, "cutoff": self.cutoff,
                "cut_first": self.cut_first, "unfactorized_scope": self.unfactorized_scope,
                "unfactorized_sync": self.unfactorized_sync, "reset_optimizer": self.reset_optimizer,
                "warmup_steps": self.warmup_steps, "steps_between_syncs": self.steps_between_syncs,
                "full_rank_steps": self.full_rank_steps, "ramp_steps": self.ramp_steps,
                "ramp_start_lr": self.ramp_start_lr, "ranks_per_node": self.ranks_per_node,
                "nodes": len(set(self.nodes)), "factorized": [f.name for f in self.factorized],
                "full_rank": list(self.full_rank)}

    # ---- communication ------------------------------------------------------------------------
    def _count(self, phase: str, scope: str, sent: int, received: int) -> None:
        self.timer.add_bytes(sent=sent, received=received)
        self.bytes_by_phase[phase] += sent
        if self._spans[scope]:
            self.internode_bytes_by_phase[phase] += sent

    def _comm(self, scope: str):
        return {"world": self.world, "group": self.group, "trainers": self.trainers}[scope]

    def _allreduce_mean(self, tensors: List[torch.Tensor], scope: str, phase: str) -> None:
        """Average ``tensors`` in place over a communicator with one Allreduce of a packed fp32 buffer."""
        if not tensors:
            return
        comm = self._comm(scope)
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors]).numpy()
        with self.timer.phase("communicate"):
            comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
        flat /= comm.Get_size()
        self._count(phase, scope, flat.nbytes, flat.nbytes)
        self._unpack(flat, tensors)

    def _broadcast(self, tensors: List[torch.Tensor], root: int, phase: str) -> None:
        """Rank ``root``'s ``tensors`` (world rank) on every rank, one packed fp32 broadcast."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors]).numpy()
        with self.timer.phase("communicate"):
            self.world.Bcast(flat, root=root)
        self._count(phase, "world", flat.nbytes if self.world.Get_rank() == root else 0, flat.nbytes)
        self._unpack(flat, tensors)

    @staticmethod
    def _unpack(flat: np.ndarray, tensors: List[torch.Tensor]) -> None:
        pos = 0
        for t in tensors:
            with torch.no_grad():
                t.copy_(torch.from_numpy(flat[pos:pos + t.numel()]).view_as(t))
            pos += t.numel()

    # ---- phase switches -------------------------------------------------------------------------
    def _factorize_all(self, cut: bool) -> None:
        """Factorise every weight (exactly, or keeping σ_i > cutoff·σ_1 with the rank agreed over
        all ranks) and fit the factors' optimizer state to the new shapes."""
        with self.timer.phase("compress"):
            mats = [f.matrix().to(torch.float32) for f in self.factorized]
            ranks = [kept_rank(torch.linalg.svdvals(m), self.cutoff) if cut else min(f.dims)
                     for f, m in zip(self.factorized, mats)]
        if cut and self.factorized:
            agreed = np.array(ranks, dtype=np.int64)
            self.world.Allreduce(self.MPI.IN_PLACE, agreed, op=self.MPI.MAX)  # the kept rank: max over ranks
            self._count("sync", "world", agreed.nbytes, agreed.nbytes)
            ranks = agreed.tolist()
        with self.timer.phase("compress"):
            for f, m, k in zip(self.factorized, mats, ranks):
                a, b = factorize(m, rank=int(k))
                for factor, value in ((f.a, a), (f.b, b)):
                    old = factor.shape
                    factor.data = value.to(factor.dtype)
                    factor.grad = None
                    self._fit_state(factor, old)
                self.ranks_kept[f.name] = int(k)
                f.set_weight(f.a.detach() @ f.b.detach())
        comp = model_compression(self.named, self.ranks_kept)
        self.compression_history.append({"step": self.step_count, "ranks": dict(self.ranks_kept), **comp})

    def _fit_state(self, param: torch.nn.Parameter, old_shape: torch.Size) -> None:
        """Pad or truncate the optimizer's tensors of ``param``'s shape to its new shape."""
        state = self.optimizer.state.get(param)
        if not state or tuple(old_shape) == tuple(param.shape):
            return
        for key, val in list(state.items()):
            if torch.is_tensor(val) and val.dim() > 0 and tuple(val.shape) == tuple(old_shape):
                state[key] = _pad_or_truncate(val, param.shape)

    def _sync(self) -> None:
        """End of a grouped phase: make every factorised weight and every parameter trained in the
        groups identical on all ranks (counted in phase ``"sync"``)."""
        fs = self.factorized
        if self.sync_mode == "full":
            self._allreduce_mean([f.param.data for f in fs], "world", "sync")
        else:
            if self.sync_mode == "b":
                self._allreduce_mean([f.b.data for f in fs], "world", "sync")
            elif self.sync_mode == "with-stale":
                self._allreduce_mean([t.data for f in fs for t in (f.a, f.b)], "world", "sync")
            else:  # only-learned: each factor averaged over its trainers, then sent to every rank
                if self._trainer_groups > 1:
                    mine = [f.a.data if self.trains() == "A" else f.b.data for f in fs]
                    self._allreduce_mean(mine, "trainers", "sync")
                self._broadcast([f.a.data for f in fs], self._first_trainer["A"], "sync")
                self._broadcast([f.b.data for f in fs], self._first_trainer["B"], "sync")
            for f in fs:
                f.set_weight(f.a.detach() @ f.b.detach())
        if self.unfactorized_scope == "group" and self.n_groups > 1:
            tensors = [p.data for _, p in self.always_full]
            if self.unfactorized_sync == "broadcast":
                self._broadcast(tensors, 0, "sync")
            else:
                self._allreduce_mean(tensors, "world", "sync")

    def _enter(self, at: Tuple[str, int]) -> None:
        """Switch phase if the schedule says so: sync after grouped, factorise before grouped."""
        (phase, cycle), previous = at, (self.phase, self.cycle)
        if (phase, cycle) == previous or (phase != "grouped" and phase == previous[0]):
            return
        if previous[0] == "grouped":
            self._sync()
        if phase == "grouped":
            first = not self.compression_history
            self._factorize_all(cut=self.cut_first or not first)
        if self.phase is not None:
            self.switches += 1
            self._since_switch = 0
            self._slope = max(0.0, self.base_lr - self.ramp_start_lr) / self.ramp_steps if self.ramp_steps else None
            if self.reset_optimizer:
                self.optimizer.state.clear()
        self.phase, self.cycle = phase, cycle

    # ---- the optimizer-like interface -----------------------------------------------------------
    @property
    def param_groups(self):
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    def parameters(self) -> List[torch.nn.Parameter]:
        """Parameters trained in the current phase (clip these): every model parameter in
        full-rank phases; the unfactorised ones and the trained factors while grouped."""
        if self.phase != "grouped":
            return [p for _, p in self.named]
        return [p for _, p in self.always_full] + [f.a if self.trains() == "A" else f.b for f in self.factorized]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the factors' gradients."""
        self.model.zero_grad(set_to_none=set_to_none)
        for f in self.factorized:
            f.a.grad = f.b.grad = None

    def synchronize(self) -> None:
        """Average gradients: over all ranks in full-rank phases; while grouped, the trained
        factor's gradient (and, scope "group", the unfactorised parameters') within the group.
        Gradients of weights not trained in the phase are set to None."""
        for _, p in self.named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.phase != "grouped":
            self._allreduce_mean([p.grad for _, p in self.named], "world", self.phase)
        else:
            with self.timer.phase("compress"):
                grads = []
                for f in self.factorized:
                    gw = f.view(f.param.grad)
                    if self.trains() == "A":
                        f.a.grad = gw @ f.b.detach().t()
                        grads.append(f.a.grad)
                    else:
                        f.b.grad = f.a.detach().t() @ gw
                        grads.append(f.b.grad)
                    f.param.grad = None
            rest = [p.grad for _, p in self.always_full]
            if self.unfactorized_scope == "world":
                self._allreduce_mean(rest, "world", "grouped")
            else:
                grads = grads + rest
            self._allreduce_mean(grads, "group", "grouped")
        self.timer.add_bytes(dense=self.dense_bytes_per_step)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Compatibility with DistributedOptimizer's pattern: step() never synchronizes itself."""
        yield

    def current_lr(self) -> float:
        """The learning rate of the next step: ``base_lr``, or the rebound's while it lasts."""
        k = self._since_switch + 1
        if self._slope is None or k > self.ramp_steps:
            return self.base_lr
        return min(self.base_lr, self._slope * k)

    def step(self) -> None:
        """Optimizer step at :meth:`current_lr`, then W = A·B, then advance the schedule."""
        lr = self.current_lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        if self.phase == "grouped":
            for f in self.factorized:
                f.set_weight(f.a.detach() @ f.b.detach())
        self.steps_by_phase[self.phase] += 1
        self.step_count += 1
        self._since_switch += 1
        self._enter(self.phase_at(self.step_count))

    def model_compression(self) -> dict:
        """The model size now: :func:`model_compression` with the kept ranks while grouped, the
        full model (ratio 1) in full-rank phases."""
        return model_compression(self.named, self.ranks_kept if self.phase == "grouped" else {})

    def communication_report(self) -> dict:
        """This rank's bytes sent per phase (all, and in collectives spanning nodes), the dense
        bytes full-rank data parallelism would send (every gradient, fp32, every step), the
        traffic ratio of this rank, and the model compression: at the last factorisation
        (``model_compression``, the paper's 44.14:1 kind) and at every one (``compression_history``).
        Combine the reports of all ranks with :func:`traffic_summary`."""
        sent = sum(self.bytes_by_phase.values())
        between = sum(self.internode_bytes_by_phase.values())
        dense = self.dense_bytes_per_step * self.step_count
        last = self.compression_history[-1] if self.compression_history else model_compression(self.named, {})
        return {"bytes_by_phase": dict(self.bytes_by_phase),
                "internode_bytes_by_phase": dict(self.internode_bytes_by_phase),
                "steps_by_phase": dict(self.steps_by_phase), "dense_bytes": dense, "bytes_sent": sent,
                "internode_bytes_sent": between, "traffic_ratio": dense / sent if sent else None,
                "nodes": len(set(self.nodes)), "node": self.nodes[self.world.Get_rank()],
                "group": self.group_index, "ranks_kept": dict(self.ranks_kept),
                "model_compression": {k: last[k] for k in ("full_parameters", "parameters", "ratio")},
                "compression_history": list(self.compression_history)}
