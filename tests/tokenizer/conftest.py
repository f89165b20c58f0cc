"""Shared fixtures: the native Kimi tokenizer and its two oracles (tiktoken 0.14 with the Kimi
pattern, and the pure-Python reference)."""

from __future__ import annotations

import glob
import os
import random
import sysconfig

import pytest

from k3serve.tokenizer import KIMI_PATTERN, ReferenceTokenizer, Tokenizer
from k3serve.tokenizer import kimi

tiktoken = pytest.importorskip("tiktoken", minversion="0.14")
import tiktoken.load  # noqa: E402


@pytest.fixture(scope="session")
def ranks() -> dict[bytes, int]:
    return tiktoken.load.load_tiktoken_bpe(str(kimi.VOCAB_PATH))


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return Tokenizer.kimi()


@pytest.fixture(scope="session")
def enc(ranks):
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=kimi.special_tokens("k2"))


@pytest.fixture(scope="session")
def ref(ranks) -> ReferenceTokenizer:
    return ReferenceTokenizer(ranks, kimi.special_tokens("k2"))


def _read(pattern: str, limit: int) -> str:
    out, size = [], 0
    for p in sorted(glob.glob(pattern)):
        try:
            with open(p, encoding="utf-8") as f:
                out.append(f.read())
        except (OSError, UnicodeDecodeError):
            continue
        size += len(out[-1])
        if size >= limit:
            break
    return "\n".join(out)[:limit]


@pytest.fixture(scope="session")
def texts() -> dict[str, str]:
    """Real text from the Python installation (no downloads)."""
    import pydoc_data.topics

    stdlib = sysconfig.get_paths()["stdlib"]
    rnd = random.Random(0)
    return {
        "prose": "\n".join(pydoc_data.topics.topics.values())[:300_000],
        "code": _read(os.path.join(stdlib, "*.py"), 300_000),
        "cjk": _read(os.path.join(stdlib, "test", "cjkencodings", "*-utf8.txt"), 100_000),
        "json": __import__("json").dumps([{"id": i, "név": f"ü{i}", "v": rnd.random(), "ok": i % 3 == 0}
                                          for i in range(3000)], ensure_ascii=False),
        "base64": __import__("base64").b64encode(rnd.randbytes(60_000)).decode(),
        "base64_lines": __import__("base64").encodebytes(rnd.randbytes(60_000)).decode(),
        "hex": rnd.randbytes(40_000).hex(),
        "digits": "".join(rnd.choices("0123456789 ,.", k=50_000)),
    }
