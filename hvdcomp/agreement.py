"""Everything the ranks of an optimizer must agree on: the set-up at construction
(:func:`check_consistency`), compressor state restored from a checkpoint (:class:`StateAgreement`),
and, once per step, non-finite gradients, restored state and accumulation settings
(:class:`NonFiniteGuard`: every rank takes the same decision, so no rank updates while another
skips). The step's few integers travel by one small allgather, or as sums beside the gradients
where every averaged result is an allreduced one (:meth:`NonFiniteGuard.agree_summed`), or on a
step-wide method's first allreduce (:meth:`NonFiniteGuard.riding`); sums that show something to
name (a rank, a setting) fall back to the allgather, whose messages name the ranks.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import logging
import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["NONFINITE_MODES", "StepVerdict", "StepSkipped", "NonFiniteGuard", "averaged_verdict", "check_consistency", "StateAgreement",
           "digest", "parameters_digest", "check_same_start"]

NONFINITE_MODES = ("skip", "raise", "ignore")
_GRAD, _IS_SPARSE = operator.attrgetter("grad"), operator.attrgetter("is_sparse")

log = logging.getLogger(__name__)


def _non_finite(tensors: List[torch.Tensor], device) -> torch.Tensor:
    """A 0-d flag on ``device``, > 0 if any of ``tensors`` holds NaN/Inf: ``GradScaler``'s fused
    check (``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of 1), no host sync."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.ones((), dtype=torch.float32, device=device))
    return found


@dataclass
class StepVerdict:
    """What the ranks agreed for one step.

    Attributes:
        skip: some rank had a non-finite gradient and ``nonfinite="skip"``: no rank updates.
        bad_ranks: ranks (in the group) whose own gradient was non-finite.
        averaged: an averaged result was non-finite (a gradient reduced in place, an overflowed
            payload): every rank holds it, so it names no rank.
    """

    skip: bool
    bad_ranks: List[int]
    averaged: bool = False


class StepSkipped(Exception):
    """The ranks agreed to skip this step (raised on every rank by :meth:`NonFiniteGuard.riding`'s
    first collective; ``verdict``: the :class:`StepVerdict`)."""

    def __init__(self, verdict: "StepVerdict"):
        super().__init__(f"step skipped: non-finite gradient on rank(s) {verdict.bad_ranks}")
        self.verdict = verdict


