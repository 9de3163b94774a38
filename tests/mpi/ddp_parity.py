"""The DDP front-end (hvdcomp.ddp) against the Horovod front-end (hvdcomp.DistributedOptimizer),
side by side in the same processes: Horovod over MPI, torch.distributed over gloo, the same model,
inputs and settings, for every registered method and for the recipes.

Usage: MASTER_PORT=... mpirun -np N python tests/mpi/ddp_parity.py CHECK [CHECK ...]
  methods   every spec of recipes.SPECS and none: 3 steps; per step the averaged gradients, then
            the compressor state and the parameters after the update
  recipes   no_sync() accumulation (Horovod: backward_passes_per_step=2), clipping after backward,
            AMP with an overflow step, resume from a checkpoint (every rank, and rank 0 only), a
            parameter unused on some ranks (find_unused_parameters=True)

Bit-identical (torch.equal) wherever the arithmetic is the same. At 1 and 2 ranks it is: a sum of
two values is the same in either order, and the 1/N scaling of a mean is exact for N = 2 (Horovod
sums then scales; DDP's path scales then sums). At N > 2 Horovod's MPI allreduce and gloo's ring
add the ranks in different orders, so summed payloads (none, random-k values, fp16, PowerSGD's P
and Q, CLT-k's values) agree within float rounding, bounded here relative to the
tensor's largest entry (SUMMED); gathered payloads are aggregated from identical bytes in rank order and
stay bit-identical, as do gtopk and twophase (point-to-point messages).
Prints "OK <check> ..." on rank 0.
"""
import contextlib
import copy
import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import horovod.torch as hvd
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcomp
import hvdcomp.ddp

sys.path.insert(0, os.path.dirname(__file__))
from recipes import SPECS  # noqa: E402

ALL = ["none"] + SPECS
STEPS = 3
LR = 0.1
CAP_MB = 0.0001  # DDP buckets of ~100 bytes: several buckets once DDP has rebuilt them
#: where summation orders differ (N > 2), the bound per method on |difference| relative to each
#: tensor's largest magnitude, after three steps: float32 sums a few roundings of 2^-24 apart
#: (1e-5); float16 sums N - 1 roundings of 2^-11 (2^-8); PowerSGD's orthogonalisation of a
#: rank-1 P amplifies its float32 differences (1e-4, the bound the PowerSGD comparison with
#: PyTorch's hook uses). Sign votes are integers: exact in any order.
#: state not compared at N > 2: the residual of fp16 with error feedback *is* the float16 rounding
#: error, so two runs that differ by float16 rounding have residuals that differ by their own size
#: (gradients and parameters are compared, within SUMMED)
RESIDUAL_OF_ROUNDING = ("fp16:ef=true",)
SUMMED = {"none": 1e-5, "randomk": 1e-5, "fp16": 2.0 ** -8, "powersgd": 1e-4, "cltk": 1e-5}


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3))


class Branchy(torch.nn.Module):
    """An MLP with a side branch that rank 0 alone uses (a parameter unused on some ranks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        self.side = torch.nn.Linear(6, 3)

    def forward(self, x):
        out = self.body(x)
        return out + self.side(x) if hvd.rank() == 0 else out


def batch(step, n=8):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def loss_of(forward, step, scale=1.0):
    x, y = batch(step)
    return torch.nn.functional.mse_loss(forward(x), y) * scale


class HorovodFront:
    """The Horovod front-end's recipe steps."""

    name = "horovod"

    def __init__(self, model, spec, passes=1, scaler=None, **_):
        self.model = model
        self.opt = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                                named_parameters=model.named_parameters(), compression=spec,
                                                cost_model="off", backward_passes_per_step=passes,
                                                grad_scaler=scaler)
        self.compression = self.opt.compression
        self.forward = model

    def accumulating(self):
        return contextlib.nullcontext()

    def sync(self):
        self.opt.synchronize()

    def apply(self, scaler=None):
        with self.opt.skip_synchronize():
            return scaler.step(self.opt) if scaler is not None else self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)

    @property
    def skipped(self):
        return self.opt.skipped_steps


