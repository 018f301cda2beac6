"""Byte sizes and token counts as people write and read them: "24GiB", "16GB", "9.1 GiB", "14,336 tokens"."""

from __future__ import annotations

import re

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# Binary and decimal suffixes are both accepted because users copy numbers from tools that disagree
# (nvidia-smi prints MiB, disk vendors print GB). A bare K/M/G/T is read as binary, as nvidia-smi,
# free -h and docker do.
_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": TiB, "tib": TiB, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in a size such as "24GiB", "512MiB", "16GB", "1.5 GiB" or "4096"; raises ValueError."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number and a unit, for example 24GiB, 512MiB or 16GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: int) -> str:
    """A byte count with one decimal in binary units: "512 B", "9.1 GiB", "-0.5 GiB"."""
    sign, n = ("-", -num_bytes) if num_bytes < 0 else ("", num_bytes)
    if n < KiB:
        return f"{sign}{n} B"
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size or unit == "KiB":
            return f"{sign}{n / size:.1f} {unit}"
    raise AssertionError("unreachable")


def format_tokens(num_tokens: int) -> str:
    """A token count with thousands separators: "14,336 tokens"."""
    return f"{num_tokens:,} token" + ("" if num_tokens == 1 else "s")


def format_duration(seconds: float) -> str:
    """A time left, as people say it: "45s", "3m 05s", "2h 10m"."""
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
