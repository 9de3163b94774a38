"""The user's optimizer rebuilt as a distributed one, keeping all it holds.

Horovod's recipe makes an instance of a new subclass of the user's optimizer class from its
parameter groups alone, ``cls(optimizer.param_groups, ...)``, which runs the class's constructor
again with ``params`` only: ``defaults``, attributes set outside the groups and state filled from
the constructor's arguments fall back to their defaults. :func:`keeping_class` gives both
factories a class whose ``__init__(params)`` builds the parameter groups (``torch.optim.Optimizer``'s
constructor) and then takes everything else the user's instance holds: ``defaults``, its
attributes, its ``state`` and its hooks. ``add_param_group`` is refused once built: the backward
hooks, names and plan cover the parameters given at construction.
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
