"""The engine in a child process: `stowage serve` on a private Unix socket or a loopback port (or where the caller
asks: a fixed port, another address), talked to over its HTTP API.

A crash of the engine (the out-of-memory killer, SIGBUS from a weights file truncated under the model, a fault
in a native kernel) ends the child, never the caller: the caller sees a closed stream and a dead process, and
gets EngineCrashedError saying how the engine died, with the text streamed so far already in its hands.
Ending the child returns all of its memory to the system at once.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EngineCrashedError, EngineStartError, GenerationCancelled, RemoteError
from ..protocol import API_KEY_ENV, DEFAULT_HOST, STDIN_REQUEST, UNIX_SCHEME, parse_progress

if TYPE_CHECKING:
    from .client import RemoteServer, RemoteStream
    from ..plan_request import PlanRequest

LoadProgress = Callable[[float, str], None]  # fraction, message: as Engine.load reports it
POLL_SECONDS = 0.05
HEALTH_SECONDS = 30.0  # from the URL on stdout to /health answering: uvicorn starting, no loading left
DEATH_SECONDS = 2.0  # a broken stream waits this long for the process to be seen dead before it is a plain error
STOP_SECONDS = 10.0
CAN_UNIX = os.name == "posix"  # Linux, macOS: Unix sockets, whose file mode keeps other users out
SOCKET_NAME = "engine.sock"

# What usually sends each signal to an engine; the message names the likely cause and the user's next step.
_CAUSES = {
    signal.SIGBUS: "a weights file changed or was truncated while in use",
    signal.SIGKILL: "the system ran out of memory (the out-of-memory killer), or a user killed it",
    signal.SIGSEGV: "a crash in native code (a kernel or a library)",
    signal.SIGABRT: "a native library aborted",
    signal.SIGILL: "an instruction this processor lacks (a kernel built for another CPU)",
    signal.SIGTERM: "something asked it to stop",
}


def describe_exit(returncode: int, last_error: str | None = None) -> str:
    """'the engine process was killed by SIGBUS: a weights file changed or was truncated while in use'."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"the engine process was killed by signal {-returncode}"
        cause = _CAUSES.get(sig)
        return f"the engine process was killed by {sig.name}" + (f": {cause}" if cause else "")
    return f"the engine process exited with status {returncode}" + (f": {last_error}" if last_error else "")


