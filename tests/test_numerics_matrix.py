"""The extreme-input matrix (issue 13, part 3): every registered method, with and without error
feedback, on {all zeros, one element, empty, constant, many ties, magnitudes 1e-30 and 1e30,
mixed scales} x {float32, float16, bfloat16} x simulated world sizes {1, 2, 8, 64}: one step, or
two where state carries over (error feedback, fp16's agreed scale, DGC's momenta, PowerSGD's Q).

Each cell checks: finite output, exact zeros where every rank's input is zero (where the method
promises it), shape and dtype preserved, and the method's stated error bound against a float64
reference. The measured quantity is

    e = ||aggregate - m||_2 / S,   m = mean over ranks of p_r,   S = mean over ranks of ||p_r||_2

in float64, where p_r is what rank r's method compresses: the gradient, plus the residual for
error feedback (DGC: its accumulated velocity; PowerSGD: plus its error). Dividing by S (not
||m||) makes every bound hold for any mix of signs across ranks. signSGD's bound is exact
agreement with the float64 majority vote (e = fraction of elements that differ).

Unbiasedness of QSGD, TernGrad and random-k is checked statistically in test_numerics_methods.py.

The measurements are written as JSON (to $HVDCOMP_NUMERICS_JSON when set, else a temporary
file); ``python scripts/numerics_table.py <json> docs/numerics.md`` renders the committed table
(``make numerics`` does both).
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import pytest
import torch

import hvdcomp
from hvdcomp.compressors.dgc import DGCCompressor
from hvdcomp.compressors.fp16 import PROBE
from hvdcomp.compressors.lowbit import LowBitCompressor
from hvdcomp.transports import FlatStepMethod, PowerSGDCompressor, StepMethod
from hvdcomp.compressors.topk import num_kept
from hvdcomp.memory import ErrorFeedback
from tests.simworld import SimulatedRanks

WORLDS = [1, 2, 8, 64]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INPUTS = ["zeros", "one element", "empty", "constant", "ties", "tiny", "huge", "mixed"]
SHAPE = (16, 12)
HALF = (torch.float16, torch.bfloat16)
#: unit roundoff and half the smallest subnormal of each gradient dtype (the final cast)
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FLOOR = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}


def extremes(dtype):
    """(tiny, huge) magnitudes for ``dtype``: 1e-30 and 1e30, within the dtype's normal range
    (float16: its smallest normal 6.1e-5 and a quarter of its largest value, 16376)."""
    info = torch.finfo(dtype)
    return max(1e-30, info.tiny), min(1e30, info.max / 4)


def base_input(kind: str, dtype) -> torch.Tensor:
    """The float64 input of rank 0 (rank r sends it times 1 + r/(2N), then cast to ``dtype``)."""
    gen = torch.Generator().manual_seed(INPUTS.index(kind))
    tiny, huge = extremes(dtype)
    n = SHAPE[0] * SHAPE[1]
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    spread = 1 + torch.rand(n, generator=gen).double()                 # [1, 2)
    if kind == "zeros":
        return torch.zeros(SHAPE, dtype=torch.float64)
    if kind == "one element":
        return torch.tensor([-0.75], dtype=torch.float64)
    if kind == "empty":
        return torch.zeros(0, SHAPE[1], dtype=torch.float64)
    if kind == "constant":
        return torch.full(SHAPE, 0.7, dtype=torch.float64)
    if kind == "ties":                                                  # 5 values, 38-39 copies each
        return torch.tensor([1.0, -1.0, 2.0, -2.0, 0.0], dtype=torch.float64).repeat(n // 5 + 1)[:n].reshape(SHAPE)
    if kind == "tiny":
        return (signs * spread * tiny).reshape(SHAPE)
    if kind == "huge":
        return (signs * spread * huge).reshape(SHAPE)
    # mixed: log-uniform magnitudes over [tiny, huge], every 7th element exactly 0
    logs = math.log10(tiny) + torch.rand(n, generator=gen).double() * (math.log10(huge) - math.log10(tiny))
    out = signs * 10.0**logs
    out[::7] = 0.0
    return out.reshape(SHAPE)


def rank_inputs(kind, dtype, world):
    base = base_input(kind, dtype)
    return [(base * (1 + r / (2 * world))).to(dtype) for r in range(world)]


# ---- what each method compresses, and its bound --------------------------------------------
def compensated(comp, g: torch.Tensor, name: str) -> torch.Tensor:
    """p_r: what ``comp`` compresses this step for gradient ``g`` (computed as the method does)."""
    if isinstance(comp, ErrorFeedback):
        t = g.to(torch.float32) if g.dtype in HALF else g
        e = comp.residuals.get(name)
        return t if e is None else t + e
    if isinstance(comp, DGCCompressor):
        flat = g.reshape(-1).to(torch.float32)
        u = comp.u.get(name, torch.zeros_like(flat))
        v = comp.v.get(name, torch.zeros_like(flat))
        return (v + (u * comp.momentum + flat)).reshape(g.shape)
    if isinstance(comp, PowerSGDCompressor) and name in comp.error:
        return g.to(torch.float32) + comp.error[name].reshape(g.shape)
    if isinstance(comp, LowBitCompressor) and name in comp.residuals:
        return g.to(torch.float32) + comp.residuals[name]
    if isinstance(comp, FlatStepMethod) and name in comp.residual:
        return g.to(torch.float32) + comp.residual[name]
    return g


@dataclass
class Cell:
    """One measurement's context, handed to a row's bound function."""
    world: int
    dtype: torch.dtype
    n: int
    ps: List[torch.Tensor]          # float64 compensated inputs, one per rank
    scale: float                    # S = mean_r ||p_r||
    comp: object                    # rank 0's compressor (state before the step)
    payload: list = field(default_factory=list)   # rank 0's payload (fp16: which mode)
    ctx: object = None


def inner(comp):
    return comp.inner if isinstance(comp, ErrorFeedback) else comp


def fp32_sum(c: Cell) -> float:
    return (c.world + 2) * 2.0**-24


def bound_fp16(c: Cell) -> float:
    ctx = c.ctx.inner if isinstance(c.comp, ErrorFeedback) else c.ctx
    if ctx.mode == PROBE:
        return fp32_sum(c)
    below = math.sqrt(c.n) * (c.world + 2) * 2.0**-25 * 2.0**-ctx.k / c.scale
    return (c.world + 2) * 2.0**-11 + below


def bound_contraction(c: Cell) -> float:
    k = num_kept(c.n, inner(c.comp).density)
    return math.sqrt(1 - k / c.n) + fp32_sum(c)


def bound_threshold(c: Cell) -> float:
    lam = inner(c.comp).threshold
    return min(1.0, lam * math.sqrt(c.n) / c.scale) + fp32_sum(c)


def bound_int2(c: Cell) -> float:
    k = num_kept(c.n, inner(c.comp).density)
    return (math.sqrt(1 - k / c.n) + math.sqrt(k) / 3 if c.n else 0.0) + fp32_sum(c)


def bound_qsgd(c: Cell) -> float:
    q = inner(c.comp)
    return math.sqrt(min(q.block, c.n)) / q.levels + fp32_sum(c)


def bound_terngrad(c: Cell) -> float:
    # ||T(p) - p|| <= ||p - clip(p)|| + max|clip(p)|·sqrt(nnz) <= ||p|| + max|p|·sqrt(nnz), per rank
    per_rank = [p.norm() + p.abs().max() * math.sqrt(int((p != 0).sum())) for p in c.ps]
    return float(sum(per_rank) / len(per_rank)) / c.scale + fp32_sum(c)


def bound_adaptive(c: Cell) -> float:
    """Top-k at whichever candidate density the plan gives: the smallest candidate's contraction."""
    k = min(num_kept(c.n, d) for d in inner(c.comp).settings)
    return math.sqrt(1 - k / c.n) + fp32_sum(c) if c.n else fp32_sum(c)


