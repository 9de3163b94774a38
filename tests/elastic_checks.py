"""One worker of an elastic Horovod job (tests/test_elastic.py starts it under ``horovodrun
--min-np 1 --max-np 2 --host-discovery-script``): a tiny model trained with
hvdcomp.DistributedOptimizer; or a local-update mode, H = 2, Δ carried by ``<spec>`` (METHOD
``diloco:<spec>``, ``sparseloco:<spec>``, ``co2:<spec>``, ``adaalter:<spec>``); or an adaptive
optimizer (one of :data:`ADAPTIVE`); or gossip (``gossip:<method>:<compressor>``, on a ring); or a
group of :data:`GROUPS` (its METHODs side by side, each on its own model) inside ``hvd.elastic.run``, the
world resized by rewriting what the discovery script prints. ``nan:METHOD``: METHOD with a NaN in
rank :data:`NAN_RANK`'s gradient at step :data:`NAN_STEP` (the growth's first step);
``skip:METHOD``: METHOD without that step (no line for it). Every step prints one ``ELASTIC
{json}`` line: step, size, rank, loss, a digest of the parameters, of this rank's error-feedback
residual and of each key of the torch state.

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
NAN_STEP, NAN_RANK = 2 * STEPS, 0  # (a 2,1,2 plan: the first step after the growth, on the survivor)

#: the adaptive optimizers (METHOD): each with its compressed stage at every size of a 2,1,2 plan
#: (tests/test_elastic.py::test_adaptive_optimizers_shrink_and_grow_in_the_compressed_stage, one job)
ADAPTIVE = {  # METHOD: (the class of hvdcomp.adaptive_opt, its arguments)
    "onebitadam": ("OneBitAdam", {"lr": 0.05, "freeze_step": 2}),  # 2 warm-up steps, then 1-bit steps
    "onebitlamb": ("OneBitLamb", {"lr": 0.2, "freeze_step": 2}),  # (LAMB: lr relative to |w|)
    # variance steps 1, 2 and 4 (kappa = 1), 1-bit steps 3 and 5, the variance frozen after step 5,
    # synchronisations at 6, 7, 9 and 13 (alpha = 1, H = 4), local steps in between
    "zerooneadam": ("ZeroOneAdam", {"lr": 0.05, "var_freeze_step": 5, "var_update_scaler": 1,
                                    "local_step_scaler": 1, "local_step_clipper": 4}),
    "amsgrad": ("CompressedAMSGrad", {"lr": 0.05}),  # the two-way compressed gradient, AMSGrad
}

#: METHODs trained side by side in one job, each on its own model and optimizer, all following
#: the same resets (the resets, not the steps, take the time); a new mode joins a job by its
#: METHOD here and its checks in tests/test_elastic.py
GROUPS = {
    "adaptive": sorted(ADAPTIVE),
    # hvdcomp.DistributedOptimizer (per-step compression) and the local-update modes
    # (with a NaN at the growth's first step, and without that step: nan:, skip:)
    "allreduce-and-local": ["topk:density=0.25", "powersgd", "diloco:topk:density=0.25",
                            "sparseloco:topk:density=0.25", "co2:topk:density=0.25", "adaalter:topk:density=0.25",
                            "co2:none", "nan:co2:none", "nan:topk:density=0.25", "skip:topk:density=0.25"],
    # gossip on a ring, overlap on; the compressors that keep the network average exactly
    "gossip": ["gossip:choco:sign", "gossip:dcd:none", "gossip:ecd:none", "gossip:powergossip:none"],
}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().double().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def method_state(opt) -> dict:
    """The method's checkpoint state (the facade's ``"hvdcomp"``, a local-update mode's pipeline's,
    an adaptive optimizer's compressed allreduces': worker residuals under ``"residual"``, server's
    under ``"server"``)."""
    if hasattr(opt, "averaging"):
        reducers = sorted(opt.state_dict()["hvdcomp"]["reducers"].items())
        return {part: {f"{key}.{n}": t for key, red in reducers for n, t in red.get(part, {}).items()}
                for part in ("residual", "server")}
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


def torch_state(opt) -> dict:
    """A digest of each key of a torch optimizer's per-parameter state over every parameter."""
    params = [p for g in opt.param_groups for p in g["params"]]
    keys = sorted({k for p in params for k in opt.state[p]})
    return {k: digest([torch.as_tensor(opt.state[p][k]) for p in params]) for k in keys}


def mode_state(opt):
    """Local AdaAlter: a digest of the denominators; None for the others."""
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


def base_method(method: str) -> str:
    """METHOD without its ``nan:`` / ``skip:``."""
    return method.split(":", 1)[1] if method.startswith(("nan:", "skip:")) else method


