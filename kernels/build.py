"""Build every native kernel library into kernels/_native/, shipped with the package (no compiler needed to run).

    python kernels/build.py [--out DIR]     (also: python -m kernels.build)

Run by the package build (setup.py), the PyInstaller spec and `make`: a desktop without a C compiler
then runs the native kernels, and the first reply pays no compile. Each library is built for every
instruction-set level (the loader picks what the CPU runs); a level this compiler cannot target is
skipped with a note. Torch-free on purpose: it runs inside an isolated build environment.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__:
    from .cbuild import PREBUILT, build
    from .native_libs import all_libraries
else:  # run as a file, without importing the kernels package (which imports torch)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cbuild import PREBUILT, build  # type: ignore[no-redef]
    from native_libs import all_libraries  # type: ignore[no-redef]


def build_all(out: Path) -> tuple[list[Path], list[str]]:
    """Build every library into `out`; return the built paths and the names that could not be built."""
    built, failed = [], []
    for lib in all_libraries():
        path = build(lib.name, list(lib.sources), list(lib.flags), list(lib.libs), out)
        (built.append(path) if path is not None else failed.append(lib.name))
    return built, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PREBUILT)
    args = ap.parse_args(argv)
    built, failed = build_all(args.out)
    print(f"built {len(built)} native kernel libraries into {args.out}")
    for name in failed:
        print(f"  not built: {name} (no C compiler, or it cannot target that instruction set)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
