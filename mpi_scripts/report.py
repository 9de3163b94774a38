#!/usr/bin/env python
"""Turn a sweep's results JSONs into a markdown report with plots and the study's claims checked.

Usage::

    python mpi_scripts/report.py runs/study-small [--target-ppl 400] [--out docs/results]

Reads every ``results.json`` under the directory; writes ``report.md`` and PNG plots (validation
perplexity per epoch, stacked time breakdown, bytes per step) into ``--out`` (default: the
directory itself). Communication figures are the *measured* per-phase timers and byte counters
of the runs, not a bandwidth model.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import re
import statistics
from collections import defaultdict
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
from mpi_scripts import grid  # noqa: E402
from mpi_scripts.results import mean as _mean, read_all, read_json, sd as _sd  # noqa: E402
from hvdcomp.lm import PlateauSchedule  # noqa: E402
from hvdcomp.metrics import PHASES  # noqa: E402  (the phase names' one definition)


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="directory searched for results.json files")
    p.add_argument("--out", help="where report.md and the PNGs go (default: root)")
    p.add_argument("--target-ppl", type=float,
                   help="target validation perplexity (default: 1.1 x the baseline's best)")
    p.add_argument("--command", default="", help="the command that produced the runs, quoted in the report")
    p.add_argument("--budget-hours", type=float, help="the stated compute budget, hours of wall time")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--grid", nargs="*", default=[],
                   help="grid YAML files: list their cells that have no results, quote their notes")
    args = p.parse_args(argv)
    rows = load_results(args.root)
    out = args.out or args.root
    os.makedirs(out, exist_ok=True)
    names = [] if args.no_plots or not rows else plots(rows, out, args.target_ppl)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render(rows, args.target_ppl, args.command, names, missing_cells(args.root, args.grid),
                       args.root, args.budget_hours, grid_notes(args.grid), grid_search(args.root, args.grid)))
    print(f"report: {os.path.join(out, 'report.md')} ({len(rows)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
