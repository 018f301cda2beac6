"""A model folder's files read with bounds: one JSON object (config.json, tokenizer_config.json, a shard index), or
the bytes of any of them (tokenizer.json, a chat template)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..errors import ModelFormatError

# Larger than any real config.json, tokenizer_config.json (chat templates included), shard index or tokenizer.json:
# the largest public tokenizer.json, Gemma 3's (a 262k vocabulary), has 33 MB; twice that leaves room for a larger
# vocabulary, and bounds what a hostile file costs to parse (a 150 MB vocabulary took 3.9 GB and two minutes).
MAX_JSON_BYTES = 64 * 1024 * 1024


def read_model_file(path: Path, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a model folder's file, if it is a regular file of at most max_bytes; ModelFormatError naming the
    file otherwise."""
    # A link into a Hugging Face cache's blobs is followed; a FIFO or a device is refused before it is read (reading
    # one would wait forever or never end): O_NONBLOCK lets a FIFO's open return, a regular file's reads ignore it.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelFormatError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise ModelFormatError(f"{path}: {st.st_size:,} bytes; at most {max_bytes:,} bytes are read, far more "
                                   f"than such a file holds: it is not one")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)  # a file that grows meanwhile is still read no further
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror})") from e
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ModelFormatError(f"{path}: more than {max_bytes:,} bytes; it grew while it was read")
    return data


def read_json_object(path: Path) -> dict:
    """The JSON object a model folder's file holds; ModelFormatError naming the file when it holds anything else."""
    data = read_model_file(path)
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
