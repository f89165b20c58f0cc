"""Each engine process of a host takes its share of the host's cores (not all of them), and OpenMP waiters
sleep instead of spinning, unless the user set the variables: processes sharing cores must not starve."""

from __future__ import annotations

import os

import pytest

from k3serve.core.process import compute_env
from k3serve.engine.core_spec import CoreSpec, rank_threads


def spec(**kw) -> CoreSpec:
    return CoreSpec(model="k3-tiny-random", input_addr="", output_addr="", **kw)


@pytest.mark.parametrize(("kw", "cores", "threads"), [
    ({}, 2, 2),
    ({"tensor_parallel_size": 2}, 2, 1),
    ({"local_replicas": 2}, 2, 1),
    ({"tensor_parallel_size": 2, "local_replicas": 2}, 16, 4),
    ({"tensor_parallel_size": 4}, 2, 1),  # never 0
    ({"tensor_parallel_size": 8, "nnodes": 2}, 16, 4),  # 4 ranks on this host
])
def test_rank_threads_split_the_host_cores(monkeypatch, kw, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads(spec(**kw), cores=cores) == threads


def test_rank_threads_leave_a_user_setting_alone(monkeypatch):
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_threads(spec(tensor_parallel_size=2), cores=2) == torch.get_num_threads()


def test_compute_env_makes_openmp_wait_passively_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert compute_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert compute_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert compute_env({})["K3SERVE_PARENT_PID"] == str(os.getpid())
