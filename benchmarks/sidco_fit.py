#!/usr/bin/env python
"""How close SIDCo's fitted thresholds come to the target count: kept/k per configuration.

Run from the repository root (one process, no MPI, no Horovod)::

    .venv/bin/python benchmarks/sidco_fit.py
    .venv/bin/python benchmarks/sidco_fit.py --output docs/results/sidco_fit.json

For every density ρ in ``--densities`` (0.1, 0.01, 0.001), distribution in ``--dists`` (exp, gamma,
gpareto) and fixed number of stages M in ``--stages`` (1, 2, 4) it runs
:meth:`hvdcomp.compressors.sidco.SIDCoCompressor.estimate` (no adaptation) and reports kept/k,
k = max(1, ceil(ρ·n)):

* ``laplace``: on one Laplace(0, 0.01) tensor of ``--n`` (10^6) float32 entries (seed ``--seed``);
* ``lm median`` / ``lm worst``: on real gradients of the project's small 2-layer LSTM language
  model (hidden 100, tied embeddings, :func:`benchmarks.bench_models.lstm_gradients`) on Tiny Shakespeare
  (``--data``, default ``../shared/data/tinyshakespeare/input.txt``):
  ``--lm-steps`` (5) steps of plain SGD (lr 20, gradient-norm clip 0.25, ``--batch-size`` 32
  sequences of ``--bptt`` 35 tokens, as ``mpi_scripts/train_lm.py`` on one process); the raw
  gradient (before clipping, what a compressor sees) of every parameter with at least 1000 entries
  is kept at every step (embedding 10^6 entries and four LSTM weight matrices of 4·10^4: 25
  tensors). Median of kept/k over those tensors, and the worst one (farthest from 1, as
  |kept/k − 1|); ``in ±ε``: how many tensors land within the compressor's tolerance ε = 0.2;
  ``fallbacks``: estimates (Laplace and LM together) that fell back to the exact top-k
  (:class:`~hvdcomp.compressors.sidco.Estimate` ``fallback``). kept is the fitted threshold's
  count, 0 where it kept nothing (``none-kept``: k exact top-k entries are sent instead), the
  count sent for the other fallbacks.

Rows ``adaptive`` use the compressor as in training instead: ``select(grad, name)`` step after
step, each parameter starting at one stage and gaining one (up to 4) after a miss; reported is
kept/k at the last step (Laplace: ``--lm-steps`` fresh Laplace tensors under one name).

Prints a markdown table; ``--output FILE.json`` also writes the settings and every number.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hvdcomp  # noqa: E402
from hvdcomp.compressors.sidco import SIDCoCompressor  # noqa: E402
from hvdcomp.compressors.topk import num_kept  # noqa: E402
from mpi_scripts.results import write_json  # noqa: E402
from benchmarks.bench_models import lstm_gradients  # noqa: E402

MIN_NUMEL = 1000
ADAPTIVE_STAGES = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    p.add_argument("--dists", nargs="+", default=["exp", "gamma", "gpareto"])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--n", type=float, default=1e6, help="entries of the Laplace tensor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="corpus (default: Tiny Shakespeare in ../shared/data)")
    p.add_argument("--lm-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    if args.lm_steps < 1 or args.n < 2:
        p.error("--lm-steps must be >= 1 and --n >= 2")
    return args


def laplace(n: int, scale: float, seed: int) -> torch.Tensor:
    """Laplace(0, scale) by inverse transform from a seeded generator (float64 maths)."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 0.5
    return (-scale * torch.sign(u) * torch.log1p(-2 * u.abs())).to(torch.float32)


def summarize(ratios, tolerance):
    worst = max(ratios, key=lambda r: abs(r - 1.0))
    return {"median": statistics.median(ratios), "worst": worst,
            "within": sum(abs(r - 1.0) <= tolerance for r in ratios), "tensors": len(ratios)}


def adaptive_ratio(comp, tensors_by_step, density):
    """kept/k of each tensor of the last step, after select() on every step in order."""
    last = []
    for s, tensors in enumerate(tensors_by_step):
        for name, g in tensors:
            kept = comp.select(g, name).numel() / num_kept(g.numel(), density)
            if s == len(tensors_by_step) - 1:
                last.append(kept)
    return last


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    n = int(args.n)
    lap = laplace(n, 0.01, args.seed)
    lap_steps = [[("laplace", laplace(n, 0.01, args.seed + 1 + s))] for s in range(args.lm_steps)]
    grads, corpus = lstm_gradients(args.lm_steps, args.data or "", args.seed, args.batch_size, args.bptt,
                                   MIN_NUMEL)
    lm_steps = [[(name, g) for name, st, g in grads if st == s] for s in range(args.lm_steps)]
    rows = []
    for density in args.densities:
        for dist in args.dists:
            configs = [(str(m), m) for m in args.stages] + [(f"adaptive (<= {ADAPTIVE_STAGES})", None)]
            for label, m in configs:
                comp = SIDCoCompressor(density=density, dist=dist,
                                       stages=m if m is not None else ADAPTIVE_STAGES)
                if m is not None:
                    lap_est = comp.estimate(lap, m)
                    lap_ratio = lap_est.kept / num_kept(n, density)
                    fallbacks = int(bool(lap_est.fallback))
                    lm = []
                    for _, _, g in grads:
                        est = comp.estimate(g, m)
                        fallbacks += bool(est.fallback)
                        kept = est.kept if est.fitted else est.indices.numel()
                        lm.append(kept / num_kept(g.numel(), density))
                else:
                    fallbacks = None
                    lap_ratio = adaptive_ratio(comp, lap_steps, density)[0]
                    lm = adaptive_ratio(SIDCoCompressor(density=density, dist=dist, stages=ADAPTIVE_STAGES),
                                        lm_steps, density)
                rows.append({"density": density, "dist": dist, "stages": label, "laplace": lap_ratio,
                             "lm": summarize(lm, comp.tolerance), "fallbacks": fallbacks})
    elapsed = time.perf_counter() - t0

    lines = ["| density | dist | M | laplace kept/k | lm median kept/k | lm worst kept/k | lm in ±0.2 | fallbacks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lm = r["lm"]
        lines.append(f"| {r['density']:g} | {r['dist']} | {r['stages']} | {r['laplace']:.3f} | "
                     f"{lm['median']:.3f} | {lm['worst']:.3f} | {lm['within']}/{lm['tensors']} | "
                     f"{'-' if r['fallbacks'] is None else r['fallbacks']} |")
    table = "\n".join(lines)
    print(f"SIDCo kept/k: Laplace n = {n}; LSTM small on {corpus['source']}, {args.lm_steps} SGD steps, "
          f"batch {args.batch_size} x {args.bptt}, tensors >= {MIN_NUMEL} entries ({elapsed:.1f} s)\n")
    print(table)
    if args.output:
        out = {"settings": {k: v for k, v in vars(args).items() if k != "output"},
               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "hvdcomp": getattr(hvdcomp, "__version__", None)},
               "corpus": corpus,
               "lm_tensors": [{"name": name, "step": st, "numel": g.numel()} for name, st, g in grads],
               "seconds": elapsed, "rows": rows, "table": table}
        write_json(args.output, out)
    return rows


if __name__ == "__main__":
    main()
