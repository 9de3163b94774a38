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
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
log = logging.getLogger("sweep")

# Settings shared by every cell (ranks may outnumber cores): same for every contender.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "HOROVOD_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


#: grid ``schedule:`` keys -> train_lm.py options
SCHEDULE_OPTIONS = {"anneal": "--anneal", "anneal_patience": "--anneal-patience",
                    "early_stop": "--early-stop", "warmup_steps": "--warmup-steps",
                    "min_improvement": "--min-improvement", "min_epochs": "--min-epochs"}
METHOD_KEYS = {"spec", "lr", "args", "label", "seeds"}
#: training scripts a grid may run (in this directory); True: takes --model, --data, --no-progress
SCRIPTS = {"train_lm.py": True, "train_cnn.py": False}


@dataclass
class Cell:
    """One training run of the grid.

    ``lr`` is None while it waits for the learning-rate search (:func:`resolve_lr`)."""

    model: str
    workers: int
    spec: str
    lr: Optional[float]
    epochs: int
    args: List[str]

    label: str = ""
    seed: Optional[int] = None      # None: the grid's single ``seed`` (no suffix in the name)
    script: str = "train_lm.py"     # a key of SCRIPTS
    lr_value: str = ""              # search cells: the value tried (part of the name)

    @property
    def method(self) -> str:
        """The method's part of the cell name (label or spec, file-name safe)."""
        return re.sub(r"[^A-Za-z0-9.]+", "_", (self.label or self.spec).replace("=", "-")).strip("_")

    @property
    def name(self) -> str:
        lr = f"-lr{self.lr_value}" if self.lr_value else ""
        seed = "" if self.seed is None else f"-seed{self.seed}"
        return f"{self.model}-np{self.workers}-{self.method}{lr}{seed}"

    def command(self, out_dir: str, data: Optional[str]) -> List[str]:
        """The mpirun command line of this cell."""
        if self.lr is None:
            raise ValueError(f"cell {self.name} has no learning rate yet: run its lr search first")
        cmd = ["mpirun", "-np", str(self.workers), "--oversubscribe", "--bind-to", "none", sys.executable,
               os.path.join(HERE, self.script), "--compressor", self.spec, "--epochs", str(self.epochs),
               "--lr", str(self.lr), "--output", out_dir]
        if SCRIPTS[self.script]:
            cmd += ["--model", self.model, "--no-progress"] + (["--data", data] if data else [])
        return cmd + self.args


def load_grid(path: Optional[str], overrides: argparse.Namespace) -> dict:
    """Grid settings from YAML, with command-line values taking precedence.

    Raises:
        ValueError: missing or malformed keys (the message names them).
    """
    grid = {"script": "train_lm.py", "models": ["small"], "workers": [1], "epochs": 1, "seed": 1,
            "seeds": None, "lr": 20.0, "args": [], "schedule": {}, "lr_search": None, "methods": [],
            "output": "runs/sweep", "data": None, "notes": ""}
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
    if getattr(overrides, "methods", None):
        grid["methods"] = [{"spec": s} for s in overrides.methods]
    if not grid["methods"]:
        raise ValueError("the grid has no methods: give a YAML file with 'methods:' or --methods")
    for m in grid["methods"]:
        if not isinstance(m, dict) or "spec" not in m or set(m) - METHOD_KEYS:
            raise ValueError(f"each method must be a mapping with 'spec' and optional 'lr', 'args' "
                             f"(extra train_lm.py options), 'label' (cell name) and 'seeds', got {m!r}")
    if grid["script"] not in SCRIPTS:
        raise ValueError(f"script must be one of {sorted(SCRIPTS)}, got {grid['script']!r}")
    if any(not isinstance(w, int) or w < 1 for w in grid["workers"]):
        raise ValueError(f"workers must be positive integers, got {grid['workers']}")
    bad = set(grid["schedule"] or {}) - set(SCHEDULE_OPTIONS)
    if bad:
        raise ValueError(f"unknown schedule key(s) {sorted(bad)}; known: {sorted(SCHEDULE_OPTIONS)}")
    seeds = [grid["seeds"]] + [m["seeds"] for m in grid["methods"] if "seeds" in m]
    if any(s is not None and (not isinstance(s, list) or not s or not all(isinstance(x, int) for x in s))
           for s in seeds):
        raise ValueError("seeds must be a non-empty list of integers, e.g. seeds: [1, 2, 3]")
    if any("seeds" in m for m in grid["methods"]) and grid["seeds"] is None:
        raise ValueError("a method lists 'seeds' but the grid has 'seed': give the grid 'seeds: [...]' "
                         "so every cell name carries its seed")
    search = grid["lr_search"]
    if search is not None:
        if not isinstance(search, dict) or set(search) - {"values", "epochs"} or not search.get("values"):
            raise ValueError("lr_search must be a mapping {values: [5, 10, 20, 40], epochs: 3}, "
                             f"got {search!r}")
        if any(not (isinstance(v, (int, float)) and v > 0) for v in search["values"]):
            raise ValueError(f"lr_search values must be positive numbers, got {search['values']}")
    return grid


