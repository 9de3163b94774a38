"""Native CPU kernels of the compressors: a small C library (OpenMP), built by the installer.

Why native code: on CPU, eager torch cannot reach the kernel targets of issue 16 (encode ≤ 8×,
decode ≤ 3× a streaming pass for the quantizers): drawing the stochastic-rounding uniforms alone
costs 6–11 streaming passes with torch's CPU generator, and every eager op is a separate pass over
memory with its own temporary. ``torch.compile`` (inductor, C++/OpenMP) was measured too: QSGD's
encode at 4M elements took 9.2× a stream after 19.6 s of compilation (plus ~3 s per new shape),
in every process; the C kernels here take 1–2 s to build once at install time (README, "Kernels").

What is here (``hvdcomp/native/*.c``; each function documents its exact semantics):

* ``quantize.c``: QSGD encode (per-bucket scale, stochastic rounding, packing: one read of the
  input, blocks of buckets in cache) and decode/aggregate (unpack + scale multiply fused, every
  output element written once for W payloads); TernGrad moments, encode and aggregate.
* ``sign.c``: sign bits (+ Σ|x| for EF-signSGD) in one pass, ±1 votes, scaled-sign aggregate
  and in-place residual, majority vote.
* every per-tensor kernel above that a fused bucket needs (:mod:`hvdcomp.compressors.segments`)
  also has a *segmented* form (``*_segments``): the same kernel on each of several tensors laid
  back to back in one buffer, in one call, each tensor split into the work units (and random
  streams) it would have alone, so that the results are bit for bit those of one call per tensor.
* ``sparse.c``: fused threshold-and-compact scan (count pass + write pass over fixed parts of the
  tensor: ascending indices, values gathered on the way), and the scatter-add of W sparse or dense
  payloads chunk by chunk (each output element written once).

Random numbers for stochastic rounding come from four xoshiro128++ streams per work unit (SSE2
lanes, 24 bits per element), seeded with SplitMix64 from a 64-bit key and the unit's first element
(``common.h``), and the key is drawn from the method's
per-rank ``torch.Generator`` (:meth:`hvdcomp.compressors.rng.RankGenerators.key`), so one call
costs one draw of that generator: the generator state stays the only state, checkpointable as
before, and results do not depend on the number of threads.

Use: every wrapper below takes CPU tensors (float32 and contiguous where it says so) and calls the
library with ``torch.get_num_threads()`` threads, but no more than one per 8192 elements (a tensor
that small runs on the calling thread alone). Compressors call :func:`usable` first and fall
back to their vectorised torch kernels (also the CUDA path) when it returns False.

Control:

* ``HVDCOMP_NATIVE=0`` in the environment (or :func:`set_enabled`\\ (False)) turns the native
  kernels off; results then come from the torch kernels (same distributions, other random draws).
* The library is built by ``scripts/install.sh`` (``python -m hvdcomp.native --build``) into
  ``hvdcomp/native/build/``; if it is missing on first use it is built there (or in
  ``~/.cache/hvdcomp/native`` when the package directory is read-only) with ``$CC`` (default
  ``cc``), in about a second. A build failure is logged once and the torch kernels are used.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import List, Optional, Sequence

import torch

__all__ = ["available", "usable", "usable_on", "set_enabled", "enabled", "build", "library_path", "status",
           "qsgd_encode", "qsgd_aggregate", "moments", "terngrad_encode", "terngrad_aggregate",
           "sign_bits", "sign_votes", "scaled_sign_aggregate", "majority", "count_at_least",
           "compact_at_least", "select_at_least", "keep_top", "sparse_aggregate", "first_distinct",
           "qsgd_encode_segments", "qsgd_aggregate_segments", "moments_segments", "terngrad_encode_segments",
           "terngrad_aggregate_segments", "abs_sums_segments", "scaled_sign_aggregate_segments",
           "first_distinct_segments"]

log = logging.getLogger("hvdcomp.native")

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["common.h", "quantize.c", "sign.c", "sparse.c"]
CFLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden",
          "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-Wall"]

_lock = threading.Lock()
_lib = None          # the loaded ctypes.CDLL, False after a failed attempt
_reason = ""         # why the library is not available
_enabled = os.environ.get("HVDCOMP_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def _digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def _candidate_dirs() -> List[str]:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(HERE, "build"), os.path.join(cache, "hvdcomp", "native")]


def library_path(directory: Optional[str] = None) -> str:
    """Where the library for the current sources and flags lives (or would be built)."""
    return os.path.join(directory or _candidate_dirs()[0], f"libhvdcomp_native-{_digest()}.so")


def build(directory: Optional[str] = None, compiler: Optional[str] = None) -> str:
    """Compile the C sources into ``directory`` (default ``hvdcomp/native/build``).

    Returns the library's path. Safe to run concurrently (each build writes a temporary file that
    replaces the target atomically).

    Raises:
        RuntimeError: no compiler found, or the compiler failed (its output in the message).
    """
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler '{cc}' on PATH (set CC=...); gcc with OpenMP is needed")
    target = library_path(directory)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    cmd = [cc, *CFLAGS, "-o", tmp] + [os.path.join(HERE, s) for s in SOURCES if s.endswith(".c")] + ["-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building the native kernels failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
        os.replace(tmp, target)
        for old in os.listdir(os.path.dirname(target)):  # libraries of earlier sources
            if old.startswith("libhvdcomp_native-") and old.endswith(".so") and old != os.path.basename(target):
                try:
                    os.unlink(os.path.join(os.path.dirname(target), old))
                except OSError:
                    pass
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_i64, _i32, _u64, _f32, _p = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "hvd_qsgd_encode": (_i32, [_p, _i64, _i64, _i32, _i32, _i32, _u64, _p, _p, _i32]),
    "hvd_qsgd_aggregate": (_i32, [_i32, _p, _p, _i64, _i64, _i32, _i32, _p, _i32]),
    "hvd_moments": (_i32, [_p, _i64, _i32, _p]),
    "hvd_terngrad_encode": (None, [_p, _i64, _f32, _f32, _u64, _p, _i32]),
    "hvd_terngrad_aggregate": (None, [_i32, _p, _p, _i64, _p, _i32]),
    "hvd_sign_bits": (_i32, [_p, _i64, _p, _p, _i32]),
    "hvd_sign_votes": (None, [_p, _i64, _p, _i32]),
    "hvd_scaled_sign_aggregate": (None, [_i32, _p, _p, _i64, _p, _i32, _i32]),
    "hvd_majority": (None, [_i32, _p, _p, _i64, _p, _i32]),
    "hvd_scan_parts": (_i64, [_i64]),
    "hvd_count_at_least": (_i64, [_p, _i64, _f32, _i32, _p, _i32]),
    "hvd_compact_at_least": (None, [_p, _i64, _f32, _i32, _p, _p, _p, _i32]),
    "hvd_sparse_aggregate": (_i32, [_i32, _p, _p, _p, _f32, _i64, _p, _i32]),
    "hvd_select_begin": (_p, [_p, _i64, _f32, _i32, _i32, _i32, _p]),
    "hvd_select_finish": (None, [_p, _p, _p]),
    "hvd_keep_top": (_i64, [_p, _p, _i64, _f32, _i64, _i32, _p]),
    "hvd_mark_distinct": (_i64, [_p, _i64, _i64, _p, _i64, _i64]),
    "hvd_bitmap_indices": (_i64, [_p, _i64, _p]),
    "hvd_qsgd_encode_segments": (_i32, [_p, _i64, _p, _p, _i64, _i32, _i32, _i32, _p, _p, _i32]),
    "hvd_qsgd_aggregate_segments": (_i32, [_i32, _p, _p, _i64, _p, _i64, _i32, _i32, _p, _i32]),
    "hvd_moments_segments": (_i32, [_p, _i64, _p, _i32, _p]),
    "hvd_terngrad_encode_segments": (_i32, [_p, _i64, _p, _p, _p, _p, _p, _i32]),
    "hvd_terngrad_aggregate_segments": (_i32, [_i32, _p, _p, _i64, _p, _p, _i32]),
    "hvd_abs_sums_segments": (_i32, [_p, _i64, _p, _p, _i32]),
    "hvd_scaled_sign_aggregate_segments": (_i32, [_i32, _p, _p, _i64, _p, _p, _i32, _i32]),
    "hvd_mark_distinct_segments": (_i32, [_i64, _p, _p, _p, _p, _p, _p]),
    "hvd_bitmap_indices_segments": (_i64, [_i64, _p, _p, _p]),
}


def _load():
    global _lib, _reason
    with _lock:
        if _lib is not None:
            return _lib or None
        path = next((p for p in map(library_path, _candidate_dirs()) if os.path.isfile(p)), None)
        if path is None and os.environ.get("HVDCOMP_NATIVE_BUILD", "1") != "0":
            for directory in _candidate_dirs():
                try:
                    path = build(directory)
                    break
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    _reason = str(exc)
        if path is None:
            _reason = _reason or "library not built (HVDCOMP_NATIVE_BUILD=0)"
            log.warning("hvdcomp native kernels unavailable, using the torch kernels: %s", _reason)
            _lib = False
            return None
        try:
            lib = ctypes.CDLL(path)  # torch (imported above) has loaded libgomp: one OpenMP runtime
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except (OSError, AttributeError) as exc:
            _reason = f"loading {path} failed: {exc}"
            log.warning("hvdcomp native kernels unavailable, using the torch kernels: %s", _reason)
            _lib = False
            return None
        _lib = lib
        return lib


def available() -> bool:
    """The library is built and loads (building it now if needed)."""
    return _load() is not None


def enabled() -> bool:
    """Native kernels are switched on (``HVDCOMP_NATIVE``, :func:`set_enabled`) and available."""
    return _enabled and available()


def set_enabled(on: bool) -> bool:
    """Switch the native kernels on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def usable(*tensors: torch.Tensor) -> bool:
    """Native kernels are on (``HVDCOMP_NATIVE``, :func:`set_enabled`), the library loads, and
    every tensor in ``tensors`` is on the CPU; compressors fall back to torch kernels otherwise."""
    return _enabled and all(t.device.type == "cpu" for t in tensors) and available()


