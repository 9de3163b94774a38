#!/usr/bin/env python
"""The scripts' one report generator: results JSON in, ``report.md`` (and PNG plots) out.

Usage (the first word picks the sub-report; without one it is ``study``, so a study folder named like a
sub-report is given as ``report.py study FOLDER``)::

    python mpi_scripts/report.py [study] runs/study-small [--target-ppl 400] [--out docs/results]
    python mpi_scripts/report.py ab docs/results/study-v2-ab [--grid GRID.yaml] [--command "make study"]
    python mpi_scripts/report.py speed --e2e runs/netem-e2e --comm runs/netem-comm \\
        --kernels docs/results/speed/kernels-cpu --output docs/results/speed
    python mpi_scripts/report.py gossip --input docs/results/gossip --output docs/results/gossip
    python mpi_scripts/report.py local --output runs/netem-local [--baseline B] [--versus V] [--target-factor 1.1]
    python mpi_scripts/report.py ddp-hooks --output docs/results/ddp-hooks

``study``: every ``results.json`` of a sweep (``sweep.py``/``train_lm.py``) under the directory:
perplexity, phase times and bytes per method, the seed study's claims judged against the seed
spread (:func:`compare`), plots of validation perplexity, time breakdown and bytes per step.
Communication figures are the *measured* per-phase timers and byte counters of the runs, not a
bandwidth model.

``ab``: AB-training against full-rank data parallelism on scikit-learn's digits
(``cells/*/results.json`` of ``train_cnn.py``), with the two figures AB-training's paper (Coquelin
et al., arXiv:2405.01067, 2024) keeps apart: **traffic** (bytes sent over the run against every
fp32 gradient every step; the paper's 50 % (v1) / 70.31 % (v2) less) and **model compression**
(parameters of the factorised model against the full one; the paper's 44.14:1, VGG16 on
CIFAR-10); test accuracy judged against the seed spread, the singular values at the end of
training, plots ``ab_accuracy.png``, ``ab_compression.png``, ``ab_spectra.png``.

``speed``: ``report.md``, PNG plots and ``summary.json`` from what the speed benchmarks wrote (any
input may be missing; its section then says so): ``--e2e DIR`` (``DIR/cells/<rate>/<contender>.json``
of ``benchmarks/netem_e2e.py``, the LSTM at 4 ranks, one per emulated host; step time = per step
the slowest rank, median over timed steps), ``--e2e-transformer DIR`` (the same for ``--model
transformer``, with issue 17's target: top-k 1 % and PowerSGD faster per step than stock Horovod
and than DDP with its fp16 hook at 4 ranks on 100 Mbit/s links), ``--comm DIR``
(``DIR/cells/<rate>/comm-np<p>.json`` of ``netem_e2e.py --bench comm``: raw collectives over
message sizes and hvdcomp's synchronize per method, at 2 and 4 ranks), ``--kernels DIR``
(``kernels.md`` of ``benchmarks/kernels.py``), ``--overhead DIR`` (``overhead.json`` of
``benchmarks/overhead.py``). Every "x faster than Horovod" is against the fastest of stock
Horovod's configurations measured at that link rate (``peers.STOCK_HOROVOD``: none / fp16, each
with Open MPI's default and its ring allreduce), by the quantity the ratio compares. Cost model
(:mod:`hvdcomp.comm.costmodel`): per link rate, ring formulas fitted to the measured collectives at
2 and 4 ranks together (allgather ``(p-1)·α + (p-1)·m·β``; allreduce ``2(p-1)·α + 2(p-1)/p·n·β``),
each method's communication predicted from its measured bytes per rank, checked against its
measured communication time and extrapolated to 8…1024 ranks (allreduce methods with the mpi4py
Allreduce fit: Horovod's cycle time is a per-collective constant, not a per-hop latency).

``gossip``: ``docs/results/gossip/run.sh``'s step time and bytes per rank on the emulated links,
and perplexity after the same epochs, for decentralized gossip against allreduce / allgather
routes (:data:`GOSSIP_METHOD`).

``local``: the cells of ``benchmarks/netem_local.py`` (local-update training against synchronous
training on emulated links), per rate and contender: the best validation perplexity (mean, sample
standard deviation and range over seeds), test perplexity, bytes sent per step and their ratio to
dense fp32, seconds per step and per compute-only part of a step, and the time to the target
perplexity (``--target-factor`` × the best validation perplexity of ``--baseline``, mean over its
seeds at the same rate: the first epoch end at or below it, seconds since training started), with
the speed-ups over ``--baseline`` and ``--versus`` (where the reference missed the target on some
seed, a lower bound: that seed's last epoch end stands for its time; where the contender missed it
and the reference did not, an upper bound), and issue 32's targets met, missed or not judged.
Writes ``OUTPUT/report.md`` and ``OUTPUT/report.json``.

``ddp-hooks``: the cells of ``benchmarks/ddp_hooks.py`` (issue 35): the median step per contender and
rate (per step the maximum over ranks, median over the timed steps), and the targets: hvdcomp top-k
1 % through DDP against DDP's fastest built-in hook, and against the Horovod front-end's top-k.
"""
from __future__ import annotations

import argparse
import glob
import inspect
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]  # (run as a script; peers, overhead)
from mpi_scripts import grid  # noqa: E402
from mpi_scripts.results import mean as _mean, read_all, read_json, sd as _sd, summary, write_json  # noqa: E402
from hvdcomp.comm.costmodel import CostModel, collective_terms, fit_alpha_beta  # noqa: E402
from hvdcomp.lm import PlateauSchedule  # noqa: E402
from hvdcomp.lowrank.schedule import STAGES  # noqa: E402  (the stage names' one definition)
from hvdcomp.lowrank.traffic import read  # noqa: E402  (results before and after the stage rename)
from hvdcomp.metrics import PHASES  # noqa: E402  (the phase names' one definition)
from netem_e2e import slug  # noqa: E402  (a contender's cell file name)
from peers import PEERS, STOCK_HOROVOD, STOCK_HOROVOD_DENSE, label  # noqa: E402


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ==== study: a sweep's runs and the seed study's claims ==========================================

#: Published test perplexity of the seed study (STUDY.md), (model, workers) -> column -> value.
STUDY_PPL = {
    ("small", 1): [116.398, 110.814, 120.008, 169.623, 109.912, 117.002, 166.213, 115.023, 117.987, 115.717],
    ("small", 2): [115.113, 114.365, 117.742, 151.729, 111.001, 120.002, 160.590, 118.521, 114.993, 115.133],
    ("medium", 1): [92.213, 89.597, 93.066, 107.530, 88.504, 91.387, 124.156, 93.109, 91.608, 94.436],
    ("medium", 2): [91.781, 91.088, 92.367, 107.013, 89.020, 93.694, 129.669, 90.848, 91.325, 91.727],
    ("medium", 4): [90.611, 90.236, 93.969, 108.778, 90.193, 92.195, 129.006, 91.178, 90.313, 93.634],
    ("large", 1): [86.427, 86.302, 89.600, 98.583, 85.045, 85.008, 100.809, 87.766, 85.760, 86.539],
}
STUDY_COLUMNS = ["none", "top-k 50x", "top-k 500x", "top-k 5000x", "DGC 50x", "DGC 500x", "DGC 5000x",
                 "QSGD s=64", "QSGD s=16", "QSGD s=4"]
COLUMN_ORDER = STUDY_COLUMNS[:1] + ["rand-k 50x", "rand-k 500x", "rand-k 5000x", "rand-k 50x no-EF",
                                    "rand-k 500x no-EF", "rand-k 5000x no-EF"] + STUDY_COLUMNS[1:]


def column_of(desc: dict) -> str:
    """Column label in the study's terms, from a results file's ``config.compressor``."""
    name = desc.get("name")
    sparsifiers = {"topk": "top-k", "dgc": "DGC", "randomk": "rand-k", "gtopk": "gTop-k", "cltk": "CLT-k"}
    if name in sparsifiers and "density" in desc:
        col = f"{sparsifiers[name]} {round(1 / (2 * desc['density']))}x"
        if name == "randomk" and not desc.get("ef", False):
            col += " no-EF"
        return col + (" (hierarchical)" if desc.get("hierarchical") else "")
    if name == "qsgd":
        return f"QSGD s={desc['levels']}"
    if name in ("none", "auto"):
        return name
    if name == "powersgd":
        return f"PowerSGD r={desc.get('matrix_rank', desc.get('rank'))}"
    if name == "sidco" and "density" in desc:
        return f"SIDCo {round(1 / (2 * desc['density']))}x ({desc.get('dist', 'exp')})"
    if name == "sbc" and "density" in desc:
        return f"SBC ρ={desc['density']:g}"
    if name == "lowbit":
        beta = f", β={desc['beta']:g}" if desc.get("beta") else ""
        return f"low-bit {desc['bits']}-bit{beta}"
    if name == "adaptive":
        return f"L-GreCo {desc['base']} budget {desc['budget']:g}"
    if name == "ab-training":
        return f"AB-training ({desc['mode']}, cutoff {desc['cutoff']})"
    args = ",".join(f"{k}={v}" for k, v in sorted(desc.items()) if k != "name")
    return f"{name}:{args}" if args else name


def load_results(root: str) -> List[dict]:
    """Flat rows (one per training cell's results.json under ``root``; the learning-rate search's
    runs under ``search/`` are left out) with the fields the report uses."""
    rows = []
    for path, r in read_all(root, "**/results.json").items():
        if os.path.relpath(path, root).split(os.sep)[0] == "search":
            continue
        cfg = r["config"]
        steps = r["epochs"][0]["steps"] if r["epochs"] else 0
        val = [e["val_ppl"] for e in r["epochs"]]
        elapsed = [e.get("elapsed_seconds") for e in r["epochs"]]
        rows.append({
            "path": path, "model": cfg["model"], "workers": cfg["world_size"], "seed": cfg.get("seed"),
            # the cell without its seed: runs of one variant are the seeds of one row
            "variant": re.sub(r"-seed\d+$", "", os.path.basename(os.path.dirname(path))),
            "max_epochs": cfg.get("epochs", len(val)), "epochs_cap": cfg.get("epochs"),
            "column": column_of(cfg["compressor"]), "family": cfg["compressor"]["name"],
            "density": cfg["compressor"].get("density"), "spec": cfg.get("compressor_spec"),
            "lr": cfg.get("lr"), "test_ppl": r["test_ppl"], "val": val,
            "best_val": r.get("best_val_ppl", min(val) if val else math.nan),
            "best_epoch": r.get("best_epoch"), "stopped_early": r.get("stopped_early"),
            "plateau_at_end": plateau_at_end(cfg, val),
            "elapsed": elapsed if None not in elapsed else None,
            "steps_per_epoch": steps,
            "phase_step": {p: r["per_step"][p]["mean"] for p in PHASES},
            "wall_step": r["per_step"]["wall"]["mean"],
            "bytes_sent": r["per_step"]["bytes_sent"]["mean"],
            "bytes_received": r["per_step"]["bytes_received"]["mean"],
            "dense_bytes": r["per_step"]["dense_bytes"]["mean"],
            "measured_ratio": r["measured_ratio"], "nominal_ratio": r["nominal_ratio"],
            "transport": cfg.get("transport"), "env": cfg.get("env", {}),
            "wall_seconds": _sweep_wall(path, r),
            "auto": r.get("auto"),  # compression="auto": its settings and decisions
        })
    return rows


def _sweep_wall(results_path: str, r: dict) -> float:
    """The cell's wall seconds as the sweep measured them (start-up included), else the run's own."""
    side = read_json(os.path.join(os.path.dirname(results_path), "sweep.json"))
    return float(side["wall_seconds"] if side else r.get("seconds_total", 0.0))


def search_wall_seconds(root: str) -> Tuple[int, float]:
    """(runs, wall seconds) of the learning-rate search under ``root/search``."""
    sides = read_all(root, "search/*/sweep.json").values()
    return len(sides), sum(float(s["wall_seconds"]) for s in sides)


def ordered_columns(rows) -> List[str]:
    present = {r["column"] for r in rows}
    return [c for c in COLUMN_ORDER if c in present] + sorted(present - set(COLUMN_ORDER))


def aggregate(runs: List[dict]) -> dict:
    """One method's seeds as one row: the first run's labels, means of the numbers, and
    ``runs`` (every seed's row), ``n``, ``test_sd`` (sample standard deviation, NaN for one seed)."""
    out = dict(runs[0])
    out["runs"], out["n"] = runs, len(runs)
    for key in ("test_ppl", "best_val", "wall_step", "bytes_sent", "bytes_received", "dense_bytes",
                "measured_ratio"):
        out[key] = _mean([r[key] for r in runs])
    out["test_sd"] = _sd([r["test_ppl"] for r in runs])
    out["phase_step"] = {p: _mean([r["phase_step"][p] for r in runs]) for p in PHASES}
    longest = max(len(r["val"]) for r in runs)
    out["val"] = [_mean([r["val"][e] for r in runs if e < len(r["val"])]) for e in range(longest)]
    return out


