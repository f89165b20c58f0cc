"""``k3serve plan`` / ``k3serve params`` through the real dispatcher: acceptance figures and bad input."""

from __future__ import annotations

import json

import pytest

from k3serve.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_reproduces_published_figures(capsys):
    out = run_json(capsys, "plan", "--model", "kimi-k3", "--json")
    f = out["figures"]
    assert f["weight_bytes"]["mxfp4"] == pytest.approx(1560.9e9, rel=0.005)
    assert round(f["params"]["total"] / 1e12, 2) == 2.78
    assert f["params"]["active"] == pytest.approx(104e9, rel=0.01)
    assert f["mla_kv_kib_per_token"]["bf16"] == pytest.approx(27.0)
    assert f["kda_state_mib_per_sequence"] == pytest.approx(429, abs=0.5)
    mins = {g: r["min_gpus_per_replica"] for g, r in out["gpus"].items()}
    assert {g: mins[g] for g in ("B300", "GB300")} == {"B300": 8, "GB300": 8}
    assert {mins[g] for g in ("B200", "GB200", "H200")} == {16}
    assert {mins[g] for g in ("H100", "H20")} == {32}
    assert out["gpus"]["GB300"]["replicas_per_rack"] == 9


def test_context_131072_is_one_eighth_of_1m(capsys):
    full = run_json(capsys, "plan", "--json")["figures"]["kv_bytes_per_sequence"]["bf16"]
    short = run_json(capsys, "plan", "--json", "--context-length", "128k")["figures"]
    assert short["context_length"] == 131072
    assert short["kv_bytes_per_sequence"]["bf16"] * 8 == full
    assert short["kv_gib_per_sequence"]["bf16"] == pytest.approx(27.0 / 8, abs=0.01)


def test_plan_one_gpu(capsys):
    out = run_json(capsys, "plan", "--gpu", "gb300", "--context-length", "131072", "--json")["plan"]
    assert out["gpu"] == "GB300" and out["replica_gpus"] == 8 and out["replicas_per_rack"] == 9
    assert out["max_concurrency"] >= 1 and out["decode_at_concurrency"]["tokens_per_s"] > 0
    assert out["memory_per_gpu_bytes"]["kv_and_state_pool"] > 0
    assert set(out["commands"]) == {"k3serve", "vllm", "sglang"}
    assert main(["plan", "--gpu", "H200", "--context-length", "32k"]) == 0
    text = capsys.readouterr().out
    assert "launch:" in text and "vllm serve" in text and "sglang.launch_server" in text


def test_contradiction_is_reported(capsys):
    out = run_json(capsys, "plan", "--gpu", "B300", "--gpu-memory", "192GB", "--json")["plan"]
    assert any("288 GB" in w and "B200" in w for w in out["warnings"])
    assert out["replica_gpus"] == 8  # planned with the table, not the contradicted figure
    consistent = run_json(capsys, "plan", "--gpu", "B300", "--gpu-memory", "288GB", "--json")["plan"]
    assert not any("--gpu-memory" in w for w in consistent["warnings"])


@pytest.mark.parametrize("argv", [
    ["plan", "--gpu", "A100"],
    ["plan", "--gpu", "H100", "--num-gpus", "8"],
    ["plan", "--gpu", "B300", "--num-gpus", "8", "--concurrency", "100000"],
    ["plan", "--context-length", "lots"],
    ["plan", "--context-length", "2M"],
    ["plan", "--model", "/nonexistent/config.json"],
    ["plan", "--gpu", "B300", "--tp", "5"],
    ["plan", "--num-gpus", "8"],
    ["plan", "--gpu", "B300", "--gpu-memory", "lots"],
    ["params", "--model", "no-such-model"],
])
def test_bad_input_is_one_line(capsys, argv):
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3serve: error:"), captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_params_cli(capsys):
    out = run_json(capsys, "params", "--model", "kimi-linear-48b", "--json")
    assert out["total"] == pytest.approx(49.1e9, rel=0.005)
    assert out["active_with_input_embedding"] == pytest.approx(3.5e9, rel=0.02)
    assert main(["params", "--model", "k3-tiny"]) == 0
    assert "8,622,744" in capsys.readouterr().out
