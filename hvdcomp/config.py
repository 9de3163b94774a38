"""The settings of one :class:`hvdcomp.DistributedOptimizer`: one frozen, validated dataclass,
and the part of them every rank must share (:meth:`Settings.signature`)."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from .agreement import NONFINITE_MODES
from .checks import check_bool, check_choice, check_count, check_range
from .comm.costmodel import CostModel
from .compressors.fp16 import FP16Compressor
from .compressors.none import NoneCompressor
from .spec import resolve_compression

__all__ = ["Settings", "DEFAULT_BUCKET_BYTES", "OPTIMIZER_ENV", "GRANULARITIES", "TRANSPORT_CHOICES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # as PyTorch DDP's bucket_cap_mb=25
OPTIMIZER_ENV = ("HVDCOMP_ALLGATHER",)  # environment overrides that must agree across ranks
GRANULARITIES = ("tensor", "bucket")
TRANSPORT_CHOICES = ("planned", "auto")


#: the ``Args:`` section of :func:`hvdcomp.DistributedOptimizer`'s docstring: what each setting means
ARGUMENTS_DOC = """    Args:
        optimizer: any ``torch.optim.Optimizer`` (its state is not carried over, as in Horovod).
        named_parameters: ``model.named_parameters()``; names key compressor state and must be
            the same on every rank. Two optimizers may use the same names (e.g. a GAN's G and D).
            Without it parameters are named by position.
        compression: an :class:`hvdcomp.Compressor`, a spec such as ``"topk:density=0.01"``, or
            ``hvd.Compression.none`` / ``hvd.Compression.fp16``. One compressor per optimizer.
        backward_passes_per_step: backward passes accumulated locally before communicating.
        op: ``hvd.Average`` (default) or ``hvd.Sum`` (the sum over ranks, for every method).
            ``hvd.Adasum`` combines parameter deltas: with ``none`` or ``fp16`` (no error
            feedback) this returns stock Horovod's own Adasum optimizer (stock's results bit for
            bit; hvdcomp's keyword-only arguments do not apply); other methods are refused.
        gradient_predivide_factor: as Horovod: ``MEAN`` payloads are divided by it before the
            allreduce and multiplied by it / size after (``op=Average`` only). Allgathered
            payloads are averaged in float32 locally, where it changes nothing.
        num_groups: deprecated Horovod alias of ``groups`` (an int).
        groups: as Horovod: an int k (gradients in k groups) or a list of lists of parameters
            fused together; for allgathered payloads each group is one bucket (``bucket_bytes``
            is then not used). Results do not depend on it.
        sparse_as_dense: accepted for compatibility; sparse gradients (``Embedding(sparse=True)``)
            are always made dense before compression, as Horovod does with ``True``.
        process_set: a Horovod ``ProcessSet``: gradients are averaged over its ranks only, and
            every collective of the optimizer and its compressor stays inside it; processes
            outside it train locally (as Horovod).
        allgather: the variable-size allgather of gathered payloads: ``"auto"`` (mpi4py
            ``Allgatherv`` under MPI, Horovod allgather otherwise), ``"mpi4py"``,
            ``"hierarchical"`` (mpi4py, node-aware: gathered inside each node, exchanged between
            node leaders, broadcast back; same results), ``"horovod"``, or an
            :class:`hvdcomp.comm.allgatherv.Allgatherer` instance over the process set's ranks.
        timer: a :class:`hvdcomp.metrics.PhaseTimer` to record into (a new one by default;
            available as ``optimizer.timer``).
        nonfinite: what a NaN/Inf gradient on any rank does: ``"skip"`` (default: every rank
            skips the step; compressor state stays as before it; every ``.grad`` reads NaN so a
            ``GradScaler`` sees the overflow), ``"raise"`` (``FloatingPointError`` on every rank)
            or ``"ignore"`` (no check and no per-step agreement). **This is where hvdcomp
            differs from stock Horovod on purpose**: stock applies a non-finite step (NaN/Inf
            reach the parameters), the default ``"skip"`` leaves the parameters as they were;
            ``nonfinite="ignore"`` reproduces stock's behaviour (with ``none``, bit for bit).
        check_consistency: at construction, verify (one allgather) that every rank has the same
            settings and parameter list (names, shapes, dtypes, order).
        bucket_bytes: bytes of dense gradient per allgather bucket (default 25 MiB, as DDP).
        cost_model: how payloads that need an allgather choose between allgather and
            allreduce of their local decode, per gradient: ``"measure"`` (default: α and β timed
            with a few allgathers at construction), ``"off"`` (always allgather), a
            :class:`hvdcomp.comm.costmodel.CostModel` or an ``(alpha_seconds,
            beta_seconds_per_byte)`` pair. Only compressors whose ``aggregate`` is the mean of
            ``decode`` are routed; the result is the same either way.
        grad_scaler: the ``torch.amp.GradScaler`` of an AMP loop, so that compressor state kept
            in gradient units follows loss-scale changes; found automatically when omitted (see
            :mod:`hvdcomp.amp`).
        granularity: what the compressor sees as one tensor: ``"tensor"`` (default: each
            gradient, as the methods' papers do) or ``"bucket"`` (as PyTorch DDP's comm hooks:
            consecutive gradients of one dtype, up to ``bucket_bytes`` or one Horovod ``group``,
            compressed as one flat tensor with state per bucket, named ``bucket<k>``: top-k then
            keeps the largest entries of the bucket, not of each layer). Refused for PowerSGD (it
            needs each gradient's matrix shape).
        fuse_tensors: with ``granularity="tensor"`` and a method that can
            (:func:`hvdcomp.plan.fuses`; ``docs/fused-compression.md``), the gradients of one
            bucket are compressed in one vectorised call, each still by its own rules: the same
            results as one call per gradient, and one payload per bucket on the wire. ``False``:
            one call and one payload per gradient, each sent as soon as backward produced it.
        transport: ``"planned"`` (default: the method's own transport, routed as above) or
            ``"auto"``: the cost model first picks, among the transports that carry the same kind
            of compression, the one with the least predicted communication per step
            (:func:`hvdcomp.plan.choose_transport`; e.g. top-k by allgather, ``gtopk`` or
            ``cltk``); ``optimizer.transport.choice`` holds every candidate's predicted seconds.
"""


@dataclass(frozen=True)
class Settings:
    """Every setting of the optimizer, validated (see :func:`hvdcomp.DistributedOptimizer` for
    what each one means). Build it with :meth:`validate`.

    ``op`` is Horovod's ``hvd.Average`` or ``hvd.Sum`` (``"average"`` / ``"sum"`` without
    Horovod), ``op_sum`` whether it is the sum; ``groups`` Horovod's (an int, a list of lists of
    parameters, or None); ``cost_model`` ``"measure"``, ``"off"`` or a
    :class:`hvdcomp.comm.costmodel.CostModel`.
    """

    backward_passes_per_step: int
    op: Any
    gradient_predivide_factor: float
    groups: Any
    sparse_as_dense: bool
    process_set: Any
    allgather: Any
    timer: Any
    nonfinite: str
    check_consistency: bool
    bucket_bytes: int
    cost_model: Any
    grad_scaler: Any
    granularity: str
    fuse_tensors: bool
    transport: str
    op_sum: bool = False

    @classmethod
    def validate(cls, hvd, *, backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, sparse_as_dense=False, process_set=None, allgather="auto",
                 timer=None, nonfinite="skip", check_consistency=True, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 cost_model="measure", grad_scaler=None, granularity="tensor", fuse_tensors=True,
                 transport="planned") -> "Settings":
        """Check every argument and normalise it (``op`` None → Average, a cost-model pair → a
        :class:`CostModel`, ``num_groups`` → ``groups``). ``hvd``: ``horovod.torch``, or None
        where no Horovod runs (``op`` then ``"average"`` or ``"sum"``).

        Raises:
            ValueError: as :func:`hvdcomp.DistributedOptimizer` documents (each message names
                the fix).
        """
        backward_passes_per_step = check_count(backward_passes_per_step, "backward_passes_per_step", 1)
        check_choice(nonfinite, "nonfinite", NONFINITE_MODES)
        average, total = (hvd.Average, hvd.Sum) if hvd is not None else ("average", "sum")
        op = average if op is None else op
        if op not in (average, total):  # (hvd.Adasum is handed to stock Horovod before this)
            raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}" if hvd is not None
                             else f"op must be 'average' or 'sum', got {op!r}")
        gradient_predivide_factor = check_range(gradient_predivide_factor, "gradient_predivide_factor", 0.0,
                                                low_open=True)
        if gradient_predivide_factor != 1.0 and op is not average:
            raise ValueError("gradient_predivide_factor not supported with op != Average (as in Horovod)")
        if num_groups:
            warnings.warn("num_groups has been replaced by groups (as in Horovod)", DeprecationWarning)
            groups = num_groups if groups is None else groups
        if groups is not None and not isinstance(groups, list):
            groups = check_count(groups, "groups", 1, " (or a list of lists of the model's parameters)")
        if isinstance(groups, list) and any(not isinstance(p, torch.Tensor) for g in groups for p in g):
            raise ValueError("groups must consist of torch.Tensor (lists of the model's parameters)")
        check_choice(granularity, "granularity", GRANULARITIES)
        bucket_bytes = check_count(bucket_bytes, "bucket_bytes", 1, " (bytes, e.g. 25 * 2**20)")
        sparse_as_dense = check_bool(sparse_as_dense, "sparse_as_dense")
        check_consistency = check_bool(check_consistency, "check_consistency")
        fuse_tensors = check_bool(fuse_tensors, "fuse_tensors")
        if not (cost_model in ("measure", "off") or isinstance(cost_model, CostModel)
                or (isinstance(cost_model, (tuple, list)) and len(cost_model) == 2)):
            raise ValueError("cost_model must be 'measure', 'off', a CostModel or an (alpha_seconds, "
                             f"beta_seconds_per_byte) pair; got {cost_model!r}")
        if isinstance(cost_model, (tuple, list)):
            cost_model = CostModel(float(cost_model[0]), float(cost_model[1]))  # ValueError if out of range
        check_choice(transport, "transport", TRANSPORT_CHOICES)
        if transport == "auto" and cost_model == "off":
            raise ValueError("transport='auto' lets the cost model choose: give cost_model='measure' (default) "
                             "or (alpha_seconds, beta_seconds_per_byte), not 'off'")
        return cls(backward_passes_per_step, op, gradient_predivide_factor, groups, sparse_as_dense,
                   process_set, allgather, timer, nonfinite, check_consistency, bucket_bytes, cost_model,
                   grad_scaler, granularity, fuse_tensors, transport, op is total)

    def signature(self, compression, names: dict, order, prefix: str, backward_passes_per_step: Optional[int] = None
                  ) -> dict:
        """Everything that must be identical on every rank (compared at construction): these
        settings, the method, the parameter list (names, shapes, dtypes, order), the environment
        overrides and the optimizer's creation index ``prefix``."""
        cost, groups, allgather = self.cost_model, self.groups, self.allgather
        if not isinstance(allgather, str):  # (an injected allgatherer: by its kind)
            allgather = getattr(allgather, "kind", "custom")
        return {"compression": {"class": type(compression).__name__, **compression.describe()},
                "backward_passes_per_step": backward_passes_per_step or self.backward_passes_per_step,
                "op": str(self.op), "gradient_predivide_factor": self.gradient_predivide_factor,
                "sparse_as_dense": self.sparse_as_dense, "nonfinite": self.nonfinite,
                "bucket_bytes": self.bucket_bytes, "allgather": allgather,
                "granularity": self.granularity, "fuse_tensors": self.fuse_tensors,
                "transport": self.transport,
                "cost_model": (cost.alpha, cost.beta) if isinstance(cost, CostModel) else cost,
                "groups": groups if not isinstance(groups, list) else [[names.get(p) for p in g] for g in groups],
                "environment": {k: os.environ.get(k) for k in OPTIMIZER_ENV},
                "optimizer_index": prefix,
                "parameters": [(names[p], tuple(p.shape), str(p.dtype)) for p in order]}


def name_parameters(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    """Parameter → name (``param.<i>`` by position without ``named_parameters``).

    Raises:
        ValueError: not (name, parameter) tuples, repeated names, or a parameter left unnamed.
    """
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(all_params)}
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique; repeated: {dups}")
    by_param = {p: n for n, p in named}
    missing = [i for i, p in enumerate(all_params) if p not in by_param]
    if missing:
        raise ValueError(f"named_parameters does not name optimizer parameter(s) at position(s) "
                         f"{missing[:10]}; pass model.named_parameters() of the model whose "
                         "parameters the optimizer holds")
    return {p: by_param[p] for p in all_params}


def check_method(compression, optimizer, granularity: str) -> None:
    """Combinations of a method with the optimizer's settings that cannot work.

    Args:
        optimizer: the wrapped ``torch.optim.Optimizer``, or None (only ``granularity`` is checked).

    Raises:
        ValueError: ``granularity="bucket"`` with a method that needs each gradient's matrix shape
            (PowerSGD); a method that applies momentum itself (DGC) with an optimizer that also
            does.
    """
    if granularity == "bucket" and getattr(compression, "needs_shapes", False):
        raise ValueError(f"granularity='bucket' flattens gradients, but '{compression.name}' needs "
                         "each gradient's matrix shape: use granularity='tensor'")
    if compression.owns_momentum and optimizer is not None:
        for group in optimizer.param_groups:
            beta = group.get("momentum", 0.0) or (group.get("betas") or (0.0,))[0]
            if beta:
                raise ValueError(
                    f"'{compression.name}' applies momentum itself (momentum correction), but the "
                    f"optimizer also applies momentum {beta}: momentum would be applied twice. Create "
                    "the optimizer without momentum, e.g. torch.optim.SGD(params, lr=..., momentum=0).")


#: methods ``op=hvd.Adasum`` runs with (as stock Horovod's Adasum optimizer)
ADASUM_METHODS = ("none", "fp16")


def adasum_compression(compression, hvd):
    """Horovod's own compression for ``op=hvd.Adasum`` (stock's Adasum optimizer compresses
    parameter deltas): ``none`` and ``fp16`` (spec, hvdcomp compressor without error feedback, or
    ``hvd.Compression.none`` / ``fp16``).

    Raises:
        ValueError: any other method, naming the supported ones.
    """
    if compression in (hvd.Compression.none, hvd.Compression.fp16):
        return compression
    comp = resolve_compression(compression)
    if type(comp) is NoneCompressor:
        return hvd.Compression.none
    if type(comp) is FP16Compressor:
        return hvd.Compression.fp16
    raise ValueError(f"op=hvd.Adasum combines parameter deltas (Horovod's Adasum optimizer), which "
                     f"'{comp.name}' ({comp.describe()}) does not compress; Adasum runs with compression "
                     f"{' or '.join(repr(m) for m in ADASUM_METHODS)} (without error feedback). Use "
                     "op=hvd.Average (or hvd.Sum) for other methods.")
