#!/usr/bin/env python
"""Communication-only benchmark on the study's LSTM model, for fitting alpha-beta cost models.

Launch under ``mpirun`` (2 or 4 ranks, or any number), e.g.::

    mpirun -np 4 python benchmarks/comm_lm.py --model medium --output comm.json

Two parts (no forward/backward anywhere):

1. **methods**: for each hvdcomp spec in ``--methods`` (``SPEC@key=value,...`` adds optimizer
   options: ``allgather`` and ``transport``, e.g. ``topk:density=0.01@allgather=hierarchical``),
   an :func:`hvdcomp.DistributedOptimizer` on the model; every repetition writes the same fixed random gradients (different per rank) into
   ``p.grad`` and calls ``opt.synchronize()``, i.e. compress + collectives + decompress of a whole
   step, then applies it (``step()`` with lr 0, untimed) so that compressor state moves on as in
   training. Recorded per repetition: wall seconds of ``synchronize()`` and hvdcomp's PhaseTimer
   phases (compress / communicate / decompress seconds) and bytes sent / received by this rank.
2. **collectives**: raw collectives over a sweep of message sizes (bytes contributed per rank):
   Horovod ``allreduce`` (float32, sum; its latency includes Horovod's cycle time,
   ``HOROVOD_CYCLE_TIME``), mpi4py ``Allreduce`` (float32, sum) and mpi4py ``Allgatherv`` (bytes).
   Each call is preceded by a barrier (not timed).

Every timed value is the maximum over ranks of one repetition, then the median over repetitions.
Slow cases are bounded: after the first timed repetition, a case runs at most
``--budget`` seconds (at least one repetition), and a collective whose single call exceeds
``--max-call-seconds`` is not tried at larger sizes. Per collective, ``t(n) = alpha + beta * n``
is fitted by least squares on relative error (weights 1/t): ``alpha`` in seconds, ``beta`` in
seconds per byte (n = bytes per rank). Rank 0 writes ``--output`` (JSON).
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List

from mpi4py import MPI  # first: MPI_THREAD_MULTIPLE before Horovod attaches

import numpy as np
import torch
import horovod.torch as hvd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hvdcomp  # noqa: E402
from hvdcomp.launch import abort_on_uncaught_exception, recorded_env  # noqa: E402
from hvdcomp.lm import LSTMLM, MODEL_SIZES  # noqa: E402
from mpi_scripts.results import summary, write_json  # noqa: E402

log = logging.getLogger("comm_lm")

DEFAULT_METHODS = ["none", "fp16", "topk:density=0.01", "topk:density=0.001", "dgc:density=0.01",
                   "dgc:density=0.001", "qsgd", "powersgd:rank=2"]
DEFAULT_SIZES = [8 * 4 ** k for k in range(12)] + [16 * 2 ** 20]  # 8 B ... 8 MiB, then 16 MiB
COLLECTIVES = ("hvd-allreduce", "mpi-allreduce", "mpi-allgatherv")

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="medium")
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--methods", nargs="*", default=DEFAULT_METHODS, help="hvdcomp specs (none: skip)")
    p.add_argument("--collectives", nargs="*", default=list(COLLECTIVES), choices=COLLECTIVES)
    p.add_argument("--sizes", nargs="*", type=int, default=DEFAULT_SIZES,
                   help="message sizes, bytes per rank (rounded up to whole float32 for allreduce)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per case (at most)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per case")
    p.add_argument("--budget", type=float, default=60.0, help="seconds per case after the first timed rep")
    p.add_argument("--max-call-seconds", type=float, default=20.0,
                   help="stop a collective's size sweep after a call slower than this (seconds)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", required=True, help="results JSON (rank 0)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.budget <= 0:
        p.error("need --reps >= 1, --warmup >= 0, --budget > 0")
    for entry in args.methods:
        try:
            method_options(entry)
        except ValueError as e:
            p.error(str(e))
    return args


#: optimizer options a --methods entry may set after "@"
OPTIMIZER_OPTIONS = ("allgather", "transport")


def method_options(entry: str):
    """``SPEC@key=value,...`` -> (spec, DistributedOptimizer keyword arguments).

    Raises:
        ValueError: a bad spec, or an option other than :data:`OPTIMIZER_OPTIONS`.
    """
    spec, _, opts = entry.partition("@")
    hvdcomp.get_compressor(spec)
    kwargs = dict(kv.split("=", 1) for kv in opts.split(",") if kv) if opts else {}
    bad = set(kwargs) - set(OPTIMIZER_OPTIONS)
    if bad:
        raise ValueError(f"{entry}: unknown optimizer option(s) {sorted(bad)} after '@'; known: {OPTIMIZER_OPTIONS}")
    return spec, kwargs


def worst(comm, value: float) -> float:
    """Maximum over ranks (collective)."""
    return comm.allreduce(value, op=MPI.MAX)


def repeat(comm, fn: Callable[[], Dict[str, float]], args) -> List[Dict[str, float]]:
    """Run ``fn`` (returns this rank's record with a ``"wall"`` entry) ``--warmup`` times untimed,
    then up to ``--reps`` times within ``--budget`` seconds; every rank runs the same count."""
    for _ in range(args.warmup):
        fn()
    first = fn()
    reps = args.reps
    t1 = worst(comm, first["wall"])
    if t1 * (args.reps - 1) > args.budget:
        reps = max(1, 1 + int(args.budget / max(t1, 1e-9)))
    return [first] + [fn() for _ in range(min(reps, args.reps) - 1)]


def summarize(comm, recs: List[Dict[str, float]]) -> Dict[str, object]:
    """Per key: the max over ranks of each repetition, then median / mean / min / max over reps."""
    out: Dict[str, object] = {"reps": len(recs)}
    for key in sorted(recs[0]):
        per_rep = [worst(comm, float(r[key])) for r in recs]
        mean_rep = [comm.allreduce(float(r[key]), op=MPI.SUM) / comm.size for r in recs]
        out[key] = {**summary(per_rep), "median_of_rank_mean": statistics.median(mean_rep)}
    return out


def bench_method(comm, model: LSTMLM, entry: str, grads: Dict[str, torch.Tensor], args) -> Dict[str, object]:
    """Repeated ``synchronize()`` of one hvdcomp method (``SPEC[@options]``) on fixed gradients."""
    spec, options = method_options(entry)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.0)  # lr 0: parameters stay; DGC needs momentum 0
    opt = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=spec,
                                       **options)
    timer = opt.timer
    params = list(model.named_parameters())

    def once() -> Dict[str, float]:
        for name, p in params:
            p.grad = grads[name].clone()
        comm.Barrier()
        timer.begin_step()
        t0 = time.perf_counter()
        opt.synchronize()
        wall = time.perf_counter() - t0
        rec = timer.end_step()
        with opt.skip_synchronize():  # commit the step (compressor state moves on as in training:
            opt.step()                # fp16's scale after its probe step, cltk's next leader)
        return {"wall": wall, "compress": rec["compress"], "communicate": rec["communicate"],
                "decompress": rec["decompress"], "bytes_sent": rec["bytes_sent"],
                "bytes_received": rec["bytes_received"], "dense_bytes": rec["dense_bytes"]}

    try:
        res = summarize(comm, repeat(comm, once, args))
    except BaseException:
        opt.remove_hooks()  # (close() refuses a step left half done)
        raise
    opt.close()  # stops its allgather thread: the next method builds its own
    res["compressor"] = opt.compression.describe()
    res["transport"] = str(opt.transport)
    return res


def collective_call(kind: str, nbytes: int, comm, tag: int) -> Callable[[], Dict[str, float]]:
    """A closure timing one call of ``kind`` with ``nbytes`` per rank (seconds in ``"wall"``)."""
    if kind == "mpi-allgatherv":
        send = np.full(nbytes, comm.rank % 251, dtype=np.uint8)
        recv = np.empty(nbytes * comm.size, dtype=np.uint8)
        counts = [nbytes] * comm.size
        displs = [nbytes * r for r in range(comm.size)]

        def call():
            comm.Allgatherv(send, [recv, counts, displs, MPI.BYTE])
    elif kind == "mpi-allreduce":
        send = np.ones(max(1, -(-nbytes // 4)), dtype=np.float32)
        recv = np.empty_like(send)

        def call():
            comm.Allreduce(send, recv, op=MPI.SUM)
    else:
        tensor = torch.ones(max(1, -(-nbytes // 4)), dtype=torch.float32)
        name = f"comm_lm.{tag}"

        def call():
            hvd.allreduce(tensor, op=hvd.Sum, name=name)

    def once() -> Dict[str, float]:
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        return {"wall": time.perf_counter() - t0}

    return once


def fit_alpha_beta(points: List[tuple]) -> Dict[str, float]:
    """Least squares of ``t = alpha + beta * n`` weighted by 1/t (relative error), alpha >= 0.

    Args: points: (n bytes, t seconds). Returns alpha (s), beta (s/B), and the bandwidth 1/beta (B/s).
    """
    if len(points) < 2:
        return {}
    n = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    w = 1.0 / np.maximum(t, 1e-9)
    a = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if alpha < 0:  # latency cannot be negative: refit the slope alone
        alpha, beta = 0.0, float(np.sum(n * t * w * w) / np.sum(n * n * w * w))
    pred = alpha + beta * n
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "bandwidth_bytes_per_s": float(1.0 / beta) if beta > 0 else None,
            "max_rel_error": float(np.max(np.abs(pred - t) / t)), "points": len(points)}


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    abort_on_uncaught_exception()
    hvd.init()
    logging.basicConfig(level=args.log_level if comm.rank == 0 else "WARNING",
                        format=f"[%(asctime)s rank {comm.rank}] %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(args.seed)
    model = LSTMLM(args.vocab_size, MODEL_SIZES[args.model])
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed * 1000 + comm.rank)
    grads = {name: torch.randn(p.shape, generator=gen) * 1e-3 for name, p in model.named_parameters()}
    log.info("%d ranks, %s model (%d parameters, %.1f MB fp32), methods %s, collectives %s",
             comm.size, args.model, n_params, 4 * n_params / 1e6, args.methods, args.collectives)

    methods = {}
    for spec in args.methods:
        methods[spec] = bench_method(comm, model, spec, grads, args)
        m = methods[spec]
        log.info("%-22s sync %.4f s (compress %.4f, communicate %.4f, decompress %.4f), sent %d B, %d reps",
                 spec, m["wall"]["median"], m["compress"]["median"], m["communicate"]["median"],
                 m["decompress"]["median"], m["bytes_sent"]["median"], m["reps"])

    collectives, fits = {}, {}
    for kind in args.collectives:
        rows = []
        for k, nbytes in enumerate(sorted(args.sizes)):
            res = summarize(comm, repeat(comm, collective_call(kind, nbytes, comm, k), args))
            rows.append({"bytes": nbytes, "seconds": res["wall"]["median"], **res})
            log.info("%-15s %10d B: %.6f s (%d reps)", kind, nbytes, res["wall"]["median"], res["reps"])
            if res["wall"]["max"] > args.max_call_seconds:
                log.info("%s: %.1f s per call > --max-call-seconds: larger sizes skipped", kind, res["wall"]["max"])
                break
        collectives[kind] = rows
        fits[kind] = fit_alpha_beta([(r["bytes"], r["seconds"]) for r in rows])
        if fits[kind]:
            log.info("%s fit: alpha %.3g s, beta %.3g s/B (%.1f MB/s)", kind, fits[kind]["alpha_s"],
                     fits[kind]["beta_s_per_byte"], (fits[kind]["bandwidth_bytes_per_s"] or 0) / 1e6)

    hosts = comm.gather(socket.gethostname(), root=0)
    envs = comm.gather(recorded_env(), root=0)
    if comm.rank == 0:
        import horovod

        write_json(args.output, {
            "status": "ok",
            "bench": "comm",
            "units": "seconds (max over ranks per repetition, median over repetitions); bytes per rank",
            "config": vars(args),
            "world_size": comm.size,
            "parameters": n_params,
            "hostnames": hosts,
            "env": envs[0],
            "env_same_on_all_ranks": all(e == envs[0] for e in envs),
            "versions": {"torch": torch.__version__, "horovod": horovod.__version__,
                         "hvdcomp": hvdcomp.__version__, "python": platform.python_version(),
                         "mpi": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00")},
            "methods": methods,
            "collectives": collectives,
            "fits": fits,
        })
        print(f"SUMMARY comm ranks={comm.size} model={args.model} methods={len(methods)} -> {args.output}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
