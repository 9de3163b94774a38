"""The user's optimizer rebuilt as a distributed one, keeping all it holds.

Horovod's recipe, which :func:`hvdcomp.DistributedOptimizer` follows (and stock
``hvd.DistributedOptimizer`` runs for ``op=hvd.Adasum``), makes an instance of a new subclass of
the user's optimizer class from its parameter groups alone: ``cls(optimizer.param_groups, ...)``,
whose ``__init__`` runs the class's constructor again with ``params`` only. What the groups hold
(``lr``, ``betas``, ...) survives; everything else falls back to the constructor's defaults:
``defaults`` (a group added later would get the class's learning rate, not the user's), every
attribute the constructor sets outside the groups, and state it fills from its arguments. 1-bit
LAMB's warm-up ``Lamb``, built with ``freeze_step=20, coeff_beta=0.5``, ran with 1 and 0.9 (the
fresh variance copied at step 1, the factor after the warm-up climbing 1.1, 1.21, ... where
DeepSpeed's falls from 1.0); ``Adagrad(initial_accumulator_value=0.3)`` restarts its sums at 0.

:func:`keeping_class` is the one fix, for both factories: the class the distributed optimizer
derives from does not run the user's constructor again; its ``__init__(params)`` builds the
parameter groups (``torch.optim.Optimizer``'s constructor, over the same group dicts) and then
takes everything else the user's instance holds: ``defaults``, the attributes its constructor
set, its ``state`` (what the constructor filled, or a checkpoint loaded before wrapping: stock
Horovod starts from an empty one) and its hooks. Classes whose constructor needs more than
``params`` can be wrapped too. ``add_param_group`` is refused once built: the backward hooks,
names and compression plan cover the parameters given at construction, so a group added later
would never be averaged (stock Horovod lets it train on each rank's own gradient, silently).
"""
from __future__ import annotations

import torch

__all__ = ["keeping_class", "template"]


_BUILT = "_hvdcomp_parameters_fixed"

NEW_GROUP_REFUSED = ("a distributed optimizer averages the parameters it was built with (its backward hooks, "
                     "parameter names and compression plan cover those): a parameter group added afterwards "
                     "would train on each rank's own gradient. Add every group to the optimizer before "
                     "wrapping it (torch.optim.X([{...}, {...}]) or optimizer.add_param_group first), or build a "
                     "new distributed optimizer.")


def keeping_class(optimizer: torch.optim.Optimizer) -> type:
    """A subclass of ``type(optimizer)`` (same name and module) whose constructor ``(params)``
    builds the parameter groups from ``params`` and takes the rest of ``optimizer``'s instance
    (see the module docstring); ``add_param_group`` raises once it is built.

    Returns:
        The class, for ``type(name, (keeping_class(optimizer),), methods)`` as Horovod builds its
        distributed optimizers.
    """
    base = type(optimizer)
    kept = {k: v for k, v in vars(optimizer).items() if k != "param_groups"}

    def __init__(self, params):
        torch.optim.Optimizer.__init__(self, params, kept["defaults"])  # (the groups; not base's constructor)
        self.__dict__.update(kept)
        self.__dict__[_BUILT] = True

    def add_param_group(self, param_group) -> None:
        """Refused once built (see :mod:`hvdcomp.rebuild`).

        Raises:
            ValueError: after construction, naming the fix.
        """
        if self.__dict__.get(_BUILT):
            raise ValueError(NEW_GROUP_REFUSED)
        base.add_param_group(self, param_group)

    return type(base.__name__, (base,), {"__init__": __init__, "add_param_group": add_param_group,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__,
                                         "__doc__": base.__doc__})


class _Template:
    """What stock Horovod's ``hvd.DistributedOptimizer`` reads of the optimizer it wraps: its
    class (here :func:`keeping_class`'s) and its parameter groups."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._class, self.param_groups = keeping_class(optimizer), optimizer.param_groups

    @property
    def __class__(self):  # noqa: D401 - what Horovod's factory subclasses
        return self._class


def template(optimizer: torch.optim.Optimizer):
    """``optimizer`` as stock Horovod's factory should see it (:func:`keeping_class`), for the
    paths that hand the optimizer to ``hvd.DistributedOptimizer`` (Adasum)."""
    return _Template(optimizer)
