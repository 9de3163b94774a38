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
   float16 ≤ 65504/N (partial sums can never overflow). The histogram, summed by the same
   allreduce, gives this step's E (exactly, within ±J = 12 binades of the previous one; beyond,
   E moves by 12 per step), used by the next step. Decoding divides by s (exact, a power of 2).
   No extra collective, no host synchronisation in ``encode``; ``decode`` (after the allreduce)
   reads the histogram (one synchronisation on GPU).
3. **Saturation is detected, never delivered.** A value that grew more than about 2^headroom
   since the previous step lands above C_N and is clamped there: finite and wrong. A rank that
   clamped (s·max|x_r| > C_N, from the maximum ``encode`` computes anyway) counts its exponent
   as at least E + h + 2 in its histogram, a bin no unclamped rank can reach (an unclamped rank
   has s·max|x_r| ≤ C_N < 2^(L+1), L = ⌊log2(65504/N)⌋, so e_r ≤ E + h + 1; a clamped one has
   e_r ≥ E + h + 1, and only that binade is bumped up by one). Every rank reads the same reduced
   histogram, so every rank knows, per tensor, whether some rank saturated
   (:meth:`FP16Compressor.saturation`) and resends that tensor in float32 or skips the step
   (``on_saturation``; docs/numerics.md). The flag costs no byte: the payload keeps its size.
4. **Static** (no name: stock ``hvd.DistributedOptimizer(compression=...)``, which keeps no
   per-tensor state and cannot resend): s = 1/N; |x/N| is clamped at C_N only where x itself is
   a float16 value (|x| < 65520, so the clamp is at most 2^-10 relative: within the bound
   below); a value float16 cannot hold (|x| ≥ 65520) travels as ±inf, so the averaged gradient
   is ±inf (or NaN), loud, as stock Horovod's ``Compression.fp16`` makes it. No partial sum of
   finite addends can overflow (the old clamp at ±65504 let three ranks of 65504 overflow).

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
* saturated scaled steps: as the probe step (``"resend"``), or a NaN gradient (``"skip"``);
  never a clamped value;
* static: the same relative bound for 2^-14·N ≤ |x| < 65520 (|x| in [N·C_N, 65520) is clamped,
  within it); |x| ≥ 65520 gives ±inf.

The lagged, agreed power-of-two scale is the dynamic loss scaling of mixed-precision training
(Micikevicius et al., "Mixed Precision Training", ICLR 2018) applied per tensor to the allreduce,
with the overflow check replaced by an exponent histogram that keeps the scale agreed.

Trade-offs: a tensor's first non-zero step costs 4 bytes per element instead of 2; every scaled
payload carries 25 extra float16 (50 bytes); a gradient that grows by more than 2^h = 8 times in
one step (at least; up to 2^(h+2) where max|x| of the previous step sat low in its binade and
C_N high in its own) costs that tensor a second allreduce of 4·(n + 277) bytes (``"resend"``) or
the step (``"skip"``); larger ``headroom`` tolerates faster growth and costs one binade of ρ_N
per unit. The compressor keeps one integer per tensor (``state_dict()["exponents"]``); it must be
identical on every rank (it is, when each rank decodes the same allreduced payloads or loads the
same checkpoint).
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import List, NamedTuple, Optional

import torch

from ..checks import check_choice, check_int
from .base import Compressor, ErrorBound, cast_saturating
from .registry import register

FP16_MAX = 65504.0
#: Float32 exponents ⌊log2 |x|⌋ of finite non-zero values: −149 (smallest subnormal) … 127.
EXP_MIN, EXP_MAX = -149, 127
#: Bins of a scaled step's histogram on each side of the previous exponent.
SPAN = 12

