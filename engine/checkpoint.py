"""The weight files of a model folder: single or sharded safetensors, validated, mapped lazily."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import ModelFormatError
from .safetensors import MappedFile, TensorSpec, read_header

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class Checkpoint:
    """Every tensor of a model folder by name, from headers only; data is mapped on first use."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.specs: dict[str, TensorSpec] = {}
        self.files = weight_files(self.model_dir)
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
            self._maps[spec.path] = MappedFile(spec.path)
        return self._maps[spec.path].tensor(spec)

    def close(self) -> None:
        self._maps.clear()


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the weights, checked to exist."""
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir}: not a folder")
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index.name}: not a valid index ({e})") from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise ModelFormatError(
                f"{model_dir.name}: shard {missing[0]} named in {INDEX_FILE} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + "; the download is incomplete"
            )
        return [model_dir / n for n in names]
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
