"""``k3serve generate``: a real run on a built-in model, and one clear line for each bad input."""

from __future__ import annotations

import pytest

from k3serve.cli import main


def test_generate_runs_on_builtin_model(capsys):
    assert main(["generate", "kimi-linear-tiny-random", "--prompt-ids", "1,2,3", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "generated ids: [" in out and "kimi_linear" in out


@pytest.mark.parametrize("argv,needle", [
    (["generate", "no-such-model"], "neither a directory nor a built-in name"),
    (["generate", "kimi-linear-tiny-random", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["generate", "kimi-linear-tiny-random", "--prompt-ids", "99999"], "outside the vocabulary"),
    (["generate", "kimi-linear-tiny-random", "--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3serve: error:") and needle in err[0]
