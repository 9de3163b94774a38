"""``sidco``: statistical threshold sparsification (SIDCo).

Abdelmoniem, Elzanaty, Alouini and Canini, "An Efficient Statistical-based Gradient Compression
Technique for Distributed Training Systems", MLSys 2021.

A sparsity-inducing distribution (``exp``, ``gamma`` or ``gpareto``) is fitted to the gradient's
magnitudes, over up to ``stages`` stages of peaks over threshold, and every entry with
``|x_i| >= η`` (η the fitted quantile, in the gradient's units, rounded to float32) is sent: O(n),
no sort; the kept count varies around k = max(1, ceil(ρ·n)) and is not capped. The stage count
adapts per parameter name until the kept count is within ``tolerance`` of k. Degenerate,
non-finite or empty fits fall back to the exact top-k (:class:`Estimate`'s ``fallback``). The
estimator, its stages and fallbacks in full: docs/methods.md, "SIDCo".
"""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from .registry import register
from .selection import exact_topk, indices_at_least
from .base import ErrorBound
from .sparse import SparseCompressor
from .topk import check_density, num_kept
from ..checks import check_choice, check_int, check_range

__all__ = ["SIDCoCompressor", "Estimate", "DISTRIBUTIONS", "MAX_STAGES", "fit_exponential", "fit_gamma",
           "fit_gpareto", "exponential_isf", "gamma_isf", "gpareto_isf"]

#: Valid values of ``dist``.
DISTRIBUTIONS = ("exp", "gamma", "gpareto")
#: Largest accepted ``stages``.
MAX_STAGES = 16
_F64 = torch.float64


# ---- fits (1-D tensors of non-negative samples; float64 scalars out) ---------------------------------
def _mean_var(y: torch.Tensor) -> Tuple[float, float]:
    """Mean and unbiased sample variance of a 1-D tensor (at least 2 entries), float64.

    Two passes: the sum in float64, then the squared deviations from the float32-rounded mean
    (float64 when ``y`` is float64) summed in float64, corrected for the rounding of the mean.
    """
    n = y.numel()
    mean = float(y.sum(dtype=_F64)) / n
    if not math.isfinite(mean):
        return mean, float("nan")
    center = float(torch.tensor(mean, dtype=y.dtype)) if y.is_floating_point() else mean
    d = y - center
    d.mul_(d)
    ss = float(d.sum(dtype=_F64)) - n * (mean - center) ** 2
    return mean, max(ss, 0.0) / (n - 1)


def fit_exponential(y: torch.Tensor) -> float:
    """Maximum-likelihood scale μ = mean(y) of an exponential distribution (float64)."""
    return float(y.sum(dtype=_F64)) / y.numel()


def _moment_fit(m: float, v: float, dist: str) -> Tuple[float, float]:
    """The ``"gamma"`` (α, β) or ``"gpareto"`` (ξ, σ) method-of-moments fit from mean m and
    variance v (see :func:`fit_gamma`, :func:`fit_gpareto`); ``(nan, nan)`` when degenerate."""
    if not (m > 0 and v > 0 and math.isfinite(m) and math.isfinite(v)):
        return float("nan"), float("nan")
    r = m * m / v
    return (r, v / m) if dist == "gamma" else (0.5 * (1.0 - r), 0.5 * m * (r + 1.0))


def fit_gamma(y: torch.Tensor) -> Tuple[float, float]:
    """Method-of-moments gamma fit: ``(shape α = m²/s², scale β = s²/m)`` with m the mean and s² the
    unbiased sample variance of ``y`` (1-D, at least 2 entries). ``(nan, nan)`` when degenerate
    (s² = 0, m <= 0) or not finite."""
    return _moment_fit(*_mean_var(y), "gamma")


