"""Building the C kernels of kernels/csrc at first use, into a cache folder keyed by their source and flags.

One mechanism for every native kernel (cpu_gemv.py, cpu_quant.py): the system C compiler (`$CC`, else
`cc`) builds a shared library once into the user cache folder (`STOWAGE_KERNEL_CACHE` overrides it); a
missing compiler, a failed build or no writable cache folder gives None, and callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"


def cpu_flags() -> set[str]:
    """The x86 feature flags /proc/cpuinfo lists (empty where there is none to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def load(name: str, sources: list[str], flags: list[str]) -> ctypes.CDLL | None:
    """The library built from `sources` (file names in kernels/csrc; the .c ones are compiled) with `flags`, or None."""
    try:
        path = _build(name, sources, flags)
        return ctypes.CDLL(str(path)) if path is not None else None
    except (OSError, ImportError):  # no writable cache folder (or no platformdirs to find one), or a library
        # the loader refuses: torch serves
        return None


def _cache_dir() -> Path:
    if os.environ.get("STOWAGE_KERNEL_CACHE"):
        return Path(os.environ["STOWAGE_KERNEL_CACHE"]) / "kernels"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("stowage")) / "kernels"


def _build(name: str, sources: list[str], flags: list[str]) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    digest = hashlib.sha256(" ".join(flags).encode())
    for source in sources:
        digest.update(source.encode() + b"\0" + (CSRC / source).read_bytes())
    target = _cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compiled = [str(CSRC / s) for s in sources if s.endswith(".c")]
        result = subprocess.run([compiler, *flags, *compiled, "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            return None
        os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return target
