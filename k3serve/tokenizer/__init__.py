"""Native Kimi tokenizer: a C++17 core (``native/``, built by ``pip install``) behind a small
Python API, with a pure-Python reference (``reference.py``) beside it.

    tok = Tokenizer.kimi()
    ids = tok.encode("Hello")                                  # numpy uint32
    ids = tok.encode_segments([("<|im_user|>user<|im_middle|>", True), (user_text, False)])
    text = tok.decode(ids)
"""

from __future__ import annotations

try:
    from k3serve.tokenizer import _native  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "k3serve.tokenizer needs its C++ extension (k3serve.tokenizer._native), which is built by "
        "'pip install -e .' (a C++17 compiler and the Python headers are required): " + str(e)
    ) from e

from k3serve.tokenizer.decoder import IncrementalDecoder
from k3serve.tokenizer.encoding import Tokenizer
from k3serve.tokenizer.kimi import KIMI_PATTERN
from k3serve.tokenizer.reference import ReferenceTokenizer

__all__ = ["KIMI_PATTERN", "IncrementalDecoder", "ReferenceTokenizer", "Tokenizer"]
