#!/usr/bin/env python
"""Per-step overhead at realistic tensor counts: hvdcomp against stock Horovod, side by side.

Launch under ``mpirun`` (one process per rank), e.g.::

    mpirun -np 2 python benchmarks/overhead.py --models stack transformer resnet --output DIR

Models (``--models``): ``stack`` (400 tensors), ``transformer`` (146), ``resnet`` (110) and ``lstm``
(9), with their synthetic data, as defined in ``bench_models.py``; each built identically on
every rank, each rank drawing its own data (generator seeded by rank and step).

Contenders (``--contenders``): ``local`` (the wrapped optimizer alone, no communication: the
compute-only reference), ``horovod:none`` (stock ``hvd.DistributedOptimizer``), and
``hvdcomp:<spec>`` (``hvdcomp.DistributedOptimizer``; append ``@bucket`` for
``granularity="bucket"`` where the optimizer offers it). Every contender trains its own copy of
the model (same initial weights) with SGD; rounds interleave the contenders (``--rounds`` rounds of
``--steps`` timed steps after ``--warmup`` untimed ones) so that they share the machine's state.
A step is ``zero_grad``, forward, backward, ``step()``, timed with ``time.perf_counter`` on each
rank; a step's time is the maximum over ranks. Reported per contender: the median step (seconds),
``overhead = median step − median local step``, overhead per tensor, and both as ratios to stock
Horovod's, measured in the same run.

Writes ``DIR/overhead.json`` (settings, environment, every sample) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

from mpi4py import MPI  # first: MPI starts with MPI_THREAD_MULTIPLE before Horovod attaches

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hvdcomp  # noqa: E402
from hvdcomp.launch import recorded_env  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402
import hygiene  # noqa: E402
import peers  # noqa: E402



# ---- models (defined in bench_models.py, shared with e2e_lm.py) ------------------------------
def build(name: str, args) -> Tuple[torch.nn.Module, Callable[[torch.nn.Module, int], torch.Tensor]]:
    """(model, loss(model, step)) with rank-dependent data drawn from a fixed generator."""
    torch.manual_seed(0)
    rank = MPI.COMM_WORLD.Get_rank()
    model = bench_models.make_model(name, stack_blocks=args.stack_blocks)

    def loss(m, step):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        return bench_models.loss(name, m, *bench_models.synthetic_batch(name, gen))
    return model, loss


# ---- contenders ------------------------------------------------------------------------------
def make_optimizer(contender: str, model: torch.nn.Module):
    import horovod.torch as hvd

    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if contender == "local":
        return sgd
    if contender == "horovod:none":
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    if contender.startswith("hvdcomp:"):
        spec, options = peers.hvdcomp_options(contender[len("hvdcomp:"):])
        return hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                            compression=spec, cost_model="off", **options)
    raise ValueError(f"unknown contender {contender!r}")


def step_once(opt, model, loss_fn, step) -> float:
    t0 = time.perf_counter()
    opt.zero_grad()
    loss_fn(model, step).backward()
    opt.step()
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(bench_models.MODELS), choices=bench_models.MODELS)
    p.add_argument("--contenders", nargs="+",
                   default=["local", "horovod:none", "hvdcomp:none", "hvdcomp:topk:density=0.01",
                            "hvdcomp:powersgd:rank=2", "hvdcomp:qsgd:levels=16", "hvdcomp:fp16"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stack-blocks", type=int, default=200)
    p.add_argument("--output", default=None, help="directory for overhead.json")
    args = p.parse_args(argv)

    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    comm = MPI.COMM_WORLD
    before = comm.bcast(hygiene.machine_state() if comm.Get_rank() == 0 else None, root=0)
    results: Dict[str, Dict] = {}
    for model_name in args.models:
        runs = {}
        for c in args.contenders:
            model, loss_fn = build(model_name, args)
            runs[c] = (model, make_optimizer(c, model), loss_fn, [])
        tensors = sum(1 for q in next(iter(runs.values()))[0].parameters() if q.requires_grad)
        for c, (model, opt, loss_fn, _) in runs.items():
            for s in range(args.warmup):
                step_once(opt, model, loss_fn, s)
        for r in range(args.rounds):
            for c, (model, opt, loss_fn, samples) in runs.items():
                for s in range(args.steps):
                    mine = step_once(opt, model, loss_fn, args.warmup + r * args.steps + s)
                    samples.append(comm.allreduce(mine, op=MPI.MAX))
        local = statistics.median(runs["local"][3]) if "local" in runs else 0.0
        ref = runs.get("horovod:none")
        ref_step = statistics.median(ref[3]) if ref else None
        rows = {}
        for c, (_, _, _, samples) in runs.items():
            med = statistics.median(samples)
            rows[c] = {"median_step_s": med, "overhead_s": med - local,
                       "overhead_per_tensor_s": (med - local) / tensors, "samples_s": samples}
            if ref_step is not None:
                rows[c]["step_vs_horovod"] = med / ref_step
                rows[c]["overhead_vs_horovod"] = (med - local) / max(1e-12, ref_step - local)
        results[model_name] = {"tensors": tensors,
                               "parameters": sum(q.numel() for q in runs[args.contenders[0]][0].parameters()),
                               "contenders": rows}
        if comm.Get_rank() == 0:
            print("\n".join(table(model_name, results[model_name], comm.Get_size())), flush=True)
    if comm.Get_rank() == 0 and args.output:
        os.makedirs(args.output, exist_ok=True)
        info = {"settings": vars(args), "ranks": comm.Get_size(), "host": platform.node(),
                "torch": torch.__version__, "hvdcomp": hvdcomp.__version__,
                "env": recorded_env(),
                "machine": {"before": before, "after": hygiene.machine_state(),
                            "loaded": hygiene.is_loaded(before)},
                "load_average": os.getloadavg(), "models": results}
        with open(os.path.join(args.output, "overhead.json"), "w") as f:
            json.dump(info, f, indent=2)


def table(model: str, result: dict, ranks: int) -> List[str]:
    """Markdown table of one model's contenders (ratios against stock Horovod in the same run)."""
    lines = [f"### {model}: {result['tensors']} tensors, {ranks} ranks", "",
             "| contender | step (ms) | overhead (ms) | µs / tensor | step / Horovod | overhead / Horovod |",
             "|---|---:|---:|---:|---:|---:|"]
    for c, row in result["contenders"].items():
        ratio = row.get("overhead_vs_horovod")
        ref = result["contenders"].get("horovod:none", {}).get("overhead_s", 0.0)
        shown = f"{ratio:.2f}" if ratio is not None and ref > 0 else "–"
        lines.append(f"| {c} | {1e3 * row['median_step_s']:.1f} | {1e3 * row['overhead_s']:.1f} | "
                     f"{1e6 * row['overhead_per_tensor_s']:.0f} | {row.get('step_vs_horovod', float('nan')):.2f} | "
                     f"{shown} |")
    return lines + [""]


if __name__ == "__main__":
    main()
