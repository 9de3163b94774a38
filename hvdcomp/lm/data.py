"""Word-level corpora for the language-model experiments.

Accepted ``path`` layouts:

* a plain text file (e.g. Tiny Shakespeare): lower-cased, split into words and punctuation marks,
  ``<eos>`` at each line end, then split **in order** into 90 % train / 5 % valid / 5 % test tokens;
* a directory with ``ptb.{train,valid,test}.txt``, ``{train,valid,test}.txt`` or
  ``wiki.{train,valid,test}.tokens`` (already tokenised: whitespace split, ``<eos>`` per line);
* a directory with only ``valid.txt`` and ``test.txt`` (the WikiText-2 held-out splits shipped in
  ``shared/data``): the first 90 % of ``valid`` trains, its last 10 % validates, ``test`` tests.

The vocabulary is the ``vocab_size - 1`` most frequent training tokens plus ``<unk>`` (ties broken
alphabetically, so every rank builds the same one).
"""
from __future__ import annotations

import collections
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

__all__ = ["Corpus", "load_corpus", "batchify", "rank_columns", "tokenize_raw", "default_data_path"]

UNK, EOS = "<unk>", "<eos>"
_WORD = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")
_LAYOUTS = [("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
            ("train.txt", "valid.txt", "test.txt"),
            ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")]


@dataclass
class Corpus:
    """Token id streams (1-D int64 tensors) and the vocabulary (``itos[id] = word``)."""

    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    itos: List[str]
    source: str
    notes: List[str] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        """V, ``<unk>`` included."""
        return len(self.itos)

    def describe(self) -> Dict[str, object]:
        """Sizes and provenance, for results files."""
        return {"source": self.source, "vocab_size": self.vocab_size, "train_tokens": len(self.train),
                "valid_tokens": len(self.valid), "test_tokens": len(self.test), "notes": self.notes}


def default_data_path() -> str:
    """``$HVDCOMP_DATA/tinyshakespeare/input.txt`` if set, else the copy in ``../shared/data``."""
    root = os.environ.get("HVDCOMP_DATA")
    if root is None:
        here = os.path.dirname(os.path.abspath(__file__))
        root = os.path.join(here, "..", "..", "..", "shared", "data")
    return os.path.normpath(os.path.join(root, "tinyshakespeare", "input.txt"))


def tokenize_raw(text: str) -> List[str]:
    """Lower-case words and single punctuation marks, ``<eos>`` after every non-empty line."""
    return _tokens(text, lambda line: _WORD.findall(line.lower()))


def _tokens(text: str, words_of=str.split) -> List[str]:
    """``words_of(line)`` for every line of ``text`` (a pre-tokenised corpus: whitespace split),
    ``<eos>`` after each non-empty one."""
    out: List[str] = []
    for line in text.splitlines():
        words = words_of(line)
        if words:
            out.extend(words)
            out.append(EOS)
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _splits(path: str) -> Tuple[List[str], List[str], List[str], str, List[str]]:
    if os.path.isfile(path):
        toks = tokenize_raw(_read(path))
        a, b = int(0.9 * len(toks)), int(0.95 * len(toks))
        return toks[:a], toks[a:b], toks[b:], "raw text split 90/5/5 in order", []
    if not os.path.isdir(path):
        raise FileNotFoundError(f"corpus not found: {path!r}. Give --data a text file or a directory in "
                                "PTB/WikiText layout, or set HVDCOMP_DATA to the folder holding "
                                "tinyshakespeare/input.txt")
    for names in _LAYOUTS:
        files = [os.path.join(path, n) for n in names]
        if all(os.path.isfile(f) for f in files):
            tr, va, te = (_tokens(_read(f)) for f in files)
            return tr, va, te, f"{names[0]} layout", []
    valid, test = os.path.join(path, "valid.txt"), os.path.join(path, "test.txt")
    if os.path.isfile(valid) and os.path.isfile(test):
        toks = _tokens(_read(valid))
        a = int(0.9 * len(toks))
        note = "no training split: trained on the first 90 % of valid.txt, validated on its last 10 %"
        return toks[:a], toks[a:], _tokens(_read(test)), "valid/test layout", [note]
    raise FileNotFoundError(f"{path!r} holds none of the layouts " +
                            ", ".join("/".join(n) for n in _LAYOUTS) + " or valid.txt+test.txt")


def load_corpus(path: str, vocab_size: int = 10000) -> Corpus:
    """Read and tokenise a corpus (see the module docstring for layouts).

    Args:
        path: text file or directory.
        vocab_size: cap on the vocabulary, ``<unk>`` included (>= 2).

    Raises:
        FileNotFoundError: no file or known layout at ``path``.
        ValueError: ``vocab_size < 2`` or a split with no tokens.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    train, valid, test, layout, notes = _splits(path)
    for split, toks in (("train", train), ("valid", valid), ("test", test)):
        if len(toks) < 2:
            raise ValueError(f"the {split} split of {path!r} has {len(toks)} tokens; the corpus is too small")
    counts = collections.Counter(t for t in train if t != UNK)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 1]
    itos = [UNK] + [w for w, _ in ranked]
    stoi = {w: i for i, w in enumerate(itos)}

    def ids(toks):
        return torch.tensor([stoi.get(t, 0) for t in toks], dtype=torch.long)

    return Corpus(ids(train), ids(valid), ids(test), itos, f"{path} ({layout})", notes)


def batchify(stream: torch.Tensor, columns: int) -> torch.Tensor:
    """Lay a 1-D token stream out as ``(length, columns)`` (column j is a contiguous piece).

    Raises:
        ValueError: fewer tokens than columns.
    """
    length = stream.numel() // columns
    if length < 2:
        raise ValueError(f"{stream.numel()} tokens cannot fill {columns} columns; lower the batch size")
    return stream[: length * columns].view(columns, length).t().contiguous()


def rank_columns(columns: int, rank: int, size: int) -> slice:
    """This rank's contiguous share of a global batch of ``columns`` sequences.

    Raises:
        ValueError: ``columns`` is not divisible by the world size.
    """
    if columns % size:
        raise ValueError(f"global batch size {columns} is not divisible by the world size {size}; "
                         f"use a multiple of {size} (e.g. --batch-size {columns - columns % size or size})")
    per = columns // size
    return slice(rank * per, (rank + 1) * per)
