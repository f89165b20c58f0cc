"""The K3 tokenizer for training and evaluation: the package's native Kimi tokenizer with K3 special names
(the extension is built by ``pip install``, so there is no second implementation to fall back to)."""

from __future__ import annotations


def load_tokenizer():
    from k3serve.tokenizer import Tokenizer

    return Tokenizer.kimi(variant="k3")
