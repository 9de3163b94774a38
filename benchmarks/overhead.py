#!/usr/bin/env python
"""Per-step overhead at realistic tensor counts: hvdcomp against stock Horovod, side by side; where
the per-tensor time goes (cProfile); and two checkouts against each other.

Launch under ``mpirun`` (one process per rank), e.g.::

    mpirun -np 2 python benchmarks/overhead.py --models stack transformer resnet --output DIR
    mpirun -np 2 python benchmarks/overhead.py --profile hvdcomp:none --models stack --steps 5 --top 8
    python benchmarks/overhead.py --ab /work/base . --np 2 --pairs 4 --rounds 2 --models stack --output DIR

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
Horovod's, measured in the same run. Writes ``DIR/overhead.json`` (settings, environment, every
sample) and prints a markdown table.

``--profile CONTENDER``: rank 0's cProfile (the standard library's deterministic profiler) over
``--steps`` steps of the first ``--models`` model after ``--warmup`` ones; prints the profiled
seconds and calls per step and per tensor and the functions with the most internal time
(``--sort``, ``--top``, ``--package-only``). cProfile inflates Python-heavy code: compare profiles
with each other, not with unprofiled step times; call counts (``--sort ncalls``) do not depend on
the machine's load. ``hvdcomp`` is imported from ``PYTHONPATH`` when set there (profile an older
checkout side by side).

``--ab A B`` (not under ``mpirun``): this benchmark of checkout A, then of B, then A again, ...
(``--pairs`` pairs, alternating which goes first), each under ``mpirun -np NP`` with the launch
environment of ``hvdcomp/mpi.env``, recording the machine's state before and after every run
(:mod:`hygiene`); a run that started on a loaded machine is kept but marked and left out of the
table. Prints per model and contender the median over clean runs of each run's median step, A and B
and B / A, and writes every sample to ``DIR/overhead_ab.json``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# this checkout's hvdcomp, unless PYTHONPATH names another (--profile of an older checkout side by side)
sys.path.insert(len(sys.path) if os.environ.get("PYTHONPATH") else 0, ROOT)
import hvdcomp  # noqa: E402
from hvdcomp.launch import MPI_ENV, recorded_env  # noqa: E402

sys.path.insert(0, HERE)
import bench_models  # noqa: E402
import hygiene  # noqa: E402
import peers  # noqa: E402

DEFAULT_CONTENDERS = ["local", "horovod:none", "hvdcomp:none", "hvdcomp:topk:density=0.01",
                      "hvdcomp:powersgd:rank=2", "hvdcomp:qsgd:levels=16", "hvdcomp:fp16"]
PACKAGE = os.sep + "hvdcomp" + os.sep


# ---- models (defined in bench_models.py, shared with e2e_lm.py) ------------------------------
def build(name: str, args, rank: int) -> Tuple[torch.nn.Module, Callable[[torch.nn.Module, int], torch.Tensor]]:
    """(model, loss(model, step)) with rank-dependent data drawn from a fixed generator."""
    torch.manual_seed(0)
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(bench_models.MODELS), choices=bench_models.MODELS)
    p.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS)
    p.add_argument("--steps", type=int, default=5, help="timed (or profiled) steps per contender per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over the contenders (per run, with --ab)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stack-blocks", type=int, default=200)
    p.add_argument("--output", default=None, help="directory for overhead.json (overhead_ab.json with --ab)")
    g = p.add_argument_group("--profile: cProfile of rank 0")
    g.add_argument("--profile", metavar="CONTENDER", default=None, help="horovod:none or hvdcomp:<spec>[@bucket]")
    g.add_argument("--top", type=int, default=15, help="functions listed")
    g.add_argument("--sort", choices=("tottime", "cumulative", "ncalls"), default="tottime",
                   help="order of the listed functions (cumulative: with the time of what they call; "
                        "ncalls: most often called first)")
    g.add_argument("--package-only", action="store_true",
                   help="list only functions in hvdcomp's (or horovod's, for horovod:none) files")
    g = p.add_argument_group("--ab: two checkouts, interleaved")
    g.add_argument("--ab", nargs=2, metavar=("A", "B"), default=None, help="the checkouts' directories")
    g.add_argument("--pairs", type=int, default=4, help="A/B pairs of runs")
    g.add_argument("--np", type=int, default=2, help="ranks of each run")
    g.add_argument("--python", default=sys.executable)
    g.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for a quiet machine per run")
    args = p.parse_args(argv)
    if args.ab and args.profile:
        p.error("--ab and --profile are two different runs: give one")
    if args.ab and not args.output:
        p.error("--ab needs --output DIR")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.ab:
        return ab(args)
    from mpi4py import MPI  # first: MPI starts with MPI_THREAD_MULTIPLE before Horovod attaches
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    comm = MPI.COMM_WORLD
    if args.profile:
        return profile(args, comm.Get_rank())
    before = comm.bcast(hygiene.machine_state() if comm.Get_rank() == 0 else None, root=0)
    results: Dict[str, Dict] = {}
    for model_name in args.models:
        runs = {}
        for c in args.contenders:
            model, loss_fn = build(model_name, args, comm.Get_rank())
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
        from mpi_scripts.results import write_json

        write_json(os.path.join(args.output, "overhead.json"), {
            "settings": vars(args), "ranks": comm.Get_size(), "host": platform.node(),
            "torch": torch.__version__, "hvdcomp": hvdcomp.__version__, "env": recorded_env(),
            "machine": {"before": before, "after": hygiene.machine_state(), "loaded": hygiene.is_loaded(before)},
            "load_average": os.getloadavg(), "models": results})
    return 0


# ---- --profile -------------------------------------------------------------------------------
def calls_from(stats: pstats.Stats, folder: str) -> int:
    """Calls (of Python functions and of built-ins such as torch operations) made by code in
    files under ``folder``: the work a package does itself, without the model's."""
    return sum(nc for *_, callers in stats.stats.values()
               for (filename, _, _), (_, nc, _, _) in callers.items() if folder in filename)


