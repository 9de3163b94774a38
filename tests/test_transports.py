"""hvdcomp.transports on one process with a recording allgatherer: bucket order and flushing,
results against a hand-worked top-k, bytes counted (the optimizer's multi-rank behaviour is in
test_mpi_optimizer and test_recipes)."""
import re

import torch

import hvdcomp
import hvdcomp.transports
from hvdcomp.metrics import PhaseTimer
from hvdcomp.transports import AllgatherTransport, AllreduceTransport, Units, Wiring
import hvdcomp.compressors.base


class RecordingGatherer:
    """Allgather over ``ranks`` identical ranks: every rank sends what this one sends."""

    def __init__(self, ranks):
        self.ranks, self.calls = ranks, []

    def start(self, tensors, name):
        self.calls.append((name, [t.clone() for t in tensors]))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return type("H", (), {"tensors": self.calls[-1][1], "bytes_sent": nbytes,
                              "bytes_received": self.ranks * nbytes})()

    def finish(self, handle):
        return [handle.tensors] * self.ranks


class RecordingCompressor:
    """The compressor, with the order of its encode calls recorded (by unit name)."""

    def __init__(self, comp, names):
        self.comp, self.names, self.encoded = comp, names, []

    def encode(self, tensor, name, segments=None):
        self.encoded.append(self.names.index(name))
        return self.comp.encode(tensor, name, segments)

    def __getattr__(self, key):
        return getattr(self.comp, key)


def make(params, buckets):
    for p, g in zip(params, ([4.0, -1.0, 0.5, 3.0], [1.0, -2.0], [0.25, -8.0, 2.0, 1.0])):
        p.grad = torch.tensor(g)
    comp = hvdcomp.get_compressor("topk:density=0.5")
    comp.bind_group(2)
    units = Units(params, [[0], [1], [2]], ["a", "b", "c"], [None] * 3, "t")
    timer = PhaseTimer()
    recording = RecordingCompressor(comp, units.names)
    gatherer = RecordingGatherer(2)
    wiring = Wiring(None, timer, recording, units, "t", gatherer=gatherer, buckets=buckets)
    return AllgatherTransport(wiring), gatherer, timer, recording.encoded


def test_buckets_start_in_order_when_complete_and_a_flush_sends_the_rest():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 2, 4)]
    tr, gatherer, timer, encoded = make(params, [[0, 1], [2]])
    timer.begin_step()
    assert tr.bucket_of == [0, 0, 1] and not tr.busy
    tr.start(1)                      # bucket 0 still waits for unit 0
    assert gatherer.calls == [] and tr.busy
    tr.start(0)                      # bucket 0 complete: starts
    assert [c[0] for c in gatherer.calls] == ["t.bucket0"]
    tr.start(2)                      # unit 2 never reached backward: started by the flush
    assert [c[0] for c in gatherer.calls] == ["t.bucket0", "t.bucket1"] and encoded == [1, 0, 2]
    tr.finish()
    assert not tr.busy and tr.next_bucket == 0 and tr.waiting == [2, 1]
    # top-k keeps the 2 largest |g| of each 4-element gradient, 1 of the 2-element one; the mean
    # of two identical ranks is that selection
    assert params[0].grad.tolist() == [4.0, 0.0, 0.0, 3.0]
    assert params[1].grad.tolist() == [0.0, -2.0]
    assert params[2].grad.tolist() == [0.0, -8.0, 2.0, 0.0]
    step = timer.end_step()
    assert step["dense_bytes"] == 4 * (4 + 2 + 4)
    sent = sum(t.numel() * t.element_size() for _, ts in gatherer.calls for t in ts)
    assert step["bytes_sent"] == sent and step["bytes_received"] == 2 * sent


def test_reset_drops_a_step_in_progress():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 2, 4)]
    tr, gatherer, timer, _ = make(params, [[0, 1], [2]])
    tr.start(1)
    tr.reset()
    assert not tr.busy and tr.waiting == [2, 1] and tr.encoded == {}


