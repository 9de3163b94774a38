#!/usr/bin/env python
"""Compressed adaptive optimizers on the small transformer language model: bytes per step over
the whole run, time per step and perplexity after the same number of steps, per contender and
link rate (issue 33).

Every cell is one ``mpi_scripts/train_lm.py`` run (``--arch transformer --model small``, Tiny
Shakespeare, ``--epochs`` passes; the same global batch, learning rate, schedule (linear warm-up
over ``--lr-warmup`` steps, then constant) and number of steps for everyone) at ``--np`` ranks
(default 4):

* with link rates (``--rates 100mbit 10mbit``, the default) under ``../shared/tools/netem_mpi.sh``:
  one rank per emulated host, links shaped by tc (``benchmarks/netem_e2e.py``'s driver brings the
  hosts up, shapes them and tears them down on exit or signal);
* with ``--rates local``: plain ``mpirun`` on this machine, for byte counts and perplexity only
  (its times are not evidence on a shared machine).

Contenders (``--contenders``): ``adam`` (fp32 allreduce, the reference for bytes),
``adam-fp16-ring`` (Adam over Horovod's float16 allreduce, hvdcomp ``fp16``, launched with Open
MPI's ring allreduce, ``peers.RING_ALLREDUCE_ENV``), ``adam-topk`` (Adam over hvdcomp top-k 1 %, the
naive way: compressed gradients into Adam's second moment), ``onebit-adam`` (``--freeze-step``:
``--warmup-fraction`` of the steps) and ``zeroone-adam`` (``var_freeze_step`` the same,
``var_update_scaler`` 16, ``local_step_clipper`` 16 and ``local_step_scaler`` = var_freeze_step,
as the authors' BERT example sets them equal; override with ``--zeroone-args``). Not in the default
grid: ``onebit-adam-exact`` (1-bit Adam's schedule with the momentum averaged by a float32 allreduce:
Adam with the variance frozen at the same step; what 1-bit Adam loses against it is the
compression's cost, what it loses against ``adam`` the freeze's) and ``adam-ring``,
``onebit-adam-ring``, ``zeroone-adam-ring``: the same runs launched with Open MPI's ring allreduce
like ``adam-fp16-ring`` (their float32 allreduces, Adam's steps and the two methods' warm-up and
variance steps, otherwise use Open MPI's default algorithm, which is slower on these links; the
1-bit steps use all-to-all and allgather instead).

Writes ``OUTPUT/cells/<rate>/<contender>-s<seed>/results.json`` (train_lm's) and ``OUTPUT/table.md``
+ ``OUTPUT/table.json``: per rate and contender, over the seeds, bytes sent per step over the
whole run (mean over ranks; ``run_bytes``, every step), the ratio to ``adam``'s, seconds per step
(mean of train_lm's per-step wall time, first step excluded), validation and test perplexity
(mean and min-max over seeds), and the issue's targets met, missed or not judged (:func:`targets`).
Finished cells are kept; rerun the same command to resume (or with more ``--seeds``: the table
covers the seeds named). Each cell's ``run.json`` records the command line that ran it
(``invocation``); the table names those, so a ``--table-only`` rebuild keeps them (cells from
before they were recorded fall back to the current command line).

Example (the issue's grid: 2 rates x 5 contenders x 3 seeds)::

    python benchmarks/adaptive_lm.py --output docs/results/adaptive-optimizers/netem --seeds 1 2 3

and the untimed byte count on this machine::

    python benchmarks/adaptive_lm.py --rates local --output docs/results/adaptive-optimizers/local
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List

import hygiene
import netem_e2e
import peers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from hvdcomp.launch import MPI_ENV  # noqa: E402
from hvdcomp.lm.data import default_data_path  # noqa: E402
from mpi_scripts.results import read_json, summary, write_json  # noqa: E402
from mpi_scripts.report import spread_verdict  # noqa: E402  (the reports' one seed-spread verdict)

log = logging.getLogger("adaptive_lm")

CONTENDERS = ["adam", "adam-fp16-ring", "adam-topk", "onebit-adam", "zeroone-adam"]
#: not in the default grid: 1-bit Adam with the momentum averaged exactly (float32), frozen-variance Adam
#: and the float32 contenders under the ring allreduce that ``adam-fp16-ring`` gets
ABLATIONS = ["onebit-adam-exact", "adam-ring", "onebit-adam-ring", "zeroone-adam-ring"]
#: a contender named ``<base>-ring`` is launched with Open MPI's ring allreduce (:func:`contender_env`)
RING_SUFFIX = "-ring"


def contender_args(name: str, a) -> List[str]:
    """train_lm.py arguments that make ``name`` (the rest is common to every cell)."""
    freeze = max(1, round(a.warmup_fraction * a.steps))
    table = {
        "adam": ["--optimizer", "adam"],
        "adam-fp16-ring": ["--optimizer", "adam", "--compressor", "fp16"],
        "adam-topk": ["--optimizer", "adam", "--compressor", "topk:density=0.01"],
        "onebit-adam": ["--optimizer", "onebit-adam", "--freeze-step", str(freeze)],
        "onebit-adam-exact": ["--optimizer", "onebit-adam", "--freeze-step", str(freeze),
                              "--optimizer-args", "momentum_averaging=exact"],
        "zeroone-adam": ["--optimizer", "zeroone-adam", "--freeze-step", str(freeze), "--optimizer-args",
                         a.zeroone_args or f"var_update_scaler=16,local_step_scaler={freeze},local_step_clipper=16"],
    }
    base = name if name in table else name.removesuffix(RING_SUFFIX)
    if base not in table:  # a -ring contender is its base contender's run, under the ring
        raise ValueError(f"unknown contender {name!r}: one of {', '.join(table)}")
    return table[base]


def contender_env(name: str) -> Dict[str, str]:
    """What only this contender's ranks get: Open MPI's ring allreduce for the ``-ring`` ones."""
    return dict(peers.RING_ALLREDUCE_ENV) if name.endswith(RING_SUFFIX) else {}


def steps_per_epoch(data: str, batch_size: int, bptt: int = 35) -> int:
    """train_lm.py's optimizer steps per epoch for this corpus and global batch."""
    from hvdcomp.lm import batchify, load_corpus

    return len(range(0, batchify(load_corpus(data).train, batch_size).shape[0] - 1, bptt))


