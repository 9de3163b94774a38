#!/usr/bin/env python
"""Per-step overhead of two checkouts of hvdcomp, side by side in one sitting (e.g. the commit
before a redesign and after it).

Runs ``benchmarks/overhead.py`` of checkout A, then of checkout B, then A again, ... (``--rounds``
pairs, alternating which goes first), each under ``mpirun -np N`` with the launch environment of
``hvdcomp/mpi.env``, and records the machine's state before and after every run
(:mod:`hygiene`: load average, the rest of the machine's CPU share); a run that started on a
loaded machine is kept but marked and left out of the table. Prints, per model and contender, the
median over clean runs of each run's median step (milliseconds) for A and B and their ratio, and
writes every sample to ``OUTPUT/overhead_ab.json``.

Example (two worktrees, the contenders of the architecture issue's check)::

    python benchmarks/overhead_ab.py --a /work/base --b . --np 2 --rounds 4 \\
        --models stack transformer --output runs/overhead-ab
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import hygiene  # noqa: E402
from hvdcomp.launch import MPI_ENV  # noqa: E402

DEFAULT_CONTENDERS = ["local", "horovod:none", "hvdcomp:none", "hvdcomp:fp16", "hvdcomp:topk:density=0.01",
                      "hvdcomp:topk:density=0.01@bucket", "hvdcomp:qsgd:levels=16", "hvdcomp:powersgd"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--a", required=True, help="checkout A (its benchmarks/overhead.py and hvdcomp)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="A/B pairs")
    p.add_argument("--models", nargs="+", default=["stack", "transformer"])
    p.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--inner-rounds", type=int, default=2, help="overhead.py's own --rounds per run")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for a quiet machine per run")
    p.add_argument("--output", required=True)
    return p.parse_args(argv)


def run_one(tree: str, args, out_dir: str) -> dict:
    """One overhead.py run of checkout ``tree``; its overhead.json plus the machine state."""
    out_dir = os.path.abspath(out_dir)
    before = hygiene.wait_quiet(args.max_wait)
    cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none", args.python,
           os.path.join(tree, "benchmarks", "overhead.py"), "--models", *args.models, "--contenders",
           *args.contenders, "--steps", str(args.steps), "--rounds", str(args.inner_rounds), "--output", out_dir]
    # (the response cache holds every contender's tensor names, as it holds one model's in a real job)
    env = {**os.environ, **MPI_ENV, "HOROVOD_CACHE_CAPACITY": "16384", "PYTHONPATH": os.path.abspath(tree)}
    subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL, timeout=3600)
    after = hygiene.machine_state()
    with open(os.path.join(out_dir, "overhead.json")) as f:
        result = json.load(f)
    return {"tree": tree, "before": before, "after": after, "loaded": hygiene.is_loaded(before), "result": result}


def medians(run: dict) -> Dict[str, Dict[str, float]]:
    """model -> contender -> median step seconds of one run."""
    return {model: {name: c["median_step_s"] for name, c in res["contenders"].items()}
            for model, res in run["result"]["models"].items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    runs: List[dict] = []
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for side in order:
            tree = getattr(args, side)
            run = run_one(tree, args, os.path.join(args.output, f"{side}{r}"))
            run["side"] = side
            runs.append(run)
            print(f"round {r} {side}: load {run['before']['load_1min']} -> {run['after']['load_1min']}"
                  f"{' (loaded: left out)' if run['loaded'] else ''}", flush=True)
    clean = [r for r in runs if not r["loaded"]]
    table = {}
    lines = ["| model | contender | A step ms | B step ms | B / A |", "|---|---|---:|---:|---:|"]
    for model in args.models:
        for name in args.contenders:
            per = {s: [medians(r)[model][name] for r in clean if r["side"] == s and name in medians(r)[model]]
                   for s in ("a", "b")}
            if not per["a"] or not per["b"]:
                continue
            a, b = statistics.median(per["a"]), statistics.median(per["b"])
            table.setdefault(model, {})[name] = {"a_s": a, "b_s": b, "ratio": b / a, "a_runs": per["a"],
                                                 "b_runs": per["b"]}
            lines.append(f"| {model} | {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} |")
    loads = [r["before"]["load_1min"] for r in runs] + [r["after"]["load_1min"] for r in runs]
    summary = (f"{len(clean)} of {len(runs)} runs clean; load average {min(loads)}-{max(loads)} on "
               f"{runs[0]['before']['cores']} cores; others' CPU share before runs "
               f"{min(r['before']['others_cpu_share'] for r in runs):.2f}-"
               f"{max(r['before']['others_cpu_share'] for r in runs):.2f}")
    with open(os.path.join(args.output, "overhead_ab.json"), "w") as f:
        json.dump({"args": vars(args), "runs": runs, "table": table, "summary": summary}, f, indent=1)
    print("\n".join(lines))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
