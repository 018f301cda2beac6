"""Where the app keeps its files: the user data folder, its models folder, the bundled demo model."""

from __future__ import annotations

import os
from pathlib import Path

from ..engine import defaults

APP_NAME = "Stowage"
DATA_DIR_ENV = defaults.DATA_DIR_ENV


def data_dir() -> Path:
    """The user data folder (created on first use); STOWAGE_DATA_DIR overrides it (engine/defaults.py)."""
    path = defaults.data_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """The Stowage models folder: any model folder dropped here shows up in the picker."""
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_model_dir() -> Path:
    """The small model shipped with the app, so a first run can chat without a download."""
    return Path(__file__).resolve().parents[1] / "assets" / "demo-model"


def icons_dir() -> Path:
    """The app icon at several sizes (assets/icons/stowage-NN.png)."""
    return Path(__file__).resolve().parents[1] / "assets" / "icons"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, honouring the variables huggingface_hub itself reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"
