"""Corpus loading, batching and the model's size (hand-worked values)."""
import os

import pytest
import torch

from hvdcomp.lm import LSTMLM, MODEL_SIZES, TransformerLM, batchify, load_corpus, make_lm, rank_columns
from hvdcomp.lm.data import tokenize_raw
from tests.mpirun import TINY_SHAKESPEARE


def test_tokenize_raw():
    assert tokenize_raw("First Citizen:\nYou are all resolved, rather?\n\n") == [
        "first", "citizen", ":", "<eos>", "you", "are", "all", "resolved", ",", "rather", "?", "<eos>"]


def test_raw_file_split_in_order(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("\n".join(f"w{i}" for i in range(100)) + "\n")  # 200 tokens
    c = load_corpus(str(f), vocab_size=1000)
    assert (len(c.train), len(c.valid), len(c.test)) == (180, 10, 10)
    assert c.itos[c.train[0]] == "w0" and c.itos[c.train[-2]] == "w89"
    assert c.test[-2] == 0                       # w99 is never seen in training: <unk>


def test_vocab_cap_and_unk(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("a a a b b c\n" * 20)
    c = load_corpus(str(f), vocab_size=3)
    assert c.itos == ["<unk>", "a", "<eos>"] or c.itos == ["<unk>", "a", "b"]
    assert c.itos[0] == "<unk>" and len(c.itos) == 3


@pytest.mark.parametrize("names", [("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
                                   ("train.txt", "valid.txt", "test.txt"),
                                   ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")])
def test_standard_layouts(tmp_path, names):
    for n, text in zip(names, ("the cat sat\nthe dog\n", "the cat\n", "a dog\n")):
        (tmp_path / n).write_text(text)
    c = load_corpus(str(tmp_path))
    assert len(c.train) == 7 and len(c.valid) == 3 and len(c.test) == 3
    assert c.itos[c.test[0]] == "<unk>"          # "a" never occurs in training


def test_heldout_layout_uses_valid_for_training(tmp_path):
    (tmp_path / "valid.txt").write_text("x y\n" * 30)
    (tmp_path / "test.txt").write_text("x\n")
    c = load_corpus(str(tmp_path))
    assert len(c.train) == 81 and len(c.valid) == 9 and c.notes


def test_missing_corpus_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="HVDCOMP_DATA"):
        load_corpus(str(tmp_path / "nope.txt"))


def test_batchify_and_rank_columns():
    data = batchify(torch.arange(10), 3)
    assert data.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert rank_columns(256, 3, 4) == slice(192, 256)
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        rank_columns(256, 0, 3)


@pytest.mark.parametrize("size,params", [("small", 1_161_600), ("medium", 4_444_800), ("large", 9_008_000)])
def test_model_sizes_match_study(size, params):
    model = LSTMLM(10000, MODEL_SIZES[size])
    assert sum(p.numel() for p in model.parameters()) == params
    logits, (h, c) = model(torch.zeros(5, 2, dtype=torch.long))
    assert logits.shape == (5, 2, 10000) and h.shape == (2, 2, MODEL_SIZES[size])


@pytest.mark.skipif(not os.path.isfile(TINY_SHAKESPEARE), reason="../shared/data not present")
def test_tiny_shakespeare_loads():
    c = load_corpus(TINY_SHAKESPEARE)
    assert c.vocab_size == 10000 and 200_000 < len(c.train) < 300_000


def test_transformer_lm_is_causal_and_fits_the_lstm_loop():
    """Changing token t changes no logit before t (causal mask); state is () both ways; the tied
    embedding is the output matrix; 26 parameter tensors at hidden 100 (2 layers, 4 heads)."""
    torch.manual_seed(0)
    model = make_lm("transformer", 50, "small", dropout=0.0).eval()
    assert isinstance(model, TransformerLM) and len(list(model.parameters())) == 26
    tokens = torch.randint(0, 50, (12, 3))
    logits, state = model(tokens, model.init_state(3))
    assert logits.shape == (12, 3, 50) and state == ()
    changed = tokens.clone()
    changed[7] = (changed[7] + 1) % 50
    again, _ = model(changed, state)
    assert torch.equal(again[:7], logits[:7]) and not torch.equal(again[7:], logits[7:])
    with pytest.raises(ValueError, match="multiple of heads"):
        TransformerLM(50, 10, heads=4)
    with pytest.raises(ValueError, match="unknown model"):
        make_lm("gru", 50, "small")
    assert isinstance(make_lm("lstm", 50, "small"), LSTMLM)
