"""attention_ops picks the implementation; importing kernels never imports triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stowage import kernels
from stowage.kernels import cpu_attention, cpu_decode, reference


def test_cpu_gets_the_native_kernel_or_the_reference(monkeypatch):
    expected = cpu_attention if cpu_decode.current() is not None else reference
    assert kernels.attention_ops("cpu") is expected and kernels.attention_ops(torch.device("cpu")) is expected
    monkeypatch.setenv("STOWAGE_NATIVE_DECODE", "0")  # its switch
    cpu_decode.selected_isa.cache_clear()
    try:
        assert kernels.attention_ops("cpu") is reference
    finally:
        monkeypatch.undo()
        cpu_decode.selected_isa.cache_clear()


def test_force_reference_switch(monkeypatch):
    monkeypatch.setenv(kernels.FORCE_REFERENCE_ENV, "1")
    assert kernels.attention_ops("cuda") is reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks planning for a GPU on a machine without one")
def test_a_gpu_that_is_not_here_is_planned_with_the_kernel_it_would_run(monkeypatch):
    # a plan for a 24 GB GPU made on a laptop charges the workspace of the kernel that GPU will run
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    assert kernels.attention_ops("cuda").NAME == "triton"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_gets_triton(monkeypatch):
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    ops = kernels.attention_ops("cuda")
    assert ops.__name__ == "stowage.kernels.triton_attention"


def test_ops_share_the_reference_signatures():
    import inspect

    from stowage.kernels import triton_attention

    for name in ("write_kv", "decode_attention", "prefill_attention"):
        want = list(inspect.signature(getattr(reference, name)).parameters)
        got = list(inspect.signature(getattr(triton_attention, name)).parameters)
        assert got == want, name


def test_importing_kernels_leaves_triton_alone():
    # A fresh interpreter: TRITON_INTERPRET only works if no kernel is decorated before it is set.
    # Planning for a GPU asks its kernel's workspace_bytes, which must not import triton either.
    code = ("import sys; from stowage import kernels; import stowage.engine.runtime.model; "
            "kernels.attention_ops('cpu'); "
            "import stowage.engine.planning.plan; kernels.attention_ops('cuda').workspace_bytes; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
