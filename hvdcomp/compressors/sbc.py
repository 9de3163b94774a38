"""``sbc``: Sparse Binary Compression.

Sattler, Wiedemann, Müller and Samek, "Sparse Binary Compression: Towards Distributed Deep
Learning with minimal Communication", IJCNN 2019.

In float32, of the k = max(1, ceil(ρ·n)) largest positive and the k most negative entries, the
side with the larger mean μ (float64 sum, float32 mean; ties: positive) is sent as one ±μ and its
positions; decoding puts ±μ there and 0 elsewhere. Positions travel Golomb–Rice coded as two
streams (unary quotients, b-bit remainders; b by Kiely's rule from n and the sent count):
``[mu (1,) float32, unary uint8, remainders uint8]``, data-dependent bytes (about 8.1 bits per
position at ρ = 1 %). The paper's temporal sparsity is gradient accumulation
(``backward_passes_per_step``); its residual is error feedback, on by default. The rule, the
coding and its sizes in full: docs/methods.md, "SBC".
"""
from __future__ import annotations

import math

import torch

from .base import ErrorBound, cast_saturating
from .bitpack import pack_bits, packed_nbytes, unpack_bits, unpack_codes
from .registry import register
from .selection import exact_topk, indices_at_least
from .sparse import SparseCompressor
from .topk import check_density, num_kept

__all__ = ["SBCCompressor", "decode_positions", "encode_positions", "expected_bits_per_position",
           "rice_decode", "rice_encode", "rice_parameter"]

#: ln(φ − 1), φ the golden ratio: the numerator of Kiely's rule.
_LN_PHI_MINUS_1 = math.log((math.sqrt(5.0) - 1.0) / 2.0)
#: Above this density Kiely's rule gives b = 0 (2 − φ ≈ 0.382).
_B0_DENSITY = (3.0 - math.sqrt(5.0)) / 2.0


def rice_parameter(numel: int, kept: int) -> int:
    """Rice parameter b for ``kept`` positions among ``numel``: Kiely's rule for geometric gaps,
    b = max(0, 1 + floor(log2(ln(φ − 1) / ln(1 − p)))) with p = kept/numel (see
    docs/methods.md; p = 0.01 → b = 6). 0 when nothing is kept or p > 2 − φ (p = 1 included)."""
    if kept <= 0 or numel <= 0:
        return 0
    p = kept / numel
    if p >= 1.0 or p > _B0_DENSITY:
        return 0
    return max(0, 1 + math.floor(math.log2(_LN_PHI_MINUS_1 / math.log1p(-p))))


def expected_bits_per_position(numel: int, kept: int) -> float:
    """Expected code bits per position for ``kept`` positions spread uniformly among ``numel``
    (gaps geometric with p = kept/numel): b + 1 + θ/(1 − θ), θ = (1 − p)^(2^b)."""
    if kept <= 0 or numel <= 0:
        return 0.0
    b = rice_parameter(numel, kept)
    p = min(1.0, kept / numel)
    theta = 0.0 if p >= 1.0 else math.exp(math.log1p(-p) * 2.0**b)
    return b + 1.0 + theta / (1.0 - theta)


def _unpack_remainders(packed: torch.Tensor, b: int, m: int) -> torch.Tensor:
    """The ``m`` remainders of ``b`` bits each (:func:`~hvdcomp.compressors.bitpack.pack_bits`'
    layout) as int64 (m,)."""
    if b == 0 or m == 0:
        return torch.zeros(m, dtype=torch.int64, device=packed.device)
    if packed.numel() < packed_nbytes(m, b):
        raise ValueError(f"sbc payload: {packed.numel()} remainder bytes cannot hold {m} codes of {b} bits")
    return unpack_bits(packed, b, m)


