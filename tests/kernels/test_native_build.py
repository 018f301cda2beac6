"""kernels/build.py builds every native library without torch (as in a wheel's isolated build), and the loader
takes the prebuilt library instead of compiling one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stowage.kernels import cbuild, cpu_decode
from stowage.kernels.native_libs import all_libraries, decode_layer

ROOT = Path(__file__).resolve().parents[2]
# torch made unimportable: the build runs where the package's dependencies are not installed
BLOCK_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['build.py', '--out', sys.argv[1]]; "
               "runpy.run_path('kernels/build.py', run_name='__main__')")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_build_without_torch_then_load_the_prebuilt(tmp_path, monkeypatch):
    out = tmp_path / "native"
    result = subprocess.run([sys.executable, "-P", "-c", BLOCK_TORCH, str(out)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    built = {p.name for p in out.glob("*.so")}
    expected = {cbuild.library_name(lib.name, list(lib.sources), list(lib.flags), list(lib.libs))
                for lib in all_libraries()}
    assert built == expected, result.stdout

    # with no compiler and an empty cache, the prebuilt library is what loads
    monkeypatch.setattr(cbuild, "PREBUILT", out)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("STOWAGE_KERNEL_CACHE", str(tmp_path / "cache"))
    import ctypes

    lib = cbuild.load_library(decode_layer("scalar"))
    assert lib is not None
    lib.decode_isa.restype = ctypes.c_char_p
    assert lib.decode_isa() == b"scalar"
    assert not (tmp_path / "cache").exists()


def test_active_names_the_kernels():
    text = cpu_decode.active()
    assert text.startswith("native ") or text.startswith("torch (")
