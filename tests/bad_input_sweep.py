"""The bad-input sweep (issue 60): every public constructor and spec string, every argument, fed
numbers of every kind and the other wrong types; each case must be a clear error naming the
argument, or accepted because the value is valid as documented.

The table (:data:`CONSTRUCTORS`) gives, for each constructor, how to build it with good arguments
and each checked argument's documented domain (:class:`Real`, :class:`Int`, :class:`Bool`,
:class:`Choice`), written from the docstrings, not from the checks. :func:`probes` turns a
domain into values of every kind with the verdict the docs give them (valid or not);
:func:`run_case` builds the constructor with one value and classifies what happened:

* ``accepted``: valid and accepted (a constructor that then needs Horovod, MPI or a process group
  and says so counts as accepted: its checks passed);
* ``clear``: invalid and refused with ``ValueError``/``TypeError`` naming the argument;
* ``silent``: invalid and accepted (a wrong value would train);
* ``refused-valid``: valid and refused (e.g. a numpy integer as "not an integer");
* ``unclear``: invalid and refused by an exception that does not name the argument, or of
  another type (a deep ``KeyError``, "unexpected keyword argument", ...).

Constructors that need Horovod or MPI before they check (gossip, AB-training) run in
``tests/test_bad_input.py`` under ``mpirun`` through this file's ``main``; the rest in one
process. ``python tests/bad_input_sweep.py [GROUP...]`` prints the counts per outcome and each bad
case (the before/after numbers of issue 60 came from it).
"""
from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

if __name__ == "__main__":  # (this checkout's hvdcomp, not an installed one)
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BAD = ("silent", "refused-valid", "unclear")


