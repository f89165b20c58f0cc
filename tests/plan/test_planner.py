"""Layout memory split, minimum replicas, capacity and rooflines of the planner."""

from __future__ import annotations

import pytest

from k3serve.plan.gpus import GPUS, lookup
from k3serve.plan.layout import Layout, layout_problem, stage_bounds, stage_memory
from k3serve.plan.planner import Planner, PlanInputs, candidate_layouts, fit_layout
from k3serve.plan.roofline import distinct_experts

M = 2**20


@pytest.fixture(scope="module")
def planner(k3):
    return Planner(k3)


@pytest.mark.parametrize("gpu,expected", [("B300", 8), ("GB300", 8), ("B200", 16), ("GB200", 16), ("H200", 16),
                                          ("H100", 32), ("H20", 32)])
def test_min_gpus_per_replica(planner, gpu, expected):
    assert planner.min_gpus(PlanInputs(lookup(gpu), M)) == expected


def test_rack_packing(planner):
    assert planner.plan(PlanInputs(GPUS["GB300"], M)).replicas_per_rack == 9
    gb200 = planner.plan(PlanInputs(GPUS["GB200"], M))
    assert gb200.replicas_per_rack == 4 and any("8 GPUs" in w for w in gb200.warnings)
    assert planner.plan(PlanInputs(GPUS["B300"], M)).replicas_per_rack is None  # HGX: no NVL72 rack


def test_per_gpu_weights_match_design_ledger(k3):
    """planner_ep_sandbox.md §2.3: TP/EP8 204 GB, DEP8 290 GB, TP/EP16 108 GB, TP/EP32 59 GB (+0.9 GB vision)."""
    for lay, gb in ((Layout(8), 204), (Layout(1, 1, 8), 290), (Layout(16), 108), (Layout(32), 59)):
        (stage,) = stage_memory(k3, lay)
        assert stage.weights / 1e9 == pytest.approx(gb + 0.9, abs=1.5), lay
    assert not fit_layout(k3, PlanInputs(GPUS["B300"], M), Layout(1, 1, 8)).fits  # DEP8 does not fit 288 GB
    assert fit_layout(k3, PlanInputs(GPUS["B300"], M), Layout(8)).fits


def test_cache_split_by_layout(k3):
    (tp8,) = stage_memory(k3, Layout(8))
    assert tp8.kv_bytes_per_token == 27 * 1024  # latent KV replicated on every TP rank
    assert tp8.state_bytes_per_seq * 8 == pytest.approx(428.55 * 2**20, rel=1e-4)  # KDA state head-sharded
    stages = stage_memory(k3, Layout(8, 2))
    assert sum(s.kv_bytes_per_token for s in stages) == 27 * 1024  # PP splits KV by layers
    assert [s.layers for s in stages] == [(0, 47), (47, 93)]  # vLLM: remainder from the second-to-last back
    assert stage_bounds(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]


def test_tied_head_memory(k3):
    tied = k3.replace_text(tie_word_embeddings=True)
    vocab = 163840 * 7168 * 2
    (untied1,), (tied1,) = stage_memory(k3, Layout(8)), stage_memory(tied, Layout(8))
    assert (untied1.weights - tied1.weights) * 8 == pytest.approx(vocab)  # one shared matrix on one stage
    tied2 = stage_memory(tied, Layout(8, 2))
    assert tied2[0].embedding == tied2[1].lm_head == pytest.approx(vocab / 8)  # each end stage holds a copy


def test_layout_rules(k3):
    assert layout_problem(k3, Layout(5)) is not None  # 96 heads
    assert layout_problem(k3, Layout(1, 1, 3)) is not None  # 896 experts
    assert all(lay.tp <= 8 and lay.pp <= 2 for lay in candidate_layouts(k3, GPUS["H200"], 16))
    assert any(lay.tp == 16 for lay in candidate_layouts(k3, GPUS["GB200"], 16))  # NVL72: TP across trays


