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

Its report (time to the target perplexity, bytes per step, the issue's targets): ``python
mpi_scripts/report.py local --output OUTPUT`` (:mod:`mpi_scripts.report`).

The full grid (``benchmarks/README.md``, "Local-update training")::

    python benchmarks/netem_local.py --output runs/netem-local --rates 100mbit 10mbit --seeds 1 2 3
    python mpi_scripts/report.py local --output runs/netem-local
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from typing import Dict, List

import netem_e2e
import peers

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", default="runs/netem-local", help="results directory")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="lstm")
    p.add_argument("--rates", nargs="+", default=["100mbit", "10mbit"], help="link rates (none = unshaped)")
    p.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS)
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--np", nargs=1, type=int, default=[4], help="ranks (one per emulated host)")
    p.add_argument("--train-args", default="", help="extra train_lm.py arguments (one string)")
    p.add_argument("--data", default=None, help="corpus (default: Tiny Shakespeare)")
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
    if not args.dry_run and not os.path.exists(args.netem):
        p.error(f"--netem {args.netem} does not exist")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="[%(asctime)s netem_local] %(message)s", datefmt="%H:%M:%S")
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
