"""Per-rank random generators for stochastic compressors (never the global RNG), and the order
in which a fused pipeline takes their draws (:class:`DrawOrder`, :meth:`RankGenerators.ordered`:
each gradient of a fused bucket gets the draw one call per gradient would give it; see
docs/fused-compression.md, "Random draws").
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..comm.world import rank

__all__ = ["RankGenerators", "DrawOrder", "DrawsPerCall", "rounding_draws"]


class DrawOrder:
    """The order in which one call per gradient would encode the gradients of the current step
    (docs/fused-compression.md, "Random draws").

    Args:
        names, sizes, devices: per gradient, in the optimizer's launch order: its parameter name,
            its number of elements, its device.
        flush: gradient positions in the order ``synchronize()`` starts those backward did not
            complete (one call per gradient: other routes first, then the bucketed ones).

    Attributes:
        ready: positions of the gradients backward completed this step, in that order: a list
            :class:`hvdcomp.step.StepState` appends to and replaces at each step
            (:meth:`restart`).
    """

    def __init__(self, names: Sequence[str], sizes: Sequence[int], devices: Sequence[torch.device],
                 flush: Sequence[int]):
        self.names, self.sizes, self.devices = list(names), list(sizes), list(devices)
        self.position = {n: i for i, n in enumerate(self.names)}
        self.flush = list(flush)
        self.ready: List[int] = []

    def restart(self, ready: List[int]) -> None:
        """A new step: ``ready`` is its (empty) list of completed gradients."""
        self.ready = ready

    def complete(self) -> List[int]:
        """The whole step's order, once backward is over: ``ready``, then ``flush`` without them."""
        seen = set(self.ready)
        return self.ready + [i for i in self.flush if i not in seen]


class DrawsPerCall:
    """Mixin of methods that draw from their per-rank generator (``self.rng``, a
    :class:`RankGenerators`) at each call: ``draws_per_call`` (read by
    :func:`hvdcomp.compressors.segments.needs_draw_order`), :meth:`bind_draw_order`, and the
    generator's state as the checkpoint."""

    draws_per_call = True

    def bind_draw_order(self, order) -> None:
        """Take the generator's draws in ``order`` (a :class:`DrawOrder`, or None: in call
        order); set by the optimizer on fused pipelines."""
        self.rng.order = order

    def _draws(self, names, items):
        """Each named gradient's draw (``self._draw`` of a list of ``(numel, device)``), in the
        order one call per gradient takes them (:meth:`RankGenerators.ordered`)."""
        return self.rng.ordered(names, items, self._draw)

    def state_dict(self):
        """The per-rank generator's state: ``{"rng": ...}``."""
        return {"rng": self.rng.state_dict()}

    def load_state_dict(self, state):
        self.rng.load_state_dict(state.get("rng", {}))