def invocation(argv: List[str] = None) -> str:
    """This benchmark's command line as run (``sys.argv`` by default), recorded with every cell."""
    return "python benchmarks/adaptive_lm.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))


def invocations(a) -> List[str]:
    """The distinct command lines that ran the table's cells (their ``run.json``, in table order);
    this one's where no cell recorded one (cells run before it was recorded, or none yet)."""
    seen: List[str] = []
    for rate in a.rates:
        for name in a.contenders:
            for s in a.seeds:
                run = read_json(os.path.join(a.output, "cells", rate, f"{name}-s{s}", "run.json"))
                cmd = (run or {}).get("invocation")
                if cmd and cmd not in seen:
                    seen.append(cmd)
    return seen or [invocation()]


def cell_args(name: str, seed: int, out_dir: str, a) -> List[str]:
    return [os.path.join(ROOT, "mpi_scripts", "train_lm.py"), "--arch", "transformer", "--model", "small",
            "--data", a.data, "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--anneal", "1",
            "--warmup-steps", str(a.lr_warmup), "--epochs", str(a.epochs), "--max-steps", str(a.epoch_steps),
            "--clip", str(a.clip), "--seed", str(seed), "--no-progress", "--output", out_dir, *contender_args(name, a)]


class Runner:
    """Runs the cells: under netem (``netem_e2e.Driver`` for the emulated hosts) or plain mpirun."""

    def __init__(self, args):
        self.args = args
        self.netem = None
        if any(r != "local" for r in args.rates):
            ns = argparse.Namespace(hosts=args.np, np=[args.np], python=args.python, netem=args.netem,
                                    netem_prefix=args.netem_prefix, netem_dir=None, env=[], output=args.output,
                                    bench="adaptive", exit_grace=60.0, mpirun_args="")
            self.netem = netem_e2e.Driver(ns)

    def command(self, rate: str, name: str, seed: int, out_dir: str) -> List[str]:
        env = {**contender_env(name)}
        if rate == "local":
            xs = [t for k, v in sorted(env.items()) for t in ("-x", f"{k}={v}")]
            return ["mpirun", "-np", str(self.args.np), "--oversubscribe", "--bind-to", "none", *xs,
                    self.args.python, *cell_args(name, seed, out_dir, self.args)]
        xs = [t for k in sorted(self.netem.cell_env) for t in ("-x", k)]
        xs += [t for k, v in sorted(env.items()) for t in ("-x", f"{k}={v}")]
        return ["bash", self.args.netem, "mpirun", "-n", str(self.args.np), *xs, "--", self.args.python,
                *cell_args(name, seed, out_dir, self.args)]

    def run_cell(self, rate: str, name: str, seed: int) -> dict:
        out_dir = os.path.join(self.args.output, "cells", rate, f"{name}-s{seed}")
        results = os.path.join(out_dir, "results.json")
        if os.path.exists(results) and not self.args.force:
            log.info("skip %s/%s seed %d (done; --force to rerun)", rate, name, seed)
            return {"status": "ok", "command": None}
        os.makedirs(out_dir, exist_ok=True)
        cmd = self.command(rate, name, seed, out_dir)
        log.info("cell %s/%s seed %d: %s", rate, name, seed, " ".join(map(shlex.quote, cmd)))
        log_path = os.path.join(out_dir, "train.log")
        if rate == "local":
            env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT}
            t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            with open(log_path, "w") as logf:
                proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=logf, stderr=subprocess.STDOUT, env=env,
                                        cwd=ROOT, start_new_session=True)
                try:
                    rc = proc.wait(timeout=self.args.timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the ranks, waited for by mpirun)
            run = {"returncode": rc, "elapsed_s": time.perf_counter() - t0,
                   "cpu_s": cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime}
            write_json(os.path.join(out_dir, "run.json"), {"command": cmd, "invocation": invocation(), **run})
        else:
            env = {**self.netem.base_env(), **self.netem.netem_env, "NETEM_TIMEOUT": str(int(self.args.timeout))}
            limit = self.args.load_limit or None
            before = hygiene.wait_quiet(self.args.max_wait_quiet, log=log.warning, limit=limit)
            run = self.netem.launch(cmd, env, results, log_path, self.args.timeout)
            run["machine"] = {"before": before, "after": hygiene.machine_state(), "loaded": hygiene.is_loaded(before, limit)}
            write_json(os.path.join(out_dir, "run.json"), {"command": cmd, "invocation": invocation(), **run})
        status = "ok" if os.path.exists(results) and run["returncode"] == 0 else "failed"
        if status != "ok":
            with open(log_path, errors="replace") as f:
                log.error("cell %s/%s seed %d failed: %s", rate, name, seed,
                          " | ".join(netem_e2e.error_lines(f.read())))
        return {"status": status, "command": " ".join(map(shlex.quote, cmd)), **run}

    def main(self) -> int:
        a, failed = self.args, 0
        if a.table_only:
            a.rates = [r for r in a.rates if os.path.isdir(os.path.join(a.output, "cells", r))]
            self.netem = None
            return self.write_table(0)
        try:
            if self.netem is not None:
                self.netem.bring_up()
            for rate in a.rates:
                if rate != "local":
                    self.netem.netem("shape", rate, timeout=60)
                for seed in a.seeds:
                    for name in a.contenders:
                        failed += self.run_cell(rate, name, seed)["status"] != "ok"
        finally:
            if self.netem is not None:
                self.netem.tear_down()
        return self.write_table(failed)

    def write_table(self, failed: int) -> int:
        a = self.args
        write_json(os.path.join(a.output, "table.json"), table(a))
        with open(os.path.join(a.output, "table.md"), "w") as f:
            f.write(markdown(a))
        log.info("done, %d failed; %s", failed, os.path.join(a.output, "table.md"))
        return 1 if failed else 0


