#!/usr/bin/env python
"""End-to-end step-time benchmark of ONE data-parallel contender on the study's LSTM language model
or on a transformer encoder.

Launch under ``mpirun`` (one process per rank), e.g.::

    mpirun -np 4 python benchmarks/e2e_lm.py --contender hvdcomp:topk:density=0.01 \\
        --model medium --steps 10 --warmup 3 --output cell.json

Models (``--model``):

* ``small`` / ``medium`` / ``large``: the study's LSTM language model (:class:`hvdcomp.lm.LSTMLM`)
  on a corpus (``--data``, default Tiny Shakespeare), truncated BPTT of ``--bptt`` tokens with the
  hidden state carried from step to step, global batch ``--batch-size`` (default 256) sequences;
* ``transformer``: ``bench_models.Transformer`` (``torch.nn.TransformerEncoder``, 12 layers,
  d_model 128: 146 gradient tensors, 1,718,760 parameters) on **synthetic data**
  (``bench_models.synthetic_batch``: standard-normal inputs of 32 positions × 128 features, uniform
  targets over 1000 classes, drawn per rank and step from a generator seeded by ``--seed``, rank and
  step), global batch ``--batch-size`` (default 64) samples. There is no validation set: no
  perplexity is measured (``--eval-every`` must be 0), the run measures time per step only.

Contenders (all train the same model on the same data, global batch, learning rate and seed):

* ``hvdcomp:<spec>``  - :func:`hvdcomp.DistributedOptimizer` with compressor ``<spec>``
  (e.g. ``hvdcomp:topk:density=0.01``, ``hvdcomp:powersgd:rank=2``);
* ``horovod:none`` / ``horovod:fp16`` - stock ``hvd.DistributedOptimizer`` with
  ``hvd.Compression.none`` / ``hvd.Compression.fp16``;
* ``horovod-ring:none`` / ``horovod-ring:fp16`` - the same, launched with Open MPI's ring allreduce
  (``peers.RING_ALLREDUCE_ENV``); the worker refuses to start unless every rank has those settings;
* ``hvdcomp-ddp:<spec>`` - PyTorch ``DistributedDataParallel`` on gloo with hvdcomp's communication
  hook (:func:`hvdcomp.ddp.register`, the optimizer attached; ``@bucket`` for ``granularity="bucket"``);
* ``ddp:none`` / ``ddp:fp16`` / ``ddp:powersgd`` - PyTorch ``DistributedDataParallel`` on the gloo
  backend, without a communication hook, with ``fp16_compress_hook``, or with ``powerSGD_hook``
  (rank 2, ``start_powerSGD_iter=2``, warm start, error feedback). DDP runs do not initialise
  Horovod; the process group is set up from Open MPI's environment (see ``--master-addr``).

The training step is train_lm's: forward, backward, synchronize, clip the averaged gradient to
norm ``--clip``, SGD step (no momentum: DGC applies momentum itself). ``--warmup`` untimed steps
are followed by ``--steps`` timed ones; each rank times every step with ``time.perf_counter``
(no barrier in the loop). Validation perplexity is measured every ``--eval-every`` steps (and at the
end) outside the timed region. After training, ``--compute-ref-steps`` steps of the same
forward/backward/clip/SGD step on a communication-free copy of the model give each rank's pure
compute time, so ``comm_critical_seconds = median step - median compute-only step`` estimates
the communication (plus compression) on the critical path for every contender alike.

Rank 0 writes ``--output`` (JSON). All times are seconds, all sizes bytes. Per-step statistics
take the maximum over ranks of each step first, then the median / mean over the timed steps.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import platform
import signal
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from mpi4py import MPI  # first: MPI is initialised with MPI_THREAD_MULTIPLE before Horovod attaches

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hvdcomp  # noqa: E402
import hvdcomp.ddp  # noqa: E402
from hvdcomp.launch import abort_on_uncaught_exception, recorded_env  # noqa: E402
from hvdcomp.lm import LSTMLM, MODEL_SIZES, batchify, load_corpus, rank_columns  # noqa: E402
from hvdcomp.lm.data import default_data_path  # noqa: E402
from hvdcomp.metrics import PhaseTimer  # noqa: E402
from mpi_scripts.results import summary, write_json  # noqa: E402
from mpi_scripts.train_lm import evaluate, train_step  # noqa: E402  (train_lm's step and evaluation)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402
import peers  # noqa: E402

log = logging.getLogger("e2e_lm")

MODELS = sorted(MODEL_SIZES) + ["transformer"]
#: per-model defaults of the options whose default depends on the model
MODEL_DEFAULTS = {"transformer": {"batch_size": 64, "lr": 0.1}}
LM_DEFAULTS = {"batch_size": 256, "lr": 20.0}
# ---- command line ----------------------------------------------------------------------------------
def parse_contender(text: str) -> Tuple[str, str]:
    """``"hvdcomp:topk:density=0.01"`` -> ``("hvdcomp", "topk:density=0.01")``; peers likewise, the
    family being the code path (``"horovod-ring:fp16"`` -> ``("horovod", "fp16")``).

    Raises:
        ValueError: an unknown family or peer variant, or a bad hvdcomp spec.
    """
    _, variant = peers.split(text)
    family = peers.code_path(text)
    if family in ("hvdcomp", "hvdcomp-ddp"):
        hvdcomp.get_compressor(peers.hvdcomp_options(variant)[0])  # validates (ValueError names the problem)
    return family, variant


def check_launch_env(contender: str, env=None) -> None:
    """Refuse to run a contender whose own launch settings (:func:`peers.launch_env`) are missing.

    Raises:
        RuntimeError: naming the missing variables and how to pass them.
    """
    missing = peers.missing_launch_env(contender, os.environ if env is None else env)
    if missing:
        raise RuntimeError(f"{contender} needs {' '.join(f'{k}={v}' for k, v in missing.items())} on every rank: "
                           f"launch it through benchmarks/netem_e2e.py, or add "
                           f"{' '.join(f'-x {k}={v}' for k, v in missing.items())} to mpirun")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--contender", required=True, help="hvdcomp:<spec> | " + " | ".join(peers.PEERS))
    p.add_argument("--model", choices=MODELS, default="medium",
                   help="LSTM size on the corpus, or transformer (synthetic data)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--eval-every", type=int, default=0,
                   help="validation perplexity every E optimizer steps (counting warm-up; also at step 0); "
                        "0: only at the end")
    p.add_argument("--compute-ref-steps", type=int, default=3,
                   help="communication-free steps timed after training (0: skip the compute reference)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch, sequences (split over ranks); default 256 (LSTM), 64 (transformer)")
    p.add_argument("--bptt", type=int, default=35, help="tokens per step (LSTM)")
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate; default 20 (LSTM), 0.1 (transformer)")
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--dropout", type=float, default=0.2, help="LSTM dropout (the transformer has none)")
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--eval-batch-size", type=int, default=40, help="global evaluation batch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default=None, help="corpus (default: ../shared/data/tinyshakespeare/input.txt)")
    p.add_argument("--master-addr", default=None,
                   help="DDP rendezvous host (default: $MASTER_ADDR, else 127.0.0.1 when all ranks share "
                        "a hostname, else the address rank 0's hostname resolves to)")
    p.add_argument("--master-port", type=int, default=None,
                   help="DDP rendezvous port (default: $MASTER_PORT, else a free port picked by rank 0 "
                        "and sent to the others over MPI)")
    p.add_argument("--dist-timeout", type=float, default=600.0, help="torch.distributed timeout, seconds")
    p.add_argument("--output", required=True, help="results JSON (written by rank 0)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    try:
        args.family, args.variant = parse_contender(args.contender)
    except ValueError as e:
        p.error(str(e))
    for k, v in MODEL_DEFAULTS.get(args.model, LM_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.model == "transformer" and (args.eval_every or args.data):
        p.error("--model transformer trains on synthetic data and has no validation set: "
                "use --eval-every 0 and no --data")
    if args.steps < 1 or args.warmup < 0 or args.eval_every < 0 or args.compute_ref_steps < 0:
        p.error("need --steps >= 1 and --warmup, --eval-every, --compute-ref-steps >= 0")
    return args


# ---- helpers -----------------------------------------------------------------------------------
def across_ranks(per_rank: List[List[float]]) -> Dict[str, object]:
    """Per-step max and mean over ranks, then statistics over steps (``per_step`` = the maxima).

    ``median_of_rank_min``: per step the smallest value over ranks, median over steps; for a
    communication wait that is the rank that arrived last, i.e. the transfer itself without the
    other ranks' compute skew."""
    worst = [max(col) for col in zip(*per_rank)]
    mean = [statistics.fmean(col) for col in zip(*per_rank)]
    least = [min(col) for col in zip(*per_rank)]
    return {**summary(worst), "median_of_rank_mean": statistics.median(mean),
            "median_of_rank_min": statistics.median(least),
            "per_step": worst, "per_rank_median": [statistics.median(r) for r in per_rank]}