def build(method: str):
    """(model, the optimizer of METHOD ``method``, the torch optimizer TorchState keeps, or None
    for the optimizer itself) and the target model, the same for every METHOD."""
    method = base_method(method)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    target = torch.nn.Linear(16, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    if method == "stock":
        return (model, hvd.DistributedOptimizer(base, named_parameters=model.named_parameters()), None), target
    mode = method.split(":", 1)[0]
    if mode in ("diloco", "sparseloco", "co2", "adaalter"):  # H = 2, Δ carried by the method after the colon
        import hvdcomp.local as L

        spec = method.split(":", 1)[1]
        if mode == "adaalter":  # (one synchronous warm-up step: the rounds end at odd steps)
            base = L.AdaAlter(model.parameters(), lr=0.2, eps=1.0)  # (eps 1: a tame first step)
            opt = L.LocalAdaAlter(base, model.named_parameters(), local_steps=2, warmup_steps=1, compression=spec)
        elif mode == "co2":  # (the constants of tests/test_elastic.py's one-process reference)
            opt = L.CO2(base, model.named_parameters(), local_steps=2, compression=spec, outer_lr=1.0,
                        outer_momentum=0.5)
        elif mode == "sparseloco":
            opt = L.SparseLoCo(base, model.named_parameters(), local_steps=2, compression=spec, chunk_size=None,
                               beta=0.9, outer_lr=0.7)
        else:
            opt = L.DiLoCo(base, model.named_parameters(), local_steps=2, compression=spec, outer_lr=0.7,
                           outer_momentum=0.9)
        # (a local-update mode is not a torch.optim.Optimizer: TorchState keeps the model and the inner optimizer)
        return (model, opt, base), target
    if mode == "gossip":  # gossip:<method>:<compressor> on a ring, overlap on
        import hvdcomp.gossip

        _, name, spec = method.split(":", 2)
        opt = hvdcomp.gossip.GossipOptimizer(base, model.named_parameters(), method=name, topology="ring",
                                             compression=spec, **({"consensus_step": 0.5} if name == "choco" else {}))
        return (model, opt, base), target  # (TorchState keeps the wrapped optimizer)
    if method in ADAPTIVE:
        import hvdcomp.adaptive_opt

        name, kwargs = ADAPTIVE[method]
        return (model, getattr(hvdcomp.adaptive_opt, name)(model.named_parameters(), **kwargs), None), target
    import hvdcomp

    return (model, hvdcomp.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                                compression=method), None), target


def train_step(method, model, opt, x, y, nan=False) -> dict:
    """One step of ``opt`` (``nan``: a NaN in one element of the first weight's gradient); what the
    ``ELASTIC`` line of ``method`` (without ``nan:``) says."""
    local, adaptive, gossip = hasattr(opt, "anchors"), method in ADAPTIVE, method.startswith("gossip:")
    before = {} if gossip else {k: digest([v]) for k, v in sorted(residuals(opt).items())}
    anchor_before = digest(opt.anchors.values()) if local else None
    state_before = torch_state(opt) if adaptive else {}
    pending_before = mode_state(opt)
    params_before = digest(model.parameters())
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if nan:
        model[0].weight.grad[0, 0] = float("nan")
    # gossip: the model after the local SGD step alone (the average over ranks gossip keeps)
    local_step = [(p.detach() - 0.1 * p.grad).reshape(-1).tolist() for p in model.parameters()] if gossip else None
    opt.step()
    return {"method": method, "loss": loss.item(), "params": digest(model.parameters()), "pid": os.getpid(),
            "params_before": params_before, "local_step": local_step,
            "flat": [p.detach().reshape(-1).tolist() for p in model.parameters()] if gossip else None,
            "residuals_before": before, "anchor_before": anchor_before,
            "residuals": {} if gossip else {k: digest([v]) for k, v in sorted(residuals(opt).items())},
            "counter": None if gossip else method_state(opt).get("step"),
            "anchor": digest(opt.anchors.values()) if local else None,
            "anchor_flat": [v for a in opt.anchors.values() for v in a.reshape(-1).tolist()]
            if method.startswith("co2:") else None,
            "momentum_flat": [v for p in opt.outer.param_groups[0]["params"]
                              for v in opt.outer.state.get(p, {}).get("momentum_buffer", torch.zeros_like(p))
                              .reshape(-1).tolist()] if method.startswith("co2:") else None,
            "outer": digest(_tensors(opt.outer.state_dict()["state"])) if local else None,
            "rounds": getattr(opt, "rounds", None),
            "state_before": state_before, "state": torch_state(opt) if adaptive else {},
            "pending_before": pending_before, "pending": mode_state(opt),
            "kind": getattr(opt, "last_step_kind", None),
            "server": None if gossip else digest(_tensors(method_state(opt).get("server", {}))),
            "shared": digest([t for t in _tensors(opt.compression.shared_state())])
            if hasattr(opt, "compression") and not gossip else None}


def main():
    method, hosts_file, plan = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    hvd.init()
    methods = GROUPS.get(method, [method])  # (a group: all of its METHODs, side by side)
    built = [build(m) for m in methods]
    runs, target = [(m, *b[0]) for m, b in zip(methods, built)], built[0][1]
    held = {}
    for i, (m, model, opt, base) in enumerate(runs):
        held.update({f"model{i}": model, f"optimizer{i}": base if base is not None else opt})
    state = hvd.elastic.TorchState(**held, step=0, phase=0)
    if os.environ.get("ELASTIC_CHECKS_CALLBACK", "1") == "1":  # (0: the size change noticed at the next step)
        state.register_reset_callbacks([opt.reset for _, _, opt, _ in runs if hasattr(opt, "reset")])

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
                for m, model, opt, _ in runs:  # (a gossip exchange stays in flight through the others' steps)
                    if m.startswith("skip:") and state.step == NAN_STEP:
                        continue
                    nan = m.startswith("nan:") and (state.step, hvd.rank()) == (NAN_STEP, NAN_RANK)
                    line = {"step": state.step, "size": hvd.size(), "rank": hvd.rank(),
                            **train_step(base_method(m), model, opt, x, y, nan), "method": m}
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
