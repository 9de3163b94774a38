"""AB-training's schedule: which stage an optimizer step is in, and the learning-rate rebound.

Stages (the word "phase" belongs to :class:`hvdcomp.metrics.PhaseTimer`: compute, compress,
communicate, decompress)::

    warmup      warmup_steps full-rank steps
    grouped     steps_between_syncs steps inside the rank groups   ┐ one cycle,
    sync        (no step of its own: the bytes that end a grouped   │ repeated
                stage, and the kept-rank agreements of a cut)       │
    full-rank   full_rank_steps steps over all ranks               ┘

Coquelin et al., "AB-Training: A Communication-Efficient Approach for Distributed Low-Rank
Learning", arXiv:2405.01067 (2024); the rebound is their trainer's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..checks import check_count, check_range

__all__ = ["STAGES", "Schedule", "Rebound"]

#: AB-training's stages, in the order a cycle meets them
STAGES = ("warmup", "grouped", "sync", "full-rank")


@dataclass(frozen=True)
class Schedule:
    """The stage of every optimizer step (pure).

    Args (fields):
        warmup_steps: full-rank steps before the first factorisation (≥ 0).
        steps_between_syncs: grouped steps per cycle (≥ 1).
        full_rank_steps: full-rank steps after each sync (≥ 0).

    Raises:
        ValueError: a count that is not an integer in range.
    """

    warmup_steps: int
    steps_between_syncs: int
    full_rank_steps: int

    def __post_init__(self):
        for name, low in (("warmup_steps", 0), ("steps_between_syncs", 1), ("full_rank_steps", 0)):
            object.__setattr__(self, name, check_count(getattr(self, name), name, low))

    def stage_at(self, step: int) -> Tuple[str, int]:
        """(stage, cycle) of the 0-based optimizer step ``step``: stage ``"warmup"``, ``"grouped"``
        or ``"full-rank"``; cycle counts grouped + full-rank rounds (-1 during warm-up)."""
        if step < self.warmup_steps:
            return "warmup", -1
        cycle, pos = divmod(step - self.warmup_steps, self.steps_between_syncs + self.full_rank_steps)
        return ("grouped" if pos < self.steps_between_syncs else "full-rank"), cycle

    @staticmethod
    def is_switch(previous: Tuple[Optional[str], Optional[int]], now: Tuple[str, int]) -> bool:
        """Whether going from ``previous`` (stage, cycle) to ``now`` switches stage: a new grouped
        cycle always does (a cycle without full-rank steps goes grouped → grouped), any other stage
        only when it differs from the previous one."""
        if now == previous:
            return False
        return now[0] == "grouped" or now[0] != previous[0]


class Rebound:
    """The authors' learning-rate rebound after each switch. With
    ``slope = (lr_s − ramp_start_lr) / ramp_steps``, lr_s being ``base_lr`` at the first step
    after the switch, that step runs at ``min(ramp_start_lr, slope)`` and the k-th
    (k = 2 … ramp_steps) at ``min(base_lr, k·slope)``; ``base_lr`` before the first switch, after
    the ramp, and always when ``ramp_steps`` is 0. Where lr_s < ``ramp_start_lr`` the slope is 0
    (the authors' would be negative). How this follows their trainer: docs/ab-training.md.

    Args:
        ramp_steps: steps of the ramp (≥ 0; the authors: 267 on VGG16).
        ramp_start_lr: the first step's rate, and where the ramp's slope is measured from (the
            authors: 1e-5).

    Raises:
        ValueError: ``ramp_steps`` not an integer ≥ 0, ``ramp_start_lr`` not a finite number ≥ 0.
    """

    __slots__ = ("ramp_steps", "ramp_start_lr", "since_switch", "active", "switch_lr")

    def __init__(self, ramp_steps: int, ramp_start_lr: float):
        self.ramp_steps = check_count(ramp_steps, "ramp_steps", 0)
        self.ramp_start_lr = check_range(ramp_start_lr, "ramp_start_lr", 0.0)
        self.since_switch, self.active, self.switch_lr = 0, False, None

    def restart(self) -> None:
        """A switch happened: the next step is the rebound's first."""
        self.since_switch, self.active, self.switch_lr = 0, self.ramp_steps > 0, None

    def advance(self, base_lr: float) -> None:
        """One optimizer step was taken with ``base_lr`` as the schedule's rate (the first step
        after a switch fixes lr_s)."""
        if self.active and self.since_switch == 0:
            self.switch_lr = float(base_lr)
        self.since_switch += 1

    def lr(self, base_lr: float) -> float:
        """The learning rate of the next step, ``base_lr`` being the schedule's rate for it."""
        k = self.since_switch + 1
        if not self.active or k > self.ramp_steps:
            return base_lr
        lr_s = base_lr if self.switch_lr is None else self.switch_lr
        slope = max(0.0, lr_s - self.ramp_start_lr) / self.ramp_steps
        if k == 1:
            return min(self.ramp_start_lr, slope)
        return min(base_lr, k * slope)
