"""Deterministic prefix-block hashing shared by the engine and the router.

A block's hash chains its parent's hash, so equal hashes mean equal *prefixes*, not just equal blocks.
Hashes are 64-bit ints computed with BLAKE2b over a fixed byte layout, so the same tokens give the same
hash in every process, on every machine and under every ``PYTHONHASHSEED`` (unlike Python's ``hash`` or
vLLM's per-process random ``NONE_HASH``).

Byte layout hashed for one block (all integers little-endian):
  root flag (1 byte: 0 = first block, 1 = has parent) | parent hash (u64, absent for a root) |
  number of tokens (u32) | token ids (u32 each) | extra (opaque bytes, e.g. a LoRA name or cache salt)
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_PERSON = b"k3serve-blk-v1"  # domain separation: bump the version if the layout ever changes
_ROOT = b"\x00"
_CHILD = b"\x01"
_U64_MAX = (1 << 64) - 1


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token_ids must be ints in [0, 2**32): {e}") from None
    if packed.itemsize != 4:
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _digest(parent: int | None, count: int, tokens: bytes, extra: bytes) -> int:
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    if parent is None:
        h.update(_ROOT)
    else:
        if not 0 <= parent <= _U64_MAX:
            raise ValueError(f"parent hash must be a 64-bit unsigned int, got {parent}")
        h.update(_CHILD)
        h.update(parent.to_bytes(8, "little"))
    h.update(count.to_bytes(4, "little"))
    h.update(tokens)
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash (None for the first block of a sequence)."""
    return _digest(parent, len(token_ids), _token_bytes(token_ids), extra)


def hash_blocks(
    token_ids: Sequence[int], block_size: int, *, parent: int | None = None, extra: bytes = b""
) -> list[int]:
    """Chain hashes of every *full* block of ``token_ids``; a trailing partial block is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    data = _token_bytes(token_ids[: n_full * block_size])
    step = 4 * block_size
    hashes: list[int] = []
    for i in range(n_full):
        parent = _digest(parent, block_size, data[i * step : (i + 1) * step], extra)
        hashes.append(parent)
    return hashes
