"""The compiled kernels on a real GPU (skipped without one; never faked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled Triton kernels need one")
def test_compiled_kernels_match_reference():
    # A subprocess, because this pytest process has TRITON_INTERPRET=1 (see conftest.py).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("gpu_check.py")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
