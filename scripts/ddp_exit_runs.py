"""The README's DDP pattern under torchrun, run many times: how many runs exit non-zero.

Each run is ``torchrun --standalone --nproc_per_node NPROC`` of this file with ``--worker``:

* ``--scenario readme`` (default): the README's "PyTorch DDP, without Horovod" snippet as a user
  writes it (gloo, ``DDP(model)``, ``hvdcomp.ddp.register(model, "topk:density=0.01",
  optimizer=opt)``, a few steps, ``dist.destroy_process_group()``, then a normal interpreter
  exit: no ``os._exit``); ``--barrier`` adds a ``dist.barrier()`` before the destroy.
* ``--scenario last-collective``: the exit race made wide: rank 1 joins an all-gather of
  hvdcomp's (``TorchDistGroup.all_gather_into_async``) 1 s late, both ranks drop its tensors and
  leave at once, and rank 0's interpreter takes 2 s to finalize; gloo's worker thread then lets go
  of the collective's tensors while an interpreter finalizes unless hvdcomp holds them until it
  has (hvdcomp/comm/retain.py).

Usage::

    python scripts/ddp_exit_runs.py [--runs 50] [--nproc 2] [--steps 20] [--no-hook] [--barrier]
                                    [--scenario readme|last-collective]

Prints one line per run (exit status, seconds, the first abort line if any) and a summary
``RUNS n FAILED f``; exits 1 if any run failed.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(steps: int, hook: bool, barrier: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcomp.ddp

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if hook:
        hvdcomp.ddp.register(model, "topk:density=0.01", optimizer=opt)
    g = torch.Generator().manual_seed(dist.get_rank())
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    first = last = None
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    if dist.get_rank() == 0:
        print(f"loss {first:.3f} -> {last:.3f}", flush=True)
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


def last_collective() -> None:
    import time

    import torch
    import torch.distributed as dist

    from hvdcomp.comm.torchdist import TorchDistGroup

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = TorchDistGroup()
    if rank == 1:
        time.sleep(1.0)
    mine, out = torch.full((1000,), float(rank)), torch.empty(1000 * dist.get_world_size())
    work = group.all_gather_into_async(out, mine)
    if rank == 1:
        work.wait()
    del mine, out, work

    class SlowTeardown:  # (a global: its __del__ runs while the interpreter finalizes)
        def __del__(self):
            time.sleep(2.0 if rank == 0 else 0.0)

    globals()["_keep"] = SlowTeardown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-hook", action="store_true", help="the same script without hvdcomp's hook")
    ap.add_argument("--barrier", action="store_true", help="dist.barrier() before destroy_process_group()")
    ap.add_argument("--scenario", choices=("readme", "last-collective"), default="readme")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    args = ap.parse_args()
    if args.worker:
        if args.scenario == "last-collective":
            last_collective()
        else:
            worker(args.steps, not args.no_hook, args.barrier)
        return 0
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": ROOT}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"):
        env.pop(name, None)
    failed = 0
    for i in range(args.runs):
        cmd = [torchrun, "--standalone", "--nproc_per_node", str(args.nproc), os.path.abspath(__file__),
               "--worker", "--steps", str(args.steps), *(["--no-hook"] if args.no_hook else []),
               *(["--barrier"] if args.barrier else []), "--scenario", args.scenario]
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                 timeout=args.timeout)
            rc, logs = out.returncode, out.stdout
        except subprocess.TimeoutExpired as exc:
            rc, logs = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                else (exc.stdout or "")
        bad = rc != 0
        failed += bad
        note = next((line for line in logs.splitlines()
                     if "terminate" in line or "Signal" in line or "SIGABRT" in line or "Error" in line), "")
        loss = next((line for line in logs.splitlines() if line.startswith("loss")), "")
        print(f"run {i + 1}: rc={rc} {time.perf_counter() - t0:.1f}s {loss} {note[:160]}", flush=True)
        if bad and os.environ.get("HVDCOMP_EXIT_RUNS_LOGS"):
            print(logs[-3000:], flush=True)
    print(f"RUNS {args.runs} FAILED {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
