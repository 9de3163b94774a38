"""Parity with stock Horovod 0.28.1 for the behaviours its own optimizer tests check (issue 29).

Each case is one small training loop written here, run twice on every rank: with stock
``hvd.DistributedOptimizer`` and with ``hvdcomp.DistributedOptimizer(compression="none")``
(hvdcomp's defaults otherwise). The oracle is stock Horovod: the final parameters (and, where
the case is about it, the optimizer state) must be equal **bit for bit** (compared as integers,
so NaN and inf compare too), and where stock raises, hvdcomp must raise the same exception type.
Every case runs with every ``torch.optim`` optimizer the installed torch ships that accepts the
case's parameters (one local step without Horovod decides; LBFGS needs a closure, SparseAdam
sparse gradients only, Muon 2-D parameters only).

Cases: broadcast of optimizer state and options from rank 0 (a checkpoint loaded on rank 0 only;
other ranks built with other hyper-parameters), forced allreduce of parameters a rank does not
use, ``requires_grad`` switched between steps (two optimizers, as a GAN), gradient clipping
between ``synchronize()`` and ``step()``, the warning of ``step()`` after ``synchronize()``
without ``skip_synchronize()``, no ``named_parameters`` (one and two parameter groups), missing
and duplicate names, sparse embeddings with and without ``sparse_as_dense``, process sets (at 4
ranks: even and odd ranks, two members each) and ``op=hvd.Adasum`` (``none`` and ``fp16``).
Then the two deliberate differences: errors before ``hvd.init()`` (same type as stock), and a
non-finite step (stock applies it; hvdcomp's default skips it; ``nonfinite="ignore"`` is stock).

Usage: mpirun -np N python tests/mpi/parity_checks.py [CASE ...]   (default: every case)
Prints "OK <case> <optimizer>" (or "SKIP <case> <optimizer>: <why>") on rank 0, then
"PARITY DONE". Run it with Horovod's tensor fusion off (``HOROVOD_FUSION_THRESHOLD=0``): stock
Adasum reduces a fused buffer as one vector, so its result depends on which tensors a cycle
happened to fuse (two stock runs differed by an ulp), and with a size-independent MPI allreduce
algorithm (as tests/test_recipes.py) so that the order of every sum is fixed.
"""
import inspect
import io
import os
import sys
import warnings

import torch
import horovod.torch as hvd

import hvdcomp

OPTIMIZERS = sorted((name, cls) for name, cls in vars(torch.optim).items()
                    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                    and cls is not torch.optim.Optimizer)
OPTIONS = dict(lr=0.05, momentum=0.5, weight_decay=0.01)        # each optimizer takes those it accepts
OTHER_OPTIONS = dict(lr=0.1, momentum=0.9, weight_decay=0.05)    # ranks != 0 before a broadcast
STEPS = 3
WARNING = "optimizer.step() called without optimizer.skip_synchronize()"
SETS = {}                                                        # "even"/"odd" process sets (4 ranks)
BROADCAST_AGREED = {}  # (maker, optimizer) -> every state tensor equal to rank 0's after the broadcast


def build(cls, params, options=OPTIONS):
    accepted = inspect.signature(cls.__init__).parameters
    return cls(params, **{k: v for k, v in options.items() if k in accepted})


def stock(opt, named_parameters=None, **kw):
    kw.pop("nonfinite", None)
    return hvd.DistributedOptimizer(opt, named_parameters=named_parameters, **kw)


def ours(opt, named_parameters=None, **kw):
    return hvdcomp.DistributedOptimizer(opt, named_parameters=named_parameters, compression="none", **kw)


def done(opt):
    """Stop an hvdcomp optimizer's allgather thread (many are built here)."""
    if hasattr(opt, "close"):
        opt.close()


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 * hvd.rank() + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def state_tensors(opt):
    """The wrapped optimizer's state tensors, in parameter order (hvdcomp's own entry left out)."""
    sd = opt.state_dict()
    return [v for key in sorted(sd["state"]) for _, v in sorted(sd["state"][key].items()) if torch.is_tensor(v)]


