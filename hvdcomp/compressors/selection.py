"""Index selection for the top-k-like sparsifiers (``topk``, ``dgc``): one place for the logic.

:func:`exact_topk`: exactly the k largest magnitudes (the set of ``torch.topk``; O(n) on CPU with
the native kernels by a sampled threshold and a linear-time selection). :func:`sampled_threshold_topk`:
DGC's sampled threshold (Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression", ICLR 2018),
about k entries (0.8k to 1.3k). Indices come out int64 and ascending; NaN never passes a
threshold. The scan (:func:`indices_at_least`) builds no full-size temporary on CPU and
synchronises with the host once per scan on CUDA. In full: docs/kernels.md, "Top-k selection".
"""
from __future__ import annotations

import math

import torch

from .. import native
from ..checks import check_choice, check_range

__all__ = [
    "CPU_CHUNK",
    "EXACT_MIN_NUMEL",
    "MIN_SAMPLE",
    "SELECT_CHOICES",
    "check_sample_ratio",
    "check_select",
    "exact_topk",
    "indices_at_least",
    "sample_draws",
    "sample_positions",
    "sampled_threshold_topk",
    "select_segments",
]

#: Valid values of the ``select`` option of :class:`hvdcomp.compressors.TopKCompressor`.
SELECT_CHOICES = ("exact", "sample")
#: Tensors whose sample would hold fewer entries than this use :func:`exact_topk`.
MIN_SAMPLE = 64
#: Elements per chunk of the CPU scan (4 MiB of float32: stays in the last-level cache).
CPU_CHUNK = 1 << 20
#: Smallest tensor for which :func:`exact_topk` uses the threshold path (below: ``torch.topk``).
EXACT_MIN_NUMEL = 1 << 15
#: Evenly spaced entries sampled by the threshold path of :func:`exact_topk`: this fraction of n,
#: at least EXACT_MIN_SAMPLE.
EXACT_SAMPLE_RATIO, EXACT_MIN_SAMPLE = 0.01, 4096
#: DGC's acceptance window [LOW·k, HIGH·k] and the factor applied to the threshold on a retry.
LOW, HIGH, DECAY = 0.8, 1.3, 0.8


def check_select(select) -> str:
    """Validate a ``select`` option; raises ``ValueError`` naming the valid choices."""
    return check_choice(select, "select", SELECT_CHOICES, " (e.g. 'topk:density=0.01,select=sample')")


def check_sample_ratio(sample_ratio) -> float:
    """Validate the sampled fraction; raises ``ValueError`` unless ``0 < sample_ratio <= 1``."""
    return check_range(sample_ratio, "sample_ratio", 0.0, 1.0, low_open=True, hint=" (e.g. sample_ratio=0.01)")


def _empty_index(device) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long, device=device)


