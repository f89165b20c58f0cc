"""``k3serve tokenize``: count or encode UTF-8 text files with the Kimi tokenizer.

    k3serve tokenize notes.txt book.md          # token counts
    k3serve tokenize --encode prompt.txt        # ids, one line per file
    k3serve tokenize --encode big.txt -o ids.npy

Large files are encoded in 400,000-character steps with a progress bar; that is exact, because
Kimi's first cut is at every 400,000 characters anyway.
"""

from __future__ import annotations

import argparse
import os
import sys

CHUNK_CHARS = 400_000
PROGRESS_MIN_CHARS = 4 * CHUNK_CHARS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="UTF-8 text files ('-' reads standard input)")
    p.add_argument("--encode", action="store_true", help="print token ids instead of counts")
    p.add_argument("-o", "--output", help="write ids here (.npy: one uint32 array; needs a single file)")
    p.add_argument("--allow-special", action="store_true",
                   help="turn special-token text such as <|im_end|> into control ids (default: plain text)")
    p.add_argument("--variant", choices=["k2", "k3"], default="k2", help="special-token names (default k2)")
    p.add_argument("--vocab", help="another tiktoken-format vocabulary (the Kimi pattern is used)")
    p.add_argument("--no-cuts", action="store_true", help="skip Kimi's 400k/25k-character cuts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on large files")


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def _encode(tok, text: str, allowed, chunked: bool, progress: bool, label: str):
    import numpy as np
    from tqdm import tqdm

    if not chunked or len(text) <= CHUNK_CHARS:
        return tok.encode(text, allowed_special=allowed)
    parts = []
    with tqdm(total=len(text), unit="char", unit_scale=True, desc=label, disable=not progress,
              file=sys.stderr, leave=False) as bar:
        for i in range(0, len(text), CHUNK_CHARS):
            parts.append(tok.encode(text[i:i + CHUNK_CHARS]))
            bar.update(min(CHUNK_CHARS, len(text) - i))
    return np.concatenate(parts)


def run(args: argparse.Namespace) -> int:
    from k3serve.tokenizer import Tokenizer
    from k3serve.tokenizer import kimi

    if args.output and args.output.endswith(".npy") and len(args.files) != 1:
        raise ValueError("--output .npy takes exactly one input file")
    options = {"kimi_cuts": not args.no_cuts, "prebuild": False}
    if args.vocab:
        tok = Tokenizer.from_tiktoken_file(args.vocab, special_tokens=kimi.special_tokens(args.variant), **options)
    else:
        tok = Tokenizer.kimi(args.variant, **options)
    allowed = "all" if args.allow_special else ()
    # with special tokens allowed the text is first split at them, so 400k steps would not be exact
    chunked = not args.allow_special and not args.no_cuts
    out = open(args.output, "w") if args.output and not args.output.endswith(".npy") else sys.stdout
    total_tokens = total_chars = 0
    try:
        for path in args.files:
            text = _read(path)
            progress = not args.no_progress and len(text) >= PROGRESS_MIN_CHARS
            ids = _encode(tok, text, allowed, chunked, progress, os.path.basename(path))
            total_tokens += len(ids)
            total_chars += len(text)
            if args.output and args.output.endswith(".npy"):
                import numpy as np

                np.save(args.output, ids)
            elif args.encode or args.output:
                print(" ".join(map(str, ids.tolist())), file=out)
            else:
                print(f"{len(ids)}\t{path}", file=out)
        if not args.encode and not args.output and len(args.files) > 1:
            print(f"{total_tokens}\ttotal", file=out)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
