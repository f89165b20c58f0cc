"""``k3serve spec train``: train an eagle3 draft head for a model (``engine/spec/train.py``).

The prompts are a JSON-lines file, one ``{"prompt_ids": [...]}`` per line: token ids exactly as the server
feeds the model (chat template applied). For the package's ``k3-default``, the repository's
``python -m training.spec_prompts OUT.jsonl`` writes a set shaped like its real use (tool calls, choosing and
declining tools, JSON under a schema, record recall, follow-ups, code edits).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3serve.entrypoints.generate_cli import DEFAULT_MODEL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    sub = parser.add_subparsers(dest="spec_command", metavar="ACTION", required=True)
    p = sub.add_parser("train", help="train an eagle3 head on the model's own answers to a prompt set",
                       description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: checkpoint directory or built-in name")
    p.add_argument("--prompts", required=True, type=Path, help="JSON lines, one {\"prompt_ids\": [...]} each")
    p.add_argument("--out", required=True, type=Path,
                   help="directory for the head (config.json, model.safetensors); also holds the collected "
                        "data and the per-epoch checkpoint, so rerunning the same command resumes")
    p.add_argument("--max-tokens", type=int, default=96, help="longest answer collected per prompt")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--depth", type=int, default=3, help="drafting steps unrolled per training sample")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="tokens the head can propose: the ones the answers use most")
    p.add_argument("--max-num-seqs", type=int, default=64, help="prompts answered at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def read_prompts(path: Path, vocab: int) -> list[list[int]]:
    prompts = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["prompt_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with \"prompt_ids\"") from None
            if not ids or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
                raise ValueError(f"{path}:{n}: prompt_ids must be a non-empty list of ids below {vocab}")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.spec.train import TrainOptions, train_head
    from k3serve.models.loader import load_model

    opts = TrainOptions(max_tokens=args.max_tokens, depth=args.depth, epochs=args.epochs,
                        batch_size=args.batch_size, lr=args.lr, draft_vocab_size=args.draft_vocab_size)
    if not args.prompts.is_file():
        raise FileNotFoundError(f"--prompts: no such file: {args.prompts}")
    model, config = load_model(args.model, progress=False)
    prompts = read_prompts(args.prompts, config.text.vocab_size)
    longest = max(map(len, prompts)) + args.max_tokens
    engine = LLMEngine(model, model_config=config,
                       config=EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=longest))
    train_head(model, engine, prompts, args.out, opts, progress=not args.no_progress)
    print(f"spec train: eagle3 head saved in {args.out} (use --speculative-config "
          f"'{{\"method\": \"eagle3\", \"model\": \"{args.out}\"}}')")
    return 0