def groups(rows) -> Dict[Tuple[str, int], Dict[str, dict]]:
    """(model, workers) -> column -> the column's seeds aggregated (:func:`aggregate`).

    The seeds of a column are the runs of one cell variant (its directory name without
    ``-seed<N>``); where variants that differ in other settings (``args``, ``label``) share a
    column, each keeps its own, named ``column [variant]``."""
    runs: Dict[Tuple[str, int], Dict[str, List[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        runs[(r["model"], r["workers"])][(r["column"], r["variant"])].append(r)
    out = {}
    for key, variants in runs.items():
        shared = defaultdict(int)
        for column, _ in variants:
            shared[column] += 1
        out[key] = {}
        for (column, variant), rs in variants.items():
            name = column if shared[column] == 1 else f"{column} [{variant}]"
            out[key][name] = dict(aggregate(sorted(rs, key=lambda r: r["seed"] or 0)), column=name,
                                  base_column=column)
    return dict(sorted(out.items(), key=lambda kv: (["small", "medium", "large"].index(kv[0][0]), kv[0][1])))


def epochs_to(val: List[float], target: float) -> Optional[int]:
    """First epoch (1-based) whose validation perplexity is <= target, or None."""
    return next((i + 1 for i, v in enumerate(val) if v <= target), None)


def seconds_to(run: dict, target: float) -> Optional[float]:
    """Training seconds until the end of the first epoch at or below ``target`` (None: never, or
    the run did not record elapsed time)."""
    e = epochs_to(run["val"], target)
    return None if e is None or not run.get("elapsed") else run["elapsed"][e - 1]


def targets(rows, target_ppl: Optional[float]) -> Dict[Tuple[str, int], float]:
    """Target validation perplexity per group: given, else 1.1 x the baseline's best validation
    perplexity (mean over its seeds), a level every converging method should reach."""
    out = {}
    for key, cols in groups(rows).items():
        if target_ppl is not None:
            out[key] = target_ppl
        elif "none" in cols and math.isfinite(cols["none"]["best_val"]):
            out[key] = 1.1 * cols["none"]["best_val"]
    return out


# ---- the study's claims ----------------------------------------------------------------------
SUPPORTED, CONTRADICTED, TIE, SINGLE = "supported", "contradicted", "not distinguishable", "single seed"


def compare(a: List[float], b: List[float]) -> Tuple[float, float, str]:
    """Difference of means ``mean(a) − mean(b)``, its seed spread ``sqrt(sd_a² + sd_b²)`` (the
    standard deviation of the difference between one run of each) and the direction:
    ``">"``/``"<"`` when the difference exceeds the spread, ``"~"`` when it does not, ``"?"`` with
    fewer than two seeds on either side (no spread to judge against)."""
    d = _mean(a) - _mean(b)
    if len(a) < 2 or len(b) < 2:
        return d, math.nan, "?"
    spread = math.sqrt(_sd(a) ** 2 + _sd(b) ** 2)
    return d, spread, (">" if d > spread else "<" if d < -spread else "~")


def _fmt(xs: List[float], unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    m, sd = _mean(xs) * scale, _sd(xs) * scale
    return f"{m:.{digits}f}" + ("" if math.isnan(sd) else f" ± {sd:.{digits}f}") + f"{unit} (n={len(xs)})"


def _outcome(direction: str, wanted: str) -> str:
    if direction == "?":
        return SINGLE
    if direction == "~":
        return TIE
    return SUPPORTED if direction == wanted else CONTRADICTED


def _verdict(outcomes: List[str]) -> str:
    if not outcomes:
        return "no data"
    counts = {o: outcomes.count(o) for o in (SUPPORTED, CONTRADICTED, TIE, SINGLE) if o in outcomes}
    if len(counts) == 1:
        only = next(iter(counts))
        return {SUPPORTED: "supported", CONTRADICTED: "not supported", TIE: "not distinguishable",
                SINGLE: "not judged (single seed)"}[only]
    head = ("partly supported" if SUPPORTED in counts else
            "not supported" if CONTRADICTED in counts else "not distinguishable")
    return head + " (" + ", ".join(f"{n} {o}" for o, n in counts.items()) + ")"


def _test(col: dict) -> List[float]:
    return [r["test_ppl"] for r in col["runs"]]


SHARE_UNIT = " % of compute"


def share_of_compute(phase: str):
    """A function ``col -> [seconds of phase per step / seconds of compute per step, one per run]``
    (dimensionless floats) for ``phase`` in :data:`PHASES`.

    Claims 5 and 6 and the time table compare times measured in different runs, and the runs of
    one grid may come from sessions on machines of different speed (a study run in chunks): in
    study v2 the same cell's compute step took 0.7 s in one session and 1.4 s in another.
    Dividing each run's phase time by its own compute time (forward + backward + update on the
    same ranks, in the same run) cancels the machine's speed to first order, so seeds from
    different sessions can be compared. A run with no compute time recorded gives NaN."""
    def values(col) -> List[float]:
        return [r["phase_step"][phase] / r["phase_step"]["compute"] if r["phase_step"]["compute"] > 0
                else math.nan for r in col["runs"]]
    return values


def _vs(name: str, a: dict, bname: str, b: dict, wanted: str, values=_test, unit: str = "",
        scale: float = 1.0) -> Tuple[str, str]:
    """One comparison as (outcome, evidence): effect size (difference and relative), spread."""
    xa, xb = values(a), values(b)
    d, spread, direction = compare(xa, xb)
    rel = d / _mean(xb) if _mean(xb) else math.nan
    spread_txt = "one seed, no spread" if math.isnan(spread) else f"spread {spread * scale:.1f}{unit}"
    return (_outcome(direction, wanted),
            f"{name} {_fmt(xa, unit, scale)} vs {bname} {_fmt(xb, unit, scale)}: "
            f"{d * scale:+.1f}{unit} ({100 * rel:+.1f} %), {spread_txt}")


def check_claims(rows, target_ppl: Optional[float] = None) -> List[Tuple[str, str, str]]:
    """The seven claims of STUDY.md as (claim, verdict, evidence with numbers).

    Every comparison is judged against the seed spread (:func:`compare`): a difference within the
    spread is "not distinguishable", a single seed is "not judged"; the verdict counts them."""
    g, tg = groups(rows), targets(rows, target_ppl)
    claims = []

    def each(fn):
        """fn(model, workers, cols) -> None or [(outcome, note), ...]: one per comparison."""
        outcomes, notes = [], []
        for (model, w), cols in g.items():
            for outcome, note in fn(model, w, cols) or []:
                outcomes.append(outcome)
                notes.append(f"{model}/{w}: {note} → {outcome}")
        return _verdict(outcomes), "; ".join(notes) or "no cells to compare"

    def named(cols, base):
        """The columns of ``base`` (one, or one per variant that shares it)."""
        return [c for c in cols if cols[c].get("base_column", c) == base]

    def c1(model, w, cols):
        if "none" not in cols:
            return None
        return [_vs(c, cols[c], "none", cols["none"], "<")
                for base in ("top-k 50x", "DGC 50x") for c in named(cols, base)]
    claims.append(("1. Top-k and DGC at 50x reach perplexity at or below the baseline", *each(c1)))

    def c2(model, w, cols):
        tk, dg = named(cols, "top-k 5000x"), named(cols, "DGC 5000x")
        if "none" not in cols or not tk or not dg:
            return None
        return [_vs(tk[0], cols[tk[0]], "none", cols["none"], ">"),
                _vs(dg[0], cols[dg[0]], "none", cols["none"], ">"),
                _vs(dg[0], cols[dg[0]], tk[0], cols[tk[0]], ">")]
    claims.append(("2. At 5000x both degrade clearly, DGC more than top-k", *each(c2)))

    def c3(model, w, cols):
        if "none" not in cols:
            return None
        out = []
        for c in (c for c in cols if c.startswith("QSGD")):
            d, spread, direction = compare(_test(cols[c]), _test(cols["none"]))
            if direction == "?":
                outcome = SINGLE
            elif abs(d) <= 2.5:
                outcome = SUPPORTED
            elif abs(d) - spread > 2.5:
                outcome = CONTRADICTED
            else:
                outcome = TIE
            out.append((outcome, f"{c} {_fmt(_test(cols[c]))} vs none {_fmt(_test(cols['none']))}: "
                                 f"{d:+.1f}" + ("" if math.isnan(spread) else f", spread {spread:.1f}")))
        return out
    claims.append(("3. QSGD stays within ±2.5 perplexity of the baseline (outside by more than the "
                   "spread: contradicted)", *each(c3)))

    def c4(model, w, cols):
        pairs = [(c, c + " no-EF") for c in cols if c.startswith("rand-k") and not c.endswith("no-EF")
                 and c + " no-EF" in cols]
        if "none" not in cols:
            return None
        out = []
        for e, n in pairs:
            out.append(_vs(n, cols[n], e, cols[e], ">"))
            out.append(_vs(e, cols[e], "none", cols["none"], ">"))
        return out
    claims.append(("4. Random-k without residuals is far worse than with them, which is worse than baseline",
                   *each(c4)))

    comm = share_of_compute("communicate")

    def c5(model, w, cols):
        if "none" not in cols or w < 2:
            return None
        return [_vs(c, cols[c], "none", cols["none"], "<", comm, SHARE_UNIT, 100) for c in cols if c != "none"]
    claims.append(("5. Communication time per step falls for every method", *each(c5)))

    compress = share_of_compute("compress")

    def c6(model, w, cols):
        """Each top-k column against DGC at the same density and against every QSGD column: pairs
        of settings with their own seeds, not a family's settings pooled as if they were seeds."""
        out = []
        for tk in (c for c in cols if c.startswith("top-k")):
            dgc = named(cols, cols[tk].get("base_column", tk).replace("top-k", "DGC", 1))
            for other in dgc + [c for c in cols if c.startswith("QSGD")]:
                out.append(_vs(tk, cols[tk], other, cols[other], ">", compress, SHARE_UNIT, 100))
        return out or None
    claims.append(("6. Top-k's selection cost is the largest; DGC and QSGD add less", *each(c6)))

    def c7(model, w, cols):
        if (model, w) not in tg or "none" not in cols:
            return None
        t = tg[(model, w)]

        def epochs(col):  # a run that never reaches the target counts as one epoch past the most
            # it was allowed (an early-stopped run did not get there sooner)
            return [float(epochs_to(r["val"], t) or r["max_epochs"] + 1) for r in col["runs"]]
        return [_vs(f"{c} (target {t:.1f})", cols[c], "none", cols["none"], "<", epochs, " epochs")
                for base in ("top-k 50x", "DGC 50x") for c in named(cols, base)]
    claims.append(("7. Sparsifiers converge in fewer epochs than the baseline (epochs to the target "
                   "validation perplexity)", *each(c7)))
    return claims


# ---- markdown and plots ----------------------------------------------------------------------
def _ppl_cell(col: dict) -> str:
    if col["n"] < 2:
        return f"{col['test_ppl']:.1f}"
    return f"{col['test_ppl']:.1f} ± {col['test_sd']:.1f} (n={col['n']})"


def ppl_table(rows) -> str:
    """Test perplexity per (model, workers) and method: mean ± sample sd over seeds, the study's
    published value in parentheses."""
    g = groups(rows)
    cols = ordered_columns([c for by in g.values() for c in by.values()])
    lines = ["| model / workers | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for (model, w), by in g.items():
        study = dict(zip(STUDY_COLUMNS, STUDY_PPL.get((model, w), [])))
        cells = []
        for c in cols:
            ours = _ppl_cell(by[c]) if c in by else "–"
            cells.append(ours + (f" ({study[c]:.1f})" if c in study else ""))
        lines.append(f"| {model} / {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def last_epoch_gain(val: List[float]) -> Optional[float]:
    """How much the last epoch lowered the best validation perplexity so far, in percent (0 when it
    did not improve on the earlier best); None for runs of fewer than two epochs. A run still gaining
    more than the schedule's ``min_improvement`` per epoch when it stopped is not converged."""
    if len(val) < 2:
        return None
    before = min(val[:-1])
    return max(0.0, 100.0 * (1.0 - min(val) / before))


def plateau_at_end(cfg: dict, val: List[float]) -> Optional[bool]:
    """Whether the run's own training schedule (:class:`hvdcomp.lm.PlateauSchedule`, replayed on
    its validation perplexities ``val`` with the settings in ``cfg``) called for early stopping at
    its last epoch: a run that plateaus in the last epoch it is allowed records
    ``stopped_early: false`` (it did not stop *before* the cap). None when ``cfg`` lacks the
    schedule's settings or ``val`` is empty."""

    keys = [k for k in inspect.signature(PlateauSchedule).parameters if k != "lr"]
    if not val or any(k not in cfg for k in keys):
        return None
    sched = PlateauSchedule(1.0, **{k: cfg[k] for k in keys})
    return [sched.end_epoch(v) for v in val][-1]


def _stop_reason(run: dict) -> str:
    """What ended a run: ``diverged`` (a non-finite validation perplexity), ``plateau`` (early
    stopping, also when the schedule called for it in the last allowed epoch), ``cap`` (it used
    every epoch allowed without meeting the early-stopping rule) or ``?`` (its config lacks the cap)."""
    if any(not math.isfinite(v) for v in run["val"]):
        return "diverged"
    if run.get("stopped_early") or run.get("plateau_at_end"):
        return "plateau"
    cap = run.get("epochs_cap")
    return "cap" if cap is not None and len(run["val"]) >= cap else "?"


def method_table(rows) -> str:
    """One line per method: learning rate, seeds, test perplexity, best epoch, epochs run, what
    ended each run (a validation plateau or the epoch cap) and its last epoch's gain (percent)."""
    lines = ["| model / workers | method | lr | seeds | test ppl | best val ppl | best epoch | epochs run "
             "| ended by | last-epoch gain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, w), by in groups(rows).items():
        for c in ordered_columns(list(by.values())):
            col = by[c]
            lrs = sorted({r["lr"] for r in col["runs"]})
            lines.append(f"| {model} / {w} | {c} | {', '.join(f'{x:g}' for x in lrs)} | "
                         f"{', '.join(str(r['seed']) for r in col['runs'])} | {_ppl_cell(col)} | "
                         f"{col['best_val']:.1f} | {', '.join(str(r['best_epoch']) for r in col['runs'])} | "
                         f"{', '.join(str(len(r['val'])) for r in col['runs'])} | "
                         f"{', '.join(_stop_reason(r) for r in col['runs'])} | "
                         f"{', '.join(_gain(r['val']) for r in col['runs'])} |")
    return "\n".join(lines)


def _gain(val: List[float]) -> str:
    g = last_epoch_gain(val)
    return "-" if g is None else f"{g:.1f} %"


def convergence_line(rows) -> str:
    """How many training runs ended at a validation plateau, at the epoch cap (with the median
    last-epoch gain of those: the reader's measure of how far from converged the compared runs
    are), diverged, or for an unknown reason."""
    reasons = [_stop_reason(r) for r in rows]
    gains = sorted(g for r, why in zip(rows, reasons) if why == "cap"
                   for g in [last_epoch_gain(r["val"])] if g is not None)
    line = (f"Convergence: {reasons.count('plateau')} of {len(rows)} training runs ended at a validation "
            f"plateau, {reasons.count('cap')} at the epoch cap")
    if gains:
        line += (f" (their last epoch still lowered the best validation perplexity by a median "
                 f"{statistics.median(gains):.1f} %, range {gains[0]:.1f}-{gains[-1]:.1f} %)")
    for why, words in (("diverged", "diverged"), ("?", "ended for a reason the results do not record")):
        if reasons.count(why):
            line += f", {reasons.count(why)} {words}"
    return line + "."


def time_table(rows) -> str:
    """Seconds per epoch by phase, then compress and communicate as % of the same runs' compute
    (:func:`share_of_compute`, mean over seeds), which stay comparable across machines."""
    shares = ("compress", "communicate")
    lines = ["| model / workers | method | " + " | ".join(PHASES) + " | total s/epoch | s/step | " +
             " | ".join(f"{p} % of compute" for p in shares) + " |",
             "|---|---|" + "---|" * (len(PHASES) + 2 + len(shares))]
    for (model, w), by in groups(rows).items():
        for c in ordered_columns(list(by.values())):
            r = by[c]
            per_epoch = [r["phase_step"][p] * r["steps_per_epoch"] for p in PHASES]
            pct = [100 * _mean(share_of_compute(p)(r)) for p in shares]
            lines.append(f"| {model} / {w} | {c} | " + " | ".join(f"{x:.2f}" for x in per_epoch) +
                         f" | {sum(per_epoch):.2f} | {r['wall_step']:.3f} | " +
                         " | ".join(f"{x:.1f}" for x in pct) + " |")
    return "\n".join(lines)


def bytes_table(rows) -> str:
    lines = ["| model / workers | method | transport | sent KB/step | received KB/step | measured ratio | nominal ratio |",
             "|---|---|---|---|---|---|---|"]
    for (model, w), by in groups(rows).items():
        for c in ordered_columns(list(by.values())):
            r = by[c]
            nominal = "–" if r["nominal_ratio"] is None else f"{r['nominal_ratio']:.1f}x"
            lines.append(f"| {model} / {w} | {c} | {r['transport']} | {r['bytes_sent'] / 1e3:.1f} | "
                         f"{r['bytes_received'] / 1e3:.1f} | {r['measured_ratio']:.1f}x | {nominal} |")
    return "\n".join(lines)


def target_table(rows, target_ppl) -> str:
    """Epochs and training seconds to the target validation perplexity, mean over the seeds that
    reach it (how many did, in parentheses)."""
    tg = targets(rows, target_ppl)
    lines = ["| model / workers | target val ppl | method | epochs | seconds |", "|---|---|---|---|---|"]
    for key, by in groups(rows).items():
        if key not in tg:
            continue
        for c in ordered_columns(list(by.values())):
            runs = by[c]["runs"]
            eps = [epochs_to(r["val"], tg[key]) for r in runs]
            secs = [seconds_to(r, tg[key]) for r in runs]
            hit = [e for e in eps if e is not None]
            reached = f" ({len(hit)}/{len(runs)})" if len(runs) > 1 else ""
            e_txt = f"{_mean(hit):.1f}{reached}" if hit else f"never in {max(len(r['val']) for r in runs)}"
            s_vals = [x for x in secs if x is not None]
            s_txt = f"{_mean(s_vals):.0f}" if s_vals else "–"
            lines.append(f"| {key[0]} / {key[1]} | {tg[key]:.1f} | {c} | {e_txt} | {s_txt} |")
    return "\n".join(lines)


def lr_search_table(root: str, search: Optional[dict] = None) -> Optional[str]:
    """The learning-rate search: best validation perplexity at each value tried, the chosen value
    in bold. ``search`` as :func:`mpi_scripts.grid.choose_lr` returns it, else read from
    ``root/lr_search.json`` (written by sweep.py). None without a search."""
    if search is None:
        search = read_json(os.path.join(root, "lr_search.json"))
    if not search:
        return None
    values = sorted({float(v) for s in search.values() for v in s["values"]})
    lines = ["| cell | " + " | ".join(f"lr {v:g}" for v in values) + " | chosen |",
             "|---|" + "---|" * (len(values) + 1)]
    for key, s in sorted(search.items()):
        by = {float(k): v for k, v in s["values"].items()}
        cells = []
        for v in values:
            x = by.get(v)
            txt = "–" if x is None else ("diverged" if not math.isfinite(x) else f"{x:.1f}")
            cells.append(f"**{txt}**" if s["chosen"] is not None and v == s["chosen"] else txt)
        chosen = "none (every value failed)" if s["chosen"] is None else f"{s['chosen']:g}"
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {chosen} |")
    return "\n".join(lines)


def budget_line(root: str, rows, budget_hours: Optional[float]) -> str:
    """Compute spent (wall seconds the sweep measured, search included) against the budget."""
    n_search, search_s = search_wall_seconds(root)
    cells_s = sum(r["wall_seconds"] for r in rows)
    total_h = (search_s + cells_s) / 3600
    line = (f"Compute spent: **{total_h:.2f} h** of wall time as the sweep measured it ({len(rows)} training "
            f"runs {cells_s / 3600:.2f} h" + (f", learning-rate search {n_search} runs {search_s / 3600:.2f} h"
                                              if n_search else "") + ")")
    if budget_hours:
        line += f", against a budget of {budget_hours:g} h ({'within' if total_h <= budget_hours else 'OVER'} budget)"
    return line + "."


PANELS = (("top-k, DGC", ("none", "top-k", "DGC")), ("QSGD, random-k", ("none", "QSGD", "rand-k")))


def _panel_of(column: str) -> int:
    for i, (_, prefixes) in enumerate(PANELS):
        if column.startswith(prefixes[1:]):
            return i
    return len(PANELS)


def plots(rows, out_dir: str, target_ppl=None) -> List[str]:
    """Write the PNG plots; returns their file names."""
    plt = _pyplot()

    names = []
    g = groups(rows)
    tg = targets(rows, target_ppl)
    for (model, w), by in g.items():
        cols = ordered_columns(list(by.values()))
        panels = sorted({_panel_of(c) for c in cols if c != "none"}) or [0]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.8 * len(panels), 4.4), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for c in cols:
                if c != "none" and _panel_of(c) != panel:
                    continue
                runs = by[c]["runs"]
                mean = by[c]["val"]
                line, = ax.plot(range(1, len(mean) + 1), mean, marker=".", label=f"{c} (n={len(runs)})")
                if len(runs) > 1:  # seed band: min..max over the seeds still running at that epoch
                    lo = [min(r["val"][e] for r in runs if e < len(r["val"])) for e in range(len(mean))]
                    hi = [max(r["val"][e] for r in runs if e < len(r["val"])) for e in range(len(mean))]
                    ax.fill_between(range(1, len(mean) + 1), lo, hi, color=line.get_color(), alpha=0.2)
            if (model, w) in tg:
                ax.axhline(tg[(model, w)], color="grey", linestyle=":", linewidth=1)
            title = PANELS[panel][0] if panel < len(PANELS) else "other methods"
            ax.set(title=f"{model}, {w} worker(s): {title}", xlabel="epoch",
                   ylabel="validation perplexity (mean; band: seed min–max)", yscale="log")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        name = "val_ppl.png" if len(g) == 1 else f"val_ppl-{model}-np{w}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        names.append(name)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(g), figsize=(5.5 * len(g), 4.6), squeeze=False)
    for ax, ((model, w), by) in zip(axes[0], g.items()):
        cols = ordered_columns(list(by.values()))
        bottom = [0.0] * len(cols)
        for p in PHASES:
            vals = [by[c]["phase_step"][p] for c in cols]
            ax.bar(range(len(cols)), vals, bottom=bottom, label=p)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(cols)), cols, rotation=70, fontsize=7)
        ax.set(title=f"{model}, {w} worker(s)", ylabel="seconds per step (measured)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "time_breakdown.png"), dpi=110)
    names.append("time_breakdown.png")
    plt.close(fig)

    if tg:
        fig, axes = plt.subplots(1, len(tg), figsize=(6 * len(tg), 4.6), squeeze=False)
        for ax, key in zip(axes[0], tg):
            by = g[key]
            cols = ordered_columns(list(by.values()))
            means, errs, never = [], [], []
            for c in cols:
                secs = [seconds_to(r, tg[key]) for r in by[c]["runs"]]
                hit = [x for x in secs if x is not None]
                means.append(_mean(hit) if hit else 0.0)
                errs.append(0.0 if len(hit) < 2 else _sd(hit))
                never.append(not hit)
            ax.bar(range(len(cols)), means, yerr=errs, capsize=3,
                   color=["lightgrey" if n else "C0" for n in never])
            for i, n in enumerate(never):
                if n:
                    ax.text(i, 0, "never", rotation=90, ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(cols)), cols, rotation=70, fontsize=7)
            ax.set(title=f"{key[0]}, {key[1]} worker(s): to val ppl {tg[key]:.1f}",
                   ylabel="training seconds (mean ± sd over seeds)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "time_to_target.png"), dpi=110)
        names.append("time_to_target.png")
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    for (model, w), by in g.items():
        for c in ordered_columns(list(by.values())):
            col = by[c]
            ax.errorbar(col["bytes_sent"], col["test_ppl"], yerr=0 if col["n"] < 2 else col["test_sd"],
                        marker="o", capsize=3, linestyle="none")
            ax.annotate(c if len(g) == 1 else f"{c} ({model}/{w})", (col["bytes_sent"], col["test_ppl"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="bytes sent per step per rank (measured)",
           ylabel="test perplexity (mean ± sd over seeds)", title="Bytes vs perplexity: the trade-off")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "frontier.png"), dpi=110)
    names.append("frontier.png")
    plt.close(fig)
    auto = auto_plot(rows, out_dir)
    if auto is not None:
        names.append(auto)
    return names


def _seconds(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def auto_table(rows) -> Optional[str]:
    """Every decision of the ``compression="auto"`` runs (results.json ``auto.decisions``): step,
    cause, chosen method and route, regime, compute-only, predicted and measured step seconds,
    relative error, why. None without such runs."""
    lines = []
    for r in rows:
        if not r.get("auto"):
            continue
        lines += [f"**{r['variant']}** (seed {r['seed']}; link α {r['auto']['cost_model']['alpha_s']:.3g} s, "
                  f"β {r['auto']['cost_model']['beta_s_per_byte']:.3g} s/B at the end)", "",
                  "| step | cause | chosen | route | regime | compute s | predicted s | measured s | error | why |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for d in r["auto"]["decisions"]:
            error = "-" if d.get("error") is None else f"{d['error']:.3g}"
            lines.append(f"| {d['step']} | {d['cause']} | `{d['chosen']}` | {d.get('route', '')} | {d['regime']} | "
                         f"{_seconds(d.get('compute_s'))} | {_seconds(d.get('predicted_step_s'))} | "
                         f"{_seconds(d.get('measured_step_s'))} | {error} | {d['reason']} |")
        lines.append("")
    return "\n".join(lines).strip() or None


def auto_plot(rows, out_dir: str) -> Optional[str]:
    """``auto_choice.png``: per ``compression="auto"`` run, the chosen candidate over training
    steps (top) and each decision's predicted against measured step seconds (bottom); None without
    such runs."""
    runs = [r for r in rows if r.get("auto")]
    if not runs:
        return None
    plt = _pyplot()

    labels = list(dict.fromkeys(c for r in runs for c in r["auto"]["candidates"]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for r in runs:
        decisions = r["auto"]["decisions"]
        end = max(r["steps_per_epoch"] * len(r["val"]), decisions[-1]["step"] + 1)
        steps = [d["step"] for d in decisions] + [end]
        chosen = [labels.index(d["chosen"]) for d in decisions]
        line, = top.step(steps, chosen + chosen[-1:], where="post", label=f"{r['variant']} seed {r['seed']}")
        marks = [(d["step"], d["predicted_step_s"], d.get("measured_step_s")) for d in decisions
                 if d.get("predicted_step_s") is not None]
        if marks:
            bottom.plot([m[0] for m in marks], [m[1] for m in marks], "o--", color=line.get_color(),
                        label=f"{r['variant']}: predicted")
            measured = [m for m in marks if m[2] is not None]
            bottom.plot([m[0] for m in measured], [m[2] for m in measured], "s-", color=line.get_color(),
                        label=f"{r['variant']}: measured")
    top.set_yticks(range(len(labels)), labels, fontsize=7)
    top.set(title="compression='auto': the method in use", ylabel="candidate")
    bottom.set(xlabel="optimizer step", ylabel="seconds per step", yscale="log")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "auto_choice.png"), dpi=110)
    plt.close(fig)
    return "auto_choice.png"


def missing_cells(root: str, grid_paths: List[str]) -> List[str]:
    """Names of the cells of the given grid files that have no results.json under ``root``."""
    out = []
    for path in grid_paths:
        for cell in grid.cells_of(grid.load_grid(path, _NO_OVERRIDES)):
            if not os.path.isfile(os.path.join(root, "cells", cell.name, "results.json")):
                out.append(cell.name)
    return out


_NO_OVERRIDES = argparse.Namespace(models=None, workers=None, epochs=None, output=None, data=None, methods=None)


def grid_search(root: str, grid_paths: List[str]) -> Optional[dict]:
    """The learning-rate search of the given grids as it stands under ``root`` (methods whose
    search is complete; :func:`mpi_scripts.grid.choose_lr`), or None when they have none."""
    out = {}
    for path in grid_paths:
        cells = grid.search_cells_of(grid.load_grid(path, _NO_OVERRIDES))
        if cells:
            out.update(grid.choose_lr(root, cells))
    return out or None


def grid_notes(grid_paths: List[str]) -> List[str]:
    """The ``notes`` of the given grid files (what the grid chose and cut, in its own words)."""
    return [n for n in (grid.load_grid(p, _NO_OVERRIDES).get("notes") for p in grid_paths) if n]


def render(rows, target_ppl=None, command: str = "", plot_names=(), missing=(), root: str = "",
           budget_hours: Optional[float] = None, notes=(), search: Optional[dict] = None) -> str:
    """The whole markdown report (``search``: the learning-rate search, see :func:`lr_search_table`)."""
    if not rows:
        search = lr_search_table(root, search) if root else None
        parts = ["# hvdcomp study report", "No training run has finished yet.",
                 *[n.strip() for n in notes], budget_line(root, rows, budget_hours) if root else ""]
        if search:
            parts += ["## Learning-rate search so far (best validation perplexity; chosen in bold)", search]
        if missing:
            parts.append("## Cells not run yet\n\n" + ", ".join(f"`{m}`" for m in missing))
        return "\n\n".join(p for p in parts if p) + "\n"
    env = rows[0]["env"]
    seeded = any(len(c["runs"]) > 1 for by in groups(rows).values() for c in by.values())
    parts = [
        "# hvdcomp study report: the seed study's grid with measured communication",
        f"{len(rows)} runs. Produced by:\n\n```\n{command}\n```" if command else f"{len(rows)} runs.",
        *[n.strip() for n in notes],
        budget_line(root, rows, budget_hours) if root else "",
        "Every time below is measured by hvdcomp's phase timers on real MPI ranks (compute = forward "
        "+ backward + update; communicate = time in or waiting for collectives), and every byte count "
        "is what the rank put on the wire (counts exchange included); nothing is derived from an "
        "assumed link speed. Ranks share this machine's cores, so compute time grows with the rank "
        "count; settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())) + ". "
        "Claims 5 and 6 compare each run's communicate or compress time as a share of that run's own "
        "compute time, which cancels the machine's speed: compute per step ranged "
        f"{min(r['phase_step']['compute'] for r in rows):.2f}-"
        f"{max(r['phase_step']['compute'] for r in rows):.2f} s across these runs.",
        "Nominal ratios use the study's convention (32-bit values and indices: density 1 % = 50x).",
        "## Test perplexity (ours" + (": mean ± sample sd over seeds" if seeded else "") +
        "; the study's published value in parentheses)",
        "The study trained PTB and reports the best of 60 tuned runs; these runs train Tiny "
        "Shakespeare, so compare orderings, not values. The test perplexity is that of each run's "
        "weights with the best validation perplexity.",
        ppl_table(rows),
        "## Per method: learning rate, seeds, epochs", convergence_line(rows), method_table(rows),
    ]
    search = lr_search_table(root, search) if root else None
    if search:
        parts += ["## Learning-rate search (best validation perplexity of the short runs; chosen in bold)",
                  search]
    parts += [
        "## Time per epoch by phase (seconds, mean over ranks and seeds)",
        "Seconds depend on the machine each run had; the last two columns divide each run's phase "
        "time by its own compute time, and those compare across machines.", time_table(rows),
        "## Bytes on the wire and compression ratio", bytes_table(rows),
        "## Epochs and seconds to the target validation perplexity",
        "Target: 1.1 x the uncompressed run's best validation perplexity (mean over its seeds) at the "
        "same model and worker count, unless given. Seconds are training time measured by the run "
        "(evaluation included), on a machine shared by the ranks; like every time in seconds here, "
        "they depend on the machine each run had, so compare epochs across sessions.",
        target_table(rows, target_ppl),
        "## The study's claims against our data",
        "Each comparison is a difference of means with its seed spread sqrt(sd_a² + sd_b²): within "
        "the spread it is *not distinguishable*; with one seed it is *not judged*.",
        "\n".join(f"- **{c}** — {v}. {e}." for c, v, e in check_claims(rows, target_ppl)),
    ]
    decisions = auto_table(rows)
    if decisions:
        parts += ["## What compression='auto' decided",
                  "Each decision (hvdcomp/auto.py, docs/auto.md): predicted = compute-only + measured coding + "
                  "the cost model's communication; measured = the median step of the first window after it.",
                  decisions]
    if missing:
        parts.append("## Cells not run yet\n\n" + ", ".join(f"`{m}`" for m in missing) +
                     "\n\nRerun the same sweep command: finished cells are skipped, these are run.")
    if plot_names:
        parts.append("## Plots\n\n" + "\n".join(f"![{n}]({n})" for n in plot_names))
    return "\n\n".join(p for p in parts if p) + "\n"


# ==== ab: AB-training against full-rank data parallelism (train_cnn.py runs) ======================
#: the paper's model-compression figure (VGG16 on CIFAR-10)
PAPER_MODEL_RATIO = 44.14
#: the paper's traffic reductions: 50 % (arXiv v1 abstract) and 70.31 % (v2, mean over its runs)
PAPER_TRAFFIC_REDUCTION = (0.50, 0.7031)
#: the authors' VGG16/CIFAR-10 run (configs/cifar10/vgg16/common.yaml and ab_2nodes.yaml of
#: Helmholtz-AI-Energy/AB-Training): 150 "epochs" of 100 iterations, AdamW at 3e-3 with weight
#: decay 0.1, 10 epochs of linear warm-up from 1e-5, a cosine to 1e-5, AB warm-up 4,330 steps,
#: a sync every 759 steps, 60 full-rank steps after it, a 267-step rebound from 1e-5
AUTHORS_VGG16 = {"steps": 15000, "lr_warmup": 1000, "lr": 3e-3, "min_lr": 1e-5, "weight_decay": 0.1,
                 "ab_warmup": 4330, "period": 759, "full_rank": 60, "rebound": 267, "start_lr": 1e-5}


def _pm(xs, fmt="{:.2f}", scale=1.0):
    xs = [x * scale for x in xs]
    sd = _sd(xs)
    return fmt.format(_mean(xs)) + ("" if sd != sd else " ± " + fmt.format(sd))


def authors_decay(cfg: dict = AUTHORS_VGG16) -> float:
    """Π over the authors' run of (1 − lr_t·wd): the share of a weight AdamW's decoupled decay
    alone leaves (their learning-rate schedule with its rebounds, see the module doc of
    :mod:`hvdcomp.lowrank.ab`). Their trainer switches at the end of warm-up, at every multiple
    of ``period`` after it (sync) and ``full_rank`` steps later (factorise)."""
    c = cfg
    switches = {c["ab_warmup"]} | {t for t in range(c["ab_warmup"] + 1, c["steps"])
                                   if t % c["period"] in (0, c["full_rank"])}
    prod, slope, k = 1.0, None, 0
    for t in range(c["steps"]):
        if t < c["lr_warmup"]:
            base = c["start_lr"] + (c["lr"] - c["start_lr"]) * t / c["lr_warmup"]
        else:
            x = (t - c["lr_warmup"]) / (c["steps"] - c["lr_warmup"])
            base = c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1 + math.cos(math.pi * x))
        if t in switches:
            slope, k = (base - c["start_lr"]) / c["rebound"], 0
        lr = base
        if slope is not None and k < c["rebound"]:
            k += 1
            lr = min(base, slope * k)
        prod *= 1 - lr * c["weight_decay"]
    return prod


VERDICTS = {"?": "one seed", "~": "within the seed spread", ">": "above the seed spread",
            "<": "below the seed spread"}


def ab_compare(a: List[float], b: List[float]) -> Tuple[float, float, str]:
    """:func:`compare` (difference of means, its seed spread) with the verdict in words:
    "within the seed spread", "above"/"below the seed spread", or "one seed" (no spread)."""
    d, spread, direction = compare(a, b)
    return d, spread, VERDICTS[direction]


def ab_load(root: str) -> Dict[str, List[dict]]:
    """Method label -> runs (sorted by seed), from ``root/cells/<name>/results.json``; the label is
    the cell name between ``-np<N>-`` and ``-seed<S>``."""
    by: Dict[str, List[dict]] = defaultdict(list)
    for path, r in read_all(root, "cells/*/results.json").items():
        name = os.path.basename(os.path.dirname(path))
        label = name.split("-np", 1)[1].split("-", 1)[1].rsplit("-seed", 1)[0]
        by[label].append(r)
    return {k: sorted(v, key=lambda r: r["config"]["seed"]) for k, v in sorted(by.items())}


def is_ab(runs: List[dict]) -> bool:
    return runs[0]["config"].get("ab_training") is not None


def baseline_of(label: str, by: Dict[str, List[dict]]) -> Optional[str]:
    """The full-rank label of the same model, preferring the same weight decay."""
    cfg = by[label][0]["config"]
    same = [k for k, v in by.items() if not is_ab(v) and v[0]["config"]["model"] == cfg["model"]]
    exact = [k for k in same if by[k][0]["config"]["weight_decay"] == cfg["weight_decay"]]
    return (exact or same or [None])[0]


def _factorized(run: dict) -> Dict[str, Tuple[int, int]]:
    """Factorised weight -> (n, m) of its tall view (from the recorded spectra)."""
    names = run["config"]["ab"]["factorized"]
    return {n: tuple(run["singular_values"][n]["view"]) for n in names}


def accuracy_table(by: Dict[str, List[dict]]) -> str:
    lines = ["| model | method | weight decay | seeds | test accuracy % | vs full rank (pp) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for label, runs in by.items():
        cfg = runs[0]["config"]
        acc = [r["test_accuracy"] for r in runs]
        base = baseline_of(label, by) if is_ab(runs) else None
        if base:
            d, spread, verdict = ab_compare(acc, [r["test_accuracy"] for r in by[base]])
            vs = f"{100 * d:+.2f} (spread {100 * spread:.2f})" if spread == spread else f"{100 * d:+.2f}"
            verdict = f"{verdict} of {base}"
        else:
            vs, verdict = "", ""
        seeds = ", ".join(str(r["config"]["seed"]) for r in runs)
        lines.append(f"| {cfg['model']} | {label} | {cfg['weight_decay']:g} | {seeds} | "
                     f"{_pm(acc, scale=100)} | {vs} | {verdict} |")
    return "\n".join(lines)


def full_rank_share(run: dict) -> float:
    """Share of the run's steps that average every gradient over all ranks."""
    s = read(run, "steps_by_stage")
    return (s.get("warmup", 0) + s.get("full-rank", 0)) / run["steps"]


def traffic_table(by: Dict[str, List[dict]]) -> str:
    lines = ["| model | method | " + " | ".join(f"MB {p}" for p in STAGES) + " | MB total | ratio, mean over ranks | "
             "MB between nodes | ratio between nodes | reduction between nodes | full-rank steps | 1 / share |",
             "|---|---|" + "---|" * (len(STAGES) + 7)]
    for label, runs in by.items():
        t = [r["traffic"] for r in runs]
        stage = [_pm([read(x, "bytes_by_stage_mean").get(p, 0) for x in t], "{:.1f}", 1e-6) for p in STAGES]
        between = [x["ratio_between_nodes"] for x in t]
        share = full_rank_share(runs[0])
        lines.append(
            f"| {runs[0]['config']['model']} | {label} | " + " | ".join(stage) +
            f" | {_pm([x['bytes_sent_mean'] for x in t], '{:.1f}', 1e-6)} | {_pm([x['ratio_mean'] for x in t])}:1 | "
            f"{_pm([x['bytes_between_nodes_mean'] for x in t], '{:.1f}', 1e-6)} | "
            + (f"{_pm(between)}:1 | {_pm([x['reduction_between_nodes'] for x in t], '{:.1f}', 100)} % | "
               if None not in between else "n/a (one node) | | ")
            + f"{100 * share:.1f} % | {1 / share:.2f}:1 |")
    return "\n".join(lines)


def compression_table(by: Dict[str, List[dict]]) -> str:
    lines = ["| model | method | seeds | model compression, last factorisation | kept rank / min(dims) per factorised "
             "weight (each seed) | ceiling at rank 1 |", "|---|---|---|---|---|---|"]
    for label, runs in by.items():
        if not is_ab(runs):
            continue
        dims = _factorized(runs[0])
        P = runs[0]["config"]["parameters"]
        ceiling = P / (P - sum(n * m for n, m in dims.values()) + sum(n + m for n, m in dims.values()))
        kept = "; ".join(", ".join(f"{k} {r['model_compression']['ranks_kept'][k]}/{dims[k][1]}" for k in dims)
                         for r in runs)
        seeds = ", ".join(str(r["config"]["seed"]) for r in runs)
        lines.append(f"| {runs[0]['config']['model']} | {label} | {seeds} | "
                     f"{_pm([r['model_compression']['final']['ratio'] for r in runs])}:1 | {kept} | {ceiling:.1f}:1 |")
    return "\n".join(lines)


def history_table(by: Dict[str, List[dict]]) -> str:
    """Model compression at every factorisation of each AB-training method's first seed."""
    parts = []
    for label, runs in by.items():
        if not is_ab(runs):
            continue
        run = runs[0]
        dims = _factorized(run)
        rows = [f"**{label}**, seed {run['config']['seed']}:", "",
                "| step | model compression | " + " | ".join(dims) + " |", "|---|---|" + "---|" * len(dims)]
        for h in run["model_compression"]["history"]:
            rows.append(f"| {h['step']} | {h['ratio']:.2f}:1 | " + " | ".join(str(h["ranks"][k]) for k in dims) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def spectra_table(by: Dict[str, List[dict]], cutoff: float) -> str:
    lines = ["| model | method | weight decay | Π(1 − lr·wd) | weight (tall view) | σ_1 | σ_i > "
             f"{cutoff:g}·σ_1 | σ_min / σ_1 |", "|---|---|---|---|---|---|---|---|"]
    factor_names = {}
    for runs in by.values():
        if is_ab(runs):
            factor_names.setdefault(runs[0]["config"]["model"], runs[0]["config"]["ab"]["factorized"])
    for label, runs in by.items():
        run, model = runs[0], runs[0]["config"]["model"]
        decay = run.get("adamw_decay_factor")
        for name in factor_names.get(model, []):
            sv = run["singular_values"][name]
            s = sv["sigma"]
            above = sum(x > cutoff * s[0] for x in s)
            lines.append(f"| {model} | {label} | {run['config']['weight_decay']:g} | "
                         f"{'' if decay is None else f'{decay:.2f}'} | {name} ({sv['view'][0]} x {sv['view'][1]}) | "
                         f"{s[0]:.2f} | {above} / {len(s)} | {s[-1] / s[0]:.2g} |")
    return "\n".join(lines)


def paper_section(by: Dict[str, List[dict]]) -> str:
    """The comparison with the paper's two figures, each with its own kind, as computed verdicts."""
    low, high = PAPER_TRAFFIC_REDUCTION
    out = [f"The paper reports network traffic reduced by {100 * low:.0f} % (arXiv v1) and {100 * high:.2f} % "
           f"(v2, mean over its scaling runs), i.e. {1 / (1 - low):.1f}:1 to {1 / (1 - high):.2f}:1, and a "
           f"model compression of {PAPER_MODEL_RATIO}:1 on VGG16 / CIFAR-10. The first is traffic, the second "
           "the size of the factorised model: each is compared with its own kind below.", "",
           "| model | method | reduction between nodes | against the paper's 50–70 % | accuracy against full rank | "
           "traffic target | model compression | against 44.14:1 |", "|---|---|---|---|---|---|---|---|"]
    why = []
    for label, runs in by.items():
        if not is_ab(runs):
            continue
        red = [r["traffic"]["reduction_between_nodes"] for r in runs]
        base = baseline_of(label, by)
        if None in red or base is None:
            continue
        m = _mean(red)
        place = "within" if low <= m <= high else ("above" if m > high else "below")
        _, _, acc = ab_compare([r["test_accuracy"] for r in runs], [r["test_accuracy"] for r in by[base]])
        met = place in ("within", "above") and acc in ("within the seed spread", "above the seed spread")
        target = "not judged (one seed)" if acc == "one seed" else ("met" if met else "missed")
        comp = _mean([r["model_compression"]["final"]["ratio"] for r in runs])
        out.append(f"| {runs[0]['config']['model']} | {label} | {100 * m:.1f} % ({1 / (1 - m):.2f}:1) | {place} | "
                   f"{acc} of {base} | {target} | {comp:.2f}:1 | {comp / PAPER_MODEL_RATIO:.1%} of it |")
        dims = _factorized(runs[0])
        P = runs[0]["config"]["parameters"]
        unfact = P - sum(n * m for n, m in dims.values())
        ceiling = P / (unfact + sum(n + m for n, m in dims.values()))
        kept = runs[0]["model_compression"]["ranks_kept"]
        base_sv = by[base][0]["singular_values"]
        cutoff = runs[0]["config"]["ab"]["cutoff"]
        base_above = {k: sum(x > cutoff * base_sv[k]["sigma"][0] for x in base_sv[k]["sigma"]) for k in dims}
        decay = runs[0].get("adamw_decay_factor")
        why.append(
            f"- **{label}** ({comp:.2f}:1): its factorised weights hold {1 - unfact / P:.0%} of the "
            f"{P:,} parameters, and the {unfact:,} it never factorises (1-D parameters and "
            f"{', '.join(runs[0]['config']['ab']['full_rank'])}) cap the ratio at {ceiling:.1f}:1 even at rank 1 "
            f"everywhere. Kept ranks at the "
            f"last factorisation (seed {runs[0]['config']['seed']}): "
            + ", ".join(f"{k} {kept[k]} of {dims[k][1]}" for k in dims)
            + f"; the final weights of {base} (weight decay {by[base][0]['config']['weight_decay']:g}, "
            f"seed {by[base][0]['config']['seed']}) have "
            + ", ".join(f"{base_above[k]}" for k in dims) + f" singular values above {cutoff:g}·σ_1. "
            + ("" if decay is None else f"AdamW's decay leaves a weight untouched by gradients at {decay:.2f} of "
               f"itself over this run, against {authors_decay():.2f} over the authors' 15,000 steps. "))
    out += ["", "Why the model compression stays where it does:", ""] + why
    return "\n".join(out)


def plot_accuracy(by: Dict[str, List[dict]], out_dir: str) -> str:
    """``ab_accuracy.png``: test accuracy (%) per epoch, mean over seeds with a min–max band, one
    panel per model."""
    plt = _pyplot()
    models = sorted({v[0]["config"]["model"] for v in by.values()})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for label, runs in by.items():
            if runs[0]["config"]["model"] != model:
                continue
            n = min(len(r["epochs"]) for r in runs)
            accs = [[100 * r["epochs"][e]["test_accuracy"] for r in runs] for e in range(n)]
            line, = ax.plot(range(1, n + 1), [_mean(a) for a in accs], label=f"{label} (n={len(runs)})")
            if len(runs) > 1:
                ax.fill_between(range(1, n + 1), [min(a) for a in accs], [max(a) for a in accs],
                                color=line.get_color(), alpha=0.2)
        ax.set(xlabel="epoch", ylabel="test accuracy % (mean; band: seed min–max)", ylim=(80, 100), title=model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ab_accuracy.png"), dpi=110)
    plt.close(fig)
    return "ab_accuracy.png"


def plot_compression(by: Dict[str, List[dict]], out_dir: str) -> str:
    """``ab_compression.png``: model compression at every factorisation (step), every seed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for label, runs in by.items():
        if not is_ab(runs):
            continue
        color = None
        for r in runs:
            h = r["model_compression"]["history"]
            line, = ax.plot([x["step"] for x in h], [x["ratio"] for x in h], marker=".", color=color,
                            label=label if color is None else None)
            color = line.get_color()
    ax.set(xlabel="optimizer step", ylabel="model compression (full / factorised parameters)", yscale="log",
           title="Model compression at each factorisation (every seed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ab_compression.png"), dpi=110)
    plt.close(fig)
    return "ab_compression.png"


def plot_spectra(by: Dict[str, List[dict]], out_dir: str) -> str:
    """``ab_spectra.png``: σ_i / σ_1 of the factorised weights at the end (first seed), per model."""
    plt = _pyplot()
    names = {}
    for runs in by.values():
        if is_ab(runs):
            names.setdefault(runs[0]["config"]["model"], runs[0]["config"]["ab"]["factorized"])
    models = sorted(names)
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6.5 * max(1, len(models)), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for label, runs in by.items():
            if runs[0]["config"]["model"] != model:
                continue
            for i, name in enumerate(names[model]):
                s = runs[0]["singular_values"][name]["sigma"]
                ax.plot([j / len(s) for j in range(len(s))], [x / s[0] for x in s], lw=1,
                        ls=("-", "--", ":", "-.")[i % 4], label=f"{label}: {name}")
        ax.axhline(0.15, color="k", lw=0.8)
        ax.set(xlabel="i / min(dims)", ylabel="σ_i / σ_1", yscale="log",
               title=f"{model}: spectra at the end (seed 1)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ab_spectra.png"), dpi=110)
    plt.close(fig)
    return "ab_spectra.png"


def ab_render(by: Dict[str, List[dict]], command: str = "", plots: Tuple[str, ...] = (), notes: str = "") -> str:
    """The markdown report."""
    if not by:
        return "# AB-training on the digits\n\nNo results.json found.\n"
    cfg = next(iter(by.values()))[0]["config"]
    ab_cfg = next((v[0]["config"]["ab"] for v in by.values() if is_ab(v)), None)
    sizes = ", ".join(sorted({f"{v[0]['config']['model']} {v[0]['config']['parameters']:,}" for v in by.values()}))
    layout = (f"{cfg['world_size']} ranks as {cfg['nodes']} emulated nodes of {cfg['world_size'] // cfg['nodes']}"
              if cfg.get("nodes", 1) > 1 else f"{cfg['world_size']} ranks on one node")
    setup = (f"Data: {cfg['data']}. {layout}; global batch {cfg['batch_size']}, {cfg['epochs']} epochs "
             f"({next(iter(by.values()))[0]['steps']} steps); parameters: {sizes}. Optimizer {cfg['optimizer']} at "
             f"lr {cfg['lr']:g}, clip {cfg['clip']:g}, label smoothing {cfg['label_smoothing']:g}, "
             f"init {cfg['init']}, learning-rate warm-up {cfg['lr_warmup_epochs']:g} epochs, "
             f"cosine to {cfg['min_lr']:g}.")
    kept_full = {v[0]["config"]["model"]: v[0]["config"]["ab"]["full_rank"] for v in by.values() if is_ab(v)}
    if ab_cfg:
        setup += (f" AB-training: mode {ab_cfg['mode']} (sync {ab_cfg['sync']}), {ab_cfg['orientation']} factors, "
                  f"rank groups {read(ab_cfg, 'rank_groups')} ({read(ab_cfg, 'n_rank_groups')} rank groups), "
                  f"warm-up {ab_cfg['warmup_steps']} steps, "
                  f"cycles of {ab_cfg['steps_between_syncs']} grouped + {ab_cfg['full_rank_steps']} full-rank steps, "
                  f"rebound {ab_cfg['ramp_steps']} steps, cutoff {ab_cfg['cutoff']:g} "
                  f"({'cut' if ab_cfg['cut_first'] else 'exact'} at the first factorisation); never factorised "
                  "besides the 1-D parameters: "
                  + "; ".join(f"{m}: {', '.join(names)}" for m, names in sorted(kept_full.items())) + ".")
    cutoff = ab_cfg["cutoff"] if ab_cfg else 0.15
    parts = [
        "# AB-training on scikit-learn's digits against full-rank data parallelism",
        f"Produced by:\n\n```\n{command}\n```" if command else "",
        setup + (" " + notes.strip() if notes else ""),
        "Two figures are reported apart, as the paper (Coquelin et al., arXiv:2405.01067) keeps them: "
        "**traffic**, the bytes sent over the whole run against full-rank data parallelism (every fp32 "
        "gradient every step), and **model compression**, the parameters of the factorised model against "
        "the full model (the paper's 44.14:1 is of this kind).",
        "## Test accuracy", accuracy_table(by),
        "## Traffic",
        "Bytes per rank over the whole run, mean over ranks (± sd over seeds), counted at the collective "
        "(an Allreduce of n bytes sends n; a broadcast sends n at its root). Between nodes: bytes of "
        "collectives whose communicator spans both nodes (the grouped steps stay inside a node). "
        "The last column is the bound 1 / (share of full-rank steps), reached if grouped steps and syncs "
        "cost nothing between nodes.",
        traffic_table(by),
        "## Model compression", compression_table(by),
        "The ceiling is the ratio with every factorised weight at rank 1 (the unfactorised parameters "
        "as they are). Over the run, at every factorisation:",
        history_table(by),
        "## Singular values at the end of training (first seed)", spectra_table(by, cutoff),
        "## Against the paper", paper_section(by),
        "## Plots\n\n" + "\n\n".join(f"![{p}]({p})" for p in plots) if plots else ""]
    return "\n\n".join(p for p in parts if p) + "\n"


# ==== speed: kernels, end-to-end steps on rate-limited links, the α-β cost model, overhead ========
RATES = ["none", "1gbit", "100mbit", "10mbit"]
RATE_LABEL = {"none": "unlimited", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s"}
TARGET_METHODS = ["hvdcomp:topk:density=0.01", "hvdcomp:dgc:density=0.01"]
#: issue 17: at 4 ranks on 100 Mbit/s links these must be faster per step than the fastest stock
#: Horovod configuration and than DDP with its fp16 hook (transformer encoder); top-k also with
#: granularity="bucket" (the option issue 17 adds for models of many small tensors)
TRANSFORMER_TARGET = {"methods": ["hvdcomp:topk:density=0.01", "hvdcomp:topk:density=0.01@bucket",
                                  "hvdcomp:powersgd:rank=2"],
                      "rate": "100mbit", "ranks": 4, "peer": "ddp:fp16"}
EXTRAPOLATE = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
#: which collective carries each method's payload (for the cost model)
ALLREDUCE_METHODS = ("none", "fp16", "powersgd")


def slug_rate(path: str) -> str:
    return os.path.basename(os.path.dirname(path))


# ---- end-to-end ----------------------------------------------------------------------------------
def load_e2e(directory: str) -> Dict[str, Dict[str, dict]]:
    """{contender: {rate: cell}} (failed cells included, with status 'failed')."""
    out: Dict[str, Dict[str, dict]] = {}
    for path, cell in read_all(directory, "cells/*/*.json").items():
        if cell.get("bench", "e2e") != "e2e" or "contender" not in cell:
            continue
        out.setdefault(cell["contender"], {})[slug_rate(path)] = cell
    return out


def order(e2e) -> List[str]:
    """hvdcomp methods first (none, fp16, then by name), then the peers in ``peers.PEERS`` order."""
    def key(c):
        family = 0 if c.startswith("hvdcomp:") else 1
        first = {"hvdcomp:none": 0, "hvdcomp:fp16": 1}.get(c, 2) if family == 0 else (
            PEERS.index(c) if c in PEERS else len(PEERS))
        return family, first, c
    return sorted(e2e, key=key)


def loaded(cell: Optional[dict]) -> bool:
    """The cell started on a loaded machine (load average above the core count; ``hygiene.py``):
    its figures are not evidence and it is left out of every table and verdict."""
    return bool(cell) and bool(((cell.get("driver") or {}).get("machine") or {}).get("loaded"))


def ok(cell: Optional[dict]) -> bool:
    """A cell that finished and ran on a quiet machine."""
    return bool(cell) and cell.get("status") == "ok" and not loaded(cell)


def step_s(cell) -> Optional[float]:
    return cell["timing"]["step"]["median"] if ok(cell) else None


def compute_s(cell) -> Optional[float]:
    ref = cell["timing"].get("compute_reference") if ok(cell) else None
    return ref["median"] if ref else None


def comm_wait_s(cell, last_rank: bool = False) -> Optional[float]:
    """Instrumented communication on the critical path: hvdcomp's 'communicate' phase (time the
    training thread waits), stock Horovod's synchronize(); None for DDP (not instrumented).

    Default: per step the slowest rank's wait (includes waiting for other ranks' compute, which
    with 4 ranks on 2 cores is large). ``last_rank``: per step the smallest wait over ranks, i.e.
    the rank that arrived last and waited only for the transfer."""
    if not ok(cell):
        return None
    t = cell["timing"]
    rec = (t.get("phases") or {}).get("communicate") if cell.get("family") in ("hvdcomp", "hvdcomp-ddp") else None
    if rec is None and cell.get("family") == "horovod":
        rec = t.get("parts", {}).get("sync")
    if rec is None:
        return None
    if last_rank:
        return rec.get("median_of_rank_min")
    return rec["median"]


def phase_s(cell, phase: str) -> Optional[float]:
    """hvdcomp's PhaseTimer phase (median over steps of the slowest rank); None for peers."""
    rec = ((cell or {}).get("timing", {}).get("phases") or {}).get(phase) if ok(cell) else None
    return rec["median"] if rec else None


def comm_est_s(cell) -> Optional[float]:
    """Step minus the communication-free compute step (every contender alike)."""
    return cell["timing"].get("comm_critical_seconds") if ok(cell) else None


def bytes_sent(cell) -> Optional[float]:
    if not ok(cell):
        return None
    measured = (cell.get("bytes") or {}).get("measured") or {}
    if "bytes_sent" in measured:
        return measured["bytes_sent"]["median"]
    return (cell.get("bytes") or {}).get("payload_per_step_est")


def nic_tx(cell) -> Optional[float]:
    if not ok(cell):
        return None
    part = cell["timing"].get("parts", {}).get("nic_tx_bytes")
    return part["median"] if part else None


def fmt(v, spec=".2f", none="–"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def fastest_horovod(e2e, rate: str, metric=step_s, configs=STOCK_HOROVOD):
    """``(contender, value)`` of the stock Horovod configuration with the smallest ``metric`` (seconds)
    at ``rate`` among those measured; ``(None, None)`` when none was. This is the reference of every
    "x faster than Horovod" in the report."""
    measured = [(c, metric(e2e.get(c, {}).get(rate))) for c in configs]
    measured = [(c, v) for c, v in measured if v is not None]
    return min(measured, key=lambda t: t[1]) if measured else (None, None)


def failure(cell) -> str:
    """The most telling error line: an exception message from the output if there is one."""
    for line in (cell.get("output_tail") or "").splitlines():
        if any(k in line for k in ("what():", "Error:", "EnforceNotMet]", "Traceback")) and "help" not in line:
            if "Traceback" not in line:
                return line.strip()[:220].replace("|", "/")
    err = cell.get("error") or []
    text = err[-1] if isinstance(err, list) and err else cell.get("reason", "failed")
    return str(text)[:220].replace("|", "/")


def time_to_target(e2e, rates) -> dict:
    """Steps to reach the target validation perplexity (from the unlimited-link runs, which
    evaluate every few steps) times each rate's median step time."""
    base = e2e.get("hvdcomp:none", {}).get("none")
    if not ok(base) or len(base.get("val_ppl_curve", [])) < 3:
        return {"target": None}
    curve = base["val_ppl_curve"]
    # the target: what uncompressed training reaches two thirds into the run
    step_t, target = curve[max(1, (2 * (len(curve) - 1)) // 3)]
    out = {"target": target, "target_step": step_t, "rows": {}, "slack": 0.01}
    for c, cells in e2e.items():
        cell = cells.get("none")
        if not ok(cell):
            continue
        # 1 % slack: runs with identical maths (none under hvdcomp, Horovod, DDP) differ in rounding
        reached = next((s for s, p in cell["val_ppl_curve"] if s > 0 and p <= target * 1.01), None)
        row = {"steps": reached, "final_ppl": cell["val_ppl_curve"][-1][1],
               "last_step": cell["val_ppl_curve"][-1][0]}
        for r in rates:
            st = step_s(cells.get(r))
            row[r] = None if reached is None or st is None else reached * st
        out["rows"][c] = row
    return out


def save_log_plot(plt, fig, ax, path: str) -> None:
    """Log y axis, legend, write ``path`` (PNG) and close the figure."""
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_title(cell: dict) -> str:
    """What the cells trained: the worker's description (the LSTM's size for cells that lack it)."""
    config = cell.get("config", {})
    text = config.get("model_description") or f"{config.get('model', 'medium')} LSTM"
    return text[:1].upper() + text[1:]


def settings_line(e2e) -> str:
    """The environment every ok cell shared, plus each contender's own launch settings."""
    cells = [c for cells in e2e.values() for c in cells.values() if ok(c)]
    shared = set.intersection(*(set(c.get("env", {}).items()) for c in cells))
    own: Dict[tuple, List[str]] = {}  # launch settings -> contenders that had them
    for c in order({c["contender"]: None for c in cells if c.get("launch_env")}):
        env = next(x["launch_env"] for x in cells if x["contender"] == c)
        own.setdefault(tuple(sorted(env.items())), []).append(c)
    text = ("Same settings for every contender: "
            + ", ".join(f"`{k}={v}`" for k, v in sorted(shared) if k.startswith(("OMPI_MCA", "HOROVOD", "OMP_"))))
    for env, contenders in own.items():
        text += f"; {', '.join(map(label, contenders))} also " + ", ".join(f"`{k}={v}`" for k, v in env)
    return text + " (all recorded per rank in each cell's JSON)."


def e2e_section(e2e, figdir, prefix: str = "") -> (List[str], dict):
    """Step times per rate with speed-ups against the fastest stock Horovod configuration, where the
    time goes, time to a target perplexity (corpus runs only) and plots (``<prefix>*.png``)."""
    lines, summary = [], {}
    if not e2e:
        return ["No end-to-end results found (run `benchmarks/netem_e2e.py`)."], summary
    rates = [r for r in RATES if any(r in cells for cells in e2e.values())]
    contenders = order(e2e)
    any_cell = next((c for cells in e2e.values() for c in cells.values() if ok(c)), None)
    if any_cell is None:
        return ["Every end-to-end cell failed:", ""] + [
            f"- {label(c)} at {RATE_LABEL.get(r, r)}: `{failure(cell)}`"
            for c, cells in e2e.items() for r, cell in cells.items()], summary
    title = model_title(any_cell)
    left_out = [f"{label(c)} at {RATE_LABEL.get(r, r)}" for c, cells in e2e.items() for r, cell in cells.items()
                if loaded(cell)]
    if left_out:
        lines += [f"Left out, started on a loaded machine (load average above the core count): "
                  f"{', '.join(left_out)}.", ""]
    synthetic = any_cell["config"].get("data") == "synthetic"
    lines += [f"{title} ({any_cell['config']['parameters']:,} parameters"
              + (f" in {any_cell['config']['tensors']} tensors" if "tensors" in any_cell["config"] else "")
              + f", {4 * any_cell['config']['parameters'] / 1e6:.1f} MB of fp32 gradient), "
              f"{any_cell['world_size']} ranks on {any_cell['world_size']} emulated hosts "
              f"({', '.join(sorted(set(any_cell['hostnames'])))}), Open MPI over TCP, links shaped with "
              "`tc tbf` at both ends (full duplex per host). " + settings_line(e2e), ""]
    # step time table; speed-ups against the fastest stock Horovod configuration at each rate
    limited = [r for r in rates if r != "none"]
    refs = {r: fastest_horovod(e2e, r) for r in limited}
    summary["fastest_horovod"] = {r: {"contender": c, "step_s": v} for r, (c, v) in refs.items()}
    ref_text = "; ".join(f"{RATE_LABEL[r]}: {label(c) if c else 'not measured'}" for r, (c, _) in refs.items())
    lines += ["### Seconds per step (median of timed steps; per step the slowest rank)", "",
              "| contender | " + " | ".join(RATE_LABEL[r] for r in rates) + " | speed-up vs the fastest stock "
              f"Horovod configuration at {', '.join(RATE_LABEL[r] for r in limited)} ({ref_text}) |",
              "|---|" + "---|" * len(rates) + "---|"]
    for c in contenders:
        cells = e2e[c]
        vals = []
        for r in rates:
            cell = cells.get(r)
            if cell is None:
                vals.append("not run")
            elif not ok(cell):
                vals.append("failed")
            else:
                vals.append(fmt(step_s(cell)))
        speed = []
        for r in limited:
            b, s = refs[r][1], step_s(cells.get(r))
            speed.append(fmt(b / s if b and s else None, ".2f") + ("x" if b and s else ""))
        lines.append(f"| {label(c)} | " + " | ".join(vals) + " | " + ", ".join(speed) + " |")
    fails = [(c, r, cell) for c, cells in e2e.items() for r, cell in cells.items() if not ok(cell) and not loaded(cell)]
    if fails:
        lines += ["", "Failed cells (error as recorded):", ""]
        lines += [f"- {label(c)} at {RATE_LABEL.get(r, r)}: `{failure(cell)}`" for c, r, cell in fails]
    # breakdown table
    lines += ["", "### Where the time goes", "",
              "compute = the same step on a communication-free copy of the model (median of 3, after "
              "training, all 4 ranks computing at once on 2 cores, so it can exceed a real step in which "
              "ranks take turns); comm (est.) = step − compute, for every contender alike; wait max / "
              "wait last = time the training thread waited for communication (hvdcomp's `communicate` "
              "phase; stock Horovod's `synchronize()`), per step on the slowest rank (includes waiting "
              "for other ranks' compute) / on the rank that arrived last (the transfer itself); DDP "
              "overlaps inside backward and is not instrumented. NIC tx = bytes the host's link "
              "transmitted during the step (frames incl. TCP/IP headers, all traffic of that rank).",
              "compress / decompress: hvdcomp's phases (slowest rank, median).",
              "", "| contender | rate | step s | compute s | comm est. s | wait max s | wait last s | "
              "compress s | decompress s | sent B/step/rank | NIC tx B/step/rank |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in contenders:
        for r in rates:
            cell = e2e[c].get(r)
            if not ok(cell):
                continue
            lines.append(f"| {label(c)} | {RATE_LABEL[r]} | {fmt(step_s(cell))} | {fmt(compute_s(cell))} | "
                         f"{fmt(comm_est_s(cell), '.3f')} | {fmt(comm_wait_s(cell), '.3f')} | "
                         f"{fmt(comm_wait_s(cell, last_rank=True), '.3f')} | {fmt(phase_s(cell, 'compress'), '.3f')} | "
                         f"{fmt(phase_s(cell, 'decompress'), '.3f')} | "
                         f"{fmt(bytes_sent(cell), ',.0f')} | {fmt(nic_tx(cell), ',.0f')} |")
    summary["step_s"] = {c: {r: step_s(cells.get(r)) for r in rates} for c, cells in e2e.items()}
    summary["comm_wait_s"] = {c: {r: comm_wait_s(cells.get(r)) for r in rates} for c, cells in e2e.items()}
    summary["comm_wait_last_rank_s"] = {c: {r: comm_wait_s(cells.get(r), True) for r in rates}
                                        for c, cells in e2e.items()}
    summary["comm_est_s"] = {c: {r: comm_est_s(cells.get(r)) for r in rates} for c, cells in e2e.items()}
    # time to target
    if synthetic:
        lines += ["", "No validation perplexity: this model trains on synthetic data (time per step only)."]
    else:
        ttt = time_to_target(e2e, rates)
        summary["time_to_target"] = ttt
        lines += ["", "### Time to a target validation perplexity", ""]
        if ttt.get("target") is None:
            lines.append("Not available: the unlimited-link runs did not evaluate during training.")
        else:
            lines += [f"Target: validation perplexity {ttt['target']:.1f} (+1 % slack for rounding), what "
                      f"uncompressed hvdcomp (`none`) reached after {ttt['target_step']} steps on the unlimited "
                      "link. Steps to target are "
                      "taken from the unlimited-link runs (validation every few steps; the optimisation "
                      "does not depend on the link), times each rate's median step time (evaluation "
                      "excluded).", "",
                      "| contender | steps to target | final ppl (step) | " + " | ".join(
                          f"s to target, {RATE_LABEL[r]}" for r in rates) + " |",
                      "|---|---|---|" + "---|" * len(rates)]
            for c in [c for c in order(e2e) if c in ttt["rows"]]:
                row = ttt["rows"][c]
                steps = row["steps"] if row["steps"] is not None else f"not within {row['last_step']}"
                lines.append(f"| {label(c)} | {steps} | {row['final_ppl']:.1f} ({row['last_step']}) | "
                             + " | ".join(fmt(row[r], ".0f") for r in rates) + " |")
    # plots
    try:
        plt = _pyplot()

        fig, ax = plt.subplots(figsize=(8, 5))
        xs = list(range(len(rates)))
        for c in contenders:
            ys = [step_s(e2e[c].get(r)) for r in rates]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                style = "-o" if c.startswith("hvdcomp") else "--s"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label(c))
        ax.set_xticks(xs, [RATE_LABEL[r] for r in rates])
        ax.set_ylabel("seconds per step (median)")
        ax.set_title(f"{title.split(' (')[0]}, {any_cell['world_size']} ranks on {any_cell['world_size']} "
                     "emulated hosts")
        save_log_plot(plt, fig, ax, os.path.join(figdir, f"{prefix}step_time_vs_bandwidth.png"))
        lines += ["", f"![step time]({prefix}step_time_vs_bandwidth.png)"]
        if not synthetic:
            fig, ax = plt.subplots(figsize=(8, 5))
            for c in contenders:
                cell = e2e[c].get("none")
                if ok(cell) and len(cell.get("val_ppl_curve", [])) > 1:
                    curve = cell["val_ppl_curve"]
                    ax.plot([s for s, _ in curve], [p for _, p in curve], "-o", ms=3, label=label(c))
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("validation perplexity")
            save_log_plot(plt, fig, ax, os.path.join(figdir, f"{prefix}val_ppl_unlimited.png"))
            lines += ["", f"![validation]({prefix}val_ppl_unlimited.png)"]
    except ImportError:
        lines += ["", "(matplotlib missing: no plots)"]
    return lines, summary


def targets_section(e2e) -> List[str]:
    """The issue's targets on the LSTM, each met or missed with the numbers; every comparison with
    Horovod is against its fastest configuration at that rate (:func:`fastest_horovod`)."""
    lines = ["| target | method | measured | verdict |", "|---|---|---|---|"]

    def cell(c, r):
        return e2e.get(c, {}).get(r)

    for m in TARGET_METHODS:
        for r in ("1gbit", "100mbit", "10mbit"):
            for last, how in ((True, "wait of the last-arriving rank"), (False, "wait of the slowest rank")):
                mine = comm_wait_s(cell(m, r), last)
                ref, base = fastest_horovod(e2e, r, lambda x, last=last: comm_wait_s(x, last))
                if mine is not None and base is not None:
                    ratio = base / max(mine, 1e-9)
                    lines.append(f"| comm on the critical path ≥ 20x lower than stock Horovod's fastest "
                                 f"({RATE_LABEL[r]}; {how}) | {label(m)} | {label(ref)} {base:.3f} s vs {mine:.3f} s "
                                 f"= {ratio:.1f}x | {'met' if ratio >= 20 else 'missed'} |")
        a, b = step_s(cell(m, "100mbit")), step_s(cell(m, "none"))
        if a and b:
            lines.append(f"| step at 100 Mbit/s ≤ 1.1x same method unlimited | {label(m)} | {a:.2f} / {b:.2f} s "
                         f"= {a / b:.2f}x | {'met' if a / b <= 1.1 else 'missed'} |")
        a = step_s(cell(m, "10mbit"))
        ref, b = fastest_horovod(e2e, "10mbit")
        if a and b:
            lines.append(f"| ≥ 5x faster than stock Horovod's fastest at 10 Mbit/s | {label(m)} | {label(ref)} "
                         f"{b:.2f} / {a:.2f} s = {b / a:.1f}x | {'met' if b / a >= 5 else 'missed'} |")
        peers = [(p, step_s(cell(p, "100mbit"))) for p in PEERS]
        peers = [(p, s) for p, s in peers if s]
        a = step_s(cell(m, "100mbit"))
        if a and peers:
            best, bs = min(peers, key=lambda t: t[1])
            lines.append(f"| faster than the best peer at 100 Mbit/s | {label(m)} | {a:.2f} s vs {label(best)} "
                         f"{bs:.2f} s | {'met' if a < bs else 'missed'} |")
    bases = [(b, step_s(cell(b, "none"))) for b in ("hvdcomp:none",) + STOCK_HOROVOD_DENSE]
    bases = [(b, s) for b, s in bases if s]
    for m in [c for c in order(e2e) if c.startswith("hvdcomp:") and c != "hvdcomp:none"]:
        a = step_s(cell(m, "none"))
        if a and bases:
            base, b = min(bases, key=lambda t: t[1])  # the faster uncompressed step: the stricter test
            lines.append(f"| unlimited: compressed step ≤ 1.2x the uncompressed step ({label(base)}) | {label(m)} | "
                         f"{a:.2f} / {b:.2f} s = {a / b:.2f}x | {'met' if a / b <= 1.2 else 'missed'} |")
    return lines


def transformer_target(e2e) -> (List[str], List[dict]):
    """Issue 17's transformer target (:data:`TRANSFORMER_TARGET`): per method, met when its step is
    shorter than both the fastest stock Horovod configuration's and DDP fp16's at the target rate,
    at the target rank count; otherwise missed, or not measured (naming what is missing)."""
    t = TRANSFORMER_TARGET
    rate, what = t["rate"], (f"faster per step than stock Horovod's fastest and than {label(t['peer'])}, "
                             f"{t['ranks']} ranks, {RATE_LABEL[t['rate']]}")
    lines = ["| target | method | measured | verdict |", "|---|---|---|---|"]
    verdicts = []

    def measured(c):
        cell = e2e.get(c, {}).get(rate)
        if cell is not None and ok(cell) and cell.get("world_size") != t["ranks"]:
            return None, f"{label(c)} ran at {cell.get('world_size')} ranks"
        if cell is None:
            return None, f"{label(c)} not run"
        return (step_s(cell), None) if ok(cell) else (None, f"{label(c)} " + ("ran on a loaded machine" if loaded(cell) else f"failed: {failure(cell)}"))

    ref, ref_s = fastest_horovod(e2e, rate, lambda c: step_s(c) if ok(c) and c.get("world_size") == t["ranks"]
                                 else None)
    peer_s, peer_why = measured(t["peer"])
    for m in t["methods"]:
        a, why = measured(m)
        missing = [w for w in (why, None if ref else f"no stock Horovod configuration measured at {t['ranks']} ranks", peer_why) if w]
        if missing:
            verdict, text = "not measured", "; ".join(missing)
        else:
            verdict = "met" if a < ref_s and a < peer_s else "missed"
            text = (f"{a:.2f} s vs {label(ref)} {ref_s:.2f} s ({ref_s / a:.2f}x) and {label(t['peer'])} "
                    f"{peer_s:.2f} s ({peer_s / a:.2f}x)")
        lines.append(f"| {what} | {label(m)} | {text} | {verdict} |")
        verdicts.append({"method": m, "verdict": verdict, "step_s": a, "horovod": ref, "horovod_step_s": ref_s,
                         "peer": t["peer"], "peer_step_s": peer_s})
    return lines, verdicts


# ---- cost model ----------------------------------------------------------------------------------
def load_comm(directory: str) -> Dict[str, Dict[int, dict]]:
    out: Dict[str, Dict[int, dict]] = {}
    for path, cell in read_all(directory, "cells/*/comm-np*.json").items():
        if ok(cell):
            out.setdefault(slug_rate(path), {})[int(cell["world_size"])] = cell
    return out


def fit_rate(cells: Dict[int, dict]) -> Dict[str, dict]:
    """Per collective: joint ring fit over 2 and 4 ranks and its worst relative error."""
    fits = {}
    for name, kind in (("mpi-allgatherv", "allgather"), ("hvd-allreduce", "allreduce"),
                       ("mpi-allreduce", "allreduce")):
        samples = []
        for p, cell in cells.items():
            for row in cell.get("collectives", {}).get(name, []):
                a, b = collective_terms(kind, p, row["bytes"])
                samples.append((a, b, row["seconds"], p, row["bytes"]))
        if len(samples) < 2:
            continue
        model = fit_alpha_beta([s[:3] for s in samples])
        big = [abs(model.alpha * a + model.beta * b - t) / t for a, b, t, _, n in samples if n >= 2**18]
        small = [t for _, _, t, _, n in samples if n <= 4096]
        fits[name] = {"alpha_s": model.alpha, "beta_s_per_byte": model.beta, "kind": kind,
                      "max_rel_error_256KiB_up": max(big) if big else None, "points": len(samples),
                      "small_message_s": min(small) if small else None}
    return fits


def method_kind(spec: str) -> (str, int):
    name = spec.split(":")[0]
    if name in ALLREDUCE_METHODS:
        return "allreduce", 2 if name == "powersgd" else 1
    return "allgather", 2  # counts exchange + data


def predict(fits, spec, p, nbytes) -> Optional[float]:
    """Predicted communication seconds of one step of ``spec`` on ``p`` ranks."""
    kind, calls = method_kind(spec)
    # allreduce: the MPI fit (Horovod's adds its cycle time once per collective, which a per-hop
    # ring latency would wrongly multiply by 2(p-1) when extrapolating)
    fit = (fits.get("mpi-allreduce") or fits.get("hvd-allreduce")) if kind == "allreduce" else fits.get("mpi-allgatherv")
    if not fit:
        return None
    t = CostModel(fit["alpha_s"], fit["beta_s_per_byte"]).seconds(kind, p, nbytes, calls)
    hvd = fits.get("hvd-allreduce")
    if kind == "allreduce" and hvd and hvd.get("small_message_s"):
        t += calls * hvd["small_message_s"]  # Horovod's per-collective cycle wait
    return t


def cost_section(comm, figdir) -> (List[str], dict):
    if not comm:
        return ["No communication benchmark found (run `benchmarks/netem_e2e.py --bench comm`)."], {}
    lines, summary = [], {}
    for rate in [r for r in RATES if r in comm]:
        cells = comm[rate]
        fits = fit_rate(cells)
        summary[rate] = {"fits": fits}
        lines += [f"### {RATE_LABEL[rate]}", "", "Fitted on " + ", ".join(f"{p} ranks" for p in sorted(cells))
                  + " together (ring formulas):", "",
                  "| collective | α (µs) | β (ns/B) = effective bandwidth per link | worst rel. error, "
                  "messages ≥ 256 KiB | fastest call ≤ 4 KiB (s) |", "|---|---|---|---|---|"]
        for name, f in fits.items():
            bw = 8 / f["beta_s_per_byte"] / 1e6 if f["beta_s_per_byte"] else float("inf")
            lines.append(f"| {name} | {f['alpha_s'] * 1e6:.0f} | {f['beta_s_per_byte'] * 1e9:.2f} = {bw:.0f} Mbit/s | "
                         f"{fmt(f['max_rel_error_256KiB_up'], '.0%')} | {fmt(f['small_message_s'], '.4f')} |")
        lines += ["", "α comes from messages ≤ 4 KiB, β from the larger ones (`hvdcomp.comm.costmodel."
                  "fit_alpha_beta`). Messages up to the token bucket's burst (≥ 68 KiB here) leave at "
                  "the unshaped rate, so mid-size messages are faster than the line fit; the model "
                  "is meant for the bandwidth-bound sizes. Horovod's allreduce adds its cycle time "
                  "(`HOROVOD_CYCLE_TIME`, 20 ms) once per collective: predictions for methods that go "
                  "through Horovod (none, fp16, PowerSGD) add the fastest small Horovod allreduce per "
                  "call to the MPI ring model."]
        # check: predicted vs measured communication per method
        lines += ["", "Each method's communication per step (hvdcomp `synchronize()` on fixed gradients, "
                  "no compute; the `communicate` phase), measured vs predicted from its measured bytes:", "",
                  "| method | ranks | bytes sent/rank | measured s | predicted s | error |", "|---|---|---|---|---|---|"]
        specs = sorted({s for c in cells.values() for s in c.get("methods", {})})
        checks = []
        for spec in specs:
            for p in sorted(cells):
                rec = cells[p]["methods"].get(spec)
                if not rec or "communicate" not in rec:
                    continue
                nb = rec["bytes_sent"]["median"]
                meas = rec["communicate"]["median"]
                pred = predict(fits, spec, p, nb)
                err = None if pred is None else (pred - meas) / meas
                checks.append({"method": spec, "ranks": p, "bytes": nb, "measured_s": meas, "predicted_s": pred})
                lines.append(f"| {spec} | {p} | {nb:,.0f} | {meas:.3f} | {fmt(pred, '.3f')} | "
                             f"{fmt(err, '+.0%')} |")
        summary[rate]["checks"] = checks
        # extrapolation at constant bytes per rank
        nbytes = {spec: cells[max(cells)]["methods"][spec]["bytes_sent"]["median"]
                  for spec in specs if "bytes_sent" in cells[max(cells)]["methods"].get(spec, {})}
        table = {spec: {p: predict(fits, spec, p, nb) for p in EXTRAPOLATE} for spec, nb in nbytes.items()}
        summary[rate]["extrapolation"] = table
        lines += ["", "Predicted communication seconds per step at more ranks (same bytes per rank; ring "
                  "collectives):", "", "| method | " + " | ".join(str(p) for p in EXTRAPOLATE) + " |",
                  "|---|" + "---|" * len(EXTRAPOLATE)]
        for spec, row in table.items():
            lines.append(f"| {spec} | " + " | ".join(fmt(row[p], '.3g') for p in EXTRAPOLATE) + " |")
        # crossovers: first p where an allgather method costs more than an allreduce method
        cross = []
        gathers = [s for s in table if method_kind(s)[0] == "allgather"]
        reduces = [s for s in table if method_kind(s)[0] == "allreduce"]
        for g in gathers:
            for r in reduces:
                p_star = next((p for p in range(2, 65537) if (predict(fits, g, p, nbytes[g]) or 0)
                               > (predict(fits, r, p, nbytes[r]) or float("inf"))), None)
                cross.append((g, r, p_star))
        summary[rate]["crossovers"] = cross
        lines += ["", "Crossover: smallest rank count at which the allgather-based method's predicted "
                  "communication exceeds the allreduce-compatible method's:", "",
                  "| allgather method | allreduce method | crossover (ranks) |", "|---|---|---|"]
        lines += [f"| {g} | {r} | {p_star if p_star else '> 65536'} |" for g, r, p_star in cross]
        lines.append("")
        try:
            plt = _pyplot()

            fig, ax = plt.subplots(figsize=(7, 4.5))
            for spec, row in table.items():
                ps = [p for p in EXTRAPOLATE if row[p] is not None]
                ax.plot(ps, [row[p] for p in ps], "-" if method_kind(spec)[0] == "allgather" else "--",
                        label=spec)
            for c in checks:
                ax.plot([c["ranks"]], [c["measured_s"]], "k.", ms=6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks")
            ax.set_ylabel("communication seconds per step")
            ax.set_title(f"α-β model at {RATE_LABEL[rate]} (dots: measured)")
            ax.legend(fontsize=7)
            fig.tight_layout()
            name = f"cost_model_{rate}.png"
            fig.savefig(os.path.join(figdir, name), dpi=110)
            plt.close(fig)
            lines += [f"![cost model {rate}]({name})", ""]
        except ImportError:
            pass
    return lines, summary


def kernels_section(directory: Optional[str]) -> List[str]:
    if not directory:
        return ["No kernel benchmark given."]
    out = []
    for sub in sorted(glob.glob(os.path.join(directory, "**", "kernels.md"), recursive=True)) or []:
        with open(sub) as f:
            text = f.read()
        rel = os.path.relpath(sub, ROOT)
        out += [f"From `{rel}`:", "", text.replace("\n# ", "\n#### ").replace("\n## ", "\n#### "), ""]
        prof = os.path.join(os.path.dirname(sub), "profile.md")
        if os.path.isfile(prof):
            out += [f"Operator profiles (torch.profiler, self CPU time): `{os.path.relpath(prof, ROOT)}`.", ""]
    return out or [f"No kernels.md under {directory}."]


# issue 17's targets for the many-tensor stack (ratios to stock Horovod measured in the same run)
#: issue 31's targets (quiet machine): ``none``'s step within 3 % of stock Horovod's, and every
#: default method spec's overhead within 1.5x of stock Horovod's overhead
DEFAULT_SPECS = ["topk:density=0.01", "dgc:density=0.01", "qsgd:levels=16", "terngrad", "efsignsgd",
                 "randomk:density=0.01", "powersgd:matrix_rank=2", "fp16", "bf16"]
#: the models whose rows are judged against :data:`OVERHEAD_TARGETS` (issue 31 names both)
TARGET_MODELS = ("stack", "transformer")
OVERHEAD_TARGETS = ([("hvdcomp:none", "step_vs_horovod", 1.03, "step ≤ 1.03× stock Horovod")]
                    + [(f"hvdcomp:{spec}", "overhead_vs_horovod", 1.5, "overhead ≤ 1.5× stock Horovod's")
                       for spec in DEFAULT_SPECS])


def overhead_section(directory: Optional[str]) -> List[str]:
    """Per-tensor overhead: benchmarks/overhead.py's tables (one run per world size) and the
    stack's targets, met or missed with the measured ratio."""
    if not directory:
        return ["No overhead results (run benchmarks/overhead.py)."]
    runs = read_all(directory, "**/overhead.json")
    if not runs:
        return [f"No overhead.json under {directory}."]
    from overhead import table  # the same rendering as the benchmark prints

    lines = ["`overhead = median step − median step of the same model without communication` (the "
             "`local` row), per model and world size; every ratio is against stock Horovod measured "
             "in the same run (contenders interleaved in rounds). No suffix: the defaults "
             "(per tensor; segmentable methods fuse each bucket's gradients into one call, "
             "`fuse_tensors=True`, docs/fused-compression.md); `@unfused` is `fuse_tensors=False` (one call per "
             "gradient); `@bucket` is `granularity=\"bucket\"`. Horovod's response cache holds "
             "every contender's tensor names (`HOROVOD_CACHE_CAPACITY=16384`), as it holds one "
             "model's in a real job.", ""]
    targets = ["| ranks | model | contender | target | measured | verdict |", "|---:|---|---|---|---:|---|"]
    for path, run in runs.items():
        machine = run.get("machine")
        if machine:
            b, a = machine["before"], machine["after"]
            state = (f"load average {b['load_1min']:.1f} before (others {100 * b['others_cpu_share']:.0f} % "
                     f"CPU), {a['load_1min']:.1f} after, on {b['cores']} cores"
                     + (": **loaded, left out of the targets**" if machine["loaded"] else ": quiet"))
        else:  # (runs from before hygiene.py recorded no state before the run)
            state = f"load average {', '.join(f'{x:.1f}' for x in run.get('load_average', []))} at the end"
        lines.append(f"Run `{os.path.relpath(path, directory)}`: {run['ranks']} ranks, {state}.")
        lines.append("")
        for model, result in run["models"].items():
            lines += table(model, result, run["ranks"])
        judged = not (machine or {}).get("loaded")
        for model in TARGET_MODELS:
            rows = run["models"].get(model, {}).get("contenders", {})
            for contender, key, limit, text in OVERHEAD_TARGETS:
                for name in (contender, contender + "@unfused", contender + "@bucket"):
                    if name in rows and key in rows[name]:
                        value = rows[name][key]
                        verdict = ("met" if value <= limit else "missed") if judged else "not judged (loaded machine)"
                        targets.append(f"| {run['ranks']} | {model} | {name} | {text} | {value:.2f} | {verdict} |")
    return ["Targets (issue 31: the 400-tensor stack and the transformer encoder):", ""] + targets + [""] + lines


# ==== gossip: decentralized gossip against allreduce / allgather =================================
#: how the gossip sub-report reads and judges the runs (printed at the top of its report)
GOSSIP_METHOD = (
    'Reads ``INPUT/{cluster,slow,accuracy}/<contender>[-seed<k>]/results.json`` (``train_lm.py``\n'
    "outputs). Step time is the mean over the timed steps (the first is skipped) of the slowest rank's\n"
    'wall time (``per_step.wall.max``); bytes are those one rank sent per step (mean over ranks).\n'
    "Each timed cell's ``machine.json`` (written by docs/results/gossip/run.sh before the cell: the load average and\n"
    "the rest of the machine's CPU share, :mod:`hygiene`) is shown; a cell that started on a loaded\n"
    'machine, or has no such record, is no evidence and is left out of the targets.\n'
    'Perplexity: test perplexity of the best-validation weights (network average for gossip runs), mean\n'
    'and spread (max − min) over seeds. Targets (issue 34): at 8 ranks on the emulated cluster, Choco\n'
    'with top-k 1 % or sign faster per step than every allreduce/allgather route, at a perplexity within\n'
    'the seed spread of synchronous top-k 1 %: stated met or missed, with the figures.')
COLLECTIVE = ("none", "topk-allgather", "gtopk")
CHOCO = ("choco-topk", "choco-sign")


def gossip_load(path: str) -> Dict[str, dict]:
    """Cell name -> its train_lm results, for every ``path/<cell>/results.json``."""
    return {os.path.basename(os.path.dirname(fn)): r for fn, r in read_all(path, "*/results.json").items()}


def inter_node_edges(r: dict) -> str:
    """Ring edges whose ends sit on different hosts (from the ranks' recorded nodes)."""
    nodes = [x["node"] for x in sorted(r.get("ranks", []), key=lambda x: x["rank"])]
    p = len(nodes)
    if p < 2:
        return "-"
    edges = {tuple(sorted((i, (i + 1) % p))) for i in range(p) if (i + 1) % p != i}
    return f"{sum(nodes[a] != nodes[b] for a, b in edges)}/{len(edges)}"


def gossip_machine(path: str, name: str) -> dict:
    """The cell's ``machine.json`` (docs/results/gossip/run.sh), or ``{"loaded": True}`` when it has none."""
    return read_json(os.path.join(path, name, "machine.json")) or {"loaded": True, "before": None}


def timing_section(title: str, runs: Dict[str, dict], path: str) -> List[str]:
    lines = [f"## {title}", "", "| contender | ranks | step s (slowest rank) | communicate s | bytes sent per rank per step | "
             "ring edges between hosts | load before |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        ps, m = r["per_step"], gossip_machine(path, name)
        load = "not recorded" if m["before"] is None else f"{m['before']['load_1min']:.2f}"
        lines.append(f"| {name} | {r['config']['world_size']} | {ps['wall']['max']:.3f} | "
                     f"{ps['communicate']['max']:.3f} | {ps['bytes_sent']['mean']:,.0f} | "
                     f"{inter_node_edges(r) if name.startswith(('choco', 'power', 'dcd')) else '-'} | "
                     f"{load}{' (loaded: left out)' if m['loaded'] else ''} |")
    return lines + [""]


def accuracy_section(runs: Dict[str, dict]) -> (List[str], Dict[str, tuple]):
    by: Dict[str, List[float]] = {}
    for key, r in runs.items():
        by.setdefault(re.sub(r"-seed\d+$", "", key), []).append(r["test_ppl"])
    stats = {k: (sum(v) / len(v), max(v) - min(v), v) for k, v in by.items()}
    lines = ["## Perplexity after the same epochs (small LSTM, 4 ranks)", "",
             "| contender | seeds | test perplexity mean | spread (max − min) | per seed |", "|---|---|---|---|---|"]
    for k, (mean, spread, v) in stats.items():
        lines.append(f"| {k} | {len(v)} | {mean:.1f} | {spread:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    return lines + [""], stats


def gossip_sections(root: str) -> List[str]:
    """The timing, perplexity and target sections over ``root``'s cluster, slow and accuracy cells."""
    lines: List[str] = []
    cluster_dir, slow_dir = os.path.join(root, "cluster"), os.path.join(root, "slow")
    cluster, slow = gossip_load(cluster_dir), gossip_load(slow_dir)
    if cluster:
        lines += timing_section("2 emulated nodes × 4 ranks, 100 Mbit/s between nodes (medium LSTM)", cluster, cluster_dir)
    if slow:
        lines += timing_section("4 emulated hosts, 10 Mbit/s links (small LSTM)", slow, slow_dir)
    cluster = {k: r for k, r in cluster.items() if not gossip_machine(cluster_dir, k)["loaded"]}
    acc = gossip_load(os.path.join(root, "accuracy"))
    stats = {}
    if acc:
        section, stats = accuracy_section(acc)
        lines += section
    lines += ["## Targets", ""]
    coll = {k: cluster[k]["per_step"]["wall"]["max"] for k in COLLECTIVE if k in cluster}
    for name in CHOCO:
        if name not in cluster or not coll:
            lines.append(f"- {name}: not measured on a quiet machine")
            continue
        t = cluster[name]["per_step"]["wall"]["max"]
        best = min(coll, key=coll.get)
        faster = t < coll[best]
        verdict = f"- {name} at 8 ranks: {t:.3f} s per step vs the fastest collective route `{best}` {coll[best]:.3f} s " \
                  f"({'faster' if faster else 'slower'}, {t / coll[best]:.2f}x)"
        if name in stats and "topk-allgather" in stats and min(len(stats[name][2]), len(stats["topk-allgather"][2])) < 2:
            verdict += "; perplexity: fewer than 2 seeds on one side, no spread to judge against"
        elif name in stats and "topk-allgather" in stats:
            mean, spread, _ = stats[name]
            ref_mean, ref_spread, _ = stats["topk-allgather"]
            within = abs(mean - ref_mean) <= ref_spread
            verdict += f"; perplexity {mean:.1f} vs synchronous top-k 1 % {ref_mean:.1f} (its seed spread {ref_spread:.1f}: " \
                       f"{'within' if within else 'outside'})"
            verdict += ": **met**" if faster and within else ": **missed**"
        else:
            verdict += ": perplexity not measured"
        lines.append(verdict)
    return lines


# ==== local: local-update training against synchronous training (benchmarks/netem_local.py cells) ====
def spread_verdict(mean: float, ref: dict, ref_name: str):
    """``(spread, verdict)``: is ``mean`` within the seed spread of a reference, read one-sided —
    no worse than ``ref["mean"]`` by more than its range over seeds (``ref["max"] - ref["min"]``;
    a lower value meets it)? With one reference seed (``ref["n"] < 2``) there is no spread: not
    judged. Used by the ``local`` sub-report and ``benchmarks/adaptive_lm.py``'s table for perplexity."""
    spread = ref["max"] - ref["min"]
    if ref["n"] < 2:
        return spread, f"not judged ({ref_name} has one seed)"
    return spread, "met" if mean <= ref["mean"] + spread else "missed"


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


def local_summary(cells: List[dict], baseline: str, versus: str, target_factor: float) -> Dict[str, dict]:
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


def local_targets(rows: Dict[str, dict], baseline: str, rate: str, versus: str) -> List[str]:
    """The issue's targets, met, missed or not judged, for the local-update contenders at one rate
    (``versus``: the second time-to-target reference, synchronous top-k)."""
    base = rows.get(baseline)
    lines = auto_targets(rows, baseline, rate) if AUTO in rows else []
    for c, row in rows.items():
        if c.startswith("sync|") or base is None:
            continue
        spread, verdict = spread_verdict(row["best_val_ppl"]["mean"], base["best_val_ppl"], "the baseline")
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


AUTO = "sync|auto"


def auto_targets(rows: Dict[str, dict], baseline: str, rate: str) -> List[str]:
    """Issue 59's targets for ``compression="auto"`` (contender :data:`AUTO`) at one rate: time to
    the target within 1.1x of the best static contender's (the other ``sync|`` rows, fastest mean
    time to the target over seeds that all reached it), final perplexity within that contender's
    seed spread, and at 10 Mbit/s at least 5x faster to the target than ``baseline``."""
    static = {c: r for c, r in rows.items() if c.startswith("sync|") and c != AUTO}
    timed = {c: r["time_to_target_s"] for c, r in static.items() if r["time_to_target_s"] is not None}
    auto = rows[AUTO]
    if not timed:
        return [f"- {AUTO}: not judged (no static contender reached the target on every seed)"]
    best = min(timed, key=timed.get)
    t = auto["time_to_target_s"]
    within = ("n/a", "missed (it did not reach the target on every seed)") if t is None else (
        f"{t / timed[best]:.2f}x", "met" if t <= 1.1 * timed[best] else "missed")
    spread, verdict = spread_verdict(auto["best_val_ppl"]["mean"], static[best]["best_val_ppl"], best)
    lines = [f"- {AUTO}: time to target within 1.1x of the best static contender's ({best}, "
             f"{timed[best]:.0f} s): {within[0]}: {within[1]}; final perplexity {auto['best_val_ppl']['mean']:.1f} "
             f"within its seed spread ({static[best]['best_val_ppl']['mean']:.1f} + {spread:.1f}): {verdict}"]
    if rate == "10mbit" and baseline in rows:
        f, v = speedup_verdict(rows, AUTO, "speedup_vs_baseline", lambda x: x >= 5, baseline)
        lines.append(f"  time to target >= 5x less than {baseline} ({f}): {v}")
    return lines


def auto_rows(cells: List[dict]) -> List[dict]:
    """The ``compression="auto"`` cells as :func:`auto_table` / :func:`auto_plot` rows."""
    return [{"variant": f"{c['driver']['rate']} {c['contender']}", "seed": c["train_lm"]["config"].get("seed"),
             "auto": c["train_lm"]["auto"], "val": [e["val_ppl"] for e in c["train_lm"]["epochs"]],
             "steps_per_epoch": max(e["steps"] for e in c["train_lm"]["epochs"])}
            for c in cells if c.get("status") == "ok" and c["train_lm"].get("auto")]


def local_markdown(summary: Dict[str, dict], baseline: str, versus: str) -> str:
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
        lines += ["", *local_targets(rows, baseline, rate, versus), ""]
    return "\n".join(lines) + "\n"


# ==== ddp-hooks: hvdcomp's DDP front-end against DDP's hooks (benchmarks/ddp_hooks.py cells) =======
def ddp_cell(output: str, model: str, rate: str, contender: str) -> Optional[dict]:
    """The cell's JSON (:mod:`netem_e2e`'s), or None when it is missing."""
    return read_json(os.path.join(output, model, "cells", rate, slug(contender) + ".json"))


def median_step(output: str, model: str, rate: str, contender: str) -> Optional[float]:
    """The cell's median step in seconds, or None: missing, failed, or started on a loaded
    machine (:mod:`hygiene`; such a cell is no evidence and stays out of the verdicts)."""
    cell = ddp_cell(output, model, rate, contender)
    if cell is None or cell.get("status") != "ok" or cell["driver"]["machine"]["loaded"]:
        return None
    return float(cell["timing"]["step"]["median"])


def load_line(output: str, models, rates, contenders) -> str:
    """The sitting's machine state: the range of the 1-minute load average and of the rest of the
    machine's CPU share before the cells, and how many cells were marked loaded."""
    before = [c["driver"]["machine"]["before"] for m in models for r in rates for n in contenders
              if (c := ddp_cell(output, m, r, n)) is not None and "machine" in c.get("driver", {})]
    if not before:
        return "Machine state: no cells."
    loads = [b["load_1min"] for b in before]
    others = [100 * b["others_cpu_share"] for b in before]
    loaded = sum(b["load_1min"] > b["cores"] for b in before)
    return (f"Machine state before each of the {len(before)} cells: load average {min(loads):.2f}–{max(loads):.2f} "
            f"on {before[0]['cores']} cores, the rest of the machine {min(others):.0f}–{max(others):.0f} % CPU; "
            f"{loaded} cell(s) started loaded (left out). Every cell of a table ran in this one sitting.")


def ddp_hooks_markdown(args) -> str:
    """``OUT/report.md``: the step table and the two targets, per model and rate (``args``: output,
    models, rates, contenders)."""
    lines = ["# hvdcomp's DDP front-end against DDP's hooks and the Horovod front-end", "",
             "Median seconds per step (per step the maximum over the 4 ranks), emulated links, one rank per "
             "emulated host. Command: `python benchmarks/ddp_hooks.py --output " + args.output + "`.", "",
             load_line(args.output, args.models, args.rates, args.contenders), ""]
    for model in args.models:
        lines += [f"## {model}", "", "| contender | " + " | ".join(args.rates) + " |",
                  "|---|" + "---|" * len(args.rates)]
        table: Dict[str, Dict[str, Optional[float]]] = {}
        for c in args.contenders:
            table[c] = {r: median_step(args.output, model, r, c) for r in args.rates}
            cells = [f"{v:.3f}" if v is not None else "failed, loaded or not run" for v in table[c].values()]
            lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
        lines.append("")
        for rate in args.rates:
            ours = table.get("hvdcomp-ddp:topk:density=0.01", {}).get(rate)
            hooks = [table.get(c, {}).get(rate) for c in ("ddp:fp16", "ddp:powersgd")]
            hooks = [h for h in hooks if h is not None]
            horovod = table.get("hvdcomp:topk:density=0.01", {}).get(rate)
            if ours is None:
                continue
            if hooks:
                lines.append(f"- {rate}: hvdcomp top-k 1 % through DDP {ours:.3f} s vs DDP's fastest built-in "
                             f"hook {min(hooks):.3f} s: {'faster' if ours < min(hooks) else 'NOT faster'} "
                             f"({min(hooks) / ours:.2f}x)")
            if horovod is not None:
                lines.append(f"- {rate}: against the Horovod front-end's top-k 1 % {horovod:.3f} s: "
                             f"{ours / horovod:.2f}x (target <= 1.10)")
            ring = table.get("horovod-ring:fp16", {}).get(rate)
            if ring is not None:  # issue 31, item 4: against Horovod's fastest configuration, same sitting
                for c in ("hvdcomp:topk:density=0.01", "hvdcomp:dgc:density=0.01", "ddp:fp16"):
                    v = table.get(c, {}).get(rate)
                    if v is not None:
                        lines.append(f"- {rate}: `{c}` {v:.3f} s against Horovod ring fp16 {ring:.3f} s: "
                                     f"{ring / v:.2f}x ({'faster' if v < ring else 'NOT faster'})")
        lines.append("")
    return "\n".join(lines)


# ==== the command line ===========================================================================
def _write_report(folder: str, text: str, what: Optional[str] = None) -> int:
    """Write ``folder/report.md`` (making the folder); print the text, or with ``what`` one line
    naming the file and what it covers. Returns 0 (the exit status)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "report.md")
    with open(path, "w") as f:
        f.write(text)
    print(text if what is None else f"report: {path} ({what})")
    return 0


def _study(p: argparse.ArgumentParser):
    p.add_argument("root", help="directory searched for results.json files")
    p.add_argument("--out", help="where report.md and the PNGs go (default: root)")
    p.add_argument("--target-ppl", type=float,
                   help="target validation perplexity (default: 1.1 x the baseline's best)")
    p.add_argument("--command", default="", help="the command that produced the runs, quoted in the report")
    p.add_argument("--budget-hours", type=float, help="the stated compute budget, hours of wall time")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--grid", nargs="*", default=[],
                   help="grid YAML files: list their cells that have no results, quote their notes")

    def run(args) -> int:
        rows = load_results(args.root)
        out = args.out or args.root
        os.makedirs(out, exist_ok=True)
        names = [] if args.no_plots or not rows else plots(rows, out, args.target_ppl)
        return _write_report(out, render(rows, args.target_ppl, args.command, names, missing_cells(args.root, args.grid),
                                         args.root, args.budget_hours, grid_notes(args.grid),
                                         grid_search(args.root, args.grid)), f"{len(rows)} runs")
    return run


def _ab(p: argparse.ArgumentParser):
    p.add_argument("root", help="the sweep's output directory (cells/*/results.json)")
    p.add_argument("--command", default="", help="the command that produced the runs, quoted in the report")
    p.add_argument("--grid", help="the grid YAML, whose notes the report quotes")
    p.add_argument("--no-plots", action="store_true")

    def run(args) -> int:
        by = ab_load(args.root)
        notes = (grid.load_grid(args.grid, _NO_OVERRIDES).get("notes") or "") if args.grid else ""
        names: Tuple[str, ...] = ()
        if by and not args.no_plots:
            names = (plot_accuracy(by, args.root), plot_compression(by, args.root), plot_spectra(by, args.root))
        return _write_report(args.root, ab_render(by, args.command, names, notes),
                             f"{sum(len(v) for v in by.values())} runs")
    return run


def _speed(p: argparse.ArgumentParser):
    p.add_argument("--e2e", default="runs/netem-e2e", help="netem_e2e.py output, LSTM")
    p.add_argument("--e2e-transformer", default="runs/netem-e2e-transformer",
                   help="netem_e2e.py --model transformer output")
    p.add_argument("--comm", default="runs/netem-comm")
    p.add_argument("--kernels", default=None, help="directory holding kernels.md files (searched recursively)")
    p.add_argument("--overhead", default=None, help="directory holding overhead.json files (searched recursively)")
    p.add_argument("--output", default="docs/results/speed")
    p.add_argument("--preamble", default=None, help="markdown file put at the top (commands, notes)")

    def run(args) -> int:
        os.makedirs(args.output, exist_ok=True)
        e2e, e2e_t, comm = load_e2e(args.e2e), load_e2e(args.e2e_transformer), load_comm(args.comm)
        e2e_lines, e2e_summary = e2e_section(e2e, args.output)
        t_lines, t_summary = e2e_section(e2e_t, args.output, prefix="transformer_")
        if e2e_t:
            t_target_lines, t_summary["target"] = transformer_target(e2e_t)
        else:
            t_target_lines = [f"Not measured: no cells under {args.e2e_transformer} (`bash docs/results/speed/run.sh "
                              "OUT transformer` runs them)."]
        cost_lines, cost_summary = cost_section(comm, args.output)
        lines = ["# hvdcomp speed report", ""]
        if args.preamble:
            with open(args.preamble) as f:
                lines += [f.read().rstrip(), ""]
        lines += ["## Targets", ""] + (targets_section(e2e) if e2e else ["No end-to-end results."]) + [""]
        lines += ["### Transformer encoder (issue 17)", ""] + t_target_lines + [""]
        lines += ["## End-to-end on rate-limited links", ""] + e2e_lines + [""]
        lines += ["## Transformer encoder on rate-limited links", ""] + t_lines + [""]
        lines += ["## α-β cost model: fit, check and extrapolation", ""] + cost_lines + [""]
        lines += ["## Kernel benchmark", ""] + kernels_section(args.kernels) + [""]
        lines += ["## Per-tensor overhead", ""] + overhead_section(args.overhead)
        write_json(os.path.join(args.output, "summary.json"),
                   {"e2e": e2e_summary, "e2e_transformer": t_summary, "cost_model": cost_summary})
        return _write_report(args.output, "\n".join(lines).rstrip() + "\n", "and summary.json")
    return run


def _gossip(p: argparse.ArgumentParser):
    p.add_argument("--input", default="docs/results/gossip")
    p.add_argument("--output", default="docs/results/gossip")

    def run(args) -> int:
        lines = ["# Decentralized gossip against allreduce / allgather", "",
                 "Measurements: `bash docs/results/gossip/run.sh` (see its header). Report: "
                 f"`.venv/bin/python mpi_scripts/report.py gossip {' '.join(args.argv)}`", "", GOSSIP_METHOD, ""]
        lines += gossip_sections(args.input)
        return _write_report(args.output, "\n".join(lines) + "\n")
    return run


def _local(p: argparse.ArgumentParser):
    p.add_argument("--output", default="runs/netem-local", help="netem_local.py's results directory (cells/<rate>/*.json)")
    p.add_argument("--baseline", default="sync|fp16@ring", help="the target's and the first speed-up's reference")
    p.add_argument("--versus", default="sync|topk:density=0.01", help="the second speed-up's reference")
    p.add_argument("--target-factor", type=float, default=1.1, help="target = factor x baseline's best val ppl")
    p.add_argument("--include-loaded", action="store_true",
                   help="keep cells started on a loaded machine (a shared machine: every cell of the sitting "
                        "ran under its recorded load, so ratios within the sitting still compare)")

    def run(args) -> int:
        if not args.target_factor >= 1 or math.isnan(args.target_factor):
            p.error("--target-factor must be >= 1")
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
        kept = [c for c, m in zip(cells, machines) if args.include_loaded or not m.get("loaded")]
        rows = local_summary(kept, args.baseline, args.versus, args.target_factor)
        write_json(os.path.join(args.output, "report.json"), rows)
        text = local_markdown(rows, args.baseline, args.versus)
        if loads:
            text += (f"\n1-minute load average before each cell: {min(loads):.2f}-{max(loads):.2f} "
                     f"({len(loads)} cells).\n")
        if loaded:
            text += (f"{'Kept (--include-loaded)' if args.include_loaded else 'Left out'}, started on a loaded "
                     f"machine: {', '.join(loaded)}.\n")
        auto = auto_rows(kept)
        if auto:
            text += ("\n## compression=\"auto\": its decisions\n\n![the chosen method over training]("
                     f"{auto_plot(auto, args.output)})\n\n{auto_table(auto)}\n")
        return _write_report(args.output, text)
    return run


def _ddp_hooks(p: argparse.ArgumentParser):
    import ddp_hooks  # (its contenders, models and rates are the defaults)

    p.add_argument("--output", default="runs/ddp-hooks", help="ddp_hooks.py's results directory")
    p.add_argument("--models", nargs="+", default=ddp_hooks.MODELS)
    p.add_argument("--rates", nargs="+", default=ddp_hooks.RATES)
    p.add_argument("--contenders", nargs="+", default=ddp_hooks.CONTENDERS)

    def run(args) -> int:
        return _write_report(args.output, ddp_hooks_markdown(args))
    return run


#: sub-report -> (what it reports, its arguments; returns the function that writes it)
SUBREPORTS = {"study": ("a sweep's runs and the seed study's claims", _study),
              "ab": ("AB-training against full-rank data parallelism (train_cnn.py runs)", _ab),
              "speed": ("the speed benchmarks: end-to-end, cost model, kernels, overhead", _speed),
              "gossip": ("decentralized gossip against allreduce / allgather (docs/results/gossip/run.sh)", _gossip),
              "local": ("local-update training against synchronous training (benchmarks/netem_local.py)", _local),
              "ddp-hooks": ("hvdcomp's DDP front-end against DDP's hooks (benchmarks/ddp_hooks.py)", _ddp_hooks)}


def main(argv=None) -> int:
    """``report.py [study|ab|speed|gossip|local|ddp-hooks] ARGS``: the sub-report named first (``study`` when the first
    argument names none) over its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kind = argv.pop(0) if argv and argv[0] in SUBREPORTS else "study"
    what, arguments = SUBREPORTS[kind]
    p = argparse.ArgumentParser(prog=f"report.py {kind}", description=f"{__doc__.splitlines()[0]} Sub-report "
                                f"'{kind}': {what}; the others: {', '.join(k for k in SUBREPORTS if k != kind)}.")
    run = arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
