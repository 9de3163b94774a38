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
import glob
import json
import math
import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

PHASES = ("compute", "compress", "communicate", "decompress")

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
    if name in ("topk", "dgc", "randomk") and "density" in desc:
        label = {"topk": "top-k", "dgc": "DGC", "randomk": "rand-k"}[name]
        col = f"{label} {round(1 / (2 * desc['density']))}x"
        return col + ("" if desc.get("ef", name == "dgc") else " no-EF") if name == "randomk" else col
    if name == "qsgd":
        return f"QSGD s={desc['levels']}"
    if name == "none":
        return "none"
    if name == "powersgd":
        return f"PowerSGD r={desc['rank']}"
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
    """Flat rows (one per results.json under ``root``) with the fields the report uses."""
    rows = []
    for path in sorted(glob.glob(os.path.join(root, "**", "results.json"), recursive=True)):
        with open(path) as f:
            r = json.load(f)
        cfg = r["config"]
        steps = r["epochs"][0]["steps"] if r["epochs"] else 0
        rows.append({
            "path": path, "model": cfg["model"], "workers": cfg["world_size"],
            "column": column_of(cfg["compressor"]), "family": cfg["compressor"]["name"],
            "density": cfg["compressor"].get("density"), "spec": cfg.get("compressor_spec"),
            "lr": cfg.get("lr"), "test_ppl": r["test_ppl"], "val": [e["val_ppl"] for e in r["epochs"]],
            "steps_per_epoch": steps,
            "phase_step": {p: r["per_step"][p]["mean"] for p in PHASES},
            "wall_step": r["per_step"]["wall"]["mean"],
            "bytes_sent": r["per_step"]["bytes_sent"]["mean"],
            "bytes_received": r["per_step"]["bytes_received"]["mean"],
            "dense_bytes": r["per_step"]["dense_bytes"]["mean"],
            "measured_ratio": r["measured_ratio"], "nominal_ratio": r["nominal_ratio"],
            "transport": cfg.get("transport"), "env": cfg.get("env", {}),
        })
    return rows


def ordered_columns(rows) -> List[str]:
    present = {r["column"] for r in rows}
    return [c for c in COLUMN_ORDER if c in present] + sorted(present - set(COLUMN_ORDER))


def groups(rows) -> Dict[Tuple[str, int], Dict[str, dict]]:
    """(model, workers) -> column -> row."""
    out: Dict[Tuple[str, int], Dict[str, dict]] = defaultdict(dict)
    for r in rows:
        out[(r["model"], r["workers"])][r["column"]] = r
    return dict(sorted(out.items(), key=lambda kv: (["small", "medium", "large"].index(kv[0][0]), kv[0][1])))


def epochs_to(val: List[float], target: float) -> Optional[int]:
    """First epoch (1-based) whose validation perplexity is <= target, or None."""
    return next((i + 1 for i, v in enumerate(val) if v <= target), None)


def targets(rows, target_ppl: Optional[float]) -> Dict[Tuple[str, int], float]:
    """Target validation perplexity per group: given, else the baseline's final validation ppl."""
    out = {}
    for key, cols in groups(rows).items():
        if target_ppl is not None:
            out[key] = target_ppl
        elif "none" in cols and cols["none"]["val"]:
            out[key] = cols["none"]["val"][-1]
    return out


# ---- the study's claims ----------------------------------------------------------------------
def _verdict(checks: List[bool]) -> str:
    if not checks:
        return "no data"
    return "supported" if all(checks) else ("not supported" if not any(checks) else "partly supported")


