"""hvdcomp.rebuild: the class a distributed optimizer derives from keeps what the user's optimizer
holds (``defaults``, constructor-set attributes, state; issue 57, item 6) instead of running the
class's constructor again with ``params`` only, and refuses ``add_param_group`` once built. Through
``hvdcomp.DistributedOptimizer`` and 1-bit LAMB's warm-up over Horovod:
tests/mpi/adaptive_optimizer_checks.py (``rebuilt_optimizer_keeps_its_arguments``,
``onebit_lamb_against_deepspeed_formulas``)."""
import pytest
import torch

from hvdcomp.adaptive_opt import Lamb
from hvdcomp.rebuild import keeping_class, template


class ScaledSGD(torch.optim.SGD):
    """SGD whose step multiplies each gradient by ``scale``, an attribute outside the groups."""

    def __init__(self, params, lr=1e-3, scale=1.0):
        super().__init__(params, lr=lr)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.scale)
        return super().step(closure)


def horovod_rebuild(base, optimizer):
    """What Horovod's factory does with ``base`` as the class to derive from: a new subclass,
    built from the parameter groups alone."""
    return type(type(optimizer).__name__, (base,), {})(optimizer.param_groups)


def test_constructor_attributes_and_defaults_survive_the_rebuild():
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    user = ScaledSGD([x], lr=0.5, scale=3.0)
    stock = horovod_rebuild(type(user), user)  # the cause: the constructor's defaults come back
    assert stock.scale == 1.0 and stock.defaults["lr"] == 1e-3
    opt = horovod_rebuild(keeping_class(user), user)
    assert opt.scale == 3.0 and opt.defaults == user.defaults and opt.defaults["lr"] == 0.5
    assert isinstance(opt, ScaledSGD) and type(opt).__name__ == "ScaledSGD"
    assert opt.param_groups[0]["params"][0] is x and opt.param_groups[0] is user.param_groups[0]
    x.grad = torch.tensor([0.25, 1.0])
    opt.step()
    assert torch.equal(x.detach(), torch.tensor([1.0 - 0.5 * 3 * 0.25, -2.0 - 0.5 * 3 * 1.0]))


def test_lamb_keeps_freeze_step_and_coeff_beta():
    x = torch.nn.Parameter(torch.ones(3))
    user = Lamb([x], lr=0.1, freeze_step=20, coeff_beta=0.5)
    assert (horovod_rebuild(type(user), user).freeze_step, horovod_rebuild(type(user), user).coeff_beta) == (1, 0.9)
    opt = horovod_rebuild(keeping_class(user), user)
    assert (opt.freeze_step, opt.coeff_beta) == (20, 0.5)


def test_state_the_constructor_filled_is_kept():
    """Adagrad fills its sums in its constructor from its argument (not from the groups): stock's
    rebuild restarts them at 0, the kept state holds 0.3."""
    x = torch.nn.Parameter(torch.zeros(2))
    user = torch.optim.Adagrad([x], lr=0.5, initial_accumulator_value=0.3)
    assert torch.equal(horovod_rebuild(type(user), user).state[x]["sum"], torch.zeros(2))
    opt = horovod_rebuild(keeping_class(user), user)
    assert torch.equal(opt.state[x]["sum"], torch.full((2,), 0.3))
    x.grad = torch.tensor([0.4, 0.0])
    opt.step()  # sum = 0.3 + 0.16 = 0.46; x -= 0.5 * 0.4 / (sqrt(0.46) + 1e-10)
    torch.testing.assert_close(x.detach(), torch.tensor([-0.2 / 0.46 ** 0.5, 0.0]))


class Required(torch.optim.SGD):
    """A constructor with a required argument besides ``params``."""

    def __init__(self, params, lr, tag):
        super().__init__(params, lr=lr)
        self.tag = tag


def test_a_constructor_with_required_arguments_and_hooks_are_kept():
    x = torch.nn.Parameter(torch.zeros(1))
    user = Required([x], 0.1, "t")
    seen = []
    user.register_step_post_hook(lambda opt, args, kwargs: seen.append(type(opt).__name__))
    with pytest.raises(TypeError):
        horovod_rebuild(type(user), user)  # stock's rebuild calls Required(params)
    opt = horovod_rebuild(keeping_class(user), user)
    x.grad = torch.ones(1)
    opt.step()
    assert opt.tag == "t" and seen == ["Required"] and torch.equal(x.detach(), torch.tensor([-0.1]))


def test_add_param_group_refused_once_built_but_not_while_building():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    user = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.2}], lr=0.1)
    opt = horovod_rebuild(keeping_class(user), user)  # (the constructor adds two groups)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    with pytest.raises(ValueError, match="Add every group to the optimizer before wrapping it"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    assert len(opt.param_groups) == 2


def test_template_is_what_stock_horovod_reads():
    x = torch.nn.Parameter(torch.zeros(1))
    user = ScaledSGD([x], lr=0.5, scale=3.0)
    t = template(user)
    assert t.param_groups is user.param_groups and issubclass(t.__class__, ScaledSGD)
    rebuilt = type(t.__class__.__name__, (t.__class__,), {})(t.param_groups)  # hvd.DistributedOptimizer's recipe
    assert rebuilt.scale == 3.0
