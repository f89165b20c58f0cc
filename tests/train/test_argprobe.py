"""The tool-argument probe: value spans are found in the answer's tokens, scores come from the model's own
argmax, and it opens both a checkpoint directory and a run."""

from __future__ import annotations

import random

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.models.kimi import build_model
from training import argprobe, tasks
from training.export import compact_config, export
from training.grow import open_model
from training.init import init_for_training
from training.qat import enable_qat
from training.render import encode_sample
from training.tok import load_tokenizer
from training.config import DEFAULT_CONFIG
from training.vocab import CompactVocab


def test_argument_tokens_cover_each_key_and_value_exactly():
    pieces = ['<|open|>', 'argument', ' key', '="', 'city', '"', ' type', '="', 'string', '"', '<|sep|>', 'Par', 'is',
              '<|close|>', 'argument', '<|sep|>', '<|open|>', 'argument', ' key', '="', 'n', '"', ' type', '="',
              'integer', '"', '<|sep|>', '42', '<|close|>', 'argument']
    assert argprobe.argument_tokens(pieces) == [("city", [4], [11, 12]), ("n", [20], [27])]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = load_tokenizer()
    rng = random.Random(4242)  # the probe's own seed: its samples' ids are all in this vocabulary
    ids = set()
    for _ in range(6):
        ids |= set(encode_sample(tasks.make("tool", rng, held_out=True, thinking=rng.random() < 0.6,
                                                  style=tasks.SHIPPED), tok)[0])
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(ids, full.text.vocab_size)
    torch.manual_seed(0)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0)
    enable_qat(model)
    out = tmp_path_factory.mktemp("ckpt")
    model_dir, _ = export(model, vocab, DEFAULT_CONFIG, out)
    return model, vocab, model_dir, tok


def test_a_checkpoint_opens_with_its_trained_rows_as_the_vocabulary(exported):
    model, vocab, model_dir, _ = exported
    opened, opened_vocab, step = open_model(model_dir)
    assert step is None
    assert opened_vocab.ids == vocab.ids


def test_scores_follow_the_model_argmax(exported, monkeypatch):
    model, vocab, _, tok = exported
    untrained = argprobe.arg_accuracy(model, vocab, tok, n=6)
    assert untrained.samples == 6
    whole = [w for rows in untrained.by_index.values() for _, _, w in rows]
    assert whole and not any(whole)  # a random model copies no value whole

    # a model that always predicts the reference answer gets every value right
    def perfect(model, seqs):
        return seqs[0]

    def logits(x):  # "hidden" is the ids themselves: put the argmax on the next id
        out = torch.full((x.numel(), len(vocab)), -1.0)
        out[torch.arange(x.numel() - 1), x[1:]] = 1.0
        return out

    monkeypatch.setattr(argprobe, "train_forward", perfect)
    monkeypatch.setattr(model, "compute_logits", logits)
    oracle = argprobe.arg_accuracy(model, vocab, tok, n=6)
    assert all(all(row) for rows in oracle.by_index.values() for row in rows)
    assert oracle.first_wrong == {"other key": 0, "else": 0}


def test_cli_reports_and_refuses_in_one_line(exported, tmp_path, capsys):
    _, _, model_dir, _ = exported
    assert argprobe.main([str(model_dir), "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 held-out tool tasks" in out and "argument 0:" in out and "wrong first tokens" in out
    assert argprobe.main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
