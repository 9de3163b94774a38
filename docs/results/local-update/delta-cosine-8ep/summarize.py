"""The table of docs/results/local-update/README.md, "Why outer momentum stalls the transformer",
from the files run.sh writes: python summarize.py [DIR] (default: this script's folder).

Per run: validation perplexity after epochs 2, 4 and 8 (train perplexity at epoch 8), then over
two windows of rounds (3-10: the first epochs; 11-29: after them) the median and range of
cos(Δ̄_r, Δ̄_{r−1}), the median of cos(Δ̄_r, Δ̄_{r−8}), the range of ‖Δ̄_r‖ and the median of
‖u_r‖ / ‖Δ̄_r‖ and cos(u_r, Δ̄_r), u_r being the outer step's move of θ_start (averaging: u = Δ̄).
"""
import json
import os
import statistics
import sys

RUNS = ["tf_avg8", "tf_dl8", "tf_dl8_lr01", "lstm_avg8", "lstm_dl8"]
WINDOWS = [(3, 10), (11, 29)]


def describe(rows, lo, hi):
    """One window's cells (strings)."""
    w = [r for r in rows if lo <= r["round"] <= hi]
    lag1 = [r["lag1"] for r in w if "lag1" in r]
    lag8 = [r["lag8"] for r in w if "lag8" in r]
    norms = [r["norm"] for r in w]
    ratio = [r["update_norm"] / r["norm"] for r in w if "update_norm" in r]
    ucos = [r["update_cos"] for r in w if "update_cos" in r]
    med = lambda xs: f"{statistics.median(xs):.2f}" if xs else "1 (u = Δ̄)"  # noqa: E731
    return [f"{statistics.median(lag1):+.2f} ({min(lag1):+.2f} to {max(lag1):+.2f})",
            f"{statistics.median(lag8):+.2f}" if lag8 else "—",
            f"{min(norms):.1f}-{max(norms):.1f}", med(ratio), med(ucos)]


def main():
    here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    print("| run | val ppl ep 2 / 4 / 8 (train ep 8) | rounds | cos lag 1, median (range) | cos lag 8 "
          "| ‖Δ̄‖ | ‖u‖/‖Δ̄‖ | cos(u, Δ̄) |")
    print("|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        rows = json.load(open(os.path.join(here, f"{run}.cos.json")))
        ep = json.load(open(os.path.join(here, run, "results.json")))["epochs"]
        val = " / ".join(f"{ep[i]['val_ppl']:.0f}" for i in (1, 3, 7)) + f" ({ep[7]['train_ppl']:.0f})"
        for i, (lo, hi) in enumerate(WINDOWS):
            print("| " + " | ".join([run if i == 0 else "", val if i == 0 else "", f"{lo}-{hi}",
                                     *describe(rows, lo, hi)]) + " |")


if __name__ == "__main__":
    main()