class RankGenerators:
    """One ``torch.Generator`` per device type, seeded with ``seed`` and this rank.

    Ranks draw independent streams (stochastic rounding must not be correlated across ranks);
    the states are checkpointable with :meth:`state_dict` (uint8 tensors, safe to load with
    ``torch.load(weights_only=True)``).
    """

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self._gens: Dict[str, torch.Generator] = {}
        self._pending: Dict[str, torch.Tensor] = {}
        self.order: Optional[DrawOrder] = None  # set on fused pipelines (docs/fused-compression.md)
        self._step: Optional[list] = None  # the step (its DrawOrder.ready list) the draws below are of
        self._done = 0                      # draws made in the step's order so far
        self._held: Dict[int, Any] = {}     # position -> draw made ahead, for a unit encoded later

    def get(self, device: torch.device) -> torch.Generator:
        """The generator for ``device`` (created and seeded on first use)."""
        key = torch.device(device).type
        gen = self._gens.get(key)
        if gen is None:
            gen = torch.Generator(device=key)
            gen.manual_seed(self.seed * 1_000_003 + 7919 * rank() + 1)
            if key in self._pending:
                gen.set_state(self._pending.pop(key))
            self._gens[key] = gen
        return gen

    def key(self, device="cpu") -> int:
        """A 63-bit key that seeds the native kernels' xoshiro128++ streams, drawn from this rank's
        generator for ``device``: one draw per call, so the key sequence is as reproducible and
        checkpointable as the generator itself."""
        gen = self.get(device)
        return int(torch.randint(0, 2**63 - 1, (1,), generator=gen, device=gen.device).item())

    def keys(self, count: int, device="cpu") -> torch.Tensor:
        """``count`` keys as an int64 tensor ``(count,)``: the values ``count`` calls of :meth:`key`
        return, in order, from one draw of ``count`` values (leaving the generator in the same
        state)."""
        gen = self.get(device)
        return torch.randint(0, 2**63 - 1, (count,), generator=gen, device=gen.device).cpu()

    def ordered(self, names: Sequence[Optional[str]], items: Sequence[Tuple[int, torch.device]],
                draw: Callable[[List[Tuple[int, torch.device]]], List[Any]]) -> List[Any]:
        """Each named gradient's draw, as one call per gradient takes it.

        Args:
            names: the gradients encoded now (parameter names).
            items: their ``(numel, device)``.
            draw: ``draw(items) -> values``: one draw per item from these generators, taken in
                the items' order (a value may be None for an item that draws nothing).

        Without a :attr:`order` (or for a name it does not know) the draws are taken now, in
        ``names`` order. With one, the step's draws are taken in its order (:class:`DrawOrder`)
        up to the last of ``names``; those of other gradients are held for their own call.
        """
        order = self.order
        if order is None or not all(map(order.position.__contains__, names)):
            return draw(list(items))
        if order.ready is not self._step:  # a new step
            self._step, self._done, self._held = order.ready, 0, {}
        want = list(map(order.position.__getitem__, names))
        held = self._held
        missing = [p for p in want if p not in held]
        if missing:
            rest = order.ready[self._done:]
            where = {p: k for k, p in enumerate(rest)}
            if not all(map(where.__contains__, missing)):  # a gradient backward did not complete
                rest = order.complete()[self._done:]
                where = {p: k for k, p in enumerate(rest)}
            if all(map(where.__contains__, missing)):
                end = max(map(where.__getitem__, missing)) + 1
                ahead = rest[:end]
                self._held.update(zip(ahead, draw([(order.sizes[p], order.devices[p]) for p in ahead])))
                self._done += end
            else:  # encoded twice in one step: draw now
                self._held.update(zip(missing, draw([items[want.index(p)] for p in missing])))
        return list(map(held.pop, want))

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {**self._pending, **{k: g.get_state() for k, g in self._gens.items()}}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._gens, self._pending = {}, {k: v.clone() for k, v in state.items()}


def rounding_draws(rng: RankGenerators, items: Sequence[Tuple[int, torch.device]], native_on: Callable,
                   shape_of: Callable[[int], Tuple[int, ...]]) -> List[Any]:
    """The stochastic-rounding draws of QSGD and TernGrad, one per gradient ``(numel, device)``:
    where ``native_on(device)``, the native kernels' key (none for an empty gradient; every key
    of the call from one draw, :meth:`RankGenerators.keys`), else ``torch.rand(shape_of(n))``
    from the device's generator, in order."""
    out: List[Any] = [None] * len(items)
    native = {device: native_on(device) for device in {device for _, device in items}}
    keyed = [j for j, (n, device) in enumerate(items) if n and native[device]]
    for j, (n, device) in enumerate(items):
        if not native[device]:
            gen = rng.get(device)
            out[j] = torch.rand(shape_of(n), generator=gen, device=device)
    if keyed:
        for j, key in zip(keyed, rng.keys(len(keyed)).tolist()):
            out[j] = key
    return out
