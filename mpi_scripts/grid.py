"""Study grids: the YAML files of ``mpi_scripts/grids/`` as cells to run (one training run each),
with their learning-rate search; read by :mod:`mpi_scripts.sweep` (which runs them) and
:mod:`mpi_scripts.report` (which reports them). See :mod:`mpi_scripts.sweep` for the grid keys."""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import yaml

from mpi_scripts.results import read_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
log = logging.getLogger("sweep")

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
            val = float((read_json(path) or {}).get("best_val_ppl", math.nan))
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


