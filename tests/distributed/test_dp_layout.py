"""Attention data parallel with the experts over every rank (``ep == tp * dp``): the layout is checked up front
(one-line errors), ranks find their tp and ep places, and the serve flags turn into one world's engine spec."""

from __future__ import annotations

import argparse

import pytest

from k3serve.core.distributed import Parallel, ParallelLayout
from k3serve.engine.core_spec import CoreSpec
from k3serve.entrypoints import parallel_cli


def test_layout_accepts_ep_over_every_rank_and_refuses_the_rest():
    lay = ParallelLayout(tp=2, dp=2, ep=4)
    assert lay.world_size == 4 and lay.lockstep
    places = [(p.dp_rank, p.tp_rank, p.ep_rank) for p in (Parallel(lay, r) for r in range(4))]
    assert places == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert not ParallelLayout(tp=2, dp=2).lockstep  # plain dp: replicas share nothing
    assert Parallel(ParallelLayout(tp=2, ep=2), 1).ep_rank == 1
    with pytest.raises(ValueError, match="ep must be tp\\*dp \\(4\\)"):
        ParallelLayout(tp=2, dp=2, ep=2)
    with pytest.raises(ValueError, match="ep must be 1, tp \\(2\\) or tp\\*dp \\(4\\)"):
        ParallelLayout(tp=2, dp=2, ep=3)
    with pytest.raises(ValueError, match=r"experts \(64\) cannot be split over 6 ranks"):
        ParallelLayout(tp=2, dp=3, ep=6).check(experts=64)


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    parallel_cli.add_arguments(p)
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    return p.parse_args(flags)


def test_serve_flags_make_one_world_only_with_expert_parallel():
    from k3serve.core.config import ModelConfig
    from k3serve.models.registry import packaged_config

    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    fields = parallel_cli.check_parallel(_args(data_parallel_size=2, tensor_parallel_size=2,
                                               enable_expert_parallel=True), cfg)
    assert fields["data_parallel_size"] == 2
    spec = CoreSpec(model="m", input_addr="", output_addr="", **fields)
    assert spec.layout() == ParallelLayout(tp=2, ep=4, dp=2)
    plain = parallel_cli.check_parallel(_args(data_parallel_size=2, tensor_parallel_size=2), cfg)
    assert "data_parallel_size" not in plain  # each replica its own world, as before
    assert CoreSpec(model="m", input_addr="", output_addr="", **plain).layout() == ParallelLayout(tp=2)
    with pytest.raises(ValueError, match=r"experts \(64\) cannot be split over 3 ranks"):
        parallel_cli.check_parallel(_args(data_parallel_size=3, enable_expert_parallel=True), cfg)


def test_dp_across_hosts_keeps_tp_within_a_host_and_numbers_the_rpc_ports():
    """-dp 4 --nnodes 2: two replicas per host, tp inside each host; host 0 listens for the remote two on four
    ports; plain replicas keep a free local master port each, lockstep ones meet at one."""
    from k3serve.core.config import ModelConfig
    from k3serve.engine.dp_hosts import DEFAULT_RPC_PORT, host_replicas, rpc_addrs
    from k3serve.models.registry import packaged_config

    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    fields = parallel_cli.check_parallel(_args(data_parallel_size=4, tensor_parallel_size=2, nnodes=2,
                                               data_parallel_address="10.0.0.1", data_parallel_rpc_port=30000), cfg)
    assert (fields["nnodes"], fields["dp_nnodes"], fields["dp_replicas"]) == (1, 2, 4)
    assert (fields["dp_address"], fields["dp_rpc_port"], fields["master_port"]) == ("10.0.0.1", 30000, None)
    assert parallel_cli.DEFAULT_RPC_PORT == DEFAULT_RPC_PORT  # the CLI's copy (it does not import the engine)
    spec = CoreSpec(model="m", input_addr="", output_addr="", **fields)
    assert spec.layout() == ParallelLayout(tp=2)  # each replica its own world within its host
    assert list(host_replicas(4, 2, 0)) == [0, 1] and list(host_replicas(4, 2, 1)) == [2, 3]
    assert rpc_addrs("10.0.0.1", 30000, 2, 2) == ("tcp://10.0.0.1:30000", "tcp://10.0.0.1:30001")
    assert rpc_addrs("10.0.0.1", 30000, 3, 2) == ("tcp://10.0.0.1:30002", "tcp://10.0.0.1:30003")
    assert rpc_addrs("fd00::1", 30000, 1, 1)[0] == "tcp://[fd00::1]:30000"
    with pytest.raises(ValueError, match="runs on host 0"):
        rpc_addrs("10.0.0.1", 30000, 1, 2)
    # replica 3 is the second one on its host: its GPUs follow the first's
    cuda = CoreSpec(model="m", input_addr="", output_addr="", **{**fields, "device": "cuda"}, dp_rank=3,
                    local_replicas=2)
    assert [cuda.rank_device(r) for r in (0, 1)] == ["cuda:2", "cuda:3"]
    step = parallel_cli.check_parallel(_args(data_parallel_size=2, tensor_parallel_size=2, nnodes=2, master_addr="h",
                                             enable_expert_parallel=True), cfg)
    assert step["dp_address"] == "h" and step["master_port"] == parallel_cli.DEFAULT_MASTER_PORT
    assert CoreSpec(model="m", input_addr="", output_addr="", **step).layout() == ParallelLayout(tp=2, ep=4, dp=2)


def test_remote_replica_that_never_connects_is_one_clear_error():
    import asyncio

    from k3serve.core.process import free_port
    from k3serve.engine.client import EngineDead
    from k3serve.engine.dp_hosts import RemoteEngineClient, rpc_addrs

    async def go():
        port = free_port()
        client = RemoteEngineClient({"model": "m", "dp_rank": 1}, rpc_addrs("127.0.0.1", port, 1, 1),
                                    startup_timeout_s=0.3)
        try:
            with pytest.raises(EngineDead, match=f"replica 1 did not connect to tcp://127.0.0.1:{port} within"):
                await client.start()
        finally:
            await client.shutdown()

    asyncio.run(go())


def test_eplb_over_data_parallel_splits_over_every_expert_rank():
    """With the experts over tp x dp ranks, EPLB's slots divide over all of them (not the tp ranks alone)."""
    from k3serve.core.config import ModelConfig
    from k3serve.models.registry import packaged_config

    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))  # 64 experts
    fields = parallel_cli.check_parallel(_args(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                                               eplb_interval=3, eplb_redundant_experts=4), cfg)
    assert (fields["eplb_interval"], fields["eplb_redundant_experts"], fields["data_parallel_size"]) == (3, 4, 2)
    fields = parallel_cli.check_parallel(_args(data_parallel_size=2, enable_expert_parallel=True, eplb_interval=3), cfg)
    assert fields["eplb_interval"] == 3  # tp 1: the two replicas' cores are the expert ranks
    with pytest.raises(ValueError, match="64 experts \\+ 2 cannot be split evenly over 4 ranks"):
        parallel_cli.check_parallel(_args(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                                          eplb_interval=3, eplb_redundant_experts=2), cfg)
    with pytest.raises(ValueError, match="need --enable-expert-parallel"):  # plain replicas of one rank each
        parallel_cli.check_parallel(_args(data_parallel_size=2, eplb_interval=3), cfg)
