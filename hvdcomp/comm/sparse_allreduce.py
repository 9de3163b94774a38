"""Sparse allreduce of top-k entries by recursive doubling (global top-k).

Shi, Wang, Chu, Li and Liu, "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks" (gTop-k), ICDCS 2019.

Each rank holds at most k sparse entries (index, value). In round t = 0, 1, …, log2(q) − 1
(q: the largest power of two ≤ p) rank r exchanges its entries with rank r XOR 2^t, merges the
two sets (values at one index added) and keeps the k entries of largest magnitude; the p − q ranks
beyond q first fold into rank r − q and receive the result at the end. Every rank ends with the
same ≤ k entries (an entry dropped at a round loses the contributions it held). Per rank and
step: at most (log2(q) + 1)·k entries sent, against (p − 1)·k received by an allgather.

Merges are deterministic and symmetric (the union ordered by index, the lower rank's entries
first, magnitude ties broken by index), so both ranks of a pair compute the same bits. Entries
exactly zero are not sent. :func:`global_topk` also returns the indices where *this rank's*
entries are inside the result; a rank keeps the rest as its residual, so the sum over ranks of
(result contributions + residuals) is the sum of the inputs.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from .exchange import PointToPoint, SubGroup

__all__ = ["global_topk", "hierarchical_topk", "merge_entries", "select_largest", "wire_bytes"]


def wire_bytes(index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Bytes one entry takes on the wire (its index plus its value)."""
    return index_dtype.itemsize + value_dtype.itemsize