def bits(t):
    """``t`` as integers of its width: equal bits compare equal (NaN included)."""
    t = t.detach().contiguous()
    if t.is_sparse:
        t = t.coalesce().to_dense()
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(kind) if t.is_floating_point() else t


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y))
                                    for x, y in zip(a, b))


# ---- the cases: each returns what must equal stock's ------------------------------------------
def case_broadcast_state(make, cls):
    """Two steps; rank 0 saves model and optimizer; a new job (other initial weights on every
    rank, other hyper-parameters on ranks != 0) loads on rank 0 only, broadcasts parameters and
    optimizer state; then every rank holds rank 0's options and state; two more steps."""
    model = mlp()
    opt = make(build(cls, model.parameters()), model.named_parameters())
    train(model, opt, range(2))
    ckpt = io.BytesIO()
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
    done(opt)
    model = mlp(seed=1 + hvd.rank())
    opt = make(build(cls, model.parameters(), OPTIONS if hvd.rank() == 0 else OTHER_OPTIONS),
               model.named_parameters())
    if hvd.rank() == 0:
        ckpt.seek(0)
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p, hvd.broadcast(p.detach().clone(), root_rank=0, name=f"parity.param.{i}"))
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # (a fresh rank's local step may move its
    # parameters: weight decay with a zero gradient; stock's behaviour, compared below)
    options = {k: v for k, v in opt.param_groups[0].items() if k in OPTIONS}
    root = hvd.broadcast_object(options, root_rank=0, name="parity.options")
    assert options == root and {k: type(v) for k, v in options.items()} == {k: type(v) for k, v in root.items()}, \
        (options, root)
    held = state_tensors(opt) + [p.detach() for p in model.parameters()]
    # which state tensors and parameters now equal rank 0's, bit for bit, on every rank: where
    # stock Horovod leaves some different, hvdcomp must leave the same ones
    every = hvd.allgather_object([(tuple(t.shape), str(t.dtype)) for t in held], name="parity.layout")
    agreed = [all(layout == every[0] for layout in every)]
    if agreed[0]:
        for i, t in enumerate(held):
            equal = torch.equal(bits(t), bits(hvd.broadcast(t.clone(), root_rank=0, name=f"parity.state.{i}")))
            agreed.append(bool(hvd.allreduce(torch.tensor(float(equal)), op=hvd.Min, name=f"parity.eq.{i}")))
    after_broadcast = state_tensors(opt)
    train(model, opt, range(2, 4))
    done(opt)
    BROADCAST_AGREED[(make.__name__, cls.__name__)] = all(agreed)
    return [torch.tensor(agreed)] + after_broadcast + state_tensors(opt) + [p.detach().clone() for p in model.parameters()]


