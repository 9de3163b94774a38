"""Packing of small unsigned integer codes at b bits each (1 ≤ b ≤ 16), any length.

Codes are laid out little-endian within the bit stream: code i occupies bits
``[i·b, (i+1)·b)``; the last byte is zero-padded. ``ceil(m·b/8)`` bytes for m codes.
Works on CPU and CUDA tensors (pure tensor ops, no host sync).

For b ≤ 8, codes are packed a group at a time: g = 8/gcd(b, 8) codes fill exactly g·b/8 bytes
(≤ 7 bytes), assembled in one int64 per group, so the cost is O(m) with a handful of tensor ops.
Wider codes go bit by bit (O(m·b)).
"""
from __future__ import annotations

import math

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "bits_for_levels"]


def bits_for_levels(count: int) -> int:
    """Bits needed for ``count`` distinct codes: ceil(log2(count)), at least 1."""
    if count < 1:
        raise ValueError(f"need at least one code, got {count}")
    return max(1, (count - 1).bit_length())


def packed_nbytes(m: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``m`` codes of ``bits`` bits."""
    return (m * bits + 7) // 8


def _check(bits):
    if not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an integer in [1, 16], got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (1-D integer tensor, values in [0, 2^bits)) into a uint8 tensor.

    Returns a 1-D uint8 tensor of ``packed_nbytes(codes.numel(), bits)`` bytes.

    Raises:
        ValueError: ``bits`` outside [1, 16].
    """
    _check(bits)
    m = codes.numel()
    if bits <= 8:
        return _pack_groups(codes.reshape(-1), bits)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.reshape(-1, 1).to(torch.int32) >> shifts) & 1).reshape(-1).to(torch.uint8)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    out = (stream.reshape(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)
    assert out.numel() == packed_nbytes(m, bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``m`` codes as an int64 tensor.

    Raises:
        ValueError: ``bits`` outside [1, 16] or too few bytes for ``m`` codes.
    """
    _check(bits)
    if packed.numel() < packed_nbytes(m, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {m} codes of {bits} bits")
    if bits <= 8:
        return _unpack_groups(packed.reshape(-1), bits, m)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.reshape(-1, 1).to(torch.int32) >> shifts) & 1).reshape(-1)[: m * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int64))
    return (stream.reshape(m, bits).to(torch.int64) * weights).sum(1)


def _group(bits: int):
    g = 8 // math.gcd(bits, 8)          # codes per group
    return g, g * bits // 8             # bytes per group


def _pack_groups(codes: torch.Tensor, bits: int) -> torch.Tensor:
    g, nb = _group(bits)
    m = codes.numel()
    pad = (-m) % g
    c = codes.to(torch.int64)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    shifts = torch.arange(g, device=c.device, dtype=torch.int64) * bits
    word = (c.view(-1, g) << shifts).sum(1)                                  # one int64 per group
    byte_shifts = torch.arange(nb, device=c.device, dtype=torch.int64) * 8
    out = ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(m, bits)]


def _unpack_groups(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    g, nb = _group(bits)
    groups = (m + g - 1) // g
    need = groups * nb
    p = packed[: min(need, packed.numel())].to(torch.int64)
    if p.numel() < need:
        p = torch.cat([p, p.new_zeros(need - p.numel())])
    byte_shifts = torch.arange(nb, device=p.device, dtype=torch.int64) * 8
    word = (p.view(groups, nb) << byte_shifts).sum(1)
    shifts = torch.arange(g, device=p.device, dtype=torch.int64) * bits
    return ((word[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:m]
