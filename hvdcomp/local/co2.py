"""CO2: local updating with the outer averaging overlapped with the next round's inner steps.

Sun, Qin, Sun, Li, Li, Shen, Qiao and Zhong, "CO2: Efficient Distributed Training with Full
Communication-Computation Overlap", ICLR 2024. The reduction of round r's pseudo-gradient starts
when round r ends and runs while every rank computes round r + 1; its average is applied one
round late, when round r + 1 ends. With θ_r the global parameters round r starts from and Δ̄_r the
average of round r's pseudo-gradients Δ_r = θ_r − θ_local::

    m ← β·m + Δ̄_{r−1} / λ                 the staleness gap penalty λ ≥ 1 on the stale average
    m ← clamp(m, −φ, φ)                    outer-momentum clipping (elementwise), if φ is given
    θ_{r+1} = θ_r − α·m                     (round 0 ends with nothing to apply: θ_1 = θ_0)

The authors' released library reduces synchronously by default: that is DiLoCo with
:class:`CO2Momentum` as its outer optimizer; how it differs, and what the delay costs:
``docs/local-update.md`` ("CO2: what hvdcomp does, and the authors' code", "Staleness").

The round's reduction (the whole pipeline) runs on a background thread over the send buffers
only; the training thread touches only the live parameters and the inner optimizer until it
joins it (end of the next round, :meth:`CO2.state_dict`, :meth:`CO2.flush`), where a failure on
the thread is raised. With mpi4py, import it before Horovod (``MPI_THREAD_MULTIPLE``). Under
elastic Horovod no thread of ours issues a collective: the round's collectives are started as
Horovod asynchronous operations (:meth:`hvdcomp.reducer.Reducer.launch`) and finished at the join.
The time waited at the join is charged to ``communicate`` (``exposed_s`` per round), the rest of
the reduction's wall time ran behind the inner steps (``hidden_s``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional

import torch

from ..checks import check_real
from ..metrics import PhaseTimer
from .base import LocalUpdate

__all__ = ["CO2", "CO2Momentum", "check_co2_arguments"]

def check_co2_arguments(lr, momentum, gap_penalty, clip) -> None:
    """Raises ``ValueError`` unless α is a finite number > 0, β in [0, 1), λ a finite number >= 1
    and φ a finite number > 0 or None."""
    check_real(lr, "the outer learning rate", lambda v: v > 0, "> 0 and finite")
    check_real(momentum, "the outer momentum", lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    check_real(gap_penalty, "the staleness gap penalty (it divides the stale average)", lambda v: v >= 1.0,
               ">= 1 and finite (1: none)")
    if clip is not None:
        check_real(clip, "clip (the outer momentum's bound)", lambda v: v > 0,
                   "> 0 and finite, or None for no clipping")


class CO2Momentum(torch.optim.Optimizer):
    """CO2's outer update (see the module docstring), with the average pseudo-gradient in ``.grad``.

    Args:
        params: the copies of θ_start.
        lr: α > 0.
        momentum: β in [0, 1).
        gap_penalty: λ ≥ 1 (1: no penalty).
        clip: φ > 0, or None for no clipping.

    State: ``momentum_buffer`` per tensor (zeros at first).

    Raises:
        ValueError: a value out of range.
    """

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.5, gap_penalty: float = 1.0,
                 clip: Optional[float] = None):
        check_co2_arguments(lr, momentum, gap_penalty, clip)
        super().__init__(params, {"lr": float(lr), "momentum": float(momentum), "gap_penalty": float(gap_penalty),
                                  "clip": None if clip is None else float(clip)})

    @torch.no_grad()
    def step(self, closure=None):
        """m ← β·m + g/λ; m ← clamp(m, −φ, φ); θ ← θ − α·m, for every tensor with a ``.grad``."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = state.get("momentum_buffer")
                if m is None:
                    m = state["momentum_buffer"] = torch.zeros_like(p)
                m.mul_(group["momentum"]).add_(p.grad, alpha=1.0 / group["gap_penalty"])
                if group["clip"] is not None:
                    m.clamp_(-group["clip"], group["clip"])
                p.add_(m, alpha=-group["lr"])
        return None