class TwoHeads(torch.nn.Module):
    """fc3 is used on ranks != 0 only: rank 0 has no gradient for it (forced allreduce)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 3)

    def forward(self, x):
        first = self.fc2(torch.relu(self.fc1(x)))
        return first if hvd.rank() == 0 else self.fc3(torch.relu(first))


def case_force_allreduce(make, cls):
    model = TwoHeads()
    opt = make(build(cls, model.parameters()), model.named_parameters())
    train(model, opt, range(STEPS))
    done(opt)
    return [p.detach().clone() for p in model.parameters()]


def case_dynamic_requires_grad(make, cls):
    """A generator and a discriminator with an optimizer each, trained in turn: the other's
    parameters have requires_grad off (no gradient) while one trains."""
    torch.manual_seed(3)
    gen, disc = torch.nn.Conv2d(1, 4, 1), torch.nn.Conv2d(4, 1, 1)
    inp = torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(hvd.rank()))
    gen_opt = make(build(cls, gen.parameters()), gen.named_parameters())
    disc_opt = make(build(cls, disc.parameters()), disc.named_parameters())
    for _ in range(STEPS):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for p in (gen if train_gen else disc).parameters():
                assert p.grad is not None and p.grad.abs().max() > 0
            for p in (disc if train_gen else gen).parameters():
                assert p.grad is None or not p.grad.abs().max() > 0
            (gen_opt if train_gen else disc_opt).step()
    done(gen_opt)
    done(disc_opt)
    return [p.detach().clone() for m in (gen, disc) for p in m.parameters()]


def case_gradient_clipping(make, cls):
    """synchronize(), clip the averaged gradients to norm 0.1, step inside skip_synchronize()."""
    model = mlp()
    opt = make(build(cls, model.parameters()), model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        before = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        assert before > 0.1 and after <= 0.1 * (1 + 1e-6), (before, after)
        with opt.skip_synchronize():
            opt.step()
    done(opt)
    return [p.detach().clone() for p in model.parameters()]


def case_synchronize_step_warning(make, cls):
    """step() after synchronize() without skip_synchronize(): exactly one warning, naming it."""
    model = mlp()
    opt = make(build(cls, model.parameters()), model.named_parameters())
    for step in range(2):
        opt.zero_grad()
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert len(caught) == 1 and WARNING in str(caught[0].message), [str(w.message) for w in caught]
    done(opt)
    return [p.detach().clone() for p in model.parameters()]


def case_no_named_parameters(make, cls):
    """named_parameters absent: one parameter group, then two."""
    out = []
    for groups in (False, True):
        model = mlp()
        params = ([{"params": model[0].parameters()}, {"params": model[2].parameters()}] if groups
                  else model.parameters())
        opt = make(build(cls, params))
        train(model, opt, range(STEPS))
        done(opt)
        out += [p.detach().clone() for p in model.parameters()]
    return out


def case_missing_named_parameters(make, cls):
    """Half the parameters named: ValueError (stock's type)."""
    model = mlp()
    make(build(cls, model.parameters()), list(model.named_parameters())[:1])


def case_duplicate_names(make, cls):
    """Two modules whose parameters share names: ValueError (stock's type)."""
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    make(build(cls, list(a.parameters()) + list(b.parameters())),
         list(a.named_parameters()) + list(b.named_parameters()))


SPARSE_OPTIONS = dict(lr=0.05)  # weight decay and momentum refuse sparse gradients (SGD, Adagrad)


def sparse_embedding(sparse_as_dense):
    def case(make, cls):
        torch.manual_seed(4)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = make(build(cls, list(emb.parameters()), SPARSE_OPTIONS), emb.named_parameters(),
                   sparse_as_dense=sparse_as_dense)
        for step in range(STEPS):
            ids = (torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if hvd.rank() == 0
                   else torch.tensor([[1, 3, 4], [4, 7, (9 + step) % 10]]))
            opt.zero_grad()
            (emb(ids) * (1 + step)).sum().backward()
            opt.step()
        done(opt)
        return [p.detach().clone() for p in emb.parameters()] + state_tensors(opt)
    case.__name__ = f"case_sparse_embedding_{'as_dense' if sparse_as_dense else 'sparse'}"
    return case


def case_process_sets(make, cls):
    """Even and odd ranks train in their own process set (two members each, 4 ranks): equal
    parameters within a set, different between the sets."""
    mine = SETS["even"] if hvd.rank() % 2 == 0 else SETS["odd"]
    model = mlp()
    opt = make(build(cls, model.parameters()), model.named_parameters(), process_set=mine)
    train(model, opt, range(STEPS))
    done(opt)
    params = [p.detach().clone() for p in model.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    every = hvd.allgather(flat.unsqueeze(0), name="parity.sets").reshape(hvd.size(), -1)
    for r in range(hvd.size()):
        assert torch.equal(every[r], flat) == (r % 2 == hvd.rank() % 2), r
    return params


def adasum(compression):
    def case(make, cls):
        model = mlp()
        base = build(cls, model.parameters())
        if make is stock:
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                           compression=hvd.Compression.fp16 if compression == "fp16" else
                                           hvd.Compression.none)
        else:
            opt = hvdcomp.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                               compression=compression)
        train(model, opt, range(STEPS))
        return [p.detach().clone() for p in model.parameters()]
    case.__name__ = f"case_adasum_{compression}"
    return case


