#!/usr/bin/env python
"""Step time of hvdcomp's DDP front-end against DDP's built-in hooks and against hvdcomp's Horovod
front-end (issue 35), on emulated links, then one table.

One sitting, 4 ranks (one per emulated host), 100 Mbit/s and 10 Mbit/s links
(``../shared/tools/netem_mpi.sh`` through :mod:`netem_e2e`), the medium LSTM language model and the
transformer encoder of ``bench_models``, every contender of :data:`CONTENDERS`:

* DDP without a hook, with ``fp16_compress_hook``, with ``powerSGD_hook`` (rank 2, 2 plain steps,
  error feedback, warm start, ``min_compression_rate`` 2: ``benchmarks/e2e_lm.py``);
* hvdcomp top-k 1 %, DGC 1 % and PowerSGD (the same settings as DDP's) through the DDP front-end
  (``hvdcomp-ddp:<spec>``, :mod:`hvdcomp.ddp`) and through the Horovod front-end (``hvdcomp:<spec>``).

Writes ``OUT/<model>/cells/<rate>/*.json`` (one :mod:`e2e_lm` result per cell, resumable: finished
cells are kept), then ``mpi_scripts/report.py ddp-hooks``'s ``OUT/report.md``: the median step per
contender and rate, and the issue's targets.
Needs root (network namespaces). Run it on a quiet machine: the figures are seconds.

Example::

    python benchmarks/ddp_hooks.py --output docs/results/ddp-hooks
    python mpi_scripts/report.py ddp-hooks --output docs/results/ddp-hooks   # the report alone
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from netem_e2e import DEFAULT_NETEM, DEFAULT_PYTHON  # noqa: E402  (first: it puts the project on sys.path)

POWERSGD = "powersgd:matrix_rank=2,start_step=2,min_compression_rate=2"  # = e2e_lm's powerSGD_hook settings
METHODS = ["topk:density=0.01", "dgc:density=0.01", POWERSGD]
BUILTIN = ["ddp:none", "ddp:fp16", "ddp:powersgd"]
#: stock Horovod launched with Open MPI's ring allreduce (:func:`peers.launch_env`), Horovod's fastest
#: configuration in the LSTM study: issue 31 asks for the per-step verdicts against it from one sitting
RING = ["horovod-ring:none", "horovod-ring:fp16"]
CONTENDERS = BUILTIN + [f"hvdcomp-ddp:{m}" for m in METHODS] + [f"hvdcomp:{m}" for m in METHODS] + RING
MODELS = ["medium", "transformer"]
RATES = ["100mbit", "10mbit"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", default="runs/ddp-hooks", help="results directory")
    p.add_argument("--models", nargs="+", default=MODELS, choices=["small", "medium", "large", "transformer"])
    p.add_argument("--rates", nargs="+", default=RATES)
    p.add_argument("--contenders", nargs="+", default=CONTENDERS)
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell (100 Mbit/s)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per cell (PowerSGD compresses from step 2)")
    p.add_argument("--steps-slow", type=int, default=3, help="timed steps per cell at 10 Mbit/s")
    p.add_argument("--warmup-slow", type=int, default=3, help="warm-up steps per cell at 10 Mbit/s")
    p.add_argument("--python", default=DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else sys.executable)
    p.add_argument("--netem", default=DEFAULT_NETEM, help="path of netem_mpi.sh")
    p.add_argument("--dry-run", action="store_true", help="print the driver commands, run nothing")
    return p.parse_args(argv)


def driver_command(args, model: str):
    """The :mod:`netem_e2e` command for one model (every rate and contender)."""
    return [args.python, os.path.join(HERE, "netem_e2e.py"), "--output", os.path.join(args.output, model),
            "--model", model, "--rates", *args.rates, "--contenders", *args.contenders, "--np", "4",
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--steps-slow", str(args.steps_slow),
            "--warmup-slow", str(args.warmup_slow), "--slow-rates", "10mbit", "--compute-ref-steps", "0",
            "--netem", args.netem]


def main(argv=None) -> int:
    args = parse_args(argv)
    for model in args.models:
        cmd = driver_command(args, model)
        print(" ".join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=False)
    if args.dry_run:
        return 0
    from mpi_scripts import report

    return report.main(["ddp-hooks", "--output", args.output, "--models", *args.models, "--rates", *args.rates,
                        "--contenders", *args.contenders])


if __name__ == "__main__":
    sys.exit(main())
