"""One JSON object from a model folder's file (config.json, tokenizer_config.json, a shard index), read with bounds."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelFormatError

# Larger than any real config, tokenizer_config.json (chat templates included) or shard index.
MAX_JSON_BYTES = 64 * 1024 * 1024


def read_json_object(path: Path) -> dict:
    """The JSON object a model folder's file holds; ModelFormatError naming the file when it holds anything else."""
    # is_file() follows symlinks: a link into a Hugging Face cache's blobs is fine; a FIFO or a device is not
    # opened at all (reading one would wait forever or never end).
    if not path.is_file():
        raise ModelFormatError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ModelFormatError(f"{path}: {size:,} bytes is far larger than such a file can be; it is not one")
        data = path.read_bytes()
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror})") from e
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    except RecursionError:
        raise ModelFormatError(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: holds {kind_of(value)}, not a JSON object")
    return value


def kind_of(value) -> str:
    """What a JSON value is, for messages: "a list", "null", "a string", "a boolean", "a number"."""
    return {list: "a list", type(None): "null", str: "a string", bool: "a boolean"}.get(type(value), "a number")
