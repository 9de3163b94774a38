"""``qsgd``: stochastic uniform quantization per bucket.

Alistarh, Grubic, Li, Tomioka and Vojnovic, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", NeurIPS 2017.

For a bucket v of d elements and s levels::

    scale   = ||v||_2  (or max|v|)
    r_i     = s·|v_i| / scale ;  level_i = floor(r_i) + Bernoulli(r_i - floor(r_i))
    Q(v)_i  = scale · sign(v_i) · level_i / s        (unbiased: E[Q(v)] = v)

Levels in [−s, s] travel as unsigned codes ``level + s`` packed at ``ceil(log2(2s+1))`` bits
(s = 64 → 8 bits, 16 → 6, 4 → 4), plus one fp32 scale per bucket. An all-zero bucket decodes to
exact zeros. Scales differ per rank, so payloads go through the allgather path.
"""
from __future__ import annotations

import math

import torch

from .base import AggregateInto, Compressor, copy_saturating_
from .bitpack import bits_for_levels, pack_bits, packed_nbytes, unpack_bits
from .registry import register
from .rng import RankGenerators


@register("qsgd")
class QSGDCompressor(AggregateInto, Compressor):
    """QSGD with ``levels`` = s quantization levels per sign and buckets of ``bucket`` elements.

    Args:
        levels: s ≥ 1 (s ≤ 32767). The study used 64 / 16 / 4 ("7/5/3-bit").
        bucket: d ≥ 1 elements per bucket (512 in the paper for 4/8 bit).
        scale: ``"l2"`` (the paper's 2-norm; variance ≤ min(d/s², √d/s)·‖v‖²) or ``"max"``
            (max-abs: lower variance, no sparsity bound).
        seed: base seed of the per-rank generator used for stochastic rounding.

    Payload: ``[scales (ceil(n/d),) float32, codes (ceil(n·b/8),) uint8]`` with b =
    ``ceil(log2(2s+1))`` bits per element.

    Raises:
        ValueError: levels < 1 or > 32767, bucket < 1, unknown scale.
    """

    name = "qsgd"
    summable = False
    aggregate_is_mean = True

    def __init__(self, levels: int = 16, bucket: int = 512, scale: str = "l2", seed: int = 0):
        if not isinstance(levels, int) or not 1 <= levels <= 32767:
            raise ValueError(f"levels (s) must be an integer in [1, 32767], e.g. levels=16; got {levels!r}")
        if not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"bucket (d) must be an integer >= 1, e.g. bucket=512; got {bucket!r}")
        if scale not in ("l2", "max"):
            raise ValueError(f"scale must be 'l2' or 'max', got {scale!r}")
        self.levels, self.bucket, self.scale = levels, bucket, scale
        self.bits = bits_for_levels(2 * levels + 1)
        self.rng = RankGenerators(seed)

    def describe(self):
        return {"name": self.name, "levels": self.levels, "bucket": self.bucket, "scale": self.scale,
                "bits": self.bits}

    def wire_bytes(self, numel: int) -> int:
        """Exact payload bytes for ``numel`` elements (scales + packed codes)."""
        return 4 * math.ceil(numel / self.bucket) + packed_nbytes(numel, self.bits)

    def nominal_ratio(self, numel):
        return 4 * numel / max(1, self.wire_bytes(numel))

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1).to(torch.float32)
        n, d, s = flat.numel(), self.bucket, self.levels
        nb = math.ceil(n / d)
        v = torch.zeros(nb * d, dtype=torch.float32, device=flat.device)
        v[:n] = flat
        v = v.view(nb, d)
        if self.scale == "l2":  # in float64, saturated at fp32's max: never inf for finite input
            fmax = torch.finfo(torch.float32).max
            scale = v.to(torch.float64).norm(dim=1).clamp(max=fmax).to(torch.float32)
        else:
            scale = v.abs().amax(dim=1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        r = (v.abs() / safe[:, None] * s).clamp_(max=s)
        low = r.floor()
        u = torch.rand(r.shape, generator=self.rng.get(flat.device), device=flat.device)
        level = (low + (u < r - low).to(torch.float32)).clamp_(max=s)
        codes = (torch.where(v < 0, -level, level) + s).reshape(-1)[:n].to(torch.int32)
        return [scale, pack_bits(codes, self.bits)], (tensor.shape, tensor.dtype, n)

    def aggregate_into(self, out, payloads, ctx):
        """Mean over ranks of ``scale·(code - s)/s``, accumulated per bucket (scales broadcast over
        the bucket's d elements, no per-element scale tensor)."""
        shape, dtype, n = ctx
        d, s = self.bucket, self.levels
        nb = math.ceil(n / d)
        device = payloads[0][0].device if payloads else out.device
        acc = torch.zeros(nb, d, dtype=torch.float32, device=device)
        level = torch.empty(nb * d, dtype=torch.float32, device=device)
        level[n:] = float(s)  # padding decodes to level 0
        for scale, packed in payloads:
            level[:n].copy_(unpack_bits(packed, self.bits, n))
            level.sub_(s)
            acc.addcmul_(level.view(nb, d), (scale / (s * len(payloads))).unsqueeze(1))
        # saturating: a level rounded up can exceed a float16 gradient's range (s = 16, 512 values
        # of 6e4: scale/s = 8.5e4)
        return copy_saturating_(out, acc.view(-1)[:n].view(shape))

    def state_dict(self):
        return {"rng": self.rng.state_dict()}

    def load_state_dict(self, state):
        self.rng.load_state_dict(state.get("rng", {}))