class DDPFront:
    """The DDP front-end's recipe steps."""

    name = "ddp"

    def __init__(self, model, spec, passes=1, scaler=None, find_unused=False):
        self.model = model
        self.ddp = DDP(model, bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=LR)
        self.hook = hvdcomp.ddp.register(self.ddp, spec, optimizer=self.opt, grad_scaler=scaler)
        self.compression = self.hook.compression
        self.forward = self.ddp

    def accumulating(self):
        return self.ddp.no_sync()

    def sync(self):
        pass

    def apply(self, scaler=None):
        return scaler.step(self.opt) if scaler is not None else self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "hook": self.hook.state_dict()}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])
        self.hook.load_state_dict(sd["hook"])

    @property
    def skipped(self):
        return self.hook.skipped_steps


# ---- comparison ----------------------------------------------------------------------------------
def compare(a, b, where, tol=None):
    """Nested equality of tensors / dicts / lists / numbers: bit for bit, or (``tol``) within
    ``tol`` of each tensor's largest magnitude."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, (where, a, b)
        if tol is None or not a.is_floating_point():
            assert torch.equal(a, b), (where, a, b)
        else:
            scale = max(a.abs().max().item() if a.numel() else 0.0, 1e-30)
            err = (a - b).abs().max().item() if a.numel() else 0.0
            assert err <= tol * scale, (where, err / scale, a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            compare(a[k], b[k], f"{where}.{k}", tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{where}[{i}]", tol)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def tol_for(spec):
    return SUMMED.get(spec.partition(":")[0]) if hvd.size() > 2 else None


# ---- checks ----------------------------------------------------------------------------------------
def check_methods(specs):
    """Every method: the same averaged gradients, compressor state and parameters, step by step."""
    for spec in specs:
        fronts = [HorovodFront(mlp(), spec), DDPFront(mlp(), spec)]
        tol = tol_for(spec)
        for step in range(STEPS):
            got = []
            for f in fronts:
                f.zero_grad()
                loss_of(f.forward, step).backward()
                f.sync()
                got.append(grads(f.model))
            compare(got[0], got[1], f"{spec} step {step} gradients", tol)
            for f in fronts:
                f.apply()
            if not (tol is not None and spec in RESIDUAL_OF_ROUNDING):
                compare(fronts[0].compression.state_dict(), fronts[1].compression.state_dict(),
                        f"{spec} step {step} state", tol)
            compare(weights(fronts[0].model), weights(fronts[1].model), f"{spec} step {step} parameters", tol)
        fronts[1].hook.detach()
        fronts[0].opt.close()
        if hvd.rank() == 0:
            print(f"OK methods {spec} ({'bit-identical' if tol is None else f'within {tol:g}'})", flush=True)


def recipe_accumulate(front_cls, spec):
    """Two backward passes per step: DDP's no_sync() for the first; Horovod's
    backward_passes_per_step=2."""
    f = front_cls(mlp(), spec, passes=2)
    for step in range(STEPS):
        f.zero_grad()
        with f.accumulating():
            loss_of(f.forward, 2 * step).backward()
        loss_of(f.forward, 2 * step + 1).backward()
        f.sync()
        f.apply()
    return weights(f.model), f.compression.state_dict(), f.skipped


def recipe_clip(front_cls, spec):
    """Clip the averaged gradient to norm 0.05 after backward, then step."""
    f = front_cls(mlp(), spec)
    for step in range(STEPS):
        f.zero_grad()
        loss_of(f.forward, step).backward()
        f.sync()
        torch.nn.utils.clip_grad_norm_(f.model.parameters(), 0.05)
        f.apply()
    return weights(f.model), f.compression.state_dict(), f.skipped


def recipe_amp(front_cls, spec):
    """GradScaler("cpu") from 2^10; step 1 overflows on rank 1 (loss × inf): skipped on every rank,
    compressor state as before it; the scale halves and the state follows it."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=100)
    f = front_cls(mlp(), spec, scaler=scaler)
    before = None
    for step in range(STEPS + 1):
        f.zero_grad()
        bad = step == 1 and hvd.rank() == 1
        scaler.scale(loss_of(f.forward, step, float("inf") if bad else 1.0)).backward()
        f.sync()
        scaler.unscale_(f.opt)
        if step == 1:
            before = copy.deepcopy(f.compression.state_dict())
        f.apply(scaler)
        if step == 1:  # the skipped step left no trace (before the next step rescales the state)
            compare(before, f.compression.state_dict(), f"{f.name} {spec} state after the overflow step")
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 9, scaler.get_scale()
    return weights(f.model), f.compression.state_dict(), f.skipped


def _save(f):
    buf = io.BytesIO()
    torch.save({"model": f.model.state_dict(), "front": f.state_dict()}, buf)
    return buf.getvalue()


