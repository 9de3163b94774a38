#!/usr/bin/env python
"""Train the study's word-level LSTM language model with hvdcomp gradient compression.

Launch with any number of ranks, e.g.::

    mpirun -np 4 python mpi_scripts/train_lm.py --compressor topk:density=0.01 --epochs 1
    torchrun --nproc_per_node 4 mpi_scripts/train_lm.py --frontend ddp --compressor topk:density=0.01

``--frontend horovod`` (default) trains with :func:`hvdcomp.DistributedOptimizer` under Horovod;
``--frontend ddp`` with PyTorch ``DistributedDataParallel`` and hvdcomp's communication hook
(:mod:`hvdcomp.ddp`), launched by ``torchrun`` or ``srun`` (no Horovod needed). The training
modes (local updates, the compressed adaptive optimizers, gossip, AB-training) run under either:
with ``--frontend ddp`` on ``torch.distributed``, without DDP.

The global batch (``--batch-size`` sequences of ``--bptt`` tokens) is split evenly over the
ranks, so 1, 2 and 4 ranks train the same model on the same data per step. SGD (or Adam, or an
optimizer of hvdcomp.adaptive_opt: ``--optimizer``, ``--freeze-step``); gradients
are averaged by hvdcomp, then clipped to norm ``--clip``. The schedule
(:class:`hvdcomp.lm.PlateauSchedule`): optional linear warm-up (``--warmup-steps``), the learning
rate divided by ``--anneal`` (4) after an epoch whose validation perplexity did not improve (by
``--min-improvement``; as in PyTorch's word_language_model), early stopping after
``--early-stop`` such epochs in a row (not before ``--min-epochs``), at most ``--epochs`` epochs.
The test perplexity is that of the weights with the best validation perplexity.

With ``--local-steps H`` the ranks train locally and communicate every H steps (DiLoCo, SparseLoCo,
CO2 or Local AdaAlter by ``--outer-opt``; the pseudo-gradient travels by ``--compressor``;
``docs/local-update.md``); validation then uses the global parameters.

Writes ``OUTPUT/results.json`` (config, per-epoch perplexities, per-phase seconds per step with
min/mean/max over ranks, bytes per step, measured and nominal compression ratios) and prints a
one-line summary. Rank 0 shows progress.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import platform
import sys
import time

import torch
try:
    import horovod.torch as hvd
except ImportError:  # --frontend ddp needs no Horovod
    hvd = None
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hvdcomp  # noqa: E402
import hvdcomp.ddp  # noqa: E402
import hvdcomp.gossip  # noqa: E402
import hvdcomp.local  # noqa: E402
import hvdcomp.native  # noqa: E402
from hvdcomp.lm import (ARCHITECTURES, MODEL_SIZES, PlateauSchedule, batchify, load_corpus,  # noqa: E402
                        loss_sums, make_lm, rank_columns, window_loss)
from hvdcomp.comm.group import horovod as require_horovod  # noqa: E402
from hvdcomp.launch import abort_on_uncaught_exception, detect_launch, recorded_env, select_device  # noqa: E402
from hvdcomp.adaptive_opt import OPTIMIZERS, make_optimizer  # noqa: E402
from hvdcomp.lowrank import ABTraining  # noqa: E402
from hvdcomp.lm.data import default_data_path  # noqa: E402
from hvdcomp.metrics import PHASES, reduce_across_ranks, write_json_atomic  # noqa: E402

log = logging.getLogger("train_lm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--frontend", choices=["horovod", "ddp"], default="horovod",
                   help="horovod: Horovod (mpirun/horovodrun), per-step methods through "
                        "hvdcomp.DistributedOptimizer; ddp: torch.distributed (torchrun/srun, no Horovod), per-step "
                        "methods through DistributedDataParallel with hvdcomp's comm hook; the training modes "
                        "(--local-steps, --optimizer onebit-adam..., --gossip, --ab-training) run on either")
    p.add_argument("--compressor", default="none",
                   help=f"method spec NAME[:key=value,...]; methods: {', '.join(hvdcomp.available())}; or "
                        "'auto[:candidates=A+B,slack=1.1,...]': the method chosen (and changed) from the measured "
                        "link, compute and training phase (docs/auto.md; its decisions go to results.json)")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw", *OPTIMIZERS], default="sgd",
                   help="sgd, adam or adamw (DiLoCo's inner optimizer), the optimizer of every step, with "
                        "--compressor (or the inner one with --local-steps); or one of hvdcomp.adaptive_opt "
                        "(docs/adaptive-optimizers.md), which compresses by itself")
    p.add_argument("--freeze-step", type=int, default=0,
                   help="1-bit Adam / 1-bit LAMB: warm-up steps; 0/1 Adam: var_freeze_step (0: its default)")
    p.add_argument("--optimizer-args", default="", metavar="KEY=VALUE,...",
                   help="other arguments of an hvdcomp.adaptive_opt optimizer, e.g. local_step_scaler=1000")
    p.add_argument("--ab-training", default=None, metavar="KEY=VALUE,...",
                   help="AB-training instead of a compressor, e.g. 'rank_groups=2,warmup_steps=50,"
                        "steps_between_syncs=50,full_rank_steps=5,cutoff=0.1,ramp_steps=10' "
                        "(see hvdcomp.lowrank.ABTraining)")
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="hidden 100/300/500")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="lstm",
                   help="lstm (the study's 2-layer LSTM) or transformer (2 causal encoder layers, 4 heads)")
    p.add_argument("--epochs", type=int, default=1, help="maximum number of epochs")
    p.add_argument("--anneal", type=float, default=4.0,
                   help="divide the learning rate by this after a validation plateau (1: never)")
    p.add_argument("--anneal-patience", type=int, default=0,
                   help="epochs without improvement tolerated before annealing")
    p.add_argument("--early-stop", type=int, default=0,
                   help="stop after this many epochs in a row without improvement (0: never)")
    p.add_argument("--min-epochs", type=int, default=0,
                   help="never stop early before this many epochs")
    p.add_argument("--min-improvement", type=float, default=0.0,
                   help="relative decrease of validation perplexity that counts as improving "
                        "(e.g. 0.01: an epoch less than 1 %% better than the best is a plateau)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="linear learning-rate warm-up over this many optimizer steps")
    p.add_argument("--max-steps", type=int, default=0, help="cap on optimizer steps per epoch (0: no cap)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch, sequences (split over ranks)")
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--lr", type=float, default=20.0)
    p.add_argument("--clip", type=float, default=0.25, help="gradient-norm clip after aggregation")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--eval-batch-size", type=int, default=40, help="global evaluation batch")
    p.add_argument("--data", default=None,
                   help="text file or PTB/WikiText directory (default: $HVDCOMP_DATA or ../shared/data "
                        "tinyshakespeare/input.txt)")
    p.add_argument("--output", default="runs/latest", help="directory for results.json")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--allgather", choices=["auto", "mpi4py", "hierarchical", "horovod"], default="auto",
                   help="transport of allgathered payloads (hierarchical: node-aware, leaders exchange)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="MiB of dense gradient per allgather bucket (one collective per bucket)")
    p.add_argument("--granularity", choices=["tensor", "bucket"], default="tensor",
                   help="compress each gradient (tensor) or each bucket of --bucket-mb flattened "
                        "into one buffer (bucket; README, 'Granularity')")
    p.add_argument("--cost-model", default="measure", metavar="measure|off|ALPHA,BETA",
                   help="route allgather payloads by an alpha-beta model: measured at start-up, off "
                        "(always allgather), or given as latency seconds,seconds per byte")
    p.add_argument("--transport", choices=["planned", "auto"], default="planned",
                   help="auto: the cost model chooses among the transports of the same kind of "
                        "compression (top-k: allgather, gtopk, cltk; quantizers: allgather, twophase)")
    p.add_argument("--gossip", choices=["choco", "dcd", "ecd", "powergossip"], default=None,
                   help="decentralized training instead of gradient averaging: gossip with the "
                        "--topology neighbours, compressing with --compressor (docs/gossip.md)")
    p.add_argument("--topology", default="ring", help="gossip graph: ring, torus[:RxC], exponential, complete")
    p.add_argument("--consensus-step", type=float, default=None,
                   help="Choco-SGD's gamma in (0, 1] (e.g. 0.45 for sign, 0.04 for topk 1%%)")
    p.add_argument("--gossip-eval", choices=["average", "local"], default="average",
                   help="evaluate the network-average model, or each rank's own model on its share")
    p.add_argument("--local-steps", type=int, default=0, metavar="H",
                   help="local-update training (docs/local-update.md): H inner steps without communication, "
                        "then the pseudo-gradient through --compressor and an outer step (0: synchronous)")
    p.add_argument("--outer-opt", default="diloco", metavar="SPEC",
                   help=f"with --local-steps: {', '.join(sorted(hvdcomp.local.ALGORITHMS))}, with arguments, "
                        "e.g. 'diloco:outer_lr=0.7,outer_momentum=0.9', 'average', 'co2:gap_penalty=2,clip=0.1', "
                        "'sparseloco:beta=0.999', 'adaalter:eps=1,warmup_steps=1' (AdaAlter is also the inner optimizer)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="the optimizer's weight decay (DiLoCo: 0.1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: this rank's local GPU when CUDA is available, else CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "bptt", "vocab_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or args.clip <= 0:
        p.error("--lr and --clip must be positive")
    if args.anneal < 1:
        p.error("--anneal must be >= 1 (1 never anneals)")
    if not 0 <= args.min_improvement < 1:
        p.error("--min-improvement must be in [0, 1), e.g. 0.01")
    for name in ("anneal_patience", "early_stop", "warmup_steps", "min_epochs"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.bucket_mb <= 0:
        p.error("--bucket-mb must be positive")
    if args.cost_model not in ("measure", "off"):
        try:
            args.cost_model = tuple(float(v) for v in args.cost_model.split(","))
            assert len(args.cost_model) == 2 and min(args.cost_model) >= 0
        except (ValueError, AssertionError):
            p.error("--cost-model must be 'measure', 'off' or ALPHA,BETA (two numbers >= 0, "
                    "seconds and seconds per byte), e.g. 5e-5,8e-10")
    if args.transport == "auto" and args.cost_model == "off":
        p.error("--transport auto lets the cost model choose: use --cost-model measure or ALPHA,BETA")
    if (args.frontend == "ddp" and args.transport == "auto" and not args.local_steps and args.ab_training is None
            and not args.gossip and args.optimizer not in OPTIMIZERS):
        p.error("--transport auto is the Horovod front-end's (and the training modes'); the DDP hook takes the "
                "method as given: drop --transport auto, or use --frontend horovod")
    if args.compressor.split(":")[0] == "auto" and args.gossip:
        p.error("--compressor auto is chosen by the per-step front-ends (Horovod's reducer, the DDP hook) and the "
                "local-update modes: not --gossip")
    if sum(bool(x) for x in (args.gossip, args.ab_training is not None, args.local_steps,
                             args.optimizer in OPTIMIZERS)) > 1:
        p.error("--gossip, --ab-training, --local-steps and an hvdcomp.adaptive_opt --optimizer are training "
                "modes: pick one")
    if args.local_steps < 0 or args.weight_decay < 0:
        p.error("--local-steps and --weight-decay must be >= 0")
    if args.local_steps and args.ab_training is not None:
        p.error("--ab-training is not a local-update method: drop --local-steps")
    if args.outer_opt != "diloco" and not args.local_steps:
        p.error("--outer-opt applies to local-update training: give --local-steps H")
    if args.ab_training is not None and args.compressor != "none":
        p.error("--ab-training replaces gradient compression: leave --compressor at 'none'")
    if args.optimizer in OPTIMIZERS and (args.compressor != "none" or args.ab_training is not None):
        p.error(f"--optimizer {args.optimizer} compresses by itself: leave --compressor at 'none', no --ab-training")
    if args.ab_training is not None and args.warmup_steps:
        p.error("--warmup-steps does not apply to AB-training, which ramps the learning rate after "
                "every switch itself: set ramp_steps in --ab-training instead")
    return args


def transport_of(opt, compressor) -> str:
    """How gradients travel, for logs and results."""
    if isinstance(opt, ABTraining):
        return "mpi4py-allreduce (world + group sub-communicators)"
    return str(opt.transport)


def inner_optimizer(args, params):
    """--optimizer sgd / adam / adamw (with --weight-decay): the optimizer of every step."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(args.optimizer, torch.optim.SGD)
    return cls(params, lr=args.lr, weight_decay=args.weight_decay)