def exact_topk(flat: torch.Tensor, k: int, *, magnitudes: bool = True) -> torch.Tensor:
    """Indices (int64, 1-D, ascending) of the k entries of largest magnitude (docs/kernels.md, "Top-k selection").

    Args:
        flat: 1-D tensor of n elements; magnitudes (>= 0) when ``magnitudes``, else signed values
            whose absolute values are ranked.
        k: how many to keep; ``k >= n`` returns ``arange(n)``, ``k <= 0`` an empty tensor.
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if k <= 0:
        return _empty_index(flat.device)
    if n >= EXACT_MIN_NUMEL and _native_scan(flat):
        idx = _exact_topk_threshold(flat, k, magnitudes)
        if idx is not None:
            return idx
    top = torch.topk(flat if magnitudes else flat.abs(), k, sorted=False).indices
    return torch.sort(top).values


def _native_scan(flat: torch.Tensor) -> bool:
    return flat.dtype == torch.float32 and flat.is_contiguous() and native.usable(flat)


def _exact_topk_threshold(flat: torch.Tensor, k: int, magnitudes: bool):
    """The threshold path of :func:`exact_topk` (native CPU scan); None if it cannot find k
    candidates (NaN in the sample or the data), then the caller uses ``torch.topk``."""
    n = flat.numel()
    stride = max(1, n // max(EXACT_MIN_SAMPLE, math.ceil(EXACT_SAMPLE_RATIO * n)))
    sample = flat[::stride].abs()                          # evenly spaced: a strided view, copied
    s = sample.numel()
    # rank of the threshold in the sample: k/n·s plus 3 binomial sigmas (fewer than k pass ~0.1 %
    # of the time; then the rank is doubled)
    expect = k / n * s
    rank = min(s, math.ceil(expect + 3.0 * math.sqrt(expect) + 8))
    while True:
        thr = float(torch.topk(sample, rank, sorted=False).values.min())  # rank-th largest sampled
        if thr != thr:
            return None
        idx, vals = native.select_at_least(flat, thr, not magnitudes, values=True)
        total = idx.numel()
        if total >= k:
            break
        if rank == s:
            return None
        rank = min(s, 2 * rank)
    if total == k:
        return idx
    mag = vals if magnitudes else vals.abs()
    t = float(torch.kthvalue(mag, total - k + 1).values)   # the k-th largest magnitude
    return native.keep_top(vals, idx, t, k, not magnitudes)


def _set_bytes(mask: torch.Tensor, length: int) -> torch.Tensor:
    """Ascending int64 positions of the True entries of ``mask[:length]``.

    ``mask`` is a contiguous bool buffer of at least ``length`` rounded up to a multiple of 8,
    starting at a multiple of 8 bytes; the padding is cleared here. The words (8 bytes) holding a
    True entry are found first, then the bytes within those words: two ``nonzero`` over n/8 + 8m
    elements instead of one over n.
    """
    padded = (length + 7) // 8 * 8
    if padded != length:
        mask[length:padded] = False
    words = mask[:padded].view(torch.int64)
    hit = torch.nonzero(words).view(-1)
    sub = torch.nonzero(words.index_select(0, hit).view(torch.uint8)).view(-1)
    return hit.index_select(0, sub >> 3).mul_(8).add_(sub & 7)


def indices_at_least(flat: torch.Tensor, thr: torch.Tensor, *, magnitudes: bool = True,
                     chunk: int = CPU_CHUNK, chunked=None) -> torch.Tensor:
    """Ascending int64 indices i with ``flat[i] >= thr`` (``|flat[i]| >= thr`` if not ``magnitudes``).

    Equals ``torch.nonzero(mag >= thr).view(-1)`` (NaN never passes), without a full-size
    temporary on CPU (docs/kernels.md, "Top-k selection").

    Args:
        flat: 1-D tensor of n elements.
        thr: threshold, a 0-d tensor on ``flat``'s device (or a Python number).
        chunk: elements per chunk of the torch CPU scan; the native fused scan (used by default on
            CPU for contiguous float32 input) has its own fixed parts, so giving another value
            than :data:`CPU_CHUNK` selects the torch scan (tests compare the two).
        chunked: force the chunked CPU scan (True) or the one-``nonzero`` device path (False);
            default: chunked on CPU only (tests run the device path on CPU with False).
    """
    n = flat.numel()
    if chunked is None:
        chunked = flat.device.type == "cpu"
    if not chunked:
        return torch.nonzero((flat if magnitudes else flat.abs()) >= thr).view(-1)
    if n == 0:
        return _empty_index(flat.device)
    if chunk == CPU_CHUNK and _native_scan(flat):
        return native.select_at_least(flat, float(thr), not magnitudes)
    size = min(n, chunk)
    buf = torch.empty(size, dtype=flat.dtype)       # |x| of the chunk, then its 1.0 / 0.0 flags
    mask = torch.empty((size + 7) // 8 * 8, dtype=torch.bool)
    parts = []
    for start in range(0, n, chunk):
        part = flat[start:start + chunk]
        length = part.numel()
        flags = buf[:length]
        if not magnitudes:
            part = torch.abs(part, out=flags)
        # compare into the float buffer, then convert: both vectorised, unlike a bool-output compare
        torch.ge(part, thr, out=flags)
        mask[:length].copy_(flags)
        found = _set_bytes(mask, length)
        if start:
            found += start
        parts.append(found)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def sample_positions(n: int, k: int, sample_ratio: float, generator, device=None,
                     min_sample: int = MIN_SAMPLE):
    """The positions :func:`sampled_threshold_topk` samples for a tensor of ``n`` elements and
    target ``k``: ``ceil(sample_ratio·n)`` draws in [0, n) from ``generator`` (a
    ``torch.Generator`` or :class:`~hvdcomp.compressors.rng.RankGenerators`), or None (nothing
    drawn) where it takes the whole tensor or the exact top-k instead."""
    device = torch.device("cpu") if device is None else torch.device(device)
    return sample_draws(generator, [(n, device)], lambda _: k, sample_ratio, min_sample)[0]


def sample_draws(generator, items, kept, sample_ratio: float, min_sample: int = MIN_SAMPLE,
                 counts=None) -> list:
    """:func:`sample_positions` of each ``(n, device)`` in ``items`` (target ``kept(n)``), in
    order; ``counts``: a dict caching each n's sample count (0: nothing drawn)."""
    counts = {} if counts is None else counts
    out = []
    for n, device in items:
        s = counts.get(n)
        if s is None:
            k = kept(n)
            s = counts[n] = 0 if (k >= n or k <= 0 or math.ceil(sample_ratio * n) < min_sample) \
                else math.ceil(sample_ratio * n)
        if not s:
            out.append(None)
            continue
        gen = generator if isinstance(generator, torch.Generator) else generator.get(device)
        out.append(torch.randint(0, n, (s,), generator=gen, device=device))
    return out


