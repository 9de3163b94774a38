"""GossipOptimizer under mpirun against a single-process reference written here.

The reference simulates the N ranks of each configuration of ``tests/mpi/gossip_checks.py`` in
one process, from the papers' update rules (Choco-SGD, DCD-PSGD, ECD-PSGD, PowerGossip) with the
same generators (compressors built per simulated rank under ``simulated_world``; PowerGossip's
edge generators seeded from the edge), the same mixing weights (Metropolis–Hastings, computed here
by hand) and the same order of operations, and the MPI run must equal it bit for bit, at 2 and 4
ranks, on a ring, a path (ranks with 1 and 2 neighbours), a time-varying exponential graph and
inside a process set. Byte counters are checked against the wire formats.
"""
import json
import math
import os
import time

import pytest
import torch

import hvdcomp
from hvdcomp.compressors import simulated_world
from hvdcomp.compressors.topk import num_kept
from tests.mpi.gossip_checks import (CHECKPOINT_CONFIGS, CONFIGS, NONFINITE_CONFIGS, PROCESS_SET, SET_CONFIG, SHAPES,
                                     STEPS, TWO_CONFIGS, make_params, targets)
from tests.mpirun import TINY_SHAKESPEARE, check, mpirun

NAMES = list(SHAPES)


# ---- the reference ------------------------------------------------------------------------------
def adjacency(topology, n, step=0):
    """Neighbour lists, from the definitions (not hvdcomp.gossip.topology)."""
    if topology == "ring":
        return [sorted({(i - 1) % n, (i + 1) % n} - {i}) for i in range(n)]
    if topology == "exponential":  # one peer: i XOR 2^(step mod log2 n)
        k = step % (n.bit_length() - 1)
        return [[i ^ (1 << k)] for i in range(n)]
    return [list(a) for a in topology]


def weights(topology, n, step=0):
    """W[i][j] for the neighbours and W[i][i]: Metropolis–Hastings 1/(1 + max(d_i, d_j)); the
    exponential graph ½, ½."""
    adj = adjacency(topology, n, step)
    w = []
    for i in range(n):
        if topology == "exponential":
            row = {j: 0.5 for j in adj[i]}
        else:
            row = {j: 1.0 / (1 + max(len(adj[i]), len(adj[j]))) for j in adj[i]}
        row[i] = 1.0 - sum(row[j] for j in adj[i])
        w.append(row)
    return adj, w


def qsgd_scale(spec, numel):
    """Choco's 1/(1 + ω) for QSGD: ω = min(d/s², √d/s), d = min(block, numel)."""
    kw = hvdcomp.parse_spec(spec)[1]
    s, d = kw["levels"], min(kw["block"], numel)
    return 1.0 / (1.0 + min(d / s**2, math.sqrt(d) / s))


class Rank:
    """One simulated rank: model, local optimizer, compressor (built under its simulated rank)."""

    def __init__(self, g, world, spec):
        self.g, self.world = g, world
        self.params = make_params(g)
        self.c = targets(g)
        self.opt = torch.optim.SGD(list(self.params.values()), lr=0.1, momentum=0.9, weight_decay=1e-3)
        self.comp = None
        if spec is not None:
            name, kw = hvdcomp.parse_spec(spec)
            name = {"sign": "efsignsgd"}.get(name, name)
            with simulated_world(world, g):
                self.comp = hvdcomp.get_compressor(name, ef=False, **kw)

    def local_step(self):
        for n, p in self.params.items():
            p.grad = p.detach() - self.c[n]
        self.opt.step()

    def encode(self, tensor, name):
        with simulated_world(self.world, self.g):
            q, ctx = self.comp.encode(tensor, name)
        return [t.reshape(-1).clone() for t in q], ctx

    def decode(self, q, ctx, like, scale=1.0):
        d = self.comp.decode(q, ctx).reshape(like.shape).to(like.dtype)
        return d.mul_(scale) if scale != 1.0 else d


