"""Local AdaAlter: AdaGrad-type local steps with the denominator frozen between synchronizations.

Xie, Koyejo, Gupta and Lin, "Local AdaAlter: Communication-Efficient Stochastic Gradient Descent
with Adaptive Learning Rates", 2019 (arXiv:1911.09030). Every rank keeps, per parameter, the
denominator b (frozen during a round) and a running accumulator s of squared gradients::

    θ ← θ − η·(g / sqrt(b + ε) + w·θ)       (AdaAlter: b excludes the current g²)
    s ← s + g²                              (local, no communication)

and every H steps the parameters (as every mode's Δ, through the pipeline: compression applies)
and the accumulators (uncompressed allreduce) are averaged over the ranks, and ``b ← s ← mean
over ranks of s``. The first ``warmup_steps`` steps are fully synchronous (gradients averaged,
``b ← s ← s + ḡ²`` after each). Defaults follow the authors' optimizer (ε = 1e-7, H = 4; their
language-model script sets ε = 1 and warms the learning rate up): ``docs/local-update.md``.
"""
from __future__ import annotations


import torch

from ..agreement import averaged_verdict
from ..checks import check_count, check_real
from .base import LocalUpdate, optimizer_settings
from .outer import outer_sgd

__all__ = ["AdaAlter", "LocalAdaAlter"]


class AdaAlter(torch.optim.Optimizer):
    """The AdaAlter inner update (see the module docstring).

    Args:
        params: the model's parameters.
        lr: η > 0.
        eps: ε > 0 inside the square root (1e-7).
        weight_decay: w ≥ 0 (0).

    Attributes:
        synchronous: the accumulator also becomes the denominator after every step (the
            synchronous warm-up); set by :class:`LocalAdaAlter`.

    State per parameter: ``denominator`` (b) and ``accumulator`` (s), zeros at first.

    Raises:
        ValueError: ``lr`` or ``eps`` not a finite number > 0, ``weight_decay`` not a finite
            number >= 0.
    """

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-7, weight_decay: float = 0.0):
        lr = check_real(lr, "AdaAlter's lr", lambda v: v > 0, "> 0 and finite")
        eps = check_real(eps, "AdaAlter's eps", lambda v: v > 0, "> 0 and finite")
        weight_decay = check_real(weight_decay, "AdaAlter's weight_decay", lambda v: v >= 0, ">= 0 and finite")
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay})
        self.synchronous = False

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter with a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state["denominator"] = torch.zeros_like(p)
                    state["accumulator"] = torch.zeros_like(p)
                update = g / (state["denominator"] + group["eps"]).sqrt()
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                state["accumulator"].addcmul_(g, g)
                if self.synchronous:
                    state["denominator"].copy_(state["accumulator"])
        return loss


