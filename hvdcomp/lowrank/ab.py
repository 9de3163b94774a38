"""AB-training: low-rank factors trained in independent groups of ranks.

Coquelin et al., "Harnessing Orthogonality to Train Low-Rank Neural Networks" / AB-training, 2024
(the seed paper of this project's low-rank work).

Schedule over optimizer steps (all counts configurable, recorded in results)::

    warm-up (full rank, all ranks average)  ->  factorise  ->
    [ grouped: steps_between_syncs steps     (each group averages only the factor it trains)
      sync:    W = mean over all ranks of A·B
      full rank: full_rank_steps steps       (all ranks average)
      factorise again ] ...

Factorising a weight W (n × m; conv weights as out × in·kh·kw) takes its SVD ``U Σ Vᵀ`` and keeps
the k singular values above ``cutoff·σ_max`` (k agreed over all ranks as the maximum):
``A = U_k √Σ_k`` (n × k), ``B = √Σ_k V_kᵀ`` (k × m). While grouped, the module keeps ``W = A·B``
as its weight; the gradient of the trained factor follows from W's gradient by the chain rule
(``∂A = ∂W·Bᵀ``, ``∂B = Aᵀ·∂W``), so any module (Linear, LSTM, conv) works unchanged.

In ``mode="ab"`` even-numbered groups train A and odd-numbered groups train B; in
``mode="only-b"`` every group trains B with A (= U√Σ) frozen. Embeddings, 1-D parameters and the
names listed in ``full_rank`` stay full rank and are always averaged over all ranks. At every
switch the learning rate ramps linearly from ``ramp_start_lr`` back to the base rate over
``ramp_steps`` steps.

Transport: mpi4py ``Allreduce`` on ``MPI.COMM_WORLD`` and on a ``Split`` sub-communicator per
group (one collective per communicator per step, all gradients packed in one buffer).
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..metrics import PhaseTimer

__all__ = ["ABTraining", "factorize", "kept_rank"]


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
    A and B have W's dtype.

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


class _Factorized:
    __slots__ = ("name", "param", "shape", "a", "b")

    def __init__(self, name, param):
        self.name, self.param, self.shape = name, param, param.shape
        self.a: Optional[torch.nn.Parameter] = None
        self.b: Optional[torch.nn.Parameter] = None

    def matrix(self) -> torch.Tensor:
        return self.param.detach().reshape(self.shape[0], -1)


class ABTraining:
    """Drives AB-training of ``model`` over MPI ranks; replaces a DistributedOptimizer.

    Args:
        model: the model (identical on every rank at start).
        optimizer_factory: ``f(params) -> torch.optim.Optimizer``; called at every switch with the
            parameters trained in the next phase (state such as momentum restarts at switches).
        groups: number of groups (must divide the world size); ranks ``[g·S/G, (g+1)·S/G)``
            form group g.
        warmup_steps, steps_between_syncs, full_rank_steps: the schedule (see the module doc).
        cutoff: keep σ_i > cutoff·σ_1 when factorising (0.1–0.15 in the paper; 0 keeps all).
        mode: ``"ab"`` or ``"only-b"``.
        ramp_steps, ramp_start_lr: learning-rate ramp after each switch.
        full_rank: parameter names that are never factorised (e.g. the first layer, the classifier).
        base_lr: the learning rate the ramp returns to (update it for schedules).

    Raises:
        ValueError: bad schedule numbers, ``groups`` not dividing the world size, unknown mode.
        RuntimeError: mpi4py unusable (e.g. ``horovodrun --gloo``).
    """

    PHASES = ("warmup", "grouped", "sync", "full-rank")

    def __init__(self, model: torch.nn.Module, optimizer_factory: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer],
                 groups: int = 2, warmup_steps: int = 100, steps_between_syncs: int = 100,
                 full_rank_steps: int = 10, cutoff: float = 0.1, mode: str = "ab",
                 ramp_steps: int = 20, ramp_start_lr: float = 1e-5, full_rank: Sequence[str] = (),
                 base_lr: float = 0.1, timer: Optional[PhaseTimer] = None, comm=None):
        for key, val, low in (("groups", groups, 1), ("warmup_steps", warmup_steps, 0),
                              ("steps_between_syncs", steps_between_syncs, 1),
                              ("full_rank_steps", full_rank_steps, 0), ("ramp_steps", ramp_steps, 0)):
            if not isinstance(val, int) or val < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {val!r}")
        if not 0.0 <= float(cutoff) < 1.0:
            raise ValueError(f"cutoff must be in [0, 1) (e.g. 0.1), got {cutoff}")
        if mode not in ("ab", "only-b"):
            raise ValueError(f"mode must be 'ab' or 'only-b', got {mode!r}")
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover
            raise RuntimeError(f"AB-training needs mpi4py: {exc}") from None
        self.MPI = MPI
        self.world = (comm or MPI.COMM_WORLD).Dup()
        size, rank = self.world.Get_size(), self.world.Get_rank()
        if size % groups:
            raise ValueError(f"groups={groups} must divide the world size {size}")
        self.group_index = rank * groups // size
        self.group = self.world.Split(color=self.group_index, key=rank)
        self.model, self.factory = model, optimizer_factory
        self.groups, self.mode, self.cutoff = groups, mode, float(cutoff)
        self.warmup_steps, self.steps_between_syncs = warmup_steps, steps_between_syncs
        self.full_rank_steps, self.ramp_steps, self.ramp_start_lr = full_rank_steps, ramp_steps, float(ramp_start_lr)
        self.base_lr = float(base_lr)
        self.timer = timer if timer is not None else PhaseTimer()
        embedding_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        unknown = set(full_rank) - {n for n, _ in self.named}
        if unknown:
            raise ValueError(f"full_rank names {sorted(unknown)} are not parameters of the model")
        self.factorized = [_Factorized(n, p) for n, p in self.named
                           if p.dim() >= 2 and id(p) not in embedding_params and n not in full_rank]
        self._fact_ids = {id(f.param) for f in self.factorized}
        self.always_full = [(n, p) for n, p in self.named if id(p) not in self._fact_ids]
        self.step_count = 0
        self.phase, self.cycle, self.switches = None, None, 0
        self._since_switch = 0
        self.optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
        self.bytes_by_phase: Dict[str, int] = defaultdict(int)
        self.steps_by_phase: Dict[str, int] = defaultdict(int)
        self.dense_bytes_per_step = 4 * sum(p.numel() for _, p in self.named)
        self.ranks_kept: Dict[str, int] = {}
        self._enter(self.phase_at(0))

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
        return "B" if self.mode == "only-b" or self.group_index % 2 else "A"

    def describe(self) -> dict:
        """The configuration and schedule, for results files."""
        return {"name": "ab-training", "groups": self.groups, "mode": self.mode, "cutoff": self.cutoff,
                "warmup_steps": self.warmup_steps, "steps_between_syncs": self.steps_between_syncs,
                "full_rank_steps": self.full_rank_steps, "ramp_steps": self.ramp_steps,
                "ramp_start_lr": self.ramp_start_lr, "factorized": [f.name for f in self.factorized]}

    # ---- communication ------------------------------------------------------------------------
    def _allreduce_mean(self, tensors: List[torch.Tensor], comm, phase: str) -> None:
        """Average ``tensors`` in place over ``comm`` with one Allreduce of a packed fp32 buffer."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors]).numpy()
        with self.timer.phase("communicate"):
            comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
        flat /= comm.Get_size()
        self.timer.add_bytes(sent=flat.nbytes, received=flat.nbytes)
        self.bytes_by_phase[phase] += flat.nbytes
        pos = 0
        for t in tensors:
            t.copy_(torch.from_numpy(flat[pos:pos + t.numel()]).view_as(t))
            pos += t.numel()

    # ---- phase switches -------------------------------------------------------------------------
    def _factorize_all(self) -> None:
        ranks = []
        with self.timer.phase("compress"):
            for f in self.factorized:
                s = torch.linalg.svdvals(f.matrix().to(torch.float32))
                ranks.append(kept_rank(s, self.cutoff))
        agreed = np.array(ranks, dtype=np.int64)
        self.world.Allreduce(self.MPI.IN_PLACE, agreed, op=self.MPI.MAX)  # the kept rank: max over ranks
        with self.timer.phase("compress"):
            for f, k in zip(self.factorized, agreed.tolist()):
                a, b = factorize(f.matrix(), rank=k)
                f.a, f.b = torch.nn.Parameter(a), torch.nn.Parameter(b)
                self.ranks_kept[f.name] = k
                with torch.no_grad():
                    f.param.copy_((a @ b).reshape(f.shape))

    def _sync_weights(self) -> None:
        """W = mean over all ranks of A·B (the module already holds A·B)."""
        self._allreduce_mean([f.param.data for f in self.factorized], self.world, "sync")
        for f in self.factorized:
            f.a = f.b = None

    def _enter(self, at: Tuple[str, int]) -> None:
        """Switch phase if the schedule says so: sync after grouped, factorise before grouped."""
        (phase, cycle), previous = at, (self.phase, self.cycle)
        if (phase, cycle) == previous or (phase != "grouped" and phase == previous[0]):
            return
        if previous[0] == "grouped":
            self._sync_weights()
        if phase == "grouped":
            self._factorize_all()
            trained = [f.a if self.trains() == "A" else f.b for f in self.factorized]
            params = [p for _, p in self.always_full] + trained
        else:
            params = [p for _, p in self.named]
        if self.optimizer is not None:
            self.switches += 1
        self.phase, self.cycle = phase, cycle
        self.optimizer = self.factory(params)
        self._since_switch = 0

    # ---- the optimizer-like interface -----------------------------------------------------------
    @property
    def param_groups(self):
        """The current phase's optimizer's parameter groups."""
        return self.optimizer.param_groups

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """Parameters updated in the current phase (clip these)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the factors' gradients."""
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Average gradients: over all ranks in full-rank phases; while grouped, the full-rank
        parameters over all ranks and the trained factor's gradient within the group."""
        for _, p in self.named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.phase != "grouped":
            self._allreduce_mean([p.grad for _, p in self.named], self.world, self.phase)
        else:
            self._allreduce_mean([p.grad for _, p in self.always_full], self.world, "grouped")
            with self.timer.phase("compress"):
                grads = []
                for f in self.factorized:
                    gw = f.param.grad.reshape(self.shape2d(f))
                    if self.trains() == "A":
                        f.a.grad = gw @ f.b.detach().t()
                        grads.append(f.a.grad)
                    else:
                        f.b.grad = f.a.detach().t() @ gw
                        grads.append(f.b.grad)
            self._allreduce_mean(grads, self.group, "grouped")
        self.timer.add_bytes(dense=self.dense_bytes_per_step)

    @staticmethod
    def shape2d(f) -> Tuple[int, int]:
        """(n, m) matrix view of a factorised weight: first dimension x the rest."""
        return f.shape[0], math.prod(f.shape[1:])

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Compatibility with DistributedOptimizer's pattern: step() never synchronizes itself."""
        yield

    def step(self) -> None:
        """Optimizer step with the ramped learning rate, then W = A·B, then advance the schedule."""
        ramp = 1.0 if self.ramp_steps == 0 or self.switches == 0 else \
            min(1.0, (self._since_switch + 1) / self.ramp_steps)
        lr = self.ramp_start_lr + (self.base_lr - self.ramp_start_lr) * ramp
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        if self.phase == "grouped":
            with torch.no_grad():
                for f in self.factorized:
                    f.param.copy_((f.a @ f.b).reshape(f.shape))
        self.steps_by_phase[self.phase] += 1
        self.step_count += 1
        self._since_switch += 1
        self._enter(self.phase_at(self.step_count))

    def communication_report(self) -> dict:
        """Bytes sent per phase (this rank) and the whole-run ratio against full-rank data
        parallelism (which would send every gradient, fp32, every step)."""
        sent = sum(self.bytes_by_phase.values())
        dense = self.dense_bytes_per_step * self.step_count
        return {"bytes_by_phase": dict(self.bytes_by_phase), "steps_by_phase": dict(self.steps_by_phase),
                "ranks_kept": dict(self.ranks_kept), "dense_bytes": dense, "bytes_sent": sent,
                "compression_ratio": dense / sent if sent else None}
