"""``signsgd``: signSGD with majority vote; ``efsignsgd``: scaled signs with error feedback.

Bernstein, Wang, Azizzadenesheli and Anandkumar, "signSGD: Compressed Optimisation for
Non-Convex Problems", ICML 2018; Bernstein, Zhao, Azizzadenesheli and Anandkumar, "signSGD with
Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019.

Each rank sends sign(g) ∈ {−1, +1} (sign(0) = +1); the aggregate is sign(Σ_ranks sign(g_r)), again
with sign(0) = +1: the elementwise majority, ties going to +1. The optimizer then steps by
``lr · vote``. Kernels (native on CPU, torch elsewhere): docs/kernels.md.
"""
from __future__ import annotations

import torch

from .. import native
from ..checks import check_choice
from .base import AggregateInto, Compressor, ErrorBound, float32_flat, write_back, PayloadKind
from .bitpack import pack_bits, packed_nbytes, unpack_codes
from .registry import register
from .segments import SegmentsContext


def _sign_bits(flat: torch.Tensor, abs_sum: bool = False):
    """1-bit payload [x >= 0] of the 1-D ``flat`` and, with ``abs_sum``, Σ|x| as a 0-d float64
    tensor (native, for contiguous float32 CPU input: one pass for both)."""
    n = flat.numel()
    if flat.dtype == torch.float32 and flat.is_contiguous() and native.usable(flat):
        packed = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8)
        total = native.sign_bits(flat, packed, abs_sum)
        return packed, (torch.tensor(total, dtype=torch.float64) if abs_sum else None)
    packed = pack_bits(flat >= 0, 1)
    return packed, (flat.abs().sum(dtype=torch.float64) if abs_sum else None)


@register("signsgd")
class SignSGDCompressor(AggregateInto, Compressor):
    """Majority-vote signSGD.

    Args:
        vote: ``"allreduce"``: votes ±1 summed by Horovod allreduce in int32 (Horovod 0.28's
            smallest integer allreduce type, so 4 bytes per element travel); ``"allgather"``:
            signs packed at 1 bit per element, gathered, and summed locally (n/8 bytes sent,
            N·n/8 received). Both give the same result.

    Payload: ``[votes (n,) int32]`` (allreduce; after it, the summed votes) or
    ``[signs (ceil(n/8),) uint8]`` (allgather, bit i = [g_i >= 0]).

    Raises:
        ValueError: unknown ``vote``.
    """

    name = "signsgd"
    elementwise = True
    majority_vote = True  # (and aggregate_is_mean stays False: a vote, not a mean of decodes)

    def __init__(self, vote: str = "allreduce"):
        self.vote = vote = check_choice(vote, "vote", ("allreduce", "allgather"))
        self.payload_kind = PayloadKind.SUM if vote == "allreduce" else PayloadKind.GATHERED

    def describe(self):
        return {"name": self.name, "vote": self.vote}

    @property
    def error_bound(self):
        """Unscaled signs: none (‖v − sign(v)‖ can exceed ‖v‖)."""
        return ErrorBound("none", "its unscaled signs are not a contraction (‖v − sign(v)‖ can exceed ‖v‖): use efsignsgd "
                                  "(alias 'sign'), the scaled sign ‖v‖₁/n·sign(v)")

    def nominal_ratio(self, numel):
        return 32.0

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1)
        ctx = (tensor.shape, tensor.dtype)
        if self.payload_kind is not PayloadKind.SUM:
            return [_sign_bits(flat)[0]], ctx
        if flat.dtype == torch.float32 and flat.is_contiguous() and native.usable(flat):
            votes = torch.empty(flat.numel(), dtype=torch.int32)
            native.sign_votes(flat, votes)
            return [votes], ctx
        return [torch.where(flat >= 0, 1, -1).to(torch.int32)], ctx

    def aggregate_into(self, out, payloads, ctx):
        """Majority of the payloads' votes (one payload: the sign of its, possibly summed, votes)."""
        flat = float32_flat(out)
        n = flat.numel()
        if not payloads:
            flat.fill_(1.0)  # no votes: sign(0) = +1
        elif native.usable(flat, *[p[0] for p in payloads]):
            if self.payload_kind is PayloadKind.SUM:
                native.majority(flat, votes=[p[0].to(torch.int32).contiguous() for p in payloads])
            else:
                native.majority(flat, bits=[p[0].contiguous() for p in payloads])
        else:
            if self.payload_kind is PayloadKind.SUM:
                total = sum(p[0] for p in payloads)
            else:
                total = sum(unpack_codes(p[0], 1, n).to(torch.int32) * 2 - 1 for p in payloads)
            flat.copy_(torch.where(total >= 0, 1.0, -1.0).reshape(-1))  # sign(0) = +1
        return write_back(out, flat)


