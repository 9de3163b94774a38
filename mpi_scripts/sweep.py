#!/usr/bin/env python
"""Run a grid of train_lm.py cells (methods x workers x models), one training run per cell.

The grid comes from a YAML file (see ``mpi_scripts/grids/study_small.yaml``) and/or the command
line. Every cell writes ``OUTPUT/cells/<model>-np<N>-<method>/results.json``; a cell whose
results file exists is not rerun, so an interrupted sweep resumes where it stopped. All cells share
the seed and hyper-parameters unless a method sets its own ``lr`` (recorded in the cell's config).

Example::

    python mpi_scripts/sweep.py mpi_scripts/grids/study_small.yaml --workers 1 2 4
    python mpi_scripts/report.py runs/study-small
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
log = logging.getLogger("sweep")

# Settings shared by every cell (ranks may outnumber cores): same for every contender.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "HOROVOD_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Cell:
    """One training run of the grid."""

    model: str
    workers: int
    spec: str
    lr: float
    epochs: int
    args: List[str]

    label: str = ""

    @property
    def name(self) -> str:
        method = re.sub(r"[^A-Za-z0-9.]+", "_", (self.label or self.spec).replace("=", "-")).strip("_")
        return f"{self.model}-np{self.workers}-{method}"


def load_grid(path: Optional[str], overrides: argparse.Namespace) -> dict:
    """Grid settings from YAML, with command-line values taking precedence.

    Raises:
        ValueError: missing or malformed keys (the message names them).
    """
    grid = {"models": ["small"], "workers": [1], "epochs": 1, "seed": 1, "lr": 20.0, "args": [],
            "methods": [], "output": "runs/sweep", "data": None}
    if path:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        unknown = set(loaded) - set(grid)
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} in {path}; known: {sorted(grid)}")
        grid.update(loaded)
    for key in ("models", "workers", "epochs", "output", "data"):
        value = getattr(overrides, key, None)
        if value is not None:
            grid[key] = value
    if overrides.methods:
        grid["methods"] = [{"spec": s} for s in overrides.methods]
    if not grid["methods"]:
        raise ValueError("the grid has no methods: give a YAML file with 'methods:' or --methods")
    for m in grid["methods"]:
        if not isinstance(m, dict) or "spec" not in m or set(m) - {"spec", "lr", "args", "label"}:
            raise ValueError(f"each method must be a mapping with 'spec' and optional 'lr', 'args' "
                             f"(extra train_lm.py options) and 'label' (cell name), got {m!r}")
    if any(not isinstance(w, int) or w < 1 for w in grid["workers"]):
        raise ValueError(f"workers must be positive integers, got {grid['workers']}")
    return grid


def cells_of(grid: dict, max_steps: int = 0) -> List[Cell]:
    """All cells of the grid, model-major, then workers, then methods (in file order)."""
    extra = [str(a) for a in grid["args"]] + ["--seed", str(grid["seed"])]
    if max_steps:
        extra += ["--max-steps", str(max_steps)]
    return [Cell(model, w, m["spec"], float(m.get("lr", grid["lr"])), int(grid["epochs"]),
                 extra + [str(a) for a in m.get("args", [])], m.get("label", ""))
            for model in grid["models"] for w in grid["workers"] for m in grid["methods"]]


def run_cell(cell: Cell, out_root: str, data: Optional[str], timeout: float) -> str:
    """Run one cell unless its results exist. Returns "done", "skipped" or "failed"."""
    cell_dir = os.path.join(out_root, "cells", cell.name)
    if os.path.isfile(os.path.join(cell_dir, "results.json")):
        return "skipped"
    os.makedirs(cell_dir, exist_ok=True)
    cmd = ["mpirun", "-np", str(cell.workers), "--oversubscribe", "--bind-to", "none", sys.executable,
           os.path.join(HERE, "train_lm.py"), "--compressor", cell.spec, "--model", cell.model,
           "--epochs", str(cell.epochs), "--lr", str(cell.lr), "--output", cell_dir, "--no-progress",
           *cell.args]
    if data:
        cmd += ["--data", data]
    with open(os.path.join(cell_dir, "log.txt"), "w") as logf:
        logf.write(" ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, **MPI_ENV), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            logf.write(f"\nsweep: killed after {timeout} s\n")
            return "failed"
    return "done" if rc == 0 and os.path.isfile(os.path.join(cell_dir, "results.json")) else "failed"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("grid", nargs="?", help="YAML grid file")
    p.add_argument("--methods", nargs="+", help="method specs (replace the grid's)")
    p.add_argument("--workers", nargs="+", type=int)
    p.add_argument("--models", nargs="+", choices=["small", "medium", "large"])
    p.add_argument("--epochs", type=int)
    p.add_argument("--output")
    p.add_argument("--data")
    p.add_argument("--max-steps", type=int, default=0, help="cap steps per epoch (smoke runs)")
    p.add_argument("--cell-timeout", type=float, default=7200, help="seconds before a cell is killed")
    p.add_argument("--report", action="store_true", help="write the report when the sweep ends")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="[%(asctime)s sweep] %(message)s", datefmt="%H:%M:%S")
    try:
        grid = load_grid(args.grid, args)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    out_root = grid["output"]
    cells = cells_of(grid, args.max_steps)
    status = {}
    for i, cell in enumerate(cells, 1):
        t0 = time.perf_counter()
        status[cell.name] = run_cell(cell, out_root, grid["data"], args.cell_timeout)
        log.info("[%d/%d] %s: %s (%.0f s)", i, len(cells), cell.name, status[cell.name], time.perf_counter() - t0)
    failed = [n for n, s in status.items() if s == "failed"]
    log.info("%d cells: %d run, %d already done, %d failed%s", len(cells),
             sum(s == "done" for s in status.values()), sum(s == "skipped" for s in status.values()),
             len(failed), f" ({', '.join(failed)}; see their log.txt)" if failed else "")
    if args.report:
        from mpi_scripts import report  # noqa: E402  (sibling module)

        report.main([out_root])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
