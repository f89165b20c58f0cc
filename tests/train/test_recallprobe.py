"""The recall probe: per-position shares over the real answer, and one clear line on bad arguments."""

import random

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.models.kimi import build_model
from training import recallprobe, tasks
from training.export import compact_config
from training.init import init_for_training
from training.render import encode_sample
from training.tok import load_tokenizer
from training.config import DEFAULT_CONFIG
from training.vocab import CompactVocab


@pytest.mark.parametrize("recall", tasks.RECALLS)
def test_shares_cover_every_answer_position(recall):
    tok = load_tokenizer()
    rng = random.Random(777)  # the probe's own draws, to give the vocabulary their ids
    drawn = [encode_sample(tasks.make("recall", rng, held_out=True, thinking=False,
                                      style=tasks.Style(recall=recall), records=40), tok) for _ in range(2)]
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab({i for ids, _ in drawn for i in ids}, full.text.vocab_size)
    torch.manual_seed(0)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0)
    shares, exact, longest = recallprobe.by_position(model, vocab, tok, recall, 40, 2)
    assert len(shares) == max(len(ids) - n for ids, n in drawn)
    assert all(0.0 <= x <= 1.0 for x in shares) and 0 <= exact <= 2
    assert longest == max(n for _, n in drawn)


def test_cli_rejects_bad_counts_and_sources(capsys, tmp_path):
    assert recallprobe.main([str(tmp_path), "--n", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert recallprobe.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
