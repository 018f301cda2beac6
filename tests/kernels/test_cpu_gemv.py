"""The C bf16 matrix-vector kernel against torch, on the CPUs that can run it."""

import pytest
import torch

from stowage.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.is_available(),
                                reason="needs an x86 CPU with AVX512-BF16 and a C compiler")


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 100), (960, 960), (320, 960), (960, 2560), (33, 64), (5, 31)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_product_rounded_to_bf16(rows, cols, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    x = torch.randn(1, cols, generator=g).bfloat16()
    bias = torch.randn(rows, generator=g).bfloat16() if with_bias else None
    exact = x.float() @ w.float().t() + (bias.float() if with_bias else 0)
    ours = cpu_gemv.gemv(x, w, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (1, rows)
    # fp32 accumulation in another order, then one rounding to bf16: within a bf16 ulp of the exact value
    tolerance = exact.abs() * 2**-7 + 1e-4 * cols**0.5
    assert ((ours.float() - exact).abs() <= tolerance).all()
    torch_result = torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    assert (ours.float() - torch_result.float()).abs().max() <= (tolerance * 2).max()


def test_reads_a_strided_input_and_a_mapped_weight(tmp_path):
    from safetensors.torch import save_file

    from stowage.engine.formats.checkpoint import Checkpoint

    w = torch.randn(64, 96).bfloat16()
    (tmp_path / "m").mkdir()
    save_file({"w": w}, tmp_path / "m" / "model.safetensors")
    mapped = Checkpoint(tmp_path / "m").tensor("w")
    x = torch.randn(3, 96).bfloat16()[1:2]  # a view into a larger tensor
    assert torch.allclose(cpu_gemv.gemv(x, mapped).float(), (x.float() @ w.float().t()), rtol=2**-7, atol=1e-3)
