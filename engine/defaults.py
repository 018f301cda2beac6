"""Defaults that more than one module relies on, stated once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

BLOCK_SIZE = 16  # tokens per KV block
PREFILL_CHUNK = 512  # prompt tokens per forward pass
DEFAULT_CONTEXT = 4096  # a chat's context when the user names none (capped by the model's maximum)
KV_DIR_ENV = "STOWAGE_KV_DIR"  # where evicted conversations' KV cache is kept (engine/serving/kv_store.py)
DATA_DIR_ENV = "STOWAGE_DATA_DIR"  # tests and portable installs keep the app's files there; nothing else is touched
OPENED_MODELS_FILE = "opened-models.json"  # the app's opened folders and .gguf files, for `stowage list`


def data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The app's user data folder (not created here): STOWAGE_DATA_DIR, else the platform's user data folder."""
    if env.get(DATA_DIR_ENV):
        return Path(env[DATA_DIR_ENV])
    import platformdirs

    return Path(platformdirs.user_data_dir("Stowage", appauthor=False))
