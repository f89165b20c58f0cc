"""The copy probe's pieces: its attention matches the layer's own, zeroing removes a layer kind, the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import MLAttention
from k3serve.models.kimi import build_model
from training import copyprobe, data
from training.export import compact_config, save_compact
from training.forward import train_forward
from training.init import init_for_training
from training.config import DEFAULT_CONFIG
from training.vocab import CompactVocab


@pytest.fixture(scope="module")
def model_vocab():
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(range(1000, 1400), full.text.vocab_size)
    torch.manual_seed(0)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0, mla_init_std=0.3)  # scores far from uniform, so a wrong mask or scale shows
    return model, vocab


@torch.no_grad()
def test_probe_attention_reproduces_the_layer_output(model_vocab):
    model, vocab = model_vocab
    e = data.induce_sample(random.Random(0), data.token_pool(vocab), (20, 20))
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], out)))
             for m in model.modules() if isinstance(m, MLAttention)]
    train_forward(model, [torch.tensor(vocab.to_compact(e.ids))])
    for h in hooks:
        h.remove()
    assert len(seen) == 3
    for m, x, out in seen:
        p = copyprobe._scores(m, x)
        N, H = x.shape[0], m.num_heads
        ckv = m.kv_a_proj_with_mqa(x)
        v = m.kv_b_proj(m.kv_a_layernorm(ckv[:, :m.kv_lora_rank])).view(N, H, -1)[..., m.nope_dim:]
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(N, -1) * torch.sigmoid(m.g_proj(x))
        assert p.sum(-1).allclose(torch.ones(H, N)) and not p.std(-1).lt(1e-3).all()
        torch.testing.assert_close(m.o_proj(o), out, atol=1e-5, rtol=1e-4)
    rows = copyprobe.mla_attention(model, vocab, n=12)
    assert [r["layer"] for r in rows] == [m.layer_idx for m, _, _ in seen]
    assert all(0 <= min(r["target_mass"]) and max(r["entropy"]) <= r["uniform_entropy"] + 1e-4 for r in rows)


@torch.no_grad()
def test_zeroing_every_mixer_leaves_only_the_current_token(model_vocab):
    model, vocab = model_vocab
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        copyprobe.zero_outputs(model, MLAttention)
        ids = torch.tensor(vocab.to_compact(list(range(1000, 1012))))
        other = ids.clone()
        other[2] = vocab.to_compact([1300])[0]
        base = model.compute_logits(train_forward(model, [ids]))
        changed = model.compute_logits(train_forward(model, [other]))
        assert not torch.allclose(base[5], changed[5])  # KDA still carries token 2 forward
        copyprobe.zero_outputs(model, KimiDeltaAttention)
        base = model.compute_logits(train_forward(model, [ids]))
        changed = model.compute_logits(train_forward(model, [other]))
        torch.testing.assert_close(base[3:], changed[3:])  # nothing carries it any more
        assert not torch.allclose(base[2], changed[2])
    finally:
        model.load_state_dict(state)


def test_cli_scores_a_snapshot_and_reports_a_missing_run(model_vocab, tmp_path, capsys):
    model, vocab = model_vocab
    assert copyprobe.main([str(tmp_path)]) == 2
    assert "no compact snapshots" in capsys.readouterr().err
    save_compact(model, tmp_path / "compact" / "step_4.safetensors", {"config": str(DEFAULT_CONFIG)})
    (tmp_path / "used_ids.json").write_text(json.dumps(vocab.ids))
    assert copyprobe.main([str(tmp_path), "--lengths", "6"]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and out.count("n=6: ") == 3 and out.count("  layer ") == 3