def usable_on(device) -> bool:
    """:func:`usable` for tensors on ``device``."""
    return _enabled and torch.device(device).type == "cpu" and available()


def status() -> dict:
    """For results files: whether the native kernels are used, and why not."""
    on = enabled()
    return {"native": on, "library": library_path() if on else None, "reason": "" if on else
            (_reason if _enabled else "switched off (HVDCOMP_NATIVE=0 or set_enabled(False))")}


# ---- wrappers -------------------------------------------------------------------------------------
#: elements per work unit of the kernels (``HVD_CHUNK`` of common.h)
CHUNK = 8192


def _threads(n: int) -> int:
    """OpenMP threads for a kernel over ``n`` elements: ``torch.get_num_threads()``, but no more
    than its work units (one per ``CHUNK`` elements). One unit runs on the calling thread
    alone: no team to wake and join, which on a busy machine (or with many calling threads, each
    with its own team) costs milliseconds per call. Results do not depend on the thread count."""
    return max(1, min(torch.get_num_threads(), -(-n // CHUNK)))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{what}: expected a contiguous CPU {dtype} tensor, got {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'non-contiguous'} on {t.device}")


def _ptrs(tensors: Sequence[torch.Tensor]):
    return (ctypes.c_void_p * max(1, len(tensors)))(*[_ptr(t) for t in tensors])


def qsgd_encode(flat: torch.Tensor, bucket: int, levels: int, use_max: bool, bits: int, key: int,
                scales: torch.Tensor, packed: torch.Tensor) -> None:
    """QSGD codes of ``flat`` (n,) float32 into ``scales`` (ceil(n/bucket),) float32 and ``packed``
    (ceil(n·bits/8),) uint8; ``bits`` in [1, 8] with 2·levels < 2^bits."""
    _check(flat, torch.float32, "qsgd_encode input")
    rc = _load().hvd_qsgd_encode(_ptr(flat), flat.numel(), bucket, levels, int(use_max), bits,
                                 key & (2**64 - 1), _ptr(scales), _ptr(packed), _threads(flat.numel()))
    if rc:
        raise ValueError(f"qsgd_encode: bits={bits} cannot hold levels={levels}")


def qsgd_aggregate(out: torch.Tensor, scales: Sequence[torch.Tensor], packed: Sequence[torch.Tensor],
                   bucket: int, levels: int, bits: int) -> None:
    """``out`` (n,) float32 = mean over payloads of scale·(code - s)/s (see quantize.c)."""
    _check(out, torch.float32, "qsgd_aggregate output")
    for t in scales:
        _check(t, torch.float32, "qsgd scales")
    for t in packed:
        _check(t, torch.uint8, "qsgd codes")
    _load().hvd_qsgd_aggregate(len(packed), _ptrs(scales), _ptrs(packed), out.numel(), bucket,
                               levels, bits, _ptr(out), _threads(out.numel()))


def moments(flat: torch.Tensor):
    """(Σ(x-K), Σ(x-K)², max|x|, K) of ``flat`` float32 in float64, K = x[0] if finite else 0."""
    _check(flat, torch.float32, "moments input")
    out = (ctypes.c_double * 4)()
    if _load().hvd_moments(_ptr(flat), flat.numel(), _threads(flat.numel()), out):
        raise MemoryError("hvd_moments: out of memory")
    return out[0], out[1], out[2], out[3]


def terngrad_encode(flat: torch.Tensor, clip: float, scale: float, key: int, packed: torch.Tensor) -> None:
    """TernGrad codes (Wen et al., NeurIPS 2017) of ``flat`` (n,) float32 into ``packed``
    (ceil(n/4),) uint8 at 2 bits: ``1 + sign(g)·[u < |g|/scale]`` with ``g = clamp(x, ±clip)``
    (``clip`` = inf: none), 1 everywhere when ``scale`` is not > 0; ``u`` uniform from the
    xoshiro128++ streams seeded by ``key``.

    Raises:
        ValueError: ``flat`` not a contiguous CPU float32 tensor.
    """
    _check(flat, torch.float32, "terngrad_encode input")
    _load().hvd_terngrad_encode(_ptr(flat), flat.numel(), clip, scale, key & (2**64 - 1),
                                _ptr(packed), _threads(flat.numel()))


def terngrad_aggregate(out: torch.Tensor, factors: torch.Tensor, packed: Sequence[torch.Tensor]) -> None:
    """``out`` (n,) float32 = Σ_w factors[w]·(code_w - 1) over W payloads of 2-bit codes
    (``packed[w]`` (ceil(n/4),) uint8; ``factors`` (W,) float32, scale_w / W), each element written once.

    Raises:
        ValueError: ``out`` or ``factors`` not a contiguous CPU float32 tensor.
    """
    _check(out, torch.float32, "terngrad_aggregate output")
    _check(factors, torch.float32, "terngrad factors")
    _load().hvd_terngrad_aggregate(len(packed), _ptr(factors), _ptrs(packed), out.numel(), _ptr(out),
                                   _threads(out.numel()))


def sign_bits(flat: torch.Tensor, packed: torch.Tensor, abs_sum: bool = False):
    """Bits [x >= 0] of ``flat`` float32 into ``packed`` (ceil(n/8),) uint8; returns Σ|x| (float64)
    when ``abs_sum``, else None."""
    _check(flat, torch.float32, "sign_bits input")
    total = ctypes.c_double(0.0)
    if _load().hvd_sign_bits(_ptr(flat), flat.numel(), _ptr(packed),
                             ctypes.byref(total) if abs_sum else None, _threads(flat.numel())):
        raise MemoryError("hvd_sign_bits: out of memory")
    return total.value if abs_sum else None


def sign_votes(flat: torch.Tensor, votes: torch.Tensor) -> None:
    """signSGD votes (Bernstein et al., ICML 2018): ``votes`` (n,) int32 = +1 where ``flat`` (n,)
    float32 >= 0 (sign(0) = +1), else -1.

    Raises:
        ValueError: ``flat`` not contiguous CPU float32, or ``votes`` not contiguous CPU int32.
    """
    _check(flat, torch.float32, "sign_votes input")
    _check(votes, torch.int32, "sign votes")
    _load().hvd_sign_votes(_ptr(flat), flat.numel(), _ptr(votes), _threads(flat.numel()))


def scaled_sign_aggregate(out: torch.Tensor, factors: torch.Tensor, packed: Sequence[torch.Tensor],
                          decrement: bool = False) -> None:
    """``out`` = Σ_w ±factors[w] (bit set: +); with ``decrement``, ``out`` -= ±factors[0]."""
    _check(out, torch.float32, "scaled_sign_aggregate output")
    _check(factors, torch.float32, "sign factors")
    _load().hvd_scaled_sign_aggregate(len(packed), _ptr(factors), _ptrs(packed), out.numel(),
                                      _ptr(out), int(decrement), _threads(out.numel()))


def majority(out: torch.Tensor, bits: Sequence[torch.Tensor] = (), votes: Sequence[torch.Tensor] = ()) -> None:
    """``out`` = +1 where the summed ±1 votes are >= 0, else -1 (1-bit payloads or int32 votes)."""
    _check(out, torch.float32, "majority output")
    for t in votes:
        _check(t, torch.int32, "votes")
    lib = _load()
    if bits:
        lib.hvd_majority(len(bits), _ptrs(bits), None, out.numel(), _ptr(out), _threads(out.numel()))
    else:
        lib.hvd_majority(len(votes), None, _ptrs(votes), out.numel(), _ptr(out), _threads(out.numel()))


def count_at_least(flat: torch.Tensor, thr: float, absval: bool):
    """(total, per-part counts (int64 tensor)) of entries with ``x >= thr`` (``|x|`` if absval)."""
    _check(flat, torch.float32, "count_at_least input")
    lib = _load()
    counts = torch.empty(lib.hvd_scan_parts(flat.numel()), dtype=torch.int64)
    total = lib.hvd_count_at_least(_ptr(flat), flat.numel(), thr, int(absval), _ptr(counts), _threads(flat.numel()))
    return total, counts


def compact_at_least(flat: torch.Tensor, thr: float, absval: bool, counts: torch.Tensor, total: int,
                     values: bool = False):
    """Ascending int64 indices (and, with ``values``, the float32 entries) that
    :func:`count_at_least` counted with the same arguments."""
    idx = torch.empty(total, dtype=torch.int64)
    vals = torch.empty(total, dtype=torch.float32) if values else None
    _load().hvd_compact_at_least(_ptr(flat), flat.numel(), thr, int(absval), _ptr(counts), _ptr(idx),
                                 _ptr(vals) if values else None, _threads(flat.numel()))
    return (idx, vals) if values else idx


def select_at_least(flat: torch.Tensor, thr: float, absval: bool, values: bool = False):
    """Ascending int64 indices i with ``x_i >= thr`` (``|x_i|`` if absval; NaN never passes) of
    ``flat`` float32, and with ``values`` the float32 entries there: one pass over ``flat``."""
    _check(flat, torch.float32, "select_at_least input")
    lib = _load()
    total = ctypes.c_int64(0)
    handle = lib.hvd_select_begin(_ptr(flat), flat.numel(), thr, int(absval), int(values), _threads(flat.numel()),
                                  ctypes.byref(total))
    if not handle:  # out of memory for the per-thread buffers: two passes, exact allocation
        count, counts = count_at_least(flat, thr, absval)
        return compact_at_least(flat, thr, absval, counts, count, values)
    idx = torch.empty(total.value, dtype=torch.int64)
    vals = torch.empty(total.value, dtype=torch.float32) if values else None
    lib.hvd_select_finish(handle, _ptr(idx), _ptr(vals) if values else None)
    return (idx, vals) if values else idx


def keep_top(values: torch.Tensor, idx: torch.Tensor, t: float, k: int, absval: bool) -> torch.Tensor:
    """From candidates (float32 ``values`` at ascending int64 ``idx``) and t, the k-th largest
    magnitude among them: the k indices of largest magnitude, ties at t to the lowest indices,
    ascending (see sparse.c)."""
    _check(values, torch.float32, "keep_top values")
    _check(idx, torch.int64, "keep_top indices")
    out = torch.empty(k, dtype=torch.int64)
    got = _load().hvd_keep_top(_ptr(values), _ptr(idx), idx.numel(), t, k, int(absval), _ptr(out))
    return out[:got]


def sparse_aggregate(out: torch.Tensor, indices: Sequence[Optional[torch.Tensor]],
                     values: Sequence[torch.Tensor], scale: float) -> bool:
    """``out`` (n,) float32 = scale · Σ_w payload_w, payload w sparse (ascending int64
    ``indices[w]``, float32 ``values[w]``) or dense (``indices[w]`` None, ``values[w]`` (n,)).
    Returns False (``out`` untouched) if some indices are not ascending or out of range."""
    _check(out, torch.float32, "sparse_aggregate output")
    for i, v in zip(indices, values):
        _check(v, torch.float32, "sparse values")
        if i is not None:
            _check(i, torch.int64, "sparse indices")
    counts = (ctypes.c_int64 * max(1, len(values)))(
        *[-1 if i is None else i.numel() for i in indices])
    idx_ptrs = (ctypes.c_void_p * max(1, len(values)))(*[None if i is None else _ptr(i) for i in indices])
    rc = _load().hvd_sparse_aggregate(len(values), idx_ptrs, _ptrs(values), counts, scale,
                                      out.numel(), _ptr(out), _threads(out.numel()))
    return rc == 0


def first_distinct(draw, n: int, k: int) -> torch.Tensor:
    """Ascending int64 indices: the first ``k`` distinct values of the draws ``draw()`` returns
    (int64 CPU tensors of values in [0, n), called until k distinct values were seen)."""
    lib = _load()
    bitmap = torch.zeros((n + 63) // 64, dtype=torch.int64)
    count = 0
    while count < k:
        stream = draw().contiguous()
        _check(stream, torch.int64, "first_distinct draws")
        count = lib.hvd_mark_distinct(_ptr(stream), stream.numel(), n, _ptr(bitmap), count, k)
        if count < 0:
            raise ValueError(f"first_distinct: a draw outside [0, {n})")
    idx = torch.empty(k, dtype=torch.int64)
    lib.hvd_bitmap_indices(_ptr(bitmap), n, _ptr(idx))
    return idx


# ---- segmented forms: several tensors back to back in one buffer, one call -----------------------
def _sizes(sizes: torch.Tensor) -> torch.Tensor:
    _check(sizes, torch.int64, "segment sizes")
    return sizes


def _raise_if(rc: int, what: str, memory: int = -1) -> None:
    """Raise for a segmented kernel's return code: ``memory`` means out of memory, another
    negative code bad settings."""
    if rc == memory:
        raise MemoryError(f"hvdcomp native {what}: out of memory for the segments' work list")
    if rc < 0:
        raise ValueError(f"hvdcomp native {what}: invalid settings (return code {rc})")


def qsgd_encode_segments(flat: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor, bucket: int,
                         levels: int, use_max: bool, bits: int, scales: torch.Tensor,
                         packed: torch.Tensor) -> None:
    """:func:`qsgd_encode` of each segment of ``flat`` (float32, the segments' ``sizes``, an int64
    tensor, back to back; ``keys`` int64, one per segment) in one call: ``scales`` holds each
    segment's ceil(n/bucket) scales in turn, ``packed`` each segment's ceil(n·bits/8) code bytes
    in turn (bit for bit what one call per segment writes).

    Raises:
        ValueError: ``bits`` cannot hold ``levels``; a tensor of the wrong dtype or layout.
        MemoryError: no memory for the work list.
    """
    _check(flat, torch.float32, "qsgd_encode_segments input")
    _check(keys, torch.int64, "qsgd keys")
    rc = _load().hvd_qsgd_encode_segments(_ptr(flat), sizes.numel(), _ptr(_sizes(sizes)), _ptr(keys), bucket,
                                          levels, int(use_max), bits, _ptr(scales), _ptr(packed), _threads(flat.numel()))
    if rc == -1:
        raise ValueError(f"qsgd_encode_segments: bits={bits} cannot hold levels={levels}")
    _raise_if(rc, "qsgd_encode_segments", memory=-2)


def qsgd_aggregate_segments(out: torch.Tensor, scales: Sequence[torch.Tensor], packed: Sequence[torch.Tensor],
                            sizes: torch.Tensor, bucket: int, levels: int, bits: int) -> None:
    """:func:`qsgd_aggregate` of each segment of payloads laid out as
    :func:`qsgd_encode_segments` writes them, into ``out`` (float32, the segments back to back)."""
    _check(out, torch.float32, "qsgd_aggregate_segments output")
    for t in scales:
        _check(t, torch.float32, "qsgd scales")
    for t in packed:
        _check(t, torch.uint8, "qsgd codes")
    _raise_if(_load().hvd_qsgd_aggregate_segments(len(packed), _ptrs(scales), _ptrs(packed), sizes.numel(),
                                                  _ptr(_sizes(sizes)), bucket, levels, bits, _ptr(out),
                                                  _threads(out.numel())), "qsgd_aggregate_segments", memory=-2)


def moments_segments(flat: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """:func:`moments` of each segment: float64 ``(len(sizes), 4)``, rows (Σ(x-K), Σ(x-K)²,
    max|x|, K); zeros for an empty segment."""
    _check(flat, torch.float32, "moments_segments input")
    out = torch.empty(sizes.numel(), 4, dtype=torch.float64)
    _raise_if(_load().hvd_moments_segments(_ptr(flat), sizes.numel(), _ptr(_sizes(sizes)), _threads(flat.numel()),
                                           _ptr(out)), "moments")
    return out


def terngrad_encode_segments(flat: torch.Tensor, sizes: torch.Tensor, clip: torch.Tensor, scale: torch.Tensor,
                             keys: torch.Tensor, packed: torch.Tensor) -> None:
    """:func:`terngrad_encode` of each segment (float32 ``clip`` and ``scale``, int64 ``keys``, one
    per segment) in one call; ``packed`` holds each segment's ceil(n/4) bytes in turn."""
    _check(flat, torch.float32, "terngrad_encode_segments input")
    _check(clip, torch.float32, "terngrad clips")
    _check(scale, torch.float32, "terngrad scales")
    _check(keys, torch.int64, "terngrad keys")
    _raise_if(_load().hvd_terngrad_encode_segments(_ptr(flat), sizes.numel(), _ptr(_sizes(sizes)), _ptr(clip),
                                                   _ptr(scale), _ptr(keys), _ptr(packed), _threads(flat.numel())),
              "terngrad")


def terngrad_aggregate_segments(out: torch.Tensor, factors: torch.Tensor, packed: Sequence[torch.Tensor],
                                sizes: torch.Tensor) -> None:
    """:func:`terngrad_aggregate` of each segment, ``factors`` float32 (W, len(sizes)) (segment
    j of payload w: ``factors[w, j]``), into ``out`` (the segments back to back)."""
    _check(out, torch.float32, "terngrad_aggregate_segments output")
    _check(factors, torch.float32, "terngrad factors")
    _raise_if(_load().hvd_terngrad_aggregate_segments(len(packed), _ptr(factors), _ptrs(packed), sizes.numel(),
                                                      _ptr(_sizes(sizes)), _ptr(out), _threads(out.numel())), "terngrad")


def abs_sums_segments(flat: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Σ|x| of each segment in float64 (``(len(sizes),)``), each summed as :func:`sign_bits` sums
    one tensor."""
    _check(flat, torch.float32, "abs_sums_segments input")
    out = torch.empty(sizes.numel(), dtype=torch.float64)
    _raise_if(_load().hvd_abs_sums_segments(_ptr(flat), sizes.numel(), _ptr(_sizes(sizes)), _ptr(out),
                                            _threads(flat.numel())), "abs sums")
    return out


def scaled_sign_aggregate_segments(out: torch.Tensor, factors: torch.Tensor, packed: Sequence[torch.Tensor],
                                   sizes: torch.Tensor, decrement: bool = False) -> None:
    """:func:`scaled_sign_aggregate` with per-segment factors (float32 (W, len(sizes))) over the
    bits of the whole buffer (element i: bit i)."""
    _check(out, torch.float32, "scaled_sign_aggregate_segments output")
    _check(factors, torch.float32, "sign factors")
    _raise_if(_load().hvd_scaled_sign_aggregate_segments(len(packed), _ptr(factors), _ptrs(packed), sizes.numel(),
                                                         _ptr(_sizes(sizes)), _ptr(out), int(decrement),
                                                         _threads(out.numel())), "sign aggregate")


def first_distinct_segments(draws: Sequence, sizes: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """:func:`first_distinct` of each segment (``draws[j]``: the draw function of segment j, or None
    where ``ks[j]`` is 0), the indices offset by each segment's first element and written back to
    back: ascending int64 over the whole buffer, Σ ks entries."""
    lib = _load()
    n = len(draws)
    sizes = _sizes(sizes)
    words = [(s + 63) // 64 for s in sizes.tolist()]
    bitmaps = torch.zeros(max(1, sum(words)), dtype=torch.int64)
    wanted = torch.tensor(list(ks), dtype=torch.int64)
    counts = torch.zeros(n, dtype=torch.int64)
    lens = torch.zeros(n, dtype=torch.int64)
    todo = [j for j in range(n) if ks[j] > 0]
    empty = torch.zeros(0, dtype=torch.int64)
    while todo:
        streams = [empty] * n
        for j in todo:
            streams[j] = draws[j]()
        if any(s.dtype != torch.int64 or not s.is_contiguous() or s.device.type != "cpu" for s in streams):
            raise ValueError("first_distinct_segments: the draws must be contiguous CPU int64 tensors")
        lens.copy_(torch.tensor([s.numel() for s in streams], dtype=torch.int64))
        if lib.hvd_mark_distinct_segments(n, _ptrs(streams), _ptr(lens), _ptr(sizes), _ptr(wanted),
                                          _ptr(bitmaps), _ptr(counts)):
            raise ValueError("first_distinct_segments: a draw outside its segment's [0, n)")
        todo = [j for j, (c, k) in enumerate(zip(counts.tolist(), ks)) if c < k]
    idx = torch.empty(int(wanted.sum()), dtype=torch.int64)
    lib.hvd_bitmap_indices_segments(n, _ptr(sizes), _ptr(bitmaps), _ptr(idx))
    return idx


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m hvdcomp.native", description="Build or check the native kernels.")
    p.add_argument("--build", action="store_true", help="compile the library (hvdcomp/native/build)")
    p.add_argument("--check", action="store_true", help="load it and print its status")
    args = p.parse_args(argv)
    if args.build:
        print(build())
    if args.check or not args.build:
        st = status()
        print(st)
        return 0 if st["native"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
