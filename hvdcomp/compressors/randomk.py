"""``randomk``: random-k sparsification with indices shared by all ranks.

Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k with memory);
Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed Optimization",
NeurIPS 2018. Every rank draws the same k indices from a dedicated ``torch.Generator`` seeded from
(seed, parameter name, step), so only the values travel and Horovod allreduce averages them. The
indices are the first k distinct values of a stream of uniform draws in [0, n) (a uniformly
random k-subset; the native bitmap and torch's sort find the same set), or a permutation's first
k entries when k > n/8.
"""
from __future__ import annotations

import zlib
from functools import partial

import torch

from .. import native
from .base import AggregateInto, Compressor, ErrorBound, float32_flat, write_back
from .registry import register
from .topk import check_density, num_kept
from ..checks import check_seed

_MASK63 = (1 << 63) - 1


def shared_seed(seed: int, name: str, step: int) -> int:
    """A seed equal on every rank for (seed, parameter name, step); Python's ``hash`` is not."""
    return (_name_seed(seed, name) + step) & _MASK63


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_003


def _first_distinct(draw, k: int) -> torch.Tensor:
    """Torch version of :func:`hvdcomp.native.first_distinct` (same result): ascending indices of
    the first k distinct values of the concatenated draws."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    streams = []
    while True:
        streams.append(draw())
        stream = torch.cat(streams)
        ordered, order = torch.sort(stream, stable=True)
        first = torch.ones(stream.numel(), dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        pos = order[first]                      # where each distinct value first appears
        if pos.numel() >= k:
            return stream[pos.sort().values[:k]].sort().values


@register("randomk")
class RandomKCompressor(AggregateInto, Compressor):
    """Keep k = max(1, ceil(ρ·n)) uniformly random entries, the same on every rank.

    Args:
        density: ρ in (0, 1].
        seed: base seed (the same on every rank).

    Payload: ``[values (k,) float32]``; indices are regenerated locally, so 4 bytes per kept
    element travel (nominal ratio counts indices anyway, as the study does). Error feedback is on
    by default (``ef=false`` to turn it off; the study shows that diverges). Several gradients in
    one call (``segments``): each gradient's values at its own indices, in buffer order.

    State: a step counter per parameter name (``state_dict()["steps"]``).

    Raises:
        ValueError: density not in (0, 1]; from :meth:`encode`, a missing parameter name.
    """

    name = "randomk"
    default_error_feedback = True
    shared_state_keys = ("steps",)  # the indices derive from (seed, name, step) on every rank

    def __init__(self, density: float = 0.01, seed: int = 0):
        self.density = check_density(density)
        self.seed = check_seed(seed)
        self.steps = {}

    def describe(self):
        return {"name": self.name, "density": self.density, "seed": self.seed}

    @property
    def error_bound(self):
        """Keeps k random entries exactly, unscaled: E‖C(v) − v‖² = (1 − k/n)‖v‖² (over the draw)."""
        density = self.density
        return ErrorBound("contraction", "keeps k = max(1, ⌈ρn⌉) random entries exactly (unscaled): δ = k/n in "
                                         "expectation", delta=lambda n: num_kept(n, density) / max(1, n))

    def nominal_ratio(self, numel):
        return numel / max(1, num_kept(numel, self.density)) / 2.0

    def indices(self, numel: int, name: str, step: int, device=None) -> torch.Tensor:
        """The k shared indices (int64, ascending) for this parameter and step (module docstring)."""
        k = num_kept(numel, self.density)
        gen = torch.Generator().manual_seed(shared_seed(self.seed, name, step))
        if k == 0:
            idx = torch.zeros(0, dtype=torch.int64)
        elif 8 * k > numel:
            idx = torch.randperm(numel, generator=gen)[:k].sort().values
        else:
            batch = k + k * k // numel + k // 16 + 64          # usually enough distinct draws at once

            def draw():
                return torch.randint(0, numel, (batch,), generator=gen)

            idx = native.first_distinct(draw, numel, k) if native.enabled() else _first_distinct(draw, k)
        return idx.to(device) if device is not None else idx

    def _segment_layout(self, segments):
        """Per segment, decided once: its k, how its indices are drawn (``"none"``, ``"perm"`` or
        ``"draw"``, as :meth:`indices`), its batch of draws, its seed before the step is added,
        and a generator to reseed each step."""
        def make(seg):
            rows = []
            for name, n in zip(seg.names, seg.sizes):
                k = num_kept(n, self.density)
                how = "none" if k == 0 else ("perm" if 8 * k > n else "draw")
                rows.append((n, k, how, k + k * k // n + k // 16 + 64 if n else 0, _name_seed(self.seed, name),
                             torch.Generator()))
            return rows
        return segments.cached(("randomk", self.density, self.seed), make)

    def _segment_indices(self, segments, steps) -> torch.Tensor:
        """Every segment's :meth:`indices` (for ``steps[j]``) as ascending int64 indices into the
        buffer: the same sets, one native call for the draws' first distinct values."""
        layout = self._segment_layout(segments)
        use_native = native.enabled()
        draws, ks, parts = [None] * len(layout), [0] * len(layout), []
        for j, ((n, k, how, batch, base, gen), step) in enumerate(zip(layout, steps)):
            if how == "none":
                continue
            gen.manual_seed((base + step) & _MASK63)  # shared_seed(seed, name, step)
            start = segments.offsets[j]
            if how == "perm":
                parts.append(torch.randperm(n, generator=gen)[:k].sort().values + start)
            elif use_native:
                draws[j], ks[j] = partial(torch.randint, 0, n, (batch,), generator=gen), k
            else:
                parts.append(_first_distinct(partial(torch.randint, 0, n, (batch,), generator=gen), k) + start)
        if any(ks):
            parts.append(native.first_distinct_segments(draws, segments.sizes_tensor(), ks))
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        return parts[0] if len(parts) == 1 else torch.cat(parts).sort().values

    def _encode_segments(self, flat, segments):
        """Each segment's values at its own shared indices, one gather over the buffer; the
        context holds the indices into the buffer, so decoding and aggregating are those of one
        tensor."""
        steps = [0 if s is None else s for s in self._get_many("steps", segments.names)]
        self._put_many("steps", segments.names, [s + 1 for s in steps])
        idx = self._segment_indices(segments, steps).to(flat.device)
        return [flat.index_select(0, idx).to(torch.float32)], (flat.shape, flat.dtype, idx)

    def _encode(self, tensor, name=None):
        if name is None:
            raise ValueError("randomk seeds its indices from the parameter name: use "
                             "hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        step = self._get("steps", name, 0)
        self._put("steps", name, step + 1)
        flat = tensor.reshape(-1)
        idx = self.indices(flat.numel(), name, step, flat.device)
        return [flat.index_select(0, idx).to(torch.float32)], (tensor.shape, tensor.dtype, idx)

    def aggregate_into(self, out, payloads, ctx):
        """Mean of the payloads' values scattered at the shared indices into ``out`` (zeroed):
        one write pass over ``out`` (native on CPU: chunk by chunk) plus O(k)."""
        shape, dtype, idx = ctx
        flat = float32_flat(out)
        values = payloads[0][0].to(torch.float32) if len(payloads) == 1 else \
            torch.stack([p[0].to(torch.float32) for p in payloads]).mean(0)
        if not (native.usable(flat, values, idx) and native.sparse_aggregate(flat, [idx], [values.contiguous()], 1.0)):
            flat.zero_()
            flat[idx.to(flat.device)] = values.to(flat.device)
        return write_back(out, flat)

    def state_dict(self):
        return {"steps": dict(self.steps)}

    def residual_(self, p, payload, ctx):
        """``p - decode(payload)`` in ``p``'s memory: the sent values subtracted at the indices."""
        if p.dtype != torch.float32 or not p.is_contiguous():
            return super().residual_(p, payload, ctx)
        p.view(-1).index_add_(0, ctx[2].to(p.device), payload[0].to(p.dtype), alpha=-1)
        return p

    def load_state_dict(self, state):
        self.steps = dict(state.get("steps", {}))
