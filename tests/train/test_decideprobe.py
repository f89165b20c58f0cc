"""The call-or-decline probe: where the two branches part, and the probability ratio it reports."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from training import decideprobe, tasks
from training.render import encode_sample
from training.tok import load_tokenizer
from training.vocab import CompactVocab


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _parting(tok, s: tasks.Sample, style: tasks.Style) -> tuple[str, str]:
    ids, n = encode_sample(s, tok)
    alt, _ = encode_sample(replace(s, target=decideprobe.other_branch(s, style)), tok)
    d = next(i for i in range(n, min(len(ids), len(alt))) if ids[i] != alt[i])
    assert ids[:d] == alt[:d]
    return tok.decode([ids[d]]), tok.decode([alt[d]])


@pytest.mark.parametrize("reasoning, right, other", [("plain", " No", " The"), ("check", " is", " does")])
def test_branches_part_at_the_decision(tok, reasoning, right, other):
    style = tasks.Style("lines", reasoning)
    rng = random.Random(1)
    for _ in range(5):
        for kind, want in (("decline", (right, other)), ("tool", (other, right))):
            assert _parting(tok, tasks.make(kind, rng, held_out=True, thinking=True, style=style), style) == want


def test_without_thinking_branches_part_at_the_verdict_when_the_content_decides(tok):
    rng = random.Random(2)
    bare, decide = tasks.Style("lines", "check"), tasks.Style("lines", "check", "decide")
    for _ in range(5):
        s = tasks.make("decline", rng, held_out=True, thinking=False, style=decide)
        assert _parting(tok, s, decide) == (" is", " does")
        assert _parting(tok, tasks.make("tool", rng, held_out=True, thinking=False, style=decide), decide) == (
            " does", " is")
        right, other = _parting(tok, tasks.make("decline", rng, held_out=True, thinking=False, style=bare), bare)
        assert right == "None" and other != right  # the content's first token against the call's


class _Always:
    """A stand-in model whose logits favour one token id everywhere (or none: uniform)."""

    def __init__(self, size: int, favour: int | None):
        self.size, self.favour = size, favour

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(hidden.shape[0], self.size)
        if self.favour is not None:
            out[:, self.favour] = 20.0
        return out


def test_probe_reports_the_ratio_of_the_two_branches(tok, monkeypatch):
    vocab = CompactVocab(range(163840), 163840)
    monkeypatch.setattr(decideprobe, "train_forward", lambda model, seqs: torch.zeros(seqs[0].numel(), 1))
    style = tasks.Style("lines")
    uniform = decideprobe.probe(_Always(len(vocab), None), vocab, tok, style, n=2)
    assert all(p == pytest.approx(0.5) for ps in uniform.values() for p in ps)
    (no,) = tok.encode(" No")
    says_no = decideprobe.probe(_Always(len(vocab), vocab.to_compact([int(no)])[0]), vocab, tok, style, n=2)
    assert all(p > 0.99 for p in says_no[("decline", True)])  # right on every thinking decline
    assert all(p > 0.99 for p in says_no[("object", True)])  # hard ones included
    assert all(p < 0.01 for p in says_no[("tool", True)])  # wrong on every thinking call
    assert all(len(ps) == 2 for ps in says_no.values())


def test_cli_refuses_bad_input_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        decideprobe.main([str(tmp_path), "--n", "0"])
    assert e.value.code == 2 and "--n must be >= 1" in capsys.readouterr().err
    assert decideprobe.main([str(tmp_path / "missing")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
