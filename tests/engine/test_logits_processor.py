"""The per-request logits-processor hook: call order (prepare before the forward, apply after it, only in
steps that sample), per-request isolation inside a batch, chunked prefill and preemption, and logprobs that
stay those of the raw distribution."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100, 200, 300], [42] * 9]
N = 5


@pytest.fixture(scope="module")
def model(eh):
    return eh.get_model("kimi-linear-tiny-random")


class Forcer:
    """Allows only ``seq[len(outputs)]``; records its calls (and the raw rows it saw) in ``log``."""

    def __init__(self, seq: list[int], log: list):
        self.seq, self.log, self.raw = seq, log, []
        self._next: int | None = None

    def prepare(self, output_token_ids):
        self.log.append(("prepare", list(output_token_ids)))
        self._next = self.seq[len(output_token_ids)]

    def apply(self, logits):
        self.log.append(("apply", None))
        self.raw.append(logits.clone())
        keep = logits[self._next].clone()
        logits.fill_(float("-inf"))
        logits[self._next] = keep


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw)


def _run(engine, eh, procs: dict[int, object], params=None):
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params or _greedy(), logits_processor=procs.get(i))
    done = eh.drain(engine)
    return [done[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("chunk", [4, 512])
def test_forced_tokens_call_order_and_isolation(model, eh, chunk):
    plain = [o.token_ids for o in _run(eh.make_engine(model), eh, {})]
    seq = [7, 7, 1999, 3, 0]
    log: list = []
    engine = eh.make_engine(model, max_num_batched_tokens=chunk)
    hook = engine.runner.model.register_forward_pre_hook(lambda *_: log.append(("forward", None)))
    try:
        outs = _run(engine, eh, {0: Forcer(seq, log)}, _greedy(logprobs=1))
    finally:
        hook.remove()
    assert outs[0].token_ids == seq and [o.token_ids for o in outs[1:]] == plain[1:]
    # prepare (with the outputs so far) -> forward -> apply, once per sampling step; prompt-only steps skip it
    calls = [c for c in log if c[0] != "forward"]
    assert calls == [c for k in range(N) for c in (("prepare", seq[:k]), ("apply", None))]
    for k in range(N):
        i = log.index(("prepare", seq[:k]))
        assert log[i + 1] == ("forward", None) and ("apply", None) in log[i + 2:]
    if chunk == 4:
        assert log.count(("forward", None)) > N  # the 13-token prompt took several chunks


def test_logprobs_are_raw(model, eh):
    seq = [1999] * N
    forcer = Forcer(seq, [])
    out = _run(eh.make_engine(model), eh, {1: forcer}, _greedy(logprobs=3))[1]
    assert out.token_ids == seq
    for lp, raw in zip(out.logprobs, forcer.raw):
        want = torch.log_softmax(raw, dim=-1)
        assert lp[1999] == pytest.approx(float(want[1999]), abs=1e-5)  # not 0.0, its processed logprob
        top = want.topk(3)
        assert [t for t in lp if t != 1999][:3] == [t for t in top.indices.tolist() if t != 1999][:3]


class PooledBan:
    """A guided-decoding-shaped processor: the mask is built on a thread pool while the forward runs."""

    pool = ThreadPoolExecutor(max_workers=1)

    def __init__(self, banned: int):
        self.banned, self.future, self.seen = banned, None, []

    def prepare(self, output_token_ids):
        self.seen = list(output_token_ids)
        self.future = self.pool.submit(lambda: torch.tensor([self.banned]))

    def apply(self, logits):
        logits[self.future.result()] = float("-inf")


def test_threaded_mask_and_preemption(model, eh):
    from k3serve.models.cache import cache_spec

    plain = _run(eh.make_engine(model), eh, {})[2].token_ids
    spec = cache_spec(model[0], torch.float32)
    engine = eh.make_engine(model, max_num_seqs=3, enable_prefix_caching=False, max_model_len=32,
                            kv_cache_memory=3 * spec.kda_bytes_per_slot + 2 * 16 * spec.mla_bytes_per_token)
    ban = PooledBan(plain[0])
    for i in range(3):
        engine.add_request(f"w{i}", [9] * 14, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("p", PROMPTS[2], _greedy(), logits_processor=ban)
    done = eh.drain(engine)
    assert done["p"].token_ids[0] != plain[0] and plain[0] not in done["p"].token_ids
    assert ban.seen == done["p"].token_ids[:-1]
    assert engine.stats().num_preemptions > 0


def test_bad_processor_is_refused(model, eh):
    engine = eh.make_engine(model)
    with pytest.raises(ValueError, match="^logits_processor:"):
        engine.add_request("x", [1, 2], _greedy(), logits_processor=lambda logits: logits)
    assert not engine.has_unfinished_requests()
