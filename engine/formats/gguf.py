"""GGUF files (llama.cpp's format, versions 2 and 3) parsed by hand; tensors are numpy.memmap views, never copied.

Layout, little-endian: "GGUF", u32 version, u64 tensor count, u64 metadata count; the metadata
(key, u32 value type, value); the tensor infos (name, u32 n_dims, u64 dims innermost first, u32 ggml
type, u64 offset into the data); padding to `general.alignment`; the data. Every count, length and
offset is checked against the file size before anything is read or allocated, so a truncated or
hostile file is refused with a ModelFormatError, never answered with a huge allocation.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stowage.kernels.block_formats import FORMATS

from .. import dtypes
from ..errors import ModelFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # deeper arrays of arrays would only be a way to exhaust the Python stack
MAX_INT64 = 2**63 - 1  # ggml counts elements in int64
# ggml type id -> name, for every type llama.cpp has defined (ggml.h); kernels.quants.FORMATS holds those we read.
GGML_TYPES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 9: "q8_1", 10: "q2_k",
    11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 15: "q8_k", 16: "iq2_xxs", 17: "iq2_xs", 18: "iq3_xxs",
    19: "iq1_s", 20: "iq4_nl", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs", 24: "i8", 25: "i16", 26: "i32",
    27: "i64", 28: "f64", 29: "iq1_m", 30: "bf16", 31: "q4_0_4_4", 32: "q4_0_4_8", 33: "q4_0_8_8",
    34: "tq1_0", 35: "tq2_0", 36: "iq4_nl_4_4", 37: "iq4_nl_4_8", 38: "iq4_nl_8_8", 39: "mxfp4",
    40: "nvfp4", 41: "q1_0",
}
# general.file_type (llama.cpp's llama_ftype) -> the name quantizers, file names and Ollama use for it.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE",
}
# GGUF value type id -> struct code of the scalars; 8 (string) and 9 (array) are read apart.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, a type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # an empty name, n_dims = 0, a type, an offset
# llama.cpp names the parts of a split model NAME-00001-of-00003.gguf (gguf-split, convert_hf_to_gguf.py).
_PART = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class PrefixTooShort(ModelFormatError):
    """The header runs past the bytes given (a file's first bytes, read over the network): read `needed_bytes`."""

    def __init__(self, name: str, needed_bytes: int):
        super().__init__(f"{name}: the header needs the file's first {needed_bytes:,} bytes")
        self.needed_bytes = needed_bytes


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its ggml type, its shape in torch order, where its bytes lie."""

    name: str
    type_name: str  # lowercase ggml name: "q4_k", "f16", "bf16", "f32"
    shape: tuple[int, ...]  # torch order: GGUF's dims reversed (its ne[0], the innermost, is last here)
    path: Path
    offset: int  # absolute byte offset in `path`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        fmt = FORMATS[self.type_name]
        return self.numel // fmt.elems_per_block * fmt.bytes_per_block  # rows are whole blocks (checked)

    @property
    def dtype_name(self) -> str:
        """What the layout reads: "float32", "float16" or "bfloat16" for the plain types, else the format ("q8_0")."""
        return FORMATS[self.type_name].dtype_name or self.type_name


class GGUFFile:
    """One GGUF file mapped read-only: its metadata, its tensor infos, and views of tensor data.

    Given `prefix`, the file's first bytes and `file_bytes` its size, the header is parsed from those bytes alone
    (a file not downloaded yet, engine/hub); a read past them raises PrefixTooShort, which says how many to get."""

    def __init__(self, path: str | Path, prefix: bytes | None = None, file_bytes: int | None = None):
        self.path = Path(path)
        if prefix is not None:
            self._map = np.frombuffer(prefix, dtype=np.uint8)
        else:
            try:
                if self.path.stat().st_size == 0:
                    raise ModelFormatError(f"{self.path.name}: the file is empty; the download is incomplete")
                # mode "r": a read-only shared mapping; tensor pages come from the page cache, never private memory.
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except OSError as e:
                raise ModelFormatError(f"{self.path}: cannot read ({e.strerror})") from e
        r = _Cursor(memoryview(self._map), self.path.name, file_bytes)
        self.version, num_tensors, num_kvs = _header(r)
        self.metadata = _metadata(r, num_kvs)
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ModelFormatError(f"{r.name}: general.alignment is {self.alignment!r}; it must be a power of two")
        infos = [_tensor_info(r, i, self.alignment) for i in range(num_tensors)]
        self.data_start = -(-r.pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, type_name, dims, offset in infos:
            if name in self.tensors:
                raise ModelFormatError(f"{r.name}: tensor {name!r} appears twice; the file is corrupt")
            self.tensors[name] = GGUFTensor(name, type_name, tuple(reversed(dims)), self.path, self.data_start + offset)
        _check_spans(r.name, r.size, self.tensors.values())

    @property
    def mapping(self) -> np.memmap:
        """The whole file's mapping (what FileWatch.mapped watches)."""
        return self._map

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, mapped: f32 / f16 as such, bf16 as int16, block formats as uint8 [..., row_bytes]."""
        tensor = self.tensors[name]
        if tensor.offset + tensor.nbytes > len(self._map):  # only where the file is its first bytes
            raise PrefixTooShort(self.path.name, tensor.offset + tensor.nbytes)
        view = self._map[tensor.offset : tensor.offset + tensor.nbytes]
        fmt = FORMATS[tensor.type_name]
        if fmt.dtype_name is not None:
            # ggml's plain type names are safetensors' dtype codes in lowercase; one table says how to view them.
            return view.view(dtypes.SAFETENSORS[tensor.type_name.upper()][1]).reshape(tensor.shape)
        return view.reshape(*tensor.shape[:-1], fmt.row_bytes(tensor.shape[-1]))


class GGUFCheckpoint:
    """Every tensor of a GGUF model, from its one file or all of its parts; the metadata is the first part's."""

    def __init__(self, parts: list[GGUFFile]):
        self.parts = tuple(parts)
        self.metadata = parts[0].metadata
        self.tensors: dict[str, GGUFTensor] = {}
        self._part_of: dict[str, GGUFFile] = {}
        for part in parts:
            for name, tensor in part.tensors.items():
                if name in self.tensors:
                    raise ModelFormatError(
                        f"{part.path.name}: tensor {name!r} also appears in {self.tensors[name].path.name}")
                self.tensors[name] = tensor
                self._part_of[name] = part

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, mapped from its part (see GGUFFile.raw)."""
        return self._part_of[name].raw(name)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The GGUF model at `path`: a .gguf file, any part of a split one, or a folder holding one model."""
    path = find_gguf(path)
    paths = part_paths(path)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFormatError(f"{path.name}: part {missing[0]}{more} of this {len(paths)}-part model is missing; "
                               "download every part into the same folder")
    return join_parts([GGUFFile(p) for p in paths])


def join_parts(parts: list[GGUFFile]) -> GGUFCheckpoint:
    """The model the parts of a split file make (or one file's), checked against their split.* metadata."""
    for index, part in enumerate(parts):
        count, number = part.metadata.get("split.count", 1), part.metadata.get("split.no", index)
        if (count, number) != (len(parts), index):
            raise ModelFormatError(
                f"{part.path.name}: its metadata says it is part {number + 1} of {count}, but its name says part "
                f"{index + 1} of {len(parts)}; keep the part names llama.cpp gave them (NAME-00001-of-00003.gguf)")
    checkpoint = GGUFCheckpoint(parts)
    expected = parts[0].metadata.get("split.tensors.count", len(checkpoint.tensors))
    if expected != len(checkpoint.tensors):
        raise ModelFormatError(f"{parts[0].path.name}: the parts hold {len(checkpoint.tensors)} tensors, "
                               f"but split.tensors.count says {expected}; a part is corrupt")
    return checkpoint


def is_gguf_file(path: str | Path) -> bool:
    """A file named .gguf, or one that starts with GGUF's magic (an Ollama blob: blobs/sha256-<hex>)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def find_gguf(path: str | Path) -> Path:
    """The .gguf file to open for `path`: the file itself, or (the first part of) the one model in a folder."""
    path = Path(path)
    if path.is_file():
        if not is_gguf_file(path):
            raise ModelFormatError(f"{path.name}: not a .gguf file")
        return path
    if not path.is_dir():
        raise ModelFormatError(f"{path}: no such file or folder")
    models = sorted({part_paths(p)[0] for p in path.glob("*.gguf")})  # a single file, or a split one's first part
    if not models:
        raise ModelFormatError(f"{path.name}: no .gguf file in this folder")
    if len(models) > 1:
        names = ", ".join(p.name for p in models[:4]) + (", ..." if len(models) > 4 else "")
        raise ModelFormatError(f"{path.name}: this folder holds {len(models)} GGUF models ({names}); "
                               "choose one by passing its .gguf file")
    return models[0]


def part_paths(path: Path) -> list[Path]:
    """Every part of the model `path` belongs to, in order: [path] itself unless named NAME-0000i-of-0000N.gguf."""
    match = _PART.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    return [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_metadata(path: str | Path, keys: frozenset[str]) -> dict:
    """The metadata values of `keys` a GGUF file holds, reading no further than the last one found: a listing's
    look at a file (general.architecture, general.file_type) without building its vocabulary."""
    path = Path(path)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise ModelFormatError(f"{path.name}: cannot read ({getattr(e, 'strerror', None) or e})") from e
    r = _Cursor(memoryview(data), path.name)
    _, _, num_kvs = _header(r)
    found: dict = {}
    for i in range(num_kvs):
        if len(found) == len(keys):
            break
        key = r.string(f"the key of metadata entry {i}")
        value_type = r.unpack("I", f"the type of metadata {key!r}")
        if key in keys:
            found[key] = r.value(value_type, f"metadata {key!r}")
        else:
            r.skip(value_type, f"metadata {key!r}")
    return found


class _Cursor:
    """Reads the mapped file front to back, checking every read against the file size first.

    `size`: the file's size where `buf` holds only its first bytes; a read past those raises PrefixTooShort."""

    def __init__(self, buf: memoryview, name: str, size: int | None = None):
        self.buf, self.name, self.pos = buf, name, 0
        self.size = len(buf) if size is None else size

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.size - self.pos:
            raise ModelFormatError(
                f"{self.name}: {what} needs {num_bytes:,} bytes at byte {self.pos:,}, but the file has "
                f"{self.size:,} bytes: the file is truncated or corrupt")
        if self.pos + num_bytes > len(self.buf):
            raise PrefixTooShort(self.name, self.pos + num_bytes)

    def unpack(self, code: str, what: str):
        num_bytes = struct.calcsize("<" + code)
        self.need(num_bytes, what)
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += num_bytes
        return value

    def string(self, what: str, *, strict: bool = True) -> str:
        num_bytes = self.unpack("Q", f"the length of {what}")
        self.need(num_bytes, what)
        raw = bytes(self.buf[self.pos : self.pos + num_bytes])
        self.pos += num_bytes
        try:
            # keys and names must be UTF-8; other strings keep any stray byte (llama.cpp does not check them)
            return raw.decode("utf-8", errors="strict" if strict else "surrogateescape")
        except UnicodeDecodeError as e:
            raise ModelFormatError(f"{self.name}: {what} is not valid UTF-8 ({e.reason})") from e

    def strings(self, num_items: int, what: str) -> list[str]:
        """An array of strings (a vocabulary: 100k+ tokens and merges), each length checked before it is read."""
        buf, pos, size, out = self.buf, self.pos, len(self.buf), []  # self.need tells a short prefix from a short file
        length_of = _U64.unpack_from
        for i in range(num_items):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of {what}[{i}]")
            (num_bytes,) = length_of(buf, pos)
            pos += 8
            if num_bytes > size - pos:
                self.pos = pos
                self.need(num_bytes, f"{what}[{i}]")
            out.append(str(buf[pos : pos + num_bytes], "utf-8", "surrogateescape"))
            pos += num_bytes
        self.pos = pos
        return out

    def skip(self, value_type: int, what: str, depth: int = 0) -> None:
        """Step over one value without building it (each length still checked against the file)."""
        if value_type in _SCALARS:
            num_bytes = struct.calcsize("<" + _SCALARS[value_type])
        elif value_type == _STRING:
            num_bytes = self.unpack("Q", f"the length of {what}")
        elif value_type == _ARRAY and depth < MAX_ARRAY_NESTING:
            item_type = self.unpack("I", f"the item type of {what}")
            num_items = self.unpack("Q", f"the length of {what}")
            if item_type not in _SCALARS:
                self.need(num_items * {_STRING: 8, _ARRAY: 12}.get(item_type, 0), what)  # before any loop
                for i in range(num_items):
                    self.skip(item_type, f"{what}[{i}]", depth + 1)
                return
            num_bytes = num_items * struct.calcsize("<" + _SCALARS[item_type])
        else:
            self.value(value_type, what, depth)  # the same refusal as a read
            return
        self.need(num_bytes, what)
        self.pos += num_bytes

    def value(self, value_type: int, what: str, depth: int = 0):
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type], what)
        if value_type == _STRING:
            return self.string(what, strict=False)
        if value_type != _ARRAY:
            raise ModelFormatError(f"{self.name}: {what} has unknown value type {value_type}; the file is corrupt")
        if depth >= MAX_ARRAY_NESTING:
            raise ModelFormatError(f"{self.name}: {what} nests arrays more than {MAX_ARRAY_NESTING} deep")
        item_type = self.unpack("I", f"the item type of {what}")
        num_items = self.unpack("Q", f"the length of {what}")
        code = _SCALARS.get(item_type)
        if code is None and item_type not in (_STRING, _ARRAY):
            raise ModelFormatError(f"{self.name}: {what} has unknown item type {item_type}; the file is corrupt")
        # the least one item takes: a scalar, a string's length, an array's item type and length
        item_bytes = struct.calcsize("<" + code) if code else {_STRING: 8, _ARRAY: 12}[item_type]
        if num_items * item_bytes > self.size - self.pos:  # checked before reading or allocating any item
            raise ModelFormatError(
                f"{self.name}: {what} is an array of {num_items:,} items, which needs at least "
                f"{num_items * item_bytes:,} bytes, but {self.size - self.pos:,} remain: "
                "the file is truncated or corrupt")
        if item_type == _STRING:
            return self.strings(num_items, what)
        if code is None:
            return [self.value(item_type, f"{what}[{i}]", depth + 1) for i in range(num_items)]
        self.need(num_items * item_bytes, what)
        items = np.frombuffer(self.buf, np.dtype("<" + code), num_items, self.pos)
        self.pos += num_items * item_bytes
        return items.tolist()


