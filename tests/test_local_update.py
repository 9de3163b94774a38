"""Local-update training (hvdcomp.local): golden traces against a single-process simulation of the
ranks, equivalence with synchronous training, CO2's hand-worked case and overlap safety, bad
input, checkpoints, AMP (multi-rank ones under mpirun with timeouts), the outer updates' formulas,
and an LM run through mpi_scripts/train_lm.py."""
import json
import math
import os

import pytest
import torch

from hvdcomp import get_compressor
from hvdcomp.local import AdaAlter, CO2Momentum, from_spec
from tests.mpirun import TINY_SHAKESPEARE, check

WORLD = 2
TOPK = "topk:density=0.5"

#: (H, outer lr, momentum, CO2 delay, compressor) and the two other algorithms; 7 inner steps each
#: (H = 3: two rounds and a partial one that flush() ends)
GRID = (
    [{"algorithm": "diloco", "local_steps": h, "outer_lr": lr, "outer_momentum": mom, "nesterov": mom > 0,
      "compression": comp} for h in (1, 3) for lr, mom in ((1.0, 0.0), (0.7, 0.9)) for comp in ("none", TOPK)]
    + [{"algorithm": "co2", "local_steps": h, "outer_lr": lr, "outer_momentum": mom, "gap_penalty": lam, "clip": phi,
        "compression": comp} for h in (1, 3) for lr, mom, lam, phi in ((1.0, 0.0, 1.0, None), (0.7, 0.5, 2.0, 0.02))
       for comp in ("none", TOPK)]
    + [{"algorithm": "sparseloco", "local_steps": 3, "compression": comp, "beta": 0.9, "outer_lr": 0.8, "chunk_size": 4}
       for comp in (TOPK, TOPK + ",values=int2,index=compact")]
    + [{"algorithm": "adaalter", "local_steps": 3, "compression": "none", "eps": 1.0, "warmup_steps": 2}])
for _c in GRID:
    _c.update(steps=7, inner_lr=0.05)


# ---- the simulation: every rank in one process, from the formulas --------------------------------
def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


class Reducer:
    """The average over ranks of each rank's (compressed) tensors, by name: Horovod's average
    ((sum) / world) for 'none', else each rank's compressor (with its error feedback) and the
    method's aggregate of every rank's payload."""

    def __init__(self, spec):
        self.methods = None if spec == "none" else [get_compressor(spec) for _ in range(WORLD)]
        for m in self.methods or []:
            m.bind_group(WORLD)

    def __call__(self, named_per_rank):
        names = list(named_per_rank[0])
        if self.methods is None:
            return {n: (named_per_rank[0][n] + named_per_rank[1][n]) * (1.0 / WORLD) for n in names}
        encoded = []
        for m, named in zip(self.methods, named_per_rank):
            m.begin_step()
            encoded.append({n: m.encode(named[n].clone(), n) for n in names})
            m.commit()
        return {n: self.methods[0].aggregate_into(torch.zeros_like(named_per_rank[0][n]),
                                                  [e[n][0] for e in encoded], encoded[0][n][1]) for n in names}


