"""The pieces of a hand-off under tensor parallelism that need no second process: a rank's KDA rows packed
into one byte buffer and back (mixed dtypes, exact), a buffer of the wrong size refused; and `serve --role`
with `-tp 2` accepted by the CLI checks (the multi-rank path itself: tests/pd/test_tp_handoff.py, slow)."""

from __future__ import annotations

import argparse

import pytest
import torch

from k3serve.engine.pd import rank_rows


def test_pack_unpack_round_trip_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"kda_state.0": torch.randn(2, 4, 4, generator=g),
               "kda_conv.0": torch.randn(24, 3, generator=g).to(torch.bfloat16),
               "kda_state.2": torch.randn(2, 4, 4, generator=g).to(torch.float64)}
    like = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    buf = rank_rows._pack(list(tensors.values()))
    assert buf.dtype == torch.uint8 and buf.numel() == sum(t.numel() * t.element_size() for t in tensors.values())
    back = rank_rows._unpack(buf, like)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with pytest.raises(ValueError, match="bytes arrived"):
        rank_rows._unpack(torch.cat([buf, buf[:4]]), like)


def _args(**kw) -> argparse.Namespace:
    from k3serve.entrypoints import parallel_cli

    p = argparse.ArgumentParser()
    parallel_cli.add_arguments(p)
    ns = p.parse_args([f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
                       for k, v in kw.items() if k != "role"])
    ns.role = kw.get("role", "both")
    return ns


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_role_with_tensor_parallel_is_accepted(role: str) -> None:
    from k3serve.core.config import ModelConfig
    from k3serve.entrypoints import parallel_cli
    from k3serve.models.registry import packaged_config

    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    fields = parallel_cli.check_parallel(_args(tensor_parallel_size=2, role=role), cfg)
    assert fields["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match=f"--role {role} with --data-parallel-size"):
        parallel_cli.check_parallel(_args(tensor_parallel_size=2, data_parallel_size=2,
                                          enable_expert_parallel=True, role=role), cfg)
