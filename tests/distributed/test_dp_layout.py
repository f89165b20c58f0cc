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