class LocalAdaAlter(LocalUpdate):
    """Local AdaAlter (see the module docstring): wraps an :class:`AdaAlter` optimizer.

    Args:
        optimizer: an :class:`AdaAlter` over the model's parameters.
        named_parameters: ``model.named_parameters()``.
        local_steps: H ≥ 1 (4).
        warmup_steps: fully synchronous steps first (1, the authors' script default).
        compression: the method that carries the parameters' Δ (default ``"none"``).
        **kwargs: :class:`~hvdcomp.local.base.LocalUpdate`'s and the pipeline's.

    Raises:
        TypeError: ``optimizer`` is not an :class:`AdaAlter`.
        ValueError: ``warmup_steps`` < 0, and :class:`~hvdcomp.local.base.LocalUpdate`'s.
    """

    algorithm = "adaalter"

    def __init__(self, optimizer: AdaAlter, named_parameters=None, *, local_steps: int = 4, warmup_steps: int = 1,
                 compression="none", **kwargs):
        if not isinstance(optimizer, AdaAlter):
            raise TypeError("LocalAdaAlter wraps hvdcomp.local.AdaAlter(model.parameters(), lr=...), got "
                            f"{type(optimizer).__name__}; other optimizers go with hvdcomp.local.DiLoCo")
        self.warmup_steps = check_count(warmup_steps, "warmup_steps", 0)
        self._warmup_bytes = 0  # sent (= received) by the warm-up's gradient allreduces
        self._accumulator_bytes = 0  # sent (= received) by the last round's accumulator allreduce
        super().__init__(optimizer, named_parameters, local_steps=local_steps, compression=compression,
                         outer_optimizer=outer_sgd(1.0, 0.0, False), **kwargs)

    def step(self, closure=None):
        """A synchronous step during the warm-up (gradients averaged), else a local one."""
        if not self._closed:
            self._follow_world()  # (elastic Horovod: a joining rank takes the step count first)
        if self._closed or self.steps >= self.warmup_steps:
            self.inner.synchronous = False
            return super().step(closure)
        if not self._started:
            self._start_training()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, p in self._params:  # (a parameter this rank did not use: zeros, as the pipeline sends)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for _, p in self._params]
        self._warmup_bytes += self._average(grads, "grad")
        if not averaged_verdict(grads, self.sync.nonfinite):  # (skipped on every rank, as a dropped round)
            self.skipped_rounds += 1
            return loss
        self.inner.synchronous = True
        self.inner.step()
        self.inner.synchronous = False
        self.steps += 1
        with torch.no_grad():  # every rank took the same step: the round starts here
            for n, p in self._params:
                self._anchor[n].copy_(p)
        return loss

    def _average(self, tensors, what: str, dense: bool = True) -> int:
        """Average ``tensors`` in place over the ranks (Horovod allreduce, charged to
        ``communicate``; bytes counted, as dense bytes too where synchronous training sends them:
        ``dense``); returns the bytes sent (= received), 0 on one rank."""
        group = self.sync.group
        if group.size == 1 or not tensors:
            return 0
        with self.timer.phase("communicate"):
            handles = [group.allreduce_async_(t, f"{self.prefix}.{what}.{i}")
                       for i, t in enumerate(tensors)]
            for h in handles:
                group.synchronize(h)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.timer.add_bytes(sent=nbytes, received=nbytes, dense=nbytes if dense else 0)
        return nbytes

    def _states(self):
        """Every parameter's AdaAlter state (zeros where this rank never stepped it)."""
        states = [self.inner.state[p] for _, p in self._params]
        for (_, p), state in zip(self._params, states):
            if not state:
                state["denominator"], state["accumulator"] = torch.zeros_like(p), torch.zeros_like(p)
        return states

    def _run_sync(self) -> bool:
        """The parameters' Δ through the pipeline, then (unless the ranks dropped the round) the
        accumulators by allreduce, so the round's record (:meth:`LocalUpdate._reduce`) holds the
        time and bytes of both; its dense bytes stay Δ's fp32 size (synchronous training sends no
        accumulators)."""
        skipped = super()._run_sync()
        self._accumulator_bytes = 0
        if skipped:  # (the verdict is every rank's: no rank runs the allreduce)
            return True
        states = self._states()
        self._accumulator_bytes = self._average([state["accumulator"] for state in states], "accumulator",
                                                dense=False)
        for state in states:
            state["denominator"].copy_(state["accumulator"])
        return False

    @torch.no_grad()
    def _drop_round(self) -> None:
        """A dropped round (:meth:`LocalUpdate._drop_round`): the accumulators are not averaged;
        each returns to the denominator, the value it had when the round started (the last agreed
        average, the same on every rank), so the dropped round's squared gradients (NaN on the
        rank that had the non-finite one) leave no trace."""
        for state in self._states():
            state["accumulator"].copy_(state["denominator"])

    def _world_state(self):
        """The denominators (every rank's is the last agreed average of the accumulators)."""
        return [state["denominator"] for state in self._states()]

    @torch.no_grad()
    def _load_world_state(self, denominators) -> None:
        """Elastic Horovod, joining a world: the holder's denominators, and every accumulator back
        to its denominator (the round in progress is dropped, as :meth:`_drop_round` does)."""
        for state, d in zip(self._states(), denominators):
            state["denominator"].copy_(d)
            state["accumulator"].copy_(d)

    def _reduce(self):
        record = super()._reduce()
        record["accumulator_bytes"] = self._accumulator_bytes  # (the accumulators' share of bytes_sent)
        return record

    def _warmup_traffic(self):
        return {"bytes_sent": self._warmup_bytes, "bytes_received": self._warmup_bytes,
                "dense_bytes": self._warmup_bytes}

    def _mode_setup(self):
        """The warm-up length and the AdaAlter settings: every rank takes the same synchronous
        warm-up steps, which need the same lr, eps and weight decay."""
        return {"warmup_steps": self.warmup_steps, "inner": optimizer_settings(self.inner)}

    def describe(self):
        inner = self.inner.defaults
        return {**super().describe(), "warmup_steps": self.warmup_steps, "eps": inner["eps"], "lr": inner["lr"]}
