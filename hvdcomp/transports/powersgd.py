"""``powersgd``: rank-r gradient compression by one warm-started power iteration per step.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019.

Per compressible gradient, viewed as a matrix M (n × m; conv weights as out × in·kh·kw), with
error feedback e and the Q kept from the previous step::

    M = grad + e ;  Q = orthogonalize(Q) ;  P = M·Q
    P = allreduce_mean(P)            # one collective for all tensors' P (and the uncompressed ones)
    P = orthogonalize(P) ;  Q = Mᵀ·P
    Q = allreduce_mean(Q)            # one collective for all tensors' Q
    Δ = P·Qᵀ ;  e = M − Δ ;  the averaged gradient is Δ

A step therefore costs two allreduces in all. Tensors where low rank saves nothing — 1-D tensors and
any with (n + m)·r·min_compression_rate ≥ n·m — travel uncompressed (exact) inside the first one.
The initial Q of every tensor comes from one generator seeded identically on all ranks (as PyTorch's
DDP ``powerSGD_hook`` seeds its own), drawn one tensor at a time, grouped by matrix shape, in the
order the front-end hands the gradients over (the expected backward order: the reverse of
``model.parameters()``); when this and ``powerSGD_hook`` agree, and their defaults: docs/ddp.md.

Robustness (no collapse). The warm start makes Q sticky: an all-zero gradient (a frozen layer,
a parameter unused in a step, which the optimizer sends as zeros) gives P = 0 and then
Q = Mᵀ·P = 0, and without care every later step would compute P = M·0 = 0 and send nothing, for
ever. So before each step, every column of the kept Q that is zero or not finite (after an
all-zero gradient, or from a restored or broadcast state) is drawn afresh from the shared
generator, and Q is orthogonalised again; a column Gram–Schmidt leaves at exactly zero (linearly
dependent on the previous ones) is redrawn the same way. Q is identical on every rank (it is the
output of an allreduce, or restored identically), so every rank makes the same decision and draws
the same numbers: no extra collective. The next non-zero gradient is then compressed as well as by
a fresh compressor. Orthogonalisation is scale-safe (:func:`hvdcomp.lowrank.orthogonalize`), so
gradients of norm 1e-23 or 1e30 (float32) are approximated as well as gradients of norm 1.
"""
from __future__ import annotations

import operator
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..checks import check_count, check_range, check_seed
from ..compressors.base import cast_saturating
from ..compressors.registry import register
from ..lowrank.orthogonalize import orthogonalize
from ..memory import Residuals
from ..plan import StepRoute, register_step_route
from .stepwide import StepMethod, StepTransport

__all__ = ["PowerSGDCompressor"]


