"""DiLoCo's outer step, and its SparseLoCo variant.

DiLoCo: Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam and Shen, "DiLoCo:
Distributed Low-Communication Training of Language Models", 2023: H inner steps (AdamW in the
paper), then an outer SGD step with Nesterov momentum (lr 0.7, momentum 0.9) on the averaged
pseudo-gradient (:mod:`hvdcomp.local.base` has the round). Outer SGD with lr 1 and no momentum is
plain parameter averaging (local SGD, FedAvg).

SparseLoCo: Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", 2025. No outer momentum; instead a decaying error feedback on Δ::

    e ← β·e + Δ;  send C(e);  e ← e − C(e);  θ_start ← θ_start − α·(the ranks' C(e) combined)

that is :class:`hvdcomp.ErrorFeedback` with its residuals multiplied by β after each applied
round (:meth:`hvdcomp.memory.Residuals.rescale`). Its two forms (:data:`SPARSELOCO_FORMS`: the
authors' released code, top-k per 64 × 64 tile at 2 bits averaged over senders; hvdcomp's earlier
flat chunks) and how each differs from the paper: ``docs/local-update.md`` ("SparseLoCo").
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..checks import check_bool, check_choice
from ..memory import ErrorFeedback
from ..spec import resolve_compression
from ..checks import check_real
from .base import _OUTER_LR_HINT, LocalUpdate

__all__ = ["DiLoCo", "SparseLoCo", "SPARSELOCO_FORMS", "outer_sgd"]

#: SparseLoCo's forms (see the module docstring): the method that carries Δ (with error
#: feedback), β, and ``chunk_size``
SPARSELOCO_FORMS = {
    "authors": ("topk:density=0.03125,tile=64,values=stat2,index=compact,average=senders", 0.95, None),
    "flat": ("topk:density=0.02,values=int2,index=compact", 0.999, 4096),
}
_FORM = object()  # an argument left to the form's default


def outer_sgd(lr: float, momentum: float, nesterov: bool) -> Callable[[List[torch.Tensor]], torch.optim.SGD]:
    """The outer optimizer ``f(tensors)``: ``torch.optim.SGD`` (Nesterov only with momentum > 0).

    Raises:
        ValueError: ``lr`` not a finite number > 0, ``momentum`` not a number in [0, 1),
            ``nesterov`` not a bool, Nesterov without momentum.
    """
    lr = check_real(lr, "the outer learning rate", lambda v: v > 0, "> 0 and finite", _OUTER_LR_HINT)
    momentum = check_real(momentum, "the outer momentum", lambda v: 0.0 <= v < 1.0, "in [0, 1)")
    nesterov = check_bool(nesterov, "nesterov")
    if nesterov and not momentum:
        raise ValueError("Nesterov needs an outer momentum > 0: give outer_momentum, or nesterov=False")
    return lambda tensors: torch.optim.SGD(tensors, lr=lr, momentum=momentum, nesterov=nesterov)


class DiLoCo(LocalUpdate):
    """DiLoCo: H local steps of ``optimizer``, then an outer Nesterov step on the averaged
    pseudo-gradient (see the module docstring).

    Args:
        optimizer: the inner optimizer (DiLoCo: AdamW, lr 4e-4, weight decay 0.1).
        named_parameters: ``model.named_parameters()``.
        local_steps: H ≥ 1 (DiLoCo: 500 on its C4 runs; small models and noisy data want fewer,
            see ``docs/local-update.md``).
        compression: the method that carries Δ, with its error feedback (default ``"none"``).
        outer_lr: α > 0 (0.7).
        outer_momentum: in [0, 1) (0.9).
        nesterov: Nesterov momentum (True; needs ``outer_momentum`` > 0).
        outer_optimizer: ``f(tensors) -> torch.optim.Optimizer`` instead of the three above.
        **kwargs: :class:`~hvdcomp.local.base.LocalUpdate`'s (``host_copy``, ``timer``,
            ``chunk_size``, ``backward_passes_per_step``) and the pipeline's
            (``process_set``, ``allgather``, ``cost_model``, ...).

    Raises:
        ValueError: as :class:`~hvdcomp.local.base.LocalUpdate`, and :func:`outer_sgd`'s.

    Example::

        import hvdcomp.local

        hvd.init()
        inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
        opt = hvdcomp.local.DiLoCo(inner, model.named_parameters(), local_steps=32,
                                   compression="topk:density=0.01")
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    algorithm = "diloco"

    def __init__(self, optimizer, named_parameters=None, *, local_steps: int, compression="none",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 outer_optimizer: Optional[Callable] = None, **kwargs):
        outer = outer_optimizer or outer_sgd(outer_lr, outer_momentum, nesterov)
        super().__init__(optimizer, named_parameters, local_steps=local_steps, outer_optimizer=outer,
                         compression=compression, **kwargs)


