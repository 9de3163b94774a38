#!/usr/bin/env python
"""The α-β model of the gossip (neighbour) transport beside the scale-out rows, 2 to 1024 ranks.

    .venv/bin/python benchmarks/gossip_model.py --summary docs/results/speed/summary.json \\
        --output docs/results/gossip-model

Every row is communication seconds per step on the medium LSTM (n = 4,444,800 float32 in 9
tensors) in the α-β fits of the speed report (``summary.json``, ``cost_model.<rate>.fits``). The
allreduce / allgather / sparse-allreduce rows are :func:`benchmarks.scaleout_model.row_functions`'
(unchanged). A gossip row is :func:`hvdcomp.transports.neighbor.neighbor_terms`: per step a rank
sends one message to each of its ``degree`` neighbours through one full-duplex interface,
``degree·α + degree·m·β`` (m: the exact message bytes, :func:`hvdcomp.transports.neighbor.message_bytes`,
header included), priced with the mpi4py Allgatherv fit (the point-to-point links the scale-out
report also uses for gTop-k's messages). For a fixed degree this is constant in p: a ring has
degree 2, a 2-D torus 4, the one-peer exponential graph 1, at any p.

The model prices communication only. Gossip reaches consensus more slowly than an allreduce (the
spectral gap, ``docs/gossip.md``): a row here is a cost per step, not per unit of progress.
Writes ``OUTPUT/report.md`` and ``OUTPUT/model.json``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from hvdcomp import get_compressor  # noqa: E402
from hvdcomp.comm.costmodel import CostModel  # noqa: E402
from hvdcomp.compressors.topk import num_kept  # noqa: E402
from hvdcomp.gossip.topology import make_topology  # noqa: E402
from hvdcomp.transports.neighbor import message_bytes, neighbor_terms  # noqa: E402
from mpi_scripts.results import read_json, write_json  # noqa: E402
from scaleout_model import RANKS, row_functions  # noqa: E402

H = 300  # the medium LSTM: embedding 10000 x H, two layers of (4H x H) x 2 and 4H biases x 2
SHAPES = [(10000, H)] + [(4 * H, H)] * 4 + [(4 * H,)] * 4
NUMELS = [math.prod(s) for s in SHAPES]


def choco_message(spec: str) -> int:
    """Bytes of one Choco-SGD / DCD message: every tensor's payload with its wire format."""
    comp = get_compressor(spec, ef=False)
    if spec.startswith("topk"):  # values (fp32) and indices (int32) of each tensor's k entries
        kept = [num_kept(n, comp.density) for n in NUMELS]
        return message_bytes([k for k in kept for _ in (0, 1)], [4, 4] * len(kept))
    if spec.startswith("efsignsgd"):  # (scale, packed signs) per tensor
        return message_bytes([0] * 2 * len(NUMELS), []) + sum(4 + math.ceil(n / 8) for n in NUMELS)
    if spec.startswith("qsgd"):  # two payload tensors per tensor
        return message_bytes([0] * 2 * len(NUMELS), []) + sum(comp.wire_bytes(n) for n in NUMELS)
    if spec == "none":
        return message_bytes(NUMELS, [4] * len(NUMELS))
    raise ValueError(spec)


def powergossip_message() -> float:
    """Mean bytes of one PowerGossip message per edge: X v̂ (m) and Xᵀ v̂ (n) alternate, so
    (m + n)/2 float32 per matrix, plus the 1-D tensors raw every step (the header of
    :func:`hvdcomp.transports.neighbor.message_bytes`)."""
    vec = sum(4 * (s[0] + math.prod(s) // s[0]) / 2 for s in SHAPES if len(s) >= 2)
    raw = sum(4 * math.prod(s) for s in SHAPES if len(s) < 2)
    return message_bytes([0] * len(SHAPES), []) + vec + raw


def gossip_rows() -> Dict[str, Callable]:
    """Name -> f(fits, p) seconds per step: the exchange of one message per neighbour, at the
    largest degree of the topology built for p ranks (a 2-D torus of 4 ranks is 2 x 2: degree 2)."""
    degrees: Dict[tuple, int] = {}

    def row(topology: str, nbytes: float):
        def seconds(fits, p):
            if p <= 1:
                return 0.0
            if (topology, p) not in degrees:
                degrees[(topology, p)] = make_topology(topology, p).max_degree()
            fit = fits["mpi-allgatherv"]
            a, b = neighbor_terms(degrees[(topology, p)], nbytes)
            model = CostModel(fit["alpha_s"], fit["beta_s_per_byte"])
            return a * model.alpha + b * model.beta
        return seconds

    return {
        "gossip: dense (none), ring": row("ring", choco_message("none")),
        "gossip: choco sign, ring": row("ring", choco_message("efsignsgd")),
        "gossip: choco topk 1 %, ring": row("ring", choco_message("topk:density=0.01")),
        "gossip: choco topk 1 %, 2-D torus": row("torus", choco_message("topk:density=0.01")),
        "gossip: dcd qsgd s=16, ring": row("ring", choco_message("qsgd")),
        "gossip: powergossip, ring": row("ring", powergossip_message()),
        "gossip: powergossip, one-peer exponential": row("exponential", powergossip_message()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", default=os.path.join(ROOT, "docs/results/speed/summary.json"))
    ap.add_argument("--output", default=os.path.join(ROOT, "docs/results/gossip-model"))
    args = ap.parse_args(argv)
    fits_by_rate = {rate: v["fits"] for rate, v in read_json(args.summary)["cost_model"].items()}
    n = sum(NUMELS)
    rows = {**row_functions(n), **gossip_rows()}
    lines: List[str] = ["# Gossip transport in the α-β model, beside the scale-out rows", "",
                        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/gossip_model.py'] + (argv or sys.argv[1:]))}`",
                        "", __doc__[__doc__.index("Every row"):__doc__.index("Writes")].strip(), "",
                        "Message bytes per neighbour and step: "
                        + ", ".join(f"{k} {v:,.0f}" for k, v in (
                            ("dense", choco_message("none")), ("sign", choco_message("efsignsgd")),
                            ("topk 1 %", choco_message("topk:density=0.01")), ("qsgd s=16", choco_message("qsgd")),
                            ("powergossip", powergossip_message()))) + ".", ""]
    model = {}
    for rate, fits in fits_by_rate.items():
        table = {name: [f(fits, p) for p in RANKS] for name, f in rows.items()}
        model[rate] = {"ranks": RANKS, "seconds": table}
        lines += [f"## {rate} links (fitted model)", "",
                  "| method (transport) | " + " | ".join(map(str, RANKS)) + " |", "|---|" + "---|" * len(RANKS)]
        lines += [f"| {name} | " + " | ".join(f"{t:.3g}" for t in ts) + " |" for name, ts in table.items()]
        at8 = {name: ts[RANKS.index(8)] for name, ts in table.items()}
        collective = {k: v for k, v in at8.items() if not k.startswith("gossip") and "hierarchical" not in k}
        best = min(collective, key=collective.get)
        for name in ("gossip: choco topk 1 %, ring", "gossip: choco sign, ring"):
            lines += ["", f"At p = 8, `{name}` {at8[name]:.3g} s vs the fastest allreduce/allgather route "
                          f"`{best}` {collective[best]:.3g} s: "
                          f"{'faster' if at8[name] < collective[best] else 'slower'} in the model "
                          f"({at8[name] / collective[best]:.2f}x)."]
        lines += [""]
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "report.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    write_json(os.path.join(args.output, "model.json"), model)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
