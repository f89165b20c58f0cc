"""Kimi tokenizer benchmark: k3serve's native tokenizer against tiktoken 0.14 and, where they are
installed, basetenkenizer, fastokens and gigatoken (benchmark-only peers).

    python benchmarks/tokenizer.py            # full table (a few minutes on 2 cores)
    python benchmarks/tokenizer.py --quick    # fewer repeats, no peers

Method (design/tokenizer.md §3.1): single-thread sections run pinned to one core and are timed in
process CPU time (``--clock cpu``, the default), because the development machine is shared and
wall-clock figures there swing by 2x with other load; ``--clock wall`` times wall-clock. For each input:
one warm-up call on a short string, one cold call on the full text, then the best of 3 rounds over N
variants of the text (a unique header plus a rotation at a newline, a fresh string object per call),
so whole-input caches miss while word caches are warm. Every output is compared with the reference ids (tiktoken with the
Kimi cuts); a peer's figure counts as exact only where its ids matched on every variant.
"""

from __future__ import annotations

import argparse
import base64
import gc
import glob
import json
import os
import pathlib
import pickle
import random
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

from k3serve.tokenizer import KIMI_PATTERN, Tokenizer
from k3serve.tokenizer import kimi
from k3serve.tokenizer.reference import tiktoken_encode

MB = 1 << 20
CLOCK = time.process_time  # set by --clock


# corpora --------------------------------------------------------------------------------------

def _read(paths, limit: int) -> str:
    out, size = [], 0
    for p in paths:
        try:
            t = pathlib.Path(p).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(t)
        size += len(t.encode())
        if size >= limit:
            break
    text = "\n".join(out)
    while len(text.encode()) < limit:  # small installs: repeat what there is
        text += "\n" + text
    return text.encode()[:limit].decode("utf-8", "ignore")