def init_gloo(comm, args) -> hvdcomp.ddp.runtime.TorchDistCollectives:
    """``torch.distributed`` on gloo (:func:`hvdcomp.ddp.init_process_group`, rank and size from
    Open MPI's environment) at ``--master-addr``/``--master-port`` (else ``$MASTER_ADDR``/``$MASTER_PORT``,
    else rank 0's address where the ranks span hosts, and a port free on rank 0, sent over MPI)."""
    addr = args.master_addr or os.environ.get("MASTER_ADDR")
    if addr is None and len(set(comm.allgather(socket.gethostname()))) > 1:
        addr = comm.bcast(socket.gethostbyname(socket.gethostname()) if comm.rank == 0 else None, root=0)
    port = args.master_port or os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket() as s:  # (a port that was free a moment ago: the store binds it next)
            s.bind(("", 0))
            port = comm.bcast(s.getsockname()[1] if comm.rank == 0 else None, root=0)
    os.environ.update({"MASTER_PORT": str(port), **({"MASTER_ADDR": addr} if addr else {})})
    return hvdcomp.ddp.runtime.TorchDistCollectives(
        hvdcomp.ddp.init_process_group("gloo", timeout_s=args.dist_timeout))


def ddp_powersgd_payload(model, rank: int = 2, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank sends per step with DDP's ``powerSGD_hook`` after its start iteration (fp32):
    ``4·(n+m)·r`` per compressed matrix, ``4·numel`` per 1-D or not-worth-compressing tensor
    (the hook's ``_should_compress`` rule). An estimate of the payload, not a measurement."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += 4 * p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += 4 * ((n + m) * r if n * m >= (n + m) * r * min_compression_rate else n * m)
    return total


# ---- the workloads: model, data, loss ------------------------------------------------------------
class LMWorkload:
    """The study's LSTM language model on a corpus: each rank trains on its columns of the global
    batch, ``bptt`` tokens per step, hidden state carried across steps (reset at each new pass)."""

    has_validation = True

    def __init__(self, args, rank: int, size: int):
        self.args = args
        self.data_path = args.data or default_data_path()
        self.corpus = load_corpus(self.data_path, vocab_size=args.vocab_size)
        self.train = batchify(self.corpus.train, args.batch_size)[:, rank_columns(args.batch_size, rank, size)]
        self.n_chunks = (self.train.shape[0] - 1) // args.bptt  # full chunks only: every step costs the same
        self.per_rank = self.train.shape[1]
        self.validation = self.corpus.valid

    def make_model(self) -> LSTMLM:
        """A fresh model (weights from the global RNG)."""
        return LSTMLM(self.corpus.vocab_size, MODEL_SIZES[self.args.model], dropout=self.args.dropout)

    def init_state(self, model):
        return model.init_state(self.per_rank)

    def new_pass(self, step: int) -> bool:
        """Does ``step`` start a new pass over the data (state reset)?"""
        return step % self.n_chunks == 0

    def batch(self, step: int):
        """(input tokens, target tokens), each (bptt, sequences per rank)."""
        i = (step % self.n_chunks) * self.args.bptt
        return self.train[i:i + self.args.bptt], self.train[i + 1:i + 1 + self.args.bptt]

    def loss(self, module, x, y, state):
        """(mean cross-entropy per token, new hidden state)."""
        state = tuple(h.detach() for h in state)
        logits, state = module(x, state)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), state

    def describe(self) -> Dict[str, object]:
        return {"model_description": f"{self.args.model} LSTM language model", "data": self.data_path,
                "corpus": self.corpus.describe(), "sequences_per_rank": self.per_rank,
                "chunks_per_epoch": self.n_chunks}


class SyntheticWorkload:
    """A ``bench_models`` model on synthetic data (no validation set): each rank draws its share of
    the global batch per step from a generator seeded by (seed, rank, step)."""

    has_validation = False
    validation = None

    def __init__(self, args, rank: int, size: int):
        self.args, self.rank, self.name = args, rank, args.model
        self.per_rank = len(range(args.batch_size)[rank_columns(args.batch_size, rank, size)])

    def make_model(self) -> torch.nn.Module:
        return bench_models.make_model(self.name)

    def init_state(self, model):
        return None

    def new_pass(self, step: int) -> bool:
        return False

    def batch(self, step: int):
        gen = torch.Generator().manual_seed((self.args.seed * 100003 + self.rank) * 1000003 + step)
        return bench_models.synthetic_batch(self.name, gen, self.per_rank)

    def loss(self, module, x, y, state):
        return bench_models.loss(self.name, module, x, y), None

    def describe(self) -> Dict[str, object]:
        t = bench_models.TRANSFORMER
        return {"model_description": f"transformer encoder ({t['layers']} layers, d_model {t['d_model']}, "
                                     f"{t['nhead']} heads, feed-forward {t['dim_feedforward']}) + linear head, "
                                     f"synthetic data ({t['seq']} positions x {t['d_model']} features, "
                                     f"{t['classes']} classes)",
                "data": "synthetic", "corpus": None, "sequences_per_rank": self.per_rank,
                "sequence_length": t["seq"]}


def make_workload(args, rank: int, size: int):
    return SyntheticWorkload(args, rank, size) if args.model == "transformer" else LMWorkload(args, rank, size)


# ---- the contenders ----------------------------------------------------------------------------
class Setup:
    """What a contender's step needs: the module to call, the optimizer, how to evaluate."""

    def __init__(self, args, raw: torch.nn.Module, comm):
        self.args, self.raw, self.comm = args, raw, comm
        self.module = raw            # what forward is called on (DDP wrapper for DDP)
        self.opt = None
        self.timer: Optional[PhaseTimer] = None   # hvdcomp's phase timer
        self.sync: Optional[Callable[[], None]] = None  # explicit synchronize (Horovod family)
        self.skip_sync = contextlib.nullcontext
        self.notes: Dict[str, object] = {}
        self.payload_bytes_est: Optional[int] = None
        self.evaluate: Callable = None
        self.info: Dict[str, object] = {}


def build(args, raw: torch.nn.Module, comm) -> Setup:
    """Create the contender's optimizer / DDP wrapper around ``raw`` (parameters synchronised)."""
    s = Setup(args, raw, comm)
    n_params = sum(p.numel() for p in raw.parameters())
    sgd = torch.optim.SGD(raw.parameters(), lr=args.lr, momentum=0.0)
    if args.family in ("hvdcomp", "horovod"):
        import horovod.torch as hvd

        hvd.broadcast_parameters(raw.state_dict(), root_rank=0)
        if args.family == "hvdcomp":
            spec, options = peers.hvdcomp_options(args.variant)  # <spec>[@bucket]
            compressor = hvdcomp.get_compressor(spec)
            compressor.set_epoch(0)  # DGC's density warm-up, as train_lm's first epoch
            s.opt = hvdcomp.DistributedOptimizer(sgd, named_parameters=raw.named_parameters(),
                                                 compression=compressor, **options)
            s.timer = s.opt.timer
            s.info["compressor"] = compressor.describe()
            s.info["transport"] = str(s.opt.transport)
        else:
            compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.variant]
            s.opt = hvd.DistributedOptimizer(sgd, named_parameters=raw.named_parameters(),
                                             compression=compression)
            s.payload_bytes_est = n_params * (2 if args.variant == "fp16" else 4)
            s.info["transport"] = "horovod-allreduce"
        s.sync, s.skip_sync = s.opt.synchronize, s.opt.skip_synchronize
        s.evaluate = lambda model, stream: evaluate(model, stream, args.eval_batch_size, args.bptt, hvd)
        s.info["horovod_controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        coll = init_gloo(comm, args)
        s.info["rendezvous"] = f"{coll.info.master_addr}:{coll.info.master_port}"
        # PyTorch's powerSGD_hook issues its second allreduce from the first one's callback; on gloo
        # with more than one bucket the ranks then interleave the buckets' collectives in different
        # orders and gloo aborts ("Received data size doesn't match expected size"). One bucket
        # (the whole model) keeps the order the same on every rank.
        one_bucket = args.family == "ddp" and args.variant == "powersgd"
        buckets = {"bucket_cap_mb": 4 * n_params / 2 ** 20 + 1} if one_bucket else {}  # else DDP's default
        s.module = DDP(raw, **buckets)  # broadcasts rank 0's parameters
        if one_bucket:
            s.notes["buckets"] = "one DDP bucket: powerSGD_hook on gloo aborts with several"
        if args.family == "hvdcomp-ddp":

            spec, options = peers.hvdcomp_options(args.variant)
            compressor = hvdcomp.get_compressor(spec)
            compressor.set_epoch(0)  # DGC's density warm-up, as train_lm's first epoch
            hook = hvdcomp.ddp.register(s.module, compressor, optimizer=sgd,
                                        granularity=options.get("granularity", "tensor"))
            s.timer = hook.timer
            s.info["compressor"] = compressor.describe()
            s.info["transport"] = hook.transport
        elif args.variant == "fp16":
            s.module.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
            s.payload_bytes_est = 2 * n_params
        elif args.variant == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                start_powerSGD_iter=2, use_error_feedback=True,
                                                warm_start=True, random_seed=args.seed)
            s.module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            s.payload_bytes_est = ddp_powersgd_payload(raw)
            s.notes["payload_bytes_est"] = "steady state (after start_powerSGD_iter=2); before it 4 B/parameter"
        else:
            s.payload_bytes_est = 4 * n_params
        s.opt = sgd
        s.info.setdefault("transport", "gloo-allreduce (DDP buckets)")
        s.evaluate = lambda model, stream: evaluate(model, stream, args.eval_batch_size, args.bptt, coll)
    return s