def reference(config, members, world):
    """Final parameters of every member (global ranks ``members``) after STEPS steps and a flush."""
    kw = dict(config)
    method, topology, spec = kw["method"], kw["topology"], kw.get("compression")
    overlap = kw.get("overlap", True)
    n = len(members)
    ranks = [Rank(g, world, spec) for g in members]
    P = [[r.params[k] for k in NAMES] for r in ranks]
    steps = [0] * n

    def peers_weights(i):
        adj, w = weights(topology, n, steps[i])
        return adj[i], w[i]

    with torch.no_grad():
        if method == "choco":
            gamma = kw["consensus_step"]
            scales = [qsgd_scale(spec, math.prod(SHAPES[k])) if spec.startswith("qsgd") else 1.0 for k in NAMES]
            xh = [[torch.zeros_like(p) for p in P[i]] for i in range(n)]
            s = [[torch.zeros_like(p) for p in P[i]] for i in range(n)]

            def outgoing():
                return [[ranks[i].encode(P[i][k].detach() - xh[i][k], NAMES[k]) for k in range(len(NAMES))]
                        for i in range(n)]

            def incoming(sent):
                for i in range(n):
                    peers, w = peers_weights(i)
                    for k, p in enumerate(P[i]):
                        q, ctx = sent[i][k]
                        d = ranks[i].decode(q, ctx, p, scales[k])
                        xh[i][k].add_(d)
                        s[i][k].add_(d, alpha=w[i])
                        for j in peers:
                            s[i][k].add_(ranks[i].decode(sent[j][k][0], ctx, p, scales[k]), alpha=w[j])
                        p.add_(s[i][k] - xh[i][k], alpha=gamma)
                    steps[i] += 1

        elif method in ("dcd", "ecd"):
            s = []
            for i in range(n):  # the exact set-up exchange
                peers, w = peers_weights(i)
                s.append([P[i][k].detach().clone().mul_(w[i]) for k in range(len(NAMES))])
                for j in peers:
                    for k in range(len(NAMES)):
                        s[i][k].add_(P[j][k].detach().reshape(-1).clone().view(P[i][k].shape), alpha=w[j])
            prev = [None] * n

            def outgoing():
                sent = []
                for i in range(n):
                    _, w = peers_weights(i)
                    t = steps[i] + 1
                    mine = []
                    for k, (name, p, x) in enumerate(zip(NAMES, P[i], prev[i])):
                        if method == "dcd":
                            z = s[i][k] - x
                            z.add_(p.detach() - x)
                            q, ctx = ranks[i].encode(z, name)
                            d = ranks[i].decode(q, ctx, p)
                            p.copy_(x + d)
                            s[i][k].add_(d, alpha=w[i])
                        else:
                            new = s[i][k] + (p.detach() - x)
                            z = x * (1.0 - t / 2.0)
                            z.add_(new, alpha=t / 2.0)
                            p.copy_(new)
                            q, ctx = ranks[i].encode(z, name)
                            d = ranks[i].decode(q, ctx, p)
                            s[i][k].mul_(1.0 - 2.0 / t).add_(d, alpha=w[i] * 2.0 / t)
                        mine.append((q, ctx))
                    sent.append(mine)
                return sent

            def incoming(sent):
                for i in range(n):
                    peers, w = peers_weights(i)
                    c = 1.0 if method == "dcd" else 2.0 / (steps[i] + 1)
                    for j in peers:
                        for k, p in enumerate(P[i]):
                            s[i][k].add_(ranks[i].decode(sent[j][k][0], sent[i][k][1], p), alpha=w[j] * c)
                    steps[i] += 1

        else:  # powergossip
            gamma = kw.get("consensus_step", 1.0)
            rounds = kw.get("power_iterations", 1)
            mats = [k for k, name in enumerate(NAMES) if len(SHAPES[name]) >= 2]
            vecs = [k for k, name in enumerate(NAMES) if len(SHAPES[name]) < 2]
            dims = {k: (SHAPES[NAMES[k]][0], math.prod(SHAPES[NAMES[k]]) // SHAPES[NAMES[k]][0]) for k in mats}
            edges = [{} for _ in range(n)]  # edges[i][j] = [vectors, halves, generator]

            def edge(i, j):
                if j not in edges[i]:
                    lo, hi = min(members[i], members[j]), max(members[i], members[j])
                    gen = torch.Generator().manual_seed((0 * 1_000_003 + lo * 65_537 + hi + 1) & ((1 << 63) - 1))
                    edges[i][j] = [[torch.randn(dims[k][1], generator=gen) for k in mats], 0, gen]
                return edges[i][j]

            def outgoing(rnd):
                sent = []
                for i in range(n):
                    peers, _ = peers_weights(i)
                    mine = {}
                    for j in peers:
                        e = edge(i, j)
                        right = e[1] % 2 == 0
                        msg, units = [], []
                        for idx, k in enumerate(mats):
                            m, nn = dims[k]
                            x = P[i][k].detach().reshape(m, nn)
                            u = e[0][idx] / torch.linalg.vector_norm(e[0][idx])
                            units.append(u)
                            msg.append(torch.mv(x, u) if right else torch.mv(x.t(), u))
                        if rnd == 0:
                            msg += [P[i][k].detach().reshape(-1).clone() for k in vecs]
                        mine[j] = (msg, units, right)
                    sent.append(mine)
                return sent

            def incoming(sent, rnd):
                for i in range(n):
                    peers, w = peers_weights(i)
                    for j in peers:
                        e = edges[i][j]
                        own, units, right = sent[i][j]
                        theirs = sent[j][i][0]
                        step = gamma * w[j]
                        higher = members[i] > members[j]
                        for idx, k in enumerate(mats):
                            m, nn = dims[k]
                            u = own[idx] - theirs[idx] if higher else theirs[idx] - own[idx]
                            est = torch.outer(u, units[idx]) if right else torch.outer(units[idx], u)
                            P[i][k].view(m, nn).add_(est, alpha=-step if higher else step)
                            e[0][idx] = u
                        if rnd == 0:
                            for idx, k in enumerate(vecs):
                                P[i][k].view(-1).add_(theirs[len(mats) + idx] - own[len(mats) + idx], alpha=step)
                        e[1] += 1
                    if rnd == rounds - 1:
                        steps[i] += 1

        pending = None
        for _ in range(STEPS):
            if method in ("dcd", "ecd"):
                prev = [[p.detach().clone() for p in P[i]] for i in range(n)]
            for r in ranks:
                r.local_step()
            if method == "powergossip":
                if pending is not None:
                    incoming(pending, rounds - 1)
                for rnd in range(rounds):
                    pending = outgoing(rnd)
                    if rnd < rounds - 1:
                        incoming(pending, rnd)
            else:
                if pending is not None and overlap:
                    incoming(pending)
                pending = outgoing()
                if not overlap:
                    incoming(pending)
                    pending = None
        if pending is not None:
            incoming(pending, rounds - 1) if method == "powergossip" else incoming(pending)
    return [{k: P[i][idx].detach() for idx, k in enumerate(NAMES)} for i in range(n)]


def message_bytes(spec):
    """One Choco message on the wire (hvdcomp.comm.exchange.pack_payload): int64 header (count,
    then dtype and element count per tensor) + the payloads."""
    name, kw = hvdcomp.parse_spec(spec)
    numels = [math.prod(s) for s in SHAPES.values()]
    header = 8 * (1 + 2 * 2 * len(numels))  # two payload tensors per parameter
    if name == "topk":
        return header + sum(8 * num_kept(n, kw["density"]) for n in numels)
    if name == "sign":
        return header + sum(4 + math.ceil(n / 8) for n in numels)
    raise ValueError(spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for np_ in (2, 4):
        d = tmp_path_factory.mktemp(f"gossip-np{np_}")
        checks = "runs,bad_input,checkpoint,nonfinite,two_instances" if np_ == 2 else "runs"
        out[np_] = (d, check(np_, ["tests/mpi/gossip_checks.py", checks, str(d)], timeout=300))
    return out


@pytest.mark.parametrize("np_", [2, 4])
def test_mpi_run_equals_single_process_reference_bit_for_bit(runs, np_):
    d, _ = runs[np_]
    compared = 0
    for name, (sizes, config) in CONFIGS.items():
        if np_ not in sizes:
            continue
        expected = reference(config, list(range(np_)), np_)
        topology = config["topology"]
        for r in range(np_):
            got = torch.load(os.path.join(d, f"{name}-np{np_}-r{r}.pt"))
            for k in NAMES:
                assert torch.equal(got["params"][k], expected[r][k]), (name, r, k)
            compared += 1
            spec = config.get("compression", "")
            if config["method"] == "choco" and not spec.startswith("qsgd"):
                degree = len(adjacency(topology, np_)[r])
                assert got["bytes_sent"] == STEPS * degree * message_bytes(spec), (name, r)
                assert got["bytes_received"] == got["bytes_sent"]  # (equal payload sizes here)
                assert got["timer_sent"] == got["bytes_sent"]
    assert compared == np_ * sum(np_ in s for s, _ in CONFIGS.values())
    # the gossip moved the models toward each other: not a local-training no-op
    alone = Rank(0, np_, None)
    for _ in range(STEPS):
        alone.local_step()
    assert not torch.equal(alone.params["w1"].detach(),
                           torch.load(os.path.join(d, f"choco-sign-ring-np{np_}-r0.pt"))["params"]["w1"])


def test_mpi_run_inside_a_process_set_equals_reference(runs):
    d, _ = runs[4]
    expected = reference(SET_CONFIG, PROCESS_SET, 4)
    for i, g in enumerate(PROCESS_SET):
        got = torch.load(os.path.join(d, f"set-np4-r{g}.pt"))["params"]
        for k in NAMES:
            assert torch.equal(got[k], expected[i][k]), (g, k)
    alone = Rank(0, 4, None)  # rank 0 is outside the set: it trains alone
    for _ in range(STEPS):
        alone.local_step()
    got = torch.load(os.path.join(d, "set-np4-r0.pt"))["params"]
    for k in NAMES:
        assert torch.equal(got[k], alone.params[k].detach())


def test_bad_input_raises_on_every_rank(runs):
    _, out = runs[2]
    for label in ("gamma_everywhere", "gamma_one_rank", "gamma_disagree", "asymmetric", "listed_twice",
                  "disconnected", "biased_dcd", "compression_disagree", "nonfinite_unknown", "nonfinite_disagree",
                  "timeout_one_rank", "numbers"):
        for r in (0, 1):
            assert f"OK bad_input {label} rank {r}:" in out, (label, r, out[-3000:])


def test_two_optimizers_side_by_side_each_equal_their_reference(runs):
    """Two GossipOptimizers stepped in turn, exchanges in flight together over Horovod's
    collectives (elastic Horovod's and horovodrun --gloo's edge layer): each equals the
    single-process reference of its configuration bit for bit (before: the second exchange raised
    Horovod's "same name as another tensor that is currently being processed": the two ran under
    one name; tests/mpi/gossip_checks.py::check_two_instances)."""
    d, out = runs[2]
    assert "OK two_instances rank 0" in out and "OK two_instances rank 1" in out, out[-3000:]
    for name in TWO_CONFIGS:
        expected = reference(CONFIGS[name][1], [0, 1], 2)
        for r in (0, 1):
            got = load_params(d, f"two-{name}", r)["params"]
            for k in NAMES:
                assert torch.equal(got[k], expected[r][k]), (name, r, k)


def load_params(d, label, r):
    return torch.load(os.path.join(d, f"{label}-np2-r{r}.pt"))


def max_difference(got, expected):
    return max(float((got[k] - expected[k]).abs().max()) for k in NAMES)


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_checkpoint_at_every_step_changes_nothing_and_resumes_exactly(runs, name):
    """``state_dict()`` after every step (the exchange in flight, overlap on) leaves the run equal,
    bit for bit, to the reference that never saved; a run resumed on fresh objects from the
    checkpoint of step SAVE_AT (through ``torch.load(weights_only=True)``) equals it too. Before
    issue 57's fix, saving applied the exchange in flight early: after STEPS steps Choco QSGD,
    Choco sign and PowerGossip differed from the reference (DCD/ECD did not)."""
    d, out = runs[2]
    expected = reference(CONFIGS[name][1], [0, 1], 2)
    for r in (0, 1):
        assert f"OK checkpoint {name} rank {r}" in out, out[-3000:]
        for label in ("saved", "resumed"):
            got = load_params(d, f"{name}-{label}", r)["params"]
            assert all(torch.equal(got[k], expected[r][k]) for k in NAMES), (name, label, r,
                                                                              max_difference(got, expected[r]))


@pytest.mark.parametrize("mode", ["skip", "raise"])
@pytest.mark.parametrize("name", NONFINITE_CONFIGS)
def test_nonfinite_gradient_on_one_rank_skips_that_step_on_every_rank(runs, name, mode):
    """An Inf in rank 1's gradient at step BAD_STEP of STEPS + 1: every rank skips that step
    (``"skip"``) or raises ``FloatingPointError`` naming rank 1 (``"raise"``) and goes on. A skipped
    step leaves no trace (parameters, momentum, public copies, replicas, edge vectors, compressor
    generators, the exchange in flight), and each gradient here is a function of the parameters
    (p − c_r), so the run must equal, bit for bit, the reference run of STEPS steps: the
    one-process simulation with that step removed. Before issue 57's fix every rank's parameters
    were NaN at the end."""
    d, _ = runs[2]
    expected = reference(CONFIGS[name][1], [0, 1], 2)
    for r in (0, 1):
        rec = load_params(d, f"{name}-nonfinite-{mode}", r)
        got = rec["params"]
        assert all(torch.equal(got[k], expected[r][k]) for k in NAMES), (name, mode, r, max_difference(got, expected[r]))
        if mode == "skip":
            assert rec["skipped"] == 1 and rec["raised"] is None
        else:
            assert rec["skipped"] == 0 and "non-finite gradient" in rec["raised"] and "rank(s) [1]" in rec["raised"]


def test_nonfinite_ignore_lets_the_nan_reach_every_rank(runs):
    """``nonfinite="ignore"``: no check, no agreement collective; the Inf on rank 1 makes its model
    non-finite and the gossip carries that to rank 0 (what the guard prevents)."""
    d, _ = runs[2]
    for r in (0, 1):
        got = load_params(d, "choco-sign-ring-nonfinite-ignore", r)["params"]
        assert not all(bool(torch.isfinite(got[k]).all()) for k in NAMES), r


def test_one_rank_is_local_training(tmp_path):
    out = check(1, ["tests/mpi/gossip_checks.py", "single", str(tmp_path)], timeout=120)
    for method in ("choco", "dcd", "ecd", "powergossip"):
        assert f"OK single {method}" in out


@pytest.mark.parametrize("check,words", [
    # the default per-step non-finite agreement is an allgather: it ends the job, without a name
    ("stall", "did not complete within 3 s: some rank is dead, stalled or not calling step()"),
    # without it (nonfinite="ignore") the neighbours' exchange names the silent rank
    ("stall_ignore", "no message from neighbour rank(s) [2]")])
def test_stalled_rank_ends_the_job(tmp_path, check, words):
    t0 = time.monotonic()
    res = mpirun(4, ["tests/mpi/gossip_checks.py", check, str(tmp_path)], timeout=90)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0, res.stdout[-3000:]
    assert words in res.stdout, res.stdout[-3000:]
    assert "finished without noticing" not in res.stdout
    assert elapsed < 80  # rank 2 sleeps 120 s: the job ended on the timeout, not on its own


@pytest.mark.parametrize("np_", [1, 8])
def test_neighbor_transport_exact_bytes_and_uneven_degrees(np_):
    out = check(np_, ["tests/mpi/neighbor_checks.py"], timeout=180)
    assert out.count("OK neighbor") == np_, out[-3000:]


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_train_lm_gossip_choco_sign_on_a_ring(tmp_path):
    """train_lm.py --gossip choco --topology ring --compressor sign --consensus-step 0.45 at 2 ranks:
    perplexity falls; bytes per step are the scaled sign's wire size per neighbour (one here)."""
    out = check(2, ["mpi_scripts/train_lm.py", "--gossip", "choco", "--topology", "ring", "--compressor", "sign",
                    "--consensus-step", "0.45", "--epochs", "1", "--max-steps", "4", "--no-progress",
                    "--data", TINY_SHAKESPEARE, "--output", str(tmp_path)], timeout=300)
    assert "SUMMARY method=gossip-choco:sign,gamma=0.45 ranks=2" in out, out[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["epochs"][0]["val_ppl"] < 0.5 * r["initial_val_ppl"]
    assert r["gossip"]["method"] == "choco" and r["gossip"]["eval"] == "average"
    assert r["gossip"]["consensus_distance"] > 0  # the two local models differ
    h = 100
    sizes = [10000 * h] + [4 * h * h] * 4 + [4 * h] * 4
    message = 8 * (1 + 2 * 2 * len(sizes)) + sum(4 + math.ceil(n / 8) for n in sizes)  # (header: pack_payload)
    # timed steps skip the first, whose exchange is applied in the second (overlap): one message each
    assert r["per_step"]["bytes_sent"]["min"] == r["per_step"]["bytes_sent"]["max"] == message
    assert r["per_step"]["dense_bytes"]["mean"] == 4 * sum(sizes)
