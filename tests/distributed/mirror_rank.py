"""One rank of the cache-mirror test (run as ``python -m tests.distributed.mirror_rank``, RANK/WORLD_SIZE/
MASTER_* set): rank 0 serves a workload with prefix hits, snapshots and preemption through ``LLMEngine``,
the others follow (``engine.worker.follow``); then every rank hashes its MLA blocks (replicated over the tp
ranks, numbered alike) and rank 0 checks that all hashes agree. Exit 0 when they do."""

from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist

from k3serve.engine.core_spec import CoreSpec, build_engine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.tp_group import join
from k3serve.engine.worker import follow
from tests.distributed.conftest import cache_budget, prompts


def cache_hash(engine) -> int:
    """The MLA blocks (the latent cache every tp rank holds whole). KDA rows are each rank's own heads, so they
    cannot hash alike; that they are right shows in the greedy parity tests, whose logits sum every rank's
    heads (tests/distributed/test_parallel_serving.py)."""
    caches = engine.runner.caches
    h = hashlib.sha256()
    for t in caches.mla.values():
        h.update(t.numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


def main() -> int:
    tp = int(sys.argv[1])
    spec = CoreSpec(model="k3-tiny-random", input_addr="", output_addr="", max_num_seqs=4, max_model_len=64,
                    max_num_batched_tokens=64, kv_cache_memory=cache_budget(7, tp), tensor_parallel_size=tp)
    par, group = join(spec.layout(), spec.device)
    engine = build_engine(spec, par, group)
    if group.is_leader:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        finished = []
        for i, p in enumerate(prompts()):
            engine.add_request(f"a{i}", p, params)
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        # the last request to finish left its blocks and its decode snapshot cached: its conversation going on
        # (prompt + answer + a new turn) hits them
        last = finished[-1]
        engine.add_request("b", [*last.prompt_token_ids, *last.token_ids, 1, 2, 3], params)
        while engine.has_unfinished_requests():
            engine.step()
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0, stats
        group.send_shutdown()
    else:
        follow(engine, group)
    mine = torch.tensor([cache_hash(engine)], dtype=torch.long)
    hashes = [torch.zeros(1, dtype=torch.long) for _ in range(tp)]
    dist.all_gather(hashes, mine, group=group.group)
    same = all(int(x) == int(mine) for x in hashes)
    if par.rank == 0:
        print(f"cache hashes per rank: {[int(x) for x in hashes]}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