def corpora(size: int = MB) -> dict[str, str]:
    import pydoc_data.topics

    stdlib = sysconfig.get_paths()["stdlib"]
    prose_files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    prose = "\n".join(pydoc_data.topics.topics.values()) + "\n" + _read(prose_files, size)
    rnd = random.Random(1)
    return {
        "prose (1 MB)": prose.encode()[:size].decode("utf-8", "ignore"),
        "code (1 MB)": _read(sorted(glob.glob(os.path.join(stdlib, "*.py"))), size),
        "CJK (1 MB)*": _read(sorted(glob.glob(os.path.join(stdlib, "test", "cjkencodings", "*-utf8.txt"))), size),
        "JSON (1 MB)": json.dumps([{"id": i, "name": f"user_{rnd.randrange(10**6)}", "score": rnd.random(),
                                    "tags": ["alpha", "beta", "gamma"][: i % 4]} for i in range(12000)])[:size],
        "base64 (1 MB, no newlines)": base64.b64encode(rnd.randbytes(size * 3 // 4)).decode(),
        "hex (1 MB)": rnd.randbytes(size // 2).hex(),
        "digits (1 MB)": "".join(rnd.choices("0123456789", k=size)),
        "a x 100k (one piece)": "a" * 100_000,
        "100k random a-z (one piece)": "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=100_000)),
        "x + 100k spaces + y": "x" + " " * 100_000 + "y",
        "30k Han, no punctuation": "".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(30_000)),
        "600k-char line (two 400k cuts)": ("lorem ipsum dolor sit amet " * 23_000)[:600_000],
    }


def variants(text: str, k: int) -> list[str]:
    """k texts that differ from each other (so whole-input caches miss) with the same words."""
    out = []
    for v in range(k):
        cut = text.find("\n", (len(text) * (v + 1)) // (k + 1))
        body = text if cut < 0 else text[cut + 1:] + text[:cut + 1]
        out.append(f"{v:03d}\n" + body)
    return out


# encoders under test ----------------------------------------------------------------------------

ENCODERS = ["k3serve", "tiktoken 0.14 (1 call, raw)", "Kimi reference path (tiktoken + cuts)",
            "basetenkenizer encode_segments (tiktoken_safe)", "fastokens encode_ordinary", "gigatoken encode"]
PEERS = ENCODERS[3:]


def tiktoken_kimi():
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        sys.exit("tiktoken is needed for the reference (pip install 'tiktoken==0.14.*')")
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, special_tokens=kimi.special_tokens("k2"),
                             mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(kimi.VOCAB_PATH)))


def load_encoder(name: str):
    """encode(text) -> ids for one encoder (imported only in its own worker process)."""
    special = kimi.special_tokens("k2")
    if name == "k3serve":
        tok = Tokenizer.kimi()
        tok._core.linear_ok()  # wait for the background table build, so it is not timed as CPU
        return lambda t: tok.encode(t)
    if name.startswith("tiktoken"):
        enc = tiktoken_kimi()
        return lambda t: enc.encode_ordinary(t)
    if name.startswith("Kimi reference"):
        enc = tiktoken_kimi()
        return lambda t: tiktoken_encode(enc, t)
    if name.startswith("basetenkenizer"):
        import basetenkenizer

        js = basetenkenizer.tiktoken_model_to_tokenizer_json(str(kimi.VOCAB_PATH), pattern=KIMI_PATTERN,
                                                             special_tokens=special)
        bt = basetenkenizer.Tokenizer.from_json_str(js)
        return lambda t: bt.encode_segments([(t, False)], tiktoken_safe=True).ids
    if name.startswith("fastokens"):
        import fastokens

        ft = fastokens.Tokenizer.from_tiktoken(str(kimi.VOCAB_PATH), pattern=KIMI_PATTERN, special_tokens=special)
        return lambda t: ft.encode_ordinary(t).ids
    if name.startswith("gigatoken"):
        import gigatoken

        gt = gigatoken.Tokenizer.from_tiktoken(str(kimi.VOCAB_PATH), pretokenizer="kimi", special_tokens=special)
        return lambda t: gt.encode(t)
    raise ValueError(name)


def as_list(ids) -> list[int]:
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


def measure(fn, texts: list[str], refs: list[list[int]], rounds: int = 3) -> tuple[float, float, bool]:
    """(cold seconds, best warm seconds, exact on every text). Warm calls cycle through the variants
    `rounds` times, each time on a fresh copy of the string (as after parsing a request)."""
    fn("warm up")
    gc.disable()
    try:
        t = CLOCK()
        out = fn(texts[0])
        cold = CLOCK() - t
        exact = as_list(out) == refs[0]
        best = float("inf")
        for r in range(rounds):
            for text, ref in zip(texts[1:], refs[1:]):
                fresh = (text + " ")[:-1]
                t = CLOCK()
                out = fn(fresh)
                best = min(best, CLOCK() - t)
                if r == 0:
                    exact = exact and as_list(out) == ref
    finally:
        gc.enable()
    return cold, best, exact


# sections ----------------------------------------------------------------------------------------

def worker(name: str, data: str) -> None:
    """Child process: one encoder, pinned to one core, timed on every input of the data file."""
    global CLOCK
    with open(data, "rb") as f:
        cases, clock = pickle.load(f)
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    try:
        fn = load_encoder(name)
    except Exception as e:  # noqa: BLE001 - a peer that fails to load is reported, not fatal
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    results = {}
    for label, texts, refs in cases:
        try:
            results[label] = measure(fn, texts, refs)
        except Exception as e:  # noqa: BLE001 - e.g. a peer's NotImplementedError
            results[label] = f"error ({type(e).__name__})"
    print(json.dumps({"results": results}))


def single_core_table(enc, repeats: int, with_peers: bool, clock: str, core: int) -> tuple[list[str], list[str]]:
    cases = []
    for label, text in corpora().items():
        texts = variants(text, repeats + 1)
        cases.append((label, texts, [tiktoken_encode(enc, t) for t in texts]))
    names = ENCODERS if with_peers else ENCODERS[:3]
    notes, speed = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "cases.pkl")
        with open(data, "wb") as f:
            pickle.dump((cases, clock), f)
        for name in names:
            cmd = ["taskset", "-c", str(core), sys.executable, __file__, "--worker", name, "--data", data]
            env = dict(os.environ, RAYON_NUM_THREADS="1", FASTOKENS_BPE_THREADS="1", OMP_NUM_THREADS="1")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            try:
                out = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                out = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            if "error" in out:
                notes.append(f"{name} not measured: {out['error']}")
                continue
            speed[name] = out["results"]
            print(f"measured {name}", flush=True)
    names = [n for n in names if n in speed]
    head = "| input | " + " | ".join(names) + " | k3serve vs tiktoken |"
    rows = [head, "|" + "---|" * (len(names) + 2)]
    for label, texts, _ in cases:
        size = len(texts[1].encode())
        cells, mbs = [], {}
        for name in names:
            r = speed[name][label]
            if isinstance(r, str):
                cells.append(r)
                continue
            cold, best, exact = r
            mbs[name] = size / best / 1e6
            cells.append(f"{mbs[name]:.1f} ({size / cold / 1e6:.1f})" + ("" if exact else " ≠ref"))
        ratio = mbs.get("k3serve", 0) / mbs.get(ENCODERS[1], float("inf"))
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {ratio:.1f}× |")
        print(rows[-1], flush=True)
    return rows, notes


