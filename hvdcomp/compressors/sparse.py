"""Shared wire format of the sparsifiers: ``[values (m,), indices (m,)]``, with optional coding.

Default: values float32 and indices int32 (int64 when n ≥ 2^31), 8 bytes per kept element. Spec
keys accepted by every sparsifier: ``values`` = ``fp32`` | ``fp16`` (±inf beyond float16's range,
±65504 where a residual keeps the excess) | ``int2`` (2-bit levels (−1, −1/3, 1/3, 1)·s, one float32
scale s per gradient; SparseLoCo, Sarfi et al. 2025) | ``stat2`` (SparseLoCo's released 4-bin
statistical coding, 20 header bytes per gradient); ``index`` = ``int`` | ``compact`` (the fewest
whole bytes holding n − 1); ``average`` = ``ranks`` (sum over ranks / number of ranks) |
``senders`` (each index / the number of ranks that sent it). A fp32 or fp16 payload larger than
the dense tensor is written densely, ``[values (n,), indices (0,)]`` (same decode), except with
``average=senders``. Each coding in full: docs/methods.md, "Sparse wire coding".
"""
from __future__ import annotations

import abc
import math
from typing import Optional

import torch

from .. import native
from ..checks import check_choice
from . import bitpack
from .base import AggregateInto, Compressor, ErrorBound, PayloadKind
from .segments import Segments, SegmentsContext

__all__ = ["SparseCompressor", "index_dtype", "compact_index_bytes", "int2_encode", "int2_decode", "stat2_encode",
           "stat2_decode", "segments_of"]

_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_VALUE_CODINGS = ("fp32", "fp16", "int2", "stat2")
_INDEX_CODINGS = ("int", "compact")
_AVERAGES = ("ranks", "senders")
_WIRE_DEFAULTS = {"values": "fp32", "index": "int", "average": "ranks"}
FP16_MAX = 65504.0
INT2_HEADER = 4  # bytes of the float32 scale in front of an int2 payload's codes
#: why a sparsifier with int2 values has no error bound (:attr:`SparseCompressor.error_bound`)
INT2_ERROR = ("values=int2 rounds every kept entry to ±s/3 or ±s (s: the largest kept magnitude), so small kept "
              "entries grow to s/3: on v = (1, ε, ..., ε) ‖C(v) − v‖² ≈ (k − 1)/9·‖v‖² (11 at k = 100), no "
              "contraction. It is meant for error feedback, which keeps what the levels drop; use values=fp32 "
              "(default) or values=fp16")
#: why a sparsifier with stat2 values has no stated error bound (:attr:`SparseCompressor.error_bound`)
STAT2_ERROR = ("values=stat2 decodes every kept entry as the mean of its bin (4 bins of 1.5 σ around the mean of the "
               "kept values): no contraction bound is known for it. It is SparseLoCo's coding, meant for error "
               "feedback; use values=fp32 (default) or values=fp16")
STAT2_BINS, STAT2_RANGE = 4, 6.0  # stat2: 4 bins over 6 standard deviations (each 1.5 σ wide)
STAT2_HEADER = 4 * (1 + STAT2_BINS)  # bytes per gradient in front of a stat2 payload's codes: μ, the bin means


def segments_of(ctx) -> Optional[Segments]:
    """The :class:`~hvdcomp.compressors.segments.Segments` of a segmented context, else None."""
    return ctx.segments if isinstance(ctx, SegmentsContext) else None


def int2_encode(values: torch.Tensor, groups: Optional[torch.Tensor] = None, count: int = 1) -> torch.Tensor:
    """2-bit coding of ``values`` (m,) float32 (docs/methods.md): a uint8 tensor of
    ``4·count + ⌈m/4⌉`` bytes, the float32 scales then the codes. ``groups``: int64 (m,), the
    group (gradient) 0..count−1 of each value, each group with its own scale s = max |v| over its
    values (0 for a group without values); None: one group. Same device as ``values``."""
    v = values.reshape(-1).to(torch.float32)
    mags = v.abs()
    if groups is None:
        scale = mags.max().reshape(1) if v.numel() else mags.new_zeros(1)
        each = scale
    else:  # (NaN propagates into its group's scale)
        scale = mags.new_zeros(count).scatter_reduce_(0, groups, mags, "amax")
        each = scale.index_select(0, groups)
    q = torch.nan_to_num(v / each, nan=0.0, posinf=1.0, neginf=-1.0)
    q = torch.where(torch.isinf(v), torch.sign(v), q)  # ±inf: the outer level of its sign (loud: s = inf)
    codes = ((q + 1.0) * 1.5).round_().clamp_(0, 3).to(torch.uint8)  # nearest of (-1, -1/3, 1/3, 1)
    return torch.cat([scale.view(torch.uint8), bitpack.pack_bits(codes, 2)])