@register("powersgd")
class PowerSGDCompressor(StepMethod):
    """PowerSGD with error feedback and warm start (a step-wide method: it reduces all
    gradients of a step together through :meth:`reduce_batch`).

    Args:
        matrix_rank: r ≥ 1, the rank of the low-rank approximation (PowerSGD paper: 1–4; PyTorch's
            ``matrix_approximation_rank``); r = min(r, n, m) per tensor. Higher r sends
            r·(n + m) floats per matrix and approximates better. ``rank=`` is its deprecated
            spelling (one release: a process rank is not a matrix rank).
        start_step: steps of plain averaging before compressing (PyTorch's
            ``start_powerSGD_iter``; 0 compresses from the first step).
        min_compression_rate: compress only if n·m > rate·(n+m)·r (1: whenever it saves bytes).
        seed: seed of the shared generator for the initial Q (the same on every rank).
        epsilon: added to column norms in Gram–Schmidt (0: none).

    Floats on the wire per step: r·(n+m) per compressed tensor plus numel of each uncompressed one.

    State: ``step``, ``q`` and ``error`` per parameter name, the generator state.

    Raises:
        ValueError: matrix_rank < 1, negative start_step, min_compression_rate < 1 or epsilon < 0.

    Example::

        opt = hvdcomp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression="powersgd:matrix_rank=2")
    """

    name = "powersgd"
    has_scaled_state = True                     # the error (residual)
    shared_state_keys = ("step", "q", "rng")    # identical on every rank after each allreduce
    verdict_rides = True                        # every step starts with allreduce_mean (float32)

    def __init__(self, matrix_rank: int = 2, start_step: int = 0, min_compression_rate: float = 1.0,
                 seed: int = 0, epsilon: float = 0.0, rank: Optional[int] = None):
        if rank is not None:
            warnings.warn("powersgd: rank= is renamed matrix_rank= (the rank of the approximation, not "
                          "a process rank); rank= will be removed in the next release", DeprecationWarning)
            matrix_rank = rank
        self.matrix_rank = check_count(matrix_rank, "matrix_rank (r)", 1, " (e.g. matrix_rank=2)")
        self.start_step = check_count(start_step, "start_step", 0)
        self.min_compression_rate = check_range(min_compression_rate, "min_compression_rate", 1.0)
        self.epsilon = check_range(epsilon, "epsilon", 0.0)
        self.seed = check_seed(seed)
        self.counters: Dict[str, int] = {"step": 0}
        self.q: Dict[str, torch.Tensor] = {}
        self._ps: Dict[tuple, torch.Tensor] = {}  # per batch's names: its last orthonormal Ps (B × n × r)
        self.memory = Residuals(self, "error")  # error feedback: M − P·Qᵀ per tensor
        self._plans: Optional[_Plan] = None  # the last step's batches (see _plan)
        self._gen = torch.Generator().manual_seed(int(np.random.RandomState(self.seed).randint(1_000_000_000)))

    def describe(self):
        return {"name": self.name, "matrix_rank": self.matrix_rank, "start_step": self.start_step,
                "min_compression_rate": self.min_compression_rate}

    def matrix_shape(self, shape: Sequence[int]) -> Tuple[int, int]:
        """(n, m) of the matrix view: first dimension × the rest (1-D: n × 1)."""
        n = shape[0] if len(shape) else 1
        return n, (int(np.prod(shape[1:])) if len(shape) > 1 else 1)

    def compressible(self, shape: Sequence[int]) -> bool:
        """Whether low rank saves bytes for a tensor of this shape."""
        n, m = self.matrix_shape(shape)
        r = min(self.matrix_rank, n, m)
        return len(shape) >= 2 and (n + m) * r * self.min_compression_rate < n * m

    def nominal_ratio(self, numel):
        """None: the ratio depends on each matrix's shape; the measured ratio is reported."""
        return None

    def reduce_batch(self, named_grads: List[Tuple[str, torch.Tensor]],
                     allreduce_mean: Callable[[torch.Tensor, str], torch.Tensor], timer) -> List[torch.Tensor]:
        """Average all gradients of a step over the ranks with two allreduces.

        Args:
            named_grads: ``(name, gradient)`` pairs in the same order on every rank.
            allreduce_mean: ``f(flat_tensor, name) -> mean over ranks`` (one collective).
            timer: a :class:`hvdcomp.metrics.PhaseTimer` (compress / decompress phases).

        Returns:
            The averaged (low-rank approximated) gradients, shapes and dtypes as given.
        """
        step = self._get("counters", "step", 0)
        self._put("counters", "step", step + 1)
        if step < self.start_step:
            flat = torch.cat([g.reshape(-1).to(torch.float32) for _, g in named_grads])
            flat = allreduce_mean(flat, "powersgd.dense").split([g.numel() for _, g in named_grads])
            return [cast_saturating(v.view_as(g), g.dtype) for v, (_, g) in zip(flat, named_grads)]
        plan = self._plan(named_grads)
        grads = [g for _, g in named_grads]
        with timer.phase("compress"):
            qs = self._warm_starts(named_grads, plan.groups)
            batches = []  # (group, M (B, n, m), P (B, n, r))
            for group in plan.groups:
                members = [grads[i] for i in group.positions]
                if group.shape is not None:  # one shape for all: one stack, one view
                    mats = torch.stack(members).view(len(members), group.n, group.m).to(torch.float32)
                else:
                    mats = torch.stack([g.reshape(group.n, group.m) for g in members]).to(torch.float32)
                # (mats is this step's own copy: the error is added, and later subtracted, in place,
                # so a step allocates two model-sized tensors, M and P·Qᵀ, as powerSGD_hook does)
                errors = self._get_segments(self.memory.store, group)
                if errors is not None:        # last step's errors: views of one (B, n, m) tensor
                    mats.add_(errors)
                else:
                    kept = self._get_many(self.memory.store, group.names)
                    if any(e is not None for e in kept):
                        mats.add_(torch.stack([torch.zeros(group.n, group.m, device=group.device) if e is None
                                               else e for e in kept]))
                batches.append((group, mats, torch.bmm(mats, qs[group.key])))
            plain = [grads[i] for i in plan.plain]
            first = torch.cat([b[2].reshape(-1) for b in batches] +
                              (plain if plan.plain_flat else [g.reshape(-1).to(torch.float32) for g in plain]))
        first = allreduce_mean(first, "powersgd.p")
        with timer.phase("compress"):
            out: List[torch.Tensor] = [None] * len(named_grads)  # type: ignore[list-item]
            pos, reduced, ps = 0, [], []
            for group, mats, p_local in batches:
                p = orthogonalize(first[pos:pos + p_local.numel()].view_as(p_local), self.epsilon)
                pos += p.numel()
                self._ps.pop(group.names, None)  # (re-inserted last: the latest P wins in :attr:`p`)
                self._ps[group.names] = p
                ps.append(p)
                reduced.append(torch.bmm(mats.transpose(1, 2), p))
            sizes = plan.plain_flat or [t.numel() for t in plain]  # (1-D float32: the averages as views)
            for i, g, v in zip(plan.plain, plain, first[pos:].split(sizes)):
                out[i] = v if plan.plain_flat else cast_saturating(v.view_as(g), g.dtype)
            second = torch.cat([q.reshape(-1) for q in reduced]) if reduced else first.new_zeros(0)
        if reduced:
            second = allreduce_mean(second, "powersgd.q")
        with timer.phase("decompress"):
            pos = 0
            for (group, mats, _), q_local, p in zip(batches, reduced, ps):
                q = second[pos:pos + q_local.numel()].view_as(q_local).clone()
                pos += q.numel()
                approx = torch.bmm(p, q.transpose(1, 2))
                self._put_segments("q", group, q)
                self.memory.keep_segments(mats.sub_(approx), group)  # e = M − P·Qᵀ (M is not read again)
                # saturating: with the error added, g + e (and so P·Qᵀ) can exceed a float16 g's range
                if group.shape is not None and group.dtype == torch.float32:
                    results = approx.view(len(group.positions), *group.shape).unbind(0)
                else:
                    results = [cast_saturating(a.reshape(grads[i].shape), grads[i].dtype)
                               for a, i in zip(approx.unbind(0), group.positions)]
                for i, result in zip(group.positions, results):
                    out[i] = result
        return out

    def _plan(self, named_grads) -> "_Plan":
        """The step's batches of equal matrix shapes and its uncompressed gradients, cached while
        the gradients' names, shapes, devices and dtypes stay the same."""
        names = [n for n, _ in named_grads]
        signature = [_SIGNATURE(g) for _, g in named_grads]
        cached = self._plans
        if cached is not None and cached.names == names and cached.signature == signature:
            return cached
        groups: Dict[tuple, List[int]] = {}  # (n, m, r, device) -> positions: one batch each
        plain = []
        for i, (shape, device, _) in enumerate(signature):
            n, m = self.matrix_shape(shape)
            if not self.compressible(shape):
                plain.append(i)
                continue
            groups.setdefault((n, m, min(self.matrix_rank, n, m), device), []).append(i)
        plan = self._plans = _Plan(names, signature, [
            _Group(key, idx, [names[i] for i in idx], [signature[i] for i in idx]) for key, idx in groups.items()],
            plain, [signature[i][0][0] for i in plain]
            if all(len(signature[i][0]) == 1 and signature[i][2] == torch.float32 for i in plain) else None)
        return plan

    def _warm_starts(self, named_grads, groups) -> Dict[tuple, torch.Tensor]:
        """Per batch of equal shapes, the orthonormal Qs (B × m × r, float32) to multiply by.

        A name's Q is last step's agreed Q (copied: the committed one stays as it was if the step
        is rolled back; one copy of the batch's Q tensor while the names' Qs are still its views),
        or fresh columns from the shared generator, drawn in ``named_grads`` order. Columns that
        are zero or not finite, and columns that orthogonalisation leaves at zero, are redrawn
        (see the module docstring). Deterministic given the Qs and the generator state, so
        identical on every rank.
        """
        # every batch's columns checked at once (two host reads a step, whatever the number of
        # batches); where one needs repair (rare), the generator is rewound and the batches are
        # redone one by one, so the draws come in the same order as always
        rewind = self._gen.get_state()
        qs = [self._start_q(group) for group in groups]
        if not _any_flag([_dead(q).any() for q in qs]):
            for q in qs:
                orthogonalize(q, self.epsilon)
            if not _any_flag([(q == 0).all(1).any() for q in qs]):
                return {group.key: q for group, q in zip(groups, qs)}
            self._gen.set_state(rewind)
        out = {}
        for group in groups:  # (in order of their first gradient)
            n, m, r, device = group.key
            q = self._start_q(group)
            for _ in range(3):  # a redrawn random column is dependent with probability 0
                dead = _dead(q)   # (B, r)
                if dead.any():
                    for b, col in dead.nonzero().tolist():
                        q[b, :, col] = self._draw(m, 1, device)[:, 0]
                orthogonalize(q, self.epsilon)
                if not (q == 0).all(1).any():
                    break
            out[group.key] = q
        return out

    def _start_q(self, group) -> torch.Tensor:
        """A batch's Qs before the repair: last step's agreed ones (a copy) or fresh columns."""
        n, m, r, device = group.key
        q = self._get_segments("q", group)
        if q is not None and tuple(q.shape[1:]) == (m, r):
            return q.clone()
        qs = [self._draw(m, r, device) if q is None or tuple(q.shape) != (m, r) else q
              for q in self._get_many("q", group.names)]
        return torch.stack(qs)  # a new tensor

    @property
    def p(self) -> Dict[str, torch.Tensor]:
        """The last orthonormal P per tensor (n × r), for inspection."""
        return {name: p for names, ps in self._ps.items() for name, p in zip(names, ps.unbind(0))}

    @property
    def step(self) -> int:
        """Steps reduced so far (committed)."""
        return self.counters["step"]

    def rescale_state(self, factor):
        """Multiply the error (gradient units) by ``factor``; Q is a direction, kept."""
        self.memory.rescale(factor)

    def _draw(self, m: int, columns: int, device) -> torch.Tensor:
        """``columns`` fresh m-vectors (float32) from the generator shared by all ranks."""
        return torch.randn(m, columns, generator=self._gen).to(device)

    def state_dict(self):
        return {"step": self.step, "q": {k: v.clone() for k, v in self.q.items()},
                "error": self.memory.state(), "rng": self._gen.get_state()}

    def load_state_dict(self, state):
        self.counters = {"step": int(state.get("step", 0))}
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}
        self.memory.load(state.get("error", {}))
        if "rng" in state:
            self._gen.set_state(state["rng"])