CASES = [case_broadcast_state, case_force_allreduce, case_dynamic_requires_grad, case_gradient_clipping,
         case_synchronize_step_warning, case_no_named_parameters, case_missing_named_parameters,
         case_duplicate_names, sparse_embedding(False), sparse_embedding(True), case_process_sets,
         adasum("none"), adasum("fp16")]
EXPECT_ERROR = {"case_missing_named_parameters": ValueError, "case_duplicate_names": ValueError}
# The one case not bit for bit: without sparse_as_dense stock allgathers the sparse gradient and
# hands the optimizer an uncoalesced tensor (rows a rank or the ranks repeat are applied one after
# another: SGD rounds after each), while hvdcomp averages it densely (the rows summed first); the
# values then agree to a few units in the last place: each row takes at most 2N additions per
# step (an occurrence per rank and per repeat, ids repeat at most twice here), each rounded to half
# an ulp, so within N·STEPS ulps (2^-23 relative). Optimizers that coalesce (SparseAdam, Adagrad)
# agree bit for bit, and with sparse_as_dense=True every optimizer does.
ULPS = {"case_sparse_embedding_sparse": lambda: hvd.size() * STEPS}


def close_ulps(a, b, ulps):
    return len(a) == len(b) and all(
        x.shape == y.shape and ((x.double() - y.double()).abs()
                                <= ulps * 2.0**-23 * torch.maximum(x.double().abs(), y.double().abs())).all()
        for x, y in zip(a, b))


def accepts(case, cls):
    """Why ``cls`` cannot take one local step on the case's kind of parameters (None: it can)."""
    options = OPTIONS
    if case.__name__.startswith("case_sparse_embedding"):
        module = torch.nn.Embedding(10, 3, sparse=True)
        loss = lambda: module(torch.tensor([1, 2])).sum()   # noqa: E731
        options = SPARSE_OPTIONS
    else:
        module = mlp()
        loss = lambda: module(torch.ones(2, 6)).sum()       # noqa: E731
    try:
        opt = build(cls, list(module.parameters()), options)
        loss().backward()
        opt.step()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return None


def outcome(case, make, cls):
    try:
        return "value", case(make, cls)
    except Exception as exc:  # noqa: BLE001 - compared with stock's below
        return "raised", exc


def run_case(case):
    name = case.__name__
    if name == "case_process_sets" and hvd.size() != 4:
        return []
    if name.startswith("case_adasum") and hvd.size() & (hvd.size() - 1):
        return []  # Horovod's CPU Adasum needs a power-of-two number of ranks
    lines = []
    for opt_name, cls in OPTIMIZERS:
        why = accepts(case, cls)
        if why is not None:
            lines.append(f"SKIP {name[5:]} {opt_name}: {why}")
            continue
        theirs, mine = outcome(case, stock, cls), outcome(case, ours, cls)
        expected, note = EXPECT_ERROR.get(name), ""
        if expected is not None:
            assert theirs[0] == mine[0] == "raised", (name, opt_name, theirs, mine)
            assert type(theirs[1]) is type(mine[1]) is expected, (name, opt_name, theirs[1], mine[1])
        else:
            if mine[0] == "raised" or theirs[0] == "raised":
                raise AssertionError(f"{name} {opt_name}: stock {theirs}, hvdcomp {mine}")
            if not same(theirs[1], mine[1]):
                ulps = ULPS[name]() if name in ULPS else 0
                assert ulps and close_ulps(theirs[1], mine[1], ulps), \
                    f"{name} {opt_name}: hvdcomp differs from stock Horovod"
                note = f" (within {ulps} ulp, not bit for bit: rows summed before, not after, the update)"
        if name == "case_broadcast_state" and not BROADCAST_AGREED.get(("stock", opt_name), True):
            note = " (as stock: some state or parameters differ from rank 0's after the broadcast)"
        lines.append(f"OK {name[5:]} {opt_name}{note}")
    return lines


