#!/usr/bin/env python
"""Per-step overhead at realistic tensor counts: hvdcomp against stock Horovod, side by side.

Launch under ``mpirun`` (one process per rank), e.g.::

    mpirun -np 2 python benchmarks/overhead.py --models stack transformer resnet --output DIR

Models (``--models``), each built identically on every rank:

* ``stack``: ``--stack-blocks`` (200) blocks of ``Linear(64, 64)`` + ``Tanh``: 400 tensors,
  832k parameters, batch 32 of 64 features;
* ``transformer``: ``torch.nn.TransformerEncoder`` (d_model 128, 4 heads, feed-forward 256,
  12 layers) + a linear head: 146 tensors, batch 16 × sequence 32;
* ``resnet``: a ResNet-34-style CNN for 32×32 images (basic blocks [3, 4, 6, 3], widths 16–128,
  batch norm): 110 tensors, batch 16;
* ``lstm``: the study's small LSTM language model (9 tensors), batch 20 × bptt 35.

Contenders (``--contenders``): ``local`` (the wrapped optimizer alone, no communication: the
compute-only reference), ``horovod:none`` (stock ``hvd.DistributedOptimizer``), and
``hvdcomp:<spec>`` (``hvdcomp.DistributedOptimizer``; append ``@bucket`` for
``granularity="bucket"`` where the optimizer offers it). Every contender trains its own copy of
the model (same initial weights) with SGD; rounds interleave the contenders (``--rounds`` rounds of
``--steps`` timed steps after ``--warmup`` untimed ones) so that they share the machine's state.
A step is ``zero_grad``, forward, backward, ``step()``, timed with ``time.perf_counter`` on each
rank; a step's time is the maximum over ranks. Reported per contender: the median step (seconds),
``overhead = median step − median local step``, overhead per tensor, and both as ratios to stock
Horovod's, measured in the same run.

Writes ``DIR/overhead.json`` (settings, environment, every sample) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

from mpi4py import MPI  # first: MPI starts with MPI_THREAD_MULTIPLE before Horovod attaches

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hvdcomp  # noqa: E402
from hvdcomp.lm import LSTMLM, MODEL_SIZES  # noqa: E402

RECORDED_ENV = ("OMPI_MCA_", "HOROVOD_", "OMP_NUM_THREADS")


# ---- models ----------------------------------------------------------------------------------
class Stack(torch.nn.Module):
    def __init__(self, blocks: int = 200, width: int = 64):
        super().__init__()
        self.layers = torch.nn.Sequential(*[m for _ in range(blocks)
                                            for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])

    def forward(self, x):
        return self.layers(x)


class Transformer(torch.nn.Module):
    def __init__(self, d_model: int = 128, layers: int = 12, vocab: int = 1000):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=256, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, x):
        return self.head(self.encoder(x))


class Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet(torch.nn.Module):
    def __init__(self, blocks=(3, 4, 6, 3), widths=(16, 32, 64, 128), classes: int = 10):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                        torch.nn.BatchNorm2d(widths[0]), torch.nn.ReLU())
        layers, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            for j in range(n):
                layers.append(Block(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def build(name: str, args) -> Tuple[torch.nn.Module, Callable[[torch.nn.Module, int], torch.Tensor]]:
    """(model, loss(model, step)) with rank-dependent data drawn from a fixed generator."""
    torch.manual_seed(0)
    rank = MPI.COMM_WORLD.Get_rank()

    def gen(step):
        return torch.Generator().manual_seed(1000 * rank + step)

    if name == "stack":
        model = Stack(args.stack_blocks)
        return model, lambda m, s: m(torch.randn(32, 64, generator=gen(s))).pow(2).mean()
    if name == "transformer":
        model = Transformer()

        def loss(m, s):
            g = gen(s)
            logits = m(torch.randn(16, 32, 128, generator=g))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 1000),
                                                     torch.randint(1000, (16 * 32,), generator=g))
        return model, loss
    if name == "resnet":
        model = ResNet()

        def loss(m, s):
            g = gen(s)
            return torch.nn.functional.cross_entropy(m(torch.randn(16, 3, 32, 32, generator=g)),
                                                     torch.randint(10, (16,), generator=g))
        return model, loss
    if name == "lstm":
        model = LSTMLM(10000, MODEL_SIZES["small"])

        def loss(m, s):
            g = gen(s)
            tokens = torch.randint(10000, (36, 20), generator=g)
            out, _ = m(tokens[:-1])
            return torch.nn.functional.cross_entropy(out.reshape(-1, 10000), tokens[1:].reshape(-1))
        return model, loss
    raise ValueError(f"unknown model {name!r}")


# ---- contenders ------------------------------------------------------------------------------
def make_optimizer(contender: str, model: torch.nn.Module):
    import horovod.torch as hvd

    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if contender == "local":
        return sgd
    if contender == "horovod:none":
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    if contender.startswith("hvdcomp:"):
        spec, _, granularity = contender[len("hvdcomp:"):].partition("@")
        kw = {"granularity": granularity} if granularity else {}
        return hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                            compression=spec, cost_model="off", **kw)
    raise ValueError(f"unknown contender {contender!r}")


def step_once(opt, model, loss_fn, step) -> float:
    t0 = time.perf_counter()
    opt.zero_grad()
    loss_fn(model, step).backward()
    opt.step()
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["stack", "transformer", "resnet", "lstm"])
    p.add_argument("--contenders", nargs="+",
                   default=["local", "horovod:none", "hvdcomp:none", "hvdcomp:topk:density=0.01",
                            "hvdcomp:powersgd:rank=2", "hvdcomp:qsgd:levels=16", "hvdcomp:fp16"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stack-blocks", type=int, default=200)
    p.add_argument("--output", default=None, help="directory for overhead.json")
    args = p.parse_args(argv)

    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    comm = MPI.COMM_WORLD
    results: Dict[str, Dict] = {}
    for model_name in args.models:
        runs = {}
        for c in args.contenders:
            model, loss_fn = build(model_name, args)
            runs[c] = (model, make_optimizer(c, model), loss_fn, [])
        tensors = sum(1 for q in next(iter(runs.values()))[0].parameters() if q.requires_grad)
        for c, (model, opt, loss_fn, _) in runs.items():
            for s in range(args.warmup):
                step_once(opt, model, loss_fn, s)
        for r in range(args.rounds):
            for c, (model, opt, loss_fn, samples) in runs.items():
                for s in range(args.steps):
                    mine = step_once(opt, model, loss_fn, args.warmup + r * args.steps + s)
                    samples.append(comm.allreduce(mine, op=MPI.MAX))
        local = statistics.median(runs["local"][3]) if "local" in runs else 0.0
        ref = runs.get("horovod:none")
        ref_step = statistics.median(ref[3]) if ref else None
        rows = {}
        for c, (_, _, _, samples) in runs.items():
            med = statistics.median(samples)
            rows[c] = {"median_step_s": med, "overhead_s": med - local,
                       "overhead_per_tensor_s": (med - local) / tensors, "samples_s": samples}
            if ref_step is not None:
                rows[c]["step_vs_horovod"] = med / ref_step
                rows[c]["overhead_vs_horovod"] = (med - local) / max(1e-12, ref_step - local)
        results[model_name] = {"tensors": tensors,
                               "parameters": sum(q.numel() for q in runs[args.contenders[0]][0].parameters()),
                               "contenders": rows}
        if comm.Get_rank() == 0:
            print("\n".join(table(model_name, results[model_name], comm.Get_size())), flush=True)
    if comm.Get_rank() == 0 and args.output:
        os.makedirs(args.output, exist_ok=True)
        info = {"settings": vars(args), "ranks": comm.Get_size(), "host": platform.node(),
                "torch": torch.__version__, "hvdcomp": hvdcomp.__version__,
                "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV)},
                "load_average": os.getloadavg(), "models": results}
        with open(os.path.join(args.output, "overhead.json"), "w") as f:
            json.dump(info, f, indent=2)


def table(model: str, result: dict, ranks: int) -> List[str]:
    """Markdown table of one model's contenders (ratios against stock Horovod in the same run)."""
    lines = [f"### {model}: {result['tensors']} tensors, {ranks} ranks", "",
             "| contender | step (ms) | overhead (ms) | µs / tensor | step / Horovod | overhead / Horovod |",
             "|---|---:|---:|---:|---:|---:|"]
    for c, row in result["contenders"].items():
        ratio = row.get("overhead_vs_horovod")
        ref = result["contenders"].get("horovod:none", {}).get("overhead_s", 0.0)
        shown = f"{ratio:.2f}" if ratio is not None and ref > 0 else "–"
        lines.append(f"| {c} | {1e3 * row['median_step_s']:.1f} | {1e3 * row['overhead_s']:.1f} | "
                     f"{1e6 * row['overhead_per_tensor_s']:.0f} | {row.get('step_vs_horovod', float('nan')):.2f} | "
                     f"{shown} |")
    return lines + [""]


if __name__ == "__main__":
    main()