def table(a) -> dict:
    """Per rate and contender, over the seeds found: bytes per step over the run, ratio to adam,
    seconds per step, perplexities."""
    out: Dict[str, dict] = {}
    for rate in a.rates:
        rows = {}
        for name in a.contenders:
            res = [read_json(os.path.join(a.output, "cells", rate, f"{name}-s{s}", "results.json"))
                   for s in a.seeds]
            res = [r for r in res if r]
            if not res:
                continue
            runs = [read_json(os.path.join(a.output, "cells", rate, f"{name}-s{s}", "run.json"))
                    for s in a.seeds]
            machines = [r["machine"] for r in runs if r and "machine" in r]
            steps = [sum(e["steps"] for e in r["epochs"]) for r in res]
            rows[name] = {
                "steps": steps[0],
                "bytes_per_step": summary([r["run_bytes"]["bytes_sent"]["mean"] / n for r, n in zip(res, steps)]),
                "dense_bytes_per_step": res[0]["run_bytes"]["dense_bytes"]["mean"] / steps[0],
                "seconds_per_step": summary([r["per_step"]["wall"]["mean"] for r in res]),
                "val_ppl": summary([r["epochs"][-1]["val_ppl"] for r in res]),
                "test_ppl": summary([r["test_ppl"] for r in res]),
                "seeds": len(res),
                "load_before": summary([m["before"]["load_1min"] for m in machines]),
                "loaded": sum(bool(m["loaded"]) for m in machines),
            }
        base = rows["adam"]["bytes_per_step"]["mean"] if "adam" in rows else None
        for row in rows.values():
            row["ratio_vs_adam"] = base / row["bytes_per_step"]["mean"] if base else None
        out[rate] = rows
    return {"settings": {k: v for k, v in vars(a).items()}, "rates": out}


