"""In-process HTTP app over real engine processes (rank sets on gloo, 127.0.0.1), and the serving workload
the parallel layouts must answer identically: concurrent greedy completions with shared prefixes (A, B, A'
order) under a cache small enough to preempt, each token with its top logprobs."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import torch

MODEL = "k3-tiny-random"
MAX_NUM_SEQS = 4
BLOCK_SIZE = 16


def cache_budget(blocks: int, tp: int = 1, ep: bool = False, model: str = MODEL) -> int:
    """Bytes per rank for MAX_NUM_SEQS running KDA slots, one snapshot slot and ``blocks`` MLA blocks (the
    snapshot share of a budget is a quarter: one slot fits while a quarter of the budget is below two slots).
    A tp rank holds 1/tp of the KDA heads and the whole MLA latent."""
    from k3serve.core.config import ModelConfig
    from k3serve.core.distributed import Parallel, ParallelLayout
    from k3serve.models.cache import cache_spec
    from k3serve.models.kimi import build_model
    from k3serve.models.registry import packaged_config

    with torch.device("meta"):
        model = build_model(ModelConfig.from_file(packaged_config(model)),
                            Parallel(ParallelLayout(tp=tp, ep=tp if ep else 1)))
    spec = cache_spec(model, torch.float32)
    budget = (MAX_NUM_SEQS + 1) * spec.kda_bytes_per_slot + blocks * BLOCK_SIZE * spec.mla_bytes_per_token
    if tp == 1:  # a tp rank's slot is smaller beside the same MLA blocks: its pools differ a little (the
        # test asks only for the same tokens, with preemption and prefix hits seen)
        assert spec.kda_bytes_per_slot <= budget // 4 < 2 * spec.kda_bytes_per_slot
    return budget


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 2000, (36,), generator=g).tolist()
    other = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (30, 22, 41)]
    tails = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (5, 9)]
    return [shared + tails[0], other[0], shared + tails[1], other[1], shared, other[2]]


@contextlib.asynccontextmanager
async def serving(*, tp: int = 1, dp: int = 1, ep: bool = False, blocks: int = 7, model: str = MODEL,
                  lockstep: bool | None = None, **engine_extra):
    """(httpx client on the app, app state) for a server with the given layout; everything stopped after.
    ``model`` is a built-in name or a checkpoint directory of a tiny config. With ``dp`` > 1 and ``ep`` the
    experts span every replica's ranks (cores in lockstep) unless ``lockstep=False``: replicas of their own."""
    from k3serve.server.app import build_app, start_state
    from k3serve.server.state import ServerConfig

    engine = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 64, "max_model_len": 64,
              "kv_cache_memory": cache_budget(blocks, tp, ep, _config_name(model)), "tensor_parallel_size": tp,
              "expert_parallel": ep, "log_stats_interval": 0.0, **engine_extra}
    if dp > 1 and ep and lockstep is not False:  # experts over all tp x dp ranks: one world (check_parallel)
        engine["data_parallel_size"] = dp
    app = build_app(ServerConfig(model=model, engine=engine, data_parallel_size=dp, access_log=False,
                                 max_engine_restarts=0))
    state = app.state.k3
    try:
        await start_state(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://k3",
                                     timeout=300) as http:
            yield http, state
    finally:
        if state.client is not None:
            await state.client.shutdown()
        state.pool.shutdown()


def _config_name(model: str) -> str:
    """The packaged config a served model is built from: ``k3-tiny`` for ``k3-tiny-random`` or a directory
    written from it (its config.json names nothing, so the directory is named after it)."""
    from pathlib import Path

    name = Path(model).name
    return name.removesuffix("-random").split("+")[0]


# sent again one at a time after the concurrent wave: the shared prefix alone (36 tokens: its KDA snapshot is
# taken at 32, a block boundary), then shared + tail, which hits those 32 tokens (one snapshot slot: in the
# concurrent wave other prompts may evict it first, so hits there depend on arrival timing)
AGAIN = (4, 0)


async def complete_all(http: httpx.AsyncClient, max_tokens: int = 8, top: int = 0, model: str = MODEL):
    """Every prompt at once (preempting), then the AGAIN prompts one by one (hitting the prefix cache); each
    greedy completion's tokens (as the server's logprobs name them), or with ``top`` > 0 each completion's
    logprobs object (tokens, token_logprobs, top_logprobs). A prompt sent twice must get the same answer."""
    async def one(p):
        r = await http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, "logprobs": top})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return lp if top else lp["tokens"]

    outs = list(await asyncio.gather(*(one(p) for p in prompts())))
    for i in AGAIN:
        outs.append(await one(prompts()[i]))
    tokens = [o["tokens"] if top else o for o in outs]  # (a prefix hit may move logprobs in the last bits)
    assert tokens[-len(AGAIN):] == [tokens[i] for i in AGAIN]
    return outs


@pytest.fixture(scope="module")
def single_process_outputs():
    async def run():
        async with serving() as (http, state):
            out = await complete_all(http)
            return out, state.client.stats

    return asyncio.run(run())