# ---- argument domains ------------------------------------------------------------------------------
@dataclass
class Real:
    """A real number in [low, high] (either end open or absent); ``good``: a valid value."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    good: float = 0.5
    optional: bool = False

    def valid(self, v: float) -> bool:
        if math.isnan(v) or math.isinf(v):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return not (self.high is not None and (v >= self.high if self.high_open else v > self.high))


@dataclass
class Int:
    """An integer in [low, high]; ``good``: a valid value."""

    low: Optional[int] = None
    high: Optional[int] = None
    good: int = 1
    optional: bool = False

    def valid(self, v: int) -> bool:
        return (self.low is None or v >= self.low) and (self.high is None or v <= self.high)


@dataclass
class Bool:
    optional: bool = False


@dataclass
class Choice:
    values: Tuple[Any, ...]
    optional: bool = False


@dataclass
class Probe:
    value: Any
    valid: bool
    label: str


def _reals(d: Real) -> List[Probe]:
    g = d.good
    out = [Probe(g, True, "float"), Probe(np.float64(g), True, "np.float64"), Probe(torch.tensor(g, dtype=torch.float64),
                                                                                    True, "0-d tensor"),
           Probe(np.array(g), True, "0-d array")]
    if float(g).is_integer():
        out.append(Probe(int(g), True, "int"))
        out.append(Probe(np.int64(int(g)), True, "np.int64"))
    out += [Probe(float("nan"), False, "nan"), Probe(float("inf"), False, "inf"), Probe(float("-inf"), False, "-inf"),
            Probe(True, False, "True"), Probe(False, False, "False"), Probe(str(g), False, "str"),
            Probe(torch.tensor([g]), False, "1-d tensor"), Probe([g], False, "list")]
    if not d.optional:
        out.append(Probe(None, False, "None"))
    for edge, open_, sign in ((d.low, d.low_open, -1), (d.high, d.high_open, 1)):
        if edge is not None:
            out.append(Probe(float(edge), not open_ and d.valid(float(edge)), "edge"))
            out.append(Probe(float(edge) + sign * max(1.0, abs(edge)) * 0.5, False, "outside"))
    out.append(Probe(-1.0, d.valid(-1.0), "-1"))
    out.append(Probe(1e300, d.valid(1e300), "1e300"))
    return out


def _ints(d: Int) -> List[Probe]:
    g = d.good
    out = [Probe(g, True, "int"), Probe(np.int64(g), True, "np.int64"), Probe(torch.tensor(g), True, "0-d tensor"),
           Probe(float(g), False, "float"), Probe(g + 0.5, False, "fraction"), Probe(float("nan"), False, "nan"),
           Probe(float("inf"), False, "inf"), Probe(True, False, "True"), Probe(str(g), False, "str"),
           Probe(torch.tensor([g]), False, "1-d tensor"), Probe(torch.tensor(float(g)), False, "0-d float tensor")]
    if not d.optional:
        out.append(Probe(None, False, "None"))
    if d.low is not None:
        out += [Probe(d.low, True, "low"), Probe(d.low - 1, False, "below")]
    if d.high is not None:
        out += [Probe(d.high, True, "high"), Probe(d.high + 1, False, "above")]
    out.append(Probe(-1, d.valid(-1), "-1"))
    return out


def _bools(d: Bool) -> List[Probe]:
    out = [Probe(True, True, "True"), Probe(False, True, "False"), Probe(np.bool_(True), True, "np.bool_"),
           Probe("no", False, "'no'"), Probe("yes", False, "'yes'"), Probe("False", False, "'False'"),
           Probe(1, False, "1"), Probe(0, False, "0")]
    if not d.optional:
        out.append(Probe(None, False, "None"))
    return out


def _choices(d: Choice) -> List[Probe]:
    out = [Probe(v, True, repr(v)) for v in d.values]
    out += [Probe("bogus", False, "'bogus'"), Probe(1, False, "1"), Probe(True, False, "True")]
    if not d.optional:
        out.append(Probe(None, False, "None"))
    return out


def probes(domain) -> List[Probe]:
    """Values of every kind for ``domain``, each with the verdict the documentation gives it."""
    kind = {Real: _reals, Int: _ints, Bool: _bools, Choice: _choices}[type(domain)]
    out = kind(domain)
    if getattr(domain, "optional", False):
        out.append(Probe(None, True, "None"))
    return out


# ---- the constructors -------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _compressor(name):
    def build(**kw):
        from hvdcomp import get_compressor
        return get_compressor(name, **kw)
    return build


def _sgd():
    return torch.optim.SGD(_model().parameters(), lr=0.1)


def _local(cls_name):
    def build(**kw):
        import hvdcomp.local as local
        m = _model()
        inner = local.AdaAlter(m.parameters()) if cls_name == "LocalAdaAlter" else torch.optim.SGD(m.parameters(), lr=0.1)
        return getattr(local, cls_name)(inner, m.named_parameters(), **kw)
    return build


def _adaptive(cls_name, per_group=False):
    def build(**kw):
        import hvdcomp.adaptive_opt as ad
        m = _model()
        named = list(m.named_parameters())
        if per_group:  # the argument as a per-group setting of a second group
            groups = [{"params": named[:1]}, {"params": named[1:], **kw}]
            return getattr(ad, cls_name)(groups, **_ADAPTIVE_REQUIRED.get(cls_name, {}))
        return getattr(ad, cls_name)(named, **{**_ADAPTIVE_REQUIRED.get(cls_name, {}), **kw})
    return build


_ADAPTIVE_REQUIRED = {"OneBitAdam": {"freeze_step": 2}, "OneBitLamb": {"freeze_step": 2}}


def _lamb(**kw):
    from hvdcomp.adaptive_opt import Lamb
    return Lamb(_model().parameters(), **kw)


def _settings(**kw):
    """hvdcomp.DistributedOptimizer's argument checks (config.Settings.validate, which it calls
    first), with a stand-in for Horovod's op constants."""
    from hvdcomp.config import Settings

    class FakeHorovod:
        Average, Sum, Adasum = "Average", "Sum", "Adasum"

    return Settings.validate(FakeHorovod, **kw)


def _timer(**kw):
    from hvdcomp.metrics import PhaseTimer
    return PhaseTimer(**kw)


def _topology(spec):
    def build(**kw):
        from hvdcomp.gossip.topology import make_topology
        args = {"size": 4, "weights": "metropolis", **kw}
        return make_topology(spec, args["size"], args["weights"])
    return build


def _gossip(**kw):
    from hvdcomp.gossip import GossipOptimizer
    m = _model()
    args = {"method": "choco", "compression": "sign", "consensus_step": 0.5, **kw}
    return GossipOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), **args)


