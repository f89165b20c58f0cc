"""``engine/graph_runner.py`` on CPU with the stand-in mechanism: every decode step it takes runs the static
decode forward under ``CaptureCheck`` (so any host sync in the forward fails the test), padded to its bucket.

* the engine with graphs gives the eager engine's greedy tokens, and its logprobs within 1e-5 (the static forms
  sum in another order than the eager ones: not bit for bit), with every bucket including 1 replayed, mixed
  lengths, requests finishing mid-batch, prefix hits, and preemption;
* padding is invisible: a step of B rows gives the logits and cache writes of the same step run unpadded (a
  bucket of exactly B) within 1e-5 (CPU fp32 GEMMs round a row differently with the row count, so not bit for
  bit), and changes exactly the step's own MLA slots and KDA rows, plus the dummy block and row;
* steps the graphs do not cover (prefill chunks, more rows than max_batch) run eager;
* one-line refusals (CUDA graphs on a CPU device, with speculative decoding);
* on a GPU only (``K3SERVE_TEST_DEVICE=cuda``, benchmarks/gpu_check.sh): real CUDA graphs equal the stand-in
  (the same static forward run eagerly at the same buckets) bit for bit, tokens and logprobs, in fp32 and bf16,
  and the eager engine's tokens in fp32. Never run on this project's CPU machines."""

from __future__ import annotations

import os

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.graph_runner import GraphRunner, StandinGraphs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.step_inputs import StepInputs
from k3serve.models.cache import cache_spec

MAX_BATCH = 8
ON_GPU = os.environ.get("K3SERVE_TEST_DEVICE") == "cuda" and torch.cuda.is_available()


def _engine(tiny, graphs: str, **cfg) -> LLMEngine:
    cfg.setdefault("kv_cache_memory", 32 * 2**20)
    cfg.setdefault("max_model_len", 128)
    return LLMEngine(tiny[0], model_config=tiny[1],
                     config=EngineConfig(cuda_graphs=graphs, cuda_graph_max_batch=MAX_BATCH,
                                         cuda_graph_max_context=96, **cfg))


def _run(engine: LLMEngine, prompts, max_tokens, prefix=""):
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"{prefix}{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        assert len(x.logprobs) == len(y.logprobs)
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys()
            assert max(abs(lx[t] - ly[t]) for t in lx) < 1e-5


def test_graphs_equal_eager_at_every_bucket(tiny, eh):
    prompts = eh.random_prompts(MAX_BATCH, 2, 50, seed=3)
    # different lengths: the batch shrinks as requests finish, through buckets 8, 4, 2 and 1
    max_tokens = [1, 2, 3, 5, 6, 8, 9, 12]
    shared = eh.random_prompts(1, 40, 40, seed=4)[0]
    second = [shared + t for t in eh.random_prompts(3, 1, 9, seed=5)]
    eager, graphs = _engine(tiny, "off"), _engine(tiny, "standin")
    for e in (eager, graphs):
        e.outs = _run(e, prompts, max_tokens) + _run(e, [shared], [3], "s")
        e.outs += _run(e, second, [4, 7, 2], "t")  # prefix hits on the shared prompt's blocks and state
    _same(eager.outs, graphs.outs)
    assert graphs.stats().num_prefix_hit_tokens > 0
    assert all(n > 0 for n in graphs.runner.graphs.replays.values()), graphs.runner.graphs.replays
    assert eager.runner.graphs is None


def test_graphs_under_preemption(tiny, eh):
    spec = cache_spec(tiny[0], torch.float32)
    budget = 8 * spec.kda_bytes_per_slot + 10 * 16 * spec.mla_bytes_per_token
    prompts = eh.random_prompts(8, 10, 40, seed=6)
    outs = []
    for mode in ("off", "standin"):
        e = _engine(tiny, mode, max_num_seqs=8, enable_prefix_caching=False, kv_cache_memory=budget)
        outs.append(_run(e, prompts, [10] * 8))
        assert e.stats().num_preemptions > 0
    _same(*outs)
    assert sum(e.runner.graphs.replays.values()) > 0


