#!/usr/bin/env python
"""Report of ``docs/results/gossip/run.sh``: step time and bytes per rank on the emulated links, and
perplexity after the same epochs, for decentralized gossip against allreduce / allgather routes.

    .venv/bin/python benchmarks/gossip_report.py --input docs/results/gossip --output docs/results/gossip

Reads ``INPUT/{cluster,slow,accuracy}/<contender>[-seed<k>]/results.json`` (``train_lm.py``
outputs). Step time is the mean over the timed steps (the first is skipped) of the slowest rank's
wall time (``per_step.wall.max``); bytes are those one rank sent per step (mean over ranks).
Each timed cell's ``machine.json`` (written by docs/results/gossip/run.sh before the cell: the load average and
the rest of the machine's CPU share, :mod:`hygiene`) is shown; a cell that started on a loaded
machine, or has no such record, is no evidence and is left out of the targets.
Perplexity: test perplexity of the best-validation weights (network average for gossip runs), mean
and spread (max − min) over seeds. Targets (issue 34): at 8 ranks on the emulated cluster, Choco
with top-k 1 % or sign faster per step than every allreduce/allgather route, at a perplexity within
the seed spread of synchronous top-k 1 %: stated met or missed, with the figures.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
from mpi_scripts.results import read_all, read_json  # noqa: E402

COLLECTIVE = ("none", "topk-allgather", "gtopk")
CHOCO = ("choco-topk", "choco-sign")


def load(path: str) -> Dict[str, dict]:
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


def machine(path: str, name: str) -> dict:
    """The cell's ``machine.json`` (docs/results/gossip/run.sh), or ``{"loaded": True}`` when it has none."""
    return read_json(os.path.join(path, name, "machine.json")) or {"loaded": True, "before": None}


def timing_section(title: str, runs: Dict[str, dict], path: str) -> List[str]:
    lines = [f"## {title}", "", "| contender | ranks | step s (slowest rank) | communicate s | bytes sent per rank per step | "
             "ring edges between hosts | load before |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        ps, m = r["per_step"], machine(path, name)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default="docs/results/gossip")
    ap.add_argument("--output", default="docs/results/gossip")
    args = ap.parse_args(argv)
    lines = ["# Decentralized gossip against allreduce / allgather", "",
             "Measurements: `bash docs/results/gossip/run.sh` (see its header). Report: "
             f"`.venv/bin/python benchmarks/gossip_report.py {' '.join(argv or sys.argv[1:])}`", "",
             __doc__[__doc__.index("Reads"):].strip(), ""]
    cluster_dir, slow_dir = os.path.join(args.input, "cluster"), os.path.join(args.input, "slow")
    cluster, slow = load(cluster_dir), load(slow_dir)
    if cluster:
        lines += timing_section("2 emulated nodes × 4 ranks, 100 Mbit/s between nodes (medium LSTM)", cluster, cluster_dir)
    if slow:
        lines += timing_section("4 emulated hosts, 10 Mbit/s links (small LSTM)", slow, slow_dir)
    cluster = {k: r for k, r in cluster.items() if not machine(cluster_dir, k)["loaded"]}
    acc = load(os.path.join(args.input, "accuracy"))
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
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "report.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