def _powergossip(**kw):
    return _gossip(method="powergossip", compression=None, consensus_step=None, **kw)


def _ab(**kw):
    from hvdcomp.lowrank import ABTraining
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return ABTraining(m, lambda ps: torch.optim.SGD(ps, lr=0.1), **{"rank_groups": 2, **kw})


def _register(**kw):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcomp.ddp
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = DDP(_model())
    if kw.pop("other_optimizer", False):  # an optimizer over another model's parameters
        kw["optimizer"] = torch.optim.SGD(_model().parameters(), lr=0.1)
    return hvdcomp.ddp.register(model, "topk:density=0.5", **kw)


DENSITY = Real(0.0, 1.0, low_open=True, good=0.5)
SEED = Int(0, 2**32 - 1, good=3)
ADAM = {"lr": Real(0.0, good=1e-3), "eps": Real(0.0, good=1e-8), "weight_decay": Real(0.0, good=0.0)}
BETA = Real(0.0, 1.0, high_open=True, good=0.9)
#: the trust ratio's clamps: 0 < min_coeff <= max_coeff (the other at its default: 10 and 0.01)
LAMB_COEFFS = {"max_coeff": Real(0.01, good=10.0), "min_coeff": Real(0.0, 10.0, low_open=True, good=0.01)}
SPARSE_WIRE = {"values": Choice(("fp32", "fp16", "int2", "stat2")), "index": Choice(("int", "compact")),
               "average": Choice(("ranks", "senders")), "ef": Bool(optional=True)}


#: the texts meaning "the checks passed, now it needs a process group" (Horovod's own, and
#: :func:`hvdcomp.comm.resolve_group`'s when neither Horovod nor torch.distributed is initialised)
NO_GROUP = ("Horovod is not initialised", "no process group: under mpirun")


@dataclass
class Ctor:
    """A public constructor: ``build(**good, arg=value)``; ``args``: each checked argument's
    domain; ``names``: the words a message uses for an argument (default its name); ``group``:
    ``"local"`` (one process), ``"mpi"`` (under mpirun at 2 ranks), ``"ddp"`` (a gloo group of one
    process); ``accept_errors``: an exception text meaning "the checks passed, now it needs X"."""

    build: Callable[..., Any]
    good: Dict[str, Any]
    args: Dict[str, Any]
    names: Dict[str, str] = field(default_factory=dict)
    group: str = "local"
    accept_errors: Tuple[str, ...] = NO_GROUP
    spec: Optional[str] = None  # the spec-string name (compressors, local-update algorithms)


