#!/usr/bin/env python
"""Run a grid of train_lm.py cells (methods x workers x models x seeds), one training run per cell.

The grid comes from a YAML file (see ``mpi_scripts/grids/study_small.yaml`` and
``study_v2.yaml``) and/or the command line. Every cell writes
``OUTPUT/cells/<model>-np<N>-<method>[-seed<S>]/results.json``; a cell whose results file exists is
not rerun, so an interrupted sweep resumes where it stopped (``--stop-after`` ends a chunk cleanly
between cells). Grid keys:

- ``seed`` (one seed, cell names without a suffix) or ``seeds`` (a list; names end in ``-seed<S>``);
  a method may list its own ``seeds`` (e.g. three seeds only for the cells a claim hinges on);
- ``schedule``: train_lm.py's schedule options (``anneal``, ``anneal_patience``, ``early_stop``,
  ``warmup_steps``, ``min_improvement``, ``min_epochs``), ``epochs`` being the maximum;
- ``lr``: the learning rate, or per method ``lr``; with ``lr_search: {values: [...], epochs: E}``
  every method without its own ``lr`` first runs E epochs at each value (cells under
  ``OUTPUT/search/``, the first seed, the first model and the largest worker count), and its cells
  use the value with the lowest validation perplexity (``OUTPUT/lr_search.json`` records the choice);
- ``script``: ``train_lm.py`` (default) or ``train_cnn.py`` (AB-training's CNN on the digits;
  ``models`` and ``data`` do not apply to it);
- ``notes``: free text the report quotes (what the grid chose and cut to fit its budget).

Example::

    python mpi_scripts/sweep.py mpi_scripts/grids/study_small.yaml --workers 1 2 4
    python mpi_scripts/report.py runs/study-small
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import Dict, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
from mpi_scripts.grid import (ROOT, Cell, cells_of, choose_lr, load_grid, resolve_lr,  # noqa: E402,F401
                               search_cells_of)
from mpi_scripts import report  # noqa: E402
from hvdcomp.launch import MPI_ENV  # noqa: E402
from mpi_scripts.results import write_json  # noqa: E402

log = logging.getLogger("sweep")

def run_cell(cell: Cell, out_root: str, data: Optional[str], timeout: float, subdir: str = "cells") -> str:
    """Run one cell unless its results exist. Returns "done", "skipped" or "failed".

    Writes ``log.txt`` (the command and the run's output) and ``sweep.json`` (wall seconds,
    start-up and evaluation included, for the report's budget line) beside ``results.json``; a
    failed cell leaves a ``failed`` marker, removed when it is rerun."""
    cell_dir = os.path.join(out_root, subdir, cell.name)
    if os.path.isfile(os.path.join(cell_dir, "results.json")):
        return "skipped"
    os.makedirs(cell_dir, exist_ok=True)
    marker = os.path.join(cell_dir, "failed")
    if os.path.exists(marker):
        os.remove(marker)
    cmd = cell.command(cell_dir, data)
    t0 = time.time()
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
            rc = -9
    ok = rc == 0 and os.path.isfile(os.path.join(cell_dir, "results.json"))
    write_json(os.path.join(cell_dir, "sweep.json"),
               {"wall_seconds": time.time() - t0, "returncode": rc, "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    if not ok:
        open(marker, "w").close()
    return "done" if ok else "failed"


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
    p.add_argument("--stop-after", type=float, default=0,
                   help="start no new cell after this many seconds (0: run all); rerun to continue")
    p.add_argument("--report", action="store_true", help="write the report when the sweep ends")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="[%(asctime)s sweep] %(message)s", datefmt="%H:%M:%S")
    try:
        grid = load_grid(args.grid, args)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    out_root = grid["output"]
    search = search_cells_of(grid, args.max_steps)
    cells = cells_of(grid, args.max_steps)
    status: Dict[str, str] = {}
    t_start = time.perf_counter()
    todo = [("search", c) for c in search] + [("cells", c) for c in cells]
    for i, (subdir, cell) in enumerate(todo, 1):
        if args.stop_after and time.perf_counter() - t_start > args.stop_after:
            log.info("--stop-after %.0f s reached: %d cell(s) left for the next chunk", args.stop_after,
                     len(todo) - i + 1)
            break
        if subdir == "cells" and cell.lr is None:
            chosen = choose_lr(out_root, search)
            write_json(os.path.join(out_root, "lr_search.json"), chosen)
            resolve_lr(cells, chosen)
            if cell.lr is None:
                status[cell.name] = "failed"
                log.error("[%d/%d] %s: no learning rate (its search failed or diverged at every value; "
                          "see %s)", i, len(todo), cell.name, os.path.join(out_root, "search"))
                continue
        t0 = time.perf_counter()
        status[cell.name] = run_cell(cell, out_root, grid["data"], args.cell_timeout, subdir)
        log.info("[%d/%d] %s%s: %s (%.0f s)", i, len(todo), "search/" if subdir == "search" else "",
                 cell.name, status[cell.name], time.perf_counter() - t0)
    if search:
        write_json(os.path.join(out_root, "lr_search.json"), choose_lr(out_root, search))
    failed = [n for n, s in status.items() if s == "failed"]
    log.info("%d cells: %d run, %d already done, %d failed%s", len(status),
             sum(s == "done" for s in status.values()), sum(s == "skipped" for s in status.values()),
             len(failed), f" ({', '.join(failed)}; see their log.txt)" if failed else "")
    if args.report:

        report.main([out_root])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
