"""Lists the `stowage.*` packages from the folders and builds the native kernels into the package
(stowage/kernels/_native/) when a wheel is built; see kernels/build.py.

Everything else about the package is in pyproject.toml. A build machine without a C compiler still
builds the wheel: its kernels are then compiled at first use, or torch runs instead.
"""

import subprocess
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib) / "stowage" / "kernels" / "_native"
        subprocess.run([sys.executable, str(Path(__file__).parent / "kernels" / "build.py"), "--out", str(out)],
                       check=False)


class WithNativeLibraries(Distribution):
    def has_ext_modules(self):  # the wheel holds machine code: tag it for this platform, not "any"
        return True


def stowage_packages() -> list[str]:
    """app/, engine/, kernels/ and assets/ with every folder below them, under `stowage.`: the code's packages and
    the folders of its data (the C sources, the prebuilt kernels, the demo model, the icons)."""
    tops = ("app", "engine", "kernels", "assets")
    found = find_namespace_packages(include=[f"{top}{tail}" for top in tops for tail in ("", ".*")],
                                    exclude=["*.__pycache__"])
    return [f"stowage.{p}" for p in found]


setup(packages=stowage_packages(), cmdclass={"build_py": BuildPyWithKernels}, distclass=WithNativeLibraries)
