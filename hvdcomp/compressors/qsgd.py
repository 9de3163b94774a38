"""``qsgd``: stochastic uniform quantization per quantization block.

Alistarh, Grubic, Li, Tomioka and Vojnovic, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", NeurIPS 2017.

For a block v of d elements and s levels::

    scale   = ||v||_2  (or max|v|)
    r_i     = s·|v_i| / scale ;  level_i = floor(r_i) + Bernoulli(r_i - floor(r_i))
    Q(v)_i  = scale · sign(v_i) · level_i / s        (unbiased: E[Q(v)] = v)

Levels in [−s, s] travel as unsigned codes ``level + s`` packed at ``ceil(log2(2s+1))`` bits,
plus one fp32 scale per block; an all-zero block decodes to exact zeros. Scales differ per rank
(allgather). Kernels (native on CPU, torch elsewhere): docs/kernels.md.
"""
from __future__ import annotations

import math
import warnings
from itertools import accumulate
from typing import Optional

import torch

from .. import native
from ..checks import check_choice, check_count, check_int, check_seed
from .base import AggregateInto, Compressor, ErrorBound, float32_flat, write_back, PayloadKind
from .bitpack import bits_for_levels, pack_bits, packed_nbytes, unpack_bits, unpack_codes
from .registry import register
from .rng import DrawsPerCall, RankGenerators, rounding_draws
from .segments import SegmentsContext

FP32_MAX = torch.finfo(torch.float32).max