def simulate(config):
    """Per-rank traces (the local parameters after each inner step) and the final parameters."""
    c = config
    alg, h = c["algorithm"], c["local_steps"]
    models = [tiny_model() for _ in range(WORLD)]
    names = [n for n, _ in models[0].named_parameters()]
    anchor = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    reducer = Reducer(c["compression"])
    if alg == "adaalter":
        state = [{n: {"b": torch.zeros_like(p), "s": torch.zeros_like(p)} for n, p in m.named_parameters()}
                 for m in models]
    else:
        inner = [torch.optim.SGD(m.parameters(), lr=c["inner_lr"]) for m in models]
    if alg == "diloco":
        outer = torch.optim.SGD(list(anchor.values()), lr=c["outer_lr"], momentum=c["outer_momentum"],
                                nesterov=c["nesterov"])
    elif alg in ("sparseloco", "adaalter"):
        outer = torch.optim.SGD(list(anchor.values()), lr=c.get("outer_lr", 1.0), momentum=0.0)
    momentum = {n: torch.zeros_like(a) for n, a in anchor.items()}
    pending = None

    def chunks(delta):  # SparseLoCo: each parameter cut into chunks of chunk_size elements
        out = {}
        for n, d in delta.items():
            if d.numel() <= c["chunk_size"]:
                out[n] = d.clone()
            else:
                for k, start in enumerate(range(0, d.numel(), c["chunk_size"])):
                    out[f"{n}#{k}"] = d.reshape(-1)[start:start + c["chunk_size"]].clone()
        return out

    def unchunk(avg):
        return {n: avg[n] if n in avg else torch.cat([avg[f"{n}#{k}"] for k in range(math.ceil(a.numel() / c["chunk_size"]))]).view(a.shape)
                for n, a in anchor.items()}

    def outer_step(avg):
        if alg == "co2":
            for n, a in anchor.items():
                m = momentum[n]
                m.mul_(c["outer_momentum"]).add_(avg[n], alpha=1.0 / c["gap_penalty"])
                if c["clip"] is not None:
                    m.clamp_(-c["clip"], c["clip"])
                a.add_(m, alpha=-c["outer_lr"])
        else:
            for n, a in anchor.items():
                a.grad = avg[n]
            outer.step()

    def deltas():
        return [{n: anchor[n] - p.detach() for n, p in m.named_parameters()} for m in models]

    def reduce(per_rank):
        if alg == "sparseloco":
            for method in reducer.methods:
                method.memory.rescale(c["beta"])
            return unchunk(reducer([chunks(d) for d in per_rank]))
        return reducer(per_rank)

    def restart():
        with torch.no_grad():
            for m in models:
                for n, p in m.named_parameters():
                    p.copy_(anchor[n])

    def end_round(partial=False):
        nonlocal pending
        if alg == "co2":
            d = deltas()
            if pending is not None:
                outer_step(pending)
            pending = reduce(d)
            if partial:  # flush: the last round is applied at once
                outer_step(pending)
                pending = None
        else:
            with torch.no_grad():
                outer_step(reduce(deltas()))
            if alg == "adaalter":
                for n in names:
                    s = (state[0][n]["s"] + state[1][n]["s"]) * (1.0 / WORLD)
                    for r in range(WORLD):
                        state[r][n]["s"] = s.clone()
                        state[r][n]["b"] = s.clone()
        restart()

    traces = [[] for _ in range(WORLD)]
    round_step = 0
    for step in range(c["steps"]):
        for r, m in enumerate(models):
            x, y = batch(r, step)
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        if alg == "adaalter":
            warm = step < c["warmup_steps"]
            if warm:  # synchronous warm-up: averaged gradients
                avg = [(models[0].get_parameter(n).grad + models[1].get_parameter(n).grad) * (1.0 / WORLD) for n in names]
            with torch.no_grad():
                for r, m in enumerate(models):
                    for i, (n, p) in enumerate(m.named_parameters()):
                        g, st = (avg[i] if warm else p.grad), state[r][n]
                        p.add_(g / (st["b"] + c["eps"]).sqrt(), alpha=-c["inner_lr"])
                        st["s"].addcmul_(g, g)
                        if warm:
                            st["b"].copy_(st["s"])
            if warm:
                for n, p in models[0].named_parameters():
                    anchor[n] = p.detach().clone()
                if step == c["warmup_steps"] - 1:
                    outer = torch.optim.SGD(list(anchor.values()), lr=1.0, momentum=0.0)
        else:
            for opt in inner:
                opt.step()
            warm = False
        if not warm:
            round_step += 1
            if round_step == h:
                end_round()
                round_step = 0
        for r, m in enumerate(models):
            traces[r].append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    if round_step or pending is not None:
        if alg == "co2" and not round_step:
            outer_step(pending)
            restart()
        else:
            end_round(partial=True)
    final = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])
    return [torch.stack(t) for t in traces], final


