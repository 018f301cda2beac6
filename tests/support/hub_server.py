"""A real HTTP server on 127.0.0.1 shaped like the Hugging Face Hub, for huggingface_hub itself to talk to.

What it serves, as huggingface.co does (and as huggingface_hub's file_download.py / hf_api.py / utils/_http.py read):
- GET /api/models?search=&filter=&author=&sort=&limit=&expand= : a list of model objects (id, tags, downloads,
  likes, gated, gguf {architecture}, config {model_type}, ...);
- GET /api/models/{repo}[/revision/{rev}][?blobs=true] : the model with `siblings` ({rfilename}, and with blobs:
  size, blobId and lfs {sha256, size, pointerSize}), `sha`, `gated`, `safetensors` {parameters, total};
- GET /api/models/{repo}/tree/{rev}[/{path}] : [{type, oid, size, path, lfs {oid, size, pointerSize}}];
- HEAD/GET /{repo}/resolve/{rev}/{file}: an LFS file answers 302 with X-Linked-Etag (its SHA-256), X-Linked-Size,
  X-Repo-Commit, ETag and a Location on the "CDN" (/cdn-lfs/{sha256}, which serves HEAD/GET/Range); a small git
  file answers 200 with ETag (its git blob id) and X-Repo-Commit;
- errors with the Hub's X-Error-Code / X-Error-Message: 401 RepoNotFound (a missing or private repo, unauthenticated),
  401 GatedRepo, 404 EntryNotFound, 404 RevisionNotFound.
Faults: `drop_after[path] = n` sends n bytes of a GET of that file then closes the connection (once per entry in
`drops_left`); `corrupt` serves a file with a flipped byte while listing its true hash; `slow` paces a file.
`etag_override` names every LFS file by that ETag. `requests` logs what came.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlparse

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass
class Repo:
    """One model repository at one commit: files by path (bytes, or a local file to read them from)."""

    id: str
    files: dict[str, bytes | Path]
    sha: str = ""
    gated: str | bool = False  # False, "auto" or "manual"
    private: bool = False
    tags: tuple[str, ...] = ()
    downloads: int = 0
    likes: int = 0
    gguf_architecture: str | None = None
    model_type: str | None = None
    safetensors_parameters: dict[str, int] | None = None
    branches: tuple[str, ...] = ()  # names besides main that resolve to this commit

    def __post_init__(self):
        self.sha = self.sha or hashlib.sha1(self.id.encode()).hexdigest()



@dataclass
class Blob:
    """One file's content: bytes, or a local file read in pieces (a real-size sparse model is never held whole)."""

    source: bytes | Path
    size: int
    sha256: str
    git_sha1: str

    @classmethod
    def of(cls, source: bytes | Path) -> "Blob":
        size = source.stat().st_size if isinstance(source, Path) else len(source)
        sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
        for piece in cls(source, size, "", "").pieces(0, size):
            sha256.update(piece)
            sha1.update(piece)
        return cls(source, size, sha256.hexdigest(), sha1.hexdigest())

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer file git keeps in its place (what the blob id of an LFS file names)."""
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    def oid(self, path: str) -> str:
        """The git blob id: of the content, or of the LFS pointer for a file kept in LFS."""
        if not _is_lfs(path):
            return self.git_sha1
        return hashlib.sha1(b"blob %d\0" % len(self.pointer) + self.pointer).hexdigest()

    def pieces(self, start: int, end: int, piece_bytes: int = 1 << 20):
        """The bytes [start, end), in pieces."""
        if isinstance(self.source, bytes):
            for at in range(start, end, piece_bytes):
                yield self.source[at : min(at + piece_bytes, end)]
            return
        with open(self.source, "rb") as f:
            f.seek(start)
            for at in range(start, end, piece_bytes):
                yield f.read(min(piece_bytes, end - at))


@dataclass
class HubServer:
    """Start with `with HubServer() as hub:`; `hub.url` is what HF_ENDPOINT takes."""

    repos: dict[str, Repo] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)  # tokens the server accepts (gated and private repos)
    drop_after: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before the connection drops
    drops_left: dict[str, int] = field(default_factory=dict)  # file path -> how many GETs still drop (default 1)
    corrupt: set[str] = field(default_factory=set)  # file paths served with one byte flipped
    slow: dict[str, float] = field(default_factory=dict)  # file path -> seconds to wait before each 16 KiB sent
    etag_override: str | None = None  # a lying server: every resolve names this ETag (a path, say)
    info_blobs: bool = True  # False: model info ignores ?blobs=true (file sizes only in the tree listing)
    requests: list[tuple[str, str, str | None, bool]] = field(default_factory=list)  # method, path, Range, auth

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.id] = repo
        self._blobs = None
        return repo

    def __enter__(self) -> "HubServer":
        self._blobs = None
        # the Hub, and its "CDN" on another origin (huggingface_hub follows a redirect of HEAD /resolve only on
        # the same origin; the file's metadata must be on the 302 itself, as huggingface.co sends it)
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(self)) for _ in range(2)]
        for server in self._servers:
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    @property
    def url(self) -> str:
        host, port = self._servers[0].server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_url(self) -> str:
        host, port = self._servers[1].server_address[:2]
        return f"http://{host}:{port}"

    # -- what the handler reads ----------------------------------------------------------------------

    def blob(self, repo: Repo, path: str) -> Blob:
        key = (repo.id, path)
        if self._blobs is None:
            self._blobs = {}
        if key not in self._blobs:
            self._blobs[key] = Blob.of(repo.files[path])
        return self._blobs[key]

    def blob_by_sha(self, sha256: str) -> tuple[Repo, str, Blob] | None:
        for repo in self.repos.values():
            for path in repo.files:
                b = self.blob(repo, path)
                if b.sha256 == sha256:
                    return repo, path, b
        return None

    def can_read(self, repo: Repo, auth: str | None) -> bool:
        if not (repo.gated or repo.private):
            return True
        return auth is not None and auth.removeprefix("Bearer ") in self.tokens

    def model_json(self, repo: Repo, *, blobs: bool) -> dict:
        siblings = []
        for path in sorted(repo.files):
            entry: dict = {"rfilename": path}
            if blobs:
                b = self.blob(repo, path)
                entry |= {"size": b.size, "blobId": b.oid(path)}
                if _is_lfs(path):
                    entry["lfs"] = {"sha256": b.sha256, "size": b.size, "pointerSize": len(b.pointer)}
            siblings.append(entry)
        out = {"_id": repo.sha[:24], "id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0],
               "sha": repo.sha, "lastModified": "2026-11-30T12:00:00.000Z", "private": repo.private,
               "disabled": False, "gated": repo.gated, "downloads": repo.downloads, "likes": repo.likes,
               "tags": list(repo.tags), "library_name": "transformers" if repo.model_type else "gguf",
               "pipeline_tag": "text-generation", "createdAt": "2026-11-01T12:00:00.000Z", "siblings": siblings}
        if repo.gguf_architecture:
            out["gguf"] = {"architecture": repo.gguf_architecture, "total": 0}
        if repo.model_type:
            out["config"] = {"model_type": repo.model_type}
        if repo.safetensors_parameters:
            out["safetensors"] = {"parameters": repo.safetensors_parameters,
                                  "total": sum(repo.safetensors_parameters.values())}
        return out


def _is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_CDN = re.compile(r"^/cdn-lfs/(?P<sha>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        # -- routing ---------------------------------------------------------------------------------

        def _route(self, head: bool):
            url = urlparse(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            auth = self.headers.get("Authorization")
            hub.requests.append((self.command, path, self.headers.get("Range"), auth is not None))
            if path == "/api/models":
                return self._search(query)
            if m := _TREE.match(path):
                return self._tree(m["repo"], m["rev"], m["path"] or "", auth)
            if m := _INFO.match(path):
                return self._info(m["repo"], m["rev"], query, auth)
            if m := _RESOLVE.match(path):
                return self._resolve(m["repo"], m["rev"], m["file"], auth, head)
            if m := _CDN.match(path):
                found = hub.blob_by_sha(m["sha"])
                if found is None:
                    return self._error(404, None, "Not found")
                repo, file, b = found
                return self._send_file(repo, file, b, head, {"ETag": f'"{b.sha256}"'})
            self._error(404, None, "Not found")

        def _repo(self, repo_id: str, auth: str | None) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and not hub.can_read(repo, auth)):
                # huggingface.co: 401 to an anonymous request (it will not say whether a private repo exists), 404
                # to an authenticated one
                self._error(404 if auth else 401, "RepoNotFound", "Repository not found")
                return None
            return repo

        def _revision_ok(self, repo: Repo, rev: str | None) -> bool:
            if rev in (None, "main", repo.sha, *repo.branches):
                return True
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return False

        # -- API ---------------------------------------------------------------------------------------

        def _search(self, query: dict):
            text = (query.get("search") or [""])[0].lower()
            filters = query.get("filter", [])
            author = (query.get("author") or [None])[0]
            limit = int((query.get("limit") or ["1000"])[0])
            found = [r for r in hub.repos.values() if not r.private and text in r.id.lower()
                     and all(f in r.tags for f in filters) and (author is None or r.id.startswith(author + "/"))]
            found.sort(key=lambda r: -r.downloads)
            items = []
            for r in found[:limit]:
                full = hub.model_json(r, blobs=False)
                items.append({k: v for k, v in full.items() if k not in ("siblings",)})
            self._json(200, items)

        def _info(self, repo_id: str, rev: str | None, query: dict, auth: str | None):
            repo = self._repo(repo_id, auth)
            if repo is not None and self._revision_ok(repo, rev):
                blobs = hub.info_blobs and query.get("blobs", [""])[0].lower() == "true"
                self._json(200, hub.model_json(repo, blobs=blobs))

        def _tree(self, repo_id: str, rev: str, prefix: str, auth: str | None):
            repo = self._repo(repo_id, auth)
            if repo is None or not self._revision_ok(repo, rev):
                return
            out = []
            for path in sorted(repo.files):
                if prefix and not path.startswith(prefix.rstrip("/") + "/"):
                    continue
                b = hub.blob(repo, path)
                entry = {"type": "file", "oid": b.oid(path), "size": b.size, "path": path}
                if _is_lfs(path):
                    entry["lfs"] = {"oid": b.sha256, "size": b.size, "pointerSize": len(b.pointer)}
                out.append(entry)
            self._json(200, out)

        # -- files -------------------------------------------------------------------------------------

        def _resolve(self, repo_id: str, rev: str, file: str, auth: str | None, head: bool):
            repo = self._repo(repo_id, auth)
            if repo is None or not self._revision_ok(repo, rev):
                return
            if not hub.can_read(repo, auth):
                return self._error(401, "GatedRepo", f"Access to model {repo.id} is restricted. You must have "
                                   "access to it and be authenticated to access it. Please log in.")
            if file not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
            b = hub.blob(repo, file)
            common = {"X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes"}
            if _is_lfs(file):
                location = f"{hub.cdn_url}/cdn-lfs/{b.sha256}?response-content-disposition=" + \
                    quote(f'inline; filename="{file.rsplit("/", 1)[-1]}"')
                body = b"Found. Redirecting to " + location.encode()
                self.send_response(302)
                for k, v in (common | {"Location": location, "X-Linked-Etag": f'"{hub.etag_override or b.sha256}"',
                                       "X-Linked-Size": str(b.size), "ETag": f'"{b.oid(file)}"',
                                       "Content-Type": "text/plain; charset=utf-8",
                                       "Content-Length": str(len(body))}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                return
            self._send_file(repo, file, b, head, common | {"ETag": f'"{b.git_sha1}"'})

        def _send_file(self, repo: Repo, file: str, b: Blob, head: bool, headers: dict):
            start, end, status = 0, b.size, 200
            rng = self.headers.get("Range")
            if rng and (m := _RANGE.match(rng)):
                start = int(m[1])
                end = min(int(m[2]) + 1, b.size) if m[2] else b.size
                if start >= b.size:
                    return self._error(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{b.size}"})
                status = 206
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{b.size}")
            self.end_headers()
            if head:
                return
            drop = hub.drop_after.get(file)
            if drop is not None and (hub.drops_left.get(file, 1) <= 0 or drop >= end - start):
                drop = None
            if drop is not None:
                hub.drops_left[file] = hub.drops_left.get(file, 1) - 1
            sent = 0
            for piece in b.pieces(start, end, 16 << 10 if file in hub.slow else 1 << 20):
                if sent == 0 and start == 0 and file in hub.corrupt:
                    piece = bytes([piece[0] ^ 0xFF]) + piece[1:]  # the listing keeps the true hash
                if file in hub.slow:  # a slow link: a download that a cancel can land in the middle of
                    time.sleep(hub.slow[file])
                if drop is not None and sent + len(piece) > drop:
                    self.wfile.write(piece[: drop - sent])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(piece)
                sent += len(piece)

        # -- replies -----------------------------------------------------------------------------------

        def _json(self, status: int, value):
            body = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str, extra: dict | None = None):
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler
