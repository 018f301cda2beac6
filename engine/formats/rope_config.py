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

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default", "linear" (positions divided by factor) or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (gpt-oss): the band between beta_fast and beta_slow rotations is blended; cos/sin scale by attention_factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self):
        require(math.isfinite(self.theta) and self.theta > 0, f"rope_theta must be a positive number, got {self.theta}")
        if self.kind in ("llama3", "linear"):
            require(math.isfinite(self.factor) and self.factor > 0,
                    f"rope factor must be a positive number, got {self.factor}")
        if self.kind == "yarn":
            require(math.isfinite(self.factor) and self.factor > 0 and self.original_max_position > 0
                    and math.isfinite(self.attention_factor) and self.attention_factor > 0
                    and all(math.isfinite(b) and b > 0 for b in (self.beta_fast, self.beta_slow)),
                    f"yarn rope needs a positive factor, original_max_position_embeddings, attention_factor and betas, "
                    f"got factor={self.factor}, original_max_position_embeddings={self.original_max_position}, "
                    f"attention_factor={self.attention_factor}, beta_fast={self.beta_fast}, beta_slow={self.beta_slow}")
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


def rope_config(raw: dict, max_position_embeddings: int | None = None) -> RopeConfig:
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
    if kind == "yarn":
        return _yarn(merged, theta, max_position_embeddings)
    return RopeConfig(
        theta=theta,
        kind="llama3",
        factor=get_float(merged, "factor", MISSING),
        low_freq_factor=get_float(merged, "low_freq_factor", 1.0),
        high_freq_factor=get_float(merged, "high_freq_factor", 4.0),
        original_max_position=get_int(merged, "original_max_position_embeddings", 8192),
    )


def _yarn(merged: dict, theta: float, max_position_embeddings: int | None) -> RopeConfig:
    """YaRN's parameters as transformers reads them (modeling_rope_utils._compute_yarn_parameters)."""
    original = get_int(merged, "original_max_position_embeddings", MISSING)
    factor = get_float(merged, "factor", None) if merged.get("factor") is not None else None
    if factor is None:  # transformers: the ratio of the context to the original one
        if not max_position_embeddings:
            raise ModelFormatError("config.json: yarn rope without a factor needs max_position_embeddings")
        factor = max_position_embeddings / original
    if merged.get("attention_factor") is not None:
        attention = get_float(merged, "attention_factor", MISSING)
    else:
        mscale, mscale_all = merged.get("mscale"), merged.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, get_float(merged, "mscale", MISSING)) / _yarn_mscale(
                factor, get_float(merged, "mscale_all_dim", MISSING))
        else:
            attention = _yarn_mscale(factor)
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelFormatError(f"config.json: rope truncate must be true or false, got {truncate!r:.80}")
    # transformers: a beta of 0 or null means the default
    return RopeConfig(theta=theta, kind="yarn", factor=factor, original_max_position=original,
                      beta_fast=get_float(merged, "beta_fast", 32.0) or 32.0,
                      beta_slow=get_float(merged, "beta_slow", 1.0) or 1.0, truncate=truncate,
                      attention_factor=attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
