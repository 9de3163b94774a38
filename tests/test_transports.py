"""hvdcomp.transports on one process with a recording allgatherer: bucket order and flushing,
results against a hand-worked top-k, bytes counted (the optimizer's multi-rank behaviour is in
test_mpi_optimizer and test_recipes)."""
import re

import torch

import hvdcomp
import hvdcomp.transports
from hvdcomp.metrics import PhaseTimer
from hvdcomp.transports import AllgatherTransport, Units, Wiring


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
