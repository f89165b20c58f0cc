"""Worker ranks number and fill their caches as rank 0 does: after a workload with prefix-cache hits,
snapshots and preemption, every rank's MLA blocks (the replicated latent cache) hash the same. The KDA rows
are each rank's own heads; the greedy parity tests show them right (rank 0's logits sum every rank's heads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3serve.engine.ranks import free_port, rank_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # every rank loads the model: ~10 s alone, more on a loaded box
@pytest.mark.parametrize("tp", [2])
def test_worker_caches_mirror_rank_0(tp):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.mirror_rank", str(tp)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **rank_env(r, tp, r, "127.0.0.1", port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(tp)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * tp, "\n".join(o[-2000:] for o in outs)
    assert "cache hashes per rank" in outs[0]
