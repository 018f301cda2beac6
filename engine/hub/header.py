"""A model's ModelInfo from its weight files' headers, read over HTTP before anything is downloaded.

GGUF: the file's first bytes, the range grown until the header parses (gguf.GGUFFile reads them and says how many
more it needs, PrefixTooShort); a Llama 3 file's rope frequencies, kept just after the header, come with them.
Safetensors: each shard's 8-byte length, then its JSON; config.json whole. The same readers as a local file's
build the same ModelInfo (planning/inspect.py inspect_source), so the verdict is the downloaded file's plan.
Results are kept per file content (its LFS hash), whatever revision names it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from threading import Lock

from ..errors import ModelFormatError
from ..formats.config import ModelConfig
from ..formats.gguf import GGUFFile, PrefixTooShort, join_parts
from ..formats.gguf_model import GGUFModel
from ..formats.safetensors import header_length, parse_header
from ..formats.source import ModelSource
from ..planning.inspect import ModelInfo, inspect_source
from .client import Hub
from .files import RemoteFile, RemoteModel

FIRST_READ_BYTES = 1 << 20  # most GGUF headers of small models fit; a 150k-token vocabulary takes ~6 MiB
MAX_HEADER_BYTES = 256 << 20  # a GGUF header past this is not one to plan from
MAX_CONFIG_BYTES = 1 << 20
_CACHE_SIZE = 64


class RemoteSource(ModelSource):
    """A model not downloaded yet, opened from its headers: what inspect_source reads of a ModelSource."""

    def __init__(self, name: str, config: ModelConfig, sizes: dict[str, int], *, gguf: GGUFModel | None = None,
                 specs: dict | None = None):
        self.path = Path(name)
        self.name = name
        self.gguf = gguf
        self.config = config
        self._specs = specs
        self._sizes = sizes

    @property
    def specs(self):
        return self.gguf.specs if self.gguf else self._specs

    @property
    def files(self) -> list[Path]:
        return [Path(name) for name in self._sizes]

    @property
    def file_bytes(self) -> int:
        return sum(self._sizes.values())

    @property
    def has_tokenizer(self) -> bool:
        return self.gguf is not None  # tokenizer.json is not fetched: it checks ids, it costs no memory


class HeaderReader:
    """Reads headers through a Hub: each file's once per process, and once at all where `cache_dir` keeps the bytes
    read (under the file's content hash: a new revision of the same file costs nothing)."""

    def __init__(self, hub: Hub, cache_dir: Path | None = None):
        self.hub = hub
        self.cache_dir = cache_dir
        self._infos: OrderedDict[tuple, ModelInfo] = OrderedDict()
        self._lock = Lock()
        self.bytes_read = 0  # over the network, for the docs' figures and the tests

    def model_info(self, model: RemoteModel) -> ModelInfo:
        """The ModelInfo of a model of the repository, from headers only; ModelFormatError if they are not a model's."""
        key = tuple(f.identity for f in model.files)
        with self._lock:
            if key in self._infos:
                self._infos.move_to_end(key)
                return self._infos[key]
        source = self._gguf_source(model) if model.format == "gguf" else self._safetensors_source(model)
        info = inspect_source(source)
        with self._lock:
            self._infos[key] = info
            while len(self._infos) > _CACHE_SIZE:
                self._infos.popitem(last=False)
        return info

    # -- GGUF ----------------------------------------------------------------------------------------

    def _gguf_source(self, model: RemoteModel) -> RemoteSource:
        gguf = GGUFModel(model.name, join_parts([self._gguf_part(model, f) for f in model.weights]))
        return RemoteSource(model.name, gguf.config, {f.path: f.size for f in model.weights}, gguf=gguf)

    def _gguf_part(self, model: RemoteModel, f: RemoteFile) -> GGUFFile:
        """One file's header (and the tensor data the config is read from), from as few first bytes as parse."""
        kept = self._kept(f)
        prefix = kept if kept is not None else self._read(model, f, 0, min(FIRST_READ_BYTES, f.size))
        while True:
            try:
                part = GGUFFile(f.path, prefix, f.size)
                _config_reads(part)
                if prefix is not kept:
                    self._keep(f, prefix)
                return part
            except PrefixTooShort as e:
                if e.needed_bytes > MAX_HEADER_BYTES:
                    raise ModelFormatError(f"{f.path}: its header runs past {MAX_HEADER_BYTES >> 20} MiB; "
                                           "Stowage cannot plan it from the header") from None
                grown = min(max(e.needed_bytes, 2 * len(prefix)), f.size, MAX_HEADER_BYTES)
                prefix += self._read(model, f, len(prefix), grown)

    # -- safetensors ---------------------------------------------------------------------------------

    def _safetensors_source(self, model: RemoteModel) -> RemoteSource:
        by_name = {f.path: f for f in model.extras}
        config_file = by_name["config.json"]
        config_raw = self._kept(config_file)
        if config_raw is None or len(config_raw) != config_file.size:  # not kept, or cut short on disk
            config_raw = self._read_whole(model, config_file)
            self._keep(config_file, config_raw)
        try:
            raw = json.loads(config_raw)
        except ValueError as e:
            raise ModelFormatError(f"{model.repo}: config.json is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelFormatError(f"{model.repo}: config.json is not a JSON object")
        config = ModelConfig.from_dict(raw)
        specs: dict = {}
        for f in model.weights:
            kept = self._kept(f)
            if kept is not None and (len(kept) < 8 or len(kept) < 8 + header_length(kept[:8], f.path, f.size)):
                kept = None  # cut short on disk (the file is written whole, then renamed; a disk can still fail)
            first = kept[:8] if kept is not None else self._read(model, f, 0, min(8, f.size))
            length = header_length(first, f.path, f.size)
            raw = kept[8 : 8 + length] if kept is not None else self._read(model, f, 8, 8 + length)
            if kept is None:
                self._keep(f, first + raw)
            for name, spec in parse_header(raw, Path(f.path), f.size).items():
                if name in specs:
                    raise ModelFormatError(f"{f.path}: tensor {name!r} also appears in {specs[name].path.name}")
                specs[name] = spec
        return RemoteSource(model.repo, config, {f.path: f.size for f in model.weights}, specs=specs)

    # -- reading -------------------------------------------------------------------------------------

    def _kept_path(self, f: RemoteFile) -> Path | None:
        content = f.sha256 or f.blob_id  # a name for the content itself, never a path that changes meaning
        if self.cache_dir is None or not content or not content.isalnum():
            return None
        return self.cache_dir / f"{content}-{f.size}"

    def _kept(self, f: RemoteFile) -> bytes | None:
        """The first bytes of `f` read before (by this process or an earlier one), if kept."""
        path = self._kept_path(f)
        try:
            return path.read_bytes() if path is not None else None
        except OSError:
            return None

    def _keep(self, f: RemoteFile, data: bytes) -> None:
        path = self._kept_path(f)
        if path is None:
            return
        try:  # written whole, then renamed: a reader never sees half of it
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".tmp")
            partial.write_bytes(data)
            partial.replace(path)
        except OSError:
            pass  # a cache that cannot be written costs a read next time, nothing more

    def _read_whole(self, model: RemoteModel, f: RemoteFile) -> bytes:
        if f.size > MAX_CONFIG_BYTES:
            raise ModelFormatError(f"{model.repo}: {f.path} is {f.size:,} bytes; a config is far smaller")
        return self._read(model, f, 0, f.size)

    def _read(self, model: RemoteModel, f: RemoteFile, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        out = bytearray()
        with self.hub.read(model.repo, model.revision, f.path, start, end) as chunks:
            for chunk in chunks:
                out += chunk[: end - start - len(out)]
                if len(out) >= end - start:
                    break
        self.bytes_read += len(out)
        if len(out) < end - start:
            raise ModelFormatError(f"{f.path}: the server sent {len(out):,} of the {end - start:,} bytes asked "
                                   f"for at byte {start:,}; the listing's size is wrong or the file changed")
        return bytes(out)


def _config_reads(part: GGUFFile) -> None:
    """Read what the config takes from tensor data (a Llama 3 file's rope frequencies) while the prefix grows."""
    from ..formats.gguf_model import ROPE_FREQS

    if ROPE_FREQS in part.tensors:
        part.raw(ROPE_FREQS)


def header_cache_dir(env=None) -> Path:
    """Where the CLI and the app keep headers read: STOWAGE_DATA_DIR/hub-headers, else the user cache folder."""
    import os

    env = os.environ if env is None else env
    if env.get("STOWAGE_DATA_DIR"):
        return Path(env["STOWAGE_DATA_DIR"]) / "hub-headers"
    import platformdirs

    return Path(platformdirs.user_cache_dir("Stowage", appauthor=False)) / "hub-headers"
