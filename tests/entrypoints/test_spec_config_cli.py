"""``k3serve serve --speculative-config``: every bad config is one clear line and exit status 1, before any
process starts (unknown method, k < 0, bad JSON, a draft model with another vocabulary or that does not
exist, an eagle3 head missing or trained for another model)."""

from __future__ import annotations

import json

import pytest

from k3serve.cli import main
from k3serve.models.eagle import EagleConfig, EagleHead

TARGET = "k3-tiny-random"  # vocabulary 2048, hidden size 128, 9 layers


def _head(path, **over):
    cfg = {"hidden_size": 128, "vocab_size": 2048, "feature_layers": (1, 4, 8), "draft_vocab_size": 64,
           "intermediate_size": 32, **over}
    EagleHead(EagleConfig(**cfg)).save(str(path))  # a str works as well as a Path
    return str(path)


def _serve(spec: dict | str) -> list[str]:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return ["serve", TARGET, "--host", "127.0.0.1", "--port", "1", "--speculative-config", text]


@pytest.mark.parametrize("spec,needle", [
    ({"method": "medusa"}, "unknown method 'medusa'"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens must be an integer >= 0, got -1"),
    ({"method": "suffix", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 0"),
    ("{not json", "not valid JSON"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": "k3-tiny-fullvocab-random"},
     "draft model 'k3-tiny-fullvocab-random' has a vocabulary of 163840 tokens, the target 2048: they must "
     "share the tokenizer"),
    ({"method": "draft_model", "model": "no-such-draft"}, "'no-such-draft' is neither a directory"),
    ({"method": "eagle3", "model": "/nonexistent/head"}, "no readable config.json"),
])
def test_bad_speculative_config_is_one_line(capsys, spec, needle):
    assert main(_serve(spec)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3serve: error:") and needle in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("over,needle", [
    ({"vocab_size": 163840}, "has a vocabulary of 163840 tokens, the target 2048"),
    ({"hidden_size": 64}, "reads hidden size 64, the target's is 128"),
    ({"feature_layers": (1, 4, 12)}, "reads layer 12, the target has 9"),
])
def test_an_eagle_head_for_another_model_is_one_line(capsys, tmp_path, over, needle):
    head = _head(tmp_path / "head", **over)
    assert main(_serve({"method": "eagle3", "model": head})) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3serve: error: --speculative-config ") and needle in err[0], err
