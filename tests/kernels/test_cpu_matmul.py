"""Prefill products on widened fp32 tiles (kernels/cpu_matmul.py) against the fp32 product of the same values."""

import pytest
import torch

from stowage.kernels import cpu_matmul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_give_the_fp32_product_rounded_once(monkeypatch, dtype, bias):
    # 1,000 rows of 96 in tiles of 16 rows (the last one partial): every tile's columns land where they belong
    monkeypatch.setattr(cpu_matmul, "TILE_BYTES", 16 * 96 * 4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen).to(dtype)
    w = (torch.randn(1000, 96, generator=gen) * 0.1).to(dtype)
    b = torch.randn(1000, generator=gen).to(dtype) if bias else None
    assert cpu_matmul.tile_rows(96, 1000) == 16
    ours = cpu_matmul.mm(x, w, b)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert ours.dtype == dtype and ours.shape == (37, 1000)
    # fp32 sums of exact products, rounded once to the dtype: within one unit of its last place of the exact sum
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((ours.double() - exact).abs() <= ulp + 1e-5).all()
    native = torch.addmm(b, x, w.t()) if bias else torch.mm(x, w.t())  # torch's own 16-bit product
    torch.testing.assert_close(ours.float(), native.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


def test_runs_only_on_cpu_chunks_of_widened_16_bit_weights(monkeypatch):
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    chunk, token = torch.zeros(cpu_matmul.MIN_ROWS, 64, dtype=torch.bfloat16), torch.zeros(1, 64, dtype=torch.bfloat16)
    monkeypatch.setenv(cpu_matmul.WIDEN_ENV, "1")
    assert cpu_matmul.applies(chunk, w) and not cpu_matmul.applies(token, w)
    assert not cpu_matmul.applies(chunk.float(), w.float())  # fp32 is torch's fast product already
    assert not cpu_matmul.applies(chunk.half(), w)  # mixed dtypes go to torch, which says what is wrong
    monkeypatch.setenv(cpu_matmul.WIDEN_ENV, "0")
    assert not cpu_matmul.applies(chunk, w)


def test_the_cpu_flags_decide_which_dtypes_are_widened():
    bf16, f16 = torch.bfloat16, torch.float16
    assert cpu_matmul.slow_dtypes({"avx2", "fma", "f16c"}) == {bf16, f16}  # Zen 2/3, Intel client parts
    assert cpu_matmul.slow_dtypes({"avx512f", "avx512_bf16"}) == {f16}  # Zen 4, Cooper Lake
    assert cpu_matmul.slow_dtypes({"amx_bf16", "amx_fp16", "avx512_fp16"}) == set()  # Granite Rapids


def test_the_scratch_formula():
    # 1 MiB of fp32 rows: 64 rows of 4,096, 16 of 14,336 (never under 16, never past the matrix)
    assert cpu_matmul.tile_rows(4096, 14336) == 64 and cpu_matmul.tile_rows(14336, 4096) == 16
    assert cpu_matmul.tile_rows(64, 40) == 40
    assert cpu_matmul.workspace_bytes(512, [(4096, 4096), (14336, 4096)]) == 4 * (512 * 14336 + 16 * 14336 + 512 * 16)
    assert cpu_matmul.workspace_bytes(cpu_matmul.MIN_ROWS - 1, [(4096, 4096)]) == 0


def test_the_scratch_formula_bounds_what_a_product_allocates(monkeypatch):
    # the largest single allocation of one product is within what the planner charges for it
    monkeypatch.setattr(cpu_matmul, "TILE_BYTES", 64 * 256 * 4)
    x, w = torch.randn(100, 256).bfloat16(), torch.randn(700, 256).bfloat16()
    seen = []
    real_mm = torch.mm

    def counting_mm(a, b, **kw):
        seen.append(a.numel() * a.element_size() + b.numel() * b.element_size() + a.shape[0] * b.shape[1] * 4)
        return real_mm(a, b, **kw)

    monkeypatch.setattr(torch, "mm", counting_mm)
    cpu_matmul.mm(x, w)
    assert len(seen) == 11 and max(seen) <= cpu_matmul.workspace_bytes(100, [(256, 700)])
