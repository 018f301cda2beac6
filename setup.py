"""Builds the native kernels into the package (kernels/_native/) when a wheel is built; see kernels/build.py.

Everything else about the package is in pyproject.toml. A build machine without a C compiler still
builds the wheel: its kernels are then compiled at first use, or torch runs instead.
"""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib) / "kernels" / "_native"
        subprocess.run([sys.executable, str(Path(__file__).parent / "kernels" / "build.py"), "--out", str(out)],
                       check=False)


class WithNativeLibraries(Distribution):
    def has_ext_modules(self):  # the wheel holds machine code: tag it for this platform, not "any"
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=WithNativeLibraries)
