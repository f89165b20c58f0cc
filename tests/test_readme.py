"""Every `k3serve` command and Python block in the README runs, with small inputs (issue 49, item 2).

Commands are read from the README's bash blocks, so a new command there without a way to run it here fails
`test_every_readme_command_is_covered`. Placeholders (`/path/to/checkpoint`, `FILE`, `trace.jsonl`, the
replica hosts, the Hugging Face id) become small local stand-ins; servers get a free port on 127.0.0.1,
must answer `/health`, and are stopped by SIGTERM, after which none of their processes may be left.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import children, free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_tail200.jsonl"
HF_ID = "moonshotai/Kimi-Linear-48B-A3B-Instruct"


def readme_commands() -> list[str]:
    """Each `k3serve ...` command of the README's bash blocks, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if "k3serve " in line and not line.startswith(("pip ", "curl ")):
                out.append(line[line.index("k3serve "):])
            elif line.endswith("&& k3serve serve"):
                out.append("k3serve serve")
    return out


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    from k3serve.testing import write_random_checkpoint

    tmp = tmp_path_factory.mktemp("readme")
    ckpt = write_random_checkpoint("k3-tiny-fullvocab", tmp / "ckpt", seed=0)
    # A Hugging Face cache holding a snapshot of the id, read offline: resolution goes through huggingface_hub.
    commit = "0" * 40
    repo = tmp / "hf" / ("models--" + HF_ID.replace("/", "--"))
    write_random_checkpoint("kimi-linear-tiny", repo / "snapshots" / commit, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    text = tmp / "file.txt"
    text.write_text("Kimi K3 serves tool calls.\n" * 20)
    key = tmp / "key.txt"
    key.write_text("a-readme-test-kv-events-secret\n")
    return {"/path/to/checkpoint": str(ckpt), "FILE": str(text), "key.txt": str(key), "trace.jsonl": str(TRACE), "hf_cache": str(tmp / "hf")}


def _argv(command: str, stand_ins: dict[str, str]) -> list[str]:
    argv = shlex.split(command)[1:]
    return [stand_ins.get(a, a) for a in argv]


def _env(stand_ins: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": stand_ins["hf_cache"], "HF_HUB_OFFLINE": "1"}


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag, value]


def _run_server(argv: list[str], env: dict[str, str], probe: str = "/health", timeout: float = 180) -> None:
    """Start a long-running command, wait until `probe` answers, SIGTERM it, check nothing is left."""
    port = free_port()
    argv = _set(argv, "--port", str(port))
    proc = subprocess.Popen([sys.executable, "-m", "k3serve", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"`k3serve {shlex.join(argv)}` exited: {proc.stdout.read()[-3000:]}"
            started |= _descendants(proc.pid)
            try:
                if httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"`k3serve {shlex.join(argv)}` never answered {probe}"
            time.sleep(0.3)
        started |= _descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    left = [pid for pid in started if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode is not None and not left, f"processes left after SIGTERM: {left}"


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for kid in children(todo.pop()):
            out.add(kid)
            todo.append(kid)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run(argv: list[str], env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "k3serve", *argv], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"`k3serve {shlex.join(argv)}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def _bench(argv: list[str], env: dict[str, str]) -> None:
    """`bench` and `verify` need a server: the default model, as the README's first command serves it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "k3serve", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the default server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        argv = _set(argv, "--base-url", f"http://127.0.0.1:{port}")
        if argv[0] == "verify":  # the parameter checks only (seconds); the report goes to a temporary file
            html = Path(tempfile.mkdtemp()) / "report.html"
            _run(_set(argv, "--html", str(html)) + ["--only", "params"], env)
            assert "verdict" in html.read_text().lower()
        else:
            _run(_set(_set(argv, "--num-prompts", "2"), "--output-len", "4"), env)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def run_readme_command(command: str, stand_ins: dict[str, str]) -> None:
    argv, env = _argv(command, stand_ins), _env(stand_ins)
    sub = argv[0] if argv else ""
    if sub == "serve":
        _run_server(argv, env)
    elif sub == "route" and "simulate" not in argv:
        # the replica hosts stand for servers elsewhere; unreachable ones leave the router up, reporting them
        argv = [f"http://127.0.0.1:{free_port()}" if a.startswith("http://h") else a for a in argv]
        _run_server(argv, env, probe="/router/replicas")
    elif sub in ("bench", "verify"):
        _bench(argv, env)
    elif sub in ("route", "generate", "tokenize", "params", "plan"):
        _run(argv, env)
    elif sub == "sweep":  # its flags and grid, checked and expanded; a real sweep is minutes (tests/sweep runs one)
        _run([*argv, "--dry-run"], env)
    else:
        pytest.fail(f"README command `{command}` has no way to run here: add one to {__file__}")


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert "k3serve serve" in commands and len(commands) >= 10
    known = {"serve", "route", "bench", "verify", "generate", "tokenize", "params", "plan", "sweep"}
    assert {shlex.split(c)[1] for c in commands} <= known


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, stand_ins):
    run_readme_command(command, stand_ins)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    code = python_blocks()[index].replace("/tmp/", f"{tmp_path}/")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]


def test_readme_states_how_much_of_the_vocabulary_the_default_model_knows():
    from safetensors import safe_open

    from k3serve.models.registry import WEIGHTS_DIR

    claim = re.search(r"knows only the ([\d,]+) of the Kimi vocabulary's ([\d,]+) tokens", README.read_text())
    assert claim, "README lost its sentence on the default model's vocabulary"
    path = WEIGHTS_DIR / "k3-default" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        embed = f.get_tensor("language_model.model.embed_tokens.weight")
    known = int((embed.float().abs().sum(-1) > 0).sum())
    assert (int(claim.group(1).replace(",", "")), int(claim.group(2).replace(",", ""))) == (known, embed.shape[0])


def test_readme_install_notes_hold():
    """What a newcomer needs beyond the two commands: the compiler the build uses, the CPU wheel's index."""
    text = README.read_text()
    setup = (ROOT / "setup.py").read_text()
    assert "cxx_std=17" in setup and "C++17 compiler" in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    for route in ("/v1/messages", "/metrics", "--api-key", "--api-contract openai"):
        assert route in text, route