def fit_gpareto(y: torch.Tensor) -> Tuple[float, float]:
    """Method-of-moments generalized Pareto fit (location 0): ``(ξ, σ)`` with
    ξ = ½(1 − m²/s²) and σ = ½·m·(m²/s² + 1) (m: mean, s²: unbiased sample variance of ``y``,
    1-D, at least 2 entries). ``(nan, nan)`` when degenerate (s² = 0, m <= 0) or not finite."""
    return _moment_fit(*_mean_var(y), "gpareto")


# ---- inverse survival functions (float64) ---------------------------------------------------------
def exponential_isf(scale: float, delta: float) -> float:
    """y with P(Y > y) = δ for Y ~ Exponential(scale): ``scale·ln(1/δ)``."""
    return scale * -math.log(delta) if delta > 0 else math.inf


def gpareto_isf(xi: float, sigma: float, delta: float) -> float:
    """y with P(Y > y) = δ for a generalized Pareto (location 0, shape ξ, scale σ):
    ``σ/ξ·(δ^(−ξ) − 1)``, computed as ``σ·expm1(ξ·L)/ξ`` with L = ln(1/δ) (``σ·L`` at ξ = 0)."""
    if delta <= 0:
        return math.inf
    big_l = -math.log(delta)
    if xi == 0.0:
        return sigma * big_l
    try:
        return sigma * math.expm1(xi * big_l) / xi
    except OverflowError:
        return math.inf


