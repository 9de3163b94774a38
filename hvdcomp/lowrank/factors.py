"""Factorising one weight for AB-training: its matrix view, the SVD split W = A·B, the kept rank,
the authors' initialisation, and the size of a factorised model (the paper's model compression).

Coquelin et al., "AB-Training: A Communication-Efficient Approach for Distributed Low-Rank
Learning", arXiv:2405.01067 (2024). Pure functions of tensors: no communication.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["kept_rank", "factorize", "matrix_view", "unit_singular_values_", "model_compression"]


def kept_rank(singular_values: torch.Tensor, cutoff: float) -> int:
    """Number of singular values σ_i > cutoff·σ_1 (at least 1; all of them when cutoff is 0)."""
    if cutoff <= 0:
        return int(singular_values.numel())
    return max(1, int((singular_values > cutoff * singular_values[0]).sum()))


def factorize(w: torch.Tensor, rank: Optional[int] = None, cutoff: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a matrix W (n × m, floating, any dtype) into A (n × k) and B (k × m), A·B ≈ W.

    ``A = U_k·√Σ_k``, ``B = √Σ_k·V_kᵀ`` from the SVD (computed in float32; LAPACK scales
    internally, so W of norm 1e-30 or 1e30 factorises as accurately as W of norm 1);
    k = ``rank`` if given, else :func:`kept_rank` of the singular values with ``cutoff``.
    A and B have W's dtype. Pass W tall (n ≥ m, see :func:`matrix_view`) for B to be the small
    factor.

    Numerically zero singular values (σ_i ≤ n_max·eps·σ_1, every one of them when W = 0, or
    when ``rank`` exceeds W's rank) would give a zero column of A *and* a zero row of B, and then
    neither factor's gradient (∂A = ∂W·Bᵀ, ∂B = Aᵀ·∂W) could ever move that direction while
    factorised. Such directions get ``A_i = U_i·√σ_1`` (``U_i`` if W = 0) and ``B_i = 0``: A·B is
    unchanged (to within those negligible σ_i) and B's gradient along U_i is not zero.

    Raises:
        ValueError: W is not 2-D or has non-finite entries.
    """
    if w.dim() != 2:
        raise ValueError(f"factorize expects a 2-D matrix, got shape {tuple(w.shape)}")
    w32 = w.detach().to(torch.float32)
    if not torch.isfinite(w32).all():
        raise ValueError("factorize: W has non-finite entries (training has diverged); "
                         "resume from a checkpoint or lower the learning rate")
    u, s, vh = torch.linalg.svd(w32, full_matrices=False)
    k = kept_rank(s, cutoff) if rank is None else int(rank)
    top = s[0] if s.numel() else s.new_zeros(())
    dead = s[:k] <= top * (max(w.shape) * torch.finfo(torch.float32).eps)
    root = s[:k].sqrt()
    a_root = torch.where(dead, top.sqrt() if top > 0 else torch.ones_like(top), root)
    b_root = torch.where(dead, torch.zeros_like(root), root)
    return (u[:, :k] * a_root).to(w.dtype), (b_root[:, None] * vh[:k]).to(w.dtype)


def matrix_view(weight: torch.Tensor, orientation: str = "tall") -> Tuple[torch.Tensor, bool]:
    """The 2-D view AB-training factorises, and whether it is transposed.

    ``weight`` (out, …) is viewed as ``(out, prod(rest))``; with ``orientation="tall"`` a view
    with fewer rows than columns is transposed, so the result is n × m with n ≥ m (the authors'
    ``get_2d_repr``); ``"rows"`` never transposes.

    Raises:
        ValueError: ``weight`` has fewer than 2 dimensions, or an unknown orientation.
    """
    if weight.dim() < 2:
        raise ValueError(f"matrix_view needs a weight of 2 or more dimensions, got shape {tuple(weight.shape)}")
    if orientation not in ("tall", "rows"):
        raise ValueError(f"orientation must be 'tall' or 'rows', got {orientation!r}")
    m = weight.reshape(weight.shape[0], -1)
    flip = orientation == "tall" and m.shape[0] < m.shape[1]
    return (m.t() if flip else m), flip


def unit_singular_values_(model: torch.nn.Module) -> List[str]:
    """Set every singular value of every weight of 2 or more dimensions to 1 (W ← U·Vᵀ), in place.

    The authors' ``init_method: ortho-sigma``: directions are kept from the initialisation, the
    spectrum starts flat, so a direction training does not strengthen falls below the cut once
    the strengthened ones grow. Returns the names changed. Call it before the parameters are
    broadcast (or on every rank with the same weights).
    """
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            m = p.reshape(p.shape[0], -1).to(torch.float32)
            u, _, vh = torch.linalg.svd(m, full_matrices=False)
            p.copy_((u @ vh).reshape(p.shape).to(p.dtype))
            changed.append(name)
    return changed


def model_compression(named_parameters: Iterable[Tuple[str, torch.Tensor]], ranks: Dict[str, int]) -> dict:
    """Model size of the factorised model against the full-rank one (the paper's 44.14:1 kind).

    Args:
        named_parameters: ``(name, tensor)`` of the full-rank model (e.g. ``model.named_parameters()``).
        ranks: matrix rank k kept per factorised weight; such a weight of 2-D view n × m counts
            ``k·(n + m)`` parameters (A and B), every other parameter its element count.

    Returns:
        ``{"full_parameters", "parameters", "ratio"}`` with ratio = full / factorised (1.0 when
        ``ranks`` is empty).

    Raises:
        ValueError: a name in ``ranks`` is not among the parameters, or a rank outside
            [1, min(n, m)].
    """
    full = fact = 0
    seen = set()
    for name, p in named_parameters:
        full += p.numel()
        if name in ranks:
            n, m = p.shape[0], p.numel() // p.shape[0]
            k = int(ranks[name])
            if not 1 <= k <= min(n, m):
                raise ValueError(f"rank {k} of {name} is outside [1, {min(n, m)}] for its {n} x {m} view")
            fact += k * (n + m)
            seen.add(name)
        else:
            fact += p.numel()
    unknown = set(ranks) - seen
    if unknown:
        raise ValueError(f"ranks given for {sorted(unknown)}, which are not parameters of the model")
    return {"full_parameters": full, "parameters": fact, "ratio": full / fact if fact else None}