class NonFiniteGuard:
    """Detects NaN/Inf gradients without a host sync per tensor and agrees on them once a step.

    Args:
        mode: ``"skip"`` (every rank skips the step), ``"raise"`` (``FloatingPointError`` on
            every rank) or ``"ignore"`` (no check: no flag is computed).

    Raises:
        ValueError: unknown ``mode``.
    """

    def __init__(self, mode: str = "skip"):
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}; got {mode!r}")
        self.mode = mode
        self._flags: List[torch.Tensor] = []  # per observe() and device: > 0 if non-finite
        self._averaged: List[torch.Tensor] = []  # the same, for averaged results (observe(averaged=True))
        self._layout = None  # (params, their number, [(device, parameters checked)]): observe_gradients

    def observe(self, tensors: Sequence[torch.Tensor], averaged: bool = False) -> None:
        """Fold the finiteness of ``tensors`` (dense or sparse, any devices) into this step's flag:
        one fused check per device (``_non_finite``), no host sync.

        ``averaged``: the tensors are averaged results, identical on every rank (a gradient
        reduced in place, an overflowed payload read as NaN). A non-finite one skips the step
        like a rank's own, but names no rank: every rank holds it, and the rank it came from is
        not known (naming every rank would blame ranks whose gradients were finite)."""
        if self.mode == "ignore" or not tensors:
            return
        flags = self._averaged if averaged else self._flags
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for t in tensors:
            t = t.coalesce().values() if t.is_sparse else t
            if t.is_floating_point() and t.numel():
                by_device.setdefault(t.device, []).append(t)
        for device, group in by_device.items():
            flags.append(_non_finite(group, device))

    def observe_gradients(self, params: Sequence[torch.Tensor], exclude=(), only=None, averaged: bool = False) -> None:
        """:meth:`observe` of the parameters' gradients (``.grad``, those that are not None), all
        of them or the positions in ``only``, less the positions in ``exclude``.

        Which gradients the fused check takes (floating, non-empty) and on which device is a
        property of the parameters (a gradient has its parameter's dtype, shape and device), so
        for all of them it is decided once per ``params`` list and cached: a step then reads the
        ``.grad`` of each device's parameters and runs one check per device. A sparse gradient
        goes through :meth:`observe`. ``averaged``: as for :meth:`observe`."""
        if self.mode == "ignore":
            return
        if only is not None or exclude:
            chosen = sorted(only) if only is not None else [i for i in range(len(params)) if i not in exclude]
            self.observe([params[i].grad for i in chosen if params[i].grad is not None], averaged)
            return
        cached = self._layout
        if cached is None or cached[0] is not params or cached[1] != len(params):
            by_device: Dict[torch.device, List[torch.Tensor]] = {}
            for p in params:
                if p.is_floating_point() and p.numel():
                    by_device.setdefault(p.device, []).append(p)
            cached = self._layout = (params, len(params), list(by_device.items()))
        for device, group in cached[2]:
            grads = list(map(_GRAD, group))
            if any(map(operator.is_, grads, itertools.repeat(None))) or any(map(_IS_SPARSE, grads)):
                self.observe([g for g in grads if g is not None], averaged)
                continue
            (self._averaged if averaged else self._flags).append(_non_finite(grads, device))

    def reset(self) -> None:
        """Forget this step's flags (the step was discarded)."""
        self._flags, self._averaged = [], []

    def read(self) -> Tuple[bool, bool]:
        """(whether this rank's own gradients held a non-finite value this step, whether an
        averaged result did): the step's flags read in one host read per device (on CUDA, the
        step's one synchronisation with the host)."""
        flags, own = self._flags + self._averaged, len(self._flags)
        values = [0.0] * len(flags)
        for device in {f.device for f in flags}:
            at = [i for i, f in enumerate(flags) if f.device == device]
            for i, v in zip(at, torch.stack([flags[i] for i in at]).tolist()):
                values[i] = v
        return any(values[:own]), any(values[own:])

    def agree(self, exchange: Callable[[Sequence[int]], List[List[int]]], loaded: bool,
              backward_passes: int) -> StepVerdict:
        """Exchange this rank's flags and decide the step on every rank alike.

        Args:
            exchange: ``f(ints) -> [ints of rank 0, ints of rank 1, ...]`` (a small allgather).
            loaded: this rank ran ``load_state_dict`` since the previous step.
            backward_passes: this rank's ``backward_passes_per_step``.

        Raises:
            FloatingPointError: a non-finite gradient with ``mode="raise"`` (on every rank).
            RuntimeError: ranks disagree on ``backward_passes_per_step``, or some (not all)
                ranks loaded a checkpoint mid-training (on every rank, naming them).
        """
        local, averaged = self.read()  # (averaged: identical on every rank, no exchange)
        mine = [int(local), int(loaded), int(backward_passes)]
        self.reset()
        every = exchange(mine)
        passes = sorted({row[2] for row in every})
        if len(passes) > 1:
            raise RuntimeError(f"ranks disagree on backward_passes_per_step ({[row[2] for row in every]} "
                               "by rank): call set_backward_passes_per_step() with the same value on "
                               "every rank")
        loaders = [r for r, row in enumerate(every) if row[1]]
        if loaders and len(loaders) < len(every):
            raise RuntimeError(
                f"load_state_dict() ran on rank(s) {loaders} only, after training had started: "
                "compressor state (step counters, shared low-rank factors) now differs between "
                "ranks. Load the checkpoint on every rank, or on rank 0 before the first step "
                "followed by hvd.broadcast_parameters and hvd.broadcast_optimizer_state (hvdcomp "
                "then shares the state at the first step).")
        return self._verdict([r for r, row in enumerate(every) if row[0]], averaged)

    def decide(self, group, gatherer, summed, loaded: bool, backward_passes: int) -> StepVerdict:
        """This step's verdict in ``group`` (a :class:`hvdcomp.comm.group.Group`, or any group
        with ``size``): from the summed row started by :meth:`launch_summed` (``summed``, a
        Horovod handle) where there is one, else by the small allgather of ``gatherer``
        (``allgather_ints``: :meth:`hvdcomp.comm.allgatherv.Allgatherer.allgather_ints`,
        :meth:`hvdcomp.comm.torchdist.TorchDistGroup.allgather_ints`); alone when one rank.

        Raises:
            As :meth:`agree`.
        """
        if summed is not None:
            return self.agree_summed(group.synchronize(summed).tolist(), gatherer.allgather_ints, loaded,
                                     backward_passes)
        if group.size > 1:
            return self.agree(gatherer.allgather_ints, loaded, backward_passes)
        return self.agree(lambda v: [list(v)], loaded, backward_passes)

    def launch_summed(self, group, loaded: bool, backward_passes: int, name: str):
        """Start this rank's :meth:`summary` row as a summed Horovod allreduce in ``group`` (which
        Horovod fuses with the gradients' allreduces); returns the handle for :meth:`decide`."""
        row = self.summary(loaded, backward_passes)
        return group.allreduce_async(torch.tensor(row, dtype=torch.float64), name, average=False)

    # ---- the same decision from sums (gradients reduced in place) ------------------------------
    def summary(self, loaded: bool, backward_passes: int) -> List[float]:
        """This rank's row for :meth:`agree_summed`, to be summed over ranks (exact in float64
        for these integers): ``[1, loaded, passes, passes²]``."""
        return [1.0, float(bool(loaded)), float(backward_passes), float(backward_passes) ** 2]

    def agree_summed(self, sums: Sequence[float], exchange: Callable[[Sequence[int]], List[List[int]]],
                     loaded: bool, backward_passes: int, flags: Optional[Tuple[bool, bool]] = None) -> StepVerdict:
        """:meth:`agree` from the summed :meth:`summary` rows, for a step whose flags were all
        observed on allreduced results (identical on every rank): non-finite results are every
        rank's verdict, naming no rank (:meth:`observe`'s ``averaged``). Falls back to
        :meth:`agree` (on every rank alike: the choice depends on the sums only) when the sums show
        a setting to name (a rank that loaded alone, different ``backward_passes_per_step``).
        ``flags``: :meth:`read`'s result where the caller read it already (one host read a step).

        Raises:
            As :meth:`agree`.
        """
        n, loaders, total, squares = (float(v) for v in sums)
        if 0 < loaders < n or total * total != n * squares:
            return self.agree(exchange, loaded, backward_passes)
        averaged = any(self.read() if flags is None else flags)  # (every flag here is on averaged results)
        self.reset()
        return self._verdict([], averaged)

    def riding(self, allreduce_mean: Callable[[torch.Tensor, str], torch.Tensor], size: int,
               exchange: Callable[[Sequence[int]], List[List[int]]], loaded: bool,
               backward_passes: int) -> Callable[[torch.Tensor, str], torch.Tensor]:
        """``allreduce_mean`` (``f(tensor, name) -> mean over the size ranks``, a step-wide method's
        collective) with this step's verdict riding on its first call, in place of :meth:`agree`'s
        allgather before the step: this rank's :meth:`summary` row and its non-finite flag (5
        floats, summed: exact) are appended to that float32/float64 tensor. Every rank decides
        alike from the sums by :meth:`agree_summed` (no rank's gradient was non-finite, so its
        flags are averaged ones); a non-finite gradient (its rank is to be named) falls back to
        :meth:`agree`'s allgather, as a setting to name does. A skip raises
        :class:`StepSkipped` from that first call, on every rank (the method's state is staged:
        the front-end rolls it back). A first tensor of another dtype is preceded by :meth:`agree`;
        after a step without a call, the returned function's ``settle()`` takes the verdict.
        Mode ``"ignore"``: ``allreduce_mean`` as it is (no verdict, as :meth:`agree` is not called).

        Raises:
            StepSkipped, and as :meth:`agree` (from the first call).
        """
        pending = [] if self.mode == "ignore" else [True]

        def decide(sums=None, flags=None):
            pending.clear()
            verdict = (self.agree(exchange, loaded, backward_passes) if sums is None or sums[4] else
                       self.agree_summed(sums[:4], exchange, loaded, backward_passes, flags))
            if verdict.skip:
                raise StepSkipped(verdict)

        def call(tensor: torch.Tensor, name: str) -> torch.Tensor:
            if not pending:
                return allreduce_mean(tensor, name)
            if tensor.dtype not in (torch.float32, torch.float64):
                decide()
                return allreduce_mean(tensor, name)
            flags = self.read()
            row = tensor.new_tensor(self.summary(loaded, backward_passes) + [float(flags[0])])
            out = allreduce_mean(torch.cat([tensor.reshape(-1), row]), name)
            decide((out[-row.numel():].double() * size).round().tolist(), flags)
            return out[:-row.numel()].view_as(tensor)

        call.settle = lambda: decide() if pending else None  # (a step that made no call: the allgather)
        return call

    def _verdict(self, bad: List[int], averaged: bool = False) -> StepVerdict:
        """Raise, warn or skip for the ranks in ``bad`` and a non-finite averaged result (see
        ``mode``)."""
        if not bad and not averaged:
            return StepVerdict(skip=False, bad_ranks=[])
        what = [f"on rank(s) {bad}"] if bad else []
        if averaged:
            what.append("in an averaged result (a gradient averaged in place, as 'none' does, or an "
                        "overflowed compressed sum: the rank it came from is not known)")
        where = " and ".join(what)
        if self.mode == "raise":
            raise FloatingPointError(f"non-finite gradient (NaN or Inf) {where}; no update was applied. "
                                     "Lower the learning rate, check the loss, or use nonfinite='skip' to "
                                     "skip such steps.")
        log.warning("hvdcomp: non-finite gradient %s: step skipped on every rank (compressor state kept as "
                    "before the step)", where)
        return StepVerdict(skip=True, bad_ranks=bad, averaged=averaged)


