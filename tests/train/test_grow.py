"""Starting a run from a shipped-layout checkpoint: same shapes import exactly, wider KDA heads grow."""

import json

import pytest
import torch

import training.kda_autograd as kda_train
from k3serve.core.config import ModelConfig
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.models.kimi import build_model
from training import tasks
from training.export import compact_config, export
from training.forward import train_forward
from training import grow
from training.grow import import_checkpoint
from training.init import init_for_training
from training.qat import enable_qat
from training.render import encode_sample
from training.tok import load_tokenizer
from training.config import DEFAULT_CONFIG
from training.vocab import CompactVocab


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A trained-looking compact model (random, bf16-exact masters), its export and a sample."""
    import random

    tok = load_tokenizer()
    ids, _ = encode_sample(tasks.make("tool", random.Random(3), thinking=False), tok)
    full = ModelConfig.from_file(DEFAULT_CONFIG)
    vocab = CompactVocab(ids, full.text.vocab_size)
    torch.manual_seed(0)
    model = build_model(compact_config(full, vocab))
    init_for_training(model, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    enable_qat(model)
    out = tmp_path_factory.mktemp("shipped")
    model_dir, _ = export(model, vocab, DEFAULT_CONFIG, out)
    return model, vocab, model_dir, torch.tensor(vocab.to_compact(ids[:120])), full


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(train_forward(model, [ids]))


def test_same_shapes_import_the_checkpoint_exactly(shipped):
    model, vocab, model_dir, ids, full = shipped
    fresh = build_model(compact_config(full, vocab))
    init_for_training(fresh, 7)
    counts = import_checkpoint(fresh, vocab, model_dir)
    assert counts["grown"] == 0 and counts["untrained_rows"] == 0
    enable_qat(fresh)  # the shipped experts are the MXFP4 grid, so QAT over them changes nothing
    assert torch.allclose(_logits(fresh, ids), _logits(model, ids), atol=1e-4)


def test_wider_kda_heads_keep_the_old_channels_and_start_silent(shipped, tmp_path, monkeypatch):
    model, vocab, model_dir, ids, full = shipped
    raw = json.loads(DEFAULT_CONFIG.read_text())
    raw["text_config"]["linear_attn_config"]["head_dim"] = 32
    (tmp_path / "wide.json").write_text(json.dumps(raw))
    wide = build_model(compact_config(ModelConfig.from_file(tmp_path / "wide.json"), vocab))
    init_for_training(wide, 7)
    counts = import_checkpoint(wide, vocab, model_dir)
    assert counts["grown"] == len(full.text.linear_attn.kda_layers)
    layer = next(m for m in wide.modules() if isinstance(m, KimiDeltaAttention))
    o = layer.o_proj.weight.view(-1, layer.num_heads, 32)
    assert torch.all(o[:, :, 16:] == 0) and o[:, :, :16].abs().sum() > 0
    assert torch.all(layer.f_b_proj.weight.view(layer.num_heads, 32, 32)[:, :, 16:] == 0)
    assert layer.q_proj.weight.view(layer.num_heads, 32, -1)[:, 16:].abs().sum() > 0  # new channels can learn
    # The growth is exact up to the new channels' small start and two documented effects: the K^-1/2 score
    # scale and the output norm's eps. With silent new channels, the old scale and no eps, the grown model
    # computes the shipped one's function.
    monkeypatch.setattr(grow, "NEW_CHANNEL_SCALE", 0.0)
    init_for_training(wide, 7)
    import_checkpoint(wide, vocab, model_dir)
    monkeypatch.setattr(kda_train, "default_scale", lambda scale, K: 16 ** -0.5)
    for m in list(model.modules()) + list(wide.modules()):
        if isinstance(m, KimiDeltaAttention):
            monkeypatch.setattr(m.o_norm, "eps", 0.0)
    enable_qat(wide)
    want, got = _logits(model, ids), _logits(wide, ids)
    assert torch.allclose(got, want, atol=0.05, rtol=0.01), (got - want).abs().max()


def test_a_checkpoint_of_another_width_is_refused(shipped, tmp_path):
    _, vocab, model_dir, _, _ = shipped
    raw = json.loads(DEFAULT_CONFIG.read_text())
    raw["text_config"]["hidden_size"] = 96
    (tmp_path / "c.json").write_text(json.dumps(raw))
    other = build_model(compact_config(ModelConfig.from_file(tmp_path / "c.json"), vocab))
    with pytest.raises(ValueError, match="does not fit"):
        import_checkpoint(other, vocab, model_dir)