CONSTRUCTORS: Dict[str, Ctor] = {
    # per-tensor methods: get_compressor(name, **kw) and the spec strings
    "topk": Ctor(_compressor("topk"), {}, {"density": DENSITY, "tile": Int(1, good=8, optional=True), "seed": SEED,
                                           "select": Choice(("exact", "sample")), **SPARSE_WIRE}, spec="topk"),
    "topk(select=sample)": Ctor(_compressor("topk"), {"select": "sample"}, {"sample_ratio": DENSITY}),
    "dgc": Ctor(_compressor("dgc"), {}, {"density": DENSITY, "momentum": BETA, "sample_ratio": DENSITY,
                                         "warmup_epochs": Int(0, good=2), "clip_norm": Real(0.0, good=1.0),
                                         "nesterov": Bool(), "momentum_masking": Bool(), "seed": SEED}, spec="dgc"),
    "qsgd": Ctor(_compressor("qsgd"), {}, {"levels": Int(1, 32767, good=4), "block": Int(1, good=64), "seed": SEED,
                                           "scale": Choice(("l2", "max"))}, spec="qsgd"),
    "randomk": Ctor(_compressor("randomk"), {}, {"density": DENSITY, "seed": SEED}, spec="randomk"),
    "sbc": Ctor(_compressor("sbc"), {}, {"density": DENSITY}, spec="sbc"),
    "sidco": Ctor(_compressor("sidco"), {}, {"density": DENSITY, "stages": Int(1, 16, good=2),
                                             "tolerance": Real(0.0, 1.0, low_open=True, good=0.2),
                                             "dist": Choice(("exp", "gpareto", "gamma"))}, spec="sidco"),
    "signsgd": Ctor(_compressor("signsgd"), {}, {"vote": Choice(("allreduce", "allgather"))}, spec="signsgd"),
    "terngrad": Ctor(_compressor("terngrad"), {}, {"clip_sigmas": Real(0.0, good=2.5), "seed": SEED}, spec="terngrad"),
    "threshold": Ctor(_compressor("threshold"), {}, {"threshold": Real(0.0, low_open=True, good=1e-3)},
                      spec="threshold"),
    "lowbit": Ctor(_compressor("lowbit"), {}, {"bits": Int(2, 8, good=4), "block": Int(1, good=64),
                                               "beta": Real(0.0, 1.0, high_open=True, good=0.5)}, spec="lowbit"),
    "fp16": Ctor(_compressor("fp16"), {}, {"headroom": Int(0, 10, good=3),
                                           "on_saturation": Choice(("resend", "skip"))}, spec="fp16"),
    "adaptive": Ctor(_compressor("adaptive"), {}, {"every": Int(1, good=10),
                                                   "budget": Real(0.0, 1.0, low_open=True, good=0.5, optional=True),
                                                   "base": Choice(("qsgd", "randomk", "topk"))},
                     spec="adaptive"),
    "powersgd": Ctor(_compressor("powersgd"), {}, {"matrix_rank": Int(1, good=2), "start_step": Int(0, good=0),
                                                   "min_compression_rate": Real(1.0, good=2.0),
                                                   "epsilon": Real(0.0, good=0.0), "seed": SEED}, spec="powersgd"),
    "gtopk": Ctor(_compressor("gtopk"), {}, {"density": DENSITY, "hierarchical": Bool()}, spec="gtopk"),
    "cltk": Ctor(_compressor("cltk"), {}, {"density": DENSITY, "leader": Choice(("cyclic", "variance")),
                                           "window": Int(1, good=25),
                                           "smoothing": Real(0.0, 1.0, high_open=True, good=0.001)}, spec="cltk"),
    "twophase": Ctor(_compressor("twophase"), {}, {"base": Choice(("efsignsgd", "qsgd", "terngrad"))},
                     spec="twophase"),
    # compression="auto" (interval >= warmup + probe: each probed with the others where that holds)
    "auto": Ctor(_compressor("auto"), {"probe": 1, "warmup": 0}, {
        "slack": Real(1.0, good=1.1), "tolerance": Real(0.0, low_open=True, good=1.0), "interval": Int(0, good=200),
        "window": Int(1, good=10), "accordion": Real(0.0, good=0.5), "critical_slack": Real(1.1, good=1.5, optional=True)},
                 spec="auto"),
    "auto(interval=0)": Ctor(_compressor("auto"), {"interval": 0}, {"probe": Int(1, good=3), "warmup": Int(0, good=1)}),
    # DistributedOptimizer's settings
    "DistributedOptimizer": Ctor(_settings, {}, {
        "backward_passes_per_step": Int(1, good=2), "gradient_predivide_factor": Real(0.0, low_open=True, good=1.0),
        "bucket_bytes": Int(1, good=1024), "check_consistency": Bool(), "fuse_tensors": Bool(),
        "sparse_as_dense": Bool(), "nonfinite": Choice(("skip", "raise", "ignore")),
        "granularity": Choice(("tensor", "bucket")), "transport": Choice(("planned", "auto")),
        "groups": Int(1, good=2, optional=True)}),
    "PhaseTimer": Ctor(_timer, {}, {"history_limit": Int(1, good=10, optional=True),
                                    "cuda_sync": Bool(optional=True)}),
    # local-update training
    "DiLoCo": Ctor(_local("DiLoCo"), {"local_steps": 2, "nesterov": False}, {
        "local_steps": Int(1, good=2), "outer_lr": Real(0.0, low_open=True, good=0.7), "outer_momentum": BETA,
        "nesterov": Bool(), "chunk_size": Int(1, good=4, optional=True), "history_limit": Int(1, good=5, optional=True)},
        names={"outer_lr": "outer learning rate", "outer_momentum": "outer momentum", "local_steps": "local_steps"},
        spec="diloco"),
    "SparseLoCo": Ctor(_local("SparseLoCo"), {"local_steps": 2}, {
        "beta": Real(0.0, 1.0, good=0.9), "outer_lr": Real(0.0, low_open=True, good=1.0),
        "form": Choice(("authors", "flat"))}, names={"outer_lr": "outer learning rate"}, spec="sparseloco"),
    "CO2": Ctor(_local("CO2"), {"local_steps": 2}, {
        "outer_lr": Real(0.0, low_open=True, good=1.0), "outer_momentum": BETA,
        "gap_penalty": Real(1.0, good=2.0), "clip": Real(0.0, low_open=True, good=0.5, optional=True)},
        names={"outer_lr": "outer learning rate", "outer_momentum": "outer momentum", "gap_penalty": "gap penalty"},
        spec="co2"),
    "LocalAdaAlter": Ctor(_local("LocalAdaAlter"), {}, {"local_steps": Int(1, good=4), "warmup_steps": Int(0, good=1)},
                          spec="adaalter"),
    "AdaAlter": Ctor(lambda **kw: __import__("hvdcomp.local", fromlist=["AdaAlter"]).AdaAlter(_model().parameters(), **kw),
                     {}, {"lr": Real(0.0, low_open=True, good=0.01), "eps": Real(0.0, low_open=True, good=1e-7),
                          "weight_decay": Real(0.0, good=0.0)}),
    # adaptive optimizers, and their per-group settings
    "OneBitAdam": Ctor(_adaptive("OneBitAdam"), {}, {**ADAM, "freeze_step": Int(1, good=3),
                                                     "mask_zero_variance": Bool(),
                                                     "momentum_averaging": Choice(("onebit", "exact"))}),
    "OneBitAdam(group)": Ctor(_adaptive("OneBitAdam", per_group=True), {}, dict(ADAM)),
    "ZeroOneAdam": Ctor(_adaptive("ZeroOneAdam"), {}, {
        **ADAM, "var_freeze_step": Int(1, good=10), "var_update_scaler": Int(1, good=16),
        "local_step_scaler": Int(1, good=100), "local_step_clipper": Int(1, good=16), "bias_correction": Bool(),
        "schedule": Choice(("paper", "deepspeed"))}),
    "ZeroOneAdam(group)": Ctor(_adaptive("ZeroOneAdam", per_group=True), {}, dict(ADAM)),
    "OneBitLamb": Ctor(_adaptive("OneBitLamb"), {}, {
        **ADAM, "freeze_step": Int(1, good=3), **LAMB_COEFFS, "coeff_beta": BETA, "factor_max": Real(1.0, good=4.0),
        "factor_min": Real(0.0, 1.0, low_open=True, good=0.5),
        "factor_threshold": Real(0.0, 1.0, high_open=True, good=0.1)}),
    "OneBitLamb(group)": Ctor(_adaptive("OneBitLamb", per_group=True), {}, dict(ADAM)),
    "CompressedAMSGrad": Ctor(_adaptive("CompressedAMSGrad"), {}, {**ADAM, "amsgrad": Bool()}),
    "CompressedAMSGrad(group)": Ctor(_adaptive("CompressedAMSGrad", per_group=True), {}, dict(ADAM)),
    "Lamb": Ctor(_lamb, {}, {**ADAM, **LAMB_COEFFS, "coeff_beta": BETA, "freeze_step": Int(1, good=2)}),
    # gossip topologies (pure), the gossip optimizer and AB-training (under mpirun)
    "make_topology(complete)": Ctor(_topology("complete"), {}, {"size": Int(1, good=4)},
                                    names={"size": "number of ranks"}),
    "make_topology(ring)": Ctor(_topology("ring"), {}, {"weights": Choice(("metropolis", "uniform"))}),
    "GossipOptimizer": Ctor(_gossip, {}, {
        "consensus_step": Real(0.0, 1.0, low_open=True, good=0.5), "timeout": Real(0.0, low_open=True, good=60.0),
        "overlap": Bool(), "nonfinite": Choice(("skip", "raise", "ignore")),
        "method": Choice(("choco",)), "weights": Choice(("metropolis", "uniform"))},
        names={"consensus_step": "consensus_step"}, group="mpi"),
    "GossipOptimizer(powergossip)": Ctor(_powergossip, {}, {
        "power_iterations": Int(1, good=2), "warm_start": Bool(), "seed": SEED}, group="mpi"),
    "ABTraining": Ctor(_ab, {}, {
        "warmup_steps": Int(0, good=5), "steps_between_syncs": Int(1, good=5), "full_rank_steps": Int(0, good=2),
        "cutoff": Real(0.0, 1.0, high_open=True, good=0.15), "ramp_steps": Int(0, good=3),
        "ramp_start_lr": Real(0.0, good=1e-5), "base_lr": Real(0.0, low_open=True, good=0.1),
        "ranks_per_node": Int(1, good=2, optional=True), "cut_first": Bool(), "reset_optimizer": Bool(),
        "mode": Choice(("only-b", "ab")), "orientation": Choice(("tall", "rows"))}, group="mpi"),
    # the DDP front-end (a gloo group of one process)
    "ddp.register": Ctor(_register, {}, {"check_consistency": Bool(), "granularity": Choice(("tensor", "bucket")),
                                         "nonfinite": Choice(("skip", "raise", "ignore"))}, group="ddp"),
}