def profile(args, rank: int) -> int:
    """cProfile of rank 0 over ``--steps`` steps of ``--profile``'s contender (see the module)."""
    model, loss_fn = build(args.models[0], args, rank)
    opt = make_optimizer(args.profile, model)
    for s in range(args.warmup):
        step_once(opt, model, loss_fn, s)
    prof = cProfile.Profile()
    prof.enable()
    for s in range(args.steps):
        step_once(opt, model, loss_fn, args.warmup + s)
    prof.disable()
    if rank == 0:
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        print(f"{args.profile} (hvdcomp from {os.path.dirname(os.path.dirname(hvdcomp.__file__))}): "
              f"{stats.total_tt / args.steps * 1e3:.1f} ms profiled per step, "
              f"{stats.total_tt / args.steps / tensors * 1e6:.0f} µs per tensor ({tensors} tensors); "
              f"{stats.total_calls / args.steps:.0f} calls per step "
              f"({stats.total_calls / args.steps / tensors:.1f} per tensor), "
              f"{calls_from(stats, PACKAGE) / args.steps:.0f} of them made by hvdcomp's code")
        restriction = ("horovod" if args.profile.startswith("horovod") else PACKAGE.strip(os.sep) + os.sep,) \
            if args.package_only else ()
        stats.sort_stats(args.sort).print_stats(*restriction, args.top)
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()))
    return 0


# ---- --ab ------------------------------------------------------------------------------------
def ab_run(tree: str, args, out_dir: str) -> dict:
    """One benchmark run of checkout ``tree`` (its own benchmarks/overhead.py); its overhead.json
    plus the machine's state."""
    out_dir = os.path.abspath(out_dir)
    before = hygiene.wait_quiet(args.max_wait)
    cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none", args.python,
           os.path.join(tree, "benchmarks", "overhead.py"), "--models", *args.models, "--contenders",
           *args.contenders, "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--stack-blocks", str(args.stack_blocks), "--output", out_dir]
    # (the response cache holds every contender's tensor names, as it holds one model's in a real job)
    env = {**os.environ, **MPI_ENV, "HOROVOD_CACHE_CAPACITY": "16384", "PYTHONPATH": os.path.abspath(tree)}
    subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL, timeout=3600)
    after = hygiene.machine_state()
    with open(os.path.join(out_dir, "overhead.json")) as f:
        result = json.load(f)
    return {"tree": tree, "before": before, "after": after, "loaded": hygiene.is_loaded(before), "result": result}


def ab(args) -> int:
    """``--ab A B``: interleaved runs of both checkouts, and their table (see the module)."""
    runs: List[dict] = []
    for r in range(args.pairs):
        for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
            run = {**ab_run(args.ab[side == "b"], args, os.path.join(args.output, f"{side}{r}")), "side": side}
            runs.append(run)
            print(f"round {r} {side}: load {run['before']['load_1min']} -> {run['after']['load_1min']}"
                  f"{' (loaded: left out)' if run['loaded'] else ''}", flush=True)
    clean = [r for r in runs if not r["loaded"]]
    medians = [{model: {name: c["median_step_s"] for name, c in res["contenders"].items()}
                for model, res in r["result"]["models"].items()} for r in clean]
    table_ab, lines = {}, ["| model | contender | A step ms | B step ms | B / A |", "|---|---|---:|---:|---:|"]
    for model in args.models:
        for name in args.contenders:
            per = {s: [m[model][name] for r, m in zip(clean, medians) if r["side"] == s and name in m[model]]
                   for s in ("a", "b")}
            if not per["a"] or not per["b"]:
                continue
            a, b = statistics.median(per["a"]), statistics.median(per["b"])
            table_ab.setdefault(model, {})[name] = {"a_s": a, "b_s": b, "ratio": b / a, "a_runs": per["a"],
                                                    "b_runs": per["b"]}
            lines.append(f"| {model} | {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} |")
    loads = [r["before"]["load_1min"] for r in runs] + [r["after"]["load_1min"] for r in runs]
    summary = (f"{len(clean)} of {len(runs)} runs clean; load average {min(loads)}-{max(loads)} on "
               f"{runs[0]['before']['cores']} cores; others' CPU share before runs "
               f"{min(r['before']['others_cpu_share'] for r in runs):.2f}-"
               f"{max(r['before']['others_cpu_share'] for r in runs):.2f}")
    from mpi_scripts.results import write_json

    write_json(os.path.join(args.output, "overhead_ab.json"),
               {"args": vars(args), "runs": runs, "table": table_ab, "summary": summary})
    print("\n".join(lines))
    print(summary)
    return 0


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
    sys.exit(main())
