#!/usr/bin/env python
"""Worker of ``benchmarks/netem_local.py``: one ``mpi_scripts/train_lm.py`` run (a whole training,
validation every epoch) under the driver's ``mpirun``, with the cell JSON the driver expects.

Usage (every rank)::

    python benchmarks/local_lm.py --contender C --output CELL.json <train_lm.py arguments>

train_lm.py writes ``CELL.d/results.json``; rank 0 then writes ``CELL.json``: ``status: "ok"``,
the contender, train_lm's results (``train_lm``), rank 0's launch environment (``env``) and whether
every rank had the same one (``env_same_on_all_ranks``; the driver checks it, ``driver.env_check``).
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    from mpi4py import MPI  # noqa: F401  (first: MPI_THREAD_MULTIPLE, for CO2's reduction thread)
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "mpi_scripts"))

import horovod.torch as hvd  # noqa: E402
import train_lm  # noqa: E402
from hvdcomp.launch import recorded_env  # noqa: E402
from mpi_scripts.results import read_json, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--contender", required=True)
    p.add_argument("--output", required=True, help="the cell's JSON")
    args, rest = p.parse_known_args(argv)  # (the rest is train_lm.py's)
    run_dir = args.output[:-len(".json")] + ".d" if args.output.endswith(".json") else args.output + ".d"
    train_lm.main([*rest, "--output", run_dir, "--no-progress"])
    envs = hvd.allgather_object(recorded_env(), name="local_lm.env")
    if hvd.rank() == 0:
        write_json(args.output, {"status": "ok", "contender": args.contender,
                                 "train_lm": read_json(os.path.join(run_dir, "results.json")),
                                 "env": envs[0], "env_same_on_all_ranks": all(e == envs[0] for e in envs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
