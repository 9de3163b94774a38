"""The scripts of examples/, run as a user runs them (2 ranks, a few steps, under a timeout), each
checked for a value: the held-out loss falls, and the bytes a rank sends per step are what the docs
say for the example's model (computed here from its layer sizes, not read from the run).

The model of every example: Linear(64, 128), Tanh, Linear(128, 10): tensors of 8192, 128, 1280 and
10 elements (9610 in all), one allgather bucket (25 MiB default).
"""
import math
import os
import re
import socket
import sys

import pytest

from mpirun import ROOT, check
from test_ddp import TORCHRUN, run

SIZES = [128 * 64, 128, 10 * 128, 10]
N = sum(SIZES)


def result(out: str) -> dict:
    """The ``RESULT key=value ...`` line an example prints on rank 0, as numbers where they are."""
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-4000:]
    fields = dict(item.split("=", 1) for item in lines[0].split()[1:])
    for key, value in fields.items():
        if re.fullmatch(r"-?[0-9.]+(e-?[0-9]+)?", value):
            fields[key] = float(value)
    return fields


def kept(density: float):
    """Top-k's k per tensor, k = max(1, ⌈ρn⌉) (docs/methods.md)."""
    return [max(1, math.ceil(density * n)) for n in SIZES]


def pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def mpi_example(script, *args):
    return result(check(2, [os.path.join("examples", script), *args], timeout=180))


def torchrun_example(script, *args):
    return result(run([TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(),
                       os.path.join(ROOT, "examples", script), *args], timeout=180))


def learned(r, factor=0.9):
    assert r["ranks"] == 2 and r["dense_bytes_per_step"] == 4 * N, r
    assert r["loss_after"] < factor * r["loss_before"], r


# docs/transports.md, "Buckets": a bucket travels as one header of per-tensor element counts (int64,
# 8 bytes per payload tensor) and the payload bytes; top-k's fused bucket is one payload of two
# tensors (values float32, indices int32: 8 bytes per kept entry, docs/methods.md).
TOPK_1PCT_BUCKET = 2 * 8 + 8 * sum(kept(0.01))


def test_horovod_topk():
    r = mpi_example("horovod_topk.py", "--steps", "20")
    learned(r)
    assert r["bytes_sent_per_step"] == TOPK_1PCT_BUCKET == 800


def test_ddp_topk_under_torchrun():
    """The same bytes under DDP: the counts (8 bytes per payload tensor), then each tensor's bytes
    padded to a multiple of 8 (hvdcomp/comm/torchdist.py, TorchDistAllgatherer); 392 bytes of values need none."""
    r = torchrun_example("ddp_topk.py", "--steps", "20")
    learned(r)
    assert r["bytes_sent_per_step"] == 2 * 8 + 2 * pad8(4 * sum(kept(0.01))) == TOPK_1PCT_BUCKET


def test_diloco():
    """One top-k 10 % exchange of Δ per round of H = 4 steps (docs/local-update.md): the bucket's
    bytes per round, a quarter of them per step."""
    r = mpi_example("diloco.py", "--steps", "24", "--local-steps", "4")
    learned(r)
    assert r["rounds"] == 6
    bucket = 2 * 8 + 8 * sum(kept(0.1))
    assert r["bytes_sent_per_round"] == bucket == 7712
    assert r["bytes_sent_per_step"] == bucket / 4


def test_onebit_adam():
    """Warm-up steps average fp32 gradients, 4 bytes per parameter (docs/adaptive-optimizers.md);
    then the momentum at 1 bit per element through the two-phase allreduce
    (hvdcomp/transports/twophase.py): at p = 2 each rank sends the other's chunk in the all-to-all
    and its own re-compressed chunk in the allgather, n/2 elements each as efsignsgd's payload
    (one float32 scale + ⌈n/2 / 8⌉ bytes of signs), each packed with its int64 header (the tensor
    count, then dtype and element count per tensor: 8 + 2·16) and sent with its 8-byte size."""
    r = mpi_example("onebit_adam.py", "--steps", "24", "--freeze-step", "8")
    learned(r)
    assert r["warmup_steps"] >= 6 and r["onebit_steps"] >= 14, r
    assert r["bytes_sent_per_warmup_step"] == 4 * N
    chunk = 8 + 8 + 2 * 16 + 4 + math.ceil(N // 2 / 8)
    assert r["bytes_sent_per_onebit_step"] == 2 * chunk == 1306
    assert r["bytes_sent_per_onebit_step"] < 4 * N / 29          # about 1 bit per element


def test_gossip():
    """Choco-SGD on a ring of 2: one neighbour, one message per step: an int64 header (the tensor
    count, then each payload tensor's dtype and size: top-k sends two per parameter) and 8 bytes
    per kept entry
    (docs/gossip.md, "Transport and failures")."""
    r = mpi_example("gossip.py", "--steps", "20")
    learned(r)
    assert r["neighbours"] == 1
    assert r["bytes_sent_per_step"] == 8 * (1 + 2 * 2 * len(SIZES)) + 8 * sum(kept(0.1)) == 7832


@pytest.mark.parametrize("frontend", ["horovod", "ddp"])
def test_custom_method(frontend):
    """A method registered through hvdcomp.register ("int8": a float32 scale and n int8 codes per
    tensor) runs by its name in both front-ends; per tensor two payload tensors, so two 8-byte
    counts, then n + 4 bytes (Horovod: no padding; DDP: each tensor padded to 8 bytes)."""
    if frontend == "horovod":
        r = mpi_example("custom_method.py", "--steps", "20")
        expected = sum(2 * 8 + 4 + n for n in SIZES)
    else:
        r = torchrun_example("custom_method.py", "--steps", "20", "--frontend", "ddp")
        expected = sum(2 * 8 + pad8(4) + pad8(n) for n in SIZES)
    learned(r)
    assert r["frontend"] == frontend
    assert r["bytes_sent_per_step"] == expected


def test_every_example_is_tested_and_says_how_to_launch_it():
    here = sys.modules[__name__]
    source = open(here.__file__).read()
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
    assert len(scripts) == 6, scripts
    for script in scripts:
        assert f'"{script}"' in source, f"examples/{script} has no test"
        text = open(os.path.join(ROOT, "examples", script)).read()
        doc = text.split('"""')[1]
        assert "Launch" in doc and f"examples/{script} --steps" in doc, script
        assert "--steps" in text and "RESULT " in text, script
