"""Which format a model path holds, and its config and tokenizer either way: the one place that tells them apart.

A Hugging Face folder (config.json, *.safetensors) or a GGUF model: a .gguf file (or a file that starts with
GGUF's magic, as Ollama's blobs do), any part of a split one, or a folder holding one and no config.json.
"""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .gguf import is_gguf_file
from .gguf_model import open_model
from ..text.tokenizer import Tokenizer


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if path.is_file():
        return is_gguf_file(path)
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def read_config(path: str | Path) -> ModelConfig:
    """The model's config: config.json, or the GGUF metadata."""
    if is_gguf(path):
        return open_model(path).config
    return ModelConfig.from_dir(path)


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The model's tokenizer: tokenizer.json, or the one the GGUF metadata describes."""
    if is_gguf(path):
        return open_model(path).tokenizer
    return Tokenizer(path)
