"""Offline throughput: k3serve vs HF transformers ``generate`` on the same random tiny Kimi-Linear checkpoint,
and k3serve alone on tiny K3.

Workload (fixed seed): N requests, prompt lengths uniform in [32, 512], output lengths uniform in [16, 256],
random token ids, greedy, ignore_eos (every request produces exactly its output length). Output tokens/s =
useful output tokens / wall time from submission to the last token (prefill included).

HF runs static batches through ``generate`` (left padding, ``max_new_tokens`` = the longest output in the
batch, tokens past a request's own length are not counted). To give HF its best case, requests are sorted by
output length before batching, and every batch size in ``--hf-batch-sizes`` is tried; the best is reported.

Batch-1 decode tokens/s: one request (64-token prompt, 128 outputs), time from the first to the last token.
The greedy outputs of each k3serve run are hashed (sha256 over the requests' token ids in request order), so two
builds can be checked to generate the same tokens.

    python benchmarks/throughput.py --threads 1
    python benchmarks/throughput.py --device cuda --dtype bfloat16 --json $OUT/throughput.json   # on a GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from k3serve.engine.config import EngineConfig, check_device
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.testing import write_random_checkpoint


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)]


DEVICE, DTYPE = "cpu", torch.float32  # set by --device / --dtype, for both engines


def k3serve_run(path: Path, reqs: list[tuple[list[int], int]], *,
                max_num_seqs: int) -> tuple[float, dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(path, device=DEVICE, dtype=DTYPE,
                       config=EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                           kv_cache_memory=512 * 2**20, max_model_len=1024))
    engine.add_request("warmup", reqs[0][0][:32], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()  # the timed run must not hit the warm-up's blocks
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] += o.delta_token_ids
    return time.perf_counter() - start, outputs, engine


def outputs_hash(outputs: dict[str, list[int]]) -> str:
    return hashlib.sha256(json.dumps([outputs[str(i)] for i in range(len(outputs))]).encode()).hexdigest()[:16]


def k3serve_batch1_decode(path: Path) -> float:
    engine = LLMEngine(path, device=DEVICE, dtype=DTYPE,
                       config=EngineConfig(max_num_seqs=4, kv_cache_memory=64 * 2**20, max_model_len=1024))
    prompt = workload(1, 99)[0][0][:64]
    engine.add_request("b1", prompt, SamplingParams(temperature=0, max_tokens=129, ignore_eos=True))
    engine.step()  # prefill + first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return 128 / (time.perf_counter() - start)


def hf_run(path: Path, reqs: list[tuple[list[int], int]], batch_size: int) -> tuple[float, int]:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(path, dtype=DTYPE).to(DEVICE).eval()
    order = sorted(reqs, key=lambda r: r[1])
    start, produced = time.perf_counter(), 0
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[2047] * (width - len(p)) + p for p, _ in batch], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=DEVICE)
        new = max(n for _, n in batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=2047)
        assert out.shape[1] == width + new
        produced += sum(n for _, n in batch)
    return time.perf_counter() - start, produced


def hf_batch1_decode(path: Path) -> float:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(path, dtype=DTYPE).to(DEVICE).eval()
    ids = torch.tensor([workload(1, 99)[0][0][:64]], device=DEVICE)
    times = {}
    for n in (1, 129):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2047)
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        times[n] = time.perf_counter() - start
    return 128 / (times[129] - times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-batch-sizes", default="16,32,64")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cpu", help="both engines run here (cpu, cuda)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and activations of both engines")
    ap.add_argument("--json", type=Path, help="also write the table's rows to this file")
    args = ap.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, getattr(torch, args.dtype)
    try:
        check_device(DEVICE)
    except ValueError as e:
        raise SystemExit(f"throughput: {e}") from None
    torch.set_num_threads(args.threads)
    reqs = workload(args.num_requests, args.seed)
    n_out = sum(n for _, n in reqs)
    print(f"{len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, {n_out} output tokens, "
          f"{args.threads} thread(s)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("kimi-linear-tiny", "k3-tiny"):
            path = write_random_checkpoint(name, Path(tmp) / name, seed=0, dtype=DTYPE)
            wall, outputs, engine = k3serve_run(path, reqs, max_num_seqs=args.num_requests)
            assert sum(map(len, outputs.values())) == n_out
            s = engine.stats()
            b1 = k3serve_batch1_decode(path)
            rows.append((name, "k3serve", "continuous", wall, n_out / wall, b1))
            print(f"{name} k3serve: {wall:.1f} s, {n_out / wall:.0f} output tok/s, batch-1 decode {b1:.1f} tok/s "
                  f"({s.num_steps} steps, {s.num_preemptions} preemptions), greedy outputs sha256 {outputs_hash(outputs)}")
            if name == "kimi-linear-tiny" and not args.skip_hf:
                hf_b1 = hf_batch1_decode(path)
                for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
                    wall_hf, produced_hf = hf_run(path, reqs, bs)
                    rows.append((name, "HF generate", f"static {bs}", wall_hf, produced_hf / wall_hf, hf_b1))
                    print(f"{name} HF bs={bs}: {wall_hf:.1f} s, {produced_hf / wall_hf:.0f} output tok/s, "
                          f"batch-1 decode {hf_b1:.1f} tok/s")
    if args.json is not None:
        keys = ("model", "engine", "batching", "wall_s", "output_tok_s", "batch1_decode_tok_s")
        args.json.write_text(json.dumps({"device": DEVICE, "dtype": args.dtype, "requests": len(reqs),
                                         "output_tokens": n_out, "rows": [dict(zip(keys, r)) for r in rows]},
                                        indent=1))
    print("\n| model | engine | batching | wall s | output tok/s | batch-1 decode tok/s |\n|---|---|---|---|---|---|")
    for name, eng, batching, wall, tps, b1 in rows:
        print(f"| {name} | {eng} | {batching} | {wall:.1f} | {tps:.0f} | {b1:.1f} |")
    hf = [r for r in rows if r[1] == "HF generate"]
    if hf:
        best = max(hf, key=lambda r: r[4])
        ours = next(r for r in rows if r[0] == "kimi-linear-tiny" and r[1] == "k3serve")
        print(f"\nk3serve / HF best ({best[2]}): {ours[4] / best[4]:.1f}x output tok/s; "
              f"batch-1 decode {ours[5] / best[5]:.1f}x")


if __name__ == "__main__":
    main()