CHECKS_2 = ["equivalence", "co2_hand_worked", "co2_no_training_on_inflight_tensors", "bad_input",
            "resume_mid_round", "resume_broadcast", "grad_scaler", "half_precision", "adaalter_bytes"]


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    """One 2-rank launch: the traces of every GRID configuration, then the checks of CHECKS_2."""
    out = tmp_path_factory.mktemp("local-traces")
    grid = out / "grid.json"
    grid.write_text(json.dumps(GRID))
    log = check(WORLD, ["tests/mpi/local_checks.py", "traces", *CHECKS_2, "--grid", str(grid), "--out", str(out)],
                timeout=300)
    return [torch.load(out / f"traces.{r}.pt", weights_only=True) for r in range(WORLD)], log


@pytest.mark.parametrize("index", range(len(GRID)), ids=[
    f"{c['algorithm']}-H{c['local_steps']}-lr{c.get('outer_lr', 1.0)}-m{c.get('outer_momentum', 0)}-{c['compression'].split(':')[0]}"
    + (f"-pen{c['gap_penalty']}-clip{c['clip']}" if c["algorithm"] == "co2" else "") for c in GRID])
def test_golden_traces(mpi_run, index):
    """Every rank's parameters after every inner step, and the final ones, bitwise as the
    simulation computes them from the formulas."""
    traces, final = simulate(GRID[index])
    for rank in range(WORLD):
        got = mpi_run[0][rank][index]
        for step, (a, b) in enumerate(zip(got["steps"], traces[rank])):
            assert torch.equal(a, b), (rank, step, (a - b).abs().max().item())
        assert torch.equal(got["final"], final)
    assert not torch.equal(final, torch.cat([p.detach().reshape(-1) for p in tiny_model().parameters()]))


def test_simulation_sees_delay_penalty_and_clip():
    """The grid's axes change the trajectory (so the comparison above can fail): CO2's delay,
    the penalty/clip and the compressor each give other parameters than their neighbour."""
    def final(**over):
        base = {"algorithm": "co2", "local_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.5, "gap_penalty": 1.0,
                "clip": None, "compression": "none", "steps": 7, "inner_lr": 0.05}
        return simulate({**base, **over})[1]

    diloco = simulate({"algorithm": "diloco", "local_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.5,
                       "nesterov": False, "compression": "none", "steps": 7, "inner_lr": 0.05})[1]
    plain = final()
    for other in (diloco, final(gap_penalty=2.0), final(clip=0.02), final(compression=TOPK)):
        assert not torch.equal(plain, other)


# ---- multi-rank checks ----------------------------------------------------------------------------
def test_local_checks_2_ranks(mpi_run):
    """tests/mpi/local_checks.py's checks at 2 ranks (each asserts its own reference: see there)."""
    for name in ["traces", *CHECKS_2]:
        assert f"OK {name}" in mpi_run[1], mpi_run[1][-3000:]


def test_equivalence_4_ranks():
    out = check(4, ["tests/mpi/local_checks.py", "equivalence"], timeout=240)
    assert "OK equivalence" in out, out[-3000:]


