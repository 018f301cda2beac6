"""safetensors headers parsed by hand and tensors mapped with numpy.memmap (never copied)."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..dtypes import SAFETENSORS as DTYPES
from ..dtypes import name_of
from ..errors import ModelFormatError

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies: its file, dtype, shape and absolute byte span."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][2]

    @property
    def dtype_name(self) -> str:
        """The torch name of the stored dtype ("bfloat16"); what the model layout and the planner read."""
        return name_of(self.torch_dtype)

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPES[self.dtype][0]


def read_header(path: str | os.PathLike) -> dict[str, TensorSpec]:
    """Parse and validate one file's header; reads no tensor data."""
    path = Path(path)
    try:
        st = os.stat(path)  # follows a symlink (a Hugging Face cache's blobs) to the file itself
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block the read, or never end
            raise ModelFormatError(f"{path}: not a regular file")
        file_bytes = st.st_size
        with open(path, "rb") as f:
            raw = f.read(header_length(f.read(8), path.name, file_bytes))
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror})") from e
    return parse_header(raw, path, file_bytes)


def header_length(prefix: bytes, name: str, file_bytes: int) -> int:
    """The JSON header's length, from the file's first 8 bytes, checked against the file's size."""
    if len(prefix) < 8:
        raise ModelFormatError(f"{name}: file is {file_bytes} bytes, too short for a safetensors header")
    (header_bytes,) = struct.unpack("<Q", prefix[:8])
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > file_bytes:
        raise ModelFormatError(
            f"{name}: header length {header_bytes:,} bytes runs beyond the file ({file_bytes:,} bytes); "
            "the file is truncated or not safetensors"
        )
    return header_bytes


def parse_header(raw: bytes, path: Path, file_bytes: int) -> dict[str, TensorSpec]:
    """The tensors a header's JSON lists, checked against a file of `file_bytes` (read_header's, or a header read
    over the network before the file is downloaded, engine/hub)."""
    try:
        header = json.loads(raw)
    except RecursionError:
        raise ModelFormatError(f"{path.name}: header is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # not UTF-8, not JSON, or an integer of more digits than Python converts
        raise ModelFormatError(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: header is not a JSON object")
    data_start = 8 + len(raw)
    data_bytes = file_bytes - data_start
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        specs[name] = _parse_entry(path, name, entry, data_start, data_bytes)
    _check_overlaps(path, specs)
    return specs


def _parse_entry(path: Path, name: str, entry, data_start: int, data_bytes: int) -> TensorSpec:
    where = f"{path.name}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ModelFormatError(f"{where}: entry needs dtype, shape and data_offsets")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ModelFormatError(f"{where}: unknown dtype {dtype!r:.40} (known: {', '.join(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise ModelFormatError(f"{where}: shape {shape!r:.80} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise ModelFormatError(f"{where}: data_offsets {offsets!r:.80} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ModelFormatError(
            f"{where}: data_offsets [{begin}, {end}] lie outside the data area ({data_bytes:,} bytes); "
            "the file is truncated or corrupted"
        )
    expected = math.prod(shape) * DTYPES[dtype][0]
    if end - begin != expected:
        raise ModelFormatError(
            f"{where}: shape {shape} of {dtype} needs {expected:,} bytes but data_offsets span {end - begin:,}"
        )
    return TensorSpec(name, path, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_overlaps(path: Path, specs: dict[str, TensorSpec]) -> None:
    spans = sorted((s.start, s.end, s.name) for s in specs.values() if s.end > s.start)
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ModelFormatError(f"{path.name}: tensors {name_a!r} and {name_b!r} overlap in the data area")


class MappedFile:
    """One safetensors file mapped read-only; tensors are views into the mapping."""

    def __init__(self, path: Path):
        self.path = path
        # mode "r": a read-only shared mapping; pages come from the page cache, never private memory.
        self._map = np.memmap(path, dtype=np.uint8, mode="r")

    @property
    def mapping(self) -> np.memmap:
        """The whole file's mapping (what FileWatch.mapped watches)."""
        return self._map

    def tensor(self, spec: TensorSpec) -> torch.Tensor:
        """A torch tensor sharing the mapped bytes (read-only memory: do not write into it)."""
        _, np_dtype, torch_dtype = DTYPES[spec.dtype]
        view = self._map[spec.start : spec.end].view(np_dtype).reshape(spec.shape)
        with warnings.catch_warnings():
            # torch warns that the array is not writable; the weights are never written.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(view)
        return t.view(torch_dtype) if t.dtype != torch_dtype else t