class CO2(LocalUpdate):
    """CO2 (see the module docstring): DiLoCo-style rounds whose reduction overlaps the next
    round and is applied one round late, with the staleness gap penalty and momentum clipping.

    Args:
        optimizer: the inner optimizer.
        named_parameters: ``model.named_parameters()``.
        local_steps: H ≥ 1, required (the authors' library defaults to 48, too long for small
            models: see ``docs/local-update.md``); the reduction of a round is hidden when it
            takes less than H inner steps.
        compression: the method that carries Δ (default ``"none"``).
        outer_lr: α > 0 (1.0).
        outer_momentum: β in [0, 1) (0.5).
        gap_penalty: λ ≥ 1 (1.0: none).
        clip: φ > 0 or None (None: no clipping).
        **kwargs: as :class:`hvdcomp.local.DiLoCo`.

    Call :meth:`flush` (or :meth:`close`) on every rank when training ends: the last round's
    average is otherwise still in flight.

    Raises:
        ValueError: as :class:`hvdcomp.local.DiLoCo` and :class:`CO2Momentum`.
        RuntimeError: at the end of a round, when the previous reduction failed on its thread
            (under elastic Horovod, Horovod's own error, e.g. ``HorovodInternalError``).
    """

    algorithm = "co2"

    def __init__(self, optimizer, named_parameters=None, *, local_steps: int, compression="none",
                 outer_lr: float = 1.0, outer_momentum: float = 0.5, gap_penalty: float = 1.0,
                 clip: Optional[float] = None, **kwargs):
        self._round_timer = PhaseTimer(cuda_sync=False)  # the reduction's thread records here only
        self._thread: Optional[threading.Thread] = None
        self._launched = False  # (elastic Horovod) the round's collectives started, not yet finished
        self._error: Optional[BaseException] = None
        self._inflight: Dict[str, Any] = {}
        self.pending = False  # Δ̄ of the previous round is in the send buffers, to apply (never a dropped round's)
        check_co2_arguments(outer_lr, outer_momentum, gap_penalty, clip)
        super().__init__(optimizer, named_parameters, local_steps=local_steps, compression=compression,
                         outer_optimizer=lambda t: CO2Momentum(t, outer_lr, outer_momentum, gap_penalty, clip),
                         **kwargs)

    def _sync_timer(self) -> PhaseTimer:
        return self._round_timer

    # ---- the round -------------------------------------------------------------------------------
    def _end_round(self) -> None:
        """Join round r − 1's reduction, apply it, start round r's, restart from θ_{r+1}."""
        with self.timer.phase("outer"):
            delta = self._delta_aside()
        self._join()
        with self.timer.phase("outer"):
            self._apply_pending()
            self._stage(delta)  # Δ_r into the send buffers, then θ_local ← θ_{r+1}
            self._restart()
        self._start()
        self.round_step = 0

    @torch.no_grad()
    def _delta_aside(self) -> Dict[str, torch.Tensor]:
        """Δ_r = θ_r − θ_local, kept apart from the send buffers (still in flight): written into
        the live parameters where they have θ_start's device and dtype (their values are not
        needed any more: the next round starts from θ_{r+1}), else into a temporary copy."""
        out = {}
        for n, p in self._params:
            a = self._anchor[n]
            if (a.device, a.dtype) == (p.device, p.dtype):
                out[n] = p.neg_().add_(a)  # (−θ_local + θ_r is θ_r − θ_local exactly)
            else:
                out[n] = torch.sub(a, p.detach().to(a.device, a.dtype))
        return out

    @torch.no_grad()
    def _stage(self, delta: Dict[str, torch.Tensor]) -> None:
        """``delta`` (by parameter name) into the send buffers."""
        for n, d in delta.items():
            self._delta[n].copy_(d)

    def _apply_pending(self) -> None:
        """The outer step with the joined average, if there is one (none after a dropped round)."""
        if self.pending:
            self._outer_step()
        self.pending = False

    @torch.no_grad()
    def _drop_round(self) -> None:
        """The joined reduction's round was dropped (:meth:`LocalUpdate._drop_round`): no pending
        update is formed from it. The send buffers (NaN after the skipped reduction) are zeroed,
        so no checkpoint or broadcast carries them, and nothing is applied at this round's end."""
        self.pending = False
        for d in self._delta.values():
            d.zero_()

    def _start(self) -> None:
        """The reduction of the send buffers: on a background thread, or, under elastic Horovod,
        its collectives started from this thread (see the module docstring)."""
        self._load_carriers()
        self._round_timer.begin_step()
        self._inflight = {"inner_steps": self.round_step, "step": self.steps, "t0": time.perf_counter()}
        self._error = None
        if self._elastic:
            with self.timer.phase("communicate"):
                self.sync.launch()
            self._inflight["launch_s"] = time.perf_counter() - self._inflight["t0"]
            self._launched = True
            return
        self._thread = threading.Thread(target=self._reduce_in_thread, name="hvdcomp-co2", daemon=True)
        self._thread.start()

    @property
    def reduction_running(self) -> Optional[bool]:
        """None when no reduction was started since the last join; else whether its background
        thread is still running (False: finished, not yet joined); under elastic Horovod, True
        until the join (the collectives' completion is not polled)."""
        if self._launched:
            return True
        return None if self._thread is None else self._thread.is_alive()

    def _finish_reduction(self) -> None:
        """Finish the reduction (all of it, on the background thread) and record it."""
        skipped = not self.sync.reduce()
        rec = self._round_timer.end_step()
        self._inflight.update({"wall_s": time.perf_counter() - self._inflight.pop("t0"), "skipped": skipped,
                               **{f"{k}_s": rec[k] for k in ("compress", "communicate", "decompress")},
                               **{k: rec[k] for k in ("bytes_sent", "bytes_received", "dense_bytes")}})

    def _reduce_in_thread(self) -> None:
        try:
            self._finish_reduction()
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread at the join
            self._error = exc

    def _join(self) -> None:
        """Wait for the reduction in flight (charged to ``communicate``), record its round (under
        elastic Horovod a ``HorovodInternalError`` is raised as it is, for ``hvd.elastic.run``)."""
        if self._thread is None and not self._launched:
            return
        t0 = time.perf_counter()
        with self.timer.phase("communicate"):
            if self._launched:
                self._launched = False  # (a failure leaves nothing to finish: the reset drops the round)
                self._finish_reduction()
            else:
                self._thread.join()
        exposed = time.perf_counter() - t0 + self._inflight.pop("launch_s", 0.0)
        self._thread = None
        if self._error is not None:
            raise RuntimeError(f"CO2's reduction of round {self.rounds + 1} failed on its thread: "
                               f"{self._error!r}") from self._error
        rec = self._inflight
        rec.update({"exposed_s": exposed, "hidden_s": max(0.0, rec["wall_s"] - exposed)})
        self.timer.add_bytes(sent=rec["bytes_sent"], received=rec["bytes_received"], dense=rec["dense_bytes"])
        self._close_round(rec)
        if rec["skipped"]:
            self._drop_round()
        else:
            self.pending = True

    def flush(self) -> None:
        """Join the reduction in flight and apply it, then reduce and apply the current round's
        inner steps (if any) without overlap: the model then holds θ with every round in.
        Collective: call it on every rank at the same step."""
        with self.timer.phase("outer"):
            delta = self._delta_aside() if self.round_step else {}  # (relative to this round's start)
        self._join()
        with self.timer.phase("outer"):
            self._apply_pending()
        if delta:
            self._stage(delta)
            self._start()
            self._join()
            with self.timer.phase("outer"):
                self._apply_pending()
        self._restart()
        self.round_step = 0

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """:meth:`LocalUpdate.state_dict` plus the average of the previous round, waiting for its
        reduction first (so the method's state in it is committed)."""
        self._join()
        state = super().state_dict()
        state["pending"] = {"applies": self.pending, "skipped": False,  # (kept for older checkpoints)
                            "delta": {n: d.clone() for n, d in self._delta.items()} if self.pending else {}}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._join()
        super().load_state_dict(state)
        pending = state["pending"]
        self.pending = bool(pending["applies"]) and not bool(pending.get("skipped", False))
        self._stage(pending["delta"])

    def broadcast_state(self, root_rank: int = 0) -> None:
        self._join()
        super().broadcast_state(root_rank)

    def _resize(self, group) -> None:
        """Elastic Horovod's reset (no collective): the round in flight (its old world's handles,
        forgotten by :meth:`hvdcomp.reducer.Reducer.resize`, which rolls the staged state back) and
        an average joined but not applied are dropped on every rank alike."""
        self._launched = False
        self._inflight = {}
        self._drop_round()
        super()._resize(group)

    def _global_state(self) -> Dict[str, Any]:
        return {**super()._global_state(), "pending": self.pending}

    def _global_tensors(self) -> Dict[str, torch.Tensor]:
        return {**super()._global_tensors(), **{f"{n}.pending": d for n, d in self._delta.items()}}

    def close(self) -> None:
        """Join the reduction in flight (its average is not applied: :meth:`flush` first to keep
        it), then :meth:`LocalUpdate.close`."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._launched:
            self._launched = False
            self.sync.reduce()
        super().close()

    def describe(self):
        return {**super().describe(), "delay_rounds": 1}
