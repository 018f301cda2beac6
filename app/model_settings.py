"""The user's choices for one model (context, placement, sampling, system prompt), kept in QSettings."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from PySide6.QtCore import QSettings

from . import context_policy, paths

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# The range the settings offer for each sampling field (the sampling form's boxes take theirs from here).
SAMPLING_LIMITS = {"temperature": (0.0, 2.0), "top_p": (0.01, 1.0), "top_k": (0, 1000), "min_p": (0.0, 0.99),
                   "repetition_penalty": (0.5, 2.0), "max_tokens": (1, 1_000_000)}
# generation_config.json (Hugging Face) key -> ModelSettings field
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class ModelSettings:
    context_tokens: int = 4096
    gpu_layers: int | None = None  # None: as many as fit (the planner decides)
    kv_dtype: str | None = None  # None: the model's compute dtype
    ram_limit_gib: float | None = None  # None: what is available, minus a reserve; swap never counts
    overflow_policy: str = context_policy.STOP
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repetition_penalty: float = 1.1
    max_tokens: int = 512
    seed: int | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    cpu_threads: int = 0  # 0: the cores the engine may use, less one for the window (kernels/cpu_decode.py)

    def sampling_params(self):
        from stowage.engine.runtime.sampler import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_tokens,
            seed=self.seed,
        )

    def system_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []


# What a sampling preset sets; the length and the seed stay as the user left them.
PRESET_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MODEL_DEFAULTS = "model"  # the preset that is the model's own sampling (model_defaults)
SAMPLING_PRESETS = {
    "Precise": {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    "Balanced": {name: getattr(ModelSettings(), name) for name in PRESET_FIELDS},  # Stowage's own defaults
    "Creative": {"temperature": 1.0, "top_p": 0.98, "top_k": 100, "min_p": 0.02, "repetition_penalty": 1.05},
    "Greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
}


def with_preset(s: ModelSettings, preset: str, defaults: ModelSettings) -> ModelSettings:
    """`s` with a preset's sampling: a SAMPLING_PRESETS name, or MODEL_DEFAULTS for `defaults`' own."""
    values = SAMPLING_PRESETS.get(preset) or {name: getattr(defaults, name) for name in PRESET_FIELDS}
    if preset == MODEL_DEFAULTS:  # the model's whole sampling, its length included
        values = {**values, "max_tokens": defaults.max_tokens}
    return replace(s, **values)


def preset_of(s: ModelSettings, defaults: ModelSettings) -> str | None:
    """Which preset `s`'s sampling is (the model's defaults first), or None for the user's own mix."""
    def same(a: ModelSettings, b: ModelSettings) -> bool:
        return all(round(getattr(a, n), 2) == round(getattr(b, n), 2) for n in PRESET_FIELDS)

    return next((name for name in (MODEL_DEFAULTS, *SAMPLING_PRESETS) if same(s, with_preset(s, name, defaults))),
                None)


def model_defaults(model_dir: Path) -> ModelSettings:
    """ModelSettings() with the sampling the model's authors chose in generation_config.json, where it is sane.

    do_sample false means greedy (temperature 0). A value of the wrong type or out of range is ignored.
    """
    try:
        raw = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ModelSettings()
    if not isinstance(raw, dict):
        return ModelSettings()
    base, values = ModelSettings(), {}
    for key, name in GENERATION_KEYS.items():
        value, kind = raw.get(key), type(getattr(base, name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and not float(value).is_integer():
            continue
        lo, hi = SAMPLING_LIMITS[name]
        if lo <= value <= hi:
            values[name] = kind(value)
    if raw.get("do_sample") is False:
        values["temperature"] = 0.0
    return replace(base, **values)


def open_settings() -> QSettings:
    """The app's QSettings; under STOWAGE_DATA_DIR an INI file there, so tests and portable runs stay apart."""
    if os.environ.get(paths.DATA_DIR_ENV):
        return QSettings(str(paths.data_dir() / "settings.ini"), QSettings.Format.IniFormat)
    return QSettings(paths.APP_NAME, paths.APP_NAME)


def _group(model_dir) -> str:
    """A model folder's QSettings group, or a remote server's model's (remote_source.RemoteModel)."""
    if hasattr(model_dir, "settings_group"):
        return model_dir.settings_group
    # QSettings keys cannot hold '/' safely; a short hash of the path keeps two same-named models apart.
    digest = hashlib.sha1(str(Path(model_dir).resolve()).encode()).hexdigest()[:10]
    return f"models/{Path(model_dir).name.replace('/', '_')}-{digest}"


def load_model_settings(settings: QSettings, model_dir, defaults: ModelSettings | None = None) -> ModelSettings:
    """What the user chose for this model (a folder, or a server's RemoteModel with `defaults` given), over
    `defaults` (the folder's own, model_defaults(), when None)."""
    defaults = model_defaults(model_dir) if defaults is None else defaults
    settings.beginGroup(_group(model_dir))
    try:
        values = {}
        for f in fields(ModelSettings):
            if not settings.contains(f.name):
                continue
            raw = settings.value(f.name)
            default = getattr(defaults, f.name)
            values[f.name] = _coerce(raw, default, f.name)
        return replace(defaults, **values)
    finally:
        settings.endGroup()


def save_model_settings(settings: QSettings, model_dir, model_settings: ModelSettings) -> None:
    settings.beginGroup(_group(model_dir))
    for name, value in asdict(model_settings).items():
        # INI files lose None; an empty string stands for "not set".
        settings.setValue(name, "" if value is None else value)
    settings.endGroup()


_INT_OR_NONE = {"gpu_layers", "seed"}
_FLOAT_OR_NONE = {"ram_limit_gib"}
_STR_OR_NONE = {"kv_dtype"}


def _coerce(raw, default, name):
    """QSettings INI values come back as strings; turn them into the field's type."""
    if name in _INT_OR_NONE | _FLOAT_OR_NONE | _STR_OR_NONE and raw in ("", None):
        return None
    try:
        if name in _INT_OR_NONE:
            return int(raw)
        if name in _FLOAT_OR_NONE:
            return float(raw)
        if name in _STR_OR_NONE:
            return str(raw)
        if isinstance(default, bool):
            return str(raw).lower() in ("1", "true")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        return default
