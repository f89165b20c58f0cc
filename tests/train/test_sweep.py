"""The GPU sweep's planning: variant parsing and seconds per step from a calibration log (the runs
themselves are covered by ``test_train.py``; the sweep only launches them)."""

import json

import pytest

from training import sweep


def test_parse_variants():
    assert sweep.parse_variants(["a:--lr=0.01,--tokens-per-step=64", "b_2:"]) == {
        "a": ["--lr=0.01", "--tokens-per-step=64"], "b_2": []}
    for bad in (["a:x", "a:y"], [":--lr=1"], ["calib:"], ["a/b:"]):
        with pytest.raises(ValueError, match="variant name"):
            sweep.parse_variants(bad)


def test_seconds_per_step_uses_the_second_half(tmp_path):
    log = [{"step": 4, "seconds": 30.0}, {"step": 8, "seconds": 32.0}, {"step": 8, "before_qat": {}},
           {"step": 12, "seconds": 34.0}, {"step": 16, "seconds": 37.0}]
    (tmp_path / "train_log.json").write_text(json.dumps({"log": log}))
    assert sweep.seconds_per_step(tmp_path) == pytest.approx((37.0 - 32.0) / 8)
    (tmp_path / "train_log.json").write_text(json.dumps({"log": log[:1]}))
    with pytest.raises(ValueError, match="two log lines"):
        sweep.seconds_per_step(tmp_path)


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--out", "x", "--budget", "10", "--variant", "a:", "--calib-steps", "4"])
    assert "at least 8" in capsys.readouterr().err
