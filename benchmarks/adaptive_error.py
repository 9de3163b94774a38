#!/usr/bin/env python
"""What the per-layer plan of ``adaptive`` (L-GreCo) buys: compression error at equal bytes.

Run from the repository root (one process, no MPI)::

    .venv/bin/python benchmarks/adaptive_error.py [--output FILE.json]

On real gradients of the small LSTM language model (:func:`benchmarks.bench_models.lstm_gradients`:
``--steps`` SGD steps on Tiny Shakespeare, all 9 tensors) and for each base setting in
``--bases`` (top-k densities, QSGD levels), step by step as in training (no error feedback, to
compare the compressors alone):

* ``uniform``: the base method at its setting on every tensor;
* ``adaptive``: ``adaptive:base=...,budget=<setting>,every=1``: the plan applied at step s was
  solved on step s − 1's measured errors (step 0 is uniform, so it is left out).

Reported per base: relative error Σ‖x − C(x)‖² / Σ‖x‖² summed over the tensors and over steps
1..S−1, and bytes sent per step (payload bytes of the compressed tensors; the error tables
``adaptive`` sends on measuring steps are counted separately), both for the two methods, and the
planned settings of the last step.
"""
from __future__ import annotations

import argparse
import os
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hvdcomp  # noqa: E402
from benchmarks.bench_models import lstm_gradients  # noqa: E402
from hvdcomp.compressors.adaptive import AdaptiveCompressor  # noqa: E402
from mpi_scripts.results import write_json  # noqa: E402


def payload_bytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def run(spec: str, steps_grads):
    """(sum of ‖x − C(x)‖², sum of ‖x‖², payload bytes, error-table bytes) over steps ≥ 1, and the
    compressor (its plan) after the last step. ``spec`` without error feedback."""
    comp = hvdcomp.get_compressor(spec)
    err = norm = sent = tables = 0.0
    for s, grads in enumerate(steps_grads):
        for name, g in grads:
            payload, ctx = comp.encode(g, name)
            out = comp.aggregate([payload], ctx)          # one rank: records adaptive's errors
            table = payload_bytes(payload[-1:]) if isinstance(comp, AdaptiveCompressor) and ctx[2] else 0
            if s >= 1:
                err += float((g.double() - out.double()).pow(2).sum())
                norm += float(g.double().pow(2).sum())
                sent += payload_bytes(payload) - table
                tables += table
    return err, norm, sent, tables, comp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bases", nargs="+", default=["topk:0.01", "topk:0.001", "qsgd:4", "qsgd:16"],
                   help="base:setting pairs (top-k density, QSGD levels)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--data", default="")
    p.add_argument("--output", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    grads, corpus = lstm_gradients(args.steps, args.data)
    steps_grads = [[(n, g) for n, st, g in grads if st == s] for s in range(args.steps)]
    rows = []
    for item in args.bases:
        base, _, setting = item.partition(":")
        knob = {"topk": "density", "qsgd": "levels"}[base]
        uniform = f"{base}:{knob}={setting},ef=false" if base == "topk" else f"{base}:{knob}={setting}"
        adaptive = f"adaptive:base={base},budget={setting},every=1" + (",ef=false" if base == "topk" else "")
        ue, un, us, _, _ = run(uniform, steps_grads)
        ae, an, as_, at, comp = run(adaptive, steps_grads)
        steps = args.steps - 1
        rows.append({"base": base, "setting": setting, "uniform_rel_error": ue / un, "adaptive_rel_error": ae / an,
                     "uniform_bytes_per_step": us / steps, "adaptive_bytes_per_step": as_ / steps,
                     "adaptive_error_table_bytes_per_step": at / steps,
                     "plan": {n: comp.setting_of(n) for n, _ in steps_grads[-1]}})
    lines = ["| base | uniform setting | rel. error uniform | rel. error adaptive | ratio | bytes/step uniform | "
             "bytes/step adaptive (+ error tables) | last plan |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = ", ".join(f"{n.split('.')[-2] if '.' in n else n}.{n.split('.')[-1]}={v:g}" for n, v in r["plan"].items())
        lines.append(f"| {r['base']} | {r['setting']} | {r['uniform_rel_error']:.4g} | {r['adaptive_rel_error']:.4g} | "
                     f"{r['adaptive_rel_error'] / r['uniform_rel_error']:.3f} | {r['uniform_bytes_per_step']:.0f} | "
                     f"{r['adaptive_bytes_per_step']:.0f} (+{r['adaptive_error_table_bytes_per_step']:.0f}) | {plan} |")
    table = "\n".join(lines)
    print(f"adaptive vs uniform on the small LSTM's gradients ({corpus['source']}), steps 1..{args.steps - 1}\n")
    print(table)
    if args.output:
        write_json(args.output, {"settings": vars(args), "corpus": corpus, "rows": rows, "table": table})
    return rows


if __name__ == "__main__":
    main()
