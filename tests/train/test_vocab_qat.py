"""Compact-vocabulary loss equals the exported model's full-vocabulary loss; MXFP4 QAT equals packing."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from k3serve.core.config import ModelConfig
from k3serve.layers.moe import RoutedExperts
from k3serve.models.registry import CONFIG_DIR
from k3serve.ops.mx import mxfp4_dequantize, mxfp4_quantize
from training.qat import enable_qat, fake_quant_mxfp4, pack_experts
from training.vocab import CompactVocab


def test_compact_loss_is_full_vocab_loss_with_zero_rows():
    g = torch.Generator().manual_seed(0)
    V, d = 300, 8
    used = sorted(torch.randperm(V, generator=g)[:37].tolist())
    vocab = CompactVocab(used, V)
    rows = torch.randn(len(vocab), d, generator=g)
    h = torch.randn(11, d, generator=g)
    targets = torch.tensor(used)[torch.randint(0, len(used), (11,), generator=g)]
    full = vocab.expand_rows(rows)
    assert full.abs().sum(1).ne(0).sum() == len(used)
    want = F.cross_entropy(h @ full.t(), targets)
    got = vocab.loss(h @ rows.t(), torch.tensor(vocab.to_compact(targets.tolist())))
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="not in the compact vocabulary"):
        vocab.to_compact([next(i for i in range(V) if i not in set(used))])


def test_fake_quant_is_straight_through():
    w = torch.randn(4, 64, requires_grad=True)
    q = fake_quant_mxfp4(w)
    assert torch.equal(q.detach(), mxfp4_dequantize(*mxfp4_quantize(w.detach())))
    (q * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(4, 64))


def test_packed_experts_compute_what_qat_trained():
    cfg = ModelConfig.from_file(CONFIG_DIR / "k3-default.json").text
    g = torch.Generator().manual_seed(1)
    master, packed = RoutedExperts(cfg, False), RoutedExperts(cfg, True)
    with torch.no_grad():
        master.w13.copy_(torch.randn(master.w13.shape, generator=g) * 0.1)
        master.w2.copy_(torch.randn(master.w2.shape, generator=g) * 0.1)
    enable_qat(master)
    pack_experts(master, packed)
    u = torch.randn(13, cfg.expert_width, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_token] for _ in range(13)])
    w = torch.rand(13, cfg.num_experts_per_token, generator=g)
    assert torch.allclose(master(u, w, ids), packed(u, w, ids), atol=1e-5)
    with pytest.raises(ValueError, match="float master"):
        enable_qat(packed)
