#!/usr/bin/env python
"""Train a VGG-style CNN or a wide MLP on scikit-learn's handwritten digits, data parallel over MPI
ranks, with AB-training or with hvdcomp's DistributedOptimizer (full rank, any compressor).

AB-training (Coquelin et al., "AB-Training: A Communication-Efficient Approach for Distributed
Low-Rank Learning", arXiv:2405.01067, 2024) is reported on VGG16 / CIFAR-10. CIFAR-10 cannot be
downloaded here, so this trains on a real image data set that ships inside scikit-learn's wheel:
1,797 grey 8x8 digits, 10 classes. Two models:

- ``--model vgg``: the same kind of model as VGG16 (3x3 convolutions in blocks, max pooling, a
  fully connected classifier), scaled to 8x8 images (99,178 parameters at ``--width 32``);
- ``--model mlp``: three hidden layers of ``--hidden`` units (563,722 parameters at 512), whose
  512 x 512 layers, like VGG16's 512-channel convolutions on CIFAR-10, are far wider than the task
  needs, so the spectrum has room to decay under weight decay.

Launch with any number of ranks, e.g. the authors' optimizer and an emulated 2 x 4 node layout::

    mpirun -np 8 python mpi_scripts/train_cnn.py --optimizer adamw --lr 3e-3 --weight-decay 0.1 \\
        --clip 1 --init ortho-sigma --ranks-per-node 4 \\
        --ab-training warmup_steps=180,steps_between_syncs=30,full_rank_steps=3,ramp_steps=12,cutoff=0.15
    mpirun -np 8 python mpi_scripts/train_cnn.py ... (without --ab-training: full-rank baseline)

The split is fixed (a seeded permutation: 1,397 training and 400 test images); the global batch
(``--batch-size`` images) is split evenly over the ranks. The learning rate warms up linearly from
1e-5 over ``--lr-warmup-epochs``, then follows a cosine to ``--min-lr``. Writes
``OUTPUT/results.json``: config, per-epoch loss and accuracy, test accuracy, the sum of the applied
learning rates (``lr_sum``; with AdamW also the product of its decay factors 1 − lr·wd, the share
of a weight left by decay alone), ``traffic`` (bytes per rank by AB-training stage, mean over
ranks and between nodes, against full-rank data parallelism, see
:func:`hvdcomp.lowrank.traffic_summary`), ``model_compression`` (parameters of the factorised
model against the full one, at every factorisation) and the singular values of every weight at
the end.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

try:
    from mpi4py import MPI  # noqa: F401  (initialised before Horovod)
except ImportError:
    pass
import torch
import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hvdcomp  # noqa: E402
from hvdcomp.launch import abort_on_uncaught_exception  # noqa: E402
from hvdcomp.lowrank import ABTraining, matrix_view, traffic_summary, unit_singular_values_  # noqa: E402
from hvdcomp.metrics import reduce_across_ranks, write_json_atomic  # noqa: E402
from mpi_scripts.train_lm import train_step  # noqa: E402  (the one training step of the scripts)

log = logging.getLogger("train_cnn")
TEST_IMAGES = 400
WARMUP_START_LR = 1e-5


class DigitsVGG(torch.nn.Module):
    """VGG-style CNN for 1 x 8 x 8 images: two blocks of two 3x3 convolutions (``width``,
    ``2·width`` channels, ReLU, no batch norm) each followed by 2x2 max pooling, then
    Linear(2·width·2·2, 4·width) - ReLU - dropout - Linear(4·width, 10); He initialisation.

    Input: ``(N, 1, 8, 8)`` float32 in [0, 1]; output: ``(N, 10)`` logits."""

    #: kept at full rank under AB-training (the authors keep VGG16's first layer and classifier)
    FULL_RANK = ("features.0.weight", "classifier.4.weight")

    def __init__(self, width: int = 32, dropout: float = 0.3):
        super().__init__()
        w = width
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, w, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(w, w, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(w, 2 * w, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(2 * w, 2 * w, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(2 * w * 4, 4 * w), torch.nn.ReLU(),
            torch.nn.Dropout(dropout), torch.nn.Linear(4 * w, 10))
        # He initialisation for the layers followed by ReLU: with PyTorch's default this small,
        # BN-free network sits at chance for several epochs
        for m in self.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) and m is not self.classifier[-1]:
                torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                torch.nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DigitsMLP(torch.nn.Module):
    """MLP for 1 x 8 x 8 images: flatten, three Linear layers of ``hidden`` units with ReLU and
    dropout, Linear(hidden, 10); He initialisation.

    Input: ``(N, 1, 8, 8)`` float32 in [0, 1]; output: ``(N, 10)`` logits."""

    FULL_RANK = ("layers.1.weight", "layers.10.weight")

    def __init__(self, hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        h = hidden
        self.layers = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Dropout(dropout),
            torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Dropout(dropout),
            torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(h, 10))
        for m in self.modules():
            if isinstance(m, torch.nn.Linear) and m is not self.layers[-1]:
                torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                torch.nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_model(args) -> torch.nn.Module:
    """The model ``--model`` names, with ``--width`` / ``--hidden``."""
    return DigitsVGG(args.width) if args.model == "vgg" else DigitsMLP(args.hidden)


def load_digits_split(split_seed: int = 0):
    """scikit-learn's digits as ``(x_train, y_train, x_test, y_test)``: float32 ``(N, 1, 8, 8)`` in
    [0, 1] and int64 labels; the last 400 of a seeded permutation are the test set.

    Raises:
        ImportError: scikit-learn missing (``pip install scikit-learn``; ``make install`` does it).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("train_cnn.py needs scikit-learn for its digits data set: "
                          "pip install scikit-learn (make install includes it)") from exc
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    x, y = x[perm], y[perm]
    return x[:-TEST_IMAGES], y[:-TEST_IMAGES], x[-TEST_IMAGES:], y[-TEST_IMAGES:]