_SIGNATURE = operator.attrgetter("shape", "device", "dtype")


def _dead(q: torch.Tensor) -> torch.Tensor:
    """(B, r): the columns of a batch of Qs (B × m × r) that are zero or not finite."""
    return ~torch.isfinite(q).all(1) | (q == 0).all(1)


def _any_flag(flags) -> bool:
    """Whether any of the 0-d bool tensors ``flags`` is True: one host read per device."""
    return any(bool(torch.stack([f for f in flags if f.device == d]).any()) for d in {f.device for f in flags})


class _Group:
    """One batch of a step: the gradients whose matrices have one shape (n × m, rank r, one
    device). Its Qs and errors are kept as views of one (B, m, r) and one (B, n, m) tensor
    (:meth:`views`), so the next step reads each batch's state in one piece.

    Attributes:
        key: ``(n, m, r, device)``; positions, names: its gradients in the step's order.
        shape, dtype: the gradients' common shape and dtype (None where they differ).
    """

    __slots__ = ("key", "positions", "names", "n", "m", "device", "shape", "dtype")

    def __init__(self, key, positions, names, signature):
        self.key, self.positions, self.names = key, positions, tuple(names)
        self.n, self.m, _, self.device = key
        shapes = {s for s, _, _ in signature}
        dtypes = {d for _, _, d in signature}
        self.shape = next(iter(shapes)) if len(shapes) == 1 else None
        self.dtype = next(iter(dtypes)) if len(dtypes) == 1 else None

    def views(self, stacked: torch.Tensor, flat_shapes: bool = False) -> List[torch.Tensor]:
        """The per-gradient slices of a (B, ...) tensor."""
        return list(stacked.unbind(0))

    def split(self, stacked: torch.Tensor) -> List[torch.Tensor]:
        """Each gradient's slice, 1-D."""
        return [t.reshape(-1) for t in stacked.unbind(0)]


class _Plan(NamedTuple):
    """A step's layout (:meth:`PowerSGDCompressor._plan`): the names and (shape, device, dtype) of
    the gradients it was made for, the batches, the uncompressed positions, and their sizes where
    they are all 1-D float32 (sent and returned without a copy; else None)."""

    names: List[str]
    signature: List[tuple]
    groups: List[_Group]
    plain: List[int]
    plain_flat: Optional[List[int]]


def _collectives(method, numels, p, bucket_bytes):
    """None: the bytes depend on each matrix's shape (two allreduces of the factors per step)."""
    return None


register_step_route(StepRoute(PowerSGDCompressor, "allreduce", _collectives, build=StepTransport))
