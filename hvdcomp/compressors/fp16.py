"""``fp16``: float16 allreduce with a per-tensor power-of-two scale agreed across ranks.

What one float16 allreduce can carry. Horovod averages a float16 payload on CPU by summing it
rank after rank (each pairwise addition done in float32 and rounded back to float16), then
multiplying by 1/N in float32 and rounding to float16 again (``op=Average``, N = world size). For
values x scaled by s before the cast:

* overflow: every partial sum must stay within ±65504, so |s·x| ≤ 65504/N on every rank;
* underflow: |s·x| below 2^-14 (float16's smallest normal number) keeps only an absolute
  precision of 2^-25, and below 2^-25 it becomes 0.

So at full relative precision one allreduce spans magnitudes within a factor of about 2^30/N of
each other (N = 1024: about 1e6). No fixed s covers gradients from 1e-6 to 6e4 at N = 1024; a
fixed pre-division by N (the previous scheme here, and PyTorch DDP's fp16 hook) flushes 1e-6 to 0
at N = 64 already. The window has to follow each tensor's magnitude, and the scale must be the
same on every rank (payloads of different scales cannot be summed).

Scheme (tensors with a name, i.e. under :class:`hvdcomp.DistributedOptimizer`):

1. **Probe step** (a tensor's first step, and every step until some rank has sent a non-zero
   value): the payload is float32 ``[x (n), one-hot(e_r) (277)]`` where e_r = ⌊log2 max|x_r|⌋
   is this rank's largest exponent, one bin per float32 exponent (−149 … 127). The average is
   exact to float32 rounding, and the highest occupied bin of the averaged histogram is
   E = max over ranks of e_r, known identically on every rank.
2. **Scaled steps**: s = 2^k with k = ⌊log2(65504/N)⌋ − (E + 1) − ``headroom``, so the largest
   value of the previous step lands ``headroom`` binades below the overflow limit. The payload is
   float16 ``[clamp(s·x, ±C_N) (n), one-hot(e_r − E) (2J+1 = 25)]`` with C_N the largest
   float16 ≤ 65504/N (partial sums can never overflow: values that grew more than 2^headroom
   since the previous step saturate instead of becoming inf). The histogram, summed by the same
   allreduce, gives this step's E (exactly, within ±J = 12 binades of the previous one; beyond,
   E moves by 12 per step), used by the next step. Decoding divides by s (exact, a power of 2).
   No extra collective, no host synchronisation in ``encode``; ``decode`` (after the allreduce)
   reads the histogram (one synchronisation on GPU).
3. **Static** (no name: stock ``hvd.DistributedOptimizer(compression=...)``, which keeps no
   per-tensor state): s = 1/N as before, saturating at ±C_N (no partial sum can overflow; the
   old clamp at ±65504 let three ranks of 65504 overflow to inf).

Guarantee (``headroom`` h = 3, per element i, per step, against the exact mean m_i over ranks;
M = the largest |x| over ranks and elements of the previous step, and this step's values
at most 2^h·M):

* probe steps: float32 averaging, |error_i| ≤ (N + 2)·2^-24·mean_r|x_r,i|;
* scaled steps: for elements with mean_r|x_r,i| ≥ ρ_N·M, ρ_N = 2^(h − 13 − ⌊log2(65504/N)⌋),
  |error_i| ≤ (N + 2)·2^-11·mean_r|x_r,i| (one rounding at the cast, N − 1 additions, one at
  the 1/N; for N equal per-rank values the first-order bound is (N + 5)·2^-12·|m_i|, and the
  measured worst case about half of that: 0.8 % at N = 64, 12 % at N = 1024 — float16 addition
  itself, whatever the scale). ρ_N = 6e-8 at N = 2, 1.9e-6 at N = 64, 3.1e-5 at N = 1024.
  Smaller elements keep an absolute error of at most (N + 2)·2^-25/s;
* static: the same relative bound for |x| ≥ 2^-14·N; a rank's |x| above N·C_N ≥ 65504·(1 − 2^-10)
  saturates.

The lagged, agreed power-of-two scale is the dynamic loss scaling of mixed-precision training
(Micikevicius et al., "Mixed Precision Training", ICLR 2018) applied per tensor to the allreduce,
with the overflow check replaced by an exponent histogram that keeps the scale agreed.

Trade-offs: a tensor's first non-zero step costs 4 bytes per element instead of 2; every scaled
payload carries 25 extra float16 (50 bytes); a gradient that grows by more than 2^h = 8 times in
one step saturates for that step (with ``ef=true`` the excess stays in the residual and is sent
later); larger ``headroom`` tolerates faster growth and costs one binade of ρ_N per unit. The
compressor keeps one integer per tensor (``state_dict()["exponents"]``); it must be identical on
every rank (it is, when each rank decodes the same allreduced payloads or loads the same
checkpoint).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch

from .base import Compressor, cast_saturating
from .registry import register

FP16_MAX = 65504.0
#: Float32 exponents ⌊log2 |x|⌋ of finite non-zero values: −149 (smallest subnormal) … 127.
EXP_MIN, EXP_MAX = -149, 127
#: Bins of a scaled step's histogram on each side of the previous exponent.
SPAN = 12

STATIC, PROBE, SCALED = "static", "probe", "scaled"


class FP16Context(NamedTuple):
    """What :meth:`FP16Compressor.decode` needs: the gradient's shape and dtype, the payload's mode
    (static / probe / scaled), n, the world size N at encode, the scale exponent k (s = 2^k),
    the agreed exponent E the scale came from, and the parameter name."""

    shape: torch.Size
    dtype: torch.dtype
    mode: str
    numel: int
    world: int
    k: int
    exponent: int
    name: Optional[str]


def limit_exponent(world: int) -> int:
    """⌊log2(65504 / N)⌋: the top binade a float16 addend of an N-rank sum may occupy."""
    return math.floor(math.log2(FP16_MAX / world))


def addend_limit(world: int) -> float:
    """C_N: the largest float16 value ≤ 65504/N, so that N addends never sum beyond 65504."""
    top = limit_exponent(world)
    spacing = 2.0 ** (top - 10)
    return math.floor(FP16_MAX / world / spacing) * spacing


def _ldexp(t: torch.Tensor, k: int) -> torch.Tensor:
    """t·2^k for any integer k: two multiplications by powers of two that float32 can hold."""
    half = k // 2
    return t * (2.0 ** half) * (2.0 ** (k - half))


def _max_exponent(flat: torch.Tensor):
    """(⌊log2 max|flat|⌋ as a 0-d int64 tensor, whether max|flat| > 0): no host synchronisation."""
    top = flat.abs().amax() if flat.numel() else flat.new_zeros(())
    _, exponent = torch.frexp(top)  # top = mantissa·2^exponent, mantissa in [0.5, 1)
    return exponent.to(torch.int64) - 1, top > 0


def _one_hot(index: torch.Tensor, present: torch.Tensor, bins: int, dtype) -> torch.Tensor:
    """Shape ``index.shape + (bins,)``: 1 at ``index`` (clamped into the bins) where ``present``."""
    positions = torch.arange(bins, device=index.device)
    return ((positions == index.clamp(0, bins - 1).unsqueeze(-1)) & present.unsqueeze(-1)).to(dtype)


def _highest_bins(hist: torch.Tensor) -> list:
    """Per row of ``hist`` (m, bins): the highest bin > 0, or None where none is (one host read)."""
    occupied = hist > 0
    top = (occupied * torch.arange(hist.shape[1], device=hist.device)).amax(dim=1)
    return [t if any_ else None for t, any_ in zip(top.tolist(), occupied.any(dim=1).tolist())]


class FP16SegmentsContext(NamedTuple):
    """:class:`FP16Context` for several gradients in one call (``segments``): the flat buffer's
    numel and dtype, the segments, which segments are scaled (with their k and agreed exponent E)
    and which probe, and N."""

    numel: int
    dtype: torch.dtype
    world: int
    segments: object
    scaled: List[int]
    ks: List[int]
    exponents: List[int]
    probe: List[int]


def _ldexp_segments(values: torch.Tensor, sizes: List[int], ks: List[int],
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values`` (1-D, segments of ``sizes`` back to back; float16 or float32) with segment j
    times 2^ks[j], as float32, by the same two multiplications as :func:`_ldexp`: per-element
    factors repeated over the segments (``repeat_interleave``), one pass per multiplication. ``out``: a float32
    tensor of ``values``' length to write into (may be ``values`` itself when float32)."""
    counts = torch.tensor(sizes, dtype=torch.int64, device=values.device)

    def factor(powers):  # each segment's factor repeated over its elements: one op
        table = torch.tensor(powers, dtype=torch.float32, device=values.device)
        return torch.repeat_interleave(table, counts, output_size=values.numel())
    out = torch.mul(values, factor([2.0 ** (k // 2) for k in ks]), out=out)
    return out.mul_(factor([2.0 ** (k - k // 2) for k in ks]))


@register("fp16")
class FP16Compressor(Compressor):
    """Float16 transport with a per-tensor power-of-two scale agreed across ranks (see the module
    docstring for the scheme, its guarantee and trade-offs).

    Args:
        headroom: h ≥ 0 binades between the previous step's largest value and the overflow limit:
            values may grow 2^h-fold in one step without saturating; each binade costs one binade
            of small-value range (ρ_N doubles).

    Payload (one tensor, as stock Horovod needs): float32 ``(n + 277,)`` on a probe step, float16
    ``(n + 25,)`` on a scaled step, float16 ``(n,)`` without a name. Several gradients in one call
    (``segments``, :mod:`hvdcomp.compressors.segments`): each keeps its own scale and exponent,
    exactly as alone; the payload is ``[float16 (values of the scaled gradients, then a 25-bin
    histogram each)]`` followed by ``[float32 (values of the probing ones, then 277 bins each)]``,
    either omitted when empty. ``decode`` is linear in the
    payload, so ``decode(average of payloads)`` is the averaged gradient, under hvdcomp and under
    stock ``hvd.DistributedOptimizer(compression=FP16Compressor())`` (``op=Average``); it also
    records the agreed exponent of named tensors, so call it once per step on the *averaged*
    payload (error feedback uses :meth:`residual_`, which records nothing).

    State: ``exponents`` (parameter name → agreed exponent E, an int).

    Raises:
        ValueError: ``headroom`` not an integer in [0, 16].
    """

    name = "fp16"
    shared_state_keys = ("exponents",)  # agreed: identical on every rank
    wire_dtype = torch.float16

    def __init__(self, headroom: int = 3):
        if not isinstance(headroom, int) or not 0 <= headroom <= 16:
            raise ValueError(f"headroom must be an integer in [0, 16] (binades of growth tolerated "
                             f"per step, e.g. headroom=3); got {headroom!r}")
        self.headroom = headroom
        self.exponents: dict = {}

    def describe(self):
        out = {"name": self.name}
        if self.headroom != 3:
            out["headroom"] = self.headroom
        return out

    def nominal_ratio(self, numel):
        return 2.0

    def scale_exponent(self, exponent: int, world: int) -> int:
        """k with s = 2^k for a tensor whose agreed largest exponent is ``exponent`` at N = ``world``."""
        return limit_exponent(world) - (exponent + 1) - self.headroom

    # ---- encode ----------------------------------------------------------------------------
    def _encode(self, tensor, name=None):
        n, size = tensor.numel(), self.group_size()
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:  # float64 beyond float32's range saturates, like float16 does
            flat = cast_saturating(flat, torch.float32)
        limit = addend_limit(size)
        exponent = None if name is None else self._get("exponents", name)
        if name is None:
            wire = flat.div(size).clamp(-limit, limit).to(self.wire_dtype)
            return [wire], FP16Context(tensor.shape, tensor.dtype, STATIC, n, size, 0, 0, None)
        local, present = _max_exponent(flat)
        if exponent is None:
            hist = _one_hot(local - EXP_MIN, present, EXP_MAX - EXP_MIN + 1, torch.float32)
            return [torch.cat([flat, hist])], FP16Context(tensor.shape, tensor.dtype, PROBE, n, size, 0, 0, name)
        k = self.scale_exponent(exponent, size)
        values = _ldexp(flat, k).clamp(-limit, limit).to(self.wire_dtype)
        hist = _one_hot(local - exponent + SPAN, present, 2 * SPAN + 1, self.wire_dtype)
        return [torch.cat([values, hist])], FP16Context(tensor.shape, tensor.dtype, SCALED, n, size, k,
                                                         exponent, name)

    def _encode_segments(self, flat, segments):
        """Each segment scaled by its own agreed exponent (probing where it has none), in a few
        vectorised operations over the buffer; one payload tensor per mode."""
        size, dtype = self.group_size(), flat.dtype
        if flat.dtype != torch.float32:
            flat = cast_saturating(flat, torch.float32)
        limit = addend_limit(size)
        agreed = self._get_many("exponents", segments.names)
        scaled = [j for j, e in enumerate(agreed) if e is not None]
        probe = [j for j, e in enumerate(agreed) if e is None]
        top = segments.amax(flat)
        _, local = torch.frexp(top)
        local, present = local.to(torch.int64) - 1, top > 0
        views = segments.split(flat)
        payload, ks, exps = [], [], []
        if scaled:
            exps = [agreed[j] for j in scaled]
            ks = [self.scale_exponent(e, size) for e in exps]
            values = flat if len(scaled) == len(segments) else torch.cat([views[j] for j in scaled])
            values = _ldexp_segments(values, [segments.sizes[j] for j in scaled], ks).clamp_(-limit, limit)
            pick = torch.tensor(scaled, device=flat.device)
            hist = _one_hot(local[pick] - torch.tensor(exps, device=flat.device) + SPAN, present[pick],
                            2 * SPAN + 1, self.wire_dtype)
            payload.append(torch.cat([values.to(self.wire_dtype), hist.reshape(-1)]))
        if probe:
            pick = torch.tensor(probe, device=flat.device)
            hist = _one_hot(local[pick] - EXP_MIN, present[pick], EXP_MAX - EXP_MIN + 1, torch.float32)
            payload.append(torch.cat([views[j] for j in probe] + [hist.reshape(-1)]))
        return payload, FP16SegmentsContext(flat.numel(), dtype, size, segments, scaled, ks, exps, probe)

    def _segment_values(self, payload, ctx, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The flat float32 values of a segmented payload (segment order), recording nothing;
        written into ``out`` (float32, 1-D) when given."""
        sizes = ctx.segments.sizes
        parts = [None] * len(sizes)
        wire = 0
        if ctx.scaled:
            count = sum(sizes[j] for j in ctx.scaled)
            scaled_sizes = [sizes[j] for j in ctx.scaled]
            if len(ctx.scaled) == len(sizes):
                return _ldexp_segments(payload[wire][:count], scaled_sizes, [-k for k in ctx.ks], out=out)
            values = _ldexp_segments(payload[wire][:count], scaled_sizes, [-k for k in ctx.ks])
            for j, v in zip(ctx.scaled, values.split(scaled_sizes)):
                parts[j] = v
            wire += 1
        if ctx.probe:
            count = sum(sizes[j] for j in ctx.probe)
            for j, v in zip(ctx.probe, payload[wire][:count].split([sizes[j] for j in ctx.probe])):
                parts[j] = v
        return torch.cat(parts, out=out) if out is not None else torch.cat(parts)

    def _record_segments(self, payload, ctx) -> None:
        """:meth:`_record` for each segment (one host read per payload tensor)."""
        names, wire = ctx.segments.names, 0
        if ctx.scaled:
            count = sum(ctx.segments.sizes[j] for j in ctx.scaled)
            bins = payload[0][count:].view(len(ctx.scaled), 2 * SPAN + 1)
            for j, e, top in zip(ctx.scaled, ctx.exponents, _highest_bins(bins)):
                if top is not None:
                    self._put("exponents", names[j], e + top - SPAN)
            wire = 1
        if ctx.probe:
            count = sum(ctx.segments.sizes[j] for j in ctx.probe)
            bins = payload[wire][count:].view(len(ctx.probe), EXP_MAX - EXP_MIN + 1)
            for j, top in zip(ctx.probe, _highest_bins(bins)):
                if top is not None:
                    self._put("exponents", names[j], EXP_MIN + top)

    # ---- decode ----------------------------------------------------------------------------
    def _values(self, payload, ctx) -> torch.Tensor:
        """The dense float32 values of ``payload`` (shape of the gradient), recording nothing."""
        if isinstance(ctx, FP16SegmentsContext):
            return self._segment_values(payload, ctx)
        wire = payload[0]
        if ctx.mode == STATIC:
            out = wire.to(torch.float32) * ctx.world
        elif ctx.mode == PROBE:
            out = wire[:ctx.numel].to(torch.float32)
        else:
            out = _ldexp(wire[:ctx.numel].to(torch.float32), -ctx.k)
        return out.reshape(ctx.shape)

    def _record(self, payload, ctx) -> None:
        """Read the averaged exponent histogram and keep the agreed exponent for the next step."""
        if isinstance(ctx, FP16SegmentsContext):
            self._record_segments(payload, ctx)
            return
        if ctx.mode == STATIC:
            return
        occupied = torch.nonzero(payload[0][ctx.numel:] > 0)
        if occupied.numel() == 0:  # zero on every rank: keep what we had (a probe stays a probe)
            return
        top = int(occupied.max())
        agreed = EXP_MIN + top if ctx.mode == PROBE else ctx.exponent + top - SPAN
        self._put("exponents", ctx.name, agreed)

    def decode(self, payload, ctx):
        """The averaged gradient (shape and dtype of the original; saturating cast) from the
        averaged payload; records the agreed exponent (see the class docstring)."""
        self._record(payload, ctx)
        return cast_saturating(self._values(payload, ctx), ctx.dtype)  # (segments: flat, float32)

    def decode_into(self, out, payload, ctx):
        """:meth:`decode` written into ``out``; a segmented payload is decoded in ``out``'s memory
        (contiguous float32 ``out``: no temporary)."""
        if isinstance(ctx, FP16SegmentsContext) and out.dtype == torch.float32 and out.is_contiguous():
            self._record(payload, ctx)
            self._segment_values(payload, ctx, out=out.view(-1))
            return out
        return super().decode_into(out, payload, ctx)

    def residual_(self, p, payload, ctx):
        """``p - (this rank's payload decoded)``, without recording an exponent (the local payload
        is not the average)."""
        return p - self._values(payload, ctx).to(p.dtype)

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self):
        return {"exponents": dict(self.exponents)}

    def load_state_dict(self, state):
        unknown = sorted(set(state) - {"exponents"})
        if unknown:
            raise ValueError(f"fp16 state has only 'exponents', got keys {unknown}")
        self.exponents = {k: int(v) for k, v in state.get("exponents", {}).items()}