def learning_rate(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warm-up from 1e-5 to ``peak`` over ``warmup`` steps, then a cosine from ``peak`` to
    ``floor`` over the remaining steps (the authors' timm schedule, one cycle)."""
    if step < warmup:
        return WARMUP_START_LR + (peak - WARMUP_START_LR) * step / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


def spectra(model: torch.nn.Module) -> dict:
    """Singular values (descending, float) of every weight of 2+ dimensions, by name, with the
    2-D view (tall orientation) they come from."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                m, _ = matrix_view(p.detach().to(torch.float32))
                out[name] = {"view": list(m.shape), "sigma": torch.linalg.svdvals(m).tolist()}
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ab-training", default=None, metavar="KEY=VALUE,...",
                   help="AB-training (hvdcomp.lowrank.ABTraining keywords), e.g. 'warmup_steps=180,cutoff=0.15'")
    p.add_argument("--compressor", default="none", help="hvdcomp method spec for the full-rank runs")
    p.add_argument("--model", choices=["vgg", "mlp"], default="vgg")
    p.add_argument("--width", type=int, default=32, help="vgg: channels of the first block")
    p.add_argument("--hidden", type=int, default=512, help="mlp: units per hidden layer")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, images (split over ranks)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="sgd (with --momentum) or adamw (the authors': --lr 3e-3 --weight-decay 0.1 --clip 1)")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd only")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled for adamw, L2 for sgd")
    p.add_argument("--clip", type=float, default=0.0, help="max gradient norm of the trained parameters (0: off)")
    p.add_argument("--lr-warmup-epochs", type=float, default=0.0, help="linear warm-up from 1e-5")
    p.add_argument("--min-lr", type=float, default=0.0, help="end of the cosine")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--init", choices=["he", "ortho-sigma"], default="he",
                   help="ortho-sigma: every weight's singular values set to 1 (the authors' init_method)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulated node layout for AB-training's rank groups and the between-node bytes "
                        "(ranks [i*R, (i+1)*R) on node i); default: the machine's own")
    p.add_argument("--seed", type=int, default=1, help="initialisation, dropout and shuffling")
    p.add_argument("--output", default="runs/cnn", help="directory for results.json")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "width", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or not 0 <= args.momentum < 1 or args.weight_decay < 0 or args.clip < 0 or args.min_lr < 0:
        p.error("--lr must be positive, --momentum in [0, 1), --weight-decay, --clip and --min-lr >= 0")
    if not 0 <= args.label_smoothing < 1 or not 0 <= args.lr_warmup_epochs < args.epochs:
        p.error("--label-smoothing must be in [0, 1) and --lr-warmup-epochs in [0, --epochs)")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        p.error("--ranks-per-node must be >= 1")
    if args.ab_training is not None and args.compressor != "none":
        p.error("--ab-training replaces gradient compression: leave --compressor at 'none'")
    return args


def accuracy(model, x, y) -> float:
    """Fraction of ``x`` classified as ``y`` (every rank evaluates the whole, small test set)."""
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def make_optimizer_factory(args):
    """``f(params) -> torch.optim.Optimizer`` for ``--optimizer``."""
    if args.optimizer == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return lambda params: torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    abort_on_uncaught_exception()
    rank, size = hvd.rank(), hvd.size()
    logging.basicConfig(level=args.log_level if rank == 0 else "WARNING",
                        format=f"[%(asctime)s rank {rank}] %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.batch_size % size:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the world size {size}")
    if args.ranks_per_node is not None and size % args.ranks_per_node:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} must divide the world size {size}")
    x_train, y_train, x_test, y_test = load_digits_split()
    torch.manual_seed(args.seed)
    model = build_model(args)
    if args.init == "ortho-sigma":
        unit_singular_values_(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    factory = make_optimizer_factory(args)
    if args.ab_training is not None:
        _, ab_kwargs = hvdcomp.parse_spec("ab:" + args.ab_training)
        ab_kwargs.setdefault("full_rank", type(model).FULL_RANK)
        ab_kwargs.setdefault("ranks_per_node", args.ranks_per_node)
        opt = ABTraining(model, factory, base_lr=args.lr, **ab_kwargs)
        method = f"ab-training:{args.ab_training}"
        nodes = opt.describe()["nodes"]
    else:
        opt = hvdcomp.DistributedOptimizer(factory(model.parameters()), named_parameters=model.named_parameters(),
                                           compression=hvdcomp.get_compressor(args.compressor))
        method = args.compressor
        nodes = size // args.ranks_per_node if args.ranks_per_node else hvd.cross_size()
    n_params = sum(p.numel() for p in model.parameters())
    per_rank = args.batch_size // size
    steps_per_epoch = len(y_train) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    warmup = round(args.lr_warmup_epochs * steps_per_epoch)
    log.info("%s on %d rank(s), %d node(s): %s, %d parameters, %d steps of %d images", method, size, nodes,
             args.model, n_params, total_steps, args.batch_size)
    torch.manual_seed(args.seed * 1000 + rank)  # dropout masks differ per rank
    shuffle = torch.Generator().manual_seed(args.seed)
    epochs, step, t0, lr = [], 0, time.perf_counter(), args.lr
    lr_sum, decay = 0.0, 1.0                 # Σ of the applied rates; Π (1 − lr·wd) of AdamW's decay
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(y_train), generator=shuffle)  # same on every rank
        loss_sum = 0.0
        for i in range(steps_per_epoch):
            lr = learning_rate(step, total_steps, warmup, args.lr, args.min_lr)
            if isinstance(opt, ABTraining):
                opt.base_lr = lr
            else:
                for g in opt.param_groups:
                    g["lr"] = lr
            idx = order[i * args.batch_size + rank * per_rank: i * args.batch_size + (rank + 1) * per_rank]
            loss, _, _ = train_step(
                model, opt, lambda m: (torch.nn.functional.cross_entropy(m(x_train[idx]), y_train[idx],
                                                                         label_smoothing=args.label_smoothing), None),
                opt.parameters() if isinstance(opt, ABTraining) else model.parameters(), args.clip, opt.timer,
                opt.synchronize, opt.skip_synchronize)
            applied = opt.param_groups[0]["lr"]
            lr_sum += applied
            decay *= 1.0 - applied * args.weight_decay if args.optimizer == "adamw" else 1.0
            loss_sum += loss.item()
            step += 1
        train_loss = hvd.allreduce(torch.tensor(loss_sum / steps_per_epoch), name=f"loss.{epoch}").item()
        acc = accuracy(model, x_test, y_test)
        record = {"epoch": epoch, "train_loss": train_loss, "test_accuracy": acc, "lr": lr,
                  "elapsed_seconds": time.perf_counter() - t0}
        if isinstance(opt, ABTraining):
            record.update(stage=opt.stage, model_compression=opt.model_compression()["ratio"])
        epochs.append(record)
        log.info("epoch %d: train loss %.4f, test accuracy %.4f%s", epoch, train_loss, acc,
                 f", {opt.stage}, model {record['model_compression']:.2f}:1" if isinstance(opt, ABTraining) else "")
    per_step = opt.timer.totals(skip_first=1)
    across = reduce_across_ranks({k: per_step.get(k, 0.0) for k in ("wall", "bytes_sent", "dense_bytes")})
    if isinstance(opt, ABTraining):
        report = opt.communication_report()
        compression = {"final": report["model_compression"], "history": report["compression_history"],
                       "ranks_kept": report["ranks_kept"]}
    else:
        run = opt.timer.sums()
        sent = run.get("bytes_sent", 0)
        report = {"bytes_sent": sent, "internode_bytes_sent": sent if nodes > 1 else 0,
                  "dense_bytes": run.get("dense_bytes", 0), "nodes": nodes,
                  "bytes_by_stage": {"full-rank": sent},
                  "internode_bytes_by_stage": {"full-rank": sent} if nodes > 1 else {},
                  "steps_by_stage": {"full-rank": step}}
        compression = {"final": {"full_parameters": n_params, "parameters": n_params, "ratio": 1.0},
                       "history": [], "ranks_kept": {}}
    reports = hvd.allgather_object(report, name="train_cnn.reports")
    results = {"config": {**vars(args), "world_size": size, "nodes": nodes, "parameters": n_params, "method": method,
                          "data": "sklearn.datasets.load_digits (1397 train / 400 test)"},
               "epochs": epochs, "test_accuracy": epochs[-1]["test_accuracy"],
               "seconds_total": time.perf_counter() - t0, "per_step": across, "steps": step,
               "steps_by_stage": report["steps_by_stage"], "traffic": traffic_summary(reports),
               "lr_sum": lr_sum, "adamw_decay_factor": decay if args.optimizer == "adamw" else None,
               "model_compression": compression, "singular_values": spectra(model)}
    if isinstance(opt, ABTraining):
        results["config"]["ab"] = opt.describe()
    if rank == 0:
        path = os.path.join(args.output, "results.json")
        write_json_atomic(path, results)
        t = results["traffic"]
        between = "n/a (one node)" if t["ratio_between_nodes"] is None else f"{t['ratio_between_nodes']:.2f}x"
        print(f"SUMMARY method={method} ranks={size} nodes={nodes} model={args.model} "
              f"test_accuracy={results['test_accuracy']:.4f} sent={t['bytes_sent_mean'] / 1e6:.2f}MB/rank "
              f"traffic_ratio_mean={t['ratio_mean']:.2f}x between_nodes={between} "
              f"model_compression={compression['final']['ratio']:.2f}:1 -> {path}", flush=True)


if __name__ == "__main__":
    main()
