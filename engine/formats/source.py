"""A model path opened, whatever its format: the one place that tells the formats apart (`open_source`).

A Hugging Face folder (config.json, *.safetensors, single or sharded) or a GGUF model: a .gguf file (or a file
that starts with GGUF's magic, as Ollama's blobs do), any part of a split one, or a folder holding one and no
config.json. Planning (inspect), the loader (Engine.load), the CLI and the app ask this module, never the
formats themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ModelConfig
from .gguf import find_gguf, is_gguf_file, open_gguf
from ..text.gguf_tokenizer import cached_tokenizer
from ..text.tokenizer import TOKENIZER_FILE, Tokenizer

if TYPE_CHECKING:  # the formats' weights are torch's; what only reads a tokenizer (the CLI's parent) never imports it
    import torch

    from .checkpoint import Checkpoint
    from .gguf_model import GGUFModel, Matrices
    from .layout import ModelLayout, TensorInfo


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if path.is_file():
        return is_gguf_file(path)
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


class ModelSource:
    """One model's config, tensor headers, weight files and tokenizer, from headers only (no tensor data).

    The config is read at once (the first thing to be wrong with a model); the safetensors headers and the
    tokenizer when first asked for. A GGUF file is parsed once per process (gguf_model.open_model)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        self.gguf: GGUFModel | None = _open_gguf_model(self.path) if is_gguf(self.path) else None
        self.config: ModelConfig = self.gguf.config if self.gguf else ModelConfig.from_dir(self.path)

    @cached_property
    def _checkpoint(self) -> Checkpoint:
        from .checkpoint import Checkpoint

        return Checkpoint(self.path)

    @property
    def specs(self) -> Mapping[str, TensorInfo]:
        """Every tensor by its Hugging Face name (a GGUF file's names translated)."""
        return self.gguf.specs if self.gguf else self._checkpoint.specs

    @property
    def files(self) -> list[Path]:
        """The weight files (shards, or the parts of a split GGUF)."""
        return self.gguf.files if self.gguf else self._checkpoint.files

    @property
    def file_bytes(self) -> int:
        """The weight files' sizes, headers included."""
        return sum(p.stat().st_size for p in self.files)

    @property
    def has_tokenizer(self) -> bool:
        return self.gguf is not None or (self.path / TOKENIZER_FILE).exists()

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """tokenizer.json, or the one the GGUF metadata describes."""
        return self.gguf.tokenizer if self.gguf else Tokenizer(self.path)

    def layout(self) -> ModelLayout:
        from .layout import ModelLayout

        return ModelLayout.of(self.config, self.specs, self.name)

    def matrices(self, layout: ModelLayout) -> Matrices | None:
        """The shapes of the matrices kept in blocks (None: a safetensors model whose products are all torch's; gpt-oss's
        MXFP4 experts are in blocks there too: gguf_model.mxfp4_matrices)."""
        if self.gguf:
            return self.gguf.matrices(layout.layers, layout.embed, layout.lm_head, layout.experts)
        if layout.expert_form == "gate_up_mxfp4":
            from .gguf_model import mxfp4_matrices

            return mxfp4_matrices(layout.config)
        return None

    @property
    def qk_order(self) -> torch.Tensor | None:
        """The per-head gather that undoes a GGUF converter's Q/K permutation (None: none to undo)."""
        return self.gguf.qk_order if self.gguf else None

    def weights(self, dtype: torch.dtype, *, converts: bool):
        """The tensors as the loader places them (runtime/weights.py place): a GGUF file's blocks compute in
        `dtype` tile by tile; safetensors are mapped views."""
        return self.gguf.weights(dtype, converts=converts) if self.gguf else self._checkpoint


def _open_gguf_model(path: Path) -> GGUFModel:
    from .gguf_model import open_model  # torch: a safetensors folder's config and tokenizer are read without it

    return open_model(path)


def open_source(path: str | Path) -> ModelSource:
    """The model at `path`, whatever its format: the one way in."""
    return ModelSource(path)


def read_config(path: str | Path) -> ModelConfig:
    """The model's config: config.json, or the GGUF metadata."""
    return open_source(path).config


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The model's tokenizer: tokenizer.json, or the one the GGUF metadata describes, read back from its cache without
    parsing the file where it was built before (GGUFModel.tokenizer keeps the same one). Imports no torch."""
    if not is_gguf(path):
        return open_source(path).tokenizer
    file = find_gguf(path)
    return cached_tokenizer(file, lambda: open_gguf(file).metadata, file.name)
