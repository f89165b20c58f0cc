"""Expert-parallel weights without a process group: which checkpoint tensors a rank reads and where they land."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.core.distributed import Parallel, ParallelLayout
from k3serve.layers.eplb import Placement
from k3serve.layers.moe import SparseMoE
from k3serve.layers.moe_ep import EPSparseMoE, LocalExperts, ep_state_dict
from k3serve.layers.weights import collect_slots
from k3serve.models.loader import load_model
from k3serve.models.registry import packaged_config
from k3serve.testing import write_random_checkpoint


def _text(**changes):
    return dataclasses.replace(ModelConfig.from_file(packaged_config("k3-tiny")).text, **changes)


def _rank(rank: int, ep: int) -> Parallel:
    return Parallel(ParallelLayout(tp=ep, ep=ep), rank)


def _random_moe(cfg) -> SparseMoE:
    moe = SparseMoE(cfg, False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return moe


def test_rank_reads_only_its_experts(tmp_path):
    ckpt = write_random_checkpoint("k3-tiny", tmp_path, seed=1)
    full, cfg = load_model(ckpt, progress=False)
    part, _ = load_model(ckpt, progress=False, par=_rank(1, 2))
    E = cfg.text.num_experts
    local = [m for m in part.modules() if isinstance(m, LocalExperts)]
    assert local and all(m.global_ids == tuple(range(E // 2, E)) for m in local)
    full_sd, part_sd = full.state_dict(), part.state_dict()
    moe_keys = [k for k in part_sd if ".block_sparse_moe." in k]  # attention and vocab are tp-sharded besides
    assert moe_keys and set(moe_keys) == {k for k in full_sd if ".block_sparse_moe." in k}
    for key in moe_keys:
        t = part_sd[key]
        want = full_sd[key][E // 2:] if ".experts.w" in key else full_sd[key]
        assert torch.equal(t, want), key
    slots = collect_slots(part)
    foreign = [s for s in slots if s.load is None]
    assert len(foreign) == len(local) * (E // 2) * 6  # w1/w2/w3, packed + scale, for the other half
    with pytest.raises(Exception, match="another rank"):
        foreign[0].dump()


def test_replicas_on_one_rank_all_load(tmp_path):
    cfg = _text(num_experts=4, num_experts_per_token=2)
    ref = _random_moe(cfg)
    stored = {s.key: s.dump() for s in collect_slots(ref)}
    placement = Placement(4, ((0, 3, 1), (2, 3, 3)))  # rank 1 holds expert 3 twice
    ep = EPSparseMoE(cfg, False, _rank(1, 2), placement)
    for s in collect_slots(ep):
        if s.load is not None:
            s.load(stored[s.key])
    assert torch.equal(ep.experts.w13, ref.experts.w13[[2, 3, 3]])
    assert torch.equal(ep.experts.w2, ep_state_dict(ref.state_dict(), placement, 1)["experts.w2"])


def test_single_rank_path_equals_sparse_moe():
    cfg = _text(num_experts=8, num_experts_per_token=2)
    ref = _random_moe(cfg).eval()
    ep = EPSparseMoE(cfg, False, Parallel()).eval()
    ep.load_state_dict(ref.state_dict())
    x = torch.randn(64, cfg.hidden_size)  # 64·8 rows > DENSE_MAX_ROWS: the single process sums slots in order
    with torch.inference_mode():
        assert torch.equal(ep(x), ref(x))
    assert sum(ep.expert_load.snapshot()) == 64 * 2 and ep.traffic["dispatch_bytes"] == 0


def test_experts_that_do_not_split_are_one_clear_error():
    with pytest.raises(ValueError, match="64 experts cannot be split over 3 ranks"):
        EPSparseMoE(_text(), False, _rank(0, 3))
    with pytest.raises(ValueError, match="placement is for 4 experts on 2 ranks"):
        EPSparseMoE(_text(), False, _rank(0, 2), Placement(4, ((0, 1), (2, 3))))