# ---- the outer updates' formulas (one process) ----------------------------------------------------
def test_co2_momentum_penalty_and_clip():
    """m ← β·m + g/λ, clamp to ±φ, θ ← θ − α·m, by hand: α = 0.5, β = 0.5, λ = 4, φ = 1."""
    theta = torch.zeros(3, requires_grad=True)
    opt = CO2Momentum([theta], lr=0.5, momentum=0.5, gap_penalty=4.0, clip=1.0)
    theta.grad = torch.tensor([2.0, -8.0, 12.0])
    opt.step()  # m = (0.5, −2, 3) → (0.5, −1, 1); θ = (−0.25, 0.5, −0.5)
    assert theta.tolist() == [-0.25, 0.5, -0.5]
    theta.grad = torch.tensor([2.0, 0.0, -2.0])
    opt.step()  # m = (0.25 + 0.5, −0.5, 0.5 − 0.5) = (0.75, −0.5, 0); θ = (−0.625, 0.75, −0.5)
    assert theta.tolist() == [-0.625, 0.75, -0.5]
    assert opt.state[theta]["momentum_buffer"].tolist() == [0.75, -0.5, 0.0]
    for bad in ({"lr": 0.0}, {"gap_penalty": 0.5}, {"clip": 0.0}, {"momentum": 1.0}):
        with pytest.raises(ValueError):
            CO2Momentum([theta], **bad)


def test_adaalter_step_by_hand():
    """θ ← θ − η·g/sqrt(b + ε), s ← s + g²; b frozen unless synchronous."""
    theta = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = AdaAlter([theta], lr=0.5, eps=1.0)
    theta.grad = torch.tensor([3.0, -4.0])
    opt.step()  # b = 0: θ = (1 − 1.5, 2 + 2) ; s = (9, 16)
    assert theta.tolist() == [-0.5, 4.0]
    theta.grad = torch.tensor([3.0, -4.0])
    opt.step()  # b still 0 (frozen): the same step again; s = (18, 32)
    assert theta.tolist() == [-2.0, 6.0]
    assert opt.state[theta]["accumulator"].tolist() == [18.0, 32.0]
    assert opt.state[theta]["denominator"].tolist() == [0.0, 0.0]
    opt.synchronous = True
    theta.grad = torch.tensor([0.0, 8.0])
    opt.step()  # θ₂ −= 0.5·8/1; then b = s = (18, 96)
    assert theta.tolist() == [-2.0, 2.0]
    assert opt.state[theta]["denominator"].tolist() == [18.0, 96.0]


def test_adaalter_and_diloco_defaults_are_the_papers():
    """Local AdaAlter: ε = 1e-7 (the authors' optimizer), H = 4 (the paper), one synchronous
    warm-up step (their script); DiLoCo: outer SGD with Nesterov momentum 0.9 and lr 0.7;
    SparseLoCo: error feedback decaying by β = 0.999 per round."""
    import inspect

    from hvdcomp.local import DiLoCo, LocalAdaAlter, SparseLoCo
    assert inspect.signature(SparseLoCo).parameters["beta"].default == 0.999
    assert AdaAlter([torch.nn.Parameter(torch.zeros(1))]).defaults["eps"] == 1e-7
    local = inspect.signature(LocalAdaAlter).parameters
    assert (local["local_steps"].default, local["warmup_steps"].default) == (4, 1)
    outer = inspect.signature(DiLoCo).parameters
    assert (outer["outer_lr"].default, outer["outer_momentum"].default, outer["nesterov"].default) == (0.7, 0.9, True)


def test_from_spec_errors():
    with pytest.raises(ValueError, match="unknown local-update algorithm"):
        from_spec("slowmo", None)
    with pytest.raises(ValueError, match="given both"):
        from_spec("co2:clip=0.1", None, clip=0.2)


