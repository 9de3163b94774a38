"""AB-training's factorised weights: which weights are factorised, each weight with its factors
A and B, and the optimizer state that follows a factor when its matrix rank changes.

While factorised, the module keeps ``W = A·B`` as its weight, so any module (Linear, conv, LSTM)
runs unchanged; the gradient of the trained factor follows from W's (``∂A = ∂W·Bᵀ``,
``∂B = Aᵀ·∂W``). Moments are carried across factorisations, padded with zeros or truncated (the
authors' ``change_adam_shapes``; Coquelin et al., arXiv:2405.01067, 2024).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .factors import factorize, matrix_view

__all__ = ["FactorizedWeight", "factorizable", "pad_or_truncate", "fit_optimizer_state"]


def factorizable(model: torch.nn.Module, named: Sequence[Tuple[str, torch.nn.Parameter]],
                 full_rank: Sequence[str]) -> List[Tuple[str, torch.nn.Parameter]]:
    """The parameters of ``named`` AB-training factorises: 2 or more dimensions, a 2-D view
    ``(out, in·kh·kw)`` with both dimensions ≥ 2, not an embedding's, not named in ``full_rank``."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return [(n, p) for n, p in named
            if p.dim() >= 2 and min(p.shape[0], p.numel() // max(1, p.shape[0])) >= 2
            and id(p) not in embedding and n not in full_rank]


def pad_or_truncate(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` resized to ``shape``: the overlap kept, new entries zero (same dtype and device)."""
    out = t.new_zeros(tuple(shape))
    overlap = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, shape))
    out[overlap] = t[overlap]
    return out


def fit_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, old_shape) -> None:
    """Pad or truncate the optimizer's tensors of ``param`` that had ``param``'s old shape
    (momentum, Adam's moments; scalars such as ``step`` stay) to its new shape, in place."""
    state = optimizer.state.get(param)
    if not state or tuple(old_shape) == tuple(param.shape):
        return
    for key, val in list(state.items()):
        if torch.is_tensor(val) and val.dim() > 0 and tuple(val.shape) == tuple(old_shape):
            state[key] = pad_or_truncate(val, param.shape)


class FactorizedWeight:
    """One factorised weight: the module's parameter, its oriented 2-D view (n × m) and the
    factors A (n × k) and B (k × m), parameters of their own (no elements before the first
    factorisation).

    Args:
        name: the parameter's name in the model.
        param: the module's weight (out, …).
        orientation: ``"tall"`` or ``"rows"`` (:func:`hvdcomp.lowrank.matrix_view`).
    """

    __slots__ = ("name", "param", "shape", "transposed", "dims", "a", "b")

    def __init__(self, name: str, param: torch.nn.Parameter, orientation: str):
        self.name, self.param, self.shape = name, param, param.shape
        view, self.transposed = matrix_view(param.detach(), orientation)
        self.dims = tuple(view.shape)
        self.a = torch.nn.Parameter(param.detach().new_zeros(0))
        self.b = torch.nn.Parameter(param.detach().new_zeros(0))

    @property
    def rank(self) -> int:
        """The matrix rank k kept now (0 before the first factorisation)."""
        return int(self.b.shape[0]) if self.b.dim() == 2 else 0

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the weight's shape) as the oriented n × m matrix."""
        m = t.reshape(self.shape[0], -1)
        return m.t() if self.transposed else m

    def matrix(self) -> torch.Tensor:
        """The weight now, as the oriented n × m matrix."""
        return self.view(self.param.detach())

    def set_weight(self, m: torch.Tensor) -> None:
        """Write the oriented n × m matrix ``m`` into the module's weight."""
        with torch.no_grad():
            self.param.copy_((m.t() if self.transposed else m).reshape(self.shape))

    def apply_factors(self) -> None:
        """W ← A·B."""
        self.set_weight(self.a.detach() @ self.b.detach())

    def refactorize(self, m: torch.Tensor, k: int, optimizer: torch.optim.Optimizer) -> None:
        """Factorise ``m`` (this weight's n × m view, float32) at matrix rank ``k`` into A and B,
        fit their optimizer state to the new shapes, clear their gradients, and set W = A·B."""
        a, b = factorize(m, rank=int(k))
        for factor, value in ((self.a, a), (self.b, b)):
            old = factor.shape
            factor.data = value.to(factor.dtype)
            factor.grad = None
            fit_optimizer_state(optimizer, factor, old)
        self.apply_factors()

    def factor_gradient(self, trains: str) -> torch.Tensor:
        """The trained factor's gradient from W's (``∂A = ∂W·Bᵀ`` or ``∂B = Aᵀ·∂W``), stored
        as that factor's ``.grad``; W's gradient is set to None. Returns the gradient."""
        gw = self.view(self.param.grad)
        if trains == "A":
            self.a.grad = gw @ self.b.detach().t()
            out = self.a.grad
        else:
            self.b.grad = self.a.detach().t() @ gw
            out = self.b.grad
        self.param.grad = None
        return out
