"""The prefill/decode router's decode-worker choice (router/decode_choice.py): a prompt goes back to the
decode worker that holds its prefix, unless that worker is much busier; unknown prompts go by load."""

from k3serve.router.decode_choice import DecodeChoice


def test_cache_then_load():
    c = DecodeChoice(2, block_size=16)
    first = list(range(100, 164))  # 4 full blocks
    w = c.pick("a", first, 8)
    c.started("a")
    c.finished("a")
    follow_up = first + list(range(900, 940))
    for i in range(3):  # the follow-ups land where the prefix is (ties with an empty worker would split them)
        assert c.pick(f"b{i}", follow_up, 8) == w
        c.started(f"b{i}")
        c.finished(f"b{i}")
    other = list(range(3000, 3064))
    assert c.pick("o", other, 8) == 1 - w  # same load, nothing cached on either: the emptier cache
    c.started("o")
    c.finished("o")

    # w is busy with long decodes (placed there while the other worker was down): a short follow-up of
    # `first` now goes to the idle worker despite the prefix
    for i in range(8):
        c.pick(f"long{i}", list(range(5000 + 200 * i, 5000 + 200 * i + 48)), 2000, routable=[w])
        c.started(f"long{i}")
    assert c.pick("c", first + [7], 8) == 1 - w


def test_unknown_prompts_go_by_load():
    c = DecodeChoice(3)
    picks = [c.pick(f"r{i}", None, 100) for i in range(3)]
    assert sorted(picks) == [0, 1, 2]  # none finished yet: each goes to an idle worker
    c.finished("r1")
    assert c.pick("r3", None, 100) == picks[1]
    assert c.pick("r4", None, 100, routable=[2]) == 2
