"""Packing of small unsigned integer codes at b bits each (1 ≤ b ≤ 62), any length.

Codes are laid out little-endian within the bit stream: code i occupies bits
``[i·b, (i+1)·b)``; the last byte is zero-padded. ``ceil(m·b/8)`` bytes for m codes.
Works on CPU and CUDA tensors (pure tensor ops, no host sync). This is the vectorised torch
implementation (the CUDA path, and the CPU path when the native kernels are off); the native CPU
kernels (:mod:`hvdcomp.native`) write and read the same layout inside their fused loops.

A fixed number of passes per width, each a whole-tensor op on a reshaped view:

* b = 8: the codes are the bytes (plain ``uint8``, no packing);
* b = 1, 2, 4: 8/b codes per byte: one shift per code position, summed (disjoint bits) into bytes;
  unpacking shifts and masks a ``(bytes, 8/b)`` view;
* b = 3, 5, 6, 7: 8 codes fill exactly b bytes: one int64 word per group of 8, split into bytes;
* 9 ≤ b ≤ 62: bit by bit (O(m·b); QSGD with s > 127, SBC's wide remainders).
"""
from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "unpack_codes", "packed_nbytes", "bits_for_levels"]


def bits_for_levels(count: int) -> int:
    """Bits needed for ``count`` distinct codes: ceil(log2(count)), at least 1."""
    if count < 1:
        raise ValueError(f"need at least one code, got {count}")
    return max(1, (count - 1).bit_length())


def packed_nbytes(m: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``m`` codes of ``bits`` bits."""
    return (m * bits + 7) // 8


def _check(bits):
    if not isinstance(bits, int) or not 1 <= bits <= 62:
        raise ValueError(f"bits must be an integer in [1, 62], got {bits!r}")


def _padded(flat: torch.Tensor, multiple: int, dtype: torch.dtype) -> torch.Tensor:
    """``flat`` as ``dtype``, zero-padded to a multiple of ``multiple`` elements (one copy at most)."""
    m = flat.numel()
    pad = (-m) % multiple
    if not pad:
        return flat.to(dtype)
    out = torch.zeros(m + pad, dtype=dtype, device=flat.device)
    out[:m] = flat
    return out


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (integer tensor of any shape, values in [0, 2^bits)) into a uint8 tensor.

    Returns a new 1-D uint8 tensor of ``packed_nbytes(codes.numel(), bits)`` bytes.

    Raises:
        ValueError: ``bits`` outside [1, 62].
    """
    _check(bits)
    flat = codes.reshape(-1)
    m = flat.numel()
    nbytes = packed_nbytes(m, bits)
    if bits == 8:
        out = flat.to(torch.uint8)
        return out.clone() if out.data_ptr() == codes.data_ptr() and m else out
    if bits in (1, 2, 4):
        per = 8 // bits
        c = _padded(flat, per, torch.uint8).view(-1, per)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
        return (c << shifts).sum(1, dtype=torch.uint8)[:nbytes]
    if bits < 8:  # 3, 5, 6, 7: a group of 8 codes is exactly `bits` bytes
        c = _padded(flat, 8, torch.int64).view(-1, 8)
        word = (c << torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=c.device)).sum(1)
        byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=c.device)
        return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)[:nbytes]
    shifts = torch.arange(bits, device=flat.device, dtype=torch.int64)
    stream = ((flat.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1).to(torch.uint8)
    stream = _padded(stream, 8, torch.uint8).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.uint8, device=flat.device)).sum(1, dtype=torch.uint8)


def _need(packed: torch.Tensor, bits: int, m: int) -> None:
    _check(bits)
    if packed.numel() < packed_nbytes(m, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {m} codes of {bits} bits")


def unpack_codes(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """The first ``m`` codes of ``packed`` (1 ≤ bits ≤ 8) as a uint8 tensor (m,): the decoders'
    fast path (a view of ``packed`` itself for 8-bit codes).

    Raises:
        ValueError: ``bits`` outside [1, 8] or too few bytes for ``m`` codes.
    """
    _need(packed, bits, m)
    if bits > 8:
        raise ValueError(f"unpack_codes returns uint8 codes (bits <= 8), got bits={bits}; use unpack_bits")
    p = packed.reshape(-1)
    if bits == 8 or m == 0:
        return p[:m]
    if bits in (1, 2, 4):
        nbytes = packed_nbytes(m, bits)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
        return ((p[:nbytes, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:m]
    groups = (m + 7) // 8
    g = _padded(p[: min(groups * bits, p.numel())], groups * bits, torch.int64)
    g = g[: groups * bits].view(groups, bits)
    word = (g << torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=p.device)).sum(1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=p.device)
    return ((word[:, None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)[:m]


def unpack_bits(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``m`` codes as an int64 tensor.

    Raises:
        ValueError: ``bits`` outside [1, 62] or too few bytes for ``m`` codes.
    """
    _need(packed, bits, m)
    if bits <= 8:
        return unpack_codes(packed, bits, m).to(torch.int64)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.reshape(-1, 1).to(torch.int32) >> shifts) & 1).reshape(-1)[: m * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int64))
    return (stream.reshape(m, bits).to(torch.int64) * weights).sum(1)
