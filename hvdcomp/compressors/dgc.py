"""``dgc``: Deep Gradient Compression.

Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth
for Distributed Training", ICLR 2018.

Per parameter, with momentum m, velocity u and accumulation v (both zero at first)::

    g = g · min(1, (C·N^-1/2) / ||g||)     # local gradient clipping (C: the global clip norm)
    u = m·u + g                            # momentum correction
    v = v + u                              # local accumulation
    send v at |v| >= thr                   # thr from a ~1 % sample of |v| (selection.py)
    u[sent] = 0 ; v[sent] = 0              # momentum factor masking

Density warms up exponentially over the first W epochs: ρ_e = ρ^((e+1)/(W+1)). DGC applies
momentum itself: use plain SGD with ``momentum=0`` (:class:`hvdcomp.DistributedOptimizer`
refuses otherwise).
"""
from __future__ import annotations

import math

import torch

from ..memory import Residuals
from .registry import register
from .rng import DrawsPerCall, RankGenerators
from .selection import MIN_SAMPLE, check_sample_ratio, sample_draws, sampled_threshold_topk, select_segments
from .segments import SegmentsContext
from .base import ErrorBound
from .sparse import SparseCompressor
from .topk import check_density, num_kept
from ..checks import check_bool, check_count, check_range, check_seed


