#!/usr/bin/env python
"""Train a small VGG-style CNN on scikit-learn's handwritten digits, data parallel over MPI ranks,
with AB-training or with hvdcomp's DistributedOptimizer (full rank, any compressor).

AB-training's seed paper (Coquelin et al., 2024) reports 44.14:1 less traffic on VGG16/CIFAR-10.
CIFAR-10 cannot be downloaded here, so this is the same kind of model (3x3 convolutions in
blocks, max pooling, a fully connected classifier) on a real image data set that ships inside
scikit-learn's wheel: 1,797 grey 8x8 digits, 10 classes. Launch with any number of ranks::

    mpirun -np 4 python mpi_scripts/train_cnn.py --ab-training groups=2,warmup_steps=44 --epochs 30
    mpirun -np 4 python mpi_scripts/train_cnn.py --epochs 30                  # full-rank baseline

The split is fixed (a seeded permutation: 1,397 training and 400 test images); the global batch
(``--batch-size`` images) is split evenly over the ranks. SGD with momentum; the learning rate is
cosine-annealed over the run. Writes ``OUTPUT/results.json``: config, per-epoch loss and
accuracy, test accuracy, bytes sent per rank by phase, and the whole-run compression ratio against
full-rank data parallelism (every gradient in fp32 every step).
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
from hvdcomp.lowrank import ABTraining  # noqa: E402
from hvdcomp.metrics import reduce_across_ranks, write_json_atomic  # noqa: E402

log = logging.getLogger("train_cnn")
TEST_IMAGES = 400


class DigitsVGG(torch.nn.Module):
    """VGG-style CNN for 1 x 8 x 8 images: two blocks of two 3x3 convolutions (``width``,
    ``2·width`` channels, ReLU, no batch norm) each followed by 2x2 max pooling, then
    Linear(2·width·2·2, 4·width) - ReLU - dropout - Linear(4·width, 10); He initialisation.

    Input: ``(N, 1, 8, 8)`` float32 in [0, 1]; output: ``(N, 10)`` logits."""

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ab-training", default=None, metavar="KEY=VALUE,...",
                   help="AB-training (hvdcomp.lowrank.ABTraining keywords), e.g. 'groups=2,warmup_steps=44'")
    p.add_argument("--compressor", default="none", help="hvdcomp method spec for the full-rank runs")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, images (split over ranks)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--width", type=int, default=32, help="channels of the first block")
    p.add_argument("--seed", type=int, default=1, help="initialisation, dropout and shuffling")
    p.add_argument("--output", default="runs/cnn", help="directory for results.json")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or not 0 <= args.momentum < 1:
        p.error("--lr must be positive and --momentum in [0, 1)")
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
    x_train, y_train, x_test, y_test = load_digits_split()
    torch.manual_seed(args.seed)
    model = DigitsVGG(args.width)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)  # noqa: E731
    if args.ab_training is not None:
        _, ab_kwargs = hvdcomp.parse_spec("ab:" + args.ab_training)
        ab_kwargs.setdefault("full_rank", ("features.0.weight", "classifier.4.weight"))
        opt = ABTraining(model, sgd, base_lr=args.lr, **ab_kwargs)
        method = f"ab-training:{args.ab_training}"
    else:
        opt = hvdcomp.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                           compression=hvdcomp.get_compressor(args.compressor))
        method = args.compressor
    n_params = sum(p.numel() for p in model.parameters())
    per_rank = args.batch_size // size
    steps_per_epoch = len(y_train) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    log.info("%s on %d rank(s): %d parameters, %d steps of %d images", method, size, n_params,
             total_steps, args.batch_size)
    shuffle = torch.Generator().manual_seed(args.seed)
    epochs, step, t0 = [], 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(y_train), generator=shuffle)  # same on every rank
        loss_sum = 0.0
        for i in range(steps_per_epoch):
            lr = 0.5 * args.lr * (1 + math.cos(math.pi * step / total_steps))
            if isinstance(opt, ABTraining):
                opt.base_lr = lr
            else:
                for g in opt.param_groups:
                    g["lr"] = lr
            idx = order[i * args.batch_size + rank * per_rank: i * args.batch_size + (rank + 1) * per_rank]
            opt.timer.begin_step()
            with opt.timer.phase("compute"):
                loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                opt.zero_grad()
                loss.backward()
            opt.synchronize()
            with opt.timer.phase("compute"):
                with opt.skip_synchronize():
                    opt.step()
            opt.timer.end_step()
            loss_sum += loss.item()
            step += 1
        train_loss = hvd.allreduce(torch.tensor(loss_sum / steps_per_epoch), name=f"loss.{epoch}").item()
        acc = accuracy(model, x_test, y_test)
        epochs.append({"epoch": epoch, "train_loss": train_loss, "test_accuracy": acc, "lr": lr,
                       "elapsed_seconds": time.perf_counter() - t0})
        log.info("epoch %d: train loss %.4f, test accuracy %.4f", epoch, train_loss, acc)
    per_step = opt.timer.totals(skip_first=1)
    across = reduce_across_ranks({k: per_step.get(k, 0.0) for k in ("wall", "bytes_sent", "dense_bytes")})
    results = {"config": {**vars(args), "world_size": size, "parameters": n_params, "method": method,
                          "data": "sklearn.datasets.load_digits (1397 train / 400 test)"},
               "epochs": epochs, "test_accuracy": epochs[-1]["test_accuracy"],
               "seconds_total": time.perf_counter() - t0, "per_step": across, "steps": step}
    if isinstance(opt, ABTraining):
        results["config"]["ab"] = opt.describe()
        results["communication"] = opt.communication_report()
    else:
        sent = across["bytes_sent"]["mean"] * step
        dense = across["dense_bytes"]["mean"] * step
        results["communication"] = {"bytes_by_phase": {"full-rank": sent}, "steps_by_phase": {"full-rank": step},
                                    "dense_bytes": dense, "bytes_sent": sent,
                                    "compression_ratio": dense / sent if sent else None}
    if rank == 0:
        path = os.path.join(args.output, "results.json")
        write_json_atomic(path, results)
        c = results["communication"]
        print(f"SUMMARY method={method} ranks={size} test_accuracy={results['test_accuracy']:.4f} "
              f"sent={c['bytes_sent'] / 1e6:.2f}MB ratio={c['compression_ratio']:.2f}x -> {path}", flush=True)


if __name__ == "__main__":
    main()
