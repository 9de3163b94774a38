"""``terngrad``: stochastic ternary gradients.

Wen, Xu, Yan, Wu, Wang, Chen and Li, "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning", NeurIPS 2017.

``g = clamp(g, ±2.5·max(std(g), |mean(g)|))``; ``s = max|g|``; ``b_i ~ Bernoulli(|g_i|/s)``;
``out = s·sign(g)·b`` ∈ {−s, 0, s} (unbiased for the clipped gradient). Codes ``sign·b + 1`` travel
at 2 bits per element with one fp32 scale; scales differ per rank, so the allgather path is used.
"""
from __future__ import annotations

import torch

from .base import Compressor
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import register
from .rng import RankGenerators


@register("terngrad")
class TernGradCompressor(Compressor):
    """Ternary {−s, 0, s} quantization with 2.5σ clipping.

    Args:
        clip_sigmas: clip at this many standard deviations (2.5 in the paper; 0 disables), but
            never below ``clip_sigmas·|mean(g)|``: the paper's 2.5σ assumes zero-centred
            gradients, and for a constant (or nearly constant) tensor σ is 0 or float rounding
            noise, which clipped every value to about 0 (``[0.7] * 8`` decoded to ±1.6e-7).
        seed: base seed of the per-rank generator.

    Payload: ``[scale (1,) float32, codes (ceil(n/4),) uint8]`` (2 bits per element).

    Raises:
        ValueError: negative ``clip_sigmas``.
    """

    name = "terngrad"
    summable = False
    aggregate_is_mean = True

    def __init__(self, clip_sigmas: float = 2.5, seed: int = 0):
        clip_sigmas = float(clip_sigmas)
        if not clip_sigmas >= 0:
            raise ValueError(f"clip_sigmas must be >= 0 (0 disables clipping), got {clip_sigmas}")
        self.clip_sigmas = clip_sigmas
        self.rng = RankGenerators(seed)

    def describe(self):
        return {"name": self.name, "clip_sigmas": self.clip_sigmas}

    def nominal_ratio(self, numel):
        return 4 * numel / (4 + packed_nbytes(numel, 2))

    def _encode(self, tensor, name=None):
        g = tensor.reshape(-1).to(torch.float32)
        if self.clip_sigmas > 0 and g.numel() > 1:
            c = self.clip_sigmas * torch.maximum(g.std(), g.mean().abs())
            g = torch.maximum(torch.minimum(g, c), -c)
        s = g.abs().max() if g.numel() else g.new_zeros(())
        safe = torch.where(s > 0, s, torch.ones_like(s))
        u = torch.rand(g.shape, generator=self.rng.get(g.device), device=g.device)
        keep = (u < g.abs() / safe) & (s > 0)
        codes = (torch.sign(g) * keep + 1).to(torch.int32)
        return [s.reshape(1), pack_bits(codes, 2)], (tensor.shape, tensor.dtype, g.numel())

    def decode(self, payload, ctx):
        s, packed = payload
        shape, dtype, n = ctx
        return ((unpack_bits(packed, 2, n) - 1).to(torch.float32) * s).reshape(shape).to(dtype)

    def state_dict(self):
        return {"rng": self.rng.state_dict()}

    def load_state_dict(self, state):
        self.rng.load_state_dict(state.get("rng", {}))