#: the issue's byte targets over the whole run, against Adam's fp32 allreduce
BYTE_TARGETS = {"onebit-adam": 4.0, "zeroone-adam": 15.0}


def targets(rows: Dict[str, dict]) -> List[str]:
    """The issue's targets at one rate, met / missed / not judged: bytes per step over the whole
    run ≥ :data:`BYTE_TARGETS` times fewer than ``adam``'s, and a validation perplexity within
    Adam's seed spread, read one-sided (a mean no worse than Adam's by more than Adam's range over
    seeds; a lower perplexity meets it; with one Adam seed there is no spread: not judged)."""
    adam = rows.get("adam")
    if adam is None:
        return []
    lines = []
    for name, need in BYTE_TARGETS.items():
        row = rows.get(name)
        if row is None:
            continue
        ratio = row["ratio_vs_adam"]
        ppl, ref = row["val_ppl"], adam["val_ppl"]
        spread, verdict = spread_verdict(ppl["mean"], ref, "adam")
        lines.append(f"- {name}: >= {need:g}x fewer bytes than adam fp32 over the run ({ratio:.1f}x): "
                     f"{'met' if ratio >= need else 'missed'}; val ppl {ppl['mean']:.1f} within adam's "
                     f"{ref['mean']:.1f} + its seed spread ({spread:.1f}): {verdict}")
    return lines