class SparseLoCo(LocalUpdate):
    """SparseLoCo: DiLoCo with the outer momentum replaced by a decaying error feedback on Δ,
    sent sparse and at 2 bits (see the module docstring for the two forms).

    Args:
        optimizer: the inner optimizer (the paper: AdamW).
        named_parameters: ``model.named_parameters()``.
        local_steps: H ≥ 1 (their released configuration: 15).
        form: ``"authors"`` (default: the authors' released code) or ``"flat"`` (hvdcomp's earlier
            form); it sets the defaults of the next three arguments (:data:`SPARSELOCO_FORMS`).
        compression: a method with :class:`hvdcomp.ErrorFeedback`.
        beta: β in [0, 1], the residual's decay per round (0: no memory).
        outer_lr: α > 0 (1.0).
        chunk_size: elements per chunk of the flattened Δ, or None for whole parameters.
        **kwargs: as :class:`DiLoCo`.

    A dropped round leaves the residuals as they were (the decay by β follows each applied round).

    Raises:
        ValueError: an unknown ``form``, ``beta`` not a number in [0, 1], a method without
            :class:`hvdcomp.ErrorFeedback` (e.g. ``"fp16"`` or ``"topk:ef=false"``),
            ``transport="auto"``, and :class:`DiLoCo`'s.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        opt = hvdcomp.local.SparseLoCo(inner, model.named_parameters(), local_steps=15)
    """

    algorithm = "sparseloco"

    def __init__(self, optimizer, named_parameters=None, *, local_steps: int, form: str = "authors",
                 compression=_FORM, beta=_FORM, outer_lr: float = 1.0, chunk_size=_FORM, **kwargs):
        check_choice(form, "form", tuple(SPARSELOCO_FORMS), " (the authors' released code, or hvdcomp's flat chunks)")
        default_method, default_beta, default_chunk = SPARSELOCO_FORMS[form]
        compression = default_method if compression is _FORM else compression
        beta = default_beta if beta is _FORM else beta
        chunk_size = default_chunk if chunk_size is _FORM else chunk_size
        beta = check_real(beta, "beta (the residual's decay per round)", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        if kwargs.get("transport", "planned") != "planned":
            raise ValueError("SparseLoCo decays the residual of the method it is given: transport='auto' (which "
                             "may replace the method) does not apply")
        method = resolve_compression(compression)
        if not isinstance(method, ErrorFeedback):
            raise ValueError(f"SparseLoCo decays an error-feedback residual, but '{method.name}' "
                             f"({method.describe()}) keeps none: use a method with ef=true, e.g. "
                             f"'{default_method}'")
        self.form, self.beta = form, beta
        super().__init__(optimizer, named_parameters, local_steps=local_steps, compression=method,
                         outer_optimizer=outer_sgd(outer_lr, 0.0, False), chunk_size=chunk_size, **kwargs)

    def _outer_step(self) -> None:
        """The outer step, then e ← β·e on the residuals this round committed, so that the next
        round sends C(Δ + β·e): the paper's e ← β·e + Δ, with the decay applied once per applied
        round (a dropped round leaves the residuals exactly as they were)."""
        super()._outer_step()
        if self.beta != 1.0:
            self.compression.memory.rescale(self.beta)

    def _mode_setup(self):
        return {"form": self.form, "beta": self.beta}

    def describe(self):
        return {**super().describe(), "form": self.form, "beta": self.beta}
