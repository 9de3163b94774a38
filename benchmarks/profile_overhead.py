#!/usr/bin/env python
"""Where the per-tensor time of one contender goes: cProfile of rank 0 over a few steps of the
many-tensor stack (benchmarks/overhead.py's ``stack`` model), under ``mpirun``::

    mpirun -np 2 python benchmarks/profile_overhead.py hvdcomp:none --steps 5

Prints the total profiled seconds per step and per tensor, and the functions with the most
internal time. cProfile (the standard library's deterministic profiler) is used for exact call
counts per step; it inflates Python-heavy code, so compare profiles with each other, not with
unprofiled step times. ``--sort ncalls`` lists the functions called most often instead and
prints the calls per step (function calls and torch operations counted by cProfile: a figure
that does not depend on the machine's load, unlike the seconds). ``hvdcomp`` is imported from ``PYTHONPATH`` when set there (profile an
older checkout side by side), else from this repository.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE before Horovod)

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import hvdcomp  # noqa: F401
except ImportError:  # pragma: no cover - run from a checkout without installing
    sys.path.append(os.path.dirname(HERE))
import hvdcomp  # noqa: E402

sys.path.insert(0, HERE)
import bench_models  # noqa: E402
import peers  # noqa: E402


PACKAGE = os.sep + "hvdcomp" + os.sep


def calls_from(stats: pstats.Stats, folder: str) -> int:
    """Calls (of Python functions and of built-ins such as torch operations) made by code in
    files under ``folder``: the work a package does itself, without the model's."""
    return sum(nc for *_, callers in stats.stats.values()
               for (filename, _, _), (_, nc, _, _) in callers.items() if folder in filename)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("contender", help="horovod:none or hvdcomp:<spec>[@bucket]")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", choices=("stack", "transformer", "resnet", "lstm"), default="stack",
                   help="one of benchmarks/overhead.py's models")
    p.add_argument("--blocks", type=int, default=200, help="the stack's blocks")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--sort", choices=("tottime", "cumulative", "ncalls"), default="tottime",
                   help="order of the listed functions (cumulative: with the time of what they call; "
                        "ncalls: most often called first)")
    p.add_argument("--package-only", action="store_true",
                   help="list only functions in hvdcomp's (or horovod's, for horovod:none) files")
    args = p.parse_args(argv)
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = bench_models.make_model(args.model, stack_blocks=args.blocks)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if args.contender == "horovod:none":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        spec, options = peers.hvdcomp_options(args.contender[len("hvdcomp:"):])
        opt = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                            compression=spec, cost_model="off", **options)
    gen = torch.Generator().manual_seed(hvd.rank())

    def step():
        opt.zero_grad()
        x, y = bench_models.synthetic_batch(args.model, gen)
        bench_models.loss(args.model, model, x, y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    if hvd.rank() == 0:
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        print(f"{args.contender} (hvdcomp from {os.path.dirname(os.path.dirname(hvdcomp.__file__))}): "
              f"{stats.total_tt / args.steps * 1e3:.1f} ms profiled per step, "
              f"{stats.total_tt / args.steps / tensors * 1e6:.0f} µs per tensor ({tensors} tensors); "
              f"{stats.total_calls / args.steps:.0f} calls per step "
              f"({stats.total_calls / args.steps / tensors:.1f} per tensor), "
              f"{calls_from(stats, PACKAGE) / args.steps:.0f} of them made by hvdcomp's code")
        restriction = ("horovod" if args.contender.startswith("horovod") else PACKAGE.strip(os.sep) + os.sep,) \
            if args.package_only else ()
        stats.sort_stats(args.sort).print_stats(*restriction, args.top)
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
