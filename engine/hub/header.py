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
    """Reads headers through a Hub, each file's once per process (by its content hash)."""

    def __init__(self, hub: Hub):
        self.hub = hub
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
        prefix = self._read(model, f, 0, min(FIRST_READ_BYTES, f.size))
        while True:
            try:
                part = GGUFFile(f.path, prefix, f.size)
                _config_reads(part)
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
        config_raw = self._read_whole(model, by_name["config.json"])
        try:
            raw = json.loads(config_raw)
        except ValueError as e:
            raise ModelFormatError(f"{model.repo}: config.json is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelFormatError(f"{model.repo}: config.json is not a JSON object")
        config = ModelConfig.from_dict(raw)
        specs: dict = {}
        for f in model.weights:
            first = self._read(model, f, 0, min(8, f.size))
            length = header_length(first, f.path, f.size)
            for name, spec in parse_header(self._read(model, f, 8, 8 + length), Path(f.path), f.size).items():
                if name in specs:
                    raise ModelFormatError(f"{f.path}: tensor {name!r} also appears in {specs[name].path.name}")
                specs[name] = spec
        return RemoteSource(model.repo, config, {f.path: f.size for f in model.weights}, specs=specs)

    # -- reading -------------------------------------------------------------------------------------

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
