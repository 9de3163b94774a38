"""A restart from per-rank checkpoints under torchrun: a run in which rank 1 fails at step
``FAIL_AT`` (the job ends), then the same command again (a requeued job, or torchrun's own
``--max-restarts``): every rank loads its own last checkpoint (saved after every step: the model,
the optimizer and the mode's own state) and trains to the end. The parameters at the end must
equal those of the same run without the failure, bit for bit (tests/test_reliability.py).

At another world size (``--steps N`` ends the run after step N, so that the next run resumes
from it at another ``--nproc_per_node``): a rank with its own checkpoint loads it; a rank without
one (the job grew) loads the model and optimizer from rank 0's and starts its own hook state fresh
(DiLoCo: the model only, a round's end: θ_start; the outer state comes from rank 0 at the first step)
(docs/robustness.md, "Restarts"). Rank 0 saves the final parameters to DIR/MODE/final.pt.

MODES is one mode or several, comma-separated (``ddp-topk,diloco-topk``): each trained on its own
model with its own checkpoints (DIR/MODE/rank<r>.pt), side by side in one job (one torchrun launch
for all: the launches, not the steps, take the time).

Usage: torchrun --nproc_per_node 2 tests/mpi/restart_checks.py MODES DIR [FAIL_AT] [--no-barrier] [--steps N]
prints "PARAMS <mode> <sha256> <sum> <resumed from step>" per mode on rank 0 at the end.
"""
import hashlib
import os
import sys

import torch
import torch.distributed as dist

MODES, DIR = sys.argv[1].split(","), sys.argv[2]
FAIL_AT = int(sys.argv[3]) if len(sys.argv) > 3 else -1
BARRIER = "--no-barrier" not in sys.argv  # (a barrier before each save: no rank saves a step another did not finish)
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 8

dist.init_process_group("gloo")
RANK = dist.get_rank()


def batch(step):
    g = torch.Generator().manual_seed(100 * RANK + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def build(mode):
    """(the module trained, its optimizer, {name: object with state_dict/load_state_dict})"""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if mode == "ddp-topk":
        import hvdcomp.ddp
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        hook = hvdcomp.ddp.register(model, "topk:density=0.3", optimizer=opt)
        return model, opt, {"model": net, "opt": opt, "hook": hook}
    if mode == "diloco-topk":
        import hvdcomp.local

        inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        opt = hvdcomp.local.DiLoCo(inner, net.named_parameters(), local_steps=3, compression="topk:density=0.3",
                                   cost_model="off")
        return net, opt, {"model": net, "opt": opt}
    raise SystemExit(f"unknown mode {mode}")


def load(mode, parts, directory) -> int:
    """This rank's checkpoint of ``mode`` loaded (a restart), or rank 0's shared part (the job
    grew), or nothing (a fresh start); the step it resumes from."""
    path = os.path.join(directory, f"rank{RANK}.pt")
    if os.path.exists(path):  # a restart: this rank's own last checkpoint
        ck = torch.load(path, weights_only=True)
        for name, part in parts.items():
            part.load_state_dict(ck[name])
        return ck["step"]
    if os.path.exists(os.path.join(directory, "rank0.pt")):  # the job grew
        ck = torch.load(os.path.join(directory, "rank0.pt"), weights_only=True)
        for name in ("model", "opt") if mode.startswith("ddp") else ("model",):  # (equal on every rank; not
            parts[name].load_state_dict(ck[name])  # the residuals, DiLoCo's inner state: rank 0's own)
        return ck["step"]
    return 0


def main():
    runs = []  # (mode, model, optimizer, parts, directory, step resumed from)
    for mode in MODES:
        model, opt, parts = build(mode)
        directory = os.path.join(DIR, mode)
        os.makedirs(directory, exist_ok=True)
        runs.append((mode, model, opt, parts, directory, load(mode, parts, directory)))
    for step in range(min(run[-1] for run in runs), STEPS):
        if step == FAIL_AT and all(run[-1] == 0 for run in runs) and RANK == 1:
            raise RuntimeError(f"injected failure at step {step}")
        for mode, model, opt, parts, directory, start in runs:
            if step < start:
                continue
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if BARRIER:
                dist.barrier()
            state = {name: part.state_dict() for name, part in parts.items()}
            path = os.path.join(directory, f"rank{RANK}.pt")
            tmp = path + ".tmp"
            torch.save({**state, "step": step + 1}, tmp)
            os.replace(tmp, path)  # (a failure while saving leaves the previous checkpoint whole)
    for mode, model, opt, parts, directory, start in runs:
        net = parts["model"]
        if mode.startswith("diloco"):
            opt.flush()
            with opt.global_parameters():
                flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        else:
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        if RANK == 0:
            torch.save(flat, os.path.join(directory, "final.pt"))
            print(f"PARAMS {mode} {hashlib.sha256(flat.numpy().tobytes()).hexdigest()} "
                  f"{flat.double().sum().item():.17g} {start}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
