"""Checkpoints of a local-update optimizer: per-rank files (exact, mid-round too) and Horovod's
rank-0-save-and-broadcast resume. A mixin of :class:`hvdcomp.local.base.LocalUpdate`, over its
attributes (``inner``, ``outer``, ``sync``, the copies of θ_start and the round counters)."""
from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["Checkpoints"]


class Checkpoints:
    """``state_dict`` / ``load_state_dict`` / ``broadcast_state`` of a local-update optimizer."""

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Inner, outer and method state, θ_start and the round counters (tensors, numbers and
        strings only: loads with ``weights_only=True``). Save it with the model's own
        ``state_dict()`` (the local parameters). Per-rank files resume exactly, mid-round too."""
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                "sync": self.sync.state_dict(), "anchor": {n: a.detach().clone() for n, a in self._anchor.items()},
                "counters": {"steps": self.steps, "round_step": self.round_step, "rounds": self.rounds,
                             "skipped_rounds": self.skipped_rounds},
                "algorithm": self.algorithm, "world_size": self.sync.group.size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`. Every rank must load a checkpoint of the same step (or
        one rank loads, then :meth:`broadcast_state`): the next :meth:`step` compares them on every
        rank (one object allgather) and raises on every rank otherwise.

        Raises:
            ValueError: a checkpoint of another algorithm or of other parameters.
        """
        if state.get("algorithm") != self.algorithm or set(state["anchor"]) != set(self._anchor):
            raise ValueError(f"this checkpoint is of {state.get('algorithm')!r} over parameters "
                             f"{sorted(state['anchor'])[:5]}..., not of this {self.algorithm!r} optimizer's")
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        sync = state["sync"]
        self.sync.load_state_dict(sync.get("hvdcomp", sync))  # (checkpoints before 2026-12-07 hold an optimizer's)
        with torch.no_grad():
            for n, a in self._anchor.items():
                a.copy_(state["anchor"][n])
        for k, v in state["counters"].items():
            setattr(self, k, int(v))
        self._saved_size = int(state.get("world_size", 0))  # (0: a checkpoint before 2026-12-07)
        self._started, self._loaded = False, True  # (every rank compares what it loaded at its next step)

    def _global_state(self) -> Dict[str, Any]:
        """What :meth:`broadcast_state` sends besides tensors (counters)."""
        return {"steps": self.steps, "round_step": self.round_step, "rounds": self.rounds,
                "skipped_rounds": self.skipped_rounds}

    def _global_tensors(self) -> Dict[str, torch.Tensor]:
        """Tensors :meth:`broadcast_state` sends: θ_start."""
        return dict(self._anchor)

    def broadcast_state(self, root_rank: int = 0) -> None:
        """The rank-0-save-and-broadcast resume (rank ``root_rank`` of the group loaded the
        checkpoint): θ_start, the round counters and the outer and inner optimizers' state are
        broadcast from it (the optimizers' as their ``state_dict``, one object broadcast each);
        the method's shared state follows at the next round, its per-rank residuals start fresh
        elsewhere (as :func:`hvdcomp.DistributedOptimizer`). Broadcast the model too
        (``hvd.broadcast_parameters(model.state_dict(), root_rank)``, or
        ``torch.distributed.broadcast`` of each parameter). Collective over the group."""
        group = self.sync.group
        mine = group.rank == root_rank
        for opt, what in ((self.inner, "inner"), (self.outer, "outer")):
            state = group.broadcast_object(opt.state_dict() if mine else None, root_rank, f"{self.prefix}.{what}")
            if not mine:
                opt.load_state_dict(state)
        for n, t in sorted(self._global_tensors().items()):
            with torch.no_grad():
                t.copy_(group.broadcast(t.detach(), root_rank, f"{self.prefix}.{n}"))
        for k, v in group.broadcast_object(self._global_state(), root_rank, f"{self.prefix}.counters").items():
            setattr(self, k, v)
        self._started, self._loaded = True, False  # (every rank holds the root's: nothing to compare)

