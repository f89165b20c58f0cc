"""Process lifetime: every process k3serve starts dies with the one that started it.

* A parent starts children with ``child_env()``; each child calls ``die_with_parent()`` first thing, so
  it gets SIGTERM when its parent dies, even by SIGKILL (Linux: ``PR_SET_PDEATHSIG``; elsewhere a
  thread that watches the parent pid).
* ``on_stop_signals`` routes the signals a supervisor sends (SIGTERM, SIGINT, SIGHUP) to one handler,
  so a launcher runs its ``finally`` (stopping its children) instead of dying on the spot.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

PARENT_ENV = "K3SERVE_PARENT_PID"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class Stopped(KeyboardInterrupt):
    """Raised by the default stop handler; a KeyboardInterrupt so every ``finally`` and Ctrl-C path runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must call ``die_with_parent()``: this process is its parent."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def compute_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``child_env`` for a process that runs torch ops (an engine core, a rank): OpenMP threads that wait
    sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose a policy. Spinning waiters of processes that
    share cores starve each other: on 2 shared cores a k3-tiny decode run took 47 s spinning, 3.5 s passive
    (benchmarks/RESULTS.md, "thread oversubscription"). libgomp reads it once at load: it must be in the env."""
    env = child_env(env)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def die_with_parent() -> None:
    """If started with ``child_env()``: receive SIGTERM when the parent dies. No-op otherwise.

    PR_SET_PDEATHSIG fires when the parent's *thread* that forked us ends, so parents start children
    from their main thread (the event loop's). The variable is removed so our own children (which get
    their own ``child_env()``) never compare against the wrong parent."""
    value = os.environ.pop(PARENT_ENV, None)
    if not value:
        return
    parent = int(value)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
                if os.getppid() != parent:  # died before prctl took effect
                    os.kill(os.getpid(), signal.SIGTERM)
                return
    threading.Thread(target=_watch_parent, args=(parent,), name="k3serve-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def _raise_stopped(signum: int) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[int], None] = _raise_stopped) -> Iterator[None]:
    """Call ``handler(signum)`` on SIGTERM, SIGINT and SIGHUP (main thread only); the default raises
    ``Stopped``. Previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda s, _f: handler(s)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def graceful_sighup(handle_exit: Callable) -> Iterator[None]:
    """Inside, SIGHUP calls ``handle_exit(signum, frame)`` (uvicorn's graceful stop covers only SIGINT
    and SIGTERM); a SIGHUP caught is raised again on exit, for the handler that was there before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def on_hup(signum, frame):
        caught.append(signum)
        handle_exit(signum, frame)

    previous = signal.signal(signal.SIGHUP, on_hup)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)
    if caught:
        signal.raise_signal(signal.SIGHUP)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it); a child process binds it next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM every child still running (each stops its own children), wait up to ``timeout`` seconds in all,
    then kill what stays."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(procs: list[subprocess.Popen]) -> int:
    """Run until one of ``procs`` exits or this process is told to stop (SIGTERM/SIGINT), then stop them all;
    0, or 1 when any of them failed. What a host that only runs ranks or replicas for another host does."""
    try:
        with on_stop_signals():
            while all(p.poll() is None for p in procs):
                time.sleep(0.2)
    except Stopped:
        pass
    failed = any(p.poll() not in (None, 0) for p in procs)
    stop_processes(procs)
    return 1 if failed else 0
