"""``terngrad``: stochastic ternary gradients.

Wen, Xu, Yan, Wu, Wang, Chen and Li, "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning", NeurIPS 2017.

``g = clamp(g, ±2.5·max(std(g), |mean(g)|))``; ``s = max|g|``; ``b_i ~ Bernoulli(|g_i|/s)``;
``out = s·sign(g)·b`` ∈ {−s, 0, s} (unbiased for the clipped gradient). Codes ``sign·b + 1`` travel
at 2 bits per element with one fp32 scale; scales differ per rank (allgather). Kernels (native on
CPU, torch elsewhere): docs/kernels.md.
"""
from __future__ import annotations

import math
from itertools import accumulate


import numpy as np
import torch

from .. import native
from ..checks import check_range, check_seed
from .base import AggregateInto, Compressor, ErrorBound, float32_flat, write_back, PayloadKind
from .bitpack import pack_bits, packed_nbytes, unpack_codes
from .registry import register
from .rng import DrawsPerCall, RankGenerators, rounding_draws
from .segments import SegmentsContext


@register("terngrad")
class TernGradCompressor(DrawsPerCall, AggregateInto, Compressor):
    """Ternary {−s, 0, s} quantization with 2.5σ clipping.

    Args:
        clip_sigmas: clip at this many standard deviations (2.5 in the paper; 0 disables), but
            never below ``clip_sigmas·|mean(g)|`` (the paper's 2.5σ assumes zero-centred
            gradients: a constant tensor has σ = 0).
        seed: base seed of the per-rank generator.

    Payload: ``[scale (1,) float32, codes (ceil(n/4),) uint8]`` (2 bits per element). Several
    gradients in one call (``segments``): ``[scales (one per gradient,) float32, codes]``, each
    gradient's codes starting on a byte.

    State: the per-rank generator, ``state_dict()["rng"]``.

    Raises:
        ValueError: negative ``clip_sigmas``.
    """

    name = "terngrad"
    payload_kind = PayloadKind.GATHERED
    aggregate_is_mean = True

    def __init__(self, clip_sigmas: float = 2.5, seed: int = 0):
        self.clip_sigmas = check_range(clip_sigmas, "clip_sigmas", 0.0, hint=" (0 disables clipping)")
        self.rng = RankGenerators(check_seed(seed))

    def describe(self):
        return {"name": self.name, "clip_sigmas": self.clip_sigmas}

    @property
    def error_bound(self):
        """Without clipping: unbiased, E‖C(v) − v‖² = s‖v‖₁ − ‖v‖² ≤ (√n − 1)‖v‖² with s = max|v|
        (ω = √n stated); with clipping neither unbiased nor a contraction."""
        if self.clip_sigmas > 0:
            return ErrorBound("none", "clipping (clip_sigmas > 0) makes it neither unbiased nor a contraction: use "
                                      "terngrad:clip_sigmas=0 (unbiased) or qsgd")
        return ErrorBound("unbiased", "stochastic ternarization to {−s, 0, s}, s = max|v|: E[C(v)] = v, ω = √n",
                          omega=lambda n: math.sqrt(max(1, n)))

    def nominal_ratio(self, numel):
        return 4 * numel / (4 + packed_nbytes(numel, 2))

    def _encode(self, tensor, name=None):
        g = tensor.reshape(-1).to(torch.float32).contiguous()
        ctx = (tensor.shape, tensor.dtype, g.numel())
        draw = self._draws([name], [(g.numel(), g.device)])[0]
        if not native.usable(g):
            return self._encode_torch(g, draw), ctx
        n = g.numel()
        packed = torch.empty(packed_nbytes(n, 2), dtype=torch.uint8)
        if n == 0:
            return [torch.zeros(1), packed], ctx
        clip, s = self._clip_and_scale(np.array([native.moments(g)]), np.array([n]))
        native.terngrad_encode(g, float(clip[0]), float(s[0]), draw, packed)
        return [torch.tensor([float(s[0])], dtype=torch.float32), packed], ctx

    def _draw(self, items):
        """The rounding draws of ``items`` (a native key, or the torch uniforms)."""
        return rounding_draws(self.rng, items, native.usable_on, lambda n: (n,))

    def _clip_and_scale(self, moments: np.ndarray, n: np.ndarray):
        """Per tensor, from its moments (rows Σ(x−K), Σ(x−K)², max|x|, K in float64) and its size
        n (≥ 1): the clip c and the scale s, float32 arrays. The unbiased variance from the
        shifted sums in float64, then std, |mean| and c in float32 as torch computes them;
        s = min(max|g|, c) (the largest clipped magnitude), NaN where either is."""
        s1, s2, maxabs, shift = moments.T
        f32 = np.float32
        s = maxabs.astype(f32)
        clip = np.full(len(n), np.inf, dtype=f32)
        on = n > 1 if self.clip_sigmas > 0 else np.zeros(len(n), dtype=bool)
        if on.any():
            m, s1, s2, shift = n[on].astype(np.float64), s1[on], s2[on], shift[on]
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                var = (s2 - s1 * s1 / m) / (m - 1)
                std = np.where(var == var, np.sqrt(np.where(var > 0.0, var, 0.0)), np.nan).astype(f32)
                mean = np.abs(shift + s1 / m).astype(f32)
                c = f32(self.clip_sigmas) * np.maximum(std, mean)
            clip[on] = c
            s[on] = np.where(np.isnan(c) | np.isnan(s[on]), f32(np.nan), np.minimum(s[on], c))
        return clip, s

    def _layout(self, segments):
        """Per segment: where its code bytes start in a segmented payload (cached)."""
        return segments.cached("terngrad", lambda seg: list(accumulate((packed_nbytes(n, 2) for n in seg.sizes),
                                                                       initial=0)))

    def _encode_segments(self, flat, segments):
        """Every segment as :meth:`_encode` would encode it alone: one native call for the
        moments, one for the codes (one key per non-empty segment, each the draw one call per
        gradient gets);
        elsewhere the torch encode per segment."""
        dtype = flat.dtype
        g = flat.to(torch.float32).contiguous()
        ctx = SegmentsContext(g.shape, dtype, segments)
        draws = self._draws(segments.names, [(n, g.device) for n in segments.sizes])
        if not native.usable(g):
            parts = [self._encode_torch(v, u) for v, u in zip(segments.split(g), draws)]
            return [torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])], ctx
        sizes = segments.sizes_tensor()
        moments = native.moments_segments(g, sizes).numpy()
        clip, s = self._clip_and_scale(moments, np.maximum(sizes.numpy(), 1))
        s[sizes.numpy() == 0] = 0.0                            # an empty gradient's scale (as alone)
        keys = torch.tensor([0 if k is None else k for k in draws], dtype=torch.int64)
        packed = torch.empty(self._layout(segments)[-1], dtype=torch.uint8)
        scales = torch.from_numpy(s)
        native.terngrad_encode_segments(g, sizes, torch.from_numpy(clip), scales, keys, packed)
        return [scales, packed], ctx

    def _encode_torch(self, g, u):
        """Vectorised torch encode (CUDA; CPU without native kernels), with the uniforms ``u``
        (``(n,)``, from the per-rank generator)."""
        if self.clip_sigmas > 0 and g.numel() > 1:
            c = self.clip_sigmas * torch.maximum(g.std(), g.mean().abs())
            g = torch.maximum(torch.minimum(g, c), -c)
        s = g.abs().max() if g.numel() else g.new_zeros(())
        safe = torch.where(s > 0, s, torch.ones_like(s))
        keep = u.lt_(g.abs().div_(safe)).mul_(s > 0)
        codes = keep.mul_(torch.sign(g)).add_(1).nan_to_num_(nan=1.0).to(torch.uint8)
        return [s.reshape(1), pack_bits(codes, 2)]

    def aggregate_into(self, out, payloads, ctx):
        """Mean over ranks of ``s·(code - 1)``, written into ``out`` (native: in one pass, one call
        for every segment of segmented payloads; else segment by segment)."""
        segments = ctx.segments if isinstance(ctx, SegmentsContext) else None
        flat = float32_flat(out)
        world = len(payloads)
        if not payloads or flat.numel() == 0:
            flat.zero_()
        elif native.usable(flat, *[t for p in payloads for t in p]):
            codes = [p[1].contiguous() for p in payloads]
            if segments is None:
                factors = torch.cat([p[0].reshape(1).to(torch.float32) for p in payloads]).div_(world)
                native.terngrad_aggregate(flat, factors, codes)
            else:
                factors = torch.stack([p[0].to(torch.float32) for p in payloads]).div_(world)
                native.terngrad_aggregate_segments(flat, factors, codes, segments.sizes_tensor())
        elif segments is None:
            for w, (s, packed) in enumerate(payloads):
                codes = unpack_codes(packed, 2, flat.numel())
                f = (s.to(torch.float32) / world).to(flat.device)
                if w == 0:
                    flat.copy_(codes).sub_(1).mul_(f)
                else:
                    flat.addcmul_(codes.to(torch.float32).sub_(1), f)
        else:
            at = self._layout(segments)
            for j, view in enumerate(segments.split(flat)):
                own = [[p[0][j:j + 1], p[1][at[j]:at[j + 1]]] for p in payloads]
                self.aggregate_into(view, own, (view.shape, torch.float32, view.numel()))
        return write_back(out, flat)