STATIC, PROBE, SCALED = "static", "probe", "scaled"
#: What a saturated scaled step does (see the module docstring): the first is the default.
ON_SATURATION = ("resend", "skip")
#: |x| from which float16's own (round-to-nearest) cast gives ±inf.
FP16_OVERFLOW = 65520.0


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
    source: Optional[torch.Tensor] = None  # scaled: the float32 values encoded (a resend sends them)


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
    """(⌊log2 max|flat|⌋ as a 0-d int64 tensor, whether max|flat| > 0, max|flat|): no host
    synchronisation."""
    top = flat.abs().amax() if flat.numel() else flat.new_zeros(())
    _, exponent = torch.frexp(top)  # top = mantissa·2^exponent, mantissa in [0.5, 1)
    return exponent.to(torch.int64) - 1, top > 0, top


def _one_hot(index: torch.Tensor, present: torch.Tensor, bins: int, dtype) -> torch.Tensor:
    """Shape ``index.shape + (bins,)``: 1 at ``index`` (clamped into the bins) where ``present``."""
    positions = torch.arange(bins, device=index.device)
    return ((positions == index.clamp(0, bins - 1).unsqueeze(-1)) & present.unsqueeze(-1)).to(dtype)


def _highest_bins(hist: torch.Tensor) -> list:
    """Per row of ``hist`` (m, bins): the highest bin > 0, or None where none is (one host read)."""
    # (bin + 1 where occupied, else 0: the highest is one number per row, read at once)
    top = ((hist > 0) * torch.arange(1, hist.shape[1] + 1, device=hist.device)).amax(dim=1)
    return [t - 1 if t else None for t in top.tolist()]


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
    source: Optional[torch.Tensor] = None  # the float32 flat buffer encoded (a resend sends parts)


class FP16ResendContext(NamedTuple):
    """Decodes a resend of segments that saturated (:meth:`FP16Compressor.saturation`): the
    reduced first payload ``averaged`` (its context ``base``) gives every segment but those in
    ``resent`` (segment indices), which come from the reduced float32 replacement."""

    base: FP16SegmentsContext
    averaged: list
    resent: List[int]

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype


class Saturation(NamedTuple):
    """What :meth:`FP16Compressor.saturation` found: some rank's values of ``names`` (parameter
    names) left the agreed scale's window this step.

    Attributes:
        names: the tensors (or segments) that saturated on some rank.
        payload: the replacement to allreduce (same op, prescale and postscale as the first
            payload) and decode with ``ctx`` instead of the first; ``None``: the step overflowed
            (``on_saturation="skip"``): report it non-finite, decode nothing.
        ctx: the context that decodes the reduced replacement.
        delta: per name, what this rank's replacement sends minus what its first payload sent
            (float32, the gradient's shape): error feedback subtracts it from the residual.
    """

    names: tuple
    payload: Optional[list]
    ctx: object
    delta: dict


def _sent_scaled(values: torch.Tensor, k: int, limit: float) -> torch.Tensor:
    """What a scaled payload of float32 ``values`` decodes to locally (the clamp and float16
    rounding of ``encode``, undone by 2^-k), float32."""
    return _ldexp(_ldexp(values, k).clamp(-limit, limit).to(torch.float16).to(torch.float32), -k)


class _Runs:
    """Segments of ``sizes`` (back to back in a 1-D buffer) as strided runs, each one ``(count, n)``
    view: segments of one size n at one spacing (a model's repeated layers; per size, the spacing to
    one of its first 16 that gives the fewest runs). ``order``: the non-empty segments, run by run."""

    def __init__(self, sizes: tuple):
        self.sizes, offsets, by_size = sizes, list(itertools.accumulate(sizes, initial=0)), {}
        for j, n in enumerate(sizes):
            if n:
                by_size.setdefault(n, []).append(j)
        self.order, self.runs, self._index = [], [], {}
        for n, members in by_size.items():
            strides = {offsets[j] - offsets[members[0]] for j in members[1:17]} or {n}
            for start, stride, run in min((_strided(members, offsets, s) for s in strides), key=len):
                self.runs.append((start, stride, len(run), n))
                self.order += run

    def amax(self, flat: torch.Tensor) -> torch.Tensor:
        """max |segment| per segment of the contiguous 1-D ``flat``: ``(len(sizes),)``, 0 for an
        empty segment; NaN propagates (one ``amax`` per run)."""
        top = flat.new_zeros(len(self.sizes))
        if self.runs:
            if flat.device not in self._index:
                self._index[flat.device] = torch.tensor(self.order, device=flat.device)
            top[self._index[flat.device]] = torch.cat([v.amax(dim=1) for v in self.views(flat.abs())])
        return top

    def views(self, flat: torch.Tensor) -> list:
        """The runs of the contiguous 1-D ``flat``, ``(count, n)`` views, in :attr:`runs` order."""
        base = flat.storage_offset()
        return [flat.as_strided((count, n), (stride, 1), base + start) for start, stride, count, n in self.runs]