def _pack(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One uint8 message: the indices' bytes, then the values' bytes."""
    return torch.cat([indices.contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])


def _unpack(data: torch.Tensor, index_dtype, value_dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
    data = data.to(device)
    n = data.numel() // wire_bytes(index_dtype, value_dtype)
    return data[:n * index_dtype.itemsize].view(index_dtype), data[n * index_dtype.itemsize:].view(value_dtype)


def merge_entries(first: Tuple[torch.Tensor, torch.Tensor],
                  second: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Union of two sparse sets (each with unique indices), sorted by index; values at a common
    index are added (``first``'s value + ``second``'s, exactly commutative in IEEE arithmetic).

    Args:
        first, second: ``(indices, values)``: 1-D integer and floating tensors of equal length.

    Returns:
        ``(indices, values)`` with unique ascending indices.
    """
    idx = torch.cat([first[0], second[0]])
    val = torch.cat([first[1], second[1]])
    uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    return uniq, torch.zeros(uniq.numel(), dtype=val.dtype, device=val.device).index_add_(0, inverse, val)


def select_largest(indices: torch.Tensor, values: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ≤ k entries of largest magnitude (non-zero ones only), ties broken by position, kept
    in ascending index order. Deterministic: the same input gives the same bits on every rank."""
    keep = values != 0
    if not bool(keep.all()):
        indices, values = indices[keep], values[keep]
    if values.numel() > k:
        order = torch.argsort(values.abs(), descending=True, stable=True)[:k]
        order = torch.sort(order).values
        indices, values = indices[order], values[order]
    return indices, values


def global_topk(indices: torch.Tensor, values: torch.Tensor, k: int, p2p: PointToPoint
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gTop-k sparse allreduce (see the module docstring). Collective over ``p2p``'s ranks.

    Args:
        indices: 1-D int32/int64 tensor, this rank's entry positions (unique, any order).
        values: 1-D floating tensor of the same length (the values to sum; zeros are dropped).
        k: entries kept at every merge (≥ 1), the same on every rank; inputs longer than k are
            first cut to their k largest.
        p2p: the ranks' point-to-point messages (:class:`hvdcomp.comm.exchange.MPIExchange` under MPI).

    Returns:
        ``(indices, values, kept)``: the global result (≤ k entries, ascending indices, values
        summed over the ranks whose entries reached it; identical on every rank), and the sorted
        indices where this rank's own entries are part of those sums.

    Raises:
        ValueError: ``k < 1`` or mismatched inputs.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if indices.dim() != 1 or indices.shape != values.shape:
        raise ValueError(f"indices and values must be 1-D of equal length, got {tuple(indices.shape)} "
                         f"and {tuple(values.shape)}")
    order = torch.argsort(indices)
    cur = select_largest(indices[order], values[order], k)
    mine = cur[0]
    rank, size = p2p.rank, p2p.size
    idt, vdt, dev = indices.dtype, values.dtype, values.device
    max_bytes = 2 * k * wire_bytes(idt, vdt)
    q = 1 << (size.bit_length() - 1)  # largest power of two <= size
    if rank >= q:  # fold into rank - q, then receive the result and the surviving positions
        partner = rank - q
        p2p.send(_pack(*cur), partner)
        result = _unpack(p2p.recv(partner, max_bytes), idt, vdt, dev)
        chain = p2p.recv(partner, max_bytes).to(dev).view(idt)
        return result[0], result[1], mine[torch.isin(mine, chain)]
    extra = rank + q if rank + q < size else None
    if extra is not None:
        theirs = _unpack(p2p.recv(extra, max_bytes), idt, vdt, dev)
        cur = select_largest(*merge_entries(cur, theirs), k)
    chain = cur[0]  # positions where the entries this rank holds (its own, its fold's) survive
    mask = 1
    while mask < q:
        partner = rank ^ mask
        theirs = _unpack(p2p.sendrecv(_pack(*cur), partner, max_bytes), idt, vdt, dev)
        pair = (cur, theirs) if rank < partner else (theirs, cur)
        cur = select_largest(*merge_entries(*pair), k)
        chain = chain[torch.isin(chain, cur[0])]
        mask <<= 1
    if extra is not None:
        p2p.send(_pack(*cur), extra)
        p2p.send(chain.contiguous().view(torch.uint8), extra)
    return cur[0], cur[1], mine[torch.isin(mine, chain)]


def hierarchical_topk(indices: torch.Tensor, values: torch.Tensor, k: int, p2p: PointToPoint,
                      nodes: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`global_topk` in three stages, so that only one rank per node sends across nodes:

    1. the ranks of each node run :func:`global_topk` among themselves (shared memory);
    2. the node leaders (each node's lowest rank) run it among themselves on the node results
       (the only traffic between nodes: log2(nodes) exchanges of ≤ k entries per leader);
    3. each leader sends the result, and the positions where its node's entries survived, to
       the other ranks of its node.

    A rank's entries count where they survived both stages, so error feedback loses nothing.
    The result is identical on every rank (it may differ from the flat :func:`global_topk`'s:
    the merges happen in another order). Collective over ``p2p``'s ranks.

    Args:
        indices, values, k, p2p: as :func:`global_topk`.
        nodes: node id of every rank of ``p2p`` (e.g. :attr:`hvdcomp.comm.exchange.MPIExchange.nodes`).

    Returns:
        ``(indices, values, kept)`` as :func:`global_topk`.

    Raises:
        ValueError: ``len(nodes)`` differs from the number of ranks, or as :func:`global_topk`.
    """
    if len(nodes) != p2p.size:
        raise ValueError(f"nodes names {len(nodes)} ranks, the group has {p2p.size}")
    me = p2p.rank
    local = [r for r, n in enumerate(nodes) if n == nodes[me]]
    first: dict = {}
    for r, n in enumerate(nodes):  # one pass: each node's lowest rank leads it
        first.setdefault(n, r)
    leaders = sorted(first.values())
    idx, val, kept = global_topk(indices, values, k, SubGroup(p2p, local))
    idt, vdt, dev = idx.dtype, val.dtype, val.device
    max_bytes = 2 * k * wire_bytes(idt, vdt)
    if me == local[0]:
        idx, val, chain = global_topk(idx, val, k, SubGroup(p2p, leaders))
        for r in local[1:]:
            p2p.send(_pack(idx, val), r)
            p2p.send(chain.contiguous().view(torch.uint8), r)
    else:
        idx, val = _unpack(p2p.recv(local[0], max_bytes), idt, vdt, dev)
        chain = p2p.recv(local[0], max_bytes).to(dev).view(idt)
    return idx, val, kept[torch.isin(kept, chain)]