@register("dgc")
class DGCCompressor(DrawsPerCall, SparseCompressor):
    """Deep Gradient Compression (sparse payload ``[values float32, indices int32]``).

    Args:
        density: final ρ in (0, 1] (0.001 in the paper).
        momentum: m in [0, 1) (0.9).
        sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1] (0.01).
            Tensors whose sample would have fewer than 64 entries use the exact top-k.
        warmup_epochs: W ≥ 0 epochs of exponential density warm-up (call :meth:`set_epoch`).
        clip_norm: C > 0 enables local clipping of each gradient to norm C·N^-1/2 (N = world
            size: the optimizer's group size, or Horovod's world size for an unbound compressor); 0 disables.
        nesterov: Nesterov momentum (``u = m·(u+g)``, ``v += u + g``).
        momentum_masking: zero u at sent entries (the paper's momentum factor masking).
        seed: base seed of the per-rank sampling generator.

    State per parameter name: ``u``, ``v`` (1-D, float32); plus the epoch and the generator
    state.

    Several gradients in one call (``segments``): each keeps its own clipping, momentum,
    accumulation and threshold; one ``[values, indices]`` pair over the bucket.

    Raises:
        ValueError: any argument out of range.
    """

    name = "dgc"
    owns_momentum = True
    builtin_error_feedback = True
    has_scaled_state = True
    shared_state_keys = ("epoch",)
    recycled_stores = ("u", "v")
    min_sample = MIN_SAMPLE

    def __init__(self, density: float = 0.001, momentum: float = 0.9, sample_ratio: float = 0.01,
                 warmup_epochs: int = 0, clip_norm: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, seed: int = 0):
        self.density = check_density(density)
        self.momentum = check_range(momentum, "momentum", 0.0, 1.0, high_open=True, hint=" (e.g. momentum=0.9)")
        self.sample_ratio = check_sample_ratio(sample_ratio)
        self.warmup_epochs = check_count(warmup_epochs, "warmup_epochs", 0)
        self.clip_norm = check_range(clip_norm, "clip_norm", 0.0, hint=" (0 disables local clipping)")
        self.nesterov = check_bool(nesterov, "nesterov")
        self.momentum_masking = check_bool(momentum_masking, "momentum_masking")
        seed = check_seed(seed)
        self.epoch = 0
        self.u: dict[str, torch.Tensor] = {}         # momentum
        self.memory = Residuals(self, "v")            # the accumulated velocity: error feedback on u
        self.rng = RankGenerators(seed)

    def describe(self):
        return {"name": self.name, "density": self.density, "momentum": self.momentum,
                "sample_ratio": self.sample_ratio, "warmup_epochs": self.warmup_epochs,
                "clip_norm": self.clip_norm, "nesterov": self.nesterov,
                "momentum_masking": self.momentum_masking, **self.wire_options()}

    def set_epoch(self, epoch: int) -> None:
        """Tell DGC the 0-based epoch (drives the density warm-up)."""
        self.epoch = int(epoch)

    def density_at(self, epoch: int) -> float:
        """ρ_e = ρ^((e+1)/(W+1)) during warm-up (e < W), else ρ."""
        if epoch < self.warmup_epochs:
            return self.density ** ((epoch + 1) / (self.warmup_epochs + 1))
        return self.density

    def _exact_values_bound(self):
        """None: C(v) depends on earlier calls (momentum, residual)."""
        return ErrorBound("none", "it applies momentum and keeps a residual itself, so C(v) depends on earlier calls: "
                                  "use topk")

    def nominal_ratio(self, numel):
        return numel / max(1, num_kept(numel, self.density)) / 2.0

    def select(self, flat: torch.Tensor, name=None) -> torch.Tensor:
        """Indices of about k = ceil(ρ_epoch·n) entries of largest magnitude of ``flat``."""
        n = flat.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=flat.device)
        positions = self._draws([name], [(n, flat.device)])[0]
        return sampled_threshold_topk(flat, num_kept(n, self.density_at(self.epoch)), self.sample_ratio,
                                      self.rng, magnitudes=False,
                                      min_sample=self.min_sample, positions=positions)

    def _draw(self, items):
        """The sampled positions of ``items`` for their thresholds."""
        density = self.density_at(self.epoch)
        counts = self.__dict__.setdefault("_sample_counts", {}).setdefault(density, {})
        return sample_draws(self.rng, items, lambda n: num_kept(n, density), self.sample_ratio, self.min_sample,
                            counts)

    def _encode(self, tensor, name=None):
        if name is None:
            raise ValueError("dgc keeps momentum per parameter and needs its name: use "
                             "hvdcomp.DistributedOptimizer(..., named_parameters=model.named_parameters())")
        g = tensor.reshape(-1).to(torch.float32)
        n = g.numel()
        if self.clip_norm > 0 and n:
            limit = self.clip_norm / math.sqrt(self.group_size())
            # the norm in float64: a float32 norm overflows to inf for |g| ~ 1e20 (and the
            # gradient was then zeroed instead of clipped), or underflows to 0 for |g| ~ 1e-20
            norm = torch.linalg.vector_norm(g, dtype=torch.float64)
            factor = torch.clamp(limit / torch.clamp(norm, min=1e-300), max=1.0)
            g = g * factor.to(torch.float32)
        u_old = self._get("u", name)
        u_old = torch.zeros_like(g) if u_old is None else u_old
        # new tensors, never in place: a skipped step must leave the committed u and v untouched;
        # on CPU they reuse the memory of the (u, v) replaced at the previous step (no page faults)
        u = self._spare("u", name, g)
        u = torch.empty_like(g) if u is None else u
        v = self._momentum(u_old, g, u, lambda u: self.memory.compensate(name, u))
        idx = self.select(v, name)
        values = v.index_select(0, idx)
        payload = self.pack(values, idx, n)  # float16 values saturate: the excess stays in the velocity
        self._take_sent(v, u, idx, values, payload)
        self._put("u", name, u)
        self.memory.keep(name, v)                              # what was not sent stays in v
        return payload, (tensor.shape, tensor.dtype)

    def _momentum(self, u_old, g, u, compensate):
        """u = m·u_old + g into ``u`` (Nesterov: m·(u_old + g)), rounded as two operations; returns
        the velocity ``compensate(u)`` (v + u; Nesterov: v + u + g)."""
        if self.nesterov:
            torch.add(u_old, g, out=u).mul_(self.momentum)
            return compensate(u).add_(g)
        torch.mul(u_old, self.momentum, out=u).add_(g)
        return compensate(u)

    def _take_sent(self, v, u, idx, values, payload, segments=None):
        """Remove what ``payload`` sends (``values`` = v[idx]) from the velocity ``v``, keeping the
        rounding error of fp16 / int2 / stat2 values in it; zero ``u`` at ``idx`` with momentum
        masking."""
        if self.value_coding == "fp32":
            v.index_fill_(0, idx, 0.0)
        else:
            sent, sent_idx = self.unpack(payload, v.numel(), segments)
            if sent_idx is None:  # written densely
                v.index_copy_(0, idx, values - sent.index_select(0, idx))
            else:  # (int2 sends no exact zeros: fewer entries than idx)
                v.index_add_(0, sent_idx, sent, alpha=-1)
        if self.momentum_masking:
            u.index_fill_(0, idx, 0.0)

    def _encode_segments(self, flat, segments):
        """:meth:`_encode` of every segment at once (see the class docstring); the thresholds are
        sampled segment by segment, in segment order, small segments of one size ranked by one
        ``torch.topk``."""
        names, n = segments.names, flat.numel()
        g = flat.to(torch.float32)
        if self.clip_norm > 0 and n:
            limit = self.clip_norm / math.sqrt(self.group_size())
            norms = torch.stack([torch.linalg.vector_norm(v, dtype=torch.float64) for v in segments.split(g)])
            factors = torch.clamp(limit / torch.clamp(norms, min=1e-300), max=1.0)
            g = g * segments.expand(factors.to(torch.float32))
        u_old = self._get_segments("u", segments)
        if u_old is None:
            u_old = torch.cat([torch.zeros(m, device=g.device) if t is None else t.reshape(-1)
                               for t, m in zip(self._get_many("u", names), segments.sizes)])
        u = torch.empty_like(g)
        v = self._momentum(u_old, g, u, lambda u: self.memory.compensate_segments_(u.clone(), segments))
        density = self.density_at(self.epoch)
        draws = self._draws(names, [(m, v.device) for m in segments.sizes])
        idx = select_segments(v, segments, lambda m: num_kept(m, density), self.sample_ratio, draws,
                              self.min_sample, key=("dgc", density))
        values = v.index_select(0, idx)
        payload = self.pack(values, idx, n, segments=segments)
        self._take_sent(v, u, idx, values, payload, segments)
        self._put_segments("u", segments, u, flat_shapes=True)
        self.memory.keep_segments(v, segments, flat_shapes=True)
        return payload, SegmentsContext(flat.shape, flat.dtype, segments)

    def rescale_state(self, factor):
        """Multiply the momenta u and v (gradient units) by ``factor``."""
        for t in self.u.values():
            t.mul_(factor)
        self.memory.rescale(factor)

    def state_dict(self):
        return {"epoch": self.epoch, "u": {k: t.clone() for k, t in self.u.items()},
                "v": self.memory.state(), "rng": self.rng.state_dict()}

    def load_state_dict(self, state):
        self.epoch = int(state.get("epoch", 0))
        self.u = {k: t.clone() for k, t in state.get("u", {}).items()}
        self.memory.load(state.get("v", {}))
        self.rng.load_state_dict(state.get("rng", {}))