# ---- the LM script ---------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_local_steps(tmp_path):
    """train_lm.py --local-steps 2 --outer-opt diloco with top-k 1 % on Δ at 2 ranks: 2 rounds in 4
    steps, each sending the fused top-k payload (8 bytes per kept entry + the 16-byte counts
    header), half of that per step; perplexity falls."""
    out = check(2, ["mpi_scripts/train_lm.py", "--local-steps", "2", "--outer-opt", "diloco",
                    "--compressor", "topk:density=0.01", "--epochs", "1", "--max-steps", "4", "--batch-size", "64",
                    "--no-progress", "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=400)
    assert "SUMMARY method=topk:density=0.01 ranks=2" in out and "local=diloco:H=2 rounds=2" in out
    r = json.loads((tmp_path / "results.json").read_text())
    lu = r["local_update"]
    assert lu["rounds"] == 2 and lu["inner_steps"] == 4 and lu["local_steps"] == 2
    h = 100
    sizes = [10000 * h] + [4 * h * h] * 4 + [4 * h] * 4
    sent = sum(8 * min(n, max(1, math.ceil(0.01 * n))) for n in sizes) + 16
    assert lu["bytes_sent_per_round"] == lu["across_ranks"]["bytes_sent_per_round"]["max"] == sent
    assert lu["bytes_sent_per_step"] == sent / 2
    assert lu["dense_bytes_per_round"] == 4 * sum(sizes)
    assert lu["ratio_vs_dense_per_step"] == pytest.approx(2 * 4 * sum(sizes) / sent)
    assert r["config"]["local_update"]["algorithm"] == "diloco"
    assert r["epochs"][0]["val_ppl"] < 0.5 * r["initial_val_ppl"]


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_co2_transformer_adamw(tmp_path):
    """train_lm.py --arch transformer --optimizer adamw --local-steps 2 --outer-opt co2 with dense
    Δ at 2 ranks: 4 AdamW steps are 2 rounds, each sending the fp32 model (4 bytes per parameter);
    perplexity falls."""
    out = check(2, ["mpi_scripts/train_lm.py", "--arch", "transformer", "--optimizer", "adamw", "--lr", "1e-3",
                    "--local-steps", "2", "--outer-opt", "co2", "--compressor", "none", "--epochs", "1",
                    "--max-steps", "4", "--batch-size", "64", "--no-progress", "--data", TINY_SHAKESPEARE,
                    "--output", str(tmp_path)], timeout=400)
    assert "local=co2:H=2 rounds=2" in out, out[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    lu, n = r["local_update"], r["config"]["parameters"]
    assert r["config"]["arch"] == "transformer" and r["config"]["optimizer"] == "adamw"
    assert r["config"]["local_update"]["algorithm"] == "co2" and r["config"]["local_update"]["delay_rounds"] == 1
    assert (lu["rounds"], lu["inner_steps"]) == (2, 4)
    assert lu["bytes_sent_per_round"] == lu["dense_bytes_per_round"] == 4 * n and lu["bytes_sent_per_step"] == 2 * n
    assert r["epochs"][0]["val_ppl"] < r["initial_val_ppl"]


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_adaalter_counts_warmup_and_accumulators(tmp_path):
    """train_lm.py --outer-opt adaalter:warmup_steps=2,eps=1 --local-steps 2 at 2 ranks, 4 steps:
    2 synchronous warm-up steps (the gradients, 4 bytes per parameter each), then one round that
    averages Δ and the squared-gradient accumulators (4 + 4 bytes per parameter): 16 bytes per
    parameter in 4 steps, as many as synchronous fp32 training sends (ratio 1)."""
    out = check(2, ["mpi_scripts/train_lm.py", "--local-steps", "2", "--outer-opt", "adaalter:warmup_steps=2,eps=1",
                    "--lr", "0.5", "--epochs", "1", "--max-steps", "4", "--batch-size", "64", "--no-progress",
                    "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=400)
    assert "local=adaalter:warmup_steps=2,eps=1:H=2 rounds=1" in out, out[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    lu, n = r["local_update"], r["config"]["parameters"]
    assert (lu["rounds"], lu["inner_steps"], lu["warmup_bytes_sent"]) == (1, 4, 2 * 4 * n)
    assert lu["bytes_sent_per_round"] == 8 * n and lu["accumulator_bytes_per_round"] == 4 * n
    assert lu["bytes_sent_per_step"] == 4 * n and lu["ratio_vs_dense_per_step"] == 1.0
    assert r["epochs"][0]["val_ppl"] < r["initial_val_ppl"]