def bound_lowbit(c: Cell) -> float:
    """|v − Q(v)| ≤ s/2 = max_block|v|/(2L) per element, and max_block|v|² ≤ ‖block‖², so
    ‖p − Q(p)‖ ≤ √min(d, n)/(2L)·‖p‖ per rank (L = 2^(bits−1) − 1, d = block); float32 scale."""
    q = inner(c.comp)
    levels = 2 ** (q.bits - 1) - 1
    return math.sqrt(min(q.block, c.n)) / (2 * levels) * (1 + 2.0**-20) + fp32_sum(c)


def bound_efsign(c: Cell) -> float:
    return math.sqrt(1 - 1 / c.n) + fp32_sum(c)


def bound_powersgd(c: Cell) -> float:
    comp = inner(c.comp)
    if not comp.compressible(SHAPE if c.n == SHAPE[0] * SHAPE[1] else (c.n,)):
        return fp32_sum(c)
    mean = torch.stack(c.ps).mean(0).reshape(SHAPE)
    s = torch.linalg.svdvals(mean)
    if int((s > 1e-6 * s[0]).sum()) <= comp.matrix_rank:   # rank(m) <= r: recovered to float32 rounding
        return 1e-5
    return 1.0 + 1e-5       # a projection of the mean onto span(P): never longer than the mean


