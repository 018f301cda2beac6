"""Where the API listens and how it runs: a loopback or keyed TCP socket, or a private Unix socket; the uvicorn
server over a Serving, with deadlines on reading a request; `serve`, which runs it until stopped."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import stat
import sys
from pathlib import Path

from ..errors import InvalidArgumentError, StowageError
from ..protocol import API_KEY_ENV, UNIX_SCHEME, is_loopback

MAX_UNIX_PATH = 104  # bytes of a socket path that every system takes (Linux 107, macOS 103 plus the NUL)


def listen(host: str, port: int, *, has_key: bool) -> socket.socket:
    """A listening socket; refuses an address other than loopback without an API key."""
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise InvalidArgumentError(f"--host {host!r}: not an address of this machine ({e.strerror})") from None
    if not is_loopback(address[0]) and not has_key:
        raise InvalidArgumentError(f"--host {host}: other machines could reach the server; give --api-key KEY "
                                   f"(or ${API_KEY_ENV}) so that only clients with the key can use it")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise StowageError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port "
                           "(0 picks a free one)") from None
    return sock


def listen_unix(path: Path) -> socket.socket:
    """A listening Unix domain socket at path, readable and writable by this user only (0600). A socket file
    left by a server that is gone is removed first; one that a server still listens on, or a file that is not a
    socket, is refused."""
    if not hasattr(socket, "AF_UNIX"):
        raise InvalidArgumentError("--unix: this system has no Unix domain sockets; use --host/--port")
    path = path.absolute()
    if len(os.fsencode(path)) >= MAX_UNIX_PATH:
        raise InvalidArgumentError(f"--unix {path}: a socket path may have at most {MAX_UNIX_PATH - 1} bytes, this "
                                   f"one has {len(os.fsencode(path))}; choose a shorter path")
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)  # the file is created 0600: no moment where another user could connect
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise StowageError(f"cannot listen on {path}: {e.strerror}") from None
    finally:
        os.umask(previous)
    return sock


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidArgumentError(f"--unix {path}: the path exists and is not a socket; it was left alone, choose "
                                   "another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)  # a server whose backlog is full makes a connect wait
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):  # nothing listens: a socket file a dead server left
        path.unlink(missing_ok=True)
        return
    except OSError as e:
        raise InvalidArgumentError(f"--unix {path}: cannot tell whether a server listens there ({e.strerror}); "
                                   "remove it or choose another path") from None
    finally:
        probe.close()
    raise StowageError(f"cannot listen on {path}: a server listens there already; stop it or choose another --unix "
                       "path")


def close_listener(sock: socket.socket, url: str | None = None) -> None:
    """Close a listening socket; a Unix socket's file goes with it. url: its base_url, for a socket that uvicorn
    may have closed already (a closed socket has no name)."""
    url = url or base_url(sock)
    sock.close()
    if url.startswith(UNIX_SCHEME):
        Path(url.removeprefix(UNIX_SCHEME)).unlink(missing_ok=True)


def base_url(sock: socket.socket) -> str:
    """What a client connects to: `http://HOST:PORT`, or `unix:PATH` for a Unix socket."""
    if sock.family == getattr(socket, "AF_UNIX", None):
        return f"{UNIX_SCHEME}{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def serve(engine, sock: socket.socket, defaults, *, api_key: str | None, cors_origins: tuple[str, ...] = ()) -> None:
    """Run the API on sock until interrupted, engine first (POST /stowage/load replaces it with a model `defaults`
    lists); prints the base URL (or `unix:PATH`) on stdout once it is listening."""
    from ..serving.scheduler import Scheduler
    from .serving import Served, Serving

    parallel = defaults.parallel
    serving = Serving(Served(engine.name, Scheduler(engine, max_running=parallel, max_waiting=defaults.max_queue)),
                      defaults)
    serving.current.scheduler.start()  # once Serving watches it (a weights file changing unloads the model)
    url = base_url(sock)
    loopback_bind = sock.family != getattr(socket, "AF_UNIX", None) and is_loopback(sock.getsockname()[0])
    server = http_server(serving, api_key=api_key, cors_origins=cors_origins, loopback_bind=loopback_bind)
    print(url, flush=True)  # the one line on stdout: a parent process reads the port from it
    api = url if url.startswith(UNIX_SCHEME) else f"{url}/v1"
    sys.stderr.write(f"serving {engine.name} at {api} ({parallel} x {engine.cache.context_tokens:,}-token "
                     f"sequences{', API key required' if api_key else ''}); Ctrl-C stops\n")
    try:
        server.run(sockets=[sock])  # Ctrl-C and SIGTERM end it gracefully, and are not raised again (_Server)
    finally:
        serving.close()
        close_listener(sock, url)


def http_server(serving, *, api_key: str | None, cors_origins: tuple[str, ...] = (), loopback_bind: bool = True):
    """The uvicorn server of the API over a Serving (or a started scheduler); `.run(sockets=[...])` serves.
    loopback_bind: whether those sockets are loopback only (create_app)."""
    import uvicorn

    from .app import create_app
    from .deadlines import DeadlineH11Protocol
    from .guards import MAX_HEAD_BYTES
    from .serving import Serving

    serving = serving if isinstance(serving, Serving) else Serving.of(serving)

    def unload() -> None:  # POST /stowage/unload: stop serving; run_serve then frees the engine and returns
        server.should_exit = True

    # h11 with read deadlines (deadlines.py), its buffer bound at the app's head limit. No limit_concurrency: uvicorn
    # counts open sockets, so idle ones locked every client out; the app counts requests (guards.py max_requests).
    app = create_app(serving, api_key=api_key, on_unload=unload, cors_origins=cors_origins,
                     loopback_bind=loopback_bind)
    config = uvicorn.Config(app, log_level="warning", http=DeadlineH11Protocol,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES, timeout_graceful_shutdown=5)
    server = _server_class()(config)
    return server


@functools.cache
def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that Ctrl-C or SIGTERM is not raised again after its graceful shutdown (uvicorn
        re-raises the signal, so `serve` died with -15): `serve` then writes the cached conversations to the KV
        store, removes its socket file and returns, and the process exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()  # read by the super's exit, which would raise them again

    return Server