# ---- at construction: the set-up ----------------------------------------------------------------
_SETUP = ("the training set-up (build the same model, compressor and optimizer settings on every rank, "
          "in the same order)")


def check_consistency(group, signature: dict, name: str, setup: str = _SETUP) -> None:
    """All ranks of ``group`` must have the same ``signature`` (settings and the parameter list:
    names, shapes, order; one object allgather). ``group``: any group with ``allgather_object(obj,
    name)`` (:class:`hvdcomp.comm.group.Group`, :class:`hvdcomp.comm.torchdist.TorchDistGroup`).

    Args:
        setup: what is compared and how to fix it, for the error message.

    Raises:
        ValueError: on every rank, naming the first differences.
    """
    every = group.allgather_object(signature, name=name)
    diffs = []
    for rank, other in enumerate(every):
        if other == every[0]:
            continue
        for key in [*every[0], *(k for k in other if k not in every[0])]:  # (a key one side lacks: absent)
            if key != "parameters" and other.get(key, "absent") != every[0].get(key, "absent"):
                diffs.append(f"rank {rank} {key} {other.get(key, 'absent')} != rank 0 {every[0].get(key, 'absent')}")
        a, b = every[0]["parameters"], other["parameters"]
        if len(a) != len(b):
            diffs.append(f"rank {rank} has {len(b)} parameters, rank 0 has {len(a)}")
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:
            diffs.append(f"parameter #{first}: rank {rank} {b[first]} != rank 0 {a[first]}")
    if diffs:
        raise ValueError(f"ranks disagree on {setup}: " + "; ".join(diffs[:10]))