def _split_coded(data: torch.Tensor, count: int, header: int, what: str):
    """The float32 header (``header`` bytes) and the ``count`` 2-bit codes of an int2 or stat2
    payload; raises ``ValueError`` naming ``what`` unless ``data`` is uint8 of the right size."""
    if data.dtype != torch.uint8 or data.numel() != header + (count + 3) // 4:
        raise ValueError(f"{what} has {header + (count + 3) // 4} uint8 bytes, got {data.numel()} of {data.dtype}")
    return data[:header].clone().view(torch.float32), bitpack.unpack_codes(data[header:], 2, count)


def int2_decode(data: torch.Tensor, count: int, groups: Optional[torch.Tensor] = None,
                ngroups: int = 1) -> torch.Tensor:
    """Inverse of :func:`int2_encode`: ``count`` float32 values, ±1 or ±float32(1/3) times the
    value's scale (one rounding). ``groups`` / ``ngroups``: as the encoder's ``groups`` / ``count``.

    Raises:
        ValueError: ``data`` is not a uint8 tensor of ``4·ngroups + ⌈count/4⌉`` bytes.
    """
    scale, codes = _split_coded(data, count, INT2_HEADER * ngroups,
                                f"an int2 payload of {count} values and {ngroups} scale(s)")
    # levels from Python scalars (no host-to-device copy): sign ±1 times 1 (codes 0, 3) or 1/3
    level = torch.where(codes >= 2, 1.0, -1.0) * torch.where((codes == 0) | (codes == 3), 1.0, 1.0 / 3.0)
    return level * (scale if groups is None else scale.index_select(0, groups))


