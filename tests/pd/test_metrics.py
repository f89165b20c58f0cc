"""The hand-off counters on ``/metrics``, per role (each worker reports its own side): bytes, transfer time,
queue time and the prompt positions not transferred because the decode side's prefix cache held them. Two
hand-offs through ``PDRole`` (the engine-core's view, real ZMQ/TCP) in one process; the second shares the
first's full blocks, so its latents for them never cross."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from k3serve.engine.messages import AddRequest, HandoffSource, Stats
from k3serve.engine.pd.role import PDRole
from k3serve.engine.sampling_params import SamplingParams
from k3serve.server.metrics import Metrics

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
NAMES = ("handoff_transfers", "handoff_failures", "handoff_bytes", "handoff_transfer_seconds",
         "handoff_queue_seconds", "handoff_cached_tokens")


def _metrics(role: PDRole) -> dict[str, float]:
    text = Metrics("m", lambda: Stats(**role.stats()), lambda: 0).render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _hand_off(pre: PDRole, dec: PDRole, rid: str, prompt: list[int], pd) -> None:
    pd.prefill(pre.engine, rid, prompt, PARAMS)
    pre.pump()  # its core loop pumps after the step that sampled the first token: the hold starts
    time.sleep(0.05)  # held for a measurable while before anyone fetches it
    dec.add(AddRequest(rid, prompt, PARAMS, handoff=HandoffSource(pre.prefill.sender.address, rid)))
    deadline = time.monotonic() + 10
    while pre.engine.scheduler.held or dec.decode.waiting or dec.decode.fetching:
        assert time.monotonic() < deadline, "the hand-off did not complete"
        pre.pump()
        assert all(o.error is None for o in dec.pump())
        time.sleep(0.01)
    pd.drain(dec.engine)


def test_handoff_metrics_per_role(tiny, pd):
    pre, dec = PDRole(pd.make_engine(tiny), "prefill"), PDRole(pd.make_engine(tiny), "decode")
    try:
        bs = dec.engine.blocks.block_size
        first = pd.prompts(1, 2 * bs + 5, 2 * bs + 5, seed=41)[0]
        _hand_off(pre, dec, "a", first, pd)
        one = {role: _metrics(r) for role, r in (("prefill", pre), ("decode", dec))}
        _hand_off(pre, dec, "b", first[: 2 * bs] + [7, 8, 9], pd)  # d holds a's 2 full blocks
        two = {role: _metrics(r) for role, r in (("prefill", pre), ("decode", dec))}
    finally:
        pre.close()
        dec.close()
    for m in (one, two):
        for role in ("prefill", "decode"):
            assert all(f"k3serve:{n}_total" in m[role] for n in NAMES), (role, sorted(m[role]))
    for role in ("prefill", "decode"):
        assert one[role]["k3serve:handoff_transfers_total"] == 1 and two[role]["k3serve:handoff_transfers_total"] == 2
        assert one[role]["k3serve:handoff_failures_total"] == 0
        assert one[role]["k3serve:handoff_bytes_total"] > 0
        assert one[role]["k3serve:handoff_transfer_seconds_total"] > 0
        assert one[role]["k3serve:handoff_cached_tokens_total"] == 0
        assert two[role]["k3serve:handoff_cached_tokens_total"] == 2 * bs
    # the prefill side's queue time is how long it held "a" until the ack: at least the sleep
    assert one["prefill"]["k3serve:handoff_queue_seconds_total"] >= 0.05
    # b's transfer left out 2 blocks of latents: fewer bytes than a's, though its prompt is 2 tokens shorter only
    a_bytes = one["decode"]["k3serve:handoff_bytes_total"]
    b_bytes = two["decode"]["k3serve:handoff_bytes_total"] - a_bytes
    assert b_bytes < a_bytes * 0.9
    assert two["prefill"]["k3serve:handoff_bytes_total"] >= two["decode"]["k3serve:handoff_bytes_total"]
