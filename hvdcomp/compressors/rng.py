"""Per-rank random generators for stochastic compressors (never the global RNG)."""
from __future__ import annotations

from typing import Dict

import torch

from ..comm.world import rank

__all__ = ["RankGenerators"]


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

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {**self._pending, **{k: g.get_state() for k, g in self._gens.items()}}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._gens, self._pending = {}, {k: v.clone() for k, v in state.items()}
