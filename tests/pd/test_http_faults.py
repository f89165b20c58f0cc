"""Faults through the real processes (`serve --role prefill`, `serve --role decode`, `route`): the decode worker
killed (SIGKILL, its whole process group) while a hand-off is in flight frees every slot and block on the
prefill worker at once, well inside its `--handoff-timeout` (600 s here): the router sees the decode worker
fail and nacks the hand-off. The client gets an error answer, never a silent one."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.pd.cluster import cluster, metric

pytestmark = pytest.mark.slow  # three servers; ~30 s idle
MODEL = "k3-tiny-random"
ENGINE = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--gpu-memory-utilization", "0.02"]


def test_killing_the_decode_worker_mid_handoff_frees_the_prefill_worker(tmp_path):
    with cluster(MODEL, ENGINE, tmp_path / "servers.log", two_by_two=False, both=False, handoff_timeout=600) as urls:
        prefill = urls["prefill"]
        answer: dict = {}

        def ask() -> None:
            body = {"model": MODEL, "prompt": list(range(200, 460)), "max_tokens": 400, "ignore_eos": True,
                    "temperature": 0}
            try:
                r = httpx.post(urls["router"] + "/v1/completions", json=body, timeout=120)
                answer["status"], answer["body"] = r.status_code, r.json()
            except httpx.HTTPError as e:  # noqa: BLE001 - recorded, asserted below
                answer["error"] = e

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 120
        while not metric(prefill, "k3serve:handoffs_held"):  # its first token is out: the hand-off is pinned
            assert time.monotonic() < deadline and t.is_alive(), answer
            time.sleep(0.02)
        os.killpg(urls["procs"]["decode"].pid, signal.SIGKILL)
        t.join(120)
        assert answer.get("status", 0) >= 500 and answer["body"]["error"]["message"], answer
        deadline = time.monotonic() + 30  # << 600 s: only the nack frees it this soon
        while metric(prefill, "k3serve:handoffs_held") or metric(prefill, "vllm:kv_cache_usage_perc") \
                or metric(prefill, "k3serve:kda_state_slots_free") != metric(prefill, "k3serve:kda_state_slots"):
            assert time.monotonic() < deadline, "the prefill worker still holds the hand-off"
            time.sleep(0.2)
        assert httpx.get(urls["router"] + "/router/workers", timeout=10).json()["nacks"] >= 1
