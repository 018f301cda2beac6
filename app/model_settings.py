"""The user's choices for one model (context, placement, sampling, system prompt), kept in QSettings."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from PySide6.QtCore import QSettings

from stowage.engine.errors import InvalidArgumentError
from stowage.engine.runtime.sampler import SamplingParams

from . import context_policy, paths

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# The range the settings offer for each sampling field (the sampling form's boxes take theirs from here).
SAMPLING_LIMITS = {"temperature": (0.0, 2.0), "top_p": (0.01, 1.0), "top_k": (0, 1000), "min_p": (0.0, 0.99),
                   "repetition_penalty": (0.5, 2.0), "max_tokens": (1, 1_000_000)}
# generation_config.json (Hugging Face) key -> SamplingParams field
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# Stowage's own sampling for a chat (the engine's defaults are neutral, for an API whose caller chooses).
DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.1,
                                  max_tokens=512)
# The sampling fields the user chooses, saved under their own names; stop strings are the API's alone.
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "stop")


@dataclass(frozen=True)
class ModelSettings:
    context_tokens: int = 4096
    gpu_layers: int | None = None  # None: as many as fit (the planner decides)
    cpu_expert_layers: int | None = None  # a model of experts: None: as many layers' experts on the GPU as fit
    kv_dtype: str | None = None  # None: the model's compute dtype
    ram_limit_gib: float | None = None  # None: what is available, minus a reserve; swap never counts
    overflow_policy: str = context_policy.STOP
    sampling: SamplingParams = DEFAULT_SAMPLING
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    cpu_threads: int = 0  # 0: the cores the engine may use, less one for the window (kernels/cpu_decode.py)

    def system_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []


# What a sampling preset sets; the length and the seed stay as the user left them.
PRESET_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MODEL_DEFAULTS = "model"  # the preset that is the model's own sampling (model_defaults)
SAMPLING_PRESETS = {
    "Precise": {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    "Balanced": {name: getattr(DEFAULT_SAMPLING, name) for name in PRESET_FIELDS},  # Stowage's own defaults
    "Creative": {"temperature": 1.0, "top_p": 0.98, "top_k": 100, "min_p": 0.02, "repetition_penalty": 1.05},
    "Greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
}


def with_preset(s: ModelSettings, preset: str, defaults: ModelSettings) -> ModelSettings:
    """`s` with a preset's sampling: a SAMPLING_PRESETS name, or MODEL_DEFAULTS for `defaults`' own."""
    values = SAMPLING_PRESETS.get(preset) or {name: getattr(defaults.sampling, name) for name in PRESET_FIELDS}
    if preset == MODEL_DEFAULTS:  # the model's whole sampling, its length included
        values = {**values, "max_tokens": defaults.sampling.max_tokens}
    return replace(s, sampling=replace(s.sampling, **values))


def preset_of(s: ModelSettings, defaults: ModelSettings) -> str | None:
    """Which preset `s`'s sampling is (the model's defaults first), or None for the user's own mix."""
    def same(a: SamplingParams, b: SamplingParams) -> bool:
        return all(round(getattr(a, n), 2) == round(getattr(b, n), 2) for n in PRESET_FIELDS)

    return next((name for name in (MODEL_DEFAULTS, *SAMPLING_PRESETS)
                 if same(s.sampling, with_preset(s, name, defaults).sampling)), None)


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
        value, kind = raw.get(key), type(getattr(base.sampling, name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and not float(value).is_integer():
            continue
        lo, hi = SAMPLING_LIMITS[name]
        if lo <= value <= hi:
            values[name] = kind(value)
    if raw.get("do_sample") is False:
        values["temperature"] = 0.0
    return replace(base, sampling=replace(base.sampling, **values))


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
    `defaults` (the folder's own, model_defaults(), when None). A value that cannot be read, or that the engine's
    SamplingParams refuses, is the default's."""
    defaults = model_defaults(model_dir) if defaults is None else defaults
    settings.beginGroup(_group(model_dir))
    try:
        stored = {name: _coerce(settings.value(name), default, name)
                  for name, default in _saved(defaults).items() if settings.contains(name)}
    finally:
        settings.endGroup()
    sampling = defaults.sampling
    for name in SAMPLING_FIELDS:
        if name in stored:
            value = stored.pop(name)
            try:
                sampling = replace(sampling, **{name: value})
            except InvalidArgumentError:  # out of the engine's range (an edited file): the default stays
                pass
    return replace(defaults, sampling=sampling, **stored)


def save_model_settings(settings: QSettings, model_dir, model_settings: ModelSettings) -> None:
    settings.beginGroup(_group(model_dir))
    for name, value in _saved(model_settings).items():
        # INI files lose None; an empty string stands for "not set".
        settings.setValue(name, "" if value is None else value)
    settings.endGroup()


def _saved(s: ModelSettings) -> dict:
    """The settings as they are saved: one flat group, the sampling's fields beside the others (as they have
    always been saved, so older files load)."""
    values = {f.name: getattr(s, f.name) for f in fields(ModelSettings) if f.name != "sampling"}
    return {**values, **{name: getattr(s.sampling, name) for name in SAMPLING_FIELDS}}


_INT_OR_NONE = {"gpu_layers", "cpu_expert_layers", "seed"}
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
