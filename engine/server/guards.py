"""What a request passes before it reaches a route, outermost first: the size of its head; where it comes from
(web pages in a browser are refused: a foreign Host, a foreign Origin, a body that is not JSON); the API key; and
the number of requests served at once. Each is a small ASGI wrapper around the next (create_app stacks them)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from ..errors import InvalidArgumentError
from ..protocol import is_loopback
from .schemas import ApiError

MAX_HEAD_BYTES = 16 << 10  # the request's headers, all together
RETRY_AFTER_SECONDS = "1"
DEFAULT_PORTS = {"http": 80, "https": 443}  # the port a browser leaves out of an origin


def parse_origin(text: str) -> str:
    """A web page's origin as a browser sends it, `scheme://host[:port]` in lower case (a default port left out);
    InvalidArgumentError for anything else."""
    parts = urlsplit(text.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (parts.scheme not in DEFAULT_PORTS or not parts.hostname or port == -1 or parts.path not in ("", "/")
            or parts.query or parts.fragment or "@" in parts.netloc):
        raise InvalidArgumentError(f"{text!r} is not an origin: give scheme://host[:port] as a browser sends it "
                                   "(https://chat.example, http://localhost:5173)")
    host = parts.netloc.lower().rsplit(":", 1)[0] if port is not None else parts.netloc.lower()
    return f"{parts.scheme}://{host}" + ("" if port in (None, DEFAULT_PORTS[parts.scheme]) else f":{port}")


def max_requests(scheduler) -> int:
    """Requests served at once: every running and waiting one, a stream and a retry each, and some for the model
    lists, plans and loads; 32 while no model is served (scheduler None)."""
    return 32 if scheduler is None else 4 * (scheduler.max_running + scheduler.max_waiting) + 32


def stack(app, serving, *, api_key: str | None, cors_origins: Iterable[str], loopback_bind: bool):
    """app behind every guard, outermost first: head size, browsers, the key, the request limit."""
    guarded = _RequestLimit(app, serving)
    if api_key:
        guarded = _BearerAuth(guarded, api_key)
    return _HeadLimit(_BrowserGuard(guarded, tuple(cors_origins), check_host=loopback_bind))


def _refuse(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _HeadLimit:
    """Headers past MAX_HEAD_BYTES get 431 (h11 bounds only a head that arrives in several reads)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEAD_BYTES:
            error = ApiError(431, f"the request's headers are larger than {MAX_HEAD_BYTES:,} bytes",
                             code="request_header_fields_too_large")
            return await _refuse(error)(scope, receive, send)
        await self.app(scope, receive, send)


class _BrowserGuard:
    """Refuses what only a web page sends: a Host other than this machine's on a server bound to loopback (DNS
    rebinding; check_host), an Origin other than the server's own or one given with --cors-origin, a POST whose
    body is not JSON (the kinds a page sends without asking first: text/plain, forms). OpenAI clients and the app's
    engine child send no Origin and JSON. The origins given get CORS headers, and their preflights are answered."""

    def __init__(self, app, cors_origins: tuple[str, ...], *, check_host: bool):
        self.origins, self.check_host = frozenset(cors_origins), check_host
        self.app = app if not cors_origins else CORSMiddleware(
            app, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                return await _refuse(error)(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.check_host and _is_loopback(scope.get("server")) and not _is_local_name(host):
            return ApiError(403, f"the Host {host!r:.80} is not this machine: a server on a loopback address answers "
                                 "only to localhost, 127.0.0.1 or [::1] (a web page whose name was pointed here sends "
                                 "its own)", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin.lower() not in self.origins | {f"{scope['scheme']}://{host.lower()}"}:
            return ApiError(403, f"requests from the web page at {origin!r:.80} are refused; to let that page use the "
                                 "server, start it with --cors-origin ORIGIN", code="origin_not_allowed")
        if scope["method"] == "POST" and not _is_json_or_empty(headers):
            return ApiError(415, "a POST's body must be JSON, sent with the header `Content-Type: application/json` "
                                 "(curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
        return None


def _is_loopback(server) -> bool:
    """Whether the request came in on a loopback address; a Unix socket's path is none (no browser reaches one)."""
    try:
        return is_loopback(server[0])
    except (TypeError, ValueError):
        return False


def _is_local_name(host: str) -> bool:
    """localhost or a loopback address, with any port: names no other site's page can be reached under."""
    name = host.lower()
    name = name[1:].partition("]")[0] if name.startswith("[") else name.partition(":")[0]
    try:
        return name == "localhost" or is_loopback(name)
    except ValueError:
        return False


def _is_json_or_empty(headers: Headers) -> bool:
    kind = headers.get("content-type")
    if kind is None:  # no body at all (POST /stowage/unload) needs no type
        return headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
    return kind.partition(";")[0].strip().lower() == "application/json"


class _BearerAuth:
    """Every request but /health needs `Authorization: Bearer KEY` (the scheme in any case, RFC 7235; the key
    compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and not self._has_key(scope):
            error = ApiError(401, "Incorrect or missing API key: send the header `Authorization: Bearer KEY` with the "
                                  "key the server was started with (--api-key)", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            return await _refuse(error)(scope, receive, send)
        await self.app(scope, receive, send)

    def _has_key(self, scope) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.lstrip(b" "), self.key)


class _RequestLimit:
    """Past max_requests of the model served now, a request gets 503 `server_busy`; /health is always answered.
    Requests count from their headers on: a socket that has not sent them takes no slot (listener.py closes one
    that takes too long), so idle connections cannot lock clients out."""

    def __init__(self, app, serving):
        self.app, self.serving = app, serving
        self.num_open = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        served = self.serving.current
        limit = max_requests(served.scheduler if served is not None else None)
        if self.num_open >= limit:
            error = ApiError(503, f"the server is answering {limit} requests already; retry shortly",
                             type="server_error", code="server_busy", headers={"Retry-After": RETRY_AFTER_SECONDS})
            return await _refuse(error)(scope, receive, send)
        self.num_open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_open -= 1