def check_claims(rows, target_ppl: Optional[float] = None) -> List[Tuple[str, str, str]]:
    """The seven claims of STUDY.md as (claim, verdict, evidence with numbers)."""
    g, tg = groups(rows), targets(rows, target_ppl)
    claims = []

    def each(fn):
        """fn(model, workers, cols) -> None or [(ok, note), ...]: one check per comparison."""
        checks, notes = [], []
        for (model, w), cols in g.items():
            for ok, note in fn(model, w, cols) or []:
                checks.append(ok)
                notes.append(f"{model}/{w}: {note}")
        return _verdict(checks), "; ".join(notes) or "no cells to compare"

    def c1(model, w, cols):
        if "none" not in cols:
            return None
        base = cols["none"]["test_ppl"]
        cs = [c for c in ("top-k 50x", "DGC 50x") if c in cols]
        if not cs:
            return None
        return [(cols[c]["test_ppl"] <= base, f"{c} {cols[c]['test_ppl']:.1f} vs none {base:.1f}") for c in cs]
    claims.append(("1. Top-k and DGC at 50x reach perplexity at or below the baseline", *each(c1)))

    def c2(model, w, cols):
        if not {"none", "top-k 5000x", "DGC 5000x"} <= set(cols):
            return None
        base, tk, dg = cols["none"]["test_ppl"], cols["top-k 5000x"]["test_ppl"], cols["DGC 5000x"]["test_ppl"]
        return [(tk > 1.05 * base and dg > 1.05 * base and dg > tk,
                 f"top-k {tk:.1f}, DGC {dg:.1f} vs none {base:.1f} (degraded = >5 % above)")]
    claims.append(("2. At 5000x both degrade clearly, DGC more than top-k", *each(c2)))

    def c3(model, w, cols):
        qs = [c for c in cols if c.startswith("QSGD")]
        if "none" not in cols or not qs:
            return None
        base = cols["none"]["test_ppl"]
        return [(abs(cols[c]["test_ppl"] - base) <= 2.5, f"{c} {cols[c]['test_ppl'] - base:+.1f} around none {base:.1f}")
                for c in qs]
    claims.append(("3. QSGD stays within ±2.5 perplexity of the baseline", *each(c3)))

    def c4(model, w, cols):
        pairs = [(c, c + " no-EF") for c in cols if c.startswith("rand-k") and not c.endswith("no-EF")
                 and c + " no-EF" in cols]
        if "none" not in cols or not pairs:
            return None
        base = cols["none"]["test_ppl"]
        return [(cols[n]["test_ppl"] > cols[e]["test_ppl"] > base,
                 f"{e}: EF {cols[e]['test_ppl']:.1f} / no-EF {cols[n]['test_ppl']:.1f} vs none {base:.1f}")
                for e, n in pairs]
    claims.append(("4. Random-k without residuals is far worse than with them, which is worse than baseline",
                   *each(c4)))

    def c5(model, w, cols):
        if "none" not in cols or w < 2:
            return None
        base = cols["none"]["phase_step"]["communicate"]
        others = [c for c in cols if c != "none"]
        if not others:
            return None
        out = []
        for c in others:
            comm = cols[c]["phase_step"]["communicate"]
            high = c.startswith(("top-k", "DGC")) and c.endswith(("500x", "5000x"))
            ok = comm < (0.1 * base if high else base)
            out.append((ok, f"{c} {1e3 * comm:.1f} ms vs none {1e3 * base:.1f} ms"
                            + (" (must be < 10 %)" if high else "")))
        return out

    claims.append(("5. Communication time falls for every method, to nearly nothing for top-k/DGC at high ratios",
                   *each(c5)))

    def c6(model, w, cols):
        def mean_compress(prefix):
            xs = [cols[c]["phase_step"]["compress"] for c in cols if c.startswith(prefix)]
            return sum(xs) / len(xs) if xs else None
        tk, dg, qs = mean_compress("top-k"), mean_compress("DGC"), mean_compress("QSGD")
        if tk is None or (dg is None and qs is None):
            return None
        return [(tk > x, f"compress per step: top-k {1e3 * tk:.1f} ms vs {n} {1e3 * x:.1f} ms")
                for n, x in (("DGC", dg), ("QSGD", qs)) if x is not None]
    claims.append(("6. Top-k's selection cost is the largest; DGC and QSGD add less", *each(c6)))

    def c7(model, w, cols):
        if (model, w) not in tg or "none" not in cols:
            return None
        t = tg[(model, w)]
        base = epochs_to(cols["none"]["val"], t)
        sp = [c for c in cols if c.startswith(("top-k", "DGC")) and c.endswith("50x")]
        if not sp or base is None:
            return None
        eps = {c: epochs_to(cols[c]["val"], t) for c in sp}
        return [(e is not None and e < base, f"target {t:.1f}: {c} {e or 'never'} vs none {base} epochs")
                for c, e in eps.items()]
    claims.append(("7. Sparsifiers converge in fewer epochs than the baseline", *each(c7)))
    return claims


