"""The compiled kernels on a real GPU (skipped without one; never faked), and how gpu_check.py splits its work."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("gpu_check.py")
# Triton compiles each (dtype, head_dim, block size) on first use, one at a time per process: four
# processes compile four groups at once (bench/gpu_suite.sh gives this test about two minutes).
NUM_PARTS = 4
TIMEOUT_S = 540


def _env() -> dict[str, str]:
    # Without TRITON_INTERPRET, which this pytest process has (see conftest.py): the kernels are compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env


def _listed() -> list[list[str]]:
    """The case names of each part, as gpu_check.py --list deals them."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--list", "--part", f"0/{NUM_PARTS}"], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    parts: list[list[str]] = [[] for _ in range(NUM_PARTS)]
    for line in out.stdout.splitlines():
        where, name = line.split(" ", 1)
        parts[int(where.split("/")[0])].append(name)
    return parts


def test_the_parts_cover_every_case_once_and_split_no_compile_group():
    parts = _listed()
    everything = sum(parts, [])
    # 3 dtypes x 4 head_dims x 2 block sizes x (decode, write, prefill), plus per dtype a first chunk and 3 long decodes
    with_fp8 = not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)
    assert len(everything) == len(set(everything)) == 28 * (2 + with_fp8)
    assert all(parts), "a part with no case would leave a process idle"
    # the 32k decodes and the first prefill chunk compile with the d=128 bs=16 kernels: the same part
    for dtype in ("float16", "bfloat16") + (("float8_e4m3fn",) if with_fp8 else ()):
        holder = [p for p in parts if f"decode torch.{dtype} d=128 bs=16" in p]
        assert len(holder) == 1 and f"decode 32k torch.{dtype} splits=7" in holder[0]
        assert f"prefill torch.{dtype} first chunk" in holder[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled Triton kernels need one")
def test_compiled_kernels_match_reference():
    expected = len(sum(_listed(), []))  # fp8 cases are listed only where the GPU runs them
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--part", f"{k}/{NUM_PARTS}"], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(NUM_PARTS)]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    report = "\n".join(outputs)
    print(report)
    assert all(p.returncode == 0 for p in procs), report
    assert sum(line.startswith("ok  ") for line in report.splitlines()) == expected, report