# ---- the deliberate differences -----------------------------------------------------------------
def errors_before_init():
    """Before hvd.init(): the exception type stock raises (valid arguments; duplicate names) and
    the one hvdcomp raises, per situation."""
    out = {}
    for label, named in (("valid", None), ("duplicate", "dup")):
        types_ = []
        for make in (stock, ours):
            a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            params = list(a.parameters()) + list(b.parameters())
            names = (list(a.named_parameters()) + list(b.named_parameters()) if named
                     else [(f"p{i}", p) for i, p in enumerate(params)])
            try:
                make(torch.optim.SGD(params, lr=0.1), names)
                types_.append(None)
            except Exception as exc:  # noqa: BLE001 - the type is the result
                types_.append(type(exc))
        out[label] = types_
    return out


def check_errors_before_init(found):
    for label, (theirs, mine) in found.items():
        assert theirs is ValueError and mine is theirs, (label, theirs, mine)
    return ["OK errors_before_init ValueError"]


def check_nonfinite():
    """Horovod's dynamic-requires_grad set-up (1×100×100 input, summed loss, SGD lr 0.1) diverges
    to inf within 10 rounds. Stock applies those steps (inf reaches the parameters); hvdcomp's
    default nonfinite="skip" skips them on every rank (parameters as before the step, every .grad
    NaN); nonfinite="ignore" gives stock's parameters bit for bit."""
    def run(make, **kw):
        torch.manual_seed(5)
        gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
        inp = torch.rand(1, 1, 100, 100, generator=torch.Generator().manual_seed(hvd.rank()))
        opts = [make(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), **kw) for m in (gen, disc)]
        skipped_steps = 0
        for _ in range(10):
            for turn in (0, 1):
                for i, m in enumerate((gen, disc)):
                    for p in m.parameters():
                        p.requires_grad_(i == turn)
                for o in opts:
                    o.zero_grad()
                disc(gen(inp)).sum().backward()
                before = [p.detach().clone() for m in (gen, disc) for p in m.parameters()]
                opt = opts[turn]
                skipped = getattr(opt, "skipped_steps", 0)
                opt.step()
                if getattr(opt, "skipped_steps", 0) > skipped:  # hvdcomp skipped it on every rank
                    skipped_steps += 1
                    assert same(before, [p.detach() for m in (gen, disc) for p in m.parameters()])
                    assert all(torch.isnan(p.grad).all() for p in (gen, disc)[turn].parameters())
        for o in opts:
            done(o)
        return [p.detach().clone() for m in (gen, disc) for p in m.parameters()], skipped_steps

    theirs, _ = run(stock)
    skip, skipped = run(ours)
    ignore, none_skipped = run(ours, nonfinite="ignore")
    assert not all(torch.isfinite(p).all() for p in theirs), "stock did not overflow: the set-up changed"
    assert skipped >= 1 and all(torch.isfinite(p).all() for p in skip), skipped
    assert none_skipped == 0 and same(theirs, ignore), "nonfinite='ignore' differs from stock"
    return [f"OK nonfinite stock-inf skip-finite({skipped} skipped) ignore-equals-stock"]


def check_adasum_refused_for_other_methods():
    model = mlp()
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression="topk:density=0.3",
                                     op=hvd.Adasum)
    except ValueError as exc:
        assert "Adasum" in str(exc) and "'none'" in str(exc) and "'fp16'" in str(exc), exc
    else:
        raise AssertionError("Adasum accepted with topk")
    return ["OK adasum_refused topk"]


if __name__ == "__main__":
    before_init = errors_before_init()
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    if world == 4:
        SETS["even"], SETS["odd"] = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
        hvd.init(process_sets=[SETS["even"], SETS["odd"]])
    else:
        hvd.init()
    lines = check_errors_before_init(before_init)
    chosen = sys.argv[1:] or [c.__name__[5:] for c in CASES] + ["nonfinite", "adasum_refused"]
    for case in CASES:
        if case.__name__[5:] in chosen:
            lines += run_case(case)
            hvd.barrier()
    if "nonfinite" in chosen:
        lines += check_nonfinite()
    if "adasum_refused" in chosen:
        lines += check_adasum_refused_for_other_methods()
    hvd.barrier()
    if hvd.rank() == 0:
        print("\n".join(lines), flush=True)
        print("PARITY DONE", flush=True)