def digest(obj) -> str:
    """A stable hash (SHA-256 hex) of a state dict (tensors, numbers, strings)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


# ---- at the first step: the parameters training starts from -----------------------------------
def parameters_digest(tensors: Dict[str, torch.Tensor]) -> List[int]:
    """:func:`digest` of the values of ``tensors`` (by name) as 32 integers in [0, 255], for
    :func:`check_same_start` (one serialisation of the tensors, on the host)."""
    return list(bytes.fromhex(digest({n: t.detach() for n, t in tensors.items()})))


def check_same_start(every: Sequence[Sequence[int]], what: str) -> None:
    """Every rank must start ``what`` from the same parameters. ``every``: each rank's
    :func:`parameters_digest`, in rank order (from one allgather: identical on every rank, so
    every rank raises alike). Each front-end checks it at its first step, after the user's
    ``hvd.broadcast_parameters`` (which may run after construction).

    Raises:
        RuntimeError: ranks that differ from rank 0, naming them and the fix.
    """
    differ = [r for r, d in enumerate(every) if list(d) != list(every[0])]
    if differ:
        raise RuntimeError(f"the ranks start {what} from different parameters (rank(s) {differ} differ from "
                           "rank 0): broadcast them first, hvd.broadcast_parameters(model.state_dict(), root_rank=0)")


# ---- at the first step: restored compressor state ----------------------------------------------
class StateAgreement:
    """Whether compressor state was restored (``load_state_dict``), and making the shared part of
    it identical on every rank at the first step.

    Attributes:
        agreed: the first step's agreement ran.
        loaded: ``load_state_dict`` ran before the first step.
        loaded_since_step: ... or since the previous step (part of the per-step agreement).
    """

    def __init__(self):
        self.agreed = self.loaded = self.loaded_since_step = False

    def note_load(self) -> None:
        """``load_state_dict`` ran on this rank."""
        self.loaded = True
        self.loaded_since_step = self.agreed

    def agree(self, group, compression, skipped_steps: int, name: str) -> int:
        """At the first step: make compressor state that must be identical on every rank so.
        ``group``: any group with ``size``, ``rank``, ``allgather_object(obj, name)`` and
        ``broadcast_object(obj, root, name)``.

        Horovod's resume recipe loads a checkpoint on rank 0 only, then broadcasts parameters and
        optimizer state. Compressor state has two parts (:meth:`hvdcomp.Compressor.shared_state`):
        the shared part (step counters, PowerSGD's Q, warm-up epoch) is broadcast here from the
        first rank that loaded; the per-rank part (residuals, momenta, per-rank generators) stays
        as each rank has it: restored where a rank loaded its own, fresh (zero) elsewhere.

        Returns:
            The skipped-step count to keep (the loading rank's where state was shared).

        Raises:
            RuntimeError: ranks that loaded checkpoints whose shared state differs, or fresh ranks
                whose shared state differs (compressors built with different seeds).
        """
        self.agreed = True
        self.loaded_since_step = False
        if group.size == 1:
            return skipped_steps
        shared = compression.shared_state()
        every = group.allgather_object((self.loaded, digest(shared)), name=f"{name}.state")
        loaders = [r for r, (loaded, _) in enumerate(every) if loaded]
        pool = loaders or list(range(len(every)))
        if len({every[r][1] for r in pool}) > 1:
            raise RuntimeError(f"compressor state that must be identical on every rank (step counters, "
                               f"shared factors) differs between ranks {pool}: load the same checkpoint "
                               "everywhere, or on rank 0 only (it is then broadcast at the first step)")
        if loaders and len(loaders) < len(every):
            root = loaders[0]
            state = group.broadcast_object((shared, skipped_steps) if group.rank == root else None,
                                           root, name=f"{name}.shared")
            if not self.loaded:
                compression.load_shared_state(state[0])
                skipped_steps = state[1]
            log.info("hvdcomp: compressor state shared from rank %d (per-rank state kept where "
                     "loaded, fresh elsewhere)", root)
        return skipped_steps


def averaged_verdict(tensors: Sequence[torch.Tensor], nonfinite: str) -> bool:
    """Whether a step whose averaged results ``tensors`` (identical on every rank) are finite
    goes ahead, under ``nonfinite`` (:class:`NonFiniteGuard`; a non-finite
    averaged value names no rank): True when finite or ``"ignore"``, False (and a warning) to skip.

    Raises:
        FloatingPointError: ``nonfinite="raise"`` and a non-finite value (on every rank alike).
    """
    guard = NonFiniteGuard(nonfinite)
    guard.observe(tensors, averaged=True)
    return not guard.agree(lambda mine: [list(mine)], False, 1).skip
