"""`stowage serve MODEL`: the model behind an OpenAI-compatible HTTP API, its memory planned before it starts."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

from stowage.kernels import cpu_decode

from ..defaults import DEFAULT_CONTEXT
from ..dtypes import COMPUTE, KV
from ..errors import InvalidArgumentError, StowageError
from ..units import format_bytes
from ..serving.kv_store import KV_DIR_ENV
from .plan import _gpu_layers, _size
from ..server import UNIX_SCHEME

API_KEY_ENV = "STOWAGE_API_KEY"  # the key without putting it on the command line (where `ps` shows it)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_UNIX_PATH = 104  # bytes of a socket path that every system takes (Linux 107, macOS 103 plus the NUL)
DEFAULT_MAX_QUEUE = 16
_PROGRESS = re.compile(r"\[\s*(\d+(?:\.\d+)?)%\] (.*)")


def write_progress(fraction: float, message: str) -> None:
    """Loading progress on stderr, `[ 45.0%] message`: redrawn in place on a terminal, a line each otherwise
    (a parent process reads them: parse_progress)."""
    line = f"[{fraction * 100:5.1f}%] {message}"
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{line}" + ("\n" if fraction >= 1.0 else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def parse_progress(line: str) -> tuple[float, str] | None:
    """(fraction, message) of a line write_progress wrote; None for any other line."""
    match = _PROGRESS.fullmatch(line.strip())
    return (float(match[1]) / 100, match[2]) if match else None


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `serve` subcommand; its `func` runs the server until Ctrl-C and returns the exit status."""
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve MODEL_DIR at http://HOST:PORT/v1 (chat/completions, completions, models; /health). "
                    "The KV cache for --parallel sequences of --context tokens is planned before anything loads; "
                    "requests beyond --parallel wait in a queue of --max-queue, past it they get 503.")
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path, help="folder with config.json and *.safetensors")
    p.add_argument("--context", metavar="N", type=int, default=None,
                   help=f"context tokens of each sequence (default {DEFAULT_CONTEXT:,} or the model's maximum)")
    p.add_argument("--parallel", metavar="N", type=int, default=1,
                   help="sequences generated at once, sharing each decode step; each holds a whole context of "
                        "KV cache (default 1)")
    p.add_argument("--max-queue", metavar="N", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait for a free sequence (default {DEFAULT_MAX_QUEUE})")
    # None: not given, so that --unix can refuse an explicit --host or --port
    p.add_argument("--host", default=None, help=f"address to listen on (default {DEFAULT_HOST}, this machine only)")
    p.add_argument("--port", type=int, default=None,
                   help=f"port (default {DEFAULT_PORT}; 0: a free one, printed on stdout)")
    p.add_argument("--unix", metavar="PATH", type=Path, default=None,
                   help="listen on a Unix domain socket at PATH (mode 0600: this user only) instead of TCP; "
                        f"stdout then prints {UNIX_SCHEME}PATH")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV}); needed for any address "
                        "other than loopback")
    p.add_argument("--dtype", choices=sorted(COMPUTE), default=None,
                   help="weights dtype (default: as stored, used in place)")
    p.add_argument("--kv-dtype", choices=sorted(KV), default=None)
    p.add_argument("--gpu-layers", metavar="N", type=_gpu_layers, default=None,
                   help="layers on the GPUs: a number (0 = CPU only) or auto (default)")
    p.add_argument("--kv-disk-budget", metavar="SIZE", type=_size, default=None,
                   help="disk space for the KV cache of conversations evicted from memory, read back when they "
                        f"resume instead of prefilled again (in ${KV_DIR_ENV} or the user cache dir; default "
                        "min(4GiB, 10%% of the free disk); 0: off)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="Stowage's models folder, among the places whose models POST /stowage/load may load "
                        "(default: the one the desktop app uses; `stowage list` shows them all)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one ends (an app running its engine as a child)")
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    from ..formats.discovery import Places, default_models_dir
    from ..runtime.engine import Engine
    from ..planning.report import summary
    from ..server.serving import LoadDefaults, plan_serving

    for name, least in (("context", 1), ("parallel", 1), ("max_queue", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if args.unix is not None and (args.host is not None or args.port is not None):
        raise InvalidArgumentError("--unix listens on a socket file, not on a TCP address: give --unix PATH or "
                                   "--host/--port, not both")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    cpu_decode.use_default_threads()  # the cores it may use, or the CLI's --threads
    if args.exit_with_parent:
        _exit_with_parent()
    # Planned against this machine first: a shortage is an error before anything is allocated.
    plan = plan_serving(args.model_dir, args.context, parallel=args.parallel, dtype=args.dtype,
                        kv_dtype=args.kv_dtype, gpu_layers=args.gpu_layers, kv_disk_budget=args.kv_disk_budget)
    defaults = LoadDefaults(Places.default(args.models_dir or default_models_dir()), parallel=args.parallel,
                            max_queue=args.max_queue, gpu_layers=args.gpu_layers,
                            kv_disk_budget=args.kv_disk_budget)
    # a taken port or socket path fails before the load
    sock = (listen_unix(args.unix) if args.unix is not None else
            listen(args.host or DEFAULT_HOST, DEFAULT_PORT if args.port is None else args.port,
                   has_key=api_key is not None))
    try:
        spill = (f"; evicted conversations' KV cache up to {format_bytes(plan.kv_disk_bytes)} in {plan.kv_dir}"
                 if plan.kv_disk_bytes else "")
        sys.stderr.write(f"loading {args.model_dir.name}: {summary(plan)} for {args.parallel} sequence(s){spill}\n")
        engine = Engine.load(args.model_dir, plan, progress=write_progress)
    except BaseException:
        close_listener(sock)
        raise
    serve(engine, sock, defaults, api_key=api_key)
    return 0


def _exit_with_parent() -> None:
    """SIGTERM to this process once its parent is gone (re-parented): a clean stop while serving, the default
    end while loading. An app killed outright must not leave its engine holding memory."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="stowage-parent-watch").start()


def listen(host: str, port: int, *, has_key: bool) -> socket.socket:
    """A listening socket; refuses an address other than loopback without an API key."""
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise InvalidArgumentError(f"--host {host!r}: not an address of this machine ({e.strerror})") from None
    if not ipaddress.ip_address(address[0]).is_loopback and not has_key:
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


def serve(engine, sock: socket.socket, defaults, *, api_key: str | None) -> None:
    """Run the API on sock until interrupted, engine first (POST /stowage/load replaces it with a model `defaults`
    lists); prints the base URL (or `unix:PATH`) on stdout once it is listening."""
    from ..serving.scheduler import Scheduler
    from ..server.serving import Served, Serving

    parallel = defaults.parallel
    serving = Serving(Served(engine.name, Scheduler(engine, max_running=parallel,
                                                    max_waiting=defaults.max_queue).start()), defaults)
    url = base_url(sock)
    server = http_server(serving, api_key=api_key)
    print(url, flush=True)  # the one line on stdout: a parent process reads the port from it
    api = url if url.startswith(UNIX_SCHEME) else f"{url}/v1"
    sys.stderr.write(f"serving {engine.name} at {api} ({parallel} x {engine.cache.max_tokens:,}-token "
                     f"sequences{', API key required' if api_key else ''}); Ctrl-C stops\n")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down gracefully on Ctrl-C / SIGTERM, then raises the signal again
        pass
    finally:
        serving.close()
        close_listener(sock, url)


def http_server(serving, *, api_key: str | None):
    """The uvicorn server of the API over a Serving (or a started scheduler); `.run(sockets=[...])` serves."""
    import uvicorn

    from ..server.app import MAX_HEAD_BYTES, create_app
    from ..server.serving import Serving

    serving = serving if isinstance(serving, Serving) else Serving.of(serving)

    def unload() -> None:  # POST /stowage/unload: stop serving; run_serve then frees the engine and returns
        server.should_exit = True

    # h11 (whatever else is installed) with its buffer bound at the app's head limit; connections past
    # limit_concurrency get uvicorn's 503 before they cost anything. The limit follows the model served: a load
    # with another `parallel` sets it anew (uvicorn reads it from the config at each new connection).
    config = uvicorn.Config(create_app(serving, api_key=api_key, on_unload=unload), log_level="warning",
                            http="h11", h11_max_incomplete_event_size=MAX_HEAD_BYTES, timeout_graceful_shutdown=5,
                            limit_concurrency=connection_limit(serving.current.scheduler))
    serving.on_loaded = lambda served: setattr(config, "limit_concurrency", connection_limit(served.scheduler))
    server = uvicorn.Server(config)
    return server


def connection_limit(scheduler) -> int:
    """The connections a server takes at once: room for every running and waiting request, a stream and a retry
    each, and some for /health, /v1/models and loads."""
    return 4 * (scheduler.max_running + scheduler.max_waiting) + 32
