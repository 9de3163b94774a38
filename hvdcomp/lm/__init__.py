"""The study's workload: a word-level LSTM language model (and a small transformer) and its corpora."""
from .data import Corpus, load_corpus, batchify, rank_columns
from .model import ARCHITECTURES, LSTMLM, MODEL_SIZES, TransformerLM, make_lm
from .evaluate import loss_sums, window_loss
from .schedule import PlateauSchedule

__all__ = ["Corpus", "load_corpus", "batchify", "rank_columns", "LSTMLM", "TransformerLM", "MODEL_SIZES",
           "ARCHITECTURES", "make_lm", "loss_sums", "window_loss", "PlateauSchedule"]