def test_context_scales_kv(planner, k3):
    long = fit_layout(k3, PlanInputs(GPUS["B300"], M), Layout(8))
    short = fit_layout(k3, PlanInputs(GPUS["B300"], 131072), Layout(8))
    state = long.stages[0].state_bytes_per_seq
    assert (short.seq_bytes_per_gpu - state) * 8 == pytest.approx(long.seq_bytes_per_gpu - state)
    assert short.max_concurrency > 6 * long.max_concurrency
    fp8 = fit_layout(k3, PlanInputs(GPUS["B300"], 131072, kv_cache_dtype="fp8"), Layout(8))
    assert fp8.max_concurrency > 1.8 * short.max_concurrency


def test_more_gpus_more_capacity(planner):
    c16 = planner.plan(PlanInputs(GPUS["H200"], 131072, num_gpus=16)).fit.max_concurrency
    c32 = planner.plan(PlanInputs(GPUS["H200"], 131072, num_gpus=32)).fit.max_concurrency
    assert c32 > 2 * c16


def test_concurrency_request_grows_the_replica(planner):
    base = planner.plan(PlanInputs(GPUS["B300"], 131072))
    want = base.fit.max_concurrency + 1
    grown = planner.plan(PlanInputs(GPUS["B300"], 131072, concurrency=want))
    assert grown.replica_gpus == 2 * base.replica_gpus and grown.concurrency == want
    with pytest.raises(ValueError, match="impossible plan"):
        planner.plan(PlanInputs(GPUS["B300"], 131072, num_gpus=8, concurrency=want))


def test_impossible_and_forced(planner):
    with pytest.raises(ValueError, match="impossible plan"):
        planner.plan(PlanInputs(GPUS["H100"], M, num_gpus=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        planner.plan(PlanInputs(GPUS["B300"], 2 * M))
    forced = planner.plan(PlanInputs(GPUS["B300"], 131072, layout=Layout(8)))
    assert str(forced.layout) == "tp8pp1dp1ep8"
    assert "--tensor-parallel-size 8" in forced.commands["vllm"]
    assert "--tp 8" in forced.commands["sglang"]
    with pytest.raises(ValueError):
        PlanInputs(GPUS["B300"], 0)


def test_multi_node_commands(planner):
    p = planner.plan(PlanInputs(GPUS["H100"], 131072))
    assert p.nodes_per_replica == 4
    assert "--nnodes 4" in p.commands["sglang"] and "--node-rank $NODE_RANK" in p.commands["sglang"]
    assert "--nnodes 4" in p.k3serve_not_yet_supported and "--nnodes" not in p.commands["k3serve"]


def test_distinct_experts():
    """planner_ep_sandbox.md §3.7: T=1 -> 16, T=8 -> 120, T=64 -> 613 of 896."""
    assert distinct_experts(896, 16, 1) == pytest.approx(16)
    assert distinct_experts(896, 16, 8) == pytest.approx(120, abs=1)
    assert distinct_experts(896, 16, 64) == pytest.approx(613, abs=1)


def test_rooflines(planner):
    p = planner.plan(PlanInputs(GPUS["B300"], 8192, layout=Layout(8)))
    # batch 1, short context: ~4 ms bandwidth bound on 8x B300 TP8 (design §3.7)
    assert 2.5 < p.decode_batch1.step_ms < 6 and p.decode_batch1.bound == "memory"
    # a full batch reads nearly every expert: ~180 GB of experts per GPU plus KV, ~33 ms+ per step (§3.7)
    assert 30 < p.decode_at_concurrency.step_ms < 60
    assert p.decode_at_concurrency.tokens_per_s > 10 * p.decode_batch1.tokens_per_s
    # 8K prefill: ~95 ms of linear layers at 50% MFU plus attention
    assert 60 < p.prefill.seconds * 1e3 < 300
    h100 = planner.plan(PlanInputs(GPUS["H100"], 8192, num_gpus=32))
    # per GPU Hopper is slower: BF16 tensor cores only (W4A16 experts), 989 TF vs B300's 2.25/4.5 PF
    assert h100.prefill.seconds * 32 > 2 * p.prefill.seconds * 8
