"""Reference simulations in plain tensors (test helpers, used by tests/test_adaptive_optimizers.py
and tests/mpi/adaptive_optimizer_checks.py): the 1-bit compressed allreduce, and 1-bit LAMB
(:class:`OneBitLambReference`, written from DeepSpeed's code).

The compressed allreduce: N simulated ranks, written from the algorithm (Tang et al., "1-bit
Adam", ICML 2021: worker residual, chunk scatter, server average and server residual,
re-compression, gather), not from hvdcomp's code: each rank adds its worker residual, cuts the
vector into N contiguous chunks (chunk j: elements [j·n//N, (j+1)·n//N)), and compresses each to
``scale·sign`` (scale: the mean absolute value, summed in float64; sign(0) = +1); rank j averages
the N compressed copies of chunk j (added in rank order, then divided by N), adds its server
residual and compresses again; every rank gathers the N compressed chunks.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """``mean|x| · sign(x)`` (float32; sign(0) = +1; an empty chunk stays empty)."""
    scale = (x.abs().sum(dtype=torch.float64) / max(1, x.numel())).to(torch.float32)
    return torch.where(x >= 0, scale, -scale)


def compressed_allreduce(inputs: Sequence[torch.Tensor], worker: Sequence[Optional[torch.Tensor]],
                         server: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, List[torch.Tensor], List]:
    """One step for N ranks.

    Args:
        inputs: per rank, the 1-D float32 vector (n,).
        worker: per rank, its worker residual (n,) or None (zero).
        server: per rank j, the server residual of chunk j or None (zero).

    Returns:
        ``(result, new worker residuals, new server residuals)``; with one rank there is no
        server side (its result is the compressed vector, computed as ``acc − residual``).
    """
    p, n = len(inputs), inputs[0].numel()
    bounds = [j * n // p for j in range(p + 1)]
    acc = [x.to(torch.float32) + (e if e is not None else 0) for x, e in zip(inputs, worker)]
    sent = [[scaled_sign(a[bounds[j]:bounds[j + 1]]) for j in range(p)] for a in acc]
    new_worker = [a - torch.cat(s) for a, s in zip(acc, sent)]
    if p == 1:
        return acc[0] - new_worker[0], new_worker, list(server)
    result, new_server = [], []
    for j in range(p):
        mean = torch.zeros(bounds[j + 1] - bounds[j])
        for r in range(p):
            mean += sent[r][j]
        mean /= p
        target = mean if server[j] is None else mean + server[j]
        q = scaled_sign(target)
        new_server.append(target - q)
        result.append(q)
    return torch.cat(result), new_worker, new_server


class OneBitLambReference:
    """1-bit LAMB on N simulated ranks in plain tensors, written from DeepSpeed's
    ``deepspeed/runtime/fp16/onebit/lamb.py`` (``OnebitLamb.step``), in hvdcomp's step numbering
    (DeepSpeed's first ``step()`` call only sets up its buffers, so its counter is one ahead).

    Per tensor x with the averaged gradient ḡ (warm-up, t ≤ T = ``freeze_step``):
    ``m ← β1·m + (1 − β1)·ḡ``, ``v ← β2·v + (1 − β2)·ḡ²``, at t = T ``v_fresh = v``;
    ``u = m/(sqrt(v) + ε) + λ·x``; the trust ratio ``r = clamp(‖x‖/‖u‖, min_coeff, max_coeff)`` (1
    where a norm is 0); where r ≠ 1 the frozen ratio ``c ← β_c·c + (1 − β_c)·r`` (c = 0 at first);
    ``x ← x − γ·r·u``. Afterwards (t > T): at the first such step each tensor's scale ``s = mean
    over tensors of rms(m) / rms(m)``; every rank's ``s·(β1·m + (1 − β1)·g_r)`` through the
    compressed allreduce; ``m = avg/s``; the implied gradient ``(m − β1·m_prev)/(1 − β1)`` updates
    ``v_fresh``; ``u = m/(sqrt(v) + ε) + λ·x``; the factor ``max((sqrt(v) + ε)/(sqrt(v_fresh) + ε))``,
    blended towards 1 by ``ρ = min(1, ‖m/(sqrt(v) + ε)‖/‖u‖)`` where λ > 0, clamped to
    [factor_min, factor_max], then to within ±factor_threshold of the previous factor (1 at
    first); ``x ← x − γ·c·factor·u``.

    Where hvdcomp documents a difference it is followed here: the compressed allreduce is
    :func:`compressed_allreduce` (one mean |x| scale per chunk; DeepSpeed's worker scale is
    ‖x‖/√n of the whole buffer), and coordinates whose frozen variance is 0 are masked.

    Args:
        params: the initial tensors (float32); ranks: N.
        lr, betas, eps, weight_decay, max_coeff, min_coeff, coeff_beta, freeze_step, factor_max,
            factor_min, factor_threshold: the optimizer's.
    """

    def __init__(self, params: Sequence[torch.Tensor], ranks: int, *, lr, betas, eps, weight_decay, max_coeff,
                 min_coeff, coeff_beta, freeze_step, factor_max=4.0, factor_min=0.5, factor_threshold=0.1):
        self.x = [p.detach().clone().float() for p in params]
        self.m = [torch.zeros_like(p) for p in self.x]
        self.v = [torch.zeros_like(p) for p in self.x]
        self.v_fresh = [torch.zeros_like(p) for p in self.x]
        self.coeff, self.last_factor = [0.0] * len(self.x), [1.0] * len(self.x)
        self.scale: Optional[List[float]] = None
        self.worker: List = [None] * ranks
        self.server: List = [None] * ranks
        self.ranks, self.t = ranks, 0
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.max_coeff, self.min_coeff, self.coeff_beta, self.freeze_step = max_coeff, min_coeff, coeff_beta, freeze_step
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold

    def step(self, grads: Sequence[Sequence[torch.Tensor]]) -> None:
        """One step with ``grads[r][i]``: rank r's gradient of tensor i."""
        self.t += 1
        if self.t <= self.freeze_step:
            for i, x in enumerate(self.x):
                g = sum(grads[r][i] for r in range(self.ranks)) / self.ranks
                self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
                self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
                if self.t == self.freeze_step:
                    self.v_fresh[i] = self.v[i].clone()
                u = self.m[i] / (self.v[i].sqrt() + self.eps)
                if self.wd > 0:
                    u = u + self.wd * x
                w_norm, u_norm = x.norm(), u.norm()
                ratio = 1.0
                if w_norm != 0 and u_norm != 0:
                    ratio = min(max((w_norm / u_norm).item(), self.min_coeff), self.max_coeff)
                if ratio != 1.0:
                    self.coeff[i] = self.coeff_beta * self.coeff[i] + (1 - self.coeff_beta) * ratio
                self.x[i] = x - self.lr * ratio * u
            return
        if self.scale is None:
            rms = [(m.norm() / m.numel() ** 0.5).item() for m in self.m]
            self.scale = [sum(rms) / len(rms) / q for q in rms]
        local = [torch.cat([(self.scale[i] * (self.b1 * self.m[i] + (1 - self.b1) * grads[r][i])).reshape(-1)
                            for i in range(len(self.x))]) for r in range(self.ranks)]
        avg, self.worker, self.server = compressed_allreduce(local, self.worker, self.server)
        start = 0
        for i, x in enumerate(self.x):
            m = avg[start:start + x.numel()].view(x.shape) / self.scale[i] * (self.v[i] != 0)
            start += x.numel()
            implied = (m - self.b1 * self.m[i]) / (1 - self.b1)
            self.v_fresh[i] = self.b2 * self.v_fresh[i] + (1 - self.b2) * implied * implied
            self.m[i] = m
            denom = self.v[i].sqrt() + self.eps
            prelim = m / denom
            u = prelim + self.wd * x if self.wd > 0 else prelim
            factor = (denom / (self.v_fresh[i].sqrt() + self.eps)).max().item()
            if self.wd > 0:
                rho = min(1.0, (prelim.norm() / u.norm()).item())
                factor = factor * rho + (1.0 - rho)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = self.last_factor[i]
            factor = min(max(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
            self.last_factor[i] = factor
            self.x[i] = x - self.lr * self.coeff[i] * factor * u