def nic_tx_bytes() -> Optional[int]:
    """Bytes transmitted so far by this network namespace's interfaces other than ``lo`` (the
    emulated host's link under netem), from /sys/class/net; None where unreadable."""
    total, found = 0, False
    try:
        for dev in os.listdir("/sys/class/net"):
            if dev == "lo":
                continue
            with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
                total += int(f.read())
                found = True
    except OSError:
        return None
    return total if found else None


def compute_reference(args, w, raw: torch.nn.Module, start_step: int) -> List[float]:
    """Seconds per communication-free step (same forward/backward/clip/SGD) on a copy of ``raw``."""
    ref = w.make_model()
    ref.load_state_dict(raw.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    state, times = w.init_state(ref), []
    for k in range(args.compute_ref_steps):
        x, y = w.batch(start_step + k)
        _, state, parts = train_step(ref, opt, lambda m: w.loss(m, x, y, state), ref.parameters(), args.clip)
        times.append(parts["wall"])
    return times


# ---- main --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    abort_on_uncaught_exception()  # a failing rank ends the whole job instead of hanging it
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: stacks of a stuck rank
    logging.basicConfig(level=args.log_level if rank == 0 else "WARNING",
                        format=f"[%(asctime)s rank {rank}] %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    check_launch_env(args.contender)
    if args.family in ("hvdcomp", "horovod"):
        import horovod.torch as hvd

        hvd.init()
        if hvd.size() != size or hvd.rank() != rank:
            raise RuntimeError(f"Horovod rank {hvd.rank()}/{hvd.size()} != MPI rank {rank}/{size}")
    if args.batch_size % size:
        log.warning("global batch %d is not divisible by %d ranks: ranks get unequal shares",
                    args.batch_size, size)

    w = make_workload(args, rank, size)
    torch.manual_seed(args.seed)
    raw = w.make_model()
    n_params = sum(p.numel() for p in raw.parameters())
    n_tensors = sum(1 for p in raw.parameters() if p.requires_grad)
    t_setup = time.perf_counter()
    s = build(args, raw, comm)
    setup_seconds = time.perf_counter() - t_setup
    torch.manual_seed(args.seed * 1000 + rank)  # dropout masks differ per rank
    log.info("%s on %d rank(s): %s, %d parameters in %d tensors, %d sequences per rank, "
             "%d warm-up + %d timed steps", args.contender, size, w.describe()["model_description"],
             n_params, n_tensors, w.per_rank, args.warmup, args.steps)

    curve: List[Tuple[int, float]] = []
    eval_seconds = 0.0

    def evaluate(step: int) -> None:
        nonlocal eval_seconds
        t = time.perf_counter()
        ppl = s.evaluate(raw, w.validation)
        eval_seconds += time.perf_counter() - t
        curve.append((step, ppl))
        log.info("step %d: valid ppl %.2f", step, ppl)

    if args.eval_every:
        evaluate(0)
    total = args.warmup + args.steps
    state = w.init_state(raw)
    timed: List[Dict[str, float]] = []
    losses: List[float] = []
    t_train = time.perf_counter()
    for step in range(total):
        if w.new_pass(step):
            state = w.init_state(raw)  # a new pass over the data
        x, y = w.batch(step)
        tx0 = nic_tx_bytes()
        loss, state, parts = train_step(s.module, s.opt, lambda m: w.loss(m, x, y, state), s.raw.parameters(),
                                        args.clip, s.timer, s.sync, s.skip_sync)
        tx1 = nic_tx_bytes()
        if tx0 is not None and tx1 is not None:  # frames on the wire incl. TCP/IP headers
            parts["nic_tx_bytes"] = float(tx1 - tx0)
        losses.append(loss.item())
        if step >= args.warmup:
            timed.append(parts)
        log.info("step %d%s: loss %.3f, %.3f s (fwd+bwd %.3f, sync %.3f, update %.3f)", step + 1,
                 " (warm-up)" if step < args.warmup else "", losses[-1], parts["wall"], parts["fwd_bwd"],
                 parts["sync"], parts["update"])
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < total:
            evaluate(step + 1)
    train_seconds = time.perf_counter() - t_train
    if w.has_validation:
        evaluate(total)
    ref_times = compute_reference(args, w, raw, total) if args.compute_ref_steps else []

    # ---- gather and summarise (mpi4py: works for every contender) ----
    mine = {"parts": timed, "ref": ref_times, "host": socket.gethostname(),
            "processor": MPI.Get_processor_name(), "env": recorded_env(), "losses": losses}
    everyone = comm.gather(mine, root=0)
    if rank == 0:
        keys = sorted(timed[0])
        per_key = {k: across_ranks([[row[k] for row in r["parts"]] for r in everyone]) for k in keys}
        step_stats = per_key.pop("wall")
        bytes_keys = [k for k in ("bytes_sent", "bytes_received", "dense_bytes") if k in per_key]
        byte_stats = {k: per_key.pop(k) for k in bytes_keys}
        phase_stats = {k[len("phase_"):]: per_key.pop(k) for k in list(per_key) if k.startswith("phase_")}
        ref_stats = across_ranks([r["ref"] for r in everyone]) if ref_times else None
        critical = step_stats["median"] - ref_stats["median"] if ref_stats else None
        comm_wait = (phase_stats["communicate"]["median"] if phase_stats
                     else per_key["sync"]["median"] if args.family == "horovod" else None)
        envs = [r["env"] for r in everyone]
        import horovod

        results = {
            "status": "ok",
            "contender": args.contender,
            "family": args.family,
            "variant": args.variant,
            "config": {**{k: v for k, v in vars(args).items() if k not in ("family", "variant")},
                       "world_size": size, "parameters": n_params, "tensors": n_tensors,
                       **{k: v for k, v in w.describe().items() if k != "corpus"}},
            "launch_env": peers.launch_env(args.contender),
            "info": s.info,
            "notes": s.notes,
            "corpus": w.describe()["corpus"],
            "versions": {"torch": torch.__version__, "horovod": horovod.__version__,
                         "hvdcomp": hvdcomp.__version__, "mpi4py": __import__("mpi4py").__version__,
                         "mpi": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00"),
                         "python": platform.python_version()},
            "world_size": size,
            "hostnames": [r["host"] for r in everyone],
            "processor_names": [r["processor"] for r in everyone],
            "env": envs[0],
            "env_same_on_all_ranks": all(e == envs[0] for e in envs),
            "env_by_rank": envs if any(e != envs[0] for e in envs) else None,
            "timing": {
                "units": "seconds per optimizer step; per step the max over ranks, then over timed steps",
                "warmup_steps": args.warmup,
                "timed_steps": len(timed),
                "step": step_stats,
                "parts": per_key,        # fwd_bwd, sync, update
                "phases": phase_stats,   # hvdcomp's PhaseTimer (exclusive phases), hvdcomp only
                "compute_reference": ref_stats,
                "comm_critical_seconds": critical,
                "comm_wait_seconds": comm_wait,
                "setup_seconds": setup_seconds,
                "train_seconds": train_seconds,
                "eval_seconds": eval_seconds,
            },
            "bytes": {
                "units": "bytes per optimizer step per rank (payload this rank contributes)",
                "measured": byte_stats or None,
                "payload_per_step_est": s.payload_bytes_est,
                "dense_fp32_per_step": 4 * n_params,
            },
            "val_ppl_curve": curve,
            "final_val_ppl": curve[-1][1] if curve else None,
            "train_loss_rank0": losses,
        }
        write_json(args.output, results)
        ph = " ".join(f"{k} {v['median']:.3f}" for k, v in phase_stats.items())
        print(f"SUMMARY contender={args.contender} ranks={size} model={args.model} "
              f"step_median={step_stats['median']:.3f}s step_mean={step_stats['mean']:.3f}s "
              f"compute_ref={ref_stats['median'] if ref_stats else float('nan'):.3f}s "
              f"comm_critical={critical if critical is not None else float('nan'):.3f}s "
              f"{'(' + ph + ') ' if ph else ''}val_ppl={curve[-1][1] if curve else float('nan'):.2f} "
              f"-> {args.output}", flush=True)
    if args.family in ("ddp", "hvdcomp-ddp"):
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