# ---- markdown and plots ----------------------------------------------------------------------
def ppl_table(rows) -> str:
    cols = ordered_columns(rows)
    lines = ["| model / workers | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for (model, w), by in groups(rows).items():
        study = dict(zip(STUDY_COLUMNS, STUDY_PPL.get((model, w), [])))
        cells = []
        for c in cols:
            ours = f"{by[c]['test_ppl']:.1f}" if c in by else "–"
            cells.append(ours + (f" ({study[c]:.1f})" if c in study else ""))
        lines.append(f"| {model} / {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_table(rows) -> str:
    lines = ["| model / workers | method | " + " | ".join(PHASES) + " | total s/epoch | s/step |",
             "|---|---|" + "---|" * (len(PHASES) + 2)]
    for (model, w), by in groups(rows).items():
        for c in ordered_columns(list(by.values())):
            r = by[c]
            per_epoch = [r["phase_step"][p] * r["steps_per_epoch"] for p in PHASES]
            lines.append(f"| {model} / {w} | {c} | " + " | ".join(f"{x:.2f}" for x in per_epoch) +
                         f" | {sum(per_epoch):.2f} | {r['wall_step']:.3f} |")
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


def epochs_table(rows, target_ppl) -> str:
    tg = targets(rows, target_ppl)
    lines = ["| model / workers | target val ppl | " + " | ".join(ordered_columns(rows)) + " |",
             "|---|---|" + "---|" * len(ordered_columns(rows))]
    for key, by in groups(rows).items():
        if key not in tg:
            continue
        cells = []
        for c in ordered_columns(rows):
            e = epochs_to(by[c]["val"], tg[key]) if c in by else None
            cells.append("–" if c not in by else (str(e) if e else f"> {len(by[c]['val'])}"))
        lines.append(f"| {key[0]} / {key[1]} | {tg[key]:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(rows, out_dir: str) -> List[str]:
    """Write the PNG plots; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    g = groups(rows)
    fig, axes = plt.subplots(1, len(g), figsize=(5.5 * len(g), 4.2), squeeze=False)
    for ax, ((model, w), by) in zip(axes[0], g.items()):
        for c in ordered_columns(list(by.values())):
            ax.plot(range(1, len(by[c]["val"]) + 1), by[c]["val"], marker="o", label=c)
        ax.set(title=f"{model}, {w} worker(s)", xlabel="epoch", ylabel="validation perplexity", yscale="log")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "val_ppl.png"), dpi=110)
    names.append("val_ppl.png")
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

    fig, ax = plt.subplots(figsize=(9, 4.6))
    cols = ordered_columns(rows)
    for (model, w), by in g.items():
        ax.plot(range(len(cols)), [by[c]["bytes_sent"] if c in by else math.nan for c in cols],
                marker="o", linestyle="none", label=f"{model}/{w}")
    ax.set_xticks(range(len(cols)), cols, rotation=70, fontsize=7)
    ax.set(yscale="log", ylabel="bytes sent per step per rank (measured)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bytes_per_step.png"), dpi=110)
    names.append("bytes_per_step.png")
    plt.close(fig)
    return names


def missing_cells(root: str, grid_paths: List[str]) -> List[str]:
    """Names of the cells of the given grid files that have no results.json under ``root``."""
    if not grid_paths:
        return []
    import argparse as _argparse

    from mpi_scripts import sweep

    none = _argparse.Namespace(models=None, workers=None, epochs=None, output=None, data=None, methods=None)
    out = []
    for path in grid_paths:
        for cell in sweep.cells_of(sweep.load_grid(path, none)):
            if not os.path.isfile(os.path.join(root, "cells", cell.name, "results.json")):
                out.append(cell.name)
    return out


def render(rows, target_ppl=None, command: str = "", plot_names=(), missing=()) -> str:
    """The whole markdown report."""
    if not rows:
        return "# hvdcomp study report\n\nNo results.json found.\n"
    env = rows[0]["env"]
    parts = [
        "# hvdcomp study report: the seed study's grid with measured communication",
        f"{len(rows)} runs. Produced by:\n\n```\n{command}\n```" if command else f"{len(rows)} runs.",
        "Every time below is measured by hvdcomp's phase timers on real MPI ranks (compute = forward "
        "+ backward + update; communicate = time in or waiting for collectives), and every byte count "
        "is what the rank put on the wire (counts exchange included); nothing is derived from an "
        "assumed link speed. Ranks share this machine's cores, so compute time grows with the rank "
        "count; settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())) + ".",
        "Nominal ratios use the study's convention (32-bit values and indices: density 1 % = 50x).",
        "## Test perplexity (ours, study's published value in parentheses)",
        "The study trained PTB for up to 50 epochs and reports the best of 60 tuned runs; these runs "
        "train Tiny Shakespeare for a few epochs with one setting, so compare orderings, not values.",
        ppl_table(rows),
        "## Time per epoch by phase (seconds, mean over ranks)", time_table(rows),
        "## Bytes on the wire and compression ratio", bytes_table(rows),
        "## Epochs to reach the target validation perplexity",
        "Target: the uncompressed run's final validation perplexity at the same model and worker count.",
        epochs_table(rows, target_ppl),
        "## The study's claims against our data",
        "\n".join(f"- **{c}** — {v}. {e}." for c, v, e in check_claims(rows, target_ppl)),
    ]
    if missing:
        parts.append("## Cells not run yet\n\n" + ", ".join(f"`{m}`" for m in missing) +
                     "\n\nRerun the same sweep command: finished cells are skipped, these are run.")
    if plot_names:
        parts.append("## Plots\n\n" + "\n".join(f"![{n}]({n})" for n in plot_names))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="directory searched for results.json files")
    p.add_argument("--out", help="where report.md and the PNGs go (default: root)")
    p.add_argument("--target-ppl", type=float, help="target validation perplexity (default: baseline's final)")
    p.add_argument("--command", default="", help="the command that produced the runs, quoted in the report")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--grid", nargs="*", default=[], help="grid YAML files: list their cells that have no results")
    args = p.parse_args(argv)
    rows = load_results(args.root)
    out = args.out or args.root
    os.makedirs(out, exist_ok=True)
    names = [] if args.no_plots or not rows else plots(rows, out)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render(rows, args.target_ppl, args.command, names, missing_cells(args.root, args.grid)))
    print(f"report: {os.path.join(out, 'report.md')} ({len(rows)} runs)")
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
