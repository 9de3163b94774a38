"""Benchmark models with many gradient tensors and their synthetic data, defined once.

Used by ``overhead.py`` (per-tensor overhead, all four models) and ``e2e_lm.py --model transformer``
(end to end on rate-limited links). Each model is built by :func:`make_model`, fed by
:func:`synthetic_batch` (inputs and targets drawn from a caller's ``torch.Generator``, so every
rank draws its own, reproducible data) and scored by :func:`loss`:

* ``stack``: ``blocks`` (200) × (``Linear(64, 64)`` + ``Tanh``): 400 tensors, 832,000 parameters;
  input ``(batch, 64)`` standard normal, loss = mean square of the output (no targets);
* ``transformer``: ``torch.nn.TransformerEncoder`` (d_model 128, 4 heads, feed-forward 256,
  12 layers, no dropout, batch first) + ``Linear(128, 1000)`` head: 146 tensors, 1,718,760
  parameters (6.9 MB of fp32 gradient); input ``(batch, 32, 128)`` standard normal (already
  "embedded" tokens), targets uniform over the 1000 classes at every position, cross-entropy;
* ``resnet``: ResNet-34-style CNN for 32×32 images (basic blocks [3, 4, 6, 3], widths 16–128,
  batch norm): 110 tensors; input ``(batch, 3, 32, 32)`` standard normal, 10 uniform classes;
* ``lstm``: the study's small LSTM language model (:class:`hvdcomp.lm.LSTMLM`, 9 tensors) on
  uniform random tokens of a 10,000-word vocabulary, ``(36, batch)`` tokens per sample.

Synthetic targets carry nothing to learn (the loss stays near ``ln(classes)``): these models
measure time per step, not convergence.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from hvdcomp.lm import LSTMLM, MODEL_SIZES  # noqa: E402

MODELS = ("stack", "transformer", "resnet", "lstm")
#: default samples per rank per step (overhead.py's settings)
BATCH: Dict[str, int] = {"stack": 32, "transformer": 16, "resnet": 16, "lstm": 20}
#: transformer encoder shape: width, attention heads, feed-forward width, layers, sequence length
#: (tokens per sample), output classes
TRANSFORMER = {"d_model": 128, "nhead": 4, "dim_feedforward": 256, "layers": 12, "seq": 32, "classes": 1000}
LSTM_VOCAB, LSTM_TOKENS = 10000, 36


class Stack(torch.nn.Module):
    """``blocks`` × (``Linear(width, width)`` + ``Tanh``): 2·blocks tensors."""

    def __init__(self, blocks: int = 200, width: int = 64):
        super().__init__()
        self.layers = torch.nn.Sequential(*[m for _ in range(blocks)
                                            for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])

    def forward(self, x):
        return self.layers(x)


class Transformer(torch.nn.Module):
    """``torch.nn.TransformerEncoder`` + a linear head; shape from :data:`TRANSFORMER`.

    Shapes: ``forward(x (B, seq, d_model) float32) -> logits (B, seq, classes)``.
    """

    def __init__(self, d_model: int = TRANSFORMER["d_model"], layers: int = TRANSFORMER["layers"],
                 vocab: int = TRANSFORMER["classes"], nhead: int = TRANSFORMER["nhead"],
                 dim_feedforward: int = TRANSFORMER["dim_feedforward"]):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead=nhead, dim_feedforward=dim_feedforward,
                                                 dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, x):
        return self.head(self.encoder(x))


class Block(torch.nn.Module):
    """ResNet basic block: two 3×3 convolutions with batch norm, identity or 1×1 shortcut."""

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
    """ResNet-34-style CNN for 32×32 images: stem, basic blocks per stage, global mean, linear."""

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


def make_model(name: str, stack_blocks: int = 200) -> torch.nn.Module:
    """A fresh model (weights from the global RNG: seed it first for identical copies).

    Raises:
        ValueError: ``name`` not in :data:`MODELS`.
    """
    if name == "stack":
        return Stack(stack_blocks)
    if name == "transformer":
        return Transformer()
    if name == "resnet":
        return ResNet()
    if name == "lstm":
        return LSTMLM(LSTM_VOCAB, MODEL_SIZES["small"])
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def synthetic_batch(name: str, gen: torch.Generator, batch: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` for one step of ``batch`` samples (0: :data:`BATCH`), drawn from ``gen``
    (targets are an empty tensor for ``stack``, which has none)."""
    b = batch or BATCH[name]
    if name == "stack":
        return torch.randn(b, 64, generator=gen), torch.empty(0)
    if name == "transformer":
        t = TRANSFORMER
        x = torch.randn(b, t["seq"], t["d_model"], generator=gen)
        return x, torch.randint(t["classes"], (b * t["seq"],), generator=gen)
    if name == "resnet":
        return torch.randn(b, 3, 32, 32, generator=gen), torch.randint(10, (b,), generator=gen)
    if name == "lstm":
        tokens = torch.randint(LSTM_VOCAB, (LSTM_TOKENS, b), generator=gen)
        return tokens[:-1], tokens[1:]
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def loss(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The scalar training loss of ``model`` (or a wrapper around it, e.g. DDP) on one batch."""
    if name == "stack":
        return model(x).pow(2).mean()
    if name == "lstm":
        out, _ = model(x)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    out = model(x)
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def lstm_gradients(steps: int = 5, data: str = "", seed: int = 0, batch_size: int = 32, bptt: int = 35,
                   min_numel: int = 1) -> Tuple[list, dict]:
    """Real gradients of the study's small LSTM language model on Tiny Shakespeare.

    ``steps`` steps of plain SGD (lr 20, gradient-norm clip 0.25, ``batch_size`` sequences of
    ``bptt`` tokens, as ``mpi_scripts/train_lm.py`` on one process; weights from
    ``torch.manual_seed(seed + 1)``). Returns ``([(name, step, gradient)], corpus description)``:
    the raw gradient (before clipping: what a compressor sees), 1-D float32, of every parameter
    with at least ``min_numel`` entries, at every step.

    Raises:
        FileNotFoundError: the corpus (``data``, default Tiny Shakespeare in ``../shared/data``) is missing.
    """
    from hvdcomp.lm import batchify, load_corpus, make_lm, window_loss
    from hvdcomp.lm.data import default_data_path
    from mpi_scripts.train_lm import train_step

    corpus = load_corpus(data or default_data_path(), vocab_size=10000)
    train = batchify(corpus.train, batch_size)
    torch.manual_seed(seed + 1)
    model = make_lm("lstm", corpus.vocab_size, "small")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    state = model.init_state(batch_size)
    grads = []

    def record(step):  # (train_step's sync: after backward, before the clip)
        grads.extend((name, step, p.grad.detach().reshape(-1).clone()) for name, p in model.named_parameters()
                     if p.grad is not None and p.numel() >= min_numel)
    for step in range(steps):
        _, state, _ = train_step(model, opt, lambda m: window_loss(m, train, step * bptt, bptt, state)[:2],
                                 model.parameters(), 0.25, sync=lambda: record(step))
    return grads, corpus.describe()