def rice_encode(idx: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two Golomb–Rice streams of ascending positions ``idx`` with Rice parameter ``b``.

    Args:
        idx: 1-D integer tensor, strictly ascending, non-negative.
        b: remainder bits, 0 ≤ b ≤ 62.

    Returns:
        ``(unary, remainders)``, uint8 tensors of ceil(Σ(q_i + 1)/8) and ceil(m·b/8) bytes (see
        docs/methods.md, "SBC", for the layout).
    """
    idx = idx.reshape(-1).to(torch.int64)
    device = idx.device
    m = idx.numel()
    if m == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=device)
        return empty, empty.clone()
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    q = gaps >> b
    zeros_at = torch.cumsum(q + 1, 0) - 1                  # bit position of each terminating zero
    nbytes = (int(zeros_at[-1]) + 1 + 7) // 8
    # all ones, then each terminating zero cleared: distinct bits of a byte, so a sum is an OR
    cleared = torch.zeros(nbytes, dtype=torch.int64, device=device)
    cleared.index_add_(0, zeros_at >> 3, 1 << (zeros_at & 7))
    unary = (255 - cleared).to(torch.uint8)
    rem = pack_bits(gaps & ((1 << b) - 1), b) if b else torch.zeros(0, dtype=torch.uint8, device=device)
    return unary, rem


def rice_decode(unary: torch.Tensor, remainders: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`rice_encode` for a known ``b``: ascending int64 positions (m,), m the
    number of zero bits in ``unary``.

    Raises:
        ValueError: fewer remainder bytes than m codes of b bits need.
    """
    return _rice_decode(unary, remainders, lambda m: b)


def _rice_decode(unary, remainders, b_of_m):
    """Ascending int64 positions from the two streams, with b = ``b_of_m(m)``: the quotients q_i
    are the runs of one-bits before each of the m zero-bits of ``unary``."""
    u = unary.reshape(-1)
    zeros_at = torch.nonzero(unpack_codes(u, 1, 8 * u.numel()) == 0).reshape(-1)
    q = torch.diff(zeros_at, prepend=zeros_at.new_full((1,), -1)) - 1
    b = b_of_m(q.numel())
    r = _unpack_remainders(remainders.reshape(-1), b, q.numel())
    return torch.cumsum(((q << b) | r) + 1, 0) - 1


def encode_positions(idx: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rice_encode` with b = :func:`rice_parameter` (numel, m), m = ``idx.numel()``."""
    return rice_encode(idx, rice_parameter(numel, idx.numel()))


def decode_positions(unary: torch.Tensor, remainders: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`encode_positions`: m from the unary stream, then b = rice_parameter(numel, m).

    Raises:
        ValueError: a corrupt payload (too few remainder bytes, or a position ≥ ``numel``).
    """
    positions = _rice_decode(unary, remainders, lambda m: rice_parameter(numel, m))
    if positions.numel() and int(positions[-1]) >= numel:
        raise ValueError(f"sbc payload codes position {int(positions[-1])} of a tensor of {numel} "
                         "elements: it was encoded for another tensor, or corrupted")
    return positions


def _zero_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN replaced by 0 in place (infinities kept); returns ``t``."""
    inf = float("inf")
    return t.nan_to_num_(nan=0.0, posinf=inf, neginf=-inf)


def _side_top(side: torch.Tensor, k: int):
    """``(indices, values)`` of the (up to) k largest entries of ``side`` (≥ 0, float32) that are
    > 0, indices ascending; which of several entries tied at the k-th value are picked is left
    to the selection (:func:`_lowest_index_ties` settles it for the side sent)."""
    idx = exact_topk(side, k)
    vals = side.index_select(0, idx)
    keep = vals > 0
    return idx[keep], vals[keep]


def _lowest_index_ties(x: torch.Tensor, idx: torch.Tensor, k: int, sign: int) -> torch.Tensor:
    """``idx`` (from :func:`_side_top` on the side of ``sign`` of ``x``) with the entries tied at
    the k-th value replaced by the lowest-index ones: every entry of that side above t (the
    smallest kept magnitude) plus the first entries equal to t. One fused scan of ``x`` for the
    entries of magnitude ≥ t (:func:`~hvdcomp.compressors.selection.indices_at_least`); nothing
    to do when fewer than k entries are kept (then every entry of the side is in ``idx``)."""
    if idx.numel() < k or k == 0:
        return idx
    t = (x.index_select(0, idx) * sign).min()
    # positive side: x >= t (NaN never passes); negative side: |x| >= t, then the negative ones
    cand = indices_at_least(x, t, magnitudes=sign > 0)     # ascending, about k (2k) of them
    vals = x.index_select(0, cand) * sign
    above = vals > t
    tied = vals == t
    need = k - int(above.sum())
    keep = above | (tied & (torch.cumsum(tied, 0) <= need))
    return cand[keep]


def _side_mean(vals: torch.Tensor, k: int) -> torch.Tensor:
    """Mean of the kept magnitudes ``vals`` (from :func:`_side_top`) as a float32 0-d tensor (0
    when empty), summed in float64 and rounded to float32. When k entries are kept, the sum is
    that of the entries above the smallest kept value t (the same set whichever tied entries were
    picked, in ascending index order) plus t times the rest, so it does not depend on the
    tie-breaking."""
    if vals.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=vals.device)
    vals = vals.to(torch.float64)
    if vals.numel() == k:
        t = vals.min()
        above = vals > t
        total = vals[above].sum() + (k - above.sum()) * t
    else:
        total = vals.sum()
    return (total / vals.numel()).to(torch.float32)


@register("sbc")
class SBCCompressor(SparseCompressor):
    """Sparse Binary Compression: one sign, one mean, Golomb–Rice-coded positions.

    Keeps the k = max(1, ceil(ρ·n)) largest positive entries and the k most negative ones, and
    sends the side with the larger mean magnitude as that mean (one float32) at its positions
    (coded by gaps, Golomb–Rice with Kiely's parameter). The exact rule, the coding and the byte
    counts are in docs/methods.md, "SBC".

    Args:
        density: ρ in (0, 1]; 0.01 keeps at most 1 % of the entries (of one sign).

    Payload: ``[mu (1,) float32, unary (ceil(U/8),) uint8, remainders (ceil(m·b/8),) uint8]``
    (m ≤ k sent positions, U = Σ(q_i + 1) unary bits, b the Rice parameter from n and m):
    4 + ceil(U/8) + ceil(m·b/8) bytes, depending on the positions (:meth:`payload_bytes`: the
    expected size; no dense fallback, even the worst case is below 4n bytes for n ≥ 2).
    :meth:`unpack` gives ``(mu repeated (m,) float32, indices (m,) int64 ascending)``, decoded,
    aggregated and kept as residual as :class:`~hvdcomp.compressors.sparse.SparseCompressor`'s.

    Raises:
        ValueError: ``density`` not a number in (0, 1]; the sparse wire options ``values=fp16``
            or ``index=compact`` (SBC codes its own positions and sends one float32 value).
    """

    name = "sbc"
    default_error_feedback = True

    def __init__(self, density: float = 0.01):
        self.density = check_density(density)

    def describe(self):
        return {"name": self.name, "density": self.density}

    # ---- wire coding: its own ------------------------------------------------------------------
    def set_wire(self, values: str = "fp32", index: str = "int") -> SBCCompressor:
        """Only the defaults (``values=fp32``, ``index=int``) are accepted.

        Raises:
            ValueError: any other choice: SBC codes its own positions (Golomb–Rice) and sends a
                single float32 value, so the sparse wire options do not apply.
        """
        if values != "fp32" or index != "int":
            raise ValueError(f"SBC codes its own positions (Golomb-Rice gaps) and sends one float32 "
                             f"mean: drop values={values!r} / index={index!r} from the spec "
                             "(e.g. 'sbc:density=0.01')")
        return self

    def wire_options(self) -> dict:
        """Always empty: SBC has no wire options."""
        return {}

    def pack(self, values, idx, numel):
        """The sbc payload sending ``values`` (``(m,)`` or ``(1,)`` float) at the ascending int64
        positions ``idx`` (m,) of an n-element tensor, binarized as SBC does: one float32 value,
        the mean of ``values`` (summed in float64), at every position. Returns
        ``[mu (1,) float32, unary uint8, remainders uint8]`` (docs/methods.md).
        """
        if values.numel() == 0:
            mu = torch.zeros(1, dtype=torch.float32, device=idx.device)
        else:
            mu = values.reshape(-1).to(torch.float64).mean().reshape(1).to(torch.float32)
        unary, rem = encode_positions(idx, numel)
        return [mu, unary, rem]

    # ---- bytes -----------------------------------------------------------------------------------
    def _exact_values_bound(self):
        """Sends the mean μ of the c ≤ k kept entries of one sign at their positions:
        ‖C(v) − v‖² = ‖v‖² − cμ², and the side sent has the larger mean, at least max|v|/k, so
        δ ≥ 1/(n·k²)."""
        density = self.density
        return ErrorBound("contraction", "replaces the kept entries of one sign by their mean: ‖C(v) − v‖² = ‖v‖² − cμ², "
                                         "δ ≥ 1/(n·k²)", delta=lambda n: 1.0 / (max(1, n) * num_kept(max(1, n), density) ** 2))

    def nominal_ratio(self, numel):
        """n/(k + 1): k 32-bit indices and one 32-bit value against n 32-bit values (the seed
        study's convention; the coded positions are much smaller, see :meth:`payload_bytes`)."""
        return numel / (num_kept(numel, self.density) + 1)

    def payload_bytes(self, numel: int, kept: int) -> int:
        """Expected bytes of a payload sending ``kept`` positions spread uniformly among ``numel``:
        4 + ceil(kept·(1 + θ/(1 − θ))/8) + ceil(kept·b/8) (docs/methods.md); the actual size
        depends on the positions (at most 4 + ceil((kept + ⌊(numel − kept)/2^b⌋)/8) + ceil(kept·b/8))."""
        if kept <= 0 or numel <= 0:
            return 4
        b = rice_parameter(numel, kept)
        unary_bits = kept * (expected_bits_per_position(numel, kept) - b)
        return 4 + math.ceil(unary_bits / 8) + packed_nbytes(kept, b)

    def expected_payload_bytes(self, numel):
        """:meth:`payload_bytes` with kept = k (``None`` for an empty tensor)."""
        if numel == 0:
            return None
        return self.payload_bytes(numel, num_kept(numel, self.density))

    # ---- the method ----------------------------------------------------------------------------
    def _choose(self, flat: torch.Tensor):
        """(ascending int64 positions, float32 0-d signed mean) of the side sent."""
        x = cast_saturating(flat.reshape(-1), torch.float32)  # float64 beyond 3.4e38: ±float32 max
        n = x.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=x.device), torch.zeros((), device=x.device)
        k = num_kept(n, self.density)
        # each side's magnitudes, 0 elsewhere, in one buffer used twice; NaN goes to neither side
        # (replaced by 0 when present: a finite sum of x rules it out in one cheap reduction)
        clean = bool(torch.isfinite(x.sum()))
        side = x.clamp(min=0) if clean else _zero_nan(x.clamp(min=0))
        pos_idx, pos_vals = _side_top(side, k)
        mu_pos = _side_mean(pos_vals, k)
        torch.neg(x, out=side).clamp_(min=0)
        if not clean:
            _zero_nan(side)
        neg_idx, neg_vals = _side_top(side, k)
        mu_neg = _side_mean(neg_vals, k)
        if bool(mu_pos >= mu_neg):                         # tie (all-zero too): positive side
            return _lowest_index_ties(x, pos_idx, k, 1), mu_pos
        return _lowest_index_ties(x, neg_idx, k, -1), -mu_neg

    def select(self, flat, name=None):
        """Ascending int64 positions of the side sent (docs/methods.md)."""
        return self._choose(flat)[0]

    def _encode(self, tensor, name=None):
        flat = tensor.reshape(-1)
        idx, mu = self._choose(flat)
        return self.pack(mu.reshape(1), idx, flat.numel()), (tensor.shape, tensor.dtype)

    def unpack(self, payload, numel: int, segments=None):
        """``(mu repeated (m,) float32, positions (m,) int64 ascending)`` of one payload
        (``segments``: unused; SBC compresses one gradient per call).

        Raises:
            ValueError: not a three-tensor sbc payload, or a corrupt one.
        """
        if len(payload) != 3:
            raise ValueError(f"an sbc payload is [mu, unary, remainders], got {len(payload)} tensors")
        mu, unary, rem = payload
        idx = decode_positions(unary, rem, numel)
        return mu.reshape(-1)[:1].to(torch.float32).repeat(idx.numel()), idx
