#!/usr/bin/env python
"""Local-update training against synchronous training on emulated links: time to the target
perplexity, bytes per step, final perplexity with its seed spread (issue 32's benchmark).

Each cell is one whole ``mpi_scripts/train_lm.py`` training (validation every epoch) of one
contender at one link rate and seed, 4 ranks on 4 emulated hosts (``../shared/tools/netem_mpi.sh``
through :class:`netem_e2e.Driver`: namespaces, tc-shaped links, per-cell timeouts, resume,
teardown on exit and signals). Contenders (``--contenders``):

* ``sync|<compressor>[@ring]``: synchronous hvdcomp training with that method per step;
  ``@ring`` launches with Open MPI's ring allreduce (:data:`peers.RING_ALLREDUCE_ENV`).
  ``sync|fp16@ring`` is the synchronous fp16 baseline: Horovod's allreduce of float16 gradients on
  the ring (hvdcomp's ``fp16``: the same 2 bytes per element through ``hvd.allreduce``, with a
  per-tensor scale agreed across ranks);
* ``<outer-spec>|<H>|<compressor>``: ``--local-steps H --outer-opt <outer-spec> --compressor
  <compressor>`` (e.g. ``diloco|32|topk:density=0.01``, ``co2|8|fp16``).

``--report`` (no runs, no root) summarizes the cells found: per rate and contender, the best
validation perplexity (mean, sample standard deviation and range over seeds), test perplexity,
bytes sent per step and their ratio to dense fp32 per step, seconds per step and per compute-only
part of a step, and the time to the target perplexity (``--target-factor`` × the best validation
perplexity of ``--baseline``, mean over its seeds at the same rate: the first epoch end at or below
it, seconds since training started), with the speed-ups over ``--baseline`` and ``--versus``
(where the reference missed the target on some seed, a lower bound: that seed's last epoch end
stands for its time; where the contender missed it and the reference did not, an upper bound, since
the contender's run ended before it got there), and the issue's targets met, missed or not judged. Writes
``OUTPUT/report.md`` and ``OUTPUT/report.json``.

The full grid (``benchmarks/README.md``, "Local-update training")::

    python benchmarks/netem_local.py --output runs/netem-local --rates 100mbit 10mbit --seeds 1 2 3
    python benchmarks/netem_local.py --output runs/netem-local --report
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import signal
import statistics
import sys
from typing import Dict, List, Optional

import netem_e2e
import peers
from mpi_scripts.results import read_json, summary, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("netem_local")

COMPRESSORS = ("none", "fp16", "topk:density=0.01")
DEFAULT_CONTENDERS = (["sync|fp16@ring", "sync|topk:density=0.01"]
                      + [f"{outer}|{h}|{c}" for outer in ("diloco", "co2") for h in (8, 32) for c in COMPRESSORS])

#: train_lm.py settings per workload: the seed study's schedule (study v2) for the LSTM; the
#: transformer with AdamW, where DiLoCo's defaults apply (inner AdamW, weight decay 0.1)
WORKLOADS = {
    "lstm": "--arch lstm --model small --lr 20 --epochs 15 --warmup-steps 29 --anneal 4 --min-improvement 0.01 "
            "--early-stop 2 --min-epochs 6",
    "transformer": "--arch transformer --model small --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip 1.0 "
                   "--epochs 15 --warmup-steps 29 --anneal 4 --min-improvement 0.01 --early-stop 2 --min-epochs 6",
}
#: rough seconds of compute per step of each workload at 4 ranks on the 2-core machine (timeouts)
COMPUTE_SECONDS = {"lstm": 1.5, "transformer": 4.5}
PARAMETERS = {"lstm": 1161600, "transformer": 1293800}
STEPS_PER_EPOCH = 29  # Tiny Shakespeare, global batch 256 x bptt 35


def split_contender(contender: str):
    """``"sync|fp16@ring"`` -> ``("sync", None, "fp16", True)``; ``"diloco|8|none"`` ->
    ``("diloco", 8, "none", False)``.

    Raises:
        ValueError: another form.
    """
    parts = contender.split("|")
    if parts[0] == "sync" and len(parts) == 2:
        spec, _, ring = parts[1].partition("@")
        if ring not in ("", "ring"):
            raise ValueError(f"bad contender {contender!r}: only @ring is known")
        return "sync", None, spec, bool(ring)
    if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) >= 1:
        return parts[0], int(parts[1]), parts[2], False
    raise ValueError(f"bad contender {contender!r}: use sync|<compressor>[@ring] or <outer-spec>|<H>|<compressor>")


def train_args(contender: str) -> List[str]:
    """train_lm.py arguments of a contender (on top of the workload's)."""
    outer, h, spec, _ = split_contender(contender)
    if outer == "sync":
        return ["--compressor", spec]
    return ["--local-steps", str(h), "--outer-opt", outer, "--compressor", spec]


class LocalDriver(netem_e2e.Driver):
    """:class:`netem_e2e.Driver` with train_lm.py runs (contender × seed) as cells."""

    def cells(self) -> List[dict]:
        a, out = self.args, []
        for rate in a.rates:
            for c in a.contenders:
                for seed in a.seeds:
                    wargs = [os.path.join(HERE, "local_lm.py"), "--contender", c,
                             *shlex.split(WORKLOADS[a.workload]), *train_args(c), "--seed", str(seed),
                             *shlex.split(a.train_args)]
                    if a.data:
                        wargs += ["--data", a.data]
                    out.append({"rate": rate, "np": a.np[0], "name": f"{netem_e2e.slug(c)}-seed{seed}",
                                "contender": c, "args": wargs, "slow": rate in a.slow_rates, "seed": seed})
        return out

    def timeout_for(self, cell: dict) -> float:
        """``--timeout``, else 3x an estimate: every epoch's steps at compute + the per-step
        share of the dense fp32 ring allreduce (an upper bound on what any contender sends)."""
        a = self.args
        if a.timeout:
            return a.timeout
        bps = netem_e2e.rate_bps(cell["rate"])
        n = cell["np"]
        dense = 0.0 if bps is None else 2 * (n - 1) / n * 4 * PARAMETERS[a.workload] * 8 / bps
        _, h, _, _ = split_contender(cell["contender"])
        per_step = COMPUTE_SECONDS[a.workload] + dense / (h or 1)
        return 600 + 3 * 15 * STEPS_PER_EPOCH * (per_step + COMPUTE_SECONDS[a.workload] / 10)

    def contender_env(self, cell: dict) -> Dict[str, str]:
        return dict(peers.RING_ALLREDUCE_ENV) if split_contender(cell["contender"])[3] else {}

    def check_env(self, res: dict, cell: dict) -> dict:
        """Every rank had CELL_ENV and this contender's own settings, and no other's."""
        env, want = res.get("env", {}), {**self.cell_env, **self.contender_env(cell)}
        missing = {k: v for k, v in want.items() if k != "PYTHONUNBUFFERED" and env.get(k) != v}
        foreign = {k: env[k] for k in peers.RING_ALLREDUCE_ENV if k in env and k not in want}
        ok = not missing and not foreign and res.get("env_same_on_all_ranks", False)
        return {"ok": ok, "missing_or_different": missing, "foreign": foreign,
                "same_on_all_ranks": res.get("env_same_on_all_ranks")}


# ---- the report ---------------------------------------------------------------------------------
def cell_summary(cell: dict) -> dict:
    """The figures of one finished cell (its train_lm results)."""
    r = cell["train_lm"]
    lu = r.get("local_update")
    steps = sum(e["steps"] for e in r["epochs"])
    sent = lu["bytes_sent_per_step"] if lu else r["per_step"]["bytes_sent"]["mean"]
    return {"best_val_ppl": r["best_val_ppl"], "test_ppl": r["test_ppl"], "bytes_sent_per_step": sent,
            "step_s": r["per_step"]["wall"]["mean"], "compute_s": r["per_step"]["compute"]["mean"],
            "parameters": r["config"]["parameters"], "steps": steps,
            "curve": [(e["elapsed_seconds"], e["val_ppl"]) for e in r["epochs"]],
            "hidden_s_per_step": (lu or {}).get("hidden_s_per_step"),
            "exposed_s_per_step": (lu or {}).get("exposed_s_per_step")}


def time_to(curve, target: float) -> Optional[float]:
    """Seconds at the first epoch end whose validation perplexity is <= ``target`` (None: never)."""
    return next((t for t, ppl in curve if ppl <= target), None)


def summarize(cells: List[dict], baseline: str, versus: str, target_factor: float) -> Dict[str, dict]:
    """``{rate: {contender: row}}`` from finished cells (see the module docstring)."""
    by: Dict[str, Dict[str, List[dict]]] = {}
    for cell in cells:
        if cell.get("status") == "ok":
            by.setdefault(cell["driver"]["rate"], {}).setdefault(cell["contender"], []).append(cell_summary(cell))
    out: Dict[str, dict] = {}
    for rate, contenders in by.items():
        base = contenders.get(baseline)
        target = target_factor * statistics.fmean(s["best_val_ppl"] for s in base) if base else None
        rows = {}
        for c, runs in contenders.items():
            ttt = [time_to(s["curve"], target) for s in runs] if target is not None else []
            reached = [t for t in ttt if t is not None]
            rows[c] = {"seeds": len(runs), "best_val_ppl": summary([s["best_val_ppl"] for s in runs]),
                       "test_ppl": summary([s["test_ppl"] for s in runs]),
                       "bytes_sent_per_step": statistics.fmean(s["bytes_sent_per_step"] for s in runs),
                       "ratio_vs_dense_fp32": statistics.fmean(4 * s["parameters"] / max(1.0, s["bytes_sent_per_step"])
                                                               for s in runs),
                       "step_s": statistics.fmean(s["step_s"] for s in runs),
                       "compute_s": statistics.fmean(s["compute_s"] for s in runs),
                       "time_to_target_s": statistics.fmean(reached) if len(reached) == len(runs) and runs else None,
                       "time_to_target_per_seed_s": ttt,
                       # a seed that never reached the target took longer than its whole run: its
                       # last epoch end is a lower bound, and so is this mean
                       "time_to_target_at_least_s": (statistics.fmean(
                           t if t is not None else s["curve"][-1][0] for t, s in zip(ttt, runs))
                           if ttt and all(s["curve"] for s in runs) else None),
                       "reached_target": f"{len(reached)}/{len(runs)}", "target_ppl": target}
            rows[c]["step_over_compute"] = rows[c]["step_s"] / max(1e-9, rows[c]["compute_s"])
        for c, row in rows.items():
            t, t_low = row["time_to_target_s"], row["time_to_target_at_least_s"]
            for ref, key in ((baseline, "speedup_vs_baseline"), (versus, "speedup_vs_versus")):
                t_ref = rows.get(ref, {}).get("time_to_target_s")
                t_ref_low = rows.get(ref, {}).get("time_to_target_at_least_s")
                row[key] = t_ref / t if t and t_ref else None
                # where the reference missed the target on some seed: a lower bound on the speed-up
                # (needs this contender's exact time, i.e. every seed of it reached the target)
                row[key + "_at_least"] = t_ref_low / t if t and t_ref_low and row[key] is None else None
                # where this contender missed it and the reference did not: its time is above its
                # lower bound, so the speed-up is below the reference's time over it (an upper bound)
                row[key + "_at_most"] = t_ref / t_low if t is None and t_ref and t_low else None
        out[rate] = rows
    return out


def speedup_verdict(rows: Dict[str, dict], contender: str, key: str, clears, ref: str):
    """``(figure, verdict)`` of one time-to-target target of ``contender`` against ``ref``
    (``clears``: the target as a predicate on the speed-up, increasing in it).

    Met or missed on the exact speed-up (``rows[contender][key]``, both reached the target on every
    seed). Where ``ref`` missed the target on some seed, met if the lower bound (``key +
    "_at_least"``) clears it, else not judged. Where ``contender`` missed it on some seed (its run
    ended first, so its time is only bounded below) and ``ref`` did not, missed if the upper bound
    (``key + "_at_most"``) does not clear it, else not judged: a longer run could still reach the
    target in time. Neither reached it on every seed: not judged."""
    row = rows[contender]
    exact, at_least, at_most = row[key], row[key + "_at_least"], row[key + "_at_most"]
    if exact is not None:
        return f"{exact:.1f}x", "met" if clears(exact) else "missed"
    if ref not in rows:
        return "n/a", f"not judged (no {ref} cell)"
    if row["time_to_target_s"] is None:
        if at_most is None:
            return "n/a", f"not judged (neither it nor {ref} reached the target on every seed)"
        return (f"at most {at_most:.2f}x", "not judged (its run ended before the target; a longer run "
                "could still clear it)" if clears(at_most) else "missed")
    if at_least is None:
        return "n/a", f"not judged (no time to the target for {ref})"
    missed = rows[ref]["seeds"] - int(rows[ref]["reached_target"].split("/")[0])
    return (f"at least {at_least:.1f}x", "met" if clears(at_least) else
            f"not judged ({ref} missed the target on {missed} of {rows[ref]['seeds']} seeds)")


def targets(rows: Dict[str, dict], baseline: str, rate: str, versus: str) -> List[str]:
    """The issue's targets, met, missed or not judged, for the local-update contenders at one rate
    (``versus``: the second time-to-target reference, synchronous top-k)."""
    base = rows.get(baseline)
    lines = []
    for c, row in rows.items():
        if c.startswith("sync|") or base is None:
            continue
        spread, verdict = netem_e2e.spread_verdict(row["best_val_ppl"]["mean"], base["best_val_ppl"], "the baseline")
        ok_bytes = row["ratio_vs_dense_fp32"] >= 100
        lines.append(f"- {c}: final perplexity {row['best_val_ppl']['mean']:.1f} no worse than the baseline's "
                     f"{base['best_val_ppl']['mean']:.1f} + its seed spread ({spread:.1f}): {verdict}; "
                     f">= 100x fewer bytes per step than dense fp32 "
                     f"({row['ratio_vs_dense_fp32']:.0f}x): {'met' if ok_bytes else 'missed'}")
        if rate == "10mbit":
            lines.append(f"  step within 1.1x of its compute ({row['step_over_compute']:.2f}x): "
                         f"{'met' if row['step_over_compute'] <= 1.1 else 'missed'}")
        f1, v1 = speedup_verdict(rows, c, "speedup_vs_baseline", lambda x: x >= 5, baseline)
        f2, v2 = speedup_verdict(rows, c, "speedup_vs_versus", lambda x: x > 1, versus)
        if rate == "10mbit":
            lines.append(f"  time to target >= 5x less than the baseline ({f1}): {v1}; "
                         f"less than synchronous top-k ({f2}): {v2}")
        else:  # the issue sets its step and time targets for the 10 Mbit/s link
            lines.append(f"  speed-up to the target over the baseline: {f1}, over synchronous top-k: {f2} "
                         f"(no verdict: the time targets are for 10 Mbit/s)")
    return lines


def report_markdown(summary: Dict[str, dict], baseline: str, versus: str) -> str:
    def fmt(x, spec=".1f"):
        return "—" if x is None else format(x, spec)

    lines = ["# Local-update training on emulated links", ""]
    for rate, rows in sorted(summary.items()):
        target = next(iter(rows.values()))["target_ppl"]
        lines += [f"## {rate} (target perplexity {fmt(target)}: {baseline}'s best x factor)", "",
                  "| contender | seeds | best val ppl (mean ± sd, range) | test ppl | KB sent/step | x fewer than fp32 "
                  "| s/step | step/compute | time to target (s) | per seed (s) | reached | vs baseline | vs " + versus + " |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c, r in rows.items():
            v = r["best_val_ppl"]
            lines.append(f"| {c} | {r['seeds']} | {fmt(v['mean'])} ± {fmt(v['std'])} ({fmt(v['min'])}–{fmt(v['max'])}) "
                         f"| {fmt(r['test_ppl']['mean'])} | {fmt(r['bytes_sent_per_step'] / 1e3)} "
                         f"| {fmt(r['ratio_vs_dense_fp32'], '.0f')} | {fmt(r['step_s'], '.2f')} "
                         f"| {fmt(r['step_over_compute'], '.2f')} | {fmt(r['time_to_target_s'], '.0f')} "
                         f"| {', '.join(fmt(t, '.0f') for t in r['time_to_target_per_seed_s'])} "
                         f"| {r['reached_target']} | {fmt(r['speedup_vs_baseline'], '.2f')} "
                         f"| {fmt(r['speedup_vs_versus'], '.2f')} |")
        lines += ["", *targets(rows, baseline, rate, versus), ""]
    return "\n".join(lines) + "\n"


def write_report(args) -> int:
    cells = []
    for rate in sorted(os.listdir(os.path.join(args.output, "cells"))):
        folder = os.path.join(args.output, "cells", rate)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                cell = read_json(os.path.join(folder, name))
                if cell is not None:
                    cells.append(cell)
    machines = [c.get("driver", {}).get("machine", {}) for c in cells]
    loaded = [c["driver"]["rate"] + "/" + c["contender"] for c, m in zip(cells, machines) if m.get("loaded")]
    loads = [m["before"]["load_1min"] for m in machines if (m.get("before") or {}).get("load_1min") is not None]
    rows = summarize([c for c, m in zip(cells, machines) if not m.get("loaded")],
                        args.baseline, args.versus, args.target_factor)
    write_json(os.path.join(args.output, "report.json"), rows)
    text = report_markdown(rows, args.baseline, args.versus)
    if loads:
        text += (f"\n1-minute load average before each cell: {min(loads):.2f}-{max(loads):.2f} "
                 f"({len(loads)} cells).\n")
    if loaded:
        text += f"Left out, started on a loaded machine: {', '.join(loaded)}.\n"
    with open(os.path.join(args.output, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", default="runs/netem-local", help="results directory")
    p.add_argument("--report", action="store_true", help="summarize the cells in --output (runs nothing)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="lstm")
    p.add_argument("--rates", nargs="+", default=["100mbit", "10mbit"], help="link rates (none = unshaped)")
    p.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS)
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--np", nargs=1, type=int, default=[4], help="ranks (one per emulated host)")
    p.add_argument("--train-args", default="", help="extra train_lm.py arguments (one string)")
    p.add_argument("--data", default=None, help="corpus (default: Tiny Shakespeare)")
    p.add_argument("--baseline", default="sync|fp16@ring", help="the target's and the first speed-up's reference")
    p.add_argument("--versus", default="sync|topk:density=0.01", help="the second speed-up's reference")
    p.add_argument("--target-factor", type=float, default=1.1, help="target = factor x baseline's best val ppl")
    p.add_argument("--slow-rates", nargs="*", default=[], help="(kept for the driver; unused)")
    p.add_argument("--mpirun-args", default="", help="extra mpirun options (one string)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=0, help="seconds per cell (0: estimated)")
    netem_e2e.add_quiet_arguments(p)
    p.add_argument("--attempts", type=int, default=1)
    p.add_argument("--exit-grace", type=float, default=120.0)
    p.add_argument("--tail-chars", type=int, default=6000)
    p.add_argument("--force", action="store_true")
    p.add_argument("--retry-failed", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--netem", default=netem_e2e.DEFAULT_NETEM)
    p.add_argument("--netem-prefix", default="hvdloc")
    p.add_argument("--netem-dir", default=None)
    p.add_argument("--python", default=netem_e2e.DEFAULT_PYTHON if os.path.exists(netem_e2e.DEFAULT_PYTHON)
                   else sys.executable)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    args.bench, args.hosts, args.worker_args, args.model = "local", 0, "", args.workload
    args.output = os.path.abspath(args.output)
    for c in args.contenders:
        try:
            split_contender(c)
        except ValueError as e:
            p.error(str(e))
    for r in args.rates:
        try:
            netem_e2e.rate_bps(r)
        except ValueError as e:
            p.error(str(e))
    if not args.report and not args.dry_run and not os.path.exists(args.netem):
        p.error(f"--netem {args.netem} does not exist")
    if not args.target_factor >= 1 or math.isnan(args.target_factor):
        p.error("--target-factor must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="[%(asctime)s netem_local] %(message)s", datefmt="%H:%M:%S")
    if args.report:
        return write_report(args)
    if os.geteuid() != 0 and not args.dry_run:
        log.error("netem_mpi.sh needs root (network namespaces, tc)")
        return 2
    driver = LocalDriver(args)

    def on_signal(signum, _frame):
        raise netem_e2e.Interrupted(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return driver.main()
    except (netem_e2e.Interrupted, KeyboardInterrupt) as e:
        log.error("interrupted (%s): namespaces torn down; rerun the same command to resume", e or "SIGINT")
        return 130


if __name__ == "__main__":
    sys.exit(main())
