"""The hierarchical allgather's results and per-rank byte counters, on simulated ranks (issue 29).

:class:`hvdcomp.comm.hierarchical.HierarchicalAllgatherer` runs unchanged on every simulated
rank (one thread each) over a fake mpi4py: communicators whose collectives meet at a rendezvous
in the test process (``Dup``, ``Split``, ``Igatherv``, ``Iallgatherv``, ``Ibcast``, with MPI's
argument layout). Each rank's ``bytes_sent`` / ``bytes_received`` must equal the closed form of
the module docstring, for several node layouts, in seconds and without mpirun:

* received, every rank: the counts header (p·t·8 bytes for t payload tensors) plus every rank's
  payload bytes (what the flat allgather receives);
* sent: the header t·8, plus a member's own payload bytes; a leader instead its node's bundle
  (the payload bytes of its node's ranks) to the other leaders, and, when its node holds
  several ranks, the whole result to them.
"""
import sys
import threading
import types

import numpy as np
import pytest
import torch

from tests.simworld import TIMEOUT_S, run_ranks

BYTE, UNDEFINED = "BYTE", -32766


class _Request:
    def Wait(self):
        return None

    def Test(self):
        return True


class _World:
    """Rendezvous for the collectives of simulated communicators (keyed by communicator id and
    call number)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.slots = {}
        self.ids = {}

    def meet(self, key, rank, size, value):
        with self.cv:
            slot = self.slots.setdefault(key, {})
            slot[rank] = value
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(slot) == size, timeout=TIMEOUT_S):
                raise TimeoutError(f"collective {key} incomplete: {sorted(slot)} of {size}")
            return [slot[r] for r in range(size)]

    def new_id(self, parent, call, color):
        """The same id on every member of a new communicator."""
        with self.cv:
            return self.ids.setdefault((parent, call, color), len(self.ids) + 1)


class FakeComm:
    """One rank's view of a communicator over ``members`` (global ranks, in rank order)."""

    def __init__(self, world, cid, members, me):
        self.world, self.cid, self.members, self.me = world, cid, list(members), me
        self.calls = 0

    def Get_rank(self):
        return self.members.index(self.me)

    def Get_size(self):
        return len(self.members)

    def _meet(self, value):
        self.calls += 1
        return self.world.meet((self.cid, self.calls), self.Get_rank(), self.Get_size(), value)

    def Dup(self):
        call = self.calls + 1
        self._meet(None)
        return FakeComm(self.world, self.world.new_id(self.cid, call, "dup"), self.members, self.me)

    def Split(self, color, key):
        call = self.calls + 1
        every = self._meet((color, key, self.me))
        if color == UNDEFINED:
            return None
        members = [g for c, k, g in sorted(every, key=lambda t: (t[1], t[2])) if c == color]
        return FakeComm(self.world, self.world.new_id(self.cid, call, color), members, self.me)

    def Igatherv(self, send, recv, root=0):
        every = self._meet(np.array(send, copy=True))
        if self.Get_rank() == root:
            buf, counts, displs, _ = recv
            for data, n, at in zip(every, counts, displs):
                assert data.size == n
                buf[at:at + n] = data
        return _Request()

    def Iallgatherv(self, send, recv):
        every = self._meet(np.array(send, copy=True))
        buf, counts, displs, _ = recv
        for data, n, at in zip(every, counts, displs):
            assert data.size == n
            buf[at:at + n] = data
        return _Request()

    def Ibcast(self, buf, root=0):
        every = self._meet(np.array(buf, copy=True) if self.Get_rank() == root else None)
        buf[:] = every[root]
        return _Request()


@pytest.fixture
def fake_mpi(monkeypatch):
    """mpi4py replaced by a module whose MPI has what the allgatherers use (no MPI_Init)."""
    mpi = types.SimpleNamespace(BYTE=BYTE, UNDEFINED=UNDEFINED, THREAD_MULTIPLE=3,
                                Query_thread=lambda: 0, COMM_NULL=None)
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return mpi


def payload_of(rank):
    """Per-rank payloads of different sizes and dtypes (some empty)."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(3 * rank, generator=g), torch.arange(rank + 1, dtype=torch.int32),
            torch.randn(0 if rank % 2 else 5, generator=g).half()]


def nbytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


LAYOUTS = {
    "one node": [0] * 5,
    "contiguous nodes of 2": [0, 0, 1, 1, 2],
    "interleaved": [0, 1, 0, 1, 0],
    "one rank per node": [0, 1, 2, 3, 4],
    "uneven, leader not first": [3, 3, 7, 3, 7, 9],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_counts_the_closed_form_and_gets_the_payloads_in_rank_order(fake_mpi, layout):
    from hvdcomp.comm.hierarchical import HierarchicalAllgatherer

    nodes = LAYOUTS[layout]
    size = len(nodes)
    world = _World()
    payloads = [payload_of(r) for r in range(size)]
    t = len(payloads[0])
    total = sum(nbytes(p) for p in payloads)

    def rank_fn(r):
        gatherer = HierarchicalAllgatherer(comm=FakeComm(world, 0, range(size), r), nodes=nodes, threaded=False)
        handle = gatherer.start(payloads[r], "sim")
        got = gatherer.finish(handle)
        return got, handle.bytes_sent, handle.bytes_received, gatherer.is_leader

    results = run_ranks(size, rank_fn)
    for r, (got, sent, received, leader) in enumerate(results):
        node = [q for q in range(size) if nodes[q] == nodes[r]]
        assert leader == (r == node[0])
        bundle = sum(nbytes(payloads[q]) for q in node)
        data = (bundle + (total if len(node) > 1 else 0)) if leader else nbytes(payloads[r])
        assert sent == t * 8 + data, (layout, r, sent, t * 8 + data)
        assert received == size * t * 8 + total, (layout, r, received)
        assert len(got) == size
        for q in range(size):
            for a, b in zip(got[q], payloads[q]):
                assert a.dtype == b.dtype and torch.equal(a, b), (layout, r, q)