def test_every_route_has_a_row_in_the_transports_table():
    """The package's table of routes (what a reader adding a transport starts from) names every
    route the planner hands out, except ``local`` (one rank: nothing travels)."""
    from hvdcomp.plan import route_names
    rows = re.findall(r"^``([a-z-]+)``\s", hvdcomp.transports.__doc__, re.M)
    assert sorted(rows) == sorted(set(route_names()) - {"local"})


class TwoIdenticalRanks:
    """A ``torch.distributed``-like group of two ranks that hold the same tensors (a sum is twice
    the tensor), recording every allreduce as ``(dtype, numel, in place)``."""

    size, rank, ordered = 2, 0, True

    def __init__(self):
        self.calls = []

    def allreduce_async_(self, t, name="", average=True, prescale=1.0, postscale=1.0):
        self.calls.append((t.dtype, t.numel(), True))
        t.mul_(prescale / self.size if average else prescale).mul_(2)
        return [t, postscale]

    def allreduce_async(self, t, name="", average=True, prescale=1.0, postscale=1.0):
        h = self.allreduce_async_(t.clone(), name, False, prescale, postscale / self.size if average else postscale)
        self.calls[-1] = self.calls[-1][:2] + (False,)
        return h

    def synchronize(self, h):
        h[0].mul_(h[1])
        h[1] = 1.0
        return h[0]


class HalfBFloat16:
    """A summable method whose payload is the first half of the gradient as bfloat16 and the
    second half as float32."""

    payload_kind, payload_is_gradient = hvdcomp.compressors.base.PayloadKind.MEAN, False

    def encode(self, t, name, segments=None):
        return [t[:2].to(torch.bfloat16), t[2:].clone()], None

    def decode_into(self, target, outputs, ctx):
        target[:2], target[2:] = outputs[0].float(), outputs[1]
        return target


def test_allreduce_buckets_reduce_one_collective_per_dtype_in_that_dtype():
    """The DDP hook's buckets through the allreduce transport (add_bucket): a bucket of two units
    whose payloads are bfloat16 + float32 goes out as one allreduce per dtype (2, not 4), bfloat16
    as bfloat16 (the Horovod front-end's units: one per payload tensor, bfloat16 as float32);
    the mean of two identical ranks is each gradient; a bucket of one gradient under ``none``
    is reduced where it lies, divided first (DDP's arithmetic)."""
    grads = ([1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 6.0, 7.0])
    for bucketed, expected in ((True, [(torch.bfloat16, 4, True), (torch.float32, 4, True)]),
                               (False, [(torch.float32, 2, False), (torch.float32, 2, False)] * 2)):
        params = [torch.nn.Parameter(torch.zeros(4)) for _ in grads]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        group = TwoIdenticalRanks()
        units = Units(params, [[0], [1]], ["a", "b"], [None] * 2, "t")
        group.ordered = bucketed  # (unit order is the launch order either way)
        tr = AllreduceTransport(Wiring(group, PhaseTimer(), HalfBFloat16(), units, "t"))
        if bucketed:
            tr.add_bucket([0, 1])
        tr.start(0)
        if bucketed:
            assert group.calls == []  # (a bucket waits for its last unit)
        tr.start(1)
        tr.finish()
        assert group.calls == expected, (bucketed, group.calls)
        assert [p.grad.tolist() for p in params] == list(grads)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([2.0, -4.0, 6.0])
    group, held = TwoIdenticalRanks(), p.grad
    units = Units([p], [[0]], ["w"], [None], "t")
    tr = AllreduceTransport(Wiring(group, PhaseTimer(), hvdcomp.get_compressor("none"), units, "t"))
    tr.add_bucket([0])
    tr.start(0)
    tr.finish()
    assert group.calls == [(torch.float32, 3, True)] and p.grad is held and p.grad.tolist() == [2.0, -4.0, 6.0]
