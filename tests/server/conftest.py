"""Real servers for the end-to-end tests: `k3serve serve` subprocesses on 127.0.0.1, always stopped.

The model is `k3-tiny-fullvocab` (packaged config): the k3-tiny architecture with the full Kimi
vocabulary (163,840 ids, eos `<|end_of_msg|>` 163586), so chat prompts with the real special
tokens fit; random weights written once per session (about 90 MB, a few seconds).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


class Server:
    def __init__(self, ckpt: Path | None, *args: str, timeout: float = 120.0):
        """``ckpt`` None: exactly ``k3serve serve --port PORT *args``, the package's default model and settings."""
        self.contract = "kimi" if "kimi" in args else "openai"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "k3serve", "serve", "--port", str(self.port), *args]
        if ckpt is not None:
            cmd[4:4] = [str(ckpt)]
            cmd += ["--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", "2048"]
        self.log = Path(tempfile.gettempdir()) / f"k3serve-test-server-{self.port}.log"
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not become healthy")
            time.sleep(0.3)
        self.engine_pids = children(self.proc.pid)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def stop(self) -> None:
        kids = children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log_file.close()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from k3serve.testing import write_random_checkpoint

    return write_random_checkpoint("k3-tiny-fullvocab", tmp_path_factory.mktemp("k3-tiny-fullvocab"), seed=0)


@pytest.fixture(scope="session")
def server_factory(tiny_checkpoint):
    started: list[Server] = []

    def start(*args: str) -> Server:
        s = Server(tiny_checkpoint, *args)
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="session")
def kimi_server(server_factory) -> Server:
    return server_factory("--api-contract", "kimi")


@pytest.fixture(scope="session")
def openai_server(server_factory) -> Server:
    return server_factory("--api-contract", "openai")


@pytest.fixture(scope="session", params=["kimi", "openai"])
def server(request) -> Server:
    return request.getfixturevalue(f"{request.param}_server")


def in_process_app(config):
    """`build_app(config)` with a stand-in engine client that is ready and admits everything (for tests that
    drive the app through httpx's ASGI transport, no engine process)."""
    from types import SimpleNamespace

    from k3serve.chat import K3
    from k3serve.server.app import build_app

    app = build_app(config)
    state = app.state.k3
    ready = SimpleNamespace(supports_images=True, max_model_len=1 << 20, vocab_size=163840)
    state.client = SimpleNamespace(ready=ready, alive=True, dead_reason=None, state="ready", restarts=0,
                                   check_admission=lambda n=1: None)
    state.fmt, state.contract = K3, "openai"
    return app