def local_update_optimizer(args, model, compressor, **pipeline):
    """--local-steps H --outer-opt SPEC: the hvdcomp.local wrapper around the inner optimizer
    (AdaAlter's spec also sets its inner optimizer's eps)."""
    name, spec = hvdcomp.parse_spec(args.outer_opt)
    if name == "adaalter":
        inner = hvdcomp.local.AdaAlter(model.parameters(), lr=args.lr, eps=spec.pop("eps", 1e-7),
                                       weight_decay=args.weight_decay)
    else:
        inner = inner_optimizer(args, model.parameters())
    return hvdcomp.local.from_spec(name, inner, model.named_parameters(), local_steps=args.local_steps,
                                   compression=compressor, **spec, **pipeline)


def evaluate(model, stream, eval_batch, bptt, collectives=None):
    """Perplexity of ``stream``: each rank takes columns rank, rank+N, ...; sums are allreduced
    over ``collectives`` (``horovod.torch`` or :class:`hvdcomp.ddp.runtime.TorchDistCollectives`;
    default this script's)."""
    coll = collectives or hvd
    total = loss_sums(model, stream, eval_batch, bptt, coll.rank(), coll.size())
    total = coll.allreduce(total, op=coll.Sum, name="eval.sum")
    loss = total[0].item() / total[1].item()
    return math.exp(loss) if loss < 709.0 else math.inf  # (a diverged run: the schedule stops it)


