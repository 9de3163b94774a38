"""The study's training schedule: linear warm-up, validation-driven annealing (PyTorch's
``word_language_model`` example divides the learning rate by 4 after an epoch without
improvement), early stopping (the seed study: ``patience`` epochs without improvement). It
computes learning rates rather than wrapping an optimizer, so that AB-training can rebound them
at each stage switch: the caller writes the value where its optimizer reads it.
"""
from __future__ import annotations

import math

__all__ = ["PlateauSchedule"]


class PlateauSchedule:
    """Learning rate per optimizer step, annealed on validation plateaus, with early stopping.

    Args:
        lr: the peak learning rate (after warm-up, before any annealing).
        anneal: divide the learning rate by this after ``anneal_patience`` + 1 epochs in a row
            without a new best validation perplexity (4 in PyTorch's example; 1 never anneals).
        anneal_patience: epochs without improvement tolerated before annealing (0: anneal after
            the first epoch that does not improve, as PyTorch's example does).
        early_stop: stop after this many epochs in a row without improvement (0: never; the seed
            study uses 10).
        min_epochs: never stop before this many epochs (the first epochs of a run can swing
            widely while it leaves the initial plateau).
        warmup_steps: raise the learning rate linearly from ``lr / warmup_steps`` to ``lr`` over the
            first ``warmup_steps`` optimizer steps (0: no warm-up).
        min_improvement: an epoch counts as improving when its validation perplexity is below
            ``best * (1 - min_improvement)`` (0: any decrease); a smaller decrease is a plateau for
            annealing and early stopping, but still a new ``best`` (whose weights a caller keeps).

    Raises:
        ValueError: ``lr`` not positive and finite, ``anneal < 1``, negative patience or warm-up,
            ``min_improvement`` outside [0, 1).

    Example::

        sched = PlateauSchedule(20.0, anneal=4, early_stop=3, warmup_steps=50)
        for epoch in ...:
            for step in ...:
                for g in opt.param_groups: g["lr"] = sched.lr_at(global_step)
            if sched.end_epoch(val_ppl): break   # True: stop early
    """

    def __init__(self, lr: float, anneal: float = 4.0, anneal_patience: int = 0, early_stop: int = 0,
                 warmup_steps: int = 0, min_improvement: float = 0.0, min_epochs: int = 0):
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {lr}")
        if not anneal >= 1:
            raise ValueError(f"anneal must be >= 1 (1 keeps the learning rate), got {anneal}")
        for key, val in (("anneal_patience", anneal_patience), ("early_stop", early_stop),
                         ("warmup_steps", warmup_steps), ("min_epochs", min_epochs)):
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {val!r}")
        if not 0.0 <= min_improvement < 1.0:
            raise ValueError(f"min_improvement must be in [0, 1), got {min_improvement}")
        self.anneal, self.anneal_patience, self.early_stop = float(anneal), anneal_patience, early_stop
        self.warmup_steps, self.min_improvement = warmup_steps, float(min_improvement)
        self.min_epochs = min_epochs
        self.lr = float(lr)                 # current post-warm-up learning rate (annealed)
        self.best = math.inf                # best validation perplexity so far
        self.best_epoch = 0                 # 1-based epoch of ``best`` (0: none yet)
        self.epochs = 0                     # epochs reported to end_epoch
        self.bad_epochs = 0                 # epochs in a row without improvement
        self.plateau = 0                    # of those, epochs since the last anneal
        self.anneals = 0                    # times the learning rate was divided

    def lr_at(self, step: int) -> float:
        """The learning rate for optimizer step ``step`` (0-based, counted over the whole run)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    def end_epoch(self, val_ppl: float) -> bool:
        """Record an epoch's validation perplexity; anneal if it is a plateau.

        Returns:
            True when training should stop (``early_stop`` epochs in a row without improvement
            once ``min_epochs`` are done, or a non-finite perplexity: a diverged run cannot recover
            by annealing).
        """
        self.epochs += 1
        significant = False
        if math.isfinite(val_ppl) and val_ppl < self.best:
            significant = val_ppl < self.best * (1.0 - self.min_improvement)
            self.best, self.best_epoch = float(val_ppl), self.epochs
        if significant:
            self.bad_epochs = self.plateau = 0
            return False
        self.bad_epochs += 1
        self.plateau += 1
        if not math.isfinite(val_ppl):
            return True
        if self.anneal > 1 and self.plateau > self.anneal_patience:
            self.lr /= self.anneal
            self.anneals += 1
            self.plateau = 0
        return bool(self.early_stop) and self.bad_epochs >= self.early_stop and self.epochs >= self.min_epochs

    @property
    def improved(self) -> bool:
        """Whether the last epoch set a new best validation perplexity (by any amount)."""
        return self.epochs > 0 and self.best_epoch == self.epochs

    def state_dict(self) -> dict:
        """Everything needed to resume (plain numbers)."""
        return {k: getattr(self, k) for k in ("lr", "best", "best_epoch", "epochs", "bad_epochs", "plateau", "anneals")}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s numbers."""
        for k, v in state.items():
            setattr(self, k, v)