def markdown(a) -> str:
    t = table(a)
    lines = [f"# Compressed adaptive optimizers, small transformer LM, {a.np} ranks, {a.steps} steps",
             "", *[f"Command: `{c}`" for c in invocations(a)], ""]
    for rate, rows in t["rates"].items():
        lines += [f"## {rate}" + (" (plain mpirun on one machine: times are not evidence)" if rate == "local" else ""),
                  "", "| contender | bytes/step (whole run) | vs adam fp32 | s/step | val ppl (min-max) | test ppl "
                  "| seeds |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            ppl = r["val_ppl"]
            ratio = "n/a" if r["ratio_vs_adam"] is None else f"{r['ratio_vs_adam']:.1f}x"
            lines.append(f"| {name} | {r['bytes_per_step']['mean'] / 1e3:.1f} KB | "
                         f"{ratio} | {r['seconds_per_step']['mean']:.3f} | "
                         f"{ppl['mean']:.1f} ({ppl['min']:.1f}-{ppl['max']:.1f}) | {r['test_ppl']['mean']:.1f} | "
                         f"{r['seeds']} |")
        loads = [x for r in rows.values() if r["load_before"] for x in (r["load_before"]["min"], r["load_before"]["max"])]
        if loads:
            lines.append(f"\n1-minute load average before each cell: {min(loads):.2f}-{max(loads):.2f}; cells "
                         f"started on a loaded machine (above the core count): "
                         f"{sum(r['loaded'] for r in rows.values())}.")
        verdicts = targets(rows)
        if verdicts:
            lines += ["", *verdicts]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", default="runs/adaptive-lm")
    p.add_argument("--rates", nargs="+", default=["100mbit", "10mbit"], help="link rates, or 'local' (no netem)")
    p.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS + ABLATIONS)
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--np", type=int, default=4, help="ranks (one per emulated host)")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training text per run")
    p.add_argument("--max-steps", type=int, default=0, help="cap on steps per epoch (0: whole epochs)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences of 35 tokens)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.25,
                   help="train_lm.py's gradient-norm clip; after the warm-up it clips each rank's own gradient "
                        "(docs/adaptive-optimizers.md), during it and for Adam the average")
    p.add_argument("--lr-warmup", type=int, default=0, help="linear learning-rate warm-up steps (0: 10 %% of --steps)")
    p.add_argument("--warmup-fraction", type=float, default=0.15,
                   help="1-bit Adam's freeze_step and 0/1 Adam's var_freeze_step, as a fraction of --steps")
    p.add_argument("--zeroone-args", default="", help="0/1 Adam's --optimizer-args (default: see the docstring)")
    p.add_argument("--data", default=default_data_path(), help="corpus (default: Tiny Shakespeare; HVDCOMP_DATA)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per cell")
    netem_e2e.add_quiet_arguments(p)  # (emulated links; the load goes into each cell's run.json and the table)
    p.add_argument("--force", action="store_true", help="rerun finished cells")
    p.add_argument("--table-only", action="store_true", help="only rebuild OUTPUT/table.md from finished cells")
    p.add_argument("--netem", default=netem_e2e.DEFAULT_NETEM)
    p.add_argument("--netem-prefix", default="hvdadapt")
    p.add_argument("--python", default=netem_e2e.DEFAULT_PYTHON if os.path.exists(netem_e2e.DEFAULT_PYTHON)
                   else sys.executable)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    if a.epochs < 1 or a.max_steps < 0:
        p.error("--epochs must be >= 1 and --max-steps >= 0")
    if not 0 < a.warmup_fraction < 1:
        p.error("--warmup-fraction must be in (0, 1)")
    natural = steps_per_epoch(a.data, a.batch_size)
    a.epoch_steps = min(natural, a.max_steps) if a.max_steps else natural
    a.steps = a.epochs * a.epoch_steps  # every run takes exactly these optimizer steps
    a.lr_warmup = a.lr_warmup or max(1, a.steps // 10)
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="[%(asctime)s adaptive_lm] %(message)s", datefmt="%H:%M:%S")
    if any(r != "local" for r in args.rates) and os.geteuid() != 0 and not args.table_only:
        log.error("netem_mpi.sh needs root (network namespaces, tc); use --rates local without it")
        return 2

    def on_signal(signum, _frame):
        raise netem_e2e.Interrupted(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return Runner(args).main()
    except (netem_e2e.Interrupted, KeyboardInterrupt) as e:
        log.error("interrupted (%s): rerun the same command to resume", e or "SIGINT")
        return 130


if __name__ == "__main__":
    sys.exit(main())