def start(args):
    """Join the job: Horovod (with mpi4py first, so MPI starts with MPI_THREAD_MULTIPLE before
    Horovod attaches to it), or for ``--frontend ddp`` torch.distributed from torchrun's or srun's
    variables, with Horovod's few calls of this script served over it."""
    global hvd
    if args.frontend == "ddp":
        info = hvdcomp.ddp.runtime.launch_info()
        backend = "nccl" if select_device(args.device, info.local_rank).type == "cuda" else "gloo"
        hvd = hvdcomp.ddp.runtime.TorchDistCollectives(hvdcomp.ddp.init_process_group(backend))
        return
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError:  # Horovod-only runs (e.g. horovodrun --gloo) use Horovod's allgather
        pass
    hvd = require_horovod()
    hvd.init()


def train_step(module, opt, loss_of, params, clip, timer=None, sync=None, skip_sync=contextlib.nullcontext):
    """One optimizer step, as every script trains: forward and backward (``loss_of(module)`` returns
    ``(loss, carry)``), ``sync()`` (the front-end's explicit synchronize, where it has one), the
    averaged gradient of ``params`` clipped to norm ``clip`` (0: not clipped), ``opt.step()`` under
    ``skip_sync()``.
    With hvdcomp's ``timer`` (:class:`hvdcomp.metrics.PhaseTimer`) the step is a timed step and its
    compute phases are marked.

    Returns:
        ``(loss, carry, parts)``: ``parts`` in seconds (``time.perf_counter``): ``fwd_bwd`` (forward and
        backward; with DDP its in-backward communication), ``sync``, ``update`` (clip and step) and
        ``wall``; with a timer also ``phase_<phase>`` and the step's ``bytes_sent``,
        ``bytes_received``, ``dense_bytes``.
    """
    compute = (lambda: timer.phase("compute")) if timer else contextlib.nullcontext
    t0 = time.perf_counter()
    if timer:
        timer.begin_step()
    with compute():
        loss, carry = loss_of(module)
        opt.zero_grad()
        loss.backward()
    t1 = time.perf_counter()
    if sync:
        sync()
    t2 = time.perf_counter()
    with compute():
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        with skip_sync():
            opt.step()
    rec = timer.end_step() if timer else None
    t3 = time.perf_counter()
    parts = {"fwd_bwd": t1 - t0, "sync": t2 - t1, "update": t3 - t2, "wall": t3 - t0}
    if rec is not None:
        parts.update({f"phase_{k}": rec.get(k, 0.0) for k in PHASES})
        parts.update({k: float(rec[k]) for k in ("bytes_sent", "bytes_received", "dense_bytes")})
    return loss, carry, parts