def _decode_step(engine: LLMEngine, B: int) -> StepInputs:
    """A decode step of B running requests after their prefill (their next position inside an allocated block),
    built as the runner would build it, not run."""
    bs = engine.config.block_size
    for _ in range(2):
        engine.step()
    reqs = [r for r in engine.scheduler.running if (r.num_tokens - 1) // bs < len(r.block_ids)][:B]
    assert len(reqs) == B
    width = max(len(r.block_ids) for r in reqs)
    tables = [b for r in reqs for b in r.block_ids + [-1] * (width - len(r.block_ids))]
    return StepInputs([r.token_ids[-1] for r in reqs], list(range(B + 1)), [r.num_tokens - 1 for r in reqs],
                      [r.slot for r in reqs], tables, width, logit_rows=list(range(B)))


def _caches(engine):
    c = engine.runner.caches
    return {**{("mla", i): t for i, t in c.mla.items()}, **{("kda", i): t for i, t in c.kda_state.items()},
            **{("conv", i): t for i, t in c.kda_conv.items()}}


@pytest.mark.parametrize("B", [1, 3, 5])
def test_padding_is_invisible(tiny, eh, B):
    engine = _engine(tiny, "standin", max_num_seqs=8)
    for i, p in enumerate(eh.random_prompts(8, 5, 30, seed=7)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    s = _decode_step(engine, B)
    runner = engine.runner
    runner.state_rows.arrange(s.slots)
    rows = runner.state_rows.rows(s.slots)
    dummy_row, bs = runner.graphs.dummy_row(), runner.caches.block_size
    before = {k: t.clone() for k, t in _caches(engine).items()}
    with torch.inference_mode():
        padded = runner.graphs.run(s, rows)[0].clone()
    after = {k: t.clone() for k, t in _caches(engine).items()}
    for k, t in _caches(engine).items():  # the same step in a bucket of exactly B rows, from the same caches
        t.copy_(before[k])
    exact = GraphRunner(runner.model, runner.caches, "cpu", vocab_size=engine.vocab_size,
                        dummy_block=engine.dummy_block, dummy_row=runner.graphs.dummy_row, max_batch=B,
                        max_context=96, mechanism=StandinGraphs())
    exact.sizes, exact.buckets = [B], {B: exact.buckets[B]}
    with torch.inference_mode():
        unpadded = exact.run(s, rows)[0]
    # within rounding, not bit for bit: CPU fp32 GEMMs round a row differently with the row count (M = 1 vs 8)
    assert padded.shape == (B, engine.vocab_size)
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
    written = {s.block_tables[i * s.width + c // bs] * bs + c % bs for i, c in enumerate(s.cached_lens)}
    dummy = set(range(engine.dummy_block * bs, (engine.dummy_block + 1) * bs))
    for k, t in _caches(engine).items():
        if k[0] == "mla":  # compare per token slot
            b_, a_, t_ = (x.reshape(-1, x.shape[-1]) for x in (before[k], after[k], t))
            changed = set((b_ != a_).any(-1).nonzero().flatten().tolist())
            assert written <= changed <= written | dummy
            keep = [i for i in range(t_.shape[0]) if i not in dummy]
        else:  # per KDA cache row
            b_, a_, t_ = (x.flatten(1) for x in (before[k], after[k], t))
            changed = set((b_ != a_).any(-1).nonzero().flatten().tolist())
            assert changed <= set(rows) | {dummy_row}
            keep = [i for i in range(t_.shape[0]) if i != dummy_row]
        torch.testing.assert_close(a_[keep], t_[keep], rtol=1e-5, atol=1e-5)  # padded == unpadded off the dummy


def test_what_runs_eager(tiny, eh):
    """Wider batches, prefill chunks, long contexts, images and prompt logprobs go to the eager forward; an
    engine running 12 at once (wider than max_batch 8) still gives the eager tokens."""
    graphs = _engine(tiny, "standin").runner.graphs

    def step(B, cached=10, n=1, **kw):
        return StepInputs([5] * (B * n), list(range(0, B * n + 1, n)), [cached] * B, list(range(B)),
                          list(range(B)), 1, **kw)

    assert graphs.accepts(step(1)) and graphs.accepts(step(8))
    assert not graphs.accepts(step(9))  # over max_batch
    assert not graphs.accepts(step(2, n=3))  # prefill chunks
    assert not graphs.accepts(step(2, cached=0))  # fresh prompts
    assert not graphs.accepts(step(2, cached=96))  # context over max_context (96)
    assert not graphs.accepts(step(2, prompt_spans=[(0, 1)]))
    assert not graphs.accepts(step(2, image_embeds=torch.zeros(0, 4)))
    prompts = eh.random_prompts(12, 3, 20, seed=8)
    outs = [_run(_engine(tiny, mode, max_num_seqs=12), prompts, [4] * 12) for mode in ("off", "standin")]
    _same(*outs)


def test_refusals_in_one_line(tiny):
    with pytest.raises(ValueError, match=r"^cuda_graphs: (needs a CUDA device|no CUDA GPU)"):
        _engine(tiny, "on")
    with pytest.raises(ValueError, match=r"^cuda_graphs: must be 'off', 'on' or 'standin'"):
        EngineConfig(cuda_graphs="yes")
    from k3serve.engine.spec.config import SpeculativeConfig

    with pytest.raises(ValueError, match=r"^cuda_graphs: not supported with speculative decoding"):
        EngineConfig(cuda_graphs="standin", speculative_config=SpeculativeConfig.parse('{"method": "ngram"}'))


@pytest.mark.skipif(not ON_GPU, reason="needs K3SERVE_TEST_DEVICE=cuda and a GPU (benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("name", ["kimi-linear-tiny-random", "k3-tiny-random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager_on_gpu(name, dtype):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 2000, (int(n),), generator=g).tolist() for n in torch.randint(2, 60, (MAX_BATCH,), generator=g)]
    max_tokens = [1, 2, 3, 5, 6, 8, 9, 12]  # buckets 8, 4, 2 and 1 as the batch shrinks
    outs = {}
    for mode in ("on", "standin", "off"):
        e = LLMEngine(name, device="cuda", dtype=dtype,
                      config=EngineConfig(kv_cache_memory=32 * 2**20, max_model_len=128, cuda_graphs=mode,
                                          cuda_graph_max_batch=MAX_BATCH, cuda_graph_max_context=96))
        outs[mode] = _run(e, prompts, max_tokens)
        if mode == "on":
            assert all(n > 0 for n in e.runner.graphs.replays.values()), e.runner.graphs.replays
    for a, b in zip(outs["on"], outs["standin"]):  # replay == the same kernels run eagerly, bit for bit
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    if dtype == torch.float32:
        assert [o.token_ids for o in outs["on"]] == [o.token_ids for o in outs["off"]]