#: the rest: cases that are not one argument's domain, each with a word its error message must
#: contain (all are refusals)
TABLE: List[Tuple[str, str, Callable[[], Any], Optional[str]]] = [
    ("local", "from_spec('co2:momentum=1')",
     lambda: __import__("hvdcomp.local", fromlist=["from_spec"]).from_spec(
         "co2:momentum=1", _sgd(), local_steps=2), "outer_momentum"),
    ("local", "DiLoCo(..., lr=0.1) (an inner-optimizer setting)",
     lambda: _local("DiLoCo")(local_steps=2, lr=0.1), "lr"),
    ("local", "spec 'topk:density=0.1,density=0.2'",
     lambda: _compressor("topk:density=0.1,density=0.2")(), "given twice"),
    ("local", "spec 'topk:dens=0.1'", lambda: _compressor("topk:dens=0.1")(), "density"),
    ("local", "OneBitAdam per-group freeze_step",
     lambda: _adaptive("OneBitAdam", per_group=True)(freeze_step=5), "freeze_step"),
    ("local", "OneBitAdam per-group betas=(1.5, 0.9)",
     lambda: _adaptive("OneBitAdam", per_group=True)(betas=(1.5, 0.9)), "betas"),
    ("local", "OneBitAdam betas=(0.9,)", lambda: _adaptive("OneBitAdam")(betas=(0.9,)), "betas"),
    ("local", "OneBitAdam betas=(0.9, nan)", lambda: _adaptive("OneBitAdam")(betas=(0.9, float("nan"))), "betas"),
    ("local", "OneBitAdam betas='0.9'", lambda: _adaptive("OneBitAdam")(betas="0.9"), "betas"),
    ("local", "ZeroOneAdam per-group var_freeze_step",
     lambda: _adaptive("ZeroOneAdam", per_group=True)(var_freeze_step=5), "var_freeze_step"),
    ("local", "CompressedAMSGrad per-group amsgrad='no'",
     lambda: _adaptive("CompressedAMSGrad", per_group=True)(amsgrad="no"), "amsgrad"),
    ("ddp", "ddp.register(optimizer=<another model's optimizer>)", lambda: _register(other_optimizer=True),
     "optimizer"),
    ("ddp", "ddp.register(optimizer=<not an optimizer>)", lambda: _register(optimizer=object()), "optimizer"),
]
#: the spec-string texts each argument is fed (what a command line gives), beside the Python values
SPEC_TEXTS = ("true", "false", "nan", "inf", "-inf", "-1", "0", "abc", "1e300")
LOCAL_SPECS = ("diloco", "sparseloco", "co2", "adaalter")


