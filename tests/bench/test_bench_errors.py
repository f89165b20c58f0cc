"""Bad input gives one clear line on stderr and exit 1, never a traceback (acceptance 3, bench half)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from k3serve.cli import main


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


def one_error_line(capsys, argv: list[str]) -> str:
    rc = main(["bench", "--disable-tqdm", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("k3serve: error: ")
    return err


def test_unreachable_url(capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    err = one_error_line(capsys, ["--base-url", url, "--num-prompts", "2"])
    assert f"cannot reach {url}" in err


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "sharegpt"], "unknown dataset 'sharegpt'"),
    (["--dataset", "trace"], "trace:FILE"),
    (["--dataset", "trace:/nonexistent/t.jsonl"], "trace file not found: /nonexistent/t.jsonl"),
    (["--base-url", "127.0.0.1:8000"], "expected http://HOST:PORT"),
    (["--goodput", "ttft=5"], "--goodput"),
    (["--metric-percentiles", "200"], "--metric-percentiles"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--endpoint", "chat", "--prompt-format", "ids"], "--prompt-format ids"),
    (["--extra-body", "{bad"], "--extra-body"),
])
def test_bad_arguments_fail_before_any_traffic(capsys, argv, message):
    # the URL is unreachable too: these must be caught before the server is contacted
    err = one_error_line(capsys, ["--base-url", f"http://127.0.0.1:{closed_port()}", *argv])
    assert message in err


def test_bad_trace_line(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}\n')
    err = one_error_line(capsys, ["--dataset", f"trace:{trace}"])
    assert "t.jsonl:1: bad trace record" in err


def test_unknown_model(capsys, fake_server):
    fake_server.reset()
    err = one_error_line(capsys, ["--base-url", fake_server.url, "--model", "nope"])
    assert "model 'nope' is not served" in err and "fake-model" in err


def test_server_rejecting_requests_fails_at_the_probe(capsys, fake_server):
    fake_server.reset(fail_every=1)
    err = one_error_line(capsys, ["--base-url", fake_server.url])
    assert "test request to " in err and "HTTP 500: injected failure" in err
    assert len(fake_server.state.bodies) == 1  # nothing after the probe


def test_the_bench_does_not_need_torch(tmp_path):
    # tools sit on top: a client machine without torch can run the bench
    code = ("import sys; from k3serve.cli import main; "
            "rc = main(['bench', '--dataset', 'trace:/nonexistent', '--disable-tqdm']); "
            "import k3serve.bench.runner, k3serve.bench.datasets; "
            "sys.exit(10 if 'torch' in sys.modules else rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == "k3serve: error: trace file not found: /nonexistent"


def test_error_event_in_the_stream_fails_the_request(capsys, fake_server):
    fake_server.reset(stream_error=True)
    err = one_error_line(capsys, ["--base-url", fake_server.url])
    assert err.endswith("failed: stream error: engine died")