@register("qsgd")
class QSGDCompressor(DrawsPerCall, AggregateInto, Compressor):
    """QSGD with ``levels`` = s quantization levels per sign and quantization blocks of ``block`` elements.

    Args:
        levels: s ≥ 1 (s ≤ 32767). The study used 64 / 16 / 4 ("7/5/3-bit"); s ≤ 127 keeps codes
            within a byte (s = 127: 255 levels, 8 bits).
        block: d ≥ 1 elements per quantization block, each with its own scale (512 in the paper
            for 4/8 bit; a smaller block quantizes finer and sends more scales). ``bucket=`` is
            its deprecated spelling (one release: an allgather bucket is something else).
        scale: ``"l2"`` (the paper's 2-norm; variance ≤ min(d/s², √d/s)·‖v‖²) or ``"max"``
            (max-abs: lower variance, no sparsity bound).
        seed: base seed of the per-rank generator used for stochastic rounding.

    Payload: ``[scales (ceil(n/d),) float32, codes (ceil(n·b/8),) uint8]`` with b =
    ``ceil(log2(2s+1))`` bits per element (for b = 8 the codes are the bytes themselves).
    Several gradients in one call (``segments``): every gradient's scales, then every gradient's
    codes, each gradient's codes starting on a byte.

    State: the per-rank generator, ``state_dict()["rng"]``.

    Raises:
        ValueError: levels < 1 or > 32767, block < 1, unknown scale.
    """

    name = "qsgd"
    payload_kind = PayloadKind.GATHERED
    aggregate_is_mean = True

    def __init__(self, levels: int = 16, block: int = 512, scale: str = "l2", seed: int = 0,
                 bucket: Optional[int] = None):
        if bucket is not None:
            warnings.warn("qsgd: bucket= is renamed block= (a quantization block, not an allgather "
                          "bucket); bucket= will be removed in the next release", DeprecationWarning)
            block = bucket
        levels = check_int(levels, "levels (s)", 1, 32767, " (e.g. levels=16)")
        block = check_count(block, "block (d; formerly bucket)", 1, " (e.g. block=512)")
        scale = check_choice(scale, "scale", ("l2", "max"))
        seed = check_seed(seed)
        self.levels, self.block, self.scale = levels, block, scale
        self.bits = bits_for_levels(2 * levels + 1)
        self.rng = RankGenerators(seed)

    def describe(self):
        return {"name": self.name, "levels": self.levels, "block": self.block, "scale": self.scale,
                "bits": self.bits}

    def wire_bytes(self, numel: int) -> int:
        """Exact payload bytes for ``numel`` elements (scales + packed codes)."""
        return 4 * math.ceil(numel / self.block) + packed_nbytes(numel, self.bits)

    @property
    def error_bound(self):
        """Unbiased, E‖C(v) − v‖² ≤ ω‖v‖² per block of d' = min(d, n) elements: ω = min(d'/s², √d'/s)
        with the 2-norm scale (Alistarh et al., NeurIPS 2017, Lemma 3.1), min(d'/(4s²), √d'/s) with
        the max-abs scale (each element's rounding variance ≤ (m/s)²/4 and ≤ (m/s)|v_i|, m the
        block's largest magnitude)."""
        s, d = self.levels, self.block
        if self.scale == "l2":
            return ErrorBound("unbiased", f"stochastic rounding, E[C(v)] = v, ω = min(d/s², √d/s) (d = {d}, s = {s})",
                              omega=lambda n: min(min(d, n) / s**2, math.sqrt(min(d, n)) / s))
        return ErrorBound("unbiased", f"stochastic rounding, E[C(v)] = v, ω = min(d/(4s²), √d/s) (d = {d}, s = {s})",
                          omega=lambda n: min(min(d, n) / (4 * s**2), math.sqrt(min(d, n)) / s))

    def nominal_ratio(self, numel):
        return 4 * numel / max(1, self.wire_bytes(numel))

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1).to(torch.float32).contiguous()
        n = flat.numel()
        ctx = (tensor.shape, tensor.dtype, n)
        draw = self._draws([name], [(n, flat.device)])[0]
        if self.bits <= 8 and native.usable(flat):
            scales = torch.empty(math.ceil(n / self.block), dtype=torch.float32)
            packed = torch.empty(packed_nbytes(n, self.bits), dtype=torch.uint8)
            if n:
                native.qsgd_encode(flat, self.block, self.levels, self.scale == "max", self.bits,
                                   draw, scales, packed)
            return [scales, packed], ctx
        return self._encode_torch(flat, draw), ctx

    def _draw(self, items):
        """The rounding draws of ``items`` (a native key, or the torch uniforms)."""
        return rounding_draws(self.rng, items, lambda device: self.bits <= 8 and native.usable_on(device),
                              lambda n: (math.ceil(n / self.block), self.block))

    def _layout(self, segments):
        """Per segment: where its scales and its code bytes start in a segmented payload
        (``(len + 1)`` offsets each, cached)."""
        return segments.cached(("qsgd", self.block, self.bits), lambda seg: (
            list(accumulate((math.ceil(n / self.block) for n in seg.sizes), initial=0)),
            list(accumulate((packed_nbytes(n, self.bits) for n in seg.sizes), initial=0))))

    def _encode_segments(self, flat, segments):
        """Every segment as :meth:`_encode` would encode it alone, one native call for all (one
        key per non-empty segment, each the draw one call per gradient gets); elsewhere the torch
        encode per segment."""
        dtype = flat.dtype
        flat = flat.to(torch.float32).contiguous()
        scale_at, code_at = self._layout(segments)
        ctx = SegmentsContext(flat.shape, dtype, segments)
        draws = self._draws(segments.names, [(n, flat.device) for n in segments.sizes])
        if self.bits <= 8 and native.usable(flat):
            keys = torch.tensor([0 if k is None else k for k in draws], dtype=torch.int64)
            scales = torch.empty(scale_at[-1], dtype=torch.float32)
            packed = torch.empty(code_at[-1], dtype=torch.uint8)
            native.qsgd_encode_segments(flat, segments.sizes_tensor(), keys, self.block, self.levels,
                                        self.scale == "max", self.bits, scales, packed)
            return [scales, packed], ctx
        parts = [self._encode_torch(v, u) for v, u in zip(segments.split(flat), draws)]
        return [torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])], ctx

    def _segment_payloads(self, payloads, ctx, j):
        """Segment ``j``'s own payload in each of ``payloads`` (views)."""
        scale_at, code_at = self._layout(ctx.segments)
        return [[p[0][scale_at[j]:scale_at[j + 1]], p[1][code_at[j]:code_at[j + 1]]] for p in payloads]

    def _encode_torch(self, flat: torch.Tensor, u: torch.Tensor):
        """Vectorised torch encode (CUDA; CPU without native kernels), with the uniforms ``u``
        (``(ceil(n/d), d)``, from the per-rank generator)."""
        n, d, s = flat.numel(), self.block, self.levels
        nb = math.ceil(n / d)
        if n % d:
            v = torch.zeros(nb * d, dtype=torch.float32, device=flat.device)
            v[:n] = flat
        else:
            v = flat
        v = v.view(nb, d)
        if self.scale == "l2":  # in float64, saturated at fp32's max: never inf for finite input
            scale = v.to(torch.float64).norm(dim=1).clamp(max=FP32_MAX).to(torch.float32)
        else:
            scale = v.abs().amax(dim=1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        r = v.abs().div_(safe[:, None]).mul_(s).clamp_(max=s).nan_to_num_(nan=float(s))
        low = r.floor()
        level = low.add_(u.lt_(r.sub_(low)))              # floor(r) + [u < r - floor(r)]
        codes = level.copysign_(v).add_(s).reshape(-1)[:n]
        return [scale, pack_bits(codes.to(torch.uint8 if self.bits <= 8 else torch.int32), self.bits)]

    def aggregate_into(self, out, payloads, ctx):
        """Mean over ranks of ``scale·(code - s)/s``, written into ``out``: one pass over ``out`` per
        payload at most (native: one pass in all, one call for every segment of segmented
        payloads; else segment by segment), the scales broadcast over their blocks."""
        segments = ctx.segments if isinstance(ctx, SegmentsContext) else None
        flat = float32_flat(out)
        if not payloads or flat.numel() == 0:
            flat.zero_()
        elif self.bits <= 8 and native.usable(flat, *[t for p in payloads for t in p]):
            scales, codes = [p[0].contiguous() for p in payloads], [p[1].contiguous() for p in payloads]
            if segments is None:
                native.qsgd_aggregate(flat, scales, codes, self.block, self.levels, self.bits)
            else:
                native.qsgd_aggregate_segments(flat, scales, codes, segments.sizes_tensor(), self.block,
                                               self.levels, self.bits)
        elif segments is None:
            self._aggregate_torch(flat, payloads, flat.numel())
        else:
            for j, view in enumerate(segments.split(flat)):
                self.aggregate_into(view, self._segment_payloads(payloads, ctx, j),
                                    (view.shape, torch.float32, view.numel()))
        return write_back(out, flat)

    def _aggregate_torch(self, flat, payloads, n):
        d, s, world = self.block, self.levels, len(payloads)
        full = n // d * d
        level = torch.empty(n, dtype=torch.float32, device=flat.device)  # reused for every payload
        for w, (scale, packed) in enumerate(payloads):
            codes = unpack_codes(packed, self.bits, n) if self.bits <= 8 else unpack_bits(packed, self.bits, n)
            level.copy_(codes).sub_(s)
            factor = (scale / (s * world)).to(flat.device)
            for lo, hi, f in ((0, full, factor[: full // d, None]), (full, n, factor[full // d:, None])):
                if hi > lo:
                    lv, ov = level[lo:hi].view(-1, min(d, hi - lo)), flat[lo:hi].view(-1, min(d, hi - lo))
                    if w == 0:
                        torch.mul(lv, f, out=ov)
                    else:
                        ov.addcmul_(lv, f)