def _common_args(grid: dict, max_steps: int) -> List[str]:
    extra = [str(a) for a in grid["args"]]
    for key, value in (grid["schedule"] or {}).items():
        extra += [SCHEDULE_OPTIONS[key], str(value)]
    if max_steps:
        extra += ["--max-steps", str(max_steps)]
    return extra


def _method_lr(grid: dict, m: dict) -> Optional[float]:
    """A method's own lr; the grid's lr unless a search decides; None while it must be searched."""
    if "lr" in m:
        return float(m["lr"])
    return None if grid["lr_search"] else float(grid["lr"])


def cells_of(grid: dict, max_steps: int = 0) -> List[Cell]:
    """All training cells of the grid: seed-major (so a partial sweep covers every method once
    before repeating any), then model, workers and methods (in file order)."""
    extra = _common_args(grid, max_steps)
    out = []
    seeds = sorted({s for m in grid["methods"] for s in (m.get("seeds") or grid["seeds"] or [None])},
                   key=lambda s: -1 if s is None else s)
    for seed in seeds:
        for model in grid["models"]:
            for w in grid["workers"]:
                for m in grid["methods"]:
                    if seed not in (m.get("seeds") or grid["seeds"] or [None]):
                        continue
                    args = extra + ["--seed", str(grid["seed"] if seed is None else seed)]
                    out.append(Cell(model, w, m["spec"], _method_lr(grid, m), int(grid["epochs"]),
                                    args + [str(a) for a in m.get("args", [])], m.get("label", ""), seed,
                                    grid["script"]))
    return out


def search_cells_of(grid: dict, max_steps: int = 0) -> List[Cell]:
    """The learning-rate search: each method without its own ``lr`` at every value, for
    ``lr_search.epochs`` epochs, first seed, first model, largest worker count. Empty without a
    search."""
    search = grid["lr_search"]
    if not search:
        return []
    seed = (grid["seeds"] or [grid["seed"]])[0]
    model, workers = grid["models"][0], max(grid["workers"])
    extra = _common_args(grid, max_steps) + ["--seed", str(seed)]
    return [Cell(model, workers, m["spec"], float(v), int(search.get("epochs", 3)),
                 extra + [str(a) for a in m.get("args", [])], m.get("label", ""), None, grid["script"], f"{v:g}")
            for m in grid["methods"] if "lr" not in m for v in search["values"]]


def choose_lr(out_root: str, search: List[Cell]) -> Dict[str, dict]:
    """Per method (cell name without lr and seed): every tried value's best validation perplexity
    (NaN for a failed or diverged run) and the chosen value, the lowest perplexity (ties: the value
    listed first). Methods whose search is incomplete are left out."""
    tried: Dict[str, Dict[str, float]] = {}
    for cell in search:
        key = f"{cell.model}-np{cell.workers}-{cell.method}"
        path = os.path.join(out_root, "search", cell.name, "results.json")
        val = math.nan
        if os.path.isfile(path):
            with open(path) as f:
                val = float(json.load(f).get("best_val_ppl", math.nan))
        elif not os.path.isfile(os.path.join(out_root, "search", cell.name, "failed")):
            tried.setdefault(key, {})["incomplete"] = math.nan
        tried.setdefault(key, {})[cell.lr_value] = val
    out = {}
    for key, vals in tried.items():
        if "incomplete" in vals:
            continue
        finite = [(v, lr) for lr, v in vals.items() if math.isfinite(v)]
        chosen = min(finite, key=lambda t: t[0])[1] if finite else None
        out[key] = {"values": vals, "chosen": None if chosen is None else float(chosen)}
    return out


def resolve_lr(cells: List[Cell], chosen: Dict[str, dict]) -> None:
    """Give every cell waiting for the search (``lr is None``) its method's chosen value."""
    by_method = {key.split("-", 2)[2]: c["chosen"] for key, c in chosen.items()}
    for cell in cells:
        if cell.lr is None and by_method.get(cell.method) is not None:
            cell.lr = by_method[cell.method]


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
    with open(os.path.join(cell_dir, "sweep.json"), "w") as f:
        json.dump({"wall_seconds": time.time() - t0, "returncode": rc, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
    if not ok:
        open(marker, "w").close()
    return "done" if ok else "failed"


def write_json(path: str, obj) -> None:
    """Write ``obj`` as indented JSON (NaN allowed), creating the directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


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
        from mpi_scripts import report  # noqa: E402  (sibling module)

        report.main([out_root])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
