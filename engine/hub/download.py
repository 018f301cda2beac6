"""Downloads into the Hugging Face cache, laid out as huggingface_hub lays it out (blobs/<etag>, snapshots/<commit>/
<file> linking to it, refs/<branch>), so Stowage's listing, `hf` and transformers all find the files.

Each file streams through huggingface_hub's HTTP session into blobs/<etag>.incomplete, resumed with a Range
request after a dropped connection, and by a later pull after a cancel or a restart; then it is checked against
the Hub's SHA-256 (its git blob id for a small file) before it becomes a blob. A part of a model is never visible
as a model: files land in the snapshot only when whole, a split GGUF's first part and a safetensors model's
config.json last, and refs/<branch> is written at the end. Free disk space is checked before the first byte.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from threading import Event

from filelock import FileLock, Timeout
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import get_session, hf_raise_for_status

from ..errors import DownloadCancelled, HubError
from ..formats.discovery import Places
from ..units import format_bytes
from .client import Hub, TransportError
from .files import HASH_NAME, RemoteFile, RemoteModel

PARTIAL_SUFFIX = ".incomplete"
MIN_FREE_BYTES = 1 << 30  # left free on the disk after a download
PROGRESS_INTERVAL_S = 0.1
MAX_RETRIES = 5  # dropped connections in a row, without a byte between them
_HASH_CHUNK = 8 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class DownloadProgress:
    """Where a download stands: bytes of the whole model, the rate since it (re)started, the time left."""

    file: str
    done_bytes: int
    total_bytes: int
    rate_bytes_per_s: float
    seconds_left: float | None  # None until a rate is known


def hub_cache_dir() -> Path:
    """The Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), as listings read it."""
    return Places.default(None).hf_cache


def model_path(model: RemoteModel, cache_dir: Path | None = None, commit: str | None = None) -> Path:
    """Where the model opens once downloaded: its GGUF file (the first part), or the snapshot folder."""
    snapshot = (cache_dir or hub_cache_dir()) / repo_folder_name(repo_id=model.repo, repo_type="model") / \
        "snapshots" / (commit or model.revision)
    return snapshot / model.name if model.format == "gguf" else snapshot


def pull(hub: Hub, model: RemoteModel, *, ref: str | None = "main", cache_dir: Path | None = None,
         progress: Callable[[DownloadProgress], None] | None = None, cancel: Event | None = None) -> Path:
    """Download every file of `model` not in the cache yet; the path to open. `ref` is the branch or tag the user
    asked for, filed as refs/<ref> (as huggingface_hub does; none for a commit). DownloadCancelled when `cancel` is
    set (what was fetched stays, and the next pull resumes it); HubError with a sentence on any other failure."""
    cache_dir = cache_dir or hub_cache_dir()
    storage = cache_dir / repo_folder_name(repo_id=model.repo, repo_type="model")
    snapshot = storage / "snapshots" / model.revision
    # the file a listing would show last: a split GGUF's first part, a safetensors model's config.json
    order = list(reversed(model.weights)) if model.format == "gguf" else list(model.weights) + list(model.extras)
    if model.format == "safetensors":
        order.sort(key=lambda f: f.path == "config.json")
    todo = [f for f in order if not (snapshot / f.path).is_file()]
    meter = _Meter(model, sum(f.size for f in order), sum(f.size for f in order if f not in todo), progress, cancel)
    _check_disk(storage, todo, cache_dir)
    commit = model.revision
    for f in todo:  # the commit each file's HEAD names (the listing's, unless a branch moved since)
        commit = _fetch(hub, model, f, storage, meter)
    if ref is not None and ref != commit and not _COMMIT.fullmatch(ref) and ".." not in Path(ref).parts:
        ref_file = storage / "refs" / ref
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)
    meter.report(force=True)
    return model_path(model, cache_dir, commit)


def partial_path(storage: Path, etag: str) -> Path:
    return storage / "blobs" / f"{etag}{PARTIAL_SUFFIX}"


def _check_disk(storage: Path, todo: list[RemoteFile], cache_dir: Path) -> None:
    needed = 0
    for f in todo:
        partial = partial_path(storage, f.sha256 or f.blob_id or "")
        needed += f.size - (partial.stat().st_size if partial.is_file() else 0)
    existing = next(p for p in (storage, *storage.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if needed + MIN_FREE_BYTES > free:
        raise HubError(f"not enough disk space: the download needs {format_bytes(needed)} (and "
                       f"{format_bytes(MIN_FREE_BYTES)} left free), but {existing} has {format_bytes(free)} free; "
                       "free some space or set HF_HUB_CACHE to a larger disk")


def _fetch(hub: Hub, model: RemoteModel, f: RemoteFile, storage: Path, meter: "_Meter") -> str:
    """Fetch one file into the cache; the commit its snapshot is filed under."""
    url = hf_hub_url(model.repo, f.path, revision=model.revision, endpoint=hub.endpoint)
    headers = hub.headers()
    with hub.errors(model.repo, f.path):
        meta = get_hf_file_metadata(url, token=hub.token or False, endpoint=hub.endpoint)
    if not meta.etag or meta.commit_hash is None:
        raise HubError(f"{hub.endpoint} did not say which version {model.repo}/{f.path} is (no ETag or X-Repo-Commit "
                       "header); is HF_ENDPOINT a Hugging Face Hub?")
    if not (HASH_NAME.fullmatch(meta.etag) and HASH_NAME.fullmatch(meta.commit_hash)):  # they become file names here
        raise HubError(f"{hub.endpoint} named {model.repo}/{f.path} {meta.etag!r:.80} at commit "
                       f"{meta.commit_hash!r:.80}: not a hash; refusing to download from it")
    blob = storage / "blobs" / meta.etag
    # one writer per file across processes: huggingface_hub's own lock, so `hf download` waits for us and we for it
    with _locked(storage.parent / ".locks" / storage.name / f"{meta.etag}.lock", meter):
        if blob.is_file():  # the same content under another name or revision (or another pull's): nothing to fetch
            meter.start_file(f.path, meta.size if meta.size is not None else f.size)
        else:
            _download(hub, model, f, url, meta, headers, storage, meter)
            os.replace(partial_path(storage, meta.etag), blob)
    _link(blob, storage / "snapshots" / meta.commit_hash / f.path)
    return meta.commit_hash


@contextmanager
def _locked(path: Path, meter: "_Meter"):
    """Hold the lock file `path` (waiting while another pull, CLI or app, fetches the same file; a cancel still
    ends the wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    while True:
        meter.check()
        try:
            lock.acquire(timeout=0.2)
            break
        except Timeout:
            continue
    try:
        yield
    finally:
        lock.release()


def _download(hub: Hub, model: RemoteModel, f: RemoteFile, url: str, meta, headers: dict, storage: Path,
              meter: "_Meter") -> None:
    """Fetch f's bytes into its partial file (resuming what is there) and check them against the Hub's hash."""
    partial = partial_path(storage, meta.etag)
    partial.parent.mkdir(parents=True, exist_ok=True)
    size = meta.size if meta.size is not None else f.size
    done = partial.stat().st_size if partial.is_file() else 0
    if done > size:  # not this file's bytes: start again
        partial.unlink()
        done = 0
    if meta.location != url and not _same_host(url, meta.location):
        headers.pop("authorization", None)  # a signed CDN address takes no token (as huggingface_hub does)
    meter.start_file(f.path, done)
    with open(partial, "ab") as out, hub.errors(model.repo, f.path):
        _stream(meta.location, out, done, size, headers, meter, f"{model.repo}/{f.path}")
    # a small file kept in git: its blob id, where the server's ETag agrees that it is one (huggingface.co's)
    _verify(partial, f.sha256, None if f.sha256 or meta.etag != f.blob_id else f.blob_id, f"{model.repo}/{f.path}")
    os.chmod(partial, 0o644)


def _stream(url: str, out, done: int, size: int, headers: dict, meter: "_Meter", what: str) -> None:
    """Append the file's bytes from `done` to `out`, resuming with a Range request after a dropped connection (at
    once, then after 1, 2, 4 s; MAX_RETRIES in a row without a byte gives up). Bytes are written as they arrive,
    so progress and a cancel are noticed within one network read (huggingface_hub's http_get writes 10 MiB at a
    time: a cancel could wait that long, and a drop lose as much)."""
    failures = 0
    while done < size:
        meter.check()  # also between tries, while no byte comes
        request = headers | {"Accept-Encoding": "identity"} | ({"Range": f"bytes={done}-"} if done else {})
        try:
            with get_session().stream("GET", url, headers=request, follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                if done and response.status_code != 206:  # the Range was ignored: start the file again
                    out.seek(0)
                    out.truncate()
                    meter.rewind(done)
                    done = 0
                for chunk in response.iter_bytes():
                    meter.add(len(chunk))  # raises DownloadCancelled once cancel is set
                    out.write(chunk)
                    done += len(chunk)
                    failures = 0
        except TransportError as e:
            failures += 1
            if failures > MAX_RETRIES:
                raise HubError(f"{what}: the connection dropped {failures} times in a row ({e}); pull again to "
                               f"resume from {format_bytes(done)}") from e
            time.sleep(0 if failures == 1 else 2 ** (failures - 2))
            continue
        if done < size:  # a body that ended early without an error: ask for the rest
            failures += 1
            if failures > MAX_RETRIES:
                raise HubError(f"{what}: the server keeps ending the file at {format_bytes(done)} of "
                               f"{format_bytes(size)}; pull again later")
    out.flush()
    if done != size:
        raise HubError(f"{what}: the server sent {format_bytes(done)}, but the file is {format_bytes(size)}")


def _verify(path: Path, sha256: str | None, git_blob_id: str | None, what: str) -> None:
    """The file is what the Hub lists: its SHA-256 (LFS), else its git blob id; a mismatch discards it. With
    neither, its size was checked while streaming."""
    expected = sha256 or git_blob_id
    if not expected:
        return
    digest = hashlib.sha256() if sha256 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected.lower():
        path.unlink()
        kind = "SHA-256" if sha256 else "git blob id"
        raise HubError(f"{what}: the downloaded file's {kind} is {digest.hexdigest()}, but the Hub lists {expected}; "
                       "the file was corrupted on the way and has been discarded. Pull again")


def _link(blob: Path, pointer: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks here (Windows without developer mode): huggingface_hub moves the blob then too
        shutil.copyfile(blob, pointer)


def _same_host(a: str, b: str) -> bool:
    from urllib.parse import urlparse

    return urlparse(a).netloc == urlparse(b).netloc


class _Meter:
    """Counts bytes for the progress callback and checks for a cancel at every chunk."""

    def __init__(self, model: RemoteModel, total: int, done: int, progress, cancel: Event | None):
        self.total, self.done, self.progress, self.cancel = total, done, progress, cancel
        self.file = model.name
        self._started, self._start_done, self._last = time.monotonic(), done, 0.0

    def start_file(self, name: str, already: int) -> None:
        self.file = name
        self.done += already
        self._start_done += already  # resumed bytes are not part of the rate
        self.report(force=True)

    def check(self) -> None:
        """DownloadCancelled once the cancel is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled(f"download of {self.file} cancelled; pull again to resume it")

    def add(self, num_bytes: int) -> None:
        self.check()
        self.done += num_bytes
        self.report()

    def rewind(self, num_bytes: int) -> None:
        self.done -= num_bytes

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is None or (not force and now - self._last < PROGRESS_INTERVAL_S):
            return
        self._last = now
        elapsed = now - self._started
        rate = (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else None
        self.progress(DownloadProgress(self.file, self.done, self.total, rate, left))
