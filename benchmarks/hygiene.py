"""Benchmark hygiene: is the machine quiet enough for a speed figure to be evidence?

Every speed script records, before and after each run, the 1-minute load average and the share
of CPU time the rest of the machine used over a short window (from ``/proc/stat``: busy jiffies
over all jiffies, while nothing of the benchmark runs), and marks a run ``loaded`` when the load
average before it exceeded the number of cores. A loaded run is kept in the results but left out
of every verdict; :func:`wait_quiet` waits for a quiet machine first.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional

__all__ = ["cpu_busy_share", "machine_state", "wait_quiet", "is_loaded", "cpu_identity"]


def _cpu_jiffies():
    """(busy, total) jiffies summed over all CPUs since boot (``/proc/stat``'s first line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return total - idle, total


def cpu_busy_share(window: float = 1.0) -> float:
    """Fraction (0..1) of all CPU time that was busy over the next ``window`` seconds; measured
    while the benchmark itself is idle, it is the rest of the machine's share."""
    b0, t0 = _cpu_jiffies()
    time.sleep(window)
    b1, t1 = _cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def machine_state(window: float = 1.0) -> Dict[str, float]:
    """``{"load_1min", "load_5min", "cores", "others_cpu_share"}`` now (takes ``window`` seconds)."""
    share = cpu_busy_share(window)
    one, five, _ = os.getloadavg()
    return {"load_1min": round(one, 2), "load_5min": round(five, 2), "cores": os.cpu_count() or 1,
            "others_cpu_share": round(share, 3)}


def is_loaded(state: Dict[str, float], limit: Optional[float] = None) -> bool:
    """A run is ``loaded`` when the load average before it exceeded ``limit`` (default: the number
    of cores; a harness test that only checks the pipeline raises it)."""
    return state["load_1min"] > (state["cores"] if limit is None else limit)


def wait_quiet(max_wait: float = 600.0, poll: float = 15.0, log=print,
               limit: Optional[float] = None) -> Optional[Dict[str, float]]:
    """Wait (at most ``max_wait`` seconds) until the 1-minute load average is at most ``limit``
    (default: the number of cores); returns the state then (marked loaded by :func:`is_loaded`
    if it never got quiet)."""
    deadline = time.monotonic() + max_wait
    state = machine_state()
    while is_loaded(state, limit) and time.monotonic() < deadline:
        log(f"machine loaded (load {state['load_1min']} on {state['cores']} cores, others "
            f"{100 * state['others_cpu_share']:.0f} % CPU): waiting")
        time.sleep(poll)
        state = machine_state()
    return state


#: vector instruction-set flags of /proc/cpuinfo that the math libraries (MKL, oneDNN, ATen) choose kernels by
VECTOR_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_identity(path: str = "/proc/cpuinfo") -> Dict[str, object]:
    """``{"model": str, "vector_isa": [flags]}`` of this machine's first CPU (``"unknown"`` and
    ``[]`` where ``path`` cannot be read). The math libraries pick their kernels by the CPU, so
    the same run can differ in the last bits between machines (and a model trained at a high
    learning rate can turn that into different perplexities): benchmarks record it in run.json
    so figures from different sittings can be told apart."""
    model, flags = "unknown", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "vector_isa": [f for f in VECTOR_ISA if f in flags]}
