"""A whole k3-tiny model with its experts spread over 2 gloo ranks decodes like the single process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "layers"))  # spawned ranks import ep_workers by name

import ep_workers  # noqa: E402

from k3serve.models.generate import SimpleRunner, greedy_generate  # noqa: E402
from k3serve.models.loader import load_model  # noqa: E402
from k3serve.testing import write_random_checkpoint  # noqa: E402


@pytest.mark.slow  # ~50 s wall on the shared 2-core machine (spawn, load and decode on 2 ranks)
def test_k3_tiny_ep2_greedy_matches_single_process(tmp_path):
    ckpt = write_random_checkpoint("k3-tiny", tmp_path / "ckpt", seed=3, dtype=torch.float32)
    model, cfg = load_model(ckpt, progress=False)
    want = greedy_generate(model, ep_workers.PROMPTS, 6)
    want_logits = SimpleRunner(model, max_seqs=2, max_len=32).step(dict(enumerate(ep_workers.PROMPTS)))
    ep_workers.spawn(ep_workers.greedy_case, 2, str(ckpt), str(tmp_path), 6)
    for rank in range(2):
        got = torch.load(tmp_path / f"greedy{rank}.pt")
        assert got["experts_held"] == [cfg.text.num_experts // 2]  # each rank loaded only its half
        assert got["tokens"] == want
        # MXFP4 experts: the single-process combine sums slots in order, as the EP combine does
        assert torch.equal(got["logits"], want_logits), (got["logits"] - want_logits).abs().max()