def engine_command() -> list[str]:
    """How to run the engine's CLI here: this interpreter with `-m stowage.engine.cli` (`-P`: the working folder is
    not put on sys.path, so a folder there cannot shadow the installed package), or, in a PyInstaller bundle (no
    interpreter to pass `-m` to), the bundle's own executable, which runs the engine's commands when given
    arguments (packaging/launch.py, stowage_entry.main)."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-P", "-m", "stowage.engine.cli"]


def serve_command(model_dir: str | Path, request: PlanRequest | None, *, port: int = 0, host: str = DEFAULT_HOST,
                  unix: str | Path | None = None) -> list[str]:
    """The child's command line: the plan request itself (the child plans it against the memory free then), or `-`
    for one that follows on its stdin (EngineProcess.launch); on host:port or on the Unix socket at `unix` (no key:
    that goes in the environment, where `ps` does not show it)."""
    listen = ["--unix", str(unix)] if unix is not None else ["--port", str(port), "--host", host]
    return [*engine_command(), "serve", str(model_dir), *listen, "--plan-request",
            request.to_json() if request is not None else STDIN_REQUEST, "--exit-with-parent"]


def client_url(url: str) -> str:
    """Where this machine reaches a server that printed url: a server listening on every address (0.0.0.0, ::)
    is reached on loopback."""
    if url.startswith(UNIX_SCHEME):
        return url
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    try:
        unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return url
    if not unspecified:
        return url
    return f"{scheme}://{'[::1]' if ':' in host else '127.0.0.1'}:{port}"


class EngineProcess:
    """A started engine child: `server` is its client; `chat`/`complete` report the child's death as
    EngineCrashedError. Start with `EngineProcess.start(...)`; `close()` ends it."""

    def __init__(self, proc: subprocess.Popen, key: str, socket_dir: str | None = None):
        self.proc = proc
        self.key = key
        self.socket_dir = socket_dir  # the private folder of its Unix socket, removed when it ends
        self.server: RemoteServer | None = None  # once the child printed its URL
        self._log: deque[str] = deque(maxlen=50)  # the child's last stderr lines, for the message when it dies
        self._progress: queue.SimpleQueue[tuple[float, str]] = queue.SimpleQueue()  # its loading, read by _wait
        self._urls: queue.Queue[str] = queue.Queue()  # the one line it prints on stdout: its base URL
        self._stderr = threading.Thread(target=_read_stderr, args=(proc, self._log, self._progress), daemon=True,
                                        name="stowage-engine-stderr")
        self._stderr.start()
        threading.Thread(target=_read_stdout, args=(proc, self._urls), daemon=True,
                         name="stowage-engine-stdout").start()

    @classmethod
    def start(cls, model_dir: str | Path, request: PlanRequest, *, progress: LoadProgress | None = None,
              cancel: threading.Event | None = None, env: dict[str, str] | None = None,
              nice: int = 0, port: int = 0, host: str = DEFAULT_HOST, api_key: str | None = None,
              unix: bool = False) -> "EngineProcess":
        """Start the child, forward its loading progress (progress is called on this thread, as Engine.load
        calls it), and return once it answers /health.

        It listens on host:port (0: a free port), or with unix=True on a Unix socket in a private folder (0700;
        the socket 0600), removed when it ends; `request` is planned there (its num_seqs served at once). api_key
        (default: a random one for this child only) reaches it in $STOWAGE_API_KEY, never on the command line;
        the child refuses an address other than loopback without one anyway.

        Raises EngineStartError with the child's own message when it refuses (a plan that does not fit, a
        malformed model, a port that is taken), EngineCrashedError when it dies, GenerationCancelled (the
        child ended) on cancel.set()."""
        process = cls.launch(model_dir, request, env=env, nice=nice, port=port, host=host, api_key=api_key, unix=unix)
        return process.wait_ready(progress=progress, cancel=cancel)

    @classmethod
    def launch(cls, model_dir: str | Path, request: PlanRequest | None = None, *, env: dict[str, str] | None = None,
               nice: int = 0, port: int = 0, host: str = DEFAULT_HOST, api_key: str | None = None,
               unix: bool = False) -> "EngineProcess":
        """Start the child and return at once (arguments as `start`). With request None the child starts on what
        needs no request (importing the engine, most of its start) and waits for `send(request)`: a caller that
        counts a prompt's tokens to size the context does that meanwhile. Then `wait_ready`."""
        if unix and not CAN_UNIX:
            raise EngineStartError("this system has no Unix domain sockets; start the engine on a port")
        key = api_key or secrets.token_urlsafe(32)
        child_env = {**os.environ, **(env or {}), API_KEY_ENV: key}
        socket_dir = tempfile.mkdtemp(prefix="stowage-") if unix else None  # mode 0700: this user only
        command = serve_command(model_dir, request, port=port, host=host,
                                unix=Path(socket_dir, SOCKET_NAME) if socket_dir else None)
        try:  # its own session: Ctrl-C in a terminal stops the caller's reply, not the engine
            proc = subprocess.Popen(command, stdin=subprocess.PIPE if request is None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env, text=True,
                                    encoding="utf-8", errors="replace", start_new_session=True)
        except BaseException:
            if socket_dir:
                shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        if nice:
            try:  # the child's main thread; the threads it starts later (torch's, uvicorn's) inherit it
                os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
            except (AttributeError, OSError):
                pass
        return cls(proc, key, socket_dir)

    def send(self, request: PlanRequest) -> None:
        """The plan request of a child launched without one (one line on its stdin, which then closes)."""
        try:
            self.proc.stdin.write(request.to_json() + "\n")
            self.proc.stdin.close()
        except OSError:  # it has already ended: wait_ready says how
            pass

    def wait_ready(self, *, progress: LoadProgress | None = None,
                   cancel: threading.Event | None = None) -> "EngineProcess":
        """Forward the child's loading progress until it answers /health (errors as `start`; the child is ended on
        any of them); returns self."""
        from .client import RemoteServer  # here: launch() starts the child before its client's imports

        try:
            url = self._wait(lambda: _get(self._urls), cancel, progress)
            if not url:  # stdout closed before a URL: the child is ending
                self._wait(lambda: None, cancel, progress)
            # a proxy must never see the key
            self.server = RemoteServer(client_url(url), self.key, trust_env=False)
            deadline = time.monotonic() + HEALTH_SECONDS

            def healthy() -> bool | None:
                if self.server.health():
                    return True
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine process printed {url} but did not answer there within "
                                           f"{HEALTH_SECONDS:.0f} s")
                return None

            self._wait(healthy, cancel, progress)
        except BaseException:
            self.kill()
            raise
        return self

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """Raise EngineCrashedError if the child has died."""
        if self.proc.poll() is not None:
            raise EngineCrashedError(self.death())

    def death(self) -> str:
        """How the child ended, in words (its last error line when it exited with a status)."""
        self._stderr.join(STOP_SECONDS)
        return describe_exit(self.proc.returncode, self._last_error())

    def chat(self, messages: list[dict], sampling, **kwargs) -> "Watched":
        """RemoteServer.chat, with the child's death as EngineCrashedError."""
        return Watched(self, self.server.chat(messages, sampling, **kwargs))

    def complete(self, prompt, sampling, **kwargs) -> "Watched":
        """RemoteServer.complete, with the child's death as EngineCrashedError."""
        return Watched(self, self.server.complete(prompt, sampling, **kwargs))

    def close(self) -> None:
        """Ask the child to unload and wait for it to exit; terminate, then kill it, if it does not."""
        if self.is_alive and self.server is not None:
            try:
                self.server.unload()
                self.proc.wait(STOP_SECONDS)
            except (RemoteError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """End the child now (SIGTERM, then SIGKILL) and let go of it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:  # launched, its request never sent
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.server is not None:
            self.server.close()
        if self.socket_dir is not None:  # the child removes its socket; a killed one cannot
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def raise_if_dead(self) -> None:
        """After a broken connection: EngineCrashedError if the child is ending (it may take a moment)."""
        try:
            self.proc.wait(DEATH_SECONDS)
        except subprocess.TimeoutExpired:
            return
        raise EngineCrashedError(self.death())

    # -- the parts -----------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], object], cancel: threading.Event | None,
              progress: LoadProgress | None = None):
        """Poll ready() until it returns something, passing the child's progress on; the child's end or
        cancel.set() raise instead."""
        while True:
            while progress is not None and (step := _get(self._progress)) is not None:
                progress(*step)
            value = ready()
            if value is not None:
                return value
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("loading was cancelled; the engine process was ended")
            if self.proc.poll() is not None:
                self._stderr.join(STOP_SECONDS)  # its last lines, up to the end of the pipe
                message = self._last_error()
                if self.proc.returncode > 0 and message:
                    raise EngineStartError(message)
                raise EngineCrashedError(self.death())
            time.sleep(POLL_SECONDS)

    def _last_error(self) -> str | None:
        """The child's one-line error (`stowage: ...`), else the last line it wrote to stderr."""
        lines = list(self._log)
        for line in reversed(lines):
            if line.startswith("stowage: "):
                return line.removeprefix("stowage: ")
        return lines[-1] if lines else None


class Watched:
    """A RemoteStream whose broken connection is EngineCrashedError when the engine process died."""

    def __init__(self, process: EngineProcess, stream: RemoteStream):
        self.process, self.stream = process, stream

    @property
    def result(self):
        return self.stream.result

    def __iter__(self) -> Iterator[str]:
        self.process.check()
        try:
            yield from self.stream
        except RemoteError:
            self.process.raise_if_dead()
            raise


def _get(q: queue.Queue | queue.SimpleQueue):
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


def _read_stdout(proc: subprocess.Popen, urls: queue.Queue) -> None:
    urls.put(proc.stdout.readline().strip())  # the one line: the base URL ("" if the child ends first)
    for _ in proc.stdout:
        pass


def _read_stderr(proc: subprocess.Popen, log: deque[str], progress: queue.SimpleQueue) -> None:
    for line in proc.stderr:
        parsed = parse_progress(line)
        if parsed is None:
            log.append(line.rstrip())
        else:
            progress.put(parsed)
