"""The weight files of a model folder: single or sharded safetensors, validated, mapped lazily; FileWatch, which
notices a weight file (safetensors or GGUF) changing under a loaded model."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import torch

from .config import read_json_object
from stowage.kernels import fault_guard

from ..errors import ModelFormatError, WeightsChangedError
from .safetensors import MappedFile, TensorSpec, read_header

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class Checkpoint:
    """Every tensor of a model folder by name, from headers only; data is mapped on first use."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.specs: dict[str, TensorSpec] = {}
        self.files = weight_files(self.model_dir)
        self.watch = FileWatch(self.files)  # what each file was before its header was read
        for path in self.files:
            for name, spec in read_header(path).items():
                if name in self.specs:
                    raise ModelFormatError(f"{path.name}: tensor {name!r} also appears in {self.specs[name].path.name}")
                self.specs[name] = spec
        self._maps: dict[Path, MappedFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor as a view of the mapped file (no copy)."""
        spec = self.specs[name]
        if spec.path not in self._maps:
            self.watch.check([spec.path])  # the header's offsets hold only for the file they were read from
            self._maps[spec.path] = MappedFile(spec.path)
            self.watch.mapped(spec.path, self._maps[spec.path].mapping)
        return self._maps[spec.path].tensor(spec)

    def check_unchanged(self) -> None:
        """Raise ModelFormatError if a mapped file was replaced, truncated or rewritten since its header was read
        (FileWatch.check: call it before each forward step)."""
        self.watch.check(self._maps)

    def close(self) -> None:
        self._maps.clear()


class FileWatch:
    """What weight files were when they were read (device, inode, size, mtime), to refuse using one that changed,
    and their mappings, watched for pages read past a file's end (kernels/fault_guard.py).

    A few stat calls: check before and after each forward step. Before, since reading a page of a truncated mapping
    would raise SIGBUS; after, since a file truncated during the step made the fault guard read zeros for the pages
    past its end: the step's results are then discarded (docs/robustness.md). Safetensors folders and GGUF files
    (every part of a split one) are watched alike."""

    def __init__(self, paths):
        self._identity = {Path(p): _identity(Path(p)) for p in paths}
        self._guards: dict[Path, fault_guard.Watched] = {}

    def mapped(self, path: Path, mapping) -> None:
        """Watch the numpy.memmap of a watched file for pages read past its end."""
        self._guards[Path(path)] = fault_guard.watch(mapping)

    def check(self, paths=None) -> None:
        """Raise WeightsChangedError naming the first of `paths` (default: all watched) that changed."""
        for path in self._identity if paths is None else paths:
            try:
                now = _identity(path)
            except ModelFormatError:
                now = None
            guard = self._guards.get(Path(path))
            if now != self._identity[path] or (guard is not None and guard.faulted):
                raise WeightsChangedError(f"the weights file {path.name} changed on disk while the model was loaded "
                                          "(replaced, truncated or rewritten); load the model again")


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What says a file is the one we read: device, inode, size, modification time (of the link's target)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror})") from e
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the weights, checked to exist and to be regular files inside the folder."""
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir}: not a folder")
    index = model_dir / INDEX_FILE
    if index.exists():
        return _indexed_files(model_dir, index)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ModelFormatError(
            f"{model_dir.name}: holds only pickled checkpoints ({', '.join(pickled[:3])}); Stowage never unpickles "
            "model files. Convert them to safetensors first (for example with transformers: "
            "model.save_pretrained(dir, safe_serialization=True))"
        )
    raise ModelFormatError(f"{model_dir.name}: no *.safetensors weight files found")


def _indexed_files(model_dir: Path, index: Path) -> list[Path]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelFormatError(f"{index.name}: not a valid index (weight_map must map tensor names to file names)")
    bad = [v for v in weight_map.values() if not isinstance(v, str)]
    if bad:
        raise ModelFormatError(f"{index.name}: weight_map values must be file names, got {bad[0]!r:.80}")
    names = sorted(set(weight_map.values()))
    if not names:
        raise ModelFormatError(f"{index.name}: weight_map names no files")
    for name in names:
        _check_shard_name(index, name)
    missing = [n for n in names if not (model_dir / n).exists()]
    if missing:
        raise ModelFormatError(
            f"{model_dir.name}: shard {missing[0]} named in {INDEX_FILE} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; the download is incomplete"
        )
    return [model_dir / n for n in names]


def _check_shard_name(index: Path, name: str) -> None:
    # The name must stay inside the folder; the file it names may be a symlink (a Hugging Face cache points
    # every file at ../../blobs/<hash>), which read_header follows to a regular file.
    parts = PurePosixPath(name).parts
    if not name or "\0" in name or "\\" in name or name.startswith("/") or ".." in parts \
            or name != str(PurePosixPath(*parts)):
        raise ModelFormatError(
            f"{index.name}: shard name {name!r:.80} is not a plain file name inside the model folder; "
            "an index may only name files beside it")
