"""Deterministic prefix-block hashing shared by the engine and the router.

A block's hash chains its parent's hash, so equal hashes mean equal *prefixes*, not just equal blocks.
Hashes are 64-bit ints computed with BLAKE2b over a fixed byte layout, so the same tokens give the same
hash in every process, on every machine and under every ``PYTHONHASHSEED`` (unlike Python's ``hash`` or
vLLM's per-process random ``NONE_HASH``).

Byte layout hashed for one block (all integers little-endian):
  root flag (1 byte: 0 = first block, 1 = has parent) | parent hash (u64, absent for a root) |
  number of tokens (u32) | token ids (u32 each) | extra (opaque bytes, e.g. a LoRA name or cache salt)

With a ``key`` the hashes are BLAKE2b MACs: whoever sees them (KV event subscribers) cannot test whether a
guessed prompt is cached without the key. The empty key gives the unkeyed hashes.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=8)
def _base(key: bytes) -> "hashlib._Hash":
    """A BLAKE2b state with the personalisation and key already set up; each block hashes a ``copy()``,
    cheaper than a fresh constructor. (A keyed hash still costs one more compression per block, of the key
    block, which BLAKE2 holds back until the final one: measured ~+200 ns/block, benchmarks/RESULTS.md.)"""
    if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
        raise ValueError(f"hash key must be at most {hashlib.blake2b.MAX_KEY_SIZE} bytes, got {len(key)}")
    return hashlib.blake2b(digest_size=8, person=_PERSON, key=key)


def _check_parent(parent: int | None) -> None:
    if parent is not None and not 0 <= parent <= _U64_MAX:
        raise ValueError(f"parent hash must be a 64-bit unsigned int, got {parent}")


def _digest(base, parent: int | None, count: bytes, tokens: bytes, extra: bytes) -> int:
    h = base.copy()
    h.update(_ROOT if parent is None else _CHILD + parent.to_bytes(8, "little"))
    h.update(count)
    h.update(tokens)
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"", *, key: bytes = b"") -> int:
    """Hash of one block given its parent's hash (None for the first block of a sequence). ``key`` (at most
    64 bytes) keys BLAKE2b, so only holders of the key can compute or test a hash; ``b""`` is unkeyed."""
    _check_parent(parent)
    return _digest(_base(bytes(key)), parent, len(token_ids).to_bytes(4, "little"), _token_bytes(token_ids), extra)


def hash_blocks(
    token_ids: Sequence[int], block_size: int, *, parent: int | None = None, extra: bytes = b"", key: bytes = b""
) -> list[int]:
    """Chain hashes of every *full* block of ``token_ids``; a trailing partial block is not hashed.
    ``key`` as in ``hash_block``: the engine and the router must use the same one."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    _check_parent(parent)
    base = _base(bytes(key))
    n_full = len(token_ids) // block_size
    data = _token_bytes(token_ids[: n_full * block_size])
    count = block_size.to_bytes(4, "little")
    step = 4 * block_size
    hashes: list[int] = []
    for i in range(n_full):
        parent = _digest(base, parent, count, data[i * step : (i + 1) * step], extra)
        hashes.append(parent)
    return hashes
