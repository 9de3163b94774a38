"""One worker of an elastic Horovod job (tests/test_elastic.py starts it under ``horovodrun
--min-np 1 --max-np 2 --host-discovery-script``): a tiny model trained with
hvdcomp.DistributedOptimizer (or a local-update mode, H = 2, Δ carried by ``<spec>``: METHOD
``diloco:<spec>``, ``sparseloco:<spec>``, ``co2:<spec>``, ``adaalter:<spec>``; or 1-bit Adam:
``onebitadam``) inside ``hvd.elastic.run``, the world resized by rewriting what the discovery
script prints. Every step prints one ``ELASTIC {json}`` line: step, size, rank, loss, a
digest of the parameters and of this rank's error-feedback residual.

``python tests/elastic_checks.py METHOD HOSTS_FILE PLAN`` where PLAN is the sizes to visit, e.g.
``2,1,2``: STEPS steps at each, rank 0 rewriting HOSTS_FILE to move on to the next; with
``ELASTIC_CHECKS_KILL=1`` a shrink is the last rank killing itself with SIGKILL instead.
"""
import hashlib
import json
import os
import signal
import sys
import time

import torch

import horovod.torch as hvd

STEPS = 4  # steps at each size of the plan


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().double().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def method_state(opt) -> dict:
    """The method's checkpoint state (the facade's ``"hvdcomp"``, a local-update mode's pipeline's,
    1-bit Adam's compressed allreduce's: worker residuals under ``"residual"``, server's under
    ``"server"``)."""
    if hasattr(opt, "averaging"):
        return opt.state_dict()["hvdcomp"]["reducers"].get("momentum", {})
    if hasattr(opt, "sync"):
        return opt.sync.state_dict().get("compression", {})
    return opt.state_dict().get("hvdcomp", {}).get("compression", {})


def residuals(opt):
    """This rank's error-feedback residuals (name -> tensor), from the optimizer's checkpoint."""
    state = method_state(opt)
    out = {}

    def walk(prefix, obj):
        if torch.is_tensor(obj):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
    walk("", state)
    return {k: v for k, v in out.items() if "/residuals/" in k or "/error/" in k or k.startswith("/residual/")}


def adam_state(opt, key: str):
    """A digest of one key of 1-bit Adam's torch state over every parameter (None for other optimizers)."""
    if not hasattr(opt, "averaging"):
        return None
    return digest([opt.state[p][key] for p in opt.order])


def mode_state(opt):
    """CO2: whether an average waits to be applied, and a digest of the send buffers (which hold
    it); Local AdaAlter: a digest of the denominators; None for the others."""
    if hasattr(opt, "reduction_running"):
        return [opt.pending, digest(opt.pseudo_gradients.values())]
    if type(opt).__name__ == "LocalAdaAlter":
        return digest([opt.state[p]["denominator"] for _, p in opt._params if "denominator" in opt.state[p]])
    return None


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def main():
    method, hosts_file, plan = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    target = torch.nn.Linear(16, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    if method == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    elif ":" in method and method.split(":")[0] in ("diloco", "sparseloco", "co2", "adaalter"):
        import hvdcomp.local as L  # H = 2, Δ carried by the method after the colon

        mode, spec = method.split(":", 1)
        if mode == "adaalter":  # (one synchronous warm-up step: the rounds end at odd steps)
            base = L.AdaAlter(model.parameters(), lr=0.2, eps=1.0)  # (eps 1: a tame first step)
            opt = L.LocalAdaAlter(base, model.named_parameters(), local_steps=2, warmup_steps=1, compression=spec)
        elif mode == "sparseloco":
            opt = L.SparseLoCo(base, model.named_parameters(), local_steps=2, compression=spec, chunk_size=None,
                               beta=0.9, outer_lr=0.7)
        elif mode == "co2":
            opt = L.CO2(base, model.named_parameters(), local_steps=2, compression=spec, outer_lr=0.7,
                        outer_momentum=0.5)
        else:
            opt = L.DiLoCo(base, model.named_parameters(), local_steps=2, compression=spec, outer_lr=0.7,
                           outer_momentum=0.9)
    elif method == "onebitadam":  # 2 warm-up steps, then the compressed stage at every size
        import hvdcomp.adaptive_opt

        opt = hvdcomp.adaptive_opt.OneBitAdam(model.named_parameters(), lr=0.05, freeze_step=2)
    else:
        import hvdcomp

        opt = hvdcomp.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=method)
    local = hasattr(opt, "anchors")
    # (DiLoCo is not a torch.optim.Optimizer: TorchState keeps the model and the inner optimizer)
    state = hvd.elastic.TorchState(model=model, optimizer=base if local else opt, step=0, phase=0)
    if hasattr(opt, "reset") and os.environ.get("ELASTIC_CHECKS_CALLBACK", "1") == "1":
        state.register_reset_callbacks([opt.reset])  # (0: the size change noticed at the next step)

    kill = os.environ.get("ELASTIC_CHECKS_KILL", "0") == "1"  # shrink by SIGKILL of the last rank instead

    @hvd.elastic.run
    def train(state):
        while state.phase < len(plan):
            if hvd.size() != plan[state.phase]:  # waiting for the driver to resize the job
                if kill and hvd.size() > plan[state.phase] and hvd.rank() == hvd.size() - 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # (no exception, no hook: the rank just ends)
                if hvd.rank() == 0 and not kill:
                    with open(hosts_file, "w") as f:
                        f.write(f"localhost:{plan[state.phase]}\n")
                time.sleep(0.3)
            else:
                gen = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
                x = torch.randn(32, 16, generator=gen)
                with torch.no_grad():
                    y = target(x)
                before = {k: digest([v]) for k, v in sorted(residuals(opt).items())}
                anchor_before = digest(opt.anchors.values()) if local else None
                variance_before = adam_state(opt, "exp_avg_sq")
                pending_before = mode_state(opt)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                while getattr(opt, "reduction_running", None):  # (CO2: its reduction finished, not joined)
                    time.sleep(0.01)
                line = {"step": state.step, "size": hvd.size(), "rank": hvd.rank(), "loss": loss.item(),
                        "params": digest(model.parameters()), "pid": os.getpid(),
                        "residuals_before": before, "anchor_before": anchor_before,
                        "residuals": {k: digest([v]) for k, v in sorted(residuals(opt).items())},
                        "counter": method_state(opt).get("step"),
                        "anchor": digest(opt.anchors.values()) if local else None,
                        "outer": digest(_tensors(opt.outer.state_dict()["state"])) if local else None,
                        "rounds": getattr(opt, "rounds", None),
                        "variance_before": variance_before, "pending_before": pending_before, "variance": adam_state(opt, "exp_avg_sq"),
                        "momentum": adam_state(opt, "exp_avg"), "pending": mode_state(opt), "kind": getattr(opt, "last_step_kind", None),
                        "server": digest(_tensors(method_state(opt).get("server", {})))
                        if hasattr(opt, "averaging") else None,
                        "shared": digest([t for t in _tensors(opt.compression.shared_state())])
                        if hasattr(opt, "compression") else None}
                print("ELASTIC " + json.dumps(line), flush=True)
                state.step += 1
                if state.step % STEPS == 0:
                    state.phase += 1
            state.commit()
        return state.step

    train(state)
    print(f"ELASTIC-DONE rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
