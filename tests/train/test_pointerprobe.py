"""The pointer probe: the attention mass one supervised head puts on a pointer's sources, per MLA layer."""

from __future__ import annotations

import random

import pytest

from k3serve.core.config import ModelConfig
from k3serve.models.kimi import build_model
from training import keyed, pointerprobe, tasks
from training.config import DEFAULT_CONFIG
from training.export import compact_config
from training.init import init_for_training
from training.render import encode_sample
from training.tok import load_tokenizer
from training.vocab import CompactVocab


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer()
    samples = []
    for kind, extra in pointerprobe.GROUPS.values():  # what the probe draws: each group from the seed
        rng = random.Random(11)
        samples += [tasks.make(kind, rng, held_out=True, style=tasks.SHIPPED, **extra) for _ in range(2)]
    used = {int(i) for s in samples for i in encode_sample(s, tok)[0]}
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(used, full.text.vocab_size)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0)
    return tok, vocab, model, samples


def test_all_visible_positions_hold_all_the_mass_and_one_position_part_of_it(setup):
    tok, vocab, model, samples = setup
    ids, n = encode_sample(samples[0], tok)
    (t, src), = keyed.describe_targets(ids, [(n, len(ids))])
    everything = pointerprobe.masses(model, vocab, ids, [(t, list(range(t + 1)))], head=2)
    assert all(m == pytest.approx(1.0, abs=1e-5) for (m,) in everything)
    one = pointerprobe.masses(model, vocab, ids, [(t, src)], head=2)
    assert len(one) == len(everything) > 1 and all(0.0 < m < 1.0 for (m,) in one)


def test_probe_reports_each_group_per_mla_layer(setup, capsys, tmp_path):
    tok, vocab, model, _ = setup
    res = pointerprobe.probe(model, vocab, tok, "describe_attn", n=2)
    assert list(res) == list(pointerprobe.GROUPS)
    assert all(len(per_layer) == 3 and all(0.0 <= m <= 1.0 for m in per_layer) for per_layer in res.values())
    with pytest.raises(SystemExit) as e:
        pointerprobe.main([str(tmp_path), "--n", "0"])
    assert e.value.code == 2 and "--n must be >= 1" in capsys.readouterr().err
    assert pointerprobe.main([str(tmp_path / "missing")]) == 2
