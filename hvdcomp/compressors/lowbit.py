"""``lowbit``: 4- and 8-bit block quantization with moving-average error compensation.

After Xie, Lin, Toh and Zhou, "LoCo: Low-Bit Communication Adaptor for Large-scale Model
Training", 2024. Per quantization block j of ``block`` elements, L = 2^(bits−1) − 1 and
s_j = max|v_i| / L (float32), the codes c_i = clamp(round(v_i / s_j), −L, L) travel unsigned at
``bits`` bits each and decode as s_j·c_i (|v_i − Q(v)_i| ≤ s_j / 2 up to float32 rounding). The
compensation h (per parameter name, float32 for float16/bfloat16 gradients, else the gradient's
dtype) follows p_t = g_t + h_{t−1}, q_t = Q(p_t), h_t = β·h_{t−1} + (1 − β)·(p_t − q_t); β = 0
is error feedback exactly. A NaN or Inf decodes its block as NaN (encoding does not fail; the
optimizer's non-finite guard skips the step and the rollback drops the staged h). Scales differ
per rank (allgather); the aggregate is the mean of the decodes (``aggregate_is_mean``). The
quantizer, the backlog bound and the differences from the paper: docs/methods.md, "Low-bit
quantization with error compensation".
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, Sequence

import torch

from .base import AggregateInto, Compressor, ErrorBound, cast_saturating, copy_saturating_, PayloadKind
from .bitpack import pack_bits, packed_nbytes, unpack_codes
from ..memory import Residuals
from ..checks import check_count, check_int, check_range
from .registry import register

__all__ = ["LowBitCompressor", "LowBitQuantizer"]

_HALF = (torch.float16, torch.bfloat16)
FP32_MAX = torch.finfo(torch.float32).max

#: Elements of the output written per chunk by :meth:`LowBitCompressor.aggregate_into`: two
#: float32 scratch buffers of this size (1 MiB each) take every rank's codes before the chunk is
#: written once; smaller chunks were slower on CPU (Python overhead per chunk and rank).
_CHUNK = 1 << 18


def _largest_scale(levels: int) -> float:
    """The largest float32 s with float32(levels·s) finite (float32's max / L, rounded down
    until the product is finite: for L = 127, float32(max/127)·127 rounds to Inf)."""
    s = torch.tensor(FP32_MAX / levels, dtype=torch.float32)
    while not torch.isfinite(s * levels):
        s = torch.nextafter(s, torch.zeros_like(s))
    return s.item()


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """:func:`~hvdcomp.compressors.bitpack.pack_bits` at 4 bits (the same layout: code 2k in the
    low nibble of byte k, code 2k+1 in the high one) of a contiguous uint8 tensor of codes < 16.

    On little-endian hosts each pair of codes read as one int16 x is ``c_2k + 256·c_2k+1``, and
    the low byte of ``x | (x >> 4)`` is ``c_2k + 16·c_2k+1``: three contiguous passes (strided
    byte-wide shifts were 4x slower)."""
    m = codes.numel()
    if m % 2 or codes.storage_offset() % 2:
        padded = torch.zeros(m + m % 2, dtype=torch.uint8, device=codes.device)
        padded[:m] = codes
        codes = padded
    if sys.byteorder == "little":
        x = codes.view(torch.int16)
        return torch.bitwise_right_shift(x, 4).bitwise_or_(x).to(torch.uint8)
    pairs = codes.view(-1, 2)
    return torch.bitwise_left_shift(pairs[:, 1], 4).bitwise_or_(pairs[:, 0])


@register("lowbit")
class LowBitCompressor(AggregateInto, Compressor):
    """Block quantization at ``bits`` bits with moving-average error compensation (see
    docs/methods.md for every formula).

    Args:
        bits: bits per element, 2 ≤ bits ≤ 8 (the paper: 4 or 8); L = 2^(bits−1) − 1 levels per
            sign.
        block: elements per quantization block (one float32 scale each), ≥ 1. Default 512 (as
            QSGD's bucket here): 1/16 bit of scale per element.
        beta: β in [0, 1), the weight of the previous compensation in its moving average.
            Default 0 (classic error feedback; docs/methods.md).

    Payload: ``[scales (ceil(n/block),) float32, codes (ceil(n·bits/8),) uint8]``;
    ``4·ceil(n/block) + ceil(n·bits/8)`` bytes (:meth:`expected_payload_bytes`, exact).

    State: h per parameter name, the gradient's shape, float32 for float16/bfloat16 gradients and
    the gradient's dtype otherwise, on the gradient's device; ``state_dict() ==
    {"residuals": {name: h}}`` (per rank, staged during an open step).

    Raises:
        ValueError: ``bits`` not an integer in [2, 8], ``block`` not an integer ≥ 1, ``beta`` not
            in [0, 1); from :meth:`encode`, no parameter name, or a stored h whose shape differs
            from the gradient's; from :meth:`load_state_dict`, unknown keys or non-tensor values.
        TypeError: from :meth:`encode`, a complex or integer gradient.
    """

    name = "lowbit"
    payload_kind = PayloadKind.GATHERED
    aggregate_is_mean = True
    builtin_error_feedback = True
    has_scaled_state = True
    elementwise = False

    def __init__(self, bits: int = 4, block: int = 512, beta: float = 0.0):
        self.bits = check_int(bits, "bits", 2, 8, " (4 or 8 in the paper, e.g. bits=4)")
        self.block = check_count(block, "block", 1, " (elements per quantization block, e.g. block=512)")
        self.beta = check_range(beta, "beta", 0.0, 1.0, high_open=True,
                                hint=" (0: classic error feedback, e.g. beta=0)")
        self.levels = (1 << (self.bits - 1)) - 1          # L
        unit = math.lcm(self.block, 8)                    # chunks start on whole blocks and bytes
        self._chunk = max(1, _CHUNK // unit) * unit
        self._scale_max = _largest_scale(self.levels)
        self.memory = Residuals(self, beta=self.beta)  # h: the moving average of the errors

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "bits": self.bits, "block": self.block, "beta": self.beta}

    # ---- sizes ---------------------------------------------------------------------------------
    def wire_bytes(self, numel: int) -> int:
        """Exact payload bytes for ``numel`` elements: ``4·ceil(n/block) + ceil(n·bits/8)``."""
        return 4 * math.ceil(numel / self.block) + packed_nbytes(numel, self.bits)

    def expected_payload_bytes(self, numel: int) -> int:
        """Exact bytes one rank sends for ``numel`` elements (:meth:`wire_bytes`; 0 for 0)."""
        return self.wire_bytes(numel)

    @property
    def error_bound(self):
        """None: it carries its quantization error from call to call."""
        return ErrorBound("none", "it keeps its own error compensation between calls, so one call's error is not "
                                  "bounded by ‖v‖: use qsgd")

    def nominal_ratio(self, numel: int) -> float:
        """``32 / (bits + 32/block)`` (float32 values against bits per element plus the scale's
        share), independent of ``numel`` (the seed study's convention)."""
        return 32.0 / (self.bits + 32.0 / self.block)

    # ---- the quantizer ---------------------------------------------------------------------------
    def _work(self, size: int, device: torch.device) -> torch.Tensor:
        """A float32 work buffer of ``size`` elements: on CPU one kept between calls (grown to the
        largest gradient; fresh large CPU tensors page-fault on first touch, which cost more
        than the quantization itself), elsewhere a new one (CUDA's caching allocator reuses
        memory)."""
        if device.type != "cpu":
            return torch.empty(size, dtype=torch.float32, device=device)
        buf = self.__dict__.get("_cpu_work")
        if buf is None or buf.numel() < size:
            buf = self._cpu_work = torch.empty(size, dtype=torch.float32)
        return buf[:size]

    def _quantize(self, v: torch.Tensor):
        """Q of a 1-D contiguous float32 tensor: ``(payload, q)`` with ``payload = [scales, codes]``
        (new tensors) and ``q = Q(v)`` as float32 (n,), equal to decoding the payload (bit for
        bit, but for the sign of zeros). ``q`` may be this instance's work buffer: use it before
        the next call."""
        n, d, L = v.numel(), self.block, self.levels
        nb, full = math.ceil(n / d), n // d * d
        # one (nb, d) work tensor: |v| for the scales, then v/s, the codes and q; the last block's
        # padding is zero (no padded copy of v)
        work = self._work(nb * d, v.device)
        work[n:].zero_()
        torch.abs(v, out=work[:n])
        c = work.view(nb, d)
        scales = c.amax(dim=1) if nb else torch.zeros(0, dtype=torch.float32, device=v.device)
        scales = scales.div_(L)     # NaN in a block gives NaN, Inf gives Inf
        # a finite block decodes finite: L·s_j at most float32's max (only max|v| near 3.4e38 is
        # affected); Inf and NaN scales stay as they are
        scales = torch.where(scales.isinf(), scales, scales.clamp(max=self._scale_max))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        if full:
            torch.div(v[:full].view(-1, d), safe[: full // d, None], out=c[: full // d])
        if full < n:
            torch.div(v[full:], safe[-1], out=work[full:n])
        # clamp: only a subnormal scale (rounded) can put |v/s| above L; NaN codes (non-finite
        # blocks, which decode to NaN through their scale) become 0 so that packing stays in range
        c.round_().clamp_(-L, L).nan_to_num_(nan=0.0)
        unsigned = work[:n].to(torch.int8).view(torch.uint8).add_(L)   # c + L in [0, 2L], a new tensor
        if self.bits == 8:
            codes = unsigned
        elif self.bits == 4:
            codes = _pack4(unsigned)
        else:
            codes = pack_bits(unsigned, self.bits)
        q = c.mul_(scales[:, None]).view(-1)[:n]
        return [scales, codes], q

    def _encode(self, tensor, name=None):
        if tensor.is_complex():
            raise TypeError(f"'{self.name}' quantizes real gradients, got a {tensor.dtype} tensor")
        if name is None:
            raise ValueError("lowbit keeps its error compensation per parameter and needs its name: use "
                             "hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        dtype = tensor.dtype
        state_dtype = torch.float32 if dtype in _HALF else dtype
        g = tensor.detach().reshape(-1).to(state_dtype)
        h = self.memory.get(name)
        if h is not None:
            if h.shape != tensor.shape:
                raise ValueError(f"lowbit holds a compensation of shape {tuple(h.shape)} for '{name}' but "
                                 f"got a gradient of shape {tuple(tensor.shape)}; parameter names must "
                                 "name the same tensor every step")
            h = h.to(device=g.device, dtype=state_dtype).reshape(-1)
            p = g + h                                            # new tensor: g and h stay as they are
        else:
            p = g                                                # may be the gradient's memory
        payload, q = self._quantize(cast_saturating(p, torch.float32).contiguous())
        r = p.sub_(q) if h is not None else p - q                # p_t − q_t, in h's dtype (p is ours)
        self.memory.keep(name, r.view(tensor.shape))             # h_t = β·h_{t−1} + (1 − β)·r
        return payload, (tensor.shape, dtype, g.numel())

    # ---- decoding ------------------------------------------------------------------------------
    def aggregate_into(self, out: torch.Tensor, payloads: Sequence, ctx) -> torch.Tensor:
        """Mean over ranks of ``s_j·(code_i − L)`` written into ``out`` (shape of the gradient,
        any floating dtype; saturated to it): per chunk of a few blocks, every rank's codes are
        added in float32 in rank order (each scale divided by W first), then the chunk is written
        to ``out`` once. Returns ``out``.

        Raises:
            ValueError: a payload whose scales or codes are too short for the context's n.
        """
        n = ctx[2]
        world = len(payloads)
        if world == 0 or n == 0:
            return out.zero_()
        d, L, bits = self.block, self.levels, self.bits
        nb = math.ceil(n / d)
        device = out.device
        factors = []
        for scales, codes in payloads:
            if scales.numel() != nb or codes.numel() < packed_nbytes(n, bits):
                raise ValueError(f"lowbit payload of {scales.numel()} scales and {codes.numel()} code bytes "
                                 f"does not hold {n} elements at bits={bits}, block={d}")
            factors.append(scales.to(device=device, dtype=torch.float32) / world)
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=device)
        flat = target.view(-1)
        span_max = min(self._chunk, nb * d)
        tmp = torch.empty(span_max + 1, dtype=torch.float32, device=device)  # +1: an odd 4-bit tail
        acc = torch.empty(span_max, dtype=torch.float32, device=device)
        for lo in range(0, n, self._chunk):
            hi = min(n, lo + self._chunk)
            m = hi - lo
            b0, b1 = lo // d, math.ceil(hi / d)
            span = (b1 - b0) * d
            t, a = tmp[:span], acc[:span]
            t2, a2 = t.view(b1 - b0, d), a.view(b1 - b0, d)
            byte_lo, byte_hi = lo * bits // 8, packed_nbytes(hi, bits)
            for w, (_, codes) in enumerate(payloads):
                self._codes_into(tmp, codes.reshape(-1)[byte_lo:byte_hi].to(device), m)
                t[:m].sub_(L)
                if span > m:
                    t[m:].zero_()                     # the last block's padding
                f = factors[w][b0:b1, None]
                if w == 0:
                    torch.mul(t2, f, out=a2)
                else:
                    a2.addcmul_(t2, f)
            if world > 1:  # W terms of |·| ≤ L·s/W may still round past float32's max
                a[:m].clamp_(-FP32_MAX, FP32_MAX)
            copy_saturating_(flat[lo:hi], a[:m])
        if target is not out:
            out.copy_(target)
        return out

    def _codes_into(self, t: torch.Tensor, packed: torch.Tensor, m: int) -> None:
        """The first ``m`` unsigned codes of ``packed`` as float32 into ``t[:m]`` (4 bits: both
        nibbles written straight into ``t``, which must hold ``m + 1`` elements for odd m)."""
        if self.bits == 4:
            nbytes = packed_nbytes(m, 4)
            pairs = t[: 2 * nbytes].view(nbytes, 2)
            pairs[:, 0].copy_(packed[:nbytes] & 15)   # code 2k: low nibble (little-endian)
            pairs[:, 1].copy_(packed[:nbytes] >> 4)   # code 2k+1: high nibble
        else:
            t[:m].copy_(unpack_codes(packed, self.bits, m))

    # ---- state ---------------------------------------------------------------------------------
    def rescale_state(self, factor: float) -> None:
        """Multiply every committed h by ``factor`` (gradient units, e.g. an AMP loss-scale
        change ``S_new / S_old``); call between steps."""
        self.memory.rescale(factor)

    def state_dict(self) -> Dict[str, Any]:
        """``{"residuals": {name: h}}`` (copies of the committed h)."""
        return {"residuals": self.memory.state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (tensors are copied).

        Raises:
            ValueError: keys other than ``"residuals"``, or a residual that is not a floating
                tensor.
        """
        self._check_state_keys(state, "residuals")
        residuals = state.get("residuals", {})
        if not isinstance(residuals, dict):
            raise ValueError(f"lowbit state 'residuals' must be a dict {{name: tensor}}, got {type(residuals).__name__}")
        for k, v in residuals.items():
            if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
                raise ValueError(f"lowbit residual '{k}' must be a floating-point tensor, got {type(v).__name__}"
                                 + (f" of {v.dtype}" if isinstance(v, torch.Tensor) else ""))
        self.memory.load(residuals)


class LowBitQuantizer(LowBitCompressor):
    """Q alone, stateless: :class:`LowBitCompressor` without the error compensation (not
    registered). ``hvdcomp.ErrorFeedback(LowBitQuantizer(bits, block))`` is ``lowbit`` with
    β = 0; also for measuring the quantizer by itself.

    Args:
        bits, block: as :class:`LowBitCompressor`.

    Payload: as :class:`LowBitCompressor`.

    Raises:
        ValueError: ``bits`` or ``block`` out of range.
    """

    builtin_error_feedback = False
    has_scaled_state = False

    def __init__(self, bits: int = 4, block: int = 512):
        super().__init__(bits=bits, block=block, beta=0.0)

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "bits": self.bits, "block": self.block, "compensation": False}

    def _encode(self, tensor, name=None):
        if tensor.is_complex():
            raise TypeError(f"'{self.name}' quantizes real gradients, got a {tensor.dtype} tensor")
        v = cast_saturating(tensor.detach().reshape(-1), torch.float32).contiguous()
        payload, _ = self._quantize(v)
        return payload, (tensor.shape, tensor.dtype, v.numel())

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"LowBitQuantizer is stateless but got state with keys {sorted(state)}")
