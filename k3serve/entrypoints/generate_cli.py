"""``k3serve generate``: offline greedy generation with a model over its own caches (token ids in and out), a
check that the whole model path (loader -> KDA/MLA/MoE/AttnRes -> caches -> decode) works on this machine.
"""

from __future__ import annotations

import argparse
import time

import torch

# The small K3 trained by the repository's `training/` and shipped in the package (k3serve/models/weights/k3-default).
DEFAULT_MODEL = "k3-default"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_download_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a MODEL given as a Hugging Face repo id comes from (shared with ``k3serve serve``)."""
    parser.add_argument("--revision", default=None,
                        help="branch, tag or commit of a Hugging Face MODEL; main when not given")
    parser.add_argument("--download-dir", default=None,
                        help="Hugging Face cache directory for a MODEL repo id; when not given $HF_HUB_CACHE, else "
                             "~/.cache/huggingface/hub. HF_HUB_OFFLINE=1 uses only what is cached there")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"checkpoint directory, Hugging Face repo id (owner/name) or built-in name (default: "
                             f"{DEFAULT_MODEL}; also k3-tiny-random, k3-tiny-grouped-random, kimi-linear-tiny-random)")
    add_download_arguments(parser)
    parser.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8",
                        help="comma-separated prompt token ids (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype")
    parser.add_argument("--act-quant", choices=["rceil", "floor"], default=None,
                        help="emulate MXFP8 activations on the routed-expert GEMMs (K3's QAT recipe)")


def _parse_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"--prompt-ids has ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids


def run(args: argparse.Namespace) -> int:
    from k3serve.core.config import ModelConfig
    from k3serve.models.generate import greedy_generate
    from k3serve.models.loader import load_model
    from k3serve.models.registry import resolve_model_path

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    t0 = time.perf_counter()
    path = resolve_model_path(args.model, revision=args.revision, download_dir=args.download_dir)
    ids = _parse_ids(args.prompt_ids, ModelConfig.from_file(path).text.vocab_size)  # before the slow part
    model, config = load_model(path, dtype=DTYPES[args.dtype], act_quant=args.act_quant)
    t1 = time.perf_counter()
    out = greedy_generate(model, [ids], args.max_tokens, config.text.eos_token_id)[0]
    t2 = time.perf_counter()
    kinds = config.text.layer_kinds
    print(f"model: {args.model} ({config.model_type}, {kinds.count('kda')} KDA + {kinds.count('mla')} MLA layers, "
          f"experts {'MXFP4' if config.experts_mxfp4 else 'dense'}); loaded in {t1 - t0:.2f}s")
    print(f"prompt ids:    {ids}")
    print(f"generated ids: {out}")
    print(f"{len(out)} tokens in {t2 - t1:.2f}s ({len(out) / max(t2 - t1, 1e-9):.1f} tok/s, greedy)")
    return 0
