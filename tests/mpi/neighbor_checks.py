"""hvdcomp.transports.neighbor.NeighborTransport at any number of ranks (no Horovod).

Usage: mpirun -np N python tests/mpi/neighbor_checks.py

Per rank, against values computed from the senders' formulas: a ring with one payload for every
neighbour (sizes that differ per rank, an empty tensor, three dtypes); a star (rank 0 talks to
everyone, the others to rank 0 only: degrees N−1 and 1) with a different payload per edge; the
same on a sub-communicator of the even ranks (as a Horovod process set's); exact byte counts
(header 8·(1 + 2·tensors) + data per message: hvdcomp.comm.exchange.pack_payload).
"""
from mpi4py import MPI
import torch

from hvdcomp.transports.neighbor import NeighborTransport, message_bytes


def payload(sender, receiver=None):
    """What ``sender`` sends (to ``receiver``, for per-edge payloads): sizes depend on the sender."""
    tag = -1 if receiver is None else receiver
    return [torch.arange(sender + 1, dtype=torch.float32) + 100 * tag,
            torch.full((2 * sender + 3,), sender, dtype=torch.int32),
            torch.empty(0, dtype=torch.float64),
            torch.tensor([sender, tag], dtype=torch.int64)]


def nbytes(p):
    return message_bytes([t.numel() for t in p], [t.element_size() for t in p])


def check_on(comm, label):
    t = NeighborTransport(comm, timeout=30)
    r, n = t.rank, t.size
    # ring, one payload for all
    peers = sorted({(r - 1) % n, (r + 1) % n} - {r})
    got = t.exchange(payload(r), peers)
    assert sorted(got) == peers, (label, got.keys())
    for j in peers:
        for a, b in zip(got[j], payload(j)):
            assert a.dtype == b.dtype and torch.equal(a, b), (label, j)
    sent = len(peers) * nbytes(payload(r))
    received = sum(nbytes(payload(j)) for j in peers)
    assert (t.bytes_sent, t.bytes_received) == (sent, received), (label, t.bytes_sent, sent)
    # star, one payload per edge, started twice before finishing (order kept)
    peers = list(range(1, n)) if r == 0 else ([0] if n > 1 else [])
    h1 = t.post({j: payload(r, j) for j in peers}, peers)
    h2 = t.post({j: payload(r + 10, j) for j in peers}, peers)
    assert t.busy
    got1, got2 = t.wait(h1), t.wait(h2)
    assert not t.busy
    for j in peers:
        for a, b in zip(got1[j], payload(j, r)):
            assert torch.equal(a, b), (label, "star", j)
        for a, b in zip(got2[j], payload(j + 10, r)):
            assert torch.equal(a, b), (label, "star2", j)
    assert h1.bytes_sent == sum(nbytes(payload(r, j)) for j in peers)
    assert h1.bytes_received == sum(nbytes(payload(j, r)) for j in peers)
    t.close()


world = MPI.COMM_WORLD
check_on(world, "world")
even = world.Split(world.Get_rank() % 2, world.Get_rank())
if world.Get_rank() % 2 == 0:
    check_on(even, "even ranks")
print(f"OK neighbor rank {world.Get_rank()} of {world.Get_size()}", flush=True)
