"""Bounded state over long runs (issue 60 item 6): 10 000 inner steps of a tiny model with H = 1
(10 000 rounds) for DiLoCo and CO2, in one process (Horovod at one rank).

Checks, for each mode: the round records and the timer's step records held stay at most
2·history_limit while every round is counted; ``report()``'s per-round and per-step bytes and
seconds equal the sums of every round's record as it was appended (collected here, independently
of the optimizer's roll-up); the process's resident memory grows by less than RSS_BUDGET_KIB
between step 2000 and step 10 000 (measured from /proc/self/status; with the unbounded round
history it grew by about 1 KiB per round).

Usage: mpirun -np 1 python tests/mpi/bounded_checks.py [STEPS]   (prints "OK <mode> ..." per mode)
"""
import gc
import sys

import horovod.torch as hvd
import torch

from hvdcomp.local import CO2, DiLoCo
from hvdcomp.metrics import PhaseTimer

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
WARM = STEPS // 5
LIMIT = 100
RSS_BUDGET_KIB = 1024


def rss_kib() -> int:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(mode: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    common = dict(local_steps=1, compression="topk:density=0.5", cost_model="off", history_limit=LIMIT,
                  timer=PhaseTimer(cuda_sync=False, history_limit=LIMIT))
    opt = (DiLoCo(inner, model.named_parameters(), outer_lr=0.7, outer_momentum=0.9, **common) if mode == "diloco"
           else CO2(inner, model.named_parameters(), outer_lr=1.0, outer_momentum=0.5, **common))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    seen = {"bytes_sent": 0, "wall_s": 0.0}  # every round's record, summed as it is appended
    last_round, held, rss_warm = 0, 0, None
    for step in range(STEPS):
        if step == WARM:
            rss_warm = rss_kib()
        opt.timer.begin_step()
        with opt.timer.phase("compute"):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.timer.end_step()
        if opt.rounds != last_round:  # a round ended (CO2: the previous one, joined now)
            rec = opt.history[-1]
            assert rec["round"] == opt.rounds == last_round + 1, (rec["round"], opt.rounds, last_round)
            for k in seen:
                seen[k] += rec[k]
            last_round = opt.rounds
        held = max(held, len(opt.history), len(opt.timer.history))
    rss_end = rss_kib()
    report = opt.report()
    rounds = opt.rounds
    assert held <= 2 * LIMIT, held
    assert opt.timer.steps == STEPS and len(opt._rounds_log) == rounds >= STEPS - 1, (opt.timer.steps, rounds)
    assert seen["bytes_sent"] > 0
    assert report["bytes_sent_per_round"] == seen["bytes_sent"] / rounds, (report["bytes_sent_per_round"], seen)
    assert abs(report["wall_s_per_round"] - seen["wall_s"] / rounds) <= 1e-9 * max(1.0, seen["wall_s"])
    assert report["bytes_sent_per_step"] == seen["bytes_sent"] / STEPS
    assert report["rounds"] == rounds and report["inner_steps"] == STEPS
    assert "compute_s_per_step" in report and report["compute_s_per_step"] > 0
    growth = rss_end - rss_warm
    assert growth < RSS_BUDGET_KIB, f"{mode}: RSS grew by {growth} KiB from step {WARM} to {STEPS}"
    opt.close()
    return (f"{mode}: {STEPS} steps, {rounds} rounds, at most {held} records held, "
            f"RSS {rss_warm} -> {rss_end} KiB ({growth:+d} KiB)")


hvd.init()
for mode in ("diloco", "co2"):
    print(f"OK {run(mode)}", flush=True)
