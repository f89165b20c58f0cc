"""Parity with HF transformers' KimiLinearForCausalLM on checkpoints written by its own save_pretrained.

fp32 logits must match within 1e-4 max abs for a full prefill and for prefill-then-decode token by token
through k3serve's own caches (compared with HF's logits at the same positions of one full forward).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3serve.models.generate import SimpleRunner  # noqa: E402
from k3serve.models.loader import load_model  # noqa: E402

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16,
            qk_nope_head_dim=16, num_local_experts=8, num_experts_per_tok=2, linear_head_dim=16,
            linear_num_heads=4, pad_token_id=511, bos_token_id=510, eos_token_id=509)
CONFIGS = {
    "plain": dict(q_lora_rank=None, linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                                        "full_attn_layers": [2, 4], "kda_layers": [1, 3]}),
    "grouped-routing": dict(q_lora_rank=None, num_local_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                            linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                                "full_attn_layers": [4], "kda_layers": [1, 2, 3]}),
    "q-lora-2-shared": dict(q_lora_rank=24, n_shared_experts=2, num_hidden_layers=5,
                            linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                                "full_attn_layers": [1, 5], "kda_layers": [2, 3, 4]}),
}


def _hf_checkpoint(name: str, tmp_path):
    cfg = KimiLinearConfig(**{**BASE, **CONFIGS[name]})
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move every tensor off its init value so no term can hide
        for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "A_log" in pname:
                continue
            scale = 0.05 if p.dim() == 1 else 0.02
            p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(tmp_path)
    return model


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _hf_checkpoint(request.param, path)
    ours, _ = load_model(path, dtype=torch.float32, progress=False)
    return hf, ours


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 509, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", [70, 9])
def test_prefill_and_decode_match_transformers(pair, length):
    hf, ours = pair
    ids = _tokens(length, length)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # full prefill: every position's logits (one sequence, all tokens)
    runner = SimpleRunner(ours, max_seqs=1, max_len=length + 1)
    full = torch.stack([runner.step({0: ids})[0]])
    assert (full[0] - ref[-1]).abs().max() < 1e-4
    # prefill half, then decode token by token through the caches
    split = length // 2
    runner = SimpleRunner(ours, max_seqs=1, max_len=length + 1)
    got = [runner.step({0: ids[:split]})[0]]
    for t in ids[split:]:
        got.append(runner.step({0: [t]})[0])
    got = torch.stack(got)
    want = ref[split - 1:]
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4


def test_all_positions_match_with_a_batch(pair):
    """Two sequences in one packed prefill, every position checked via one-token-at-a-time decoding."""
    hf, ours = pair
    seqs = [_tokens(13, 3), _tokens(5, 4)]
    runner = SimpleRunner(ours, max_seqs=2, max_len=16)
    step = runner.step({0: seqs[0][:1], 1: seqs[1][:1]})
    outs = [[step[0]], [step[1]]]
    for t in range(1, 13):
        batch = {i: [s[t]] for i, s in enumerate(seqs) if t < len(s)}
        logits = runner.step(batch)
        for row, i in enumerate(batch):
            outs[i].append(logits[row])
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0].float()
        assert (torch.stack(outs[i]) - ref).abs().max() < 1e-4
