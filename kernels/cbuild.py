"""Building the C kernels of kernels/csrc, keyed by their source and flags: when the package is built, or at first use.

One mechanism for every native kernel (cpu_gemv.py, cpu_quant.py, cpu_decode.py): a library named
`name-<digest of sources and flags>.so`. `python -m kernels.build` (run by the package build and the
PyInstaller spec) puts them in kernels/_native/, shipped with the package, so a machine without a C
compiler runs them and the first reply pays no compile. Otherwise the system C compiler (`$CC`, else `cc`)
builds it once into the user cache folder (`STOWAGE_KERNEL_CACHE` overrides it), a developer convenience;
a missing compiler, a failed build or no writable cache folder gives None, and callers fall back to torch.
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
PREBUILT = Path(__file__).parent / "_native"


def cpu_flags() -> set[str]:
    """The x86 feature flags /proc/cpuinfo lists (empty where there is none to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def load(name: str, sources: list[str], flags: list[str], libs: list[str] = ()) -> ctypes.CDLL | None:
    """The library built from `sources` (file names in kernels/csrc; the .c ones are compiled) with `flags`, or None.

    A prebuilt one (kernels/_native/, same sources and flags) is taken first; `libs` follow the sources."""
    try:
        prebuilt = PREBUILT / library_name(name, sources, flags, libs)
        path = prebuilt if prebuilt.exists() else build(name, sources, flags, libs, _cache_dir())
        return ctypes.CDLL(str(path)) if path is not None else None
    except (OSError, ImportError):  # no writable cache folder (or no platformdirs to find one), or a library
        # the loader refuses: torch serves
        return None


def load_library(lib) -> ctypes.CDLL | None:
    """`load` for a kernels/native_libs.py entry."""
    return load(lib.name, list(lib.sources), list(lib.flags), list(lib.libs))


def _cache_dir() -> Path:
    if os.environ.get("STOWAGE_KERNEL_CACHE"):
        return Path(os.environ["STOWAGE_KERNEL_CACHE"]) / "kernels"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("stowage")) / "kernels"


def library_name(name: str, sources: list[str], flags: list[str], libs: list[str] = ()) -> str:
    """The file name of the library: its name and a digest of what it is built from."""
    digest = hashlib.sha256(" ".join([*flags, *libs]).encode())
    for source in sources:
        digest.update(source.encode() + b"\0" + (CSRC / source).read_bytes())
    return f"{name}-{digest.hexdigest()[:16]}.so"


def build(name: str, sources: list[str], flags: list[str], libs, folder: Path) -> Path | None:
    """Build the library into `folder` (nothing when it is there already); its path, or None when it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    target = folder / library_name(name, sources, flags, libs)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compiled = [str(CSRC / s) for s in sources if s.endswith(".c")]
        result = subprocess.run([compiler, *flags, *compiled, *libs, "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            return None
        os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return target
