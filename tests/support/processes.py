"""Processes and servers the tests start, seen from outside: whether one still runs, a port to give one, a client."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

TIMEOUT_S = 60  # seconds a client waits for a test's server
ROOT = Path(__file__).resolve().parents[2]
SERVE_KEY = "test-key"
# one thread in the server as in this process (tests/conftest.py): the same matrix products, the same greedy tokens
SERVE_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "STOWAGE_API_KEY": SERVE_KEY}


def stowage(*args, env=SERVE_ENV) -> subprocess.Popen:
    """`stowage ARGS` (the installed package's CLI) as a child with its stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-P", "-m", "stowage.engine.cli", *map(str, args)], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_line(proc: subprocess.Popen) -> str:
    """The child's next line on stdout (a server's URL), failing after TIMEOUT_S rather than hanging."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(TIMEOUT_S), "the server printed no URL"
    return proc.stdout.readline().strip()


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    """A loopback port nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openai_client(base_url: str, key: str, **http):
    """The official client, no retries; `http`: httpx.Client options (a Unix socket's transport)."""
    import httpx
    import openai

    # trust_env=False: a proxy from the environment must not stand between the test and the server
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S,
                         http_client=httpx.Client(trust_env=False, **http))


@contextmanager
def running(server, sock: socket.socket):
    """A uvicorn server (engine/server/listener.py http_server) serving sock on a thread of its own, started before
    the body runs and stopped after it."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)


@contextmanager
def served(engine, *, max_running: int = 2, max_waiting: int = 4):
    """The official client of an in-process server of `engine` (its scheduler started here) on a loopback port, with
    no key; the scheduler and the socket are closed after the body."""
    from stowage.engine.server.listener import http_server, listen
    from stowage.engine.serving.scheduler import Scheduler

    scheduler = Scheduler(engine, max_running=max_running, max_waiting=max_waiting).start()
    sock = listen("127.0.0.1", 0, has_key=False)
    try:
        with running(http_server(scheduler, api_key=None), sock):
            yield openai_client(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", "unused")
    finally:
        scheduler.close()
        sock.close()
