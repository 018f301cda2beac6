"""The rotary embedding's parameters as config.json gives them, every value checked (engine/runtime/rope.py builds the tables).

transformers 5 writes `rope_parameters`, older files `rope_scaling` and a top-level `rope_theta`. Given both dicts,
transformers keeps `rope_scaling` and silently drops `rope_parameters`; Stowage merges them and refuses a file in
which two of them give one key different values, since either guess could be wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config_values import MISSING, get_float, get_int, require
from ..errors import ModelFormatError, UnsupportedModelError

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default", "linear" (positions divided by factor) or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        require(math.isfinite(self.theta) and self.theta > 0, f"rope_theta must be a positive number, got {self.theta}")
        if self.kind in ("llama3", "linear"):
            require(math.isfinite(self.factor) and self.factor > 0,
                    f"rope factor must be a positive number, got {self.factor}")
        if self.kind == "llama3":
            require(math.isfinite(self.high_freq_factor) and 0 < self.low_freq_factor < self.high_freq_factor,
                    f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got {self.low_freq_factor} "
                    f"and {self.high_freq_factor}")
            require(self.original_max_position > 0,
                    f"original_max_position_embeddings must be positive, got {self.original_max_position}")


def _rope_dict(raw: dict, key: str) -> dict:
    """`raw[key]` (rope_parameters or rope_scaling) as one set for every layer, `type` read as `rope_type`."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelFormatError(f"config.json: {key} must be an object, got {value!r:.80}")
    if any(isinstance(v, dict) for v in value.values()):
        raise UnsupportedModelError(f"config.json: {key} per layer type is not supported (one set for every layer is)")
    value = dict(value)
    if "type" in value and "rope_type" not in value:  # the older spelling
        value["rope_type"] = value.pop("type")
    value.pop("type", None)
    return value


def rope_config(raw: dict) -> RopeConfig:
    """The RopeConfig of `raw`'s rope_parameters, rope_scaling and rope_theta together (they must not disagree)."""
    sources = {"rope_parameters": _rope_dict(raw, "rope_parameters"), "rope_scaling": _rope_dict(raw, "rope_scaling")}
    if raw.get("rope_theta") is not None:
        sources["rope_theta"] = {"rope_theta": raw["rope_theta"]}
    merged: dict = {}
    origin: dict[str, str] = {}
    for source, values in sources.items():
        for key, value in values.items():
            if key in merged and merged[key] != value:
                raise ModelFormatError(
                    f"config.json: {origin[key]} and {source} disagree on {key} ({merged[key]!r:.40} vs "
                    f"{value!r:.40}); remove the stale one (transformers would use rope_scaling and ignore "
                    "rope_parameters)")
            merged[key], origin[key] = value, source
    kind = merged.get("rope_type") or "default"
    if not isinstance(kind, str):
        raise ModelFormatError(f"config.json: rope_type must be a string, got {kind!r:.80}")
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope type {kind!r:.40} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = get_float(merged, "rope_theta", 10000.0)
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=get_float(merged, "factor", MISSING))
    return RopeConfig(
        theta=theta,
        kind="llama3",
        factor=get_float(merged, "factor", MISSING),
        low_freq_factor=get_float(merged, "low_freq_factor", 1.0),
        high_freq_factor=get_float(merged, "high_freq_factor", 4.0),
        original_max_position=get_int(merged, "original_max_position_embeddings", 8192),
    )