def sampled_threshold_topk(flat: torch.Tensor, k: int, sample_ratio: float,
                           generator, *, magnitudes: bool = True,
                           min_sample: int = MIN_SAMPLE, max_tries: int = 10,
                           positions: torch.Tensor = None) -> torch.Tensor:
    """Indices (int64, 1-D) of about k entries of largest magnitude, by DGC's sampled threshold.

    Args:
        flat: 1-D tensor of n elements; magnitudes (>= 0) when ``magnitudes``, else signed values
            (their magnitudes are taken chunk by chunk: no full-size ``|flat|`` is built).
        k: target count, 0 < k <= n (``k >= n`` returns ``arange(n)``).
        sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1].
        generator: a ``torch.Generator`` on ``flat``'s device type, or a
            :class:`~hvdcomp.compressors.rng.RankGenerators` (its generator for that device is
            created only when a sample is drawn). ``ceil(sample_ratio·n)`` positions are drawn
            from it and nothing else is, so the result is reproducible and checkpointable.
        min_sample: below this many samples the exact top-k is used instead (no draw).
        max_tries: scans before giving up lowering the threshold.
        positions: the sampled positions, drawn beforehand (:func:`sample_positions`, e.g. in
            the order of one call per gradient); ``generator`` is then not used.

    Returns:
        Every index whose magnitude is at least the final threshold, in ascending order, when
        between 0.8k and 1.3k of them pass; exactly k indices (the top k of the candidates,
        ascending) when more pass or for small tensors; fewer than 0.8k only if ``max_tries``
        scans all fall short (the last scan's indices; e.g. NaN in the sample).
    """
    n = flat.numel()
    samples = math.ceil(sample_ratio * n)
    if k >= n:
        return torch.arange(n, device=flat.device)
    if samples < min_sample or k <= 0:
        return exact_topk(flat, k, magnitudes=magnitudes)
    pos = positions if positions is not None else sample_positions(n, k, sample_ratio, generator, flat.device,
                                                                   min_sample)
    # index_select, not flat[pos]: the same values, several times faster for a random gather on CPU
    sampled = flat.index_select(0, pos)
    if not magnitudes:
        sampled.abs_()
    ks = max(1, math.ceil(k / n * samples))
    thr = torch.topk(sampled, ks, sorted=False).values.min()
    idx = _empty_index(flat.device)
    for _ in range(max_tries):
        idx = indices_at_least(flat, thr, magnitudes=magnitudes)
        count = idx.numel()
        if count > HIGH * k:
            cand = flat.index_select(0, idx)
            if not magnitudes:
                cand.abs_()
            keep = torch.zeros(count, dtype=torch.bool, device=idx.device)
            keep[torch.topk(cand, k, sorted=False).indices] = True
            return idx[keep]                              # ascending, like every other result
        if count >= LOW * k:
            return idx
        thr = thr * DECAY
    return idx


def select_segments(flat: torch.Tensor, segments, kept, sample_ratio=None, draws=None,
                    min_sample: int = MIN_SAMPLE, key=None) -> torch.Tensor:
    """Each segment's selection, as one call per segment would make it: ascending int64 indices
    into ``flat``.

    Args:
        flat: 1-D tensor holding the segments (signed values: magnitudes are ranked).
        segments: a :class:`hvdcomp.compressors.segments.Segments`.
        kept: ``kept(n) -> k``, the target count of a segment of n elements.
        sample_ratio: None for :func:`exact_topk` of every segment; else
            :func:`sampled_threshold_topk` with this ratio and ``min_sample`` (which falls back
            to :func:`exact_topk` below ``min_sample`` samples), each sampled segment ``j`` with
            the positions ``draws[j]`` (:func:`sample_positions`).
        key: a hashable value that determines ``kept`` (e.g. the density): how each segment is
            selected is then decided once and cached on ``segments``.
    """
    def plan(seg):
        def how(n: int) -> str:
            k = kept(n)
            if k >= n:
                return "all"
            if sample_ratio is not None and math.ceil(sample_ratio * n) >= min_sample:
                return "sample"
            return "large" if n >= EXACT_MIN_NUMEL else "rows"
        sampled = [(j, start, n, kept(n)) for j, (n, start) in enumerate(zip(seg.sizes, seg.offsets))
                   if n and how(n) == "sample"]
        classes = [(how(n), n, kept(n), positions, starts)
                   for n, positions, _, starts in seg.size_classes(flat.device)]
        return sampled, [c for c in classes if c[0] != "sample"]

    if key is None:
        sampled, classes = plan(segments)
    else:
        sampled, classes = segments.cached(("select", key, sample_ratio, min_sample, flat.device), plan)
    picked, mags = [], None
    for j, start, n, k in sampled:
        picked.append(sampled_threshold_topk(flat[start:start + n], k, sample_ratio, None, magnitudes=False,
                                             min_sample=min_sample, positions=draws[j]) + start)
    for way, n, k, positions, starts in classes:
        if way == "all":
            picked.append((torch.arange(n, device=flat.device).expand(len(positions), n) + starts).reshape(-1))
        elif way == "large":  # the O(n) threshold kernel, per segment
            picked += [exact_topk(flat[o:o + n], k, magnitudes=False) + o
                       for o in (segments.offsets[j] for j in positions)]
        else:
            mags = flat.abs() if mags is None else mags
            rows = segments.rows(mags, positions, n)
            picked.append((rows.topk(k, dim=1, sorted=False).indices + starts).reshape(-1))
    if not picked:
        return _empty_index(flat.device)
    return torch.cat(picked).sort().values