@dataclass
class Row:
    method: str
    spec: str
    ef: str                          # "off", "on" or "built in"
    bound: Callable[[Cell], float]
    formula: str
    zeros: str                       # "elementwise", "all-zero tensor" or "sign(0) = +1"
    steps: int = 1                   # 2 where state carries over (EF residual, fp16 scale, momenta, Q)


def contraction_formula(name):
    return f"√(1 − k/n) + (N+2)·2⁻²⁴ ({name}: k = max(1, ⌈ρn⌉))"


ROWS = [
    Row("none", "none", "off", fp32_sum, "(N+2)·2⁻²⁴ (float32 sum and 1/N)", "elementwise"),
    Row("none", "none:ef=true", "on", fp32_sum, "(N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("fp16", "fp16", "off", bound_fp16,
        "probe step (float32): (N+2)·2⁻²⁴; scaled steps: (N+2)·2⁻¹¹ + √n·(N+2)·2⁻²⁵/(s·S)",
        "elementwise", steps=2),
    Row("fp16", "fp16:ef=true", "on", bound_fp16, "as fp16 without EF, on g + e", "elementwise", steps=2),
    Row("bf16", "bf16", "off", lambda c: 2.0**-8 + fp32_sum(c), "2⁻⁸ + (N+2)·2⁻²⁴", "elementwise"),
    Row("bf16", "bf16:ef=true", "on", lambda c: 2.0**-8 + fp32_sum(c),
        "2⁻⁸ + (N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("topk", "topk:density=0.1,ef=false", "off",
        bound_contraction, contraction_formula("ρ = 0.1"), "elementwise"),
    Row("topk", "topk:density=0.1", "on", bound_contraction,
        contraction_formula("ρ = 0.1"), "elementwise", steps=2),
    # top-k, then each kept value rounded to ±s/3 or ±s (s = max kept |v| ≤ ‖p‖): |error| ≤ s/3 on
    # at most k entries, so ‖p − C(p)‖ ≤ (√(1 − k/n) + √k/3)·‖p‖ per rank; zeros are never sent
    Row("topk", "topk:density=0.1,values=int2,ef=false", "off", bound_int2,
        "√(1 − k/n) + √k/3 + (N+2)·2⁻²⁴ (ρ = 0.1, values at 2 bits)", "elementwise"),
    Row("topk", "topk:density=0.1,values=int2", "on", bound_int2,
        "√(1 − k/n) + √k/3 + (N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("randomk", "randomk:density=0.1,ef=false", "off", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴ (the mean minus its part on the k shared indices)", "elementwise"),
    Row("randomk", "randomk:density=0.1", "on", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("threshold", "threshold:ef=false", "off", bound_threshold,
        "min(1, λ√n/S) + (N+2)·2⁻²⁴ (λ = 10⁻³)", "elementwise"),
    Row("threshold", "threshold", "on", bound_threshold,
        "min(1, λ√n/S) + (N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("dgc", "dgc:density=0.1", "built in", bound_contraction,
        contraction_formula("ρ = 0.1, on the velocity v"), "elementwise", steps=2),
    Row("qsgd", "qsgd", "off", bound_qsgd, "√min(d, n)/s + (N+2)·2⁻²⁴ (s = 16, d = 512)", "elementwise"),
    Row("qsgd", "qsgd:ef=true", "on", bound_qsgd, "√min(d, n)/s + (N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("terngrad", "terngrad", "off", bound_terngrad,
        "mean_r(‖p_r‖ + max|p_r|·√nnz(p_r))/S + (N+2)·2⁻²⁴", "elementwise"),
    Row("terngrad", "terngrad:ef=true", "on", bound_terngrad,
        "as without EF, on g + e", "elementwise", steps=2),
    Row("signsgd", "signsgd", "off", lambda c: 0.0,
        "0: equals the float64 majority vote (fraction of elements differing)", "sign(0) = +1"),
    Row("signsgd", "signsgd:ef=true", "on", lambda c: 0.0, "0", "sign(0) = +1", steps=2),
    Row("efsignsgd", "efsignsgd:ef=false", "off", bound_efsign, "√(1 − 1/n) + (N+2)·2⁻²⁴", "all-zero tensor"),
    Row("efsignsgd", "efsignsgd", "on", bound_efsign, "√(1 − 1/n) + (N+2)·2⁻²⁴", "all-zero tensor", steps=2),
    Row("powersgd", "powersgd:matrix_rank=2", "built in", bound_powersgd,
        "10⁻⁵ if rank(m) ≤ r (exact recovery), else 1 + 10⁻⁵ (P·Pᵀ·m: a projection of the mean); "
        "uncompressed shapes (N+2)·2⁻²⁴", "all-zero tensor", steps=2),
    # C(p) keeps some entries of p (SIDCo: those above a fitted threshold) and zeroes the rest
    Row("sidco", "sidco:density=0.1,ef=false", "off", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴ (a mask of p_r: ‖p_r − C(p_r)‖ ≤ ‖p_r‖)", "elementwise"),
    Row("sidco", "sidco:density=0.1", "on", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴", "elementwise", steps=2),
    # C(p) = μ on S (μ the mean of p on S), 0 elsewhere: ‖p_S − μ‖ ≤ ‖p_S‖, so ‖p − C(p)‖ ≤ ‖p‖
    Row("sbc", "sbc:density=0.1,ef=false", "off", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴ (‖p_r − C(p_r)‖ ≤ ‖p_r‖: μ is the mean of p_r on the kept side)", "elementwise"),
    Row("sbc", "sbc:density=0.1", "on", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴", "elementwise", steps=2),
    Row("lowbit", "lowbit:bits=4,block=64", "built in", bound_lowbit,
        "√min(d, n)/(2L) + (N+2)·2⁻²⁴ (L = 7, d = 64: round to nearest, max-abs scale per block)",
        "elementwise", steps=2),
    # the plan may give the tensor any candidate density: the smallest one's contraction holds
    Row("adaptive", "adaptive:base=topk,budget=0.1,every=1,ef=false", "off", bound_adaptive,
        contraction_formula("ρ = 0.025, the smallest candidate of budget 0.1"), "elementwise", steps=2),
    Row("adaptive", "adaptive:base=topk,budget=0.1,every=1", "on", bound_adaptive,
        contraction_formula("ρ = 0.025"), "elementwise", steps=2),
    # out − mean = −(1/N)·Σ_r e_r, each new residual e_r is p_r with some entries zeroed: ‖e_r‖ ≤ ‖p_r‖
    Row("gtopk", "gtopk:density=0.1", "built in", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴ (the residuals are parts of the p_r)", "elementwise", steps=2),
    Row("cltk", "cltk:density=0.1", "built in", lambda c: 1.0 + fp32_sum(c),
        "1 + (N+2)·2⁻²⁴ (the residuals are parts of the p_r)", "elementwise", steps=2),
    # first step: out − mean = −(1/N)·Σ_r w_r − s, with ‖p − Q(p)‖ ≤ ‖p‖ and ‖Q(p)‖ ≤ ‖p‖ for the
    # scaled sign, so ‖w_r‖ ≤ ‖p_r‖ and ‖s‖ ≤ ‖m‖ ≤ mean_r ‖p_r‖
    Row("twophase", "twophase", "built in", lambda c: 2.0 + fp32_sum(c),
        "2 + (N+2)·2⁻²⁴ (worker and server residuals of the scaled sign, first step)", "all-zero tensor"),
]


def output_rounding(c: Cell, eps: float) -> float:
    """The final cast to the gradient's dtype: relative u_d of the output, plus subnormal floor."""
    return UNIT[c.dtype] * (1 + eps) + math.sqrt(c.n) * FLOOR[c.dtype] / c.scale


# ---- running one cell ------------------------------------------------------------------------
def run_cell(row: Row, kind: str, dtype_name: str, world: int) -> List[dict]:
    dtype = DTYPES[dtype_name]
    grads = rank_inputs(kind, dtype, world)
    sim = SimulatedRanks(lambda: hvdcomp.get_compressor(row.spec), world)
    batched = isinstance(sim.comps[0], StepMethod)
    records = []
    for step in range(row.steps):
        ps = [compensated(c, g, "w").double() for c, g in zip(sim.comps, grads)]
        cell = Cell(world, dtype, grads[0].numel(), ps, float(sum(p.norm() for p in ps) / world), sim.comps[0])
        if batched:
            outs = sim.reduce_batch([[("w", g)] for g in grads])
            out = outs[0][0]
            assert all(torch.equal(o[0], out) for o in outs)
        else:
            encoded = sim.encode(grads, "w")
            cell.payload, cell.ctx = encoded[0]
            bound = row.bound(cell) if cell.scale > 0 else 0.0   # before decode records fp16 state
            outs = sim.combine(encoded, ranks=[0])    # summable: every rank decodes (checked equal)
            out = outs[0]
            assert all(o is None or torch.equal(o, out) for o in outs), "ranks disagree"
        if batched:
            bound = row.bound(cell) if cell.scale > 0 else 0.0
        where = f"{row.spec} {kind} {dtype_name} N={world} step {step}"
        assert out.shape == grads[0].shape and out.dtype == dtype, where
        assert torch.isfinite(out).all(), where
        stacked = torch.stack(ps) if ps[0].numel() else torch.zeros(world, 0, dtype=torch.float64)
        zero = (stacked == 0).all(0).reshape(out.shape)
        if row.zeros == "elementwise":
            assert (out[zero] == 0).all(), where
        elif row.zeros == "all-zero tensor" and zero.all():
            assert (out == 0).all(), where
        if row.zeros == "sign(0) = +1":
            votes = torch.where(stacked >= 0, 1.0, -1.0).sum(0).reshape(out.shape)
            majority = torch.where(votes >= 0, 1.0, -1.0)
            measured = float((out.double() != majority).double().mean()) if out.numel() else 0.0
            bound = 0.0
        elif cell.scale == 0:
            measured = 0.0 if (out == 0).all() else math.inf
        else:
            mean = stacked.mean(0).reshape(out.shape)
            measured = float((out.double() - mean).norm()) / cell.scale
            bound = bound + output_rounding(cell, bound)
        assert measured <= bound, (where, measured, bound)
        records.append({"method": row.method, "ef": row.ef, "spec": row.spec, "input": kind, "dtype": dtype_name,
                        "world": world, "step": step, "measured": measured, "bound": bound})
    return records


RESULTS: Dict[str, List[dict]] = {}


@pytest.mark.parametrize("row", ROWS, ids=[r.spec for r in ROWS])
def test_extreme_input_matrix(row):
    records = []
    for kind in INPUTS:
        for dtype_name in DTYPES:
            for world in WORLDS:
                records.extend(run_cell(row, kind, dtype_name, world))
    RESULTS[row.spec] = records
    assert len(records) == len(INPUTS) * len(DTYPES) * len(WORLDS) * row.steps


def test_every_registered_method_has_rows():
    assert {r.method for r in ROWS} == set(hvdcomp.available())
    for name in hvdcomp.available():
        cls = type(inner(hvdcomp.get_compressor(name)))
        efs = {r.ef for r in ROWS if r.method == name}
        assert efs == ({"built in"} if cls.builtin_error_feedback else {"off", "on"}), name


def test_write_measurements_and_render_the_table(tmp_path):
    """Writes every row's cells (JSON) and renders the markdown table from it."""
    if len(RESULTS) != len(ROWS):
        pytest.skip("run together with test_extreme_input_matrix (all rows) to write the table")
    from scripts.numerics_table import render

    rows = [{"method": r.method, "ef": r.ef, "spec": r.spec, "bound": r.formula, "zeros": r.zeros, "steps": r.steps}
            for r in ROWS]
    data = {"inputs": INPUTS, "dtypes": list(DTYPES), "worlds": WORLDS, "rows": rows,
            "cells": [c for r in ROWS for c in RESULTS[r.spec]],
            "environment": {"torch": torch.__version__, "python": platform.python_version(),
                            "machine": platform.machine()}}
    path = os.environ.get("HVDCOMP_NUMERICS_JSON") or str(tmp_path / "numerics.json")
    with open(path, "w") as fh:
        json.dump(data, fh, indent=0)
    text = render(json.load(open(path)))
    for r in ROWS:
        assert f"`{r.spec}`" in text
    assert "worst" in text.lower()
