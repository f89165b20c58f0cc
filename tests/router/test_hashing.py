import os
import subprocess
import sys

import pytest

from k3serve.core.hashing import hash_block, hash_blocks

TOKENS = list(range(1000, 1000 + 40))


def test_chain_matches_block_by_block():
    parent = None
    expected = []
    for i in range(0, 32, 8):
        parent = hash_block(parent, TOKENS[i : i + 8])
        expected.append(parent)
    assert hash_blocks(TOKENS[:39], 8) == expected  # trailing partial block (7 tokens) is not hashed


def test_hashes_are_64_bit_and_sensitive_to_every_input():
    h = hash_block(None, [1, 2, 3])
    assert 0 <= h < 2**64
    assert hash_block(None, [1, 2, 4]) != h
    assert hash_block(5, [1, 2, 3]) != h  # same tokens, different prefix
    assert hash_block(None, [1, 2, 3], b"lora-a") != h
    assert hash_block(None, [3, 2, 1]) != h
    # token count is hashed: tokens cannot be confused with extra bytes
    assert hash_block(None, [1], b"") != hash_block(None, [], (1).to_bytes(4, "little"))


def test_equal_prefixes_share_hashes_then_diverge():
    a = hash_blocks([7] * 16 + [1] * 8, 8)
    b = hash_blocks([7] * 16 + [2] * 8, 8)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_stable_across_processes_and_hash_seeds():
    code = "from k3serve.core.hashing import hash_blocks; print(hash_blocks(list(range(100)), 16, extra=b'x'))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    outs.add(str(hash_blocks(list(range(100)), 16, extra=b"x")) + "\n")
    assert len(outs) == 1


def test_known_value_pins_the_byte_layout():
    # any change to the layout changes every hash in every deployed engine and router: bump _PERSON then
    assert hash_block(None, list(range(512))) == 7858590778425080564


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_bad_tokens_raise_value_error(bad):
    with pytest.raises(ValueError):
        hash_block(None, bad)


def test_bad_block_size_and_parent():
    with pytest.raises(ValueError):
        hash_blocks([1, 2], 0)
    with pytest.raises(ValueError):
        hash_block(2**64, [1])
