"""Low-rank communication: AB-training and the orthogonalisation PowerSGD uses.

AB-training, one job per module: :mod:`.ab` (the training loop's driver, :class:`ABTraining`),
:mod:`.schedule` (which stage a step is in; the learning-rate rebound), :mod:`.layout` (nodes,
rank groups, which factor a rank trains), :mod:`.factors` (matrix view, SVD split, kept rank,
model compression), :mod:`.weights` (a factorised weight and its optimizer state),
:mod:`.traffic` (the collectives, their bytes per stage, the whole-run summary).
"""
from .ab import ABTraining
from .factors import factorize, kept_rank, matrix_view, model_compression, unit_singular_values_
from .orthogonalize import orthogonalize
from .schedule import STAGES
from .traffic import traffic_summary

__all__ = ["ABTraining", "STAGES", "factorize", "kept_rank", "matrix_view", "model_compression", "orthogonalize",
           "traffic_summary", "unit_singular_values_"]
