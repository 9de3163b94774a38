#!/usr/bin/env python
"""Report of AB-training against full-rank data parallelism on scikit-learn's digits (train_cnn.py runs).

Usage::

    python mpi_scripts/report_ab.py docs/results/study-v2-ab [--grid GRID.yaml] [--command "make study"]

Reads every ``cells/*/results.json`` under the directory (one per method and seed) and writes
``report.md`` with the two figures AB-training's paper (Coquelin et al., "AB-Training: A
Communication-Efficient Approach for Distributed Low-Rank Learning", arXiv:2405.01067, 2024)
keeps apart:

- **traffic**: bytes sent over the whole run against full-rank data parallelism (every fp32
  gradient every step), as the mean over ranks and between nodes; the paper's figure of this kind
  is 50 % (v1) / 70.31 % (v2) less network traffic, i.e. 2:1 to 3.37:1;
- **model compression**: parameters of the factorised model against the full model, over the run
  and with the kept ranks per layer; the paper's 44.14:1 (VGG16 on CIFAR-10) is of this kind;

with test accuracy against full rank (difference of means judged against the seed spread
sqrt(sd_a² + sd_b²), as ``report.py`` does), the singular values at the end of training, and
plots ``ab_accuracy.png``, ``ab_compression.png`` and ``ab_spectra.png``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
from hvdcomp.lowrank.schedule import STAGES  # noqa: E402  (the stage names' one definition)
from hvdcomp.lowrank.traffic import read  # noqa: E402  (results before and after the stage rename)
from mpi_scripts import report  # noqa: E402  (the seed-spread comparison of every report)
from mpi_scripts.results import mean as _mean, read_all, sd as _sd  # noqa: E402

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


def compare(a: List[float], b: List[float]) -> Tuple[float, float, str]:
    """:func:`report.compare` (difference of means, its seed spread) with the verdict in words:
    "within the seed spread", "above"/"below the seed spread", or "one seed" (no spread)."""
    d, spread, direction = report.compare(a, b)
    return d, spread, VERDICTS[direction]


def load(root: str) -> Dict[str, List[dict]]:
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
            d, spread, verdict = compare(acc, [r["test_accuracy"] for r in by[base]])
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
        _, _, acc = compare([r["test_accuracy"] for r in runs], [r["test_accuracy"] for r in by[base]])
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


def _plot_setup():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_accuracy(by: Dict[str, List[dict]], out_dir: str) -> str:
    """``ab_accuracy.png``: test accuracy (%) per epoch, mean over seeds with a min–max band, one
    panel per model."""
    plt = _plot_setup()
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
    plt = _plot_setup()
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
    plt = _plot_setup()
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


def render(by: Dict[str, List[dict]], command: str = "", plots: Tuple[str, ...] = (), notes: str = "") -> str:
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
    plots: Tuple[str, ...] = ()
    if by and not args.no_plots:
        plots = (plot_accuracy(by, args.root), plot_compression(by, args.root), plot_spectra(by, args.root))
    with open(os.path.join(args.root, "report.md"), "w") as f:
        f.write(render(by, args.command, plots, notes))
    print(f"report: {os.path.join(args.root, 'report.md')} ({sum(len(v) for v in by.values())} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