# ---- running the cases ---------------------------------------------------------------------------------
def classify(valid: bool, error: Optional[BaseException], words: List[str], accept_errors=()) -> Tuple[str, str]:
    """(outcome, message) of one case (see the module docstring)."""
    if error is not None and any(a in str(error) for a in accept_errors):
        error = None
    if error is None:
        return ("accepted" if valid else "silent"), ""
    msg = f"{type(error).__name__}: {error}"
    if valid:
        return "refused-valid", msg
    named = isinstance(error, (ValueError, TypeError)) and any(w.lower() in str(error).lower() for w in words)
    return ("clear" if named else "unclear"), msg


def _attempt(build, kwargs) -> Optional[BaseException]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(**kwargs)
    except Exception as exc:  # noqa: BLE001 - classified by the caller
        return exc
    return None


def run_case(name: str, arg: str, probe: Probe) -> Tuple[str, str]:
    ctor = CONSTRUCTORS[name]
    words = [arg, ctor.names.get(arg, arg)]
    return classify(probe.valid, _attempt(ctor.build, {**ctor.good, arg: probe.value}), words, ctor.accept_errors)


def _spec_valid(domain, text: str) -> bool:
    from hvdcomp.spec import _parse_value
    value = _parse_value(text)
    if isinstance(domain, Real):
        return not isinstance(value, bool) and isinstance(value, (int, float)) and domain.valid(float(value))
    if isinstance(domain, Int):
        return not isinstance(value, bool) and isinstance(value, int) and domain.valid(value)
    if isinstance(domain, Bool):
        return isinstance(value, bool)
    return value in domain.values