def gamma_isf(shape: float, scale: float, delta: float, *, rtol: float = 1e-14) -> float:
    """η with P(Y > η) = δ for Y ~ Gamma(shape α, scale β): ``β·x`` with Q(α, x) = δ, where Q is
    the regularized upper incomplete gamma function (``torch.special.gammaincc``, float64).

    Q(α, ·) falls from 1 at 0 to 0 at ∞. The root is bracketed by doubling / halving from
    max(1, α), then found by Newton's method on g(t) = ln Q(α, eᵗ) − ln δ in t = ln x
    (g'(t) = −x^α·e^(−x) / (Γ(α)·Q)), a step that leaves the bracket being replaced by bisection;
    it stops when |g| <= ``rtol`` or the bracket is narrower than ``rtol``·max(1, |t|).
    Returns 0 for δ >= 1 and inf for δ <= 0.

    Raises:
        ValueError: ``shape`` or ``scale`` not a positive finite number.
    """
    if not (shape > 0 and scale > 0 and math.isfinite(shape) and math.isfinite(scale)):
        raise ValueError(f"gamma_isf needs a positive finite shape and scale, got ({shape}, {scale})")
    if delta >= 1:
        return 0.0
    if delta <= 0:
        return math.inf
    alpha = torch.tensor(shape, dtype=_F64)

    def q(x: float) -> float:
        return float(torch.special.gammaincc(alpha, torch.tensor(x, dtype=_F64)))

    hi = max(1.0, shape)
    while q(hi) > delta:
        hi *= 2.0
        if math.isinf(hi):
            return math.inf
    lo = hi
    while lo > 0 and q(lo) <= delta:
        lo *= 0.5
    if lo == 0.0:  # the root is below the smallest double
        return 0.0
    log_delta, lgamma = math.log(delta), math.lgamma(shape)
    t_lo, t_hi = math.log(lo), math.log(hi)     # Q(e^t_lo) > δ >= Q(e^t_hi)
    t = 0.5 * (t_lo + t_hi)
    for _ in range(200):
        x = math.exp(t)
        qx = q(x)
        g = math.log(qx) - log_delta if qx > 0 else -math.inf
        if abs(g) <= rtol:
            break
        if g > 0:
            t_lo = t
        else:
            t_hi = t
        if t_hi - t_lo <= rtol * max(1.0, abs(t)):
            break
        step = None
        if math.isfinite(g):
            slope = -math.exp(shape * t - x - lgamma) / qx
            if slope < 0:
                step = t - g / slope
        t = step if step is not None and t_lo < step < t_hi else 0.5 * (t_lo + t_hi)
    return scale * math.exp(t)


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (±inf beyond its range), as a Python float."""
    return float(torch.tensor(value, dtype=torch.float32)) if math.isfinite(value) else value


class Estimate(NamedTuple):
    """What :meth:`SIDCoCompressor.estimate` found for one tensor.

    Attributes:
        indices: ascending int64 indices to send (1-D).
        threshold: the final η (a float32 value): ``indices`` is exactly {i : |x_i| >= η} unless
            ``fallback``; nan when no fit was made.
        kept: entries the fitted threshold keeps (before a ``"none-kept"`` fallback); -1 when no
            fit was made.
        stages: stages run (may be fewer than asked, docs/methods.md).
        thresholds: η after each stage run.
        params: per stage, ``(distribution, parameters)``: ``("exp", (μ,))``,
            ``("gamma", (α, β))`` or ``("gpareto", (ξ, σ))``.
        fallback: ``""`` (the fitted threshold), ``"sparse"``, ``"degenerate"``,
            ``"non-finite"`` or ``"none-kept"`` (exact top-k, docs/methods.md).
    """

    indices: torch.Tensor
    threshold: float
    kept: int
    stages: int
    thresholds: tuple
    params: tuple
    fallback: str

    @property
    def fitted(self) -> bool:
        """Whether a fitted threshold decided (the stage adaptation applies)."""
        return self.fallback in ("", "none-kept")


@register("sidco")
class SIDCoCompressor(SparseCompressor):
    """SIDCo: send every entry whose magnitude passes a threshold fitted to the gradient's
    magnitudes by a multi-stage sparsity-inducing distribution (docs/methods.md, "SIDCo": the exact
    estimator, the stage adaptation and the fallbacks).

    Args:
        density: ρ in (0, 1]; target k = max(1, ceil(ρ·n)) entries per tensor of n (ρ = 1 sends
            everything). 0.01 keeps about 1 %.
        dist: ``"exp"`` (default; SIDCo-E), ``"gamma"`` (SIDCo-GP: gamma first stage, generalized
            Pareto later stages) or ``"gpareto"`` (SIDCo-P: generalized Pareto throughout).
        stages: M_max, the largest number of fitting stages, an integer in [1, 16] (default 4).
            Each parameter starts with one stage and gains one (up to M_max) after every
            selection whose kept count misses k by more than ``tolerance``.
        tolerance: ε in (0, 1] (default 0.2): a selection is on target when
            (1−ε)·k <= kept <= (1+ε)·k.

    Payload: ``[values (m,) float32, indices (m,) int32]``, ascending indices, m varying per
    rank and step around k (:mod:`hvdcomp.compressors.sparse`: other codings, how ranks combine).
    Error feedback (:class:`hvdcomp.ErrorFeedback`) is on by default, as in the paper.

    State: the current number of stages per parameter name, ``state_dict() == {"stages":
    {name: M}}`` (staged until commit within a step: a rolled-back step leaves it unchanged).
    Tensors encoded without a name use one stage and record nothing.

    Raises:
        ValueError: ``density`` not in (0, 1]; ``dist`` not one of exp, gamma, gpareto;
            ``stages`` not an integer in [1, 16]; ``tolerance`` not in (0, 1]; from
            :meth:`load_state_dict`, unknown keys or stage counts that are not integers >= 1.
    """

    name = "sidco"
    default_error_feedback = True

    def __init__(self, density: float = 0.01, dist: str = "exp", stages: int = 4, tolerance: float = 0.2):
        self.density = check_density(density)
        self.dist = check_choice(dist, "dist", DISTRIBUTIONS, " (e.g. 'sidco:density=0.01,dist=gpareto')")
        self.max_stages = check_int(stages, "stages", 1, MAX_STAGES,
                                    " (the largest number of fitting stages, e.g. stages=4)")
        self.tolerance = check_range(tolerance, "tolerance", 0.0, 1.0, low_open=True,
                                     hint=" (the accepted relative error of the kept count, e.g. tolerance=0.2)")
        self.stage_counts: Dict[str, int] = {}

    def describe(self):
        return {"name": self.name, "density": self.density, "dist": self.dist, "stages": self.max_stages,
                "tolerance": self.tolerance, **self.wire_options()}

    def _exact_values_bound(self):
        """Keeps the entries above a fitted threshold exactly, never none (the exact top-k is
        the fallback), so at least the largest: δ ≥ max|v|²/‖v‖² ≥ 1/n."""
        return ErrorBound("contraction", "keeps the entries above an estimated threshold exactly, at least the largest: "
                                         "δ ≥ 1/n (about k/n when the fit hits its target)",
                          delta=lambda n: 1.0 / max(1, n))

    def nominal_ratio(self, numel):
        """None: how many entries pass the fitted threshold depends on the data."""
        return None

    # ---- the estimator ---------------------------------------------------------------------------
    @staticmethod
    def _magnitudes(flat: torch.Tensor) -> torch.Tensor:
        """|flat| as a new contiguous float32 tensor (never ``flat``'s memory)."""
        if flat.is_complex():
            return flat.abs().to(torch.float32).contiguous()
        if flat.dtype == torch.float32:
            return flat.abs().contiguous()
        return flat.to(torch.float32).abs_().contiguous()

    def _fit_first(self, a: torch.Tensor, delta: float):
        """Stage 1 on all magnitudes: ``((dist, params), quantile)``; quantile nan if degenerate,
        and the fallback kind (``""``, ``"degenerate"`` or ``"non-finite"``)."""
        if self.dist == "exp":
            mu = fit_exponential(a)
            if not math.isfinite(mu):
                return ("exp", (mu,)), math.nan, "non-finite"
            return ("exp", (mu,)), exponential_isf(mu, delta), ""
        m, v = _mean_var(a)
        if not (math.isfinite(m) and math.isfinite(v)):
            return (self.dist, (math.nan, math.nan)), math.nan, "non-finite"
        params = _moment_fit(m, v, self.dist)  # (the moments of this one pass)
        if not (math.isfinite(params[0]) and math.isfinite(params[1])):
            return (self.dist, params), math.nan, "degenerate"
        return (self.dist, params), (gamma_isf if self.dist == "gamma" else gpareto_isf)(*params, delta), ""

    def _fit_tail(self, y: torch.Tensor, delta: float):
        """Stage m >= 2 on the exceedances ``y`` (float64): ``((dist, params), quantile)``,
        quantile nan when the fit is degenerate or not finite."""
        if self.dist == "exp":
            mu = fit_exponential(y)
            ok = math.isfinite(mu) and mu > 0
            return ("exp", (mu,)), exponential_isf(mu, delta) if ok else math.nan
        xi, sigma = fit_gpareto(y)
        ok = math.isfinite(xi) and math.isfinite(sigma) and sigma > 0
        return ("gpareto", (xi, sigma)), gpareto_isf(xi, sigma, delta) if ok else math.nan

    def _fallback(self, a: torch.Tensor, k: int, kind: str, kept: int = -1, threshold: float = math.nan,
                  stages: int = 0, thresholds=(), params=()) -> Estimate:
        idx = exact_topk(a, k)
        idx = idx[a.index_select(0, idx) != 0]  # zeros change nothing (NaN stays: NaN != 0)
        return Estimate(idx, threshold, kept, stages, tuple(thresholds), tuple(params), kind)

    def estimate(self, flat: torch.Tensor, stages: Optional[int] = None) -> Estimate:
        """Run the estimator (docs/methods.md, "SIDCo") on ``flat`` (1-D, any floating dtype) with
        ``stages`` stages (default: ``stages`` given at construction). No state is read or
        written.

        Raises:
            ValueError: ``stages`` not an integer in [1, 16].
        """
        m_stages = self.max_stages if stages is None else stages
        m_stages = check_int(m_stages, "stages", 1, MAX_STAGES)
        flat = flat.reshape(-1)
        n = flat.numel()
        device = flat.device
        k = num_kept(n, self.density)
        if n == 0:
            return Estimate(torch.zeros(0, dtype=torch.long, device=device), math.nan, 0, 0, (), (), "")
        if k >= n:
            return Estimate(torch.arange(n, device=device), 0.0, n, 0, (), (), "")
        a = self._magnitudes(flat)
        if int(torch.count_nonzero(a)) < 2:
            return self._fallback(a, k, "sparse")
        target = self.density * n
        thresholds, params = [], []
        idx = vals = None
        eta, count = 0.0, n
        for m in range(1, m_stages + 1):
            if count <= target or count < 2:
                break
            delta = min(1.0, target / count) ** (1.0 / (m_stages - m + 1))
            if m == 1:
                fit, quantile, kind = self._fit_first(a, delta)
                new_eta = _float32(eta + quantile) if math.isfinite(quantile) else quantile
                if kind or not new_eta > 0:
                    if not kind:
                        kind = "non-finite" if math.isnan(new_eta) else "degenerate"
                    return self._fallback(a, k, kind, params=[fit])
                idx = indices_at_least(a, new_eta)
                if math.isinf(new_eta):
                    idx = idx[:0]
                vals = a.index_select(0, idx)
            else:
                y = vals.to(_F64) - eta
                fit, quantile = self._fit_tail(y, delta)
                if not (math.isfinite(quantile) and quantile >= 0):
                    break
                new_eta = _float32(eta + quantile)
                keep = vals >= new_eta
                idx, vals = idx[keep], vals[keep]
            eta, count = new_eta, idx.numel()
            thresholds.append(eta)
            params.append(fit)
        if count == 0:
            return self._fallback(a, k, "none-kept", kept=0, threshold=eta, stages=len(thresholds),
                                  thresholds=thresholds, params=params)
        return Estimate(idx, eta, count, len(thresholds), tuple(thresholds), tuple(params), "")

    # ---- stage adaptation ------------------------------------------------------------------------
    def next_stages(self, current: int, kept: int, k: int) -> int:
        """The adaptation rule: ``min(current + 1, stages)`` when |kept/k − 1| > tolerance, else
        ``current``."""
        if k > 0 and abs(kept / k - 1.0) > self.tolerance:
            return min(current + 1, self.max_stages)
        return current

    def current_stages(self, name) -> int:
        """Stages the next selection of ``name`` uses (this step's staged update included)."""
        if name is None:
            return 1
        return min(self._get("stage_counts", name, 1), self.max_stages)

    def select(self, flat, name=None):
        """Ascending int64 indices chosen by :meth:`estimate` with this parameter's current stage
        count, which is then adapted (staged while a step is open)."""
        n = flat.numel()
        k = num_kept(n, self.density)
        if n == 0 or k >= n:
            return torch.arange(n, device=flat.device)
        current = self.current_stages(name)
        est = self.estimate(flat, current)
        if name is not None:
            nxt = self.next_stages(current, est.kept, k) if est.fitted else current
            self._put("stage_counts", name, nxt)
        return est.indices

    # ---- checkpointing -----------------------------------------------------------------------------
    def state_dict(self):
        return {"stages": dict(self.stage_counts)}

    def load_state_dict(self, state):
        """Restore ``{"stages": {name: M}}``; counts above this instance's ``stages`` are lowered
        to it.

        Raises:
            ValueError: keys other than ``"stages"``, or a count that is not an integer >= 1.
        """
        self._check_state_keys(state, "stages", hint=" ({name: number of stages})")
        counts = {}
        for name, value in dict(state.get("stages", {})).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sidco state 'stages' maps parameter names to integers >= 1, got "
                                 f"{name!r}: {value!r}")
            counts[name] = min(value, self.max_stages)
        self.stage_counts = counts
