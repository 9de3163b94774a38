"""The study's workload: a word-level LSTM language model and its corpora."""
from .data import Corpus, load_corpus, batchify, rank_columns
from .model import LSTMLM, MODEL_SIZES
from .evaluate import loss_sums

__all__ = ["Corpus", "load_corpus", "batchify", "rank_columns", "LSTMLM", "MODEL_SIZES", "loss_sums"]
