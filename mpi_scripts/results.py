"""The scripts' one way to write and read results JSON and to summarise repeated measurements.

Every script of ``mpi_scripts/``, ``benchmarks/`` and ``scripts/`` writes its JSON through
:func:`write_json` (hvdcomp's atomic writer: a temporary file and ``os.replace``, so a reader never
sees half a file), reads it back through :func:`read_json` (a folder of runs through :func:`read_all`), and summarises seeds, steps or
repetitions through :func:`summary`, :func:`mean` and :func:`sd` (Python's :mod:`statistics`).
"""
from __future__ import annotations

import glob
import json
import math
import os
import statistics
import sys
from typing import Dict, Iterable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
from hvdcomp.metrics import write_json_atomic as write_json  # noqa: E402,F401  (the one writer)


def read_json(path: str) -> Optional[dict]:
    """The JSON object at ``path``; None where the file is missing or not (yet) valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_all(root: str, pattern: str) -> Dict[str, dict]:
    """Every JSON file under ``root`` whose path matches the glob ``pattern`` (``**`` recursive),
    sorted, by its path (``root`` joined with the match); files that are not valid JSON are left out."""
    found = ((path, read_json(path)) for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)))
    return {path: obj for path, obj in found if obj is not None}


def _present(values: Iterable[Optional[float]]) -> list:
    return [v for v in values if v is not None]


def mean(values: Iterable[Optional[float]]) -> float:
    """Arithmetic mean of the values that are not None; NaN when none are."""
    xs = _present(values)
    return statistics.fmean(xs) if xs else math.nan


def sd(values: Iterable[Optional[float]]) -> float:
    """Sample standard deviation (n − 1) of the values that are not None; NaN below two values."""
    xs = _present(values)
    return statistics.stdev(xs) if len(xs) > 1 else math.nan


def summary(values: Iterable[float]) -> Dict[str, Optional[float]]:
    """``{"median", "mean", "std", "min", "max", "n"}`` of the values (``std``: sample standard
    deviation, None below two values); ``{}`` for no values."""
    xs = list(values)
    if not xs:
        return {}
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else None, "min": min(xs), "max": max(xs), "n": len(xs)}