@register("efsignsgd")
class ScaledSignCompressor(AggregateInto, Compressor):
    """EF-signSGD: ``(‖p‖₁/n)·sign(p)`` with error feedback (on by default).

    Karimireddy, Rebjock, Stich and Jaggi, "Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes", ICML 2019.

    Payload: ``[scale (1,) float32, signs (ceil(n/8),) uint8]`` (1 bit per element,
    sign(0) = +1). The scale differs per rank, so payloads are gathered and the decoded
    ``scale_r·sign_r`` averaged. Several gradients in one call (``segments``): ``[scales (one
    per gradient,) float32, signs of the whole buffer]``.
    """

    name = "efsignsgd"
    payload_kind = PayloadKind.GATHERED
    aggregate_is_mean = True
    default_error_feedback = True

    @property
    def error_bound(self):
        """‖v‖₁/n·sign(v) per tensor (sign(0) = +1): ‖C(v) − v‖² = ‖v‖² − ‖v‖₁²/n, so
        δ = ‖v‖₁²/(n‖v‖²) ≥ 1/n (Karimireddy et al., ICML 2019)."""
        return ErrorBound("contraction", "the scaled sign ‖v‖₁/n·sign(v): δ = ‖v‖₁²/(n‖v‖²) ≥ 1/n",
                          delta=lambda n: 1.0 / max(1, n))

    def nominal_ratio(self, numel):
        return 4 * numel / (4 + packed_nbytes(numel, 1))

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1).to(torch.float32).contiguous()
        # mean |p| in float64: the fp32 sum of large values can overflow although the mean cannot
        packed, total = _sign_bits(flat, abs_sum=True)
        scale = (total / max(1, flat.numel())).to(torch.float32).reshape(1)
        return [scale, packed], (tensor.shape, tensor.dtype)

    def _encode_segments(self, flat, segments):
        """Signs of the whole buffer, and each segment's scale ``Σ|p|/n`` with ``Σ|p|`` summed as
        :meth:`_encode` sums one gradient (one native call for all; elsewhere per segment)."""
        dtype = flat.dtype
        flat = flat.to(torch.float32).contiguous()
        packed, _ = _sign_bits(flat)
        if native.usable(flat):
            sums = native.abs_sums_segments(flat, segments.sizes_tensor())
        else:
            sums = torch.stack([v.abs().sum(dtype=torch.float64) for v in segments.split(flat)])
        scales = sums.div_(segments.sizes_tensor().clamp(min=1).to(sums.device)).to(torch.float32)
        return [scales, packed], SegmentsContext(flat.shape, dtype, segments)

    def aggregate_into(self, out, payloads, ctx):
        """Mean over ranks of ``scale_r·sign_r`` (each scale divided by the rank count first, so
        the sum cannot overflow), written into ``out``; segmented payloads with each segment's
        factors ``scale_r/W``."""
        segments = ctx.segments if isinstance(ctx, SegmentsContext) else None
        flat = float32_flat(out)
        if not payloads:
            flat.zero_()
            return write_back(out, flat)
        if segments is None:
            factors = torch.cat([p[0].reshape(1).to(torch.float32) for p in payloads]).div_(len(payloads))
        else:
            factors = torch.stack([p[0].to(torch.float32) for p in payloads]).div_(len(payloads))
        if native.usable(flat, factors, *[p[1] for p in payloads]):
            packed = [p[1].contiguous() for p in payloads]
            if segments is None:
                native.scaled_sign_aggregate(flat, factors, packed)
            else:
                native.scaled_sign_aggregate_segments(flat, factors, packed, segments.sizes_tensor())
            return write_back(out, flat)
        for w, (_, packed) in enumerate(payloads):  # each element with its (segment's) factor
            sign = unpack_codes(packed, 1, flat.numel()).to(torch.float32).mul_(2).sub_(1)
            f = factors[w].to(flat.device)
            if segments is not None:
                f = segments.expand(f)
            if w == 0:
                torch.mul(sign, f, out=flat)
            else:
                flat.addcmul_(sign, f)
        return write_back(out, flat)

    def residual_(self, p, payload, ctx):
        """``p - scale·sign`` in ``p``'s memory (contiguous float32 CPU ``p``, native kernels)."""
        scale, packed = payload
        if p.dtype != torch.float32 or not p.is_contiguous() or not native.usable(p, scale, packed):
            return super().residual_(p, payload, ctx)
        if isinstance(ctx, SegmentsContext):
            native.scaled_sign_aggregate_segments(p.view(-1), scale.reshape(1, -1).to(torch.float32), [packed],
                                                  ctx.segments.sizes_tensor(), decrement=True)
        else:
            native.scaled_sign_aggregate(p.view(-1), scale.reshape(1).to(torch.float32), [packed], decrement=True)
        return p