def build_optimizer(args, model, compressor, device):
    """``(module to call for training, optimizer, front)``: ``front`` is what synchronizes and
    times (the hvdcomp optimizer itself, or the DDP hook's state)."""
    if args.frontend == "ddp" and not args.local_steps:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=args.bucket_mb)
        opt = inner_optimizer(args, model.parameters())
        return ddp, opt, hvdcomp.ddp.register(ddp, compressor, optimizer=opt, granularity=args.granularity,
                                              cost_model=args.cost_model)
    pipeline = dict(allgather=args.allgather, bucket_bytes=max(1, int(args.bucket_mb * 2**20)),
                    cost_model=args.cost_model, granularity=args.granularity, transport=args.transport)
    if args.local_steps:
        opt = local_update_optimizer(args, model, compressor, **pipeline)
    else:
        opt = hvdcomp.DistributedOptimizer(inner_optimizer(args, model.parameters()),
                                           named_parameters=model.named_parameters(), compression=compressor,
                                           **pipeline)
    return model, opt, opt


def main(argv=None):
    args = parse_args(argv)
    start(args)
    abort_on_uncaught_exception()  # a failing rank ends the whole job instead of hanging it
    rank, size = hvd.rank(), hvd.size()
    logging.basicConfig(level=args.log_level if rank == 0 else "WARNING",
                        format=f"[%(asctime)s rank {rank}] %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # ValueError for a bad spec, on every rank (gossip builds its own, error feedback off: below)
    compressor = None if args.gossip else hvdcomp.get_compressor(args.compressor)
    method = args.compressor if args.ab_training is None else f"ab-training:{args.ab_training}"
    if args.optimizer != "sgd":  # (the optimizer names the method: adam+<spec>, onebit-adam, ...)
        method = args.optimizer if args.optimizer in OPTIMIZERS else f"{args.optimizer}+{method}"

    data_path = args.data or default_data_path()
    corpus = load_corpus(data_path, vocab_size=args.vocab_size)
    cols = rank_columns(args.batch_size, rank, size)
    device = select_device(args.device, hvd.local_rank())
    train = batchify(corpus.train, args.batch_size)[:, cols].to(device)
    log.info("corpus %s: %d/%d/%d tokens, vocab %d", corpus.source, len(corpus.train),
             len(corpus.valid), len(corpus.test), corpus.vocab_size)

    torch.manual_seed(args.seed)
    model = make_lm(args.arch, corpus.vocab_size, args.model, dropout=args.dropout).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(args.seed * 1000 + rank)  # dropout masks differ per rank
    n_params = sum(p.numel() for p in model.parameters())
    evaluate_model = evaluate
    if args.ab_training is not None:
        _, ab_kwargs = hvdcomp.parse_spec("ab:" + args.ab_training)
        ab = ABTraining(model, lambda params: torch.optim.SGD(params, lr=args.lr), base_lr=args.lr, **ab_kwargs)
        opt = front = ab
        forward = model
    elif args.gossip:  # decentralized: local SGD step, then compressed gossip with the neighbours
        ab = None
        opt = hvdcomp.gossip.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                             named_parameters=model.named_parameters(), method=args.gossip,
                                             topology=args.topology, compression=args.compressor,
                                             consensus_step=args.consensus_step)
        compressor = opt.compression or hvdcomp.get_compressor("none")
        method = f"gossip-{args.gossip}:{args.compressor}" + (
            f",gamma={args.consensus_step}" if args.consensus_step is not None else "")
        if args.gossip_eval == "average":  # the ranks' models differ: evaluate their average
            evaluate_model = opt.with_average_model(evaluate)
        front, forward = opt, model
    elif args.optimizer in OPTIMIZERS:  # hvdcomp.adaptive_opt: averages (and compresses) by itself
        ab = None
        opt = front = make_optimizer(args.optimizer, model.named_parameters(), lr=args.lr,
                                     freeze_step=args.freeze_step,
                                     **hvdcomp.parse_spec("args:" + args.optimizer_args)[1])
        forward, compressor = model, opt.compression
    else:
        ab = None
        forward, opt, front = build_optimizer(args, model, compressor, device)
        compressor = front.compression  # (the chosen one, with --transport auto)
    timer = front.timer
    ratios = [None if ab else compressor.nominal_ratio(p.numel()) for p in model.parameters()]
    nominal = None if None in ratios else n_params / sum(p.numel() / r for p, r in zip(model.parameters(), ratios))
    log.info("%s on %d rank(s): %s model, %d parameters, nominal ratio %s, transport %s",
             method, size, args.model, n_params,
             "data-dependent" if nominal is None else f"{nominal:.1f}x",
             transport_of(front, compressor))

    steps_per_epoch = len(range(0, train.shape[0] - 1, args.bptt))
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    sched = PlateauSchedule(args.lr, anneal=args.anneal, anneal_patience=args.anneal_patience,
                            early_stop=args.early_stop, warmup_steps=args.warmup_steps,
                            min_improvement=args.min_improvement, min_epochs=args.min_epochs)
    epochs, best_weights, stopped_early, global_step = [], None, False, 0
    initial_val = evaluate_model(model, corpus.valid, args.eval_batch_size, args.bptt)
    log.info("initial valid ppl %.2f", initial_val)
    t_start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        compressor.set_epoch(epoch - 1)  # DGC's density warm-up
        t_epoch, loss_sum, state = time.perf_counter(), 0.0, model.init_state(train.shape[1])
        bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch}", disable=rank != 0 or args.no_progress,
                   mininterval=2.0, file=sys.stderr)
        for step in range(steps_per_epoch):
            lr = sched.lr_at(global_step)
            if ab:
                ab.base_lr = lr  # AB-training sets its optimizer's rate itself (ramps after switches)
            else:
                for g in opt.param_groups:
                    g["lr"] = lr
            loss, state, _ = train_step(
                forward, opt, lambda m: window_loss(m, train, step * args.bptt, args.bptt, state)[:2],
                ab.parameters() if ab else model.parameters(), args.clip, timer, front.synchronize,
                front.skip_synchronize)
            global_step += 1
            loss_sum += loss.item()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.close()
        train_loss = hvd.allreduce(torch.tensor(loss_sum / steps_per_epoch), name=f"train.loss.{epoch}").item()
        with opt.global_parameters() if args.local_steps else contextlib.nullcontext():  # (mid-round: θ_start)
            val_ppl = evaluate_model(model, corpus.valid, args.eval_batch_size, args.bptt)
            stop = sched.end_epoch(val_ppl)
            if sched.improved:
                best_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        epochs.append({"epoch": epoch, "train_loss": train_loss,
                       "train_ppl": math.exp(min(train_loss, 700.0)), "val_ppl": val_ppl, "lr": lr,
                       "steps": steps_per_epoch, "seconds": time.perf_counter() - t_epoch,
                       "elapsed_seconds": time.perf_counter() - t_start, "elapsed_steps": global_step})
        log.info("epoch %d: train ppl %.2f, valid ppl %.2f, lr %g, %.1f s", epoch, epochs[-1]["train_ppl"],
                 val_ppl, lr, epochs[-1]["seconds"])
        if stop:
            stopped_early = epoch < args.epochs
            if stopped_early:
                log.info("stopping after epoch %d: no improvement for %d epoch(s) (best %.2f at epoch %d)",
                         epoch, sched.bad_epochs, sched.best, sched.best_epoch)
            break
    if args.local_steps:
        opt.flush()  # (the last round in; the model holds the global parameters)
    if best_weights is not None:
        model.load_state_dict(best_weights)  # test the weights with the best validation perplexity
    best_val = sched.best
    test_ppl = evaluate_model(model, corpus.test, args.eval_batch_size, args.bptt)
    launch = detect_launch()
    me = (rank, hvd.local_rank(), os.environ.get("SLURMD_NODENAME", platform.node()), str(device))
    everyone = hvd.allgather_object(me, name="ranks.info")

    per_step = timer.totals(skip_first=1)
    keys = [*PHASES, "wall", "bytes_sent", "bytes_received", "dense_bytes"]
    across = reduce_across_ranks({k: per_step.get(k, 0.0) for k in keys})
    measured_ratio = across["dense_bytes"]["mean"] / max(1.0, across["bytes_sent"]["mean"])
    results = {
        "config": {**vars(args), "data": data_path, "world_size": size, "parameters": n_params,
                   "compressor": compressor.describe(), "compressor_spec": method,
                   "transport": transport_of(front, compressor),
                   "env": recorded_env(),
                   "torch": torch.__version__, "hvdcomp": hvdcomp.__version__, "host": platform.node(),
                   "kernels": hvdcomp.native.status()},
        "corpus": corpus.describe(),
        "launcher": launch.launcher,
        "ranks": [dict(zip(("rank", "local_rank", "node", "device"), r)) for r in everyone],
        "epochs": epochs,
        "initial_val_ppl": initial_val,
        "test_ppl": test_ppl,
        "best_val_ppl": best_val,
        "best_epoch": sched.best_epoch,
        "stopped_early": stopped_early,
        "anneals": sched.anneals,
        "seconds_total": time.perf_counter() - t_start,
        "per_step": across,  # seconds and bytes per optimizer step, min/mean/max over ranks
        "run_bytes": reduce_across_ranks({k: float(timer.sums().get(k, 0))  # every step
                                          for k in ("bytes_sent", "bytes_received", "dense_bytes")}),
        "timed_steps": per_step["steps"],
        "nominal_ratio": nominal,
        "measured_ratio": measured_ratio,
    }
    model_cm = getattr(front, "cost_model", None)
    if model_cm is not None:
        results["cost_model"] = {"alpha_s": model_cm.alpha, "beta_s_per_byte": model_cm.beta,
                                 "routes": opt.transport.routes}
    auto = getattr(front, "auto", None) or getattr(getattr(front, "sync", None), "auto", None)
    if auto is not None:  # every decision: step, chosen method and route, predicted/measured step, error, why
        results["auto"] = auto.describe()
        results["config"]["compressor"] = auto.auto.describe()  # (the method is auto's; it chose among these)
    if args.gossip:
        results["gossip"] = {**opt.describe(), "eval": args.gossip_eval,
                             "consensus_distance": opt.consensus_distance()}
    elif not ab and getattr(front.transport, "choice", None):
        results["transport_choice"] = {"chosen": compressor.describe(), "predicted_s": opt.transport.choice}
    if args.local_steps:  # bytes per round and per inner step, seconds per phase (CO2: hidden behind compute)
        local = opt.report()
        results["config"]["local_update"] = opt.describe()
        results["local_update"] = {**local, "across_ranks": reduce_across_ranks(local)}
        opt.close()
    if ab:
        results["config"]["compressor"] = ab.describe()
        results["ab_training"] = ab.communication_report()
    if rank == 0:
        path = os.path.join(args.output, "results.json")
        write_json_atomic(path, results)
        ph = " ".join(f"{p} {across[p]['mean']:.3f}s" for p in PHASES)
        print(f"SUMMARY method={method} ranks={size} model={args.model} epochs={args.epochs} "
              f"val_ppl={epochs[-1]['val_ppl']:.2f} test_ppl={test_ppl:.2f} step={across['wall']['mean']:.3f}s "
              f"({ph}) sent={across['bytes_sent']['mean'] / 1e3:.1f}KB/step "
              f"ratio={measured_ratio:.1f}x (nominal {'n/a' if nominal is None else f'{nominal:.1f}x'})"
              + (f" local={args.outer_opt}:H={args.local_steps} rounds={local['rounds']}" if args.local_steps else "")
              + f" -> {path}", flush=True)
    if args.frontend == "ddp":  # (every rank past its last collective, then the group torn down;
        # the tensors of hvdcomp's collectives are held until gloo lets go: hvdcomp/comm/retain.py)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
