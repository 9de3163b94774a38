"""Plain reference implementations of the compressors, timed beside hvdcomp's by
``benchmarks/kernels.py --compare``.

What a straightforward eager-torch implementation does (as in GRACE, sands-lab/grace): one tensor
op per step of the formula, codes kept as unpacked ``int8`` (one byte per element, no bit
packing), ``torch.rand`` for stochastic rounding, ``torch.topk`` for selection, ``randperm`` for
random-k, and a fresh dense tensor per decoded payload (aggregation adds the decodes). The maths is
hvdcomp's (bucketed QSGD scales, 2.5σ TernGrad clipping, DGC momentum, error feedback where hvdcomp
turns it on by default), so the comparison is of kernels, not of algorithms. Randomness comes from
one ``torch.Generator`` per reference object, never the global RNG.

Each reference has ``encode(x) -> payload`` (``x``: 1-D float32), ``decode_into(out, payload)``
and ``aggregate_into(out, payloads)`` (the mean of the decodes), like the compressors.
"""
from __future__ import annotations

import math

import torch

__all__ = ["reference_for"]


class Reference:
    """Base: error feedback around ``_encode`` (GRACE's residual memory), mean-of-decodes aggregate."""

    def __init__(self, comp, error_feedback: bool, seed: int = 0):
        self.ef = error_feedback
        self.residual = None
        self.gen = torch.Generator().manual_seed(seed)

    def encode(self, x):
        if not self.ef:
            return self._encode(x)
        p = x if self.residual is None else x + self.residual
        payload = self._encode(p)
        self.residual = p - self.decode(payload, x.numel())
        return payload

    def decode_into(self, out, payload):
        return out.copy_(self.decode(payload, out.numel()).view(out.shape))

    def aggregate_into(self, out, payloads):
        total = None
        for payload in payloads:
            d = self.decode(payload, out.numel())
            total = d if total is None else total + d
        return out.copy_((total / len(payloads)).view(out.shape))


class QSGDReference(Reference):
    """Per-bucket scale, ``rand`` rounding, codes ``sign·level`` as int8 (int16 for s > 127)."""

    def __init__(self, comp, error_feedback, seed=0):
        super().__init__(comp, error_feedback, seed)
        self.s, self.d, self.max = comp.levels, comp.block, comp.scale == "max"

    def _encode(self, x):
        n, d = x.numel(), self.d
        v = torch.nn.functional.pad(x, (0, (-n) % d)).view(-1, d)
        norm = v.abs().amax(dim=1) if self.max else v.norm(dim=1)
        level_float = self.s * v.abs() / norm[:, None]
        previous = level_float.floor()
        is_next = torch.rand(v.shape, generator=self.gen) < level_float - previous
        level = previous + is_next
        codes = (torch.sign(v) * level).to(torch.int8 if self.s <= 127 else torch.int16)
        return [norm, codes]

    def decode(self, payload, n):
        norm, codes = payload
        return (codes.float() * norm[:, None] / self.s).view(-1)[:n]


class TernGradReference(Reference):
    def __init__(self, comp, error_feedback, seed=0):
        super().__init__(comp, error_feedback, seed)
        self.sigmas = comp.clip_sigmas

    def _encode(self, x):
        c = self.sigmas * x.std()
        g = torch.clamp(x, -c, c) if self.sigmas > 0 else x
        s = g.abs().max()
        keep = torch.rand(g.shape, generator=self.gen) < g.abs() / s
        return [s.reshape(1), (torch.sign(g) * keep).to(torch.int8)]

    def decode(self, payload, n):
        s, codes = payload
        return codes.float() * s


class SignReference(Reference):
    """signSGD: bool signs (one byte each); the aggregate is the sign of the summed votes."""

    def _encode(self, x):
        return [x >= 0]

    def decode(self, payload, n):
        return payload[0].float() * 2 - 1

    def aggregate_into(self, out, payloads):
        votes = sum(p[0].float() * 2 - 1 for p in payloads)
        return out.copy_(torch.where(votes >= 0, 1.0, -1.0).view(out.shape))


class ScaledSignReference(Reference):
    """EF-signSGD: mean |x| and bool signs."""

    def _encode(self, x):
        return [x.abs().mean().reshape(1), x >= 0]

    def decode(self, payload, n):
        scale, bits = payload
        return (bits.float() * 2 - 1) * scale


class SparseReference(Reference):
    """Values and int32 indices; decode scatters into fresh zeros."""

    def decode(self, payload, n):
        values, idx = payload
        return torch.zeros(n).scatter_(0, idx.long(), values)


class TopKReference(SparseReference):
    def __init__(self, comp, error_feedback, seed=0):
        super().__init__(comp, error_feedback, seed)
        self.density = comp.density

    def _encode(self, x):
        k = max(1, math.ceil(self.density * x.numel()))
        idx = torch.topk(x.abs(), k).indices
        return [x[idx], idx.to(torch.int32)]


class DGCReference(TopKReference):
    """Momentum correction and accumulation, then ``torch.topk`` of the accumulation."""

    def __init__(self, comp, error_feedback, seed=0):
        super().__init__(comp, False, seed)
        self.m, self.u, self.v = comp.momentum, None, None

    def _encode(self, x):
        self.u = x.clone() if self.u is None else self.m * self.u + x
        self.v = self.u.clone() if self.v is None else self.v + self.u
        payload = super()._encode(self.v)
        idx = payload[1].long()
        self.u[idx] = 0
        self.v[idx] = 0
        return payload


class RandomKReference(SparseReference):
    def __init__(self, comp, error_feedback, seed=0):
        super().__init__(comp, error_feedback, seed)
        self.density = comp.density

    def _encode(self, x):
        k = max(1, math.ceil(self.density * x.numel()))
        idx = torch.randperm(x.numel(), generator=self.gen)[:k]
        return [x[idx], idx.to(torch.int32)]


class ThresholdReference(SparseReference):
    def __init__(self, comp, error_feedback, seed=0):
        super().__init__(comp, error_feedback, seed)
        self.threshold = comp.threshold

    def _encode(self, x):
        idx = torch.nonzero(x.abs() >= self.threshold).view(-1)
        return [x[idx], idx.to(torch.int32)]


class FP16Reference(Reference):
    def _encode(self, x):
        return [x.half()]

    def decode(self, payload, n):
        return payload[0].float()


REFERENCES = {"qsgd": QSGDReference, "terngrad": TernGradReference, "signsgd": SignReference,
              "efsignsgd": ScaledSignReference, "topk": TopKReference, "dgc": DGCReference,
              "randomk": RandomKReference, "threshold": ThresholdReference, "fp16": FP16Reference}


def reference_for(comp):
    """The plain reference of hvdcomp compressor ``comp`` (error feedback as ``comp`` has it),
    or None for methods without one (e.g. PowerSGD)."""
    inner = getattr(comp, "inner", comp)
    cls = REFERENCES.get(inner.name)
    return None if cls is None else cls(inner, inner is not comp)
