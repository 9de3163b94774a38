#!/usr/bin/env python
"""Report of AB-training against full-rank data parallelism on the digits CNN (train_cnn.py runs).

Usage::

    python mpi_scripts/report_ab.py docs/results/study-v2-ab [--command "make study"]

Reads every ``results.json`` under the directory (one per method and seed), writes ``report.md``
(test accuracy mean ± sample sd over seeds, bytes sent per rank by phase, whole-run compression
ratio against full-rank data parallelism, beside the seed paper's 44.14:1 on VGG16/CIFAR-10) and
``ab_accuracy.png`` (test accuracy per epoch, seed band).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict
from typing import Dict, List

#: AB-training's published whole-run ratio (Coquelin et al., 2024; VGG16 on CIFAR-10)
SEED_RATIO = 44.14
PHASES = ("warmup", "grouped", "sync", "full-rank")


def _mean(xs):
    return sum(xs) / len(xs)


def _sd(xs):
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def load(root: str) -> Dict[str, List[dict]]:
    """Method label -> runs (sorted by seed), from ``root/cells/<name>/results.json``."""
    by: Dict[str, List[dict]] = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(root, "cells", "*", "results.json"))):
        with open(path) as f:
            r = json.load(f)
        name = os.path.basename(os.path.dirname(path))
        label = name.split("-np", 1)[1].split("-", 1)[1].rsplit("-seed", 1)[0]
        by[label].append(r)
    return {k: sorted(v, key=lambda r: r["config"]["seed"]) for k, v in sorted(by.items())}


def _pm(xs, fmt="{:.2f}", scale=1.0):
    xs = [x * scale for x in xs]
    sd = _sd(xs)
    return fmt.format(_mean(xs)) + ("" if sd != sd else " ± " + fmt.format(sd))


def table(by: Dict[str, List[dict]]) -> str:
    """One row per method: seeds, accuracy, MB sent per rank by phase, whole-run ratio."""
    lines = ["| method | seeds | test accuracy % | " + " | ".join(f"MB {p}" for p in PHASES) +
             " | MB total | ratio vs full rank |", "|---|---|---|" + "---|" * (len(PHASES) + 2)]
    for label, runs in by.items():
        comm = [r["communication"] for r in runs]
        phase_mb = [_pm([c["bytes_by_phase"].get(p, 0) for c in comm], "{:.1f}", 1e-6) for p in PHASES]
        ratios = [c["compression_ratio"] for c in comm]
        lines.append(f"| {label} | {', '.join(str(r['config']['seed']) for r in runs)} | "
                     f"{_pm([r['test_accuracy'] for r in runs], scale=100)} | " + " | ".join(phase_mb) +
                     f" | {_pm([c['bytes_sent'] for c in comm], '{:.1f}', 1e-6)} | "
                     f"{_pm(ratios, '{:.2f}')}:1 |")
    return "\n".join(lines)


def ranks_table(by: Dict[str, List[dict]]) -> str:
    """Matrix rank kept per factorised weight (AB-training runs, first seed)."""
    lines = ["| method | " + "weight: kept rank |", "|---|---|"]
    for label, runs in by.items():
        kept = runs[0]["communication"].get("ranks_kept")
        if kept:
            lines.append(f"| {label} | " + ", ".join(f"{k}: {v}" for k, v in sorted(kept.items())) + " |")
    return "\n".join(lines)


def plot(by: Dict[str, List[dict]], out_dir: str) -> str:
    """Write ``ab_accuracy.png`` into ``out_dir``: test accuracy (%) per epoch, mean over seeds
    with a min–max band per method; returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    for label, runs in by.items():
        n = min(len(r["epochs"]) for r in runs)
        accs = [[100 * r["epochs"][e]["test_accuracy"] for r in runs] for e in range(n)]
        line, = ax.plot(range(1, n + 1), [_mean(a) for a in accs], label=f"{label} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(range(1, n + 1), [min(a) for a in accs], [max(a) for a in accs],
                            color=line.get_color(), alpha=0.2)
    ax.set(xlabel="epoch", ylabel="test accuracy % (mean; band: seed min–max)", ylim=(80, 100),
           title="Digits CNN, 4 ranks: AB-training vs full rank")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ab_accuracy.png"), dpi=110)
    plt.close(fig)
    return "ab_accuracy.png"


def render(by: Dict[str, List[dict]], command: str = "", plot_name: str = "", notes: str = "") -> str:
    """The markdown report."""
    if not by:
        return "# AB-training on the digits CNN\n\nNo results.json found.\n"
    cfg = next(iter(by.values()))[0]["config"]
    parts = ["# AB-training on the digits CNN against full-rank data parallelism",
             f"Produced by:\n\n```\n{command}\n```" if command else "",
             f"Model: VGG-style CNN, {cfg['parameters']:,} parameters; data: {cfg['data']}; "
             f"{cfg['world_size']} ranks, {cfg['epochs']} epochs, global batch {cfg['batch_size']}. " + notes.strip(),
             "Bytes are what one rank sent over the whole run (mean ± sd over seeds); the ratio "
             "divides what full-rank data parallelism would send (every gradient in fp32 every step) "
             "by that.",
             table(by),
             "## Matrix rank kept per factorised weight (first seed)", ranks_table(by),
             f"## Against the seed paper\n\nAB-training's paper reports {SEED_RATIO}:1 on VGG16 / "
             "CIFAR-10, whose large layers keep a small fraction of their rank. The direction to "
             "compare is whether AB-training sends less than full rank at a small accuracy cost; the "
             "size of the ratio depends on the model (this one's layers are small, and the full-rank "
             "warm-up and periodic full-rank steps send every gradient).",
             f"## Plot\n\n![{plot_name}]({plot_name})" if plot_name else ""]
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="the sweep's output directory (cells/*/results.json)")
    p.add_argument("--command", default="", help="the command that produced the runs, quoted in the report")
    p.add_argument("--grid", help="the grid YAML, whose notes the report quotes")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    by = load(args.root)
    notes = ""
    if args.grid:
        import yaml

        with open(args.grid) as f:
            notes = (yaml.safe_load(f) or {}).get("notes", "")
    name = "" if args.no_plots or not by else plot(by, args.root)
    with open(os.path.join(args.root, "report.md"), "w") as f:
        f.write(render(by, args.command, name, notes))
    print(f"report: {os.path.join(args.root, 'report.md')} ({sum(len(v) for v in by.values())} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