def spec_cases(group: str = "local"):
    """(label, valid, build) for every spec-string argument: ``name:arg=<text>`` for each text."""
    from hvdcomp import get_compressor
    from hvdcomp.local import from_spec
    for name, ctor in CONSTRUCTORS.items():
        if ctor.spec is None or ctor.group != group:
            continue
        for arg, domain in ctor.args.items():
            if isinstance(domain, Choice) and not all(isinstance(v, str) for v in domain.values):
                continue
            for text in SPEC_TEXTS + ((str(domain.good),) if isinstance(domain, (Real, Int)) else ()):
                spec = f"{ctor.spec}:{arg}={text}"
                if ctor.spec in LOCAL_SPECS:
                    def build(spec=spec, ctor=ctor):
                        import hvdcomp.local as local
                        m = _model()
                        inner = (local.AdaAlter(m.parameters()) if ctor.spec == "adaalter"
                                 else torch.optim.SGD(m.parameters(), lr=0.1))
                        good = {k: v for k, v in ctor.good.items() if f"{k}=" not in spec}
                        return from_spec(spec, inner, m.named_parameters(), **good)
                else:
                    def build(spec=spec):
                        return get_compressor(spec)
                yield name, arg, spec, _spec_valid(domain, text), build, [arg, ctor.names.get(arg, arg)], ctor.accept_errors


def sweep(group: str = "local") -> List[dict]:
    """Every case of ``group``: one record per case with its outcome."""
    out = []
    for name, ctor in CONSTRUCTORS.items():
        if ctor.group != group:
            continue
        for arg, domain in ctor.args.items():
            for p in probes(domain):
                outcome, msg = run_case(name, arg, p)
                out.append({"ctor": name, "arg": arg, "probe": p.label, "value": repr(p.value)[:40], "valid": p.valid,
                            "outcome": outcome, "message": msg[:300]})
    for name, arg, spec, valid, build, words, accept in spec_cases(group):
        outcome, msg = classify(valid, _attempt(build, {}), words, accept)
        out.append({"ctor": name, "arg": arg, "probe": "spec", "value": spec, "valid": valid, "outcome": outcome,
                    "message": msg[:300]})
    for g, label, build, expect in TABLE:
        if g != group:
            continue
        error = _attempt(lambda: build(), {})
        outcome = classify(False, error, [expect], NO_GROUP)[0]
        out.append({"ctor": "table", "arg": label, "probe": "table", "value": label, "valid": False,
                    "outcome": outcome, "message": "" if error is None else f"{type(error).__name__}: {error}"[:300]})
    return out


def counts(records: List[dict]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r in records:
        out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    return dict(sorted(out.items()))


def main(groups: List[str]) -> None:
    """Run ``groups`` (``mpi`` after ``hvd.init()``), print one JSON line of counts per group and
    each bad case; under mpirun only rank 0 prints."""
    if "mpi" in groups:
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
    else:
        rank = 0
    for group in groups:
        records = sweep(group)
        if rank == 0:
            print("COUNTS " + json.dumps({"group": group, **counts(records)}), flush=True)
            for r in records:
                if r["outcome"] in BAD:
                    print("BAD " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["local", "ddp"])
