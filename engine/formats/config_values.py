"""Typed reads of config.json values: each a ModelFormatError naming the key when the value has the wrong type.

Ranges are checked by the records built from them (ModelConfig, RopeConfig `__post_init__`), through `require`.
"""

from __future__ import annotations

from ..errors import ModelFormatError

MISSING = object()  # the default of a required key


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ModelFormatError(f"config.json: {message}")


def get_value(raw: dict, key: str, default):
    value = raw.get(key)
    if value is None:  # absent or null: transformers treats both as "not given"
        if default is MISSING:
            raise ModelFormatError(f"config.json: missing required key {key!r}")
        return default
    return value


def get_int(raw: dict, key: str, default=MISSING) -> int | None:
    value = get_value(raw, key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 4096.0: a writer that only has floats
    if value is not default and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelFormatError(f"config.json: {key} must be an integer, got {value!r:.80}")
    return value


def get_float(raw: dict, key: str, default: float, where: str = "config.json") -> float:
    value = get_value(raw, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFormatError(f"{where}: {key} must be a number, got {value!r:.80}")
    try:
        return float(value)
    except OverflowError:  # an integer past float range
        raise ModelFormatError(f"{where}: {key} is out of range ({value:.3e})") from None


def get_optional_float(raw: dict, key: str, default: float | None) -> float | None:
    """A number, or None when the key is null (switched off, whatever the default) or absent with no default."""
    if key in raw and raw[key] is None:
        return None
    return None if default is None and raw.get(key) is None else get_float(raw, key, default)


def get_bool(raw: dict, key: str, default: bool = False) -> bool:
    value = get_value(raw, key, default)
    if not isinstance(value, bool):
        raise ModelFormatError(f"config.json: {key} must be true or false, got {value!r:.80}")
    return value