def long_piece_rows(tok) -> list[str]:
    rows = ["", "| single long piece (no cuts: one 100k-character piece) | best ms |", "|---|---|"]
    t = Tokenizer.kimi(kimi_cuts=False)
    rnd = random.Random(2)
    for label, text in (("a × 100,000", "a" * 100_000),
                        ("100,000 random a-z", "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=100_000)))):
        t.encode(text)
        best = min(_timed(lambda: t.encode(text)) for _ in range(5))
        rows.append(f"| {label} | {best * 1e3:.2f} |")
        print(rows[-1], flush=True)
    return rows


def _timed(fn, clock=None) -> float:
    clock = clock or CLOCK
    t = clock()
    fn()
    return clock() - t


def chat_messages(n_tokens_target: int = 128_000) -> list[tuple[str, str]]:
    """A Kimi-K2-style agentic transcript: 8 KB system prompt, prose user turns, code assistant
    turns (design/tokenizer.md §3.5)."""
    texts = corpora()
    prose, code = texts["prose (1 MB)"], texts["code (1 MB)"]
    rnd = random.Random(3)
    msgs = [("system", prose[:8000])]
    size, p, c = 8000, 8000, 0
    while size < n_tokens_target * 4.3:
        u = rnd.randint(500, 4000)
        a = rnd.randint(3000, 12000)
        msgs += [("user", prose[p:p + u]), ("assistant", code[c:c + a])]
        p, c, size = p + u, c + a, size + u + a
    msgs.append(("user", prose[p:p + 2000]))  # the new turn
    return msgs


def render_segments(msgs) -> list[tuple[str, bool]]:
    segs = []
    for role, content in msgs:
        tag = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}[role]
        segs += [(f"{tag}{role}<|im_middle|>", True), (content, False), ("<|im_end|>", True)]
    return segs


def chat_rows(tok, enc, repeats: int) -> list[str]:
    msgs = chat_messages()
    segs = render_segments(msgs)
    prompt = "".join(t for t, _ in segs)
    ref = []
    for t, allow in segs:
        ref += tiktoken_encode(enc, t, "all" if allow else ())
    n_tok = len(ref)

    def fresh(segments):  # new str objects, as after JSON parsing of a request
        return [(t.encode().decode(), a) for t, a in segments]

    rows = ["", f"| {n_tok:,}-token chat ({len(prompt.encode()) / 1e3:.0f} KB, {len(msgs)} messages), "
            "only the last turn new | best ms |", "|---|---|"]
    best_tt = min(_timed(lambda: enc.encode(prompt, allowed_special="all")) for _ in range(repeats))
    rows.append(f"| tiktoken, whole prompt re-encoded (1 call) | {best_tt * 1e3:.2f} |")
    nocache = min(_timed(lambda: tok.encode_segments(fresh(segs), use_cache=False)) for _ in range(repeats))
    rows.append(f"| k3serve encode_segments, no cache | {nocache * 1e3:.2f} |")
    best, exact = float("inf"), True
    for r in range(repeats):
        tok.clear_segment_cache()
        history = render_segments(msgs[:-1] + [("user", f"request {r}: " + msgs[-1][1])])
        tok.encode_segments(fresh(history[:-3]))  # the previous request warmed the cache
        req = fresh(history)
        t = CLOCK()
        ids = tok.encode_segments(req)
        best = min(best, CLOCK() - t)
        expect = []
        for t_, allow in req:
            expect += tiktoken_encode(enc, t_, "all" if allow else ())
        exact = exact and ids.tolist() == expect
    rows.append(f"| **k3serve encode_segments, segment cache (history cached)** | **{best * 1e3:.3f}** |")
    rows.append(f"| speed-up of the cached path over tiktoken | {best_tt / best:.0f}× (exact: {exact}) |")
    for r in rows[-4:]:
        print(r, flush=True)
    return rows


def thread_rows(tok, repeats: int) -> list[str]:
    texts = corpora()
    docs = []
    for name in ("prose (1 MB)", "code (1 MB)"):
        t = texts[name]
        docs += [t[i:i + 16_000] for i in range(0, len(t), 16_000)]
    size = sum(len(d.encode()) for d in docs)
    rows = ["", f"| encode_batch, {len(docs)} documents of 16k characters (2 MB) | best wall ms | MB/s | "
            "process CPU ms in that call |", "|---|---|---|---|"]
    single = [tok.encode(d).tolist() for d in docs]
    res = {}
    for n in (1, 2):
        out = tok.encode_batch(docs, num_threads=n)
        assert [o.tolist() for o in out] == single
        best = (float("inf"), 0.0)
        for _ in range(3 * repeats):
            w, c = time.perf_counter(), time.process_time()
            tok.encode_batch(docs, num_threads=n)
            best = min(best, (time.perf_counter() - w, time.process_time() - c))
        res[n] = best[0]
        rows.append(f"| {n} thread{'s' if n > 1 else ''} | {best[0] * 1e3:.2f} | {size / best[0] / 1e6:.0f} | "
                    f"{best[1] * 1e3:.2f} |")
    rows.append(f"| 2 threads vs 1 (wall) | {res[1] / res[2]:.2f}× | | |")
    for r in rows[-3:]:
        print(r, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no peers")
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="timer of the single-core sections")
    ap.add_argument("--repeats", type=int, default=0, help="variants per input (default 5, --quick 3)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.data)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    repeats = args.repeats or (3 if args.quick else 5)
    all_cores = os.sched_getaffinity(0)
    core = max(all_cores)
    load = os.getloadavg()[0]
    enc = tiktoken_kimi()
    rows = [f"MB/s on one core ({args.clock} time), best of 3 rounds over {repeats} warm variants (cold first call in "
            "parentheses), each encoder in its own process; ≠ref = ids differ from the reference path on "
            f"some variant. Load average {load:.1f} at the start (the machine is shared).", ""]
    table, notes = single_core_table(enc, repeats, not args.quick, args.clock, core)
    rows += table
    os.sched_setaffinity(0, {core})  # one core for everything but the thread section
    tok = Tokenizer.kimi()
    tok._core.linear_ok()
    rows += long_piece_rows(tok)
    rows += chat_rows(tok, enc, repeats * 2)
    os.sched_setaffinity(0, all_cores)
    rows += thread_rows(tok, repeats)
    if notes:
        rows += [""] + [f"* {n}" for n in notes]
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
