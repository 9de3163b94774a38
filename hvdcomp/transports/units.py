"""The compression units of an optimizer: what each compresses and where its result goes."""
from __future__ import annotations

import itertools
import operator
from typing import List, Optional, Sequence

import torch

__all__ = ["Units"]

_GRAD, _IS_SPARSE = operator.attrgetter("grad"), operator.attrgetter("is_sparse")


class Units:
    """Compression units (a gradient each, or several gradients flattened into one buffer) with
    the buffers their results are written to.

    Args:
        order: the optimizer's parameters in expected backward order.
        members: per unit, the positions in ``order`` of the gradients it holds (launch order).
        names: per unit, its name (a parameter's, ``bucket<k>`` or ``fused<k>``).
        segments: per unit, the :class:`hvdcomp.compressors.segments.Segments` of a fused unit
            (per-tensor compression in one call), else None.
        prefix: the optimizer's prefix for Horovod tensor names.

    Attributes:
        dense_bytes: per unit, its size as fp32 (bytes): what uncompressed training would send.
        grad_bytes: per unit, its size in the gradients' own dtype (bytes).
        wire_name: per unit, the Horovod tensor name prefix of its collectives.
    """

    def __init__(self, order: Sequence[torch.Tensor], members: List[List[int]], names: List[str],
                 segments: List[Optional[object]], prefix: str):
        self.order, self.members, self.names, self.segments = order, members, names, segments
        self.sparse: List[tuple] = []  # (parameter, its sparse gradient) of this step
        numel = [sum(order[i].numel() for i in m) for m in members]
        esize = [order[m[0]].element_size() for m in members]
        self.numel = numel
        self.dense_bytes = [n * 4 for n in numel]
        self.grad_bytes = [n * e for n, e in zip(numel, esize)]
        self.wire_name = [f"{prefix}.{n}" for n in names]
        self.flat: List[Optional[torch.Tensor]] = [None] * len(members)
        self.views: List[Optional[List[torch.Tensor]]] = [None] * len(members)  # of flat, per member
        self.params = [[order[i] for i in m] for m in members]  # per unit, its parameters

    def __len__(self) -> int:
        return len(self.members)

    def gradient(self, p: torch.Tensor) -> torch.Tensor:
        """``p.grad`` ready to compress: zeros for a parameter this rank did not use (other ranks
        may have), a sparse gradient made dense (Horovod's ``sparse_as_dense`` semantics; its
        layout comes back with :meth:`restore_sparse`)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            self.sparse.append((p, p.grad))
            p.grad = p.grad.to_dense()
        return p.grad

    def restore_sparse(self) -> None:
        """Write each averaged dense gradient back into the original sparse one, as Horovod does
        (the optimizer sees the gradient layout it would see without Horovod)."""
        for p, sparse in self.sparse:
            p.grad = sparse.zero_().add_(p.grad.to_sparse())
        self.sparse = []

    def tensor(self, u: int) -> torch.Tensor:
        """What unit ``u`` compresses, and where its result is written: the gradient itself, or
        (a unit of several gradients) a flat buffer they are copied into, in launch order (one
        ``_foreach_copy_`` into the buffer's views, made once)."""
        members = self.members[u]
        if len(members) == 1:
            return self.gradient(self.order[members[0]])
        grads = list(map(_GRAD, self.params[u]))
        if any(map(operator.is_, grads, itertools.repeat(None))) or any(map(_IS_SPARSE, grads)):
            grads = [self.gradient(p) for p in self.params[u]]
        flat = self.flat[u]
        if flat is None or flat.dtype != grads[0].dtype or flat.device != grads[0].device:
            flat = self.flat[u] = torch.empty(self.numel[u], dtype=grads[0].dtype, device=grads[0].device)
            self.views[u] = list(torch._C._nn.unflatten_dense_tensors(flat, grads))
        torch._foreach_copy_(self.views[u], grads)
        return flat

    def target(self, u: int) -> torch.Tensor:
        """Where unit ``u``'s averaged result goes (see :meth:`tensor`)."""
        members = self.members[u]
        return self.order[members[0]].grad if len(members) == 1 else self.flat[u]

    def write_back(self, u: int) -> None:
        """Copy a multi-gradient unit's result from its flat buffer into the members' ``.grad``
        (one ``_foreach_copy_``)."""
        members = self.members[u]
        if len(members) > 1:
            torch._foreach_copy_(list(map(_GRAD, self.params[u])), self.views[u])
