"""`stowage serve MODEL`: the model behind an OpenAI-compatible HTTP API, its memory planned before it starts."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from typing import TYPE_CHECKING

from ..defaults import DEFAULT_CONTEXT, KV_DIR_ENV
from ..dtypes import COMPUTE_NAMES
from ..errors import InvalidArgumentError
from ..units import format_bytes
from .plan import KV_DTYPE_HELP, _gpu_layers, _kv_dtype, _size
from ..protocol import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, STDIN_REQUEST, UNIX_SCHEME, write_progress

if TYPE_CHECKING:  # the engine and the server import torch: only `serve` itself needs them, never the parser
    from ..plan_request import PlanRequest

DEFAULT_MAX_QUEUE = 16


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `serve` subcommand; its `func` runs the server until Ctrl-C and returns the exit status."""
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve MODEL at http://HOST:PORT/v1 (chat/completions, completions, models; /health). "
                    "The KV cache for --parallel sequences of --context tokens is planned before anything loads; "
                    "requests beyond --parallel wait in a queue of --max-queue, past it they get 503.")
    p.add_argument("model_dir", metavar="MODEL", type=Path,
                   help="a model folder (config.json, *.safetensors) or a .gguf file")
    p.add_argument("--context", dest="context_tokens", metavar="N", type=int, default=None,
                   help=f"context tokens of each sequence (default {DEFAULT_CONTEXT:,} or the model's maximum)")
    p.add_argument("--parallel", metavar="N", type=int, default=None,
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
    p.add_argument("--cors-origin", metavar="ORIGIN", dest="cors_origins", action="append", type=_origin, default=[],
                   help="let the web page at ORIGIN (scheme://host[:port]) call the server from a browser; "
                        "repeatable. Other pages are refused (docs/server.md, Security)")
    p.add_argument("--dtype", choices=sorted(COMPUTE_NAMES), default=None,
                   help="weights dtype (default: as stored, used in place)")
    p.add_argument("--kv-dtype", type=_kv_dtype, default=None, metavar="TYPE", help=KV_DTYPE_HELP)
    p.add_argument("--gpu-layers", metavar="N", type=_gpu_layers, default=None,
                   help="layers on the GPUs: a number (0 = CPU only) or auto (default)")
    p.add_argument("--kv-disk-budget", metavar="SIZE", type=_size, default=None,
                   help="disk space for the KV cache of conversations evicted from memory, read back when they "
                        f"resume instead of prefilled again (in ${KV_DIR_ENV} or the user cache dir; default "
                        "min(4GiB, 10%% of the free disk); 0: off)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="Stowage's models folder, among the places whose models POST /stowage/load may load "
                        "(default: the one the desktop app uses; `stowage list` shows them all)")
    p.add_argument("--plan-request", metavar="JSON", default=None,
                   help="the whole plan request as one JSON object, as the app and `stowage chat` pass it to their "
                        "engine (context_tokens, num_seqs, dtype, kv_dtype, gpu_layers, kv_disk_budget, ...); "
                        "instead of --context, --parallel, --dtype, --kv-dtype, --gpu-layers and --kv-disk-budget. "
                        "'-': one line of it on stdin, sent once the parent knows it (`stowage generate`)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one ends (an app running its engine as a child)")
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    from stowage.kernels import cpu_decode

    from ..formats.discovery import Places, default_models_dir
    from ..runtime.engine import Engine
    from ..planning.report import summary
    from ..server.listener import close_listener, listen, listen_unix, serve
    from ..server.serving import LoadDefaults, plan_serving

    for name, flag, least in (("context_tokens", "context", 1), ("parallel", "parallel", 1),
                              ("max_queue", "max-queue", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise InvalidArgumentError(f"--{flag} must be at least {least}, got {value}")
    if args.unix is not None and (args.host is not None or args.port is not None):
        raise InvalidArgumentError("--unix listens on a socket file, not on a TCP address: give --unix PATH or "
                                   "--host/--port, not both")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    cpu_decode.use_default_threads()  # the cores it may use, or the CLI's --threads
    if args.exit_with_parent:
        _exit_with_parent()
    if args.plan_request == STDIN_REQUEST:  # the request is still being made: meanwhile, what needs none
        _open_gguf(args.model_dir)
    request = _plan_request(args)
    # Planned against this machine first: a shortage is an error before anything is allocated.
    plan = plan_serving(args.model_dir, request)
    defaults = LoadDefaults(Places.default(args.models_dir or default_models_dir()), parallel=request.num_seqs,
                            max_queue=args.max_queue, gpu_layers=request.gpu_layers,
                            kv_disk_budget=request.kv_disk_budget)
    # a taken port or socket path fails before the load
    sock = (listen_unix(args.unix) if args.unix is not None else
            listen(args.host or DEFAULT_HOST, DEFAULT_PORT if args.port is None else args.port,
                   has_key=api_key is not None))
    try:
        spill = (f"; evicted conversations' KV cache up to {format_bytes(plan.kv_disk_bytes)} in {plan.kv_dir}"
                 if plan.kv_disk_bytes else "")
        sys.stderr.write(f"loading {args.model_dir.name}: {summary(plan)} for {plan.num_seqs} sequence(s){spill}\n")
        engine = Engine.load(args.model_dir, plan, progress=write_progress)
    except BaseException:
        close_listener(sock)
        raise
    serve(engine, sock, defaults, api_key=api_key, cors_origins=tuple(args.cors_origins))
    return 0


def _open_gguf(model_dir: Path) -> None:
    """A GGUF file parsed and its tokenizer built (or read back), once per process, as the plan will ask: the parent
    that sends the request may be building the same tokenizer (its first use), and this need not wait for it."""
    from ..formats.source import is_gguf, open_source

    if is_gguf(model_dir):
        open_source(model_dir).tokenizer  # noqa: B018 (the property builds and keeps it)


def _origin(text: str) -> str:
    from ..server.guards import parse_origin

    try:
        return parse_origin(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _plan_request(args: argparse.Namespace) -> PlanRequest:
    """--plan-request as it came, or the request the flags describe (the context: --context, or the default)."""
    from ..planning import default_context_tokens
    from ..plan_request import PlanRequest

    flags = {"--context": args.context_tokens, "--parallel": args.parallel, "--dtype": args.dtype,
             "--kv-dtype": args.kv_dtype, "--gpu-layers": args.gpu_layers, "--kv-disk-budget": args.kv_disk_budget}
    if args.plan_request is not None:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise InvalidArgumentError(f"--plan-request holds the whole request; give it without {', '.join(given)}")
        if args.plan_request == STDIN_REQUEST:  # sent by the parent once it knows it (EngineProcess.launch)
            text = sys.stdin.readline()
            if not text:
                raise InvalidArgumentError("--plan-request -: stdin ended before a request came; the process that "
                                           "started this engine gave up")
            return PlanRequest.from_json(text)
        return PlanRequest.from_json(args.plan_request)
    return PlanRequest(args.context_tokens or default_context_tokens(args.model_dir), dtype=args.dtype,
                       kv_dtype=args.kv_dtype, gpu_layers=args.gpu_layers, num_seqs=args.parallel or 1,
                       kv_disk_budget=args.kv_disk_budget)


def _exit_with_parent() -> None:
    """SIGTERM to this process once its parent is gone (re-parented): a clean stop while serving, the default
    end while loading. An app killed outright must not leave its engine holding memory."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="stowage-parent-watch").start()