def recipe_resume(front_cls, spec, everywhere=True):
    """Two steps, a checkpoint (every rank its own, or rank 0's only), a fresh model and front-end
    loading it, two more steps."""
    f = front_cls(mlp(), spec)
    for step in range(2):
        f.zero_grad()
        loss_of(f.forward, step).backward()
        f.sync()
        f.apply()
    blob = _save(f)
    if isinstance(f, DDPFront):
        f.hook.detach()
    else:
        f.opt.close()
    model = mlp(seed=7)  # other weights: the checkpoint must restore them
    if everywhere or hvd.rank() == 0:
        ck = torch.load(io.BytesIO(blob), weights_only=True)
        model.load_state_dict(ck["model"])
    if not everywhere:  # rank 0 loaded: its weights to every rank (DDP: at construction)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = front_cls(model, spec)
    if everywhere or hvd.rank() == 0:
        g.load_state_dict(ck["front"])
    if not everywhere and isinstance(g, HorovodFront):  # (DDP: the hook shares state at the first step)
        hvd.broadcast_optimizer_state(g.opt, root_rank=0)
    for step in range(2, 4):
        g.zero_grad()
        loss_of(g.forward, step).backward()
        g.sync()
        g.apply()
    shared = g.compression.shared_state()
    every = hvd.allgather_object(shared, name=f"shared.{g.name}.{spec}.{everywhere}")
    for other in every:  # what must be identical on every rank is (shared at the first step)
        compare(other, every[0], f"{g.name} {spec} shared state after resume")
    return weights(g.model), g.compression.state_dict(), g.skipped


def recipe_resume_rank0(front_cls, spec):
    return recipe_resume(front_cls, spec, everywhere=False)


def recipe_uninterrupted(front_cls, spec):
    """Four steps without a checkpoint (what recipe_resume on every rank must equal)."""
    f = front_cls(mlp(), spec)
    for step in range(4):
        f.zero_grad()
        loss_of(f.forward, step).backward()
        f.sync()
        f.apply()
    return weights(f.model), f.compression.state_dict(), f.skipped


def recipe_unused(front_cls, spec):
    """A side branch only rank 0 uses: zeros from the other ranks (Horovod sends zeros for an
    unused parameter; DDP with find_unused_parameters=True puts zeros in the bucket)."""
    f = front_cls(Branchy(), spec, find_unused=True)
    for step in range(STEPS):
        f.zero_grad()
        loss_of(f.forward, step).backward()
        f.sync()
        f.apply()
    return weights(f.model), f.compression.state_dict(), f.skipped


RECIPE_SPECS = ["topk:density=0.3", "qsgd:levels=4,block=8", "dgc:density=0.3", "fp16:ef=true",
                "powersgd:matrix_rank=1"]
STOCHASTIC = ("qsgd", "terngrad", "randomk")
RECIPES = {"accumulate": recipe_accumulate, "clip": recipe_clip, "amp": recipe_amp, "resume": recipe_resume,
           "resume-rank0": recipe_resume_rank0, "unused": recipe_unused}


def check_recipes(specs):
    for name, recipe in RECIPES.items():
        for spec in specs:
            if name == "unused" and spec.startswith(STOCHASTIC):
                # a rank that does not use a parameter: the Horovod front-end compresses it last (at
                # synchronize), the DDP front-end in the expected backward order, so a stochastic
                # method draws its numbers in another order there (equally valid, not equal)
                continue
            h = recipe(HorovodFront, spec)
            d = recipe(DDPFront, spec)
            tol = tol_for(spec)
            compare(h[0], d[0], f"{name} {spec} parameters", tol)
            compare(h[1], d[1], f"{name} {spec} state", tol)
            assert h[2] == d[2] == (1 if name == "amp" else 0), (name, spec, h[2], d[2])
            if name == "resume":
                compare(recipe_uninterrupted(DDPFront, spec)[0], d[0], f"resume {spec} = uninterrupted")
        if hvd.rank() == 0:
            print(f"OK recipes {name} {len(specs)} specs", flush=True)


def main():
    hvd.init()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    checks = sys.argv[1:] or ["methods", "recipes"]
    for check in checks:
        if check == "methods":
            check_methods(ALL)
        elif check == "recipes":
            check_recipes(RECIPE_SPECS)
        elif check.startswith("methods="):
            check_methods(check.partition("=")[2].split(";"))
        elif check.startswith("recipes="):
            check_recipes(check.partition("=")[2].split(";"))
        else:
            raise SystemExit(f"unknown check {check!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