def _strided(members: list, offsets: list, stride: int) -> list:
    """``members`` (segments of one size, in order) as runs ``(start, stride, [segments])`` of
    that spacing, each segment appended to the run that expects it."""
    expected, runs = {}, []
    for j in members:
        run = expected.pop(offsets[j], None)
        if run is None:
            run = (offsets[j], stride, [])
            runs.append(run)
        run[2].append(j)
        expected[offsets[j] + stride] = run
    return runs


_runs = functools.lru_cache(maxsize=256)(_Runs)


def _on(device: torch.device, values: list) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``; on a GPU by an asynchronous copy from pinned memory
    (``torch.tensor(values, device=...)`` would wait for the device)."""
    host = torch.tensor(values)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def _ldexp_segments(values: torch.Tensor, sizes: List[int], ks: List[int],
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values`` (1-D, segments of ``sizes`` back to back; float16 or float32) times 2^ks[j] in
    segment j, as float32 (into ``out``, float32, may be ``values``), by :func:`_ldexp`'s two
    multiplications: one pair per strided run of segments (:class:`_Runs`)."""
    if out is None:
        out = values.to(torch.float32, copy=True)
    elif out.data_ptr() != values.data_ptr():
        out.copy_(values)
    plan = _runs(tuple(sizes))
    half = [ks[j] // 2 for j in plan.order]
    factors = _on(out.device, [2.0 ** h for h in half] + [2.0 ** (ks[j] - h) for j, h in zip(plan.order, half)])
    factors = factors.view(2, -1, 1)
    at = 0
    for view, (_, _, count, _) in zip(plan.views(out), plan.runs):
        view.mul_(factors[0, at:at + count]).mul_(factors[1, at:at + count])
        at += count
    return out


class SaturationCheck:
    """The part of :class:`FP16Compressor` that never lets a saturated value through: reading,
    from the averaged payload's histogram, whether some rank's values left the scale's window
    (per tensor, per segment of a fused bucket), and building the float32 resend (or reporting
    the overflow) that the allreduce transport runs (``on_saturation``, see the class docstring).
    """

    def _flagged_offset(self, offset: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
        """e_r − E as the histogram counts it: at least h + 2 where this rank clamped (the
        saturation flag, see the module docstring). Tensors of any shape, no host sync."""
        return torch.where(clamped, offset.clamp(min=self.headroom + 2), offset)

    def saturation(self, payload, ctx) -> Optional[Saturation]:
        """Whether some rank's values of a scaled tensor (or segment) were clamped at C_N this step,
        read from the reduced ``payload`` (every rank reads the same, so every rank decides the
        same; one host read), and what to do about it (``on_saturation``).

        Args:
            payload: the reduced (averaged, or summed for ``op=Sum``) payload, before
                :meth:`~hvdcomp.compressors.base.Compressor.decode`.
            ctx: this rank's context from :meth:`~hvdcomp.compressors.base.Compressor.encode`.

        Returns:
            ``None`` when nothing saturated (decode ``payload`` as usual); else a
            :class:`Saturation`: with ``"resend"``, a float32 probe payload of the saturated
            tensors (this rank's encoded values: the mean comes out exact to float32 rounding,
            and its histogram re-learns E) to reduce and decode instead; with ``"skip"``, no
            payload (report the step as overflowed); the agreed exponent of the saturated
            tensors is then moved up at once (kept even though the step is rolled back), so the
            next step's scale fits.
        """
        if isinstance(ctx, FP16SegmentsContext):
            return self._segments_saturation(payload, ctx)
        if ctx.mode != SCALED:
            return None
        top = _highest_bins(payload[0][ctx.numel:].view(1, 2 * SPAN + 1))[0]
        self._remember(ctx, payload[0], [top])
        if top is None or top < SPAN + self.headroom + 2:  # (no rank clamped)
            return None
        if self.on_saturation == "skip":
            self.exponents[ctx.name] = ctx.exponent + top - SPAN
            return Saturation((ctx.name,), None, None, {})
        flat = ctx.source
        local, present, _ = _max_exponent(flat)
        hist = _one_hot(local - EXP_MIN, present, EXP_MAX - EXP_MIN + 1, torch.float32)
        delta = flat - _sent_scaled(flat, ctx.k, addend_limit(ctx.world))
        probe = ctx._replace(mode=PROBE, k=0, exponent=0, source=None)
        return Saturation((ctx.name,), [torch.cat([flat, hist])], probe, {ctx.name: delta.reshape(ctx.shape)})

    def _segments_saturation(self, payload, ctx) -> Optional[Saturation]:
        """:meth:`saturation` of a segmented payload: per scaled segment; a resend carries the
        saturated segments only (float32, then 277 bins each)."""
        if not ctx.scaled:
            return None
        sizes, names = ctx.segments.sizes, ctx.segments.names
        count = sum(map(sizes.__getitem__, ctx.scaled))
        tops = _highest_bins(payload[0][count:].view(len(ctx.scaled), 2 * SPAN + 1))
        self._remember(ctx, payload[0], tops)
        bound = SPAN + self.headroom + 2  # (the lowest bin of a rank that clamped)
        hit = [(i, j, t) for i, (j, t) in enumerate(zip(ctx.scaled, tops)) if t is not None and t >= bound]
        if not hit:
            return None
        saturated = tuple(names[j] for _, j, _ in hit)
        if self.on_saturation == "skip":
            for i, j, t in hit:
                self.exponents[names[j]] = ctx.exponents[i] + t - SPAN
            return Saturation(saturated, None, None, {})
        views = ctx.segments.split(ctx.source)
        values = [views[j] for _, j, _ in hit]
        top = torch.stack([v.abs().amax() for v in values])
        _, local = torch.frexp(top)
        hist = _one_hot(local.to(torch.int64) - 1 - EXP_MIN, top > 0, EXP_MAX - EXP_MIN + 1, torch.float32)
        limit = addend_limit(ctx.world)
        delta = {names[j]: (v - _sent_scaled(v, ctx.ks[i], limit)).view(ctx.segments.shapes[j])
                 for (i, j, _), v in zip(hit, values)}
        resend = FP16ResendContext(ctx, list(payload), [j for _, j, _ in hit])
        return Saturation(saturated, [torch.cat(values + [hist.reshape(-1)])], resend, delta)

    def _remember(self, ctx, reduced: torch.Tensor, tops: list) -> None:
        """Keep the highest bins just read from the reduced payload tensor ``reduced`` (encoded
        with ``ctx``), for its decode to record the agreed exponents without reading them again."""
        self.__dict__.setdefault("_seen", {})[id(ctx)] = (ctx, reduced, tops)

    def _recall(self, ctx, reduced: torch.Tensor) -> Optional[list]:
        """The highest bins :meth:`_remember` kept for ``ctx`` and this very ``reduced``, else None."""
        entry = self.__dict__.get("_seen", {}).pop(id(ctx), None)
        return entry[2] if entry is not None and entry[1] is reduced else None

    def _resend_values(self, payload, ctx: FP16ResendContext, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flat float32 values of a resend: the first payload's segments, the resent ones
        replaced by the reduced float32 replacement ``payload``; recording nothing."""
        out = self._segment_values(ctx.averaged, ctx.base, out=out)
        segments, pos = ctx.base.segments, 0
        for j in ctx.resent:
            size, at = segments.sizes[j], segments.offsets[j]
            out[at:at + size].copy_(payload[0][pos:pos + size])
            pos += size
        return out


@register("fp16")
class FP16Compressor(SaturationCheck, Compressor):
    """Float16 transport with a per-tensor power-of-two scale agreed across ranks (see the module
    docstring for the scheme, its guarantee and trade-offs).

    Args:
        headroom: h in [0, 10] binades between the previous step's largest value and the
            overflow limit: values may grow 2^h-fold in one step without saturating; each binade
            costs one binade of small-value range (ρ_N doubles). (At most ``SPAN − 2``: the
            saturation flag needs the histogram bin E + h + 2.)
        on_saturation: what a step does where some rank's values grew past the scale's window:
            ``"resend"`` (default: that tensor is allreduced again in float32, one more
            collective on such steps only) or ``"skip"`` (the step is reported non-finite and
            skipped on every rank, as an overflow; cheaper on the wire, costs the step).

    Payload (one tensor, as stock Horovod needs): float32 ``(n + 277,)`` on a probe step, float16
    ``(n + 25,)`` on a scaled step, float16 ``(n,)`` without a name. Several gradients in one call
    (``segments``, :mod:`hvdcomp.compressors.segments`): each keeps its own scale and exponent,
    exactly as alone; the payload is ``[float16 (values of the scaled gradients, then a 25-bin
    histogram each)]`` followed by ``[float32 (values of the probing ones, then 277 bins each)]``,
    either omitted when empty. ``decode`` is linear in the payload, so ``decode(average of
    payloads)`` is the averaged gradient, under hvdcomp and under stock
    ``hvd.DistributedOptimizer(compression=FP16Compressor())`` (``op=Average``). Ask
    :meth:`saturation` before ``decode`` (hvdcomp's transports do): alone, ``decode`` of a
    saturated payload gives the clamped values. ``decode`` records the agreed exponent of named
    tensors: call it once per step on the *averaged* payload (:meth:`residual_` records nothing).

    State: ``exponents`` (parameter name → agreed exponent E, an int).

    Raises:
        ValueError: ``headroom`` not an integer in [0, 10]; ``on_saturation`` not one of
            ``"resend"``, ``"skip"``.
    """

    name = "fp16"
    shared_state_keys = ("exponents",)  # agreed: identical on every rank
    wire_dtype = torch.float16

    def __init__(self, headroom: int = 3, on_saturation: str = "resend"):
        self.headroom = check_int(headroom, "headroom", 0, SPAN - 2,
                                  " (binades of growth tolerated per step, e.g. headroom=3)")
        self.on_saturation = check_choice(on_saturation, "on_saturation", ON_SATURATION,
                                          " ('resend': send a saturated tensor again in float32; 'skip': report "
                                          "the step as overflowed)")
        self.exponents: dict = {}

    def describe(self):
        out = {"name": self.name}
        if self.headroom != 3:
            out["headroom"] = self.headroom
        if self.on_saturation != ON_SATURATION[0]:
            out["on_saturation"] = self.on_saturation
        return out

    @property
    def error_bound(self):
        """None: the scale is agreed between ranks through the averaged payload (see the message)."""
        return ErrorBound("none", "its power-of-two scale is agreed between ranks through the averaged payload and kept "
                                  "from call to call (an allreduce's protocol); decoded alone, one neighbour's payload at "
                                  "a time, it saturates or diverges (Choco-SGD on a ring of 8 reached NaN within 30 "
                                  "steps): use bf16 (a plain rounding) or none")

    def nominal_ratio(self, numel):
        return 2.0

    def scale_exponent(self, exponent: int, world: int) -> int:
        """k with s = 2^k for a tensor whose agreed largest exponent is ``exponent`` at N = ``world``."""
        return limit_exponent(world) - (exponent + 1) - self.headroom

    # ---- encode ----------------------------------------------------------------------------
    def _encode(self, tensor, name=None):
        n, size = tensor.numel(), self.group_size()
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:  # float64 beyond float32's range becomes ±inf (loud)
            flat = flat.to(torch.float32)
        limit = addend_limit(size)
        exponent = None if name is None else self._get("exponents", name)
        if name is None:
            # |x| float16 can hold: clamped at C_N (≤ 2^-10 relative); beyond: ±inf, as float16 casts it
            wire = torch.where(flat.abs() >= FP16_OVERFLOW, flat, flat.div(size).clamp(-limit, limit))
            return [wire.to(self.wire_dtype)], FP16Context(tensor.shape, tensor.dtype, STATIC, n, size, 0, 0, None)
        local, present, top = _max_exponent(flat)
        if exponent is None:
            hist = _one_hot(local - EXP_MIN, present, EXP_MAX - EXP_MIN + 1, torch.float32)
            return [torch.cat([flat, hist])], FP16Context(tensor.shape, tensor.dtype, PROBE, n, size, 0, 0, name)
        k = self.scale_exponent(exponent, size)
        values = _ldexp(flat, k).clamp(-limit, limit).to(self.wire_dtype)
        hist = _one_hot(self._flagged_offset(local - exponent, _ldexp(top, k) > limit) + SPAN, present,
                        2 * SPAN + 1, self.wire_dtype)
        return [torch.cat([values, hist])], FP16Context(tensor.shape, tensor.dtype, SCALED, n, size, k,
                                                         exponent, name, flat)

    def _encode_segments(self, flat, segments):
        """Each segment scaled by its own agreed exponent (probing where it has none), in a few
        vectorised operations over the buffer; one payload tensor per mode."""
        size, dtype = self.group_size(), flat.dtype
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        limit = addend_limit(size)
        agreed = self._get_many("exponents", segments.names)
        scaled = [j for j, e in enumerate(agreed) if e is not None]
        probe = [j for j, e in enumerate(agreed) if e is None]
        top = _runs(tuple(segments.sizes)).amax(flat)
        _, local = torch.frexp(top)
        local, present = local.to(torch.int64) - 1, top > 0
        views = segments.split(flat) if probe else None  # (all scaled: no per-segment view)
        payload, ks, exps = [], [], []
        if scaled:
            exps = [agreed[j] for j in scaled]
            base = self.scale_exponent(0, size)  # (k = base − E)
            ks = [base - e for e in exps]
            values = flat if len(scaled) == len(segments) else torch.cat([views[j] for j in scaled])
            values = _ldexp_segments(values, [segments.sizes[j] for j in scaled], ks).clamp_(-limit, limit)
            pick = _on(flat.device, scaled)
            clamped = _ldexp_segments(top[pick], [1] * len(scaled), ks) > limit
            offset = self._flagged_offset(local[pick] - _on(flat.device, exps), clamped)
            hist = _one_hot(offset + SPAN, present[pick], 2 * SPAN + 1, self.wire_dtype)
            payload.append(torch.cat([values.to(self.wire_dtype), hist.reshape(-1)]))
        if probe:
            pick = _on(flat.device, probe)
            hist = _one_hot(local[pick] - EXP_MIN, present[pick], EXP_MAX - EXP_MIN + 1, torch.float32)
            payload.append(torch.cat([views[j] for j in probe] + [hist.reshape(-1)]))
        return payload, FP16SegmentsContext(flat.numel(), dtype, size, segments, scaled, ks, exps, probe,
                                            flat if scaled else None)

    def _segment_values(self, payload, ctx, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The flat float32 values of a segmented payload (segment order), recording nothing;
        written into ``out`` (float32, 1-D) when given."""
        sizes = ctx.segments.sizes
        parts = [None] * len(sizes)
        wire = 0
        if ctx.scaled:
            scaled_sizes = [sizes[j] for j in ctx.scaled]
            count = sum(scaled_sizes)
            if len(ctx.scaled) == len(sizes):
                return _ldexp_segments(payload[wire][:count], scaled_sizes, [-k for k in ctx.ks], out=out)
            values = _ldexp_segments(payload[wire][:count], scaled_sizes, [-k for k in ctx.ks])
            for j, v in zip(ctx.scaled, values.split(scaled_sizes)):
                parts[j] = v
            wire += 1
        if ctx.probe:
            count = sum(map(sizes.__getitem__, ctx.probe))
            for j, v in zip(ctx.probe, payload[wire][:count].split([sizes[j] for j in ctx.probe])):
                parts[j] = v
        return torch.cat(parts, out=out) if out is not None else torch.cat(parts)

    def _record_segments(self, payload, ctx) -> None:
        """:meth:`_record` for each segment (one host read per payload tensor)."""
        names, wire = ctx.segments.names, 0
        if ctx.scaled:
            tops = self._recall(ctx, payload[0])  # (read by the saturation check, where it ran)
            if tops is None:
                count = sum(map(ctx.segments.sizes.__getitem__, ctx.scaled))
                tops = _highest_bins(payload[0][count:].view(len(ctx.scaled), 2 * SPAN + 1))
            agreed = [(names[j], e + top - SPAN) for j, e, top in zip(ctx.scaled, ctx.exponents, tops)
                      if top is not None]
            self._put_many("exponents", [n for n, _ in agreed], [e for _, e in agreed])
            wire = 1
        if ctx.probe:
            self._record_probes(ctx.segments, ctx.probe, payload[wire])

    def _record_probes(self, segments, positions: List[int], wire: torch.Tensor) -> None:
        """The agreed exponents of the probing segments ``positions`` from the reduced ``wire``
        (their float32 values, then 277 bins each; one host read)."""
        bins = wire[sum(map(segments.sizes.__getitem__, positions)):].view(len(positions), EXP_MAX - EXP_MIN + 1)
        for j, top in zip(positions, _highest_bins(bins)):
            if top is not None:
                self._put("exponents", segments.names[j], EXP_MIN + top)

    # ---- saturation (after the first allreduce) ------------------------------------------------
    def _values(self, payload, ctx) -> torch.Tensor:
        """The dense float32 values of ``payload`` (shape of the gradient), recording nothing."""
        if isinstance(ctx, FP16SegmentsContext):
            return self._segment_values(payload, ctx)
        if isinstance(ctx, FP16ResendContext):
            return self._resend_values(payload, ctx)
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
        if isinstance(ctx, FP16ResendContext):  # (the first payload's, then the resent segments')
            self._record_segments(ctx.averaged, ctx.base)
            self._record_probes(ctx.base.segments, ctx.resent, payload[0])
            return
        if ctx.mode == STATIC:
            return
        tops = self._recall(ctx, payload[0])  # (read by the saturation check, where it ran)
        top = (tops or _highest_bins(payload[0][ctx.numel:].view(1, -1)))[0]
        if top is None:  # zero on every rank: keep what we had (a probe stays a probe)
            return
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
        if (isinstance(ctx, (FP16SegmentsContext, FP16ResendContext)) and out.dtype == torch.float32
                and out.is_contiguous()):
            self._record(payload, ctx)
            if isinstance(ctx, FP16ResendContext):
                self._resend_values(payload, ctx, out=out.view(-1))
            else:
                self._segment_values(payload, ctx, out=out.view(-1))
            return out
        return super().decode_into(out, payload, ctx)

    def residual_(self, p, payload, ctx):
        """``p - (this rank's payload decoded)``, without recording an exponent (the local payload
        is not the average)."""
        return p - self._values(payload, ctx).to(p.dtype)

    # ---- checkpointing ---------------------------------------------------------------------
    def begin_step(self) -> None:
        self.__dict__.pop("_seen", None)  # (bins read for a step whose payload was never decoded)
        super().begin_step()

    def state_dict(self):
        return {"exponents": dict(self.exponents)}

    def load_state_dict(self, state):
        self._check_state_keys(state, "exponents")
        self.exponents = {k: int(v) for k, v in state.get("exponents", {}).items()}
