"""The sweep loop: results appended as points finish, a failed point recorded while the sweep goes on, resume,
Ctrl-C, outputs (fast, with a stand-in for the per-point run); and one real sweep against live servers (slow)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from k3serve.cli import main
from k3serve.sweep import runner
from k3serve.sweep.report import load_points


def _fake_run(calls):
    def run_point(point, workload, log_dir, timeout_s, percentiles):
        calls.append(point.key)
        if point.model == "broken":
            return {"status": "failed", "error": "server exited with 1: k3serve: error: no such model"}
        if point.model == "interrupt":
            raise KeyboardInterrupt
        seqs = dict(point.settings).get("max_num_seqs", 64)
        return {"status": "ok", "error": None, "failed": 0, "output_throughput": 10.0 * seqs,
                "p99_tpot_ms": 100.0 * seqs, "p99_ttft_ms": 50.0, "p50_tpot_ms": 1.0, "p90_tpot_ms": 1.0}
    return run_point


def _sweep(tmp_path, *extra):
    return main(["sweep", "--models", "m", "broken", "--grid", "max_num_seqs=1,2,64", "--no-modelled",
                 "--disable-tqdm", "--output-dir", str(tmp_path), *extra])


def _lines(tmp_path):
    return [json.loads(x) for x in (tmp_path / "points.jsonl").read_text().splitlines()]


def test_failed_points_are_recorded_and_the_sweep_goes_on_then_resumes(tmp_path, monkeypatch, capsys):
    calls: list[str] = []
    monkeypatch.setattr(runner, "run_point", _fake_run(calls))
    assert _sweep(tmp_path, "--slo-tpot-p99-ms", "1000") == 0
    assert len(calls) == 6  # the broken model's three points did not stop the others
    pts = _lines(tmp_path)
    assert [p["status"] for p in pts] == ["ok"] * 3 + ["failed"] * 3
    assert pts[3]["error"].endswith("no such model") and pts[0]["workload"]["num_prompts"] == 8
    front = json.loads((tmp_path / "front.json").read_text())
    # p99 TPOT 6400 ms misses the SLO; of the two left, neither dominates the other
    assert [p["key"] for p in front["fronts"]["measured"]] == ["m max_num_seqs=1", "m max_num_seqs=2"]
    assert all(shlex.split(p["command"])[:3] == ["k3serve", "serve", "m"] for p in front["fronts"]["measured"])
    best = front["best_and_default"]["m"]
    assert best["best"]["key"] == "m max_num_seqs=2" and best["default"]["key"] == "m max_num_seqs=64"
    assert len(front["failed_points"]) == 3
    assert (tmp_path / "front.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "failed: server exited with 1" in out and "* " in out

    calls.clear()
    assert _sweep(tmp_path) == 0 and calls == []  # everything is in points.jsonl already
    assert _sweep(tmp_path, "--retry-failed") == 0 and len(calls) == 3 and all("broken" in c for c in calls)
    assert len(_lines(tmp_path)) == 9 and len(load_points(tmp_path)) == 6  # a retry supersedes its failure
    assert len(json.loads((tmp_path / "front.json").read_text())["failed_points"]) == 3
    calls.clear()
    assert _sweep(tmp_path, "--fresh") == 0 and len(calls) == 6 and len(_lines(tmp_path)) == 6


def test_resume_refuses_another_workload(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_point", _fake_run([]))
    assert _sweep(tmp_path) == 0
    capsys.readouterr()
    assert _sweep(tmp_path, "--output-len", "5") == 1
    assert "another workload" in capsys.readouterr().err


def test_interrupt_keeps_finished_points_and_writes_the_front(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(runner, "run_point", _fake_run(calls))
    rc = main(["sweep", "--models", "m", "interrupt", "--grid", "max_num_seqs=1", "--no-modelled",
               "--disable-tqdm", "--output-dir", str(tmp_path)])
    assert rc == 130 and calls == ["m max_num_seqs=1", "interrupt max_num_seqs=1"]
    assert [p["key"] for p in _lines(tmp_path)] == ["m max_num_seqs=1"]
    assert json.loads((tmp_path / "front.json").read_text())["fronts"]["measured"][0]["key"] == "m max_num_seqs=1"


@pytest.mark.slow
def test_real_sweep_of_two_points_and_a_model_that_fails(tmp_path, capsys):
    """Two real servers of a tiny random model with a very short workload, and a point that cannot start."""
    rc = main(["sweep", "--models", "kimi-linear-tiny-random", "no-such-model", "--grid", "max_num_seqs=2,64",
               "--num-prompts", "2", "--input-len", "16", "--output-len", "3", "--prefix-len", "8", "--warmup", "1",
               "--max-concurrency", "2", "--modelled", "GB300:8", "--disable-tqdm", "--output-dir", str(tmp_path)])
    assert rc == 0
    pts = {p["key"]: p for p in _lines(tmp_path)}
    real = [p for p in pts.values() if p["model"] == "kimi-linear-tiny-random"]
    assert len(real) == 2 and all(p["status"] == "ok" and p["completed"] == 2 and p["failed"] == 0 for p in real)
    assert all(p["total_output_tokens"] == 6 and p["output_throughput"] > 0 and p["p99_ttft_ms"] > 0 for p in real)
    assert [p["default"] for p in real] == [False, True]
    bad = [p for p in pts.values() if p["model"] == "no-such-model"]
    assert len(bad) == 2 and all(p["status"] == "failed" and "no-such-model" in p["error"] for p in bad)
    assert any(p.get("modelled") for p in pts.values())
    front = json.loads((tmp_path / "front.json").read_text())
    assert front["fronts"]["measured"] and front["fronts"]["modelled"]
    assert (tmp_path / "front.png").exists()
    # every server went away: no process is left that was started with its port
    ports = {str(p["port"]) for p in pts.values() if not p.get("modelled")}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"k3serve" in argv and b"--port" in argv:
            assert argv[argv.index(b"--port") + 1].decode() not in ports, argv
    assert all(Path(p["log"]).exists() for p in real)


def test_modelled_points_are_recorded_once_and_get_their_own_front(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_point", _fake_run([]))
    argv = ["sweep", "--models", "m", "--grid", "max_num_seqs=1", "--modelled", "GB300:8", "--disable-tqdm",
            "--output-dir", str(tmp_path)]
    assert main(argv) == 0 and main(argv) == 0
    modelled = [p for p in _lines(tmp_path) if p["modelled"]]
    assert modelled and len(modelled) == len({p["key"] for p in modelled})
    front = json.loads((tmp_path / "front.json").read_text())["fronts"]
    assert [p["key"] for p in front["measured"]] == ["m max_num_seqs=1"]
    assert front["modelled"] and all(p["modelled"] and "--tensor-parallel-size" in p["command"]
                                     for p in front["modelled"])