def _header(r: _Cursor) -> tuple[int, int, int]:
    magic = bytes(r.buf[:4])
    if magic != MAGIC:
        raise ModelFormatError(f"{r.name}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    r.pos = 4
    version = r.unpack("I", "the header")
    if version not in VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise ModelFormatError(f"{r.name}: a big-endian GGUF file; Stowage reads little-endian files only")
        detail = "an early format llama.cpp dropped in 2023" if version == 1 else "not one Stowage knows"
        raise ModelFormatError(f"{r.name}: GGUF version {version} is {detail} (Stowage reads versions 2 and 3); "
                               "convert the model again with a current llama.cpp")
    num_tensors = r.unpack("Q", "the header")
    num_kvs = r.unpack("Q", "the header")
    for count, what, least in [(num_tensors, "tensor", _MIN_TENSOR_INFO_BYTES), (num_kvs, "metadata", _MIN_KV_BYTES)]:
        if count > (r.size - r.pos) // least:
            raise ModelFormatError(f"{r.name}: the header's {what} count {count:,} cannot fit in the "
                                   f"{r.size:,}-byte file: the file is truncated or corrupt")
    return version, num_tensors, num_kvs


def _metadata(r: _Cursor, num_kvs: int) -> dict:
    metadata: dict = {}
    for i in range(num_kvs):
        key = r.string(f"the key of metadata entry {i}")
        if key in metadata:
            raise ModelFormatError(f"{r.name}: metadata key {key!r} appears twice; the file is corrupt")
        value_type = r.unpack("I", f"the type of metadata {key!r}")
        metadata[key] = r.value(value_type, f"metadata {key!r}")
    return metadata


def _tensor_info(r: _Cursor, index: int, alignment: int) -> tuple[str, str, list[int], int]:
    name = r.string(f"the name in tensor info {index}")
    what = f"the tensor info of {name!r}"
    num_dims = r.unpack("I", what)
    if num_dims > MAX_DIMS:
        raise ModelFormatError(f"{r.name}: tensor {name!r} has {num_dims} dimensions; GGUF allows at most {MAX_DIMS}")
    dims = [r.unpack("Q", what) for _ in range(num_dims)]  # ne[0], the innermost, first
    type_id = r.unpack("I", what)
    offset = r.unpack("Q", what)
    type_name = GGML_TYPES.get(type_id)
    if type_name is None:
        raise ModelFormatError(f"{r.name}: tensor {name!r} has unknown ggml type id {type_id}; "
                               "the file is corrupt or newer than Stowage")
    if type_name not in FORMATS:
        raise ModelFormatError(
            f"{r.name}: tensor {name!r} is stored as {type_name.upper()}, which Stowage does not read "
            f"(it reads {', '.join(t.upper() for t in FORMATS)}); choose a file quantized with one of those")
    if math.prod(dims) > MAX_INT64 or any(d > MAX_INT64 for d in dims):
        raise ModelFormatError(f"{r.name}: tensor {name!r} has dims {dims} whose product overflows 64 bits; "
                               "the file is corrupt")
    row, block = (dims[0] if dims else 1), FORMATS[type_name].elems_per_block
    if row % block:
        raise ModelFormatError(f"{r.name}: tensor {name!r} has rows of {row} weights, not a whole number of "
                               f"{type_name.upper()} blocks of {block}; the file is corrupt")
    if offset % alignment:
        raise ModelFormatError(f"{r.name}: tensor {name!r} starts at data offset {offset:,}, not a multiple of "
                               f"the alignment {alignment}; the file is corrupt")
    return name, type_name, dims, offset


def _check_spans(name: str, file_bytes: int, tensors) -> None:
    spans = []
    for t in tensors:
        end = t.offset + t.nbytes
        if end > file_bytes:
            raise ModelFormatError(f"{name}: tensor {t.name!r} data is not within the file bounds (ends at byte "
                                   f"{end:,}, file has {file_bytes:,}): the file is truncated or corrupt")
        if t.nbytes:
            spans.append((t.offset, end, t.name))
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ModelFormatError(f"{name}: tensors {name_a!r} and {name_b!r} overlap; the file is corrupt")