def _stat2_group(v: torch.Tensor):
    """One gradient's stat2 coding (docs/methods.md): (header float32 (5,), codes uint8 (m,))."""
    if v.numel() == 0:
        return v.new_zeros(1 + STAT2_BINS), torch.zeros(0, dtype=torch.uint8, device=v.device)
    shift = v.mean()
    centred = v - shift
    std = centred.norm() / math.sqrt(centred.numel() - 1) if centred.numel() > 1 else centred.new_zeros(())
    width = STAT2_RANGE * std / STAT2_BINS
    width = torch.where((width == 0) | ~width.isfinite(), torch.ones_like(width), width)
    q = (centred / width + STAT2_BINS // 2).round().clamp(0, STAT2_BINS - 1)
    codes = torch.nan_to_num(q, nan=0.0).to(torch.uint8)
    at = codes.long()
    sums = centred.new_zeros(STAT2_BINS).scatter_add_(0, at, centred)
    counts = centred.new_zeros(STAT2_BINS).scatter_add_(0, at, torch.ones_like(centred))
    means = torch.where(counts > 0, sums / counts, torch.zeros_like(sums))
    return torch.cat([shift.reshape(1), means]), codes


def stat2_encode(values: torch.Tensor, groups: Optional[torch.Tensor] = None, count: int = 1) -> torch.Tensor:
    """stat2 coding of ``values`` (m,) (docs/methods.md): a uint8 tensor of
    ``20·count + ⌈m/4⌉`` bytes, the groups' headers (float32 μ and 4 bin means) then the codes.
    ``groups``: int64 (m,), non-decreasing, the group (gradient) 0..count−1 of each value (the
    values of a group are contiguous: a segmented payload's indices ascend); None: one group.
    Each group is coded by the same operations as alone, so a fused payload decodes bitwise as
    the per-gradient ones."""
    v = values.reshape(-1).to(torch.float32)
    parts = [v] if groups is None else v.split(torch.bincount(groups, minlength=count).tolist())
    coded = [_stat2_group(part) for part in parts]
    headers = torch.cat([h for h, _ in coded]) if coded else v.new_zeros(0)
    codes = torch.cat([c for _, c in coded]) if coded else torch.zeros(0, dtype=torch.uint8, device=v.device)
    return torch.cat([headers.view(torch.uint8), bitpack.pack_bits(codes, 2)])


def stat2_decode(data: torch.Tensor, count: int, groups: Optional[torch.Tensor] = None,
                 ngroups: int = 1) -> torch.Tensor:
    """Inverse of :func:`stat2_encode`: ``count`` float32 values, each its bin's mean plus its
    group's μ. ``groups`` / ``ngroups``: as the encoder's ``groups`` / ``count``.

    Raises:
        ValueError: ``data`` is not a uint8 tensor of ``20·ngroups + ⌈count/4⌉`` bytes.
    """
    table, codes = _split_coded(data, count, STAT2_HEADER * ngroups,
                                f"a stat2 payload of {count} values and {ngroups} group(s)")
    table, codes = table.view(ngroups, 1 + STAT2_BINS), codes.long()
    if groups is None:
        return table[0, 1:][codes] + table[0, 0]
    return table[groups, 1 + codes] + table[groups, 0]


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices when they fit (n < 2^31), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def compact_index_bytes(numel: int) -> int:
    """Fewest whole bytes holding every index 0..numel-1 (1 to 8)."""
    return max(1, math.ceil(max(1, (numel - 1).bit_length()) / 8))


class SparseCompressor(AggregateInto, Compressor):
    """Base of methods whose payload is ``[values (m,), indices (m,)]`` (see module docstring).

    Subclasses implement :meth:`select` (which indices to send); methods that build their own
    values (DGC) call :meth:`pack`. Decoding scatter-adds values into zeros; :meth:`aggregate`
    scatter-adds every rank's payload at once (an index sent by several ranks adds up), then
    divides by the world size (``average="senders"``: each index by the number of ranks that
    sent it).
    """

    payload_kind = PayloadKind.GATHERED
    value_coding = "fp32"
    index_coding = "int"
    average = "ranks"

    @property
    def aggregate_is_mean(self) -> bool:
        """The aggregate is the mean of the ranks' decodes, except with ``average="senders"``."""
        return self.average == "ranks"

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, name) -> torch.Tensor:
        """Indices (int64, 1-D) of ``flat`` (1-D, n elements) to send."""

    # ---- what one call guarantees ----------------------------------------------------------------
    @property
    def error_bound(self) -> ErrorBound:
        """The method's bound with exact values (:meth:`_exact_values_bound`), adjusted for the
        value coding: fp16 values round each kept value (relative error ≤ 2⁻¹¹ in float16's
        normal range), so δ shrinks by the factor 1 − 2⁻²²; int2 values are no contraction at all
        (:data:`INT2_ERROR`)."""
        if self.value_coding in ("int2", "stat2"):
            return ErrorBound("none", INT2_ERROR if self.value_coding == "int2" else STAT2_ERROR)
        bound = self._exact_values_bound()
        if self.value_coding == "fp32" or bound.kind != "contraction":
            return bound
        delta = bound.delta
        return ErrorBound("contraction", bound.statement + ", times 1 − 2⁻²² for the fp16 values (|v| < 65520)",
                          delta=lambda n: delta(n) * (1.0 - 2.0**-22))

    def _exact_values_bound(self) -> ErrorBound:
        """:attr:`error_bound` with float32 values; methods that have one override this."""
        return Compressor.error_bound.fget(self)

    # ---- wire coding ---------------------------------------------------------------------------
    def set_wire(self, values: str = "fp32", index: str = "int", average: str = "ranks") -> "SparseCompressor":
        """Choose the wire coding, ``values`` in {fp32, fp16, int2, stat2} and ``index`` in {int,
        compact}, and how the ranks' payloads combine, ``average`` in {ranks, senders} (see the
        module docstring).

        Raises:
            ValueError: an unknown choice (the message lists the valid ones).
        """
        check_choice(values, "values", _VALUE_CODINGS)
        check_choice(index, "index", _INDEX_CODINGS)
        check_choice(average, "average", _AVERAGES, " (divide each index by the number of ranks, or of ranks "
                                                    "that sent it)")
        self.value_coding, self.index_coding, self.average = values, index, average
        return self

    def wire_options(self) -> dict:
        """The non-default wire options, for :meth:`describe` (empty with the defaults)."""
        chosen = {"values": self.value_coding, "index": self.index_coding, "average": self.average}
        return {k: v for k, v in chosen.items() if v != _WIRE_DEFAULTS[k]}

    def _value_bytes(self) -> int:
        return torch.empty((), dtype=_VALUE_DTYPES[self.value_coding]).element_size()

    def _index_bytes(self, numel: int) -> int:
        if self.index_coding == "compact":
            return compact_index_bytes(numel)
        return torch.empty((), dtype=index_dtype(numel)).element_size()

    def payload_bytes(self, numel: int, kept: int) -> int:
        """Bytes of one payload that keeps ``kept`` of ``numel`` elements (dense fallback included;
        int2: ``kept`` non-zero values, one scale; stat2: one gradient's header)."""
        if self.value_coding in ("int2", "stat2"):
            header = INT2_HEADER if self.value_coding == "int2" else STAT2_HEADER
            return header + (kept + 3) // 4 + kept * self._index_bytes(numel)
        vb = self._value_bytes()
        sparse = kept * (vb + self._index_bytes(numel))
        return sparse if self.average == "senders" else min(sparse, numel * vb)

    def expected_payload_bytes(self, numel):
        """Bytes of one payload of a tensor of ``numel`` elements with this wire coding (kept
        count from :meth:`nominal_ratio`), or ``None`` when that depends on the data."""
        ratio = self.nominal_ratio(numel)
        if ratio is None or numel == 0:
            return None
        kept = max(1, round(numel / (2.0 * ratio)))  # nominal ratio = n / (2k) (32-bit value + index)
        return self.payload_bytes(numel, kept)

    def pack(self, values: torch.Tensor, idx: torch.Tensor, numel: int, overflow: str = "saturate",
             segments: Optional[Segments] = None) -> list:
        """Encode kept ``values`` (m,) at ``idx`` (m,) int64 of an n-element tensor into a payload
        (``segments``: the tensor holds several gradients; int2 values get one scale each).

        ``overflow``: what float16 values do with |v| ≥ 65520: ``"saturate"`` (±65504: for a
        caller that keeps the excess, as DGC's velocity does) or ``"inf"`` (±inf, float16's own
        cast: what the methods' ``encode`` sends; :meth:`residual_` saturates it under error
        feedback). float32, int2 and stat2 values are unaffected; int2 drops the entries whose
        value is exactly 0 (no level holds it: they would decode as ±s/3)."""
        m, ib = idx.numel(), self._index_bytes(numel)
        if self.value_coding in ("int2", "stat2"):
            if self.value_coding == "int2":
                sent = values != 0  # (NaN is sent: it makes its gradient's scale NaN, loud)
                values, idx = values[sent], idx[sent]
            groups = None if segments is None else segments.segment_of(idx)
            encode = int2_encode if self.value_coding == "int2" else stat2_encode
            vals = encode(values, groups, 1 if segments is None else len(segments))
        else:
            vdt = _VALUE_DTYPES[self.value_coding]
            if vdt == torch.float16 and overflow == "saturate":
                values = values.clamp(-FP16_MAX, FP16_MAX)
            vb = self._value_bytes()
            if numel and m * (vb + ib) > numel * vb and self.average == "ranks":  # dense is smaller: the
                # same vector densely (not with average=senders: the receivers count each sender's indices)
                dense = torch.zeros(numel, dtype=vdt, device=values.device)
                dense[idx] = values.to(vdt)
                return [dense, torch.zeros(0, dtype=index_dtype(numel), device=values.device)]
            vals = values.to(vdt)
        if self.index_coding == "compact":
            return [vals, idx.to(torch.int64).reshape(-1, 1).view(torch.uint8)[:, :ib].reshape(-1)]
        return [vals, idx.to(index_dtype(numel))]

    @staticmethod
    def saturate_values_(payload) -> None:
        """Clamp a payload's float16 values to ±65504 in place (inf from a value float16 cannot
        hold becomes the largest finite one; NaN stays). For the callers that keep the excess in
        a residual (:meth:`residual_`, DGC); no-op for float32 values."""
        if payload[0].dtype == torch.float16:
            payload[0].clamp_(-FP16_MAX, FP16_MAX)

    def unpack(self, payload, numel: int, segments: Optional[Segments] = None):
        """Inverse of :meth:`pack` (with the same ``segments``): ``(values float32 (m,), indices
        int64 (m,))``, or ``(values float32 (n,), None)`` for a densely written payload."""
        values, code = payload
        if code.dtype == torch.uint8:  # compact: b little-endian bytes per index
            ib = compact_index_bytes(numel)
            wide = torch.zeros(code.numel() // ib, 8, dtype=torch.uint8, device=code.device)
            wide[:, :ib] = code.reshape(-1, ib)
            idx = wide.view(torch.int64).reshape(-1)
        else:
            idx = code.long()
        if values.dtype == torch.uint8:  # int2 or stat2: as many values as indices
            decode = stat2_decode if self.value_coding == "stat2" else int2_decode
            if segments is None:
                return decode(values, idx.numel()), idx
            return decode(values, idx.numel(), segments.segment_of(idx), len(segments)), idx
        values = values.to(torch.float32)
        if code.numel() == 0 and values.numel() == numel and numel > 0:
            return values, None
        return values, idx

    # ---- Compressor API ------------------------------------------------------------------------
    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1)
        idx = self.select(flat, name)
        values = flat.index_select(0, idx).to(torch.float32)
        return self.pack(values, idx, flat.numel(), overflow="inf"), (tensor.shape, tensor.dtype)

    def aggregate_into(self, out, payloads, ctx):
        """Scatter-add every rank's payload, scaled by 1/(number of payloads), into ``out``
        (zeroed first): one write pass over ``out`` plus work proportional to the kept entries.
        With ``average="senders"``: the sum at each index divided by the number of payloads that
        sent it (0 where none did), by ``index_add_`` in payload order.
        In place when ``out`` is contiguous float32; the native CPU kernel (ascending indices) and
        the ``index_add_`` path add in the same order and rounding (docs/kernels.md).
        """
        if out.dtype != torch.float32 or not out.is_contiguous():
            return super().aggregate_into(out, payloads, ctx)
        flat = out.view(-1)
        n = flat.numel()
        scale = 1.0 / max(1, len(payloads))
        unpacked = [self.unpack(p, n, segments_of(ctx)) for p in payloads]
        if self.average == "senders":  # each index: the sum of what was sent / the number of senders
            flat.zero_()
            senders = torch.zeros_like(flat)
            for values, idx in unpacked:  # (never dense with average=senders)
                flat.index_add_(0, idx, values)
                senders.index_add_(0, idx, torch.ones_like(values))
            flat.div_(senders.clamp_(min=1.0))
            return out
        if native.usable(flat, *[t for p in payloads for t in p]) and native.sparse_aggregate(
                flat, [i if i is None else i.contiguous() for _, i in unpacked],
                [v.contiguous() for v, _ in unpacked], scale):
            return out
        flat.zero_()
        for values, idx in unpacked:  # payload order, out += scale·value, as the native kernel
            if idx is None:
                flat.add_(values * scale)
            else:
                flat.index_add_(0, idx, values, alpha=scale)
        return out

    def residual_(self, p, payload, ctx):
        """``p - decode(payload)`` in ``p``'s memory (contiguous float32 ``p``): the sent values
        are subtracted at their indices. Payload values are always new tensors, never views of ``p``.

        Error feedback calls it on the payload before it travels: float16 values beyond float16's
        range are first saturated to ±65504 in the payload (:meth:`saturate_values_`), so the
        excess stays in the residual instead of travelling as ±inf."""
        self.saturate_values_(payload)
        if p.dtype != torch.float32 or not p.is_contiguous():
            return super().residual_(p, payload, ctx)
        flat = p.view(-1)
        values, idx = self.unpack(payload, flat.numel(), segments_of(ctx))
        if idx is None:
            flat.sub_(values)
        else:
            flat.index_add_(0, idx, values, alpha=-1)
        return p
