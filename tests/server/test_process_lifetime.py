"""Every process `k3serve serve` starts dies with it, on whatever signal a supervisor sends; start-up
failures are one line on stderr and a non-zero exit, before anything claims to serve."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import children, free_port

STARTUP_S = 180


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        out.update(kids)
        todo += kids
    return out


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(pid)
        except OSError:
            pass
    return left


class Launch:
    """``k3serve serve ...`` in its own session, so whatever it leaves behind is killed by the test."""

    def __init__(self, *args: str, tmp_path):
        self.port = free_port()
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "k3serve", "serve", *args, "--port", str(self.port)],
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid
        self.seen: set[int] = set()

    def wait_healthy(self, expect_procs: int) -> None:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert self.proc.poll() is None, self.err.read_text()[-3000:]
            try:
                healthy = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
            self.seen = descendants(self.proc.pid)
            if healthy and len(self.seen) >= expect_procs:
                return
            assert time.monotonic() < deadline, "not healthy in time"
            time.sleep(0.5)

    def close(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


@pytest.fixture
def launch(tmp_path):
    started: list[Launch] = []

    def start(*args: str) -> Launch:
        started.append(Launch(*args, tmp_path=tmp_path))
        return started[-1]

    try:
        yield start
    finally:
        for one in started:
            one.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signal_stops_server_and_engine(launch, tiny_checkpoint, sig):
    srv = launch(str(tiny_checkpoint), "--max-model-len", "2048")
    srv.wait_healthy(expect_procs=1)  # the engine-core process
    os.kill(srv.proc.pid, sig)
    assert srv.proc.wait(30) == 0
    assert not wait_gone(srv.seen, 10), "engine process left behind"
    assert "Traceback" not in srv.err.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_replicas_die_with_their_launcher(launch, tiny_checkpoint, sig):
    """SIGTERM: the launcher stops its replicas (each stops its engine); SIGKILL: the kernel tells them."""
    srv = launch(str(tiny_checkpoint), "--max-model-len", "2048", "--replicas", "2")
    srv.wait_healthy(expect_procs=4)  # 2 replicas, 2 engines
    os.kill(srv.proc.pid, sig)
    srv.proc.wait(40)
    left = wait_gone(srv.seen, 30)
    assert not left, f"left running: {left}"


def _fails_in_one_line(launch, *args: str, needle: str) -> None:
    srv = launch(*args)
    assert srv.proc.wait(STARTUP_S) == 1
    err = srv.err.read_text().strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert "serving" not in srv.out.read_text()
    assert not wait_gone(descendants(srv.proc.pid), 5)


@pytest.mark.parametrize("args, needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-model-len", "100000000"], "max_position_embeddings"),
    (["--device", "cuda:63"], "--device"),
])
def test_bad_engine_flags_are_one_line(launch, tiny_checkpoint, args, needle):
    _fails_in_one_line(launch, str(tiny_checkpoint), *args, needle=needle)


def test_engine_start_failure_is_one_line(launch, tmp_path, tiny_checkpoint):
    """The engine process fails while loading (no weights): its error reaches the terminal as one line."""
    bad = tmp_path / "no-weights"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    _fails_in_one_line(launch, str(bad), needle="the engine failed to start")


def test_busy_port_is_one_line(tiny_checkpoint):
    """Refused at once, before the engine loads (uvicorn would say it after, with a log line of its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "k3serve", "serve", str(tiny_checkpoint), "--port", str(port)],
                              capture_output=True, text=True, timeout=STARTUP_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and "serving" not in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and f"{port}" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_dead_replica_is_reaped_and_restarted(launch, tiny_checkpoint):
    """``--replicas``: a replica that dies is reaped (no zombie) and started again on its port."""
    srv = launch(str(tiny_checkpoint), "--max-model-len", "2048", "--replicas", "2")
    srv.wait_healthy(expect_procs=4)  # 2 replicas, 2 engines
    replica = children(srv.proc.pid)[0]
    os.kill(replica, signal.SIGKILL)
    deadline = time.monotonic() + STARTUP_S
    while True:
        kids = children(srv.proc.pid)  # zombies included: an unreaped replica would still be listed
        try:
            healthy = httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and len(kids) == 2 and replica not in kids:
            break
        assert time.monotonic() < deadline, f"not restarted: children {kids}\n{srv.err.read_text()[-2000:]}"
        time.sleep(0.5)
    srv.seen |= descendants(srv.proc.pid)
    assert srv.proc.poll() is None
