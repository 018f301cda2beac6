"""Triton write_kv (interpreted on the CPU) against the torch reference, byte for byte."""

from __future__ import annotations

import pytest
import torch

from stowage.kernels import reference, triton_write


def _caches(cache_dtype, num_blocks=6, block_size=16, num_kv_heads=3, head_dim=80):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, 7.0).to(cache_dtype)  # a sentinel: untouched slots must keep it
    return k, k.clone()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int16 if t.dtype.itemsize == 2 else torch.int32)


@pytest.mark.parametrize(
    "cache_dtype,src_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float8_e4m3fn, torch.float32),
     (torch.float8_e4m3fn, torch.float16), (torch.float8_e4m3fn, torch.bfloat16)],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(cache_dtype, src_dtype, block_size):
    gen = torch.Generator().manual_seed(3)
    # K and V are slices of one fused QKV projection: strided rows, as the model produces them.
    qkv = (3 * torch.randn(12, 3 + 3 + 3, 80, generator=gen)).to(src_dtype)
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    # shuffled slots across blocks, two -1 (padding) tokens that must write nothing
    slots = torch.tensor([5, 70, 71, -1, 3, block_size * 4 + 9, 2, -1, 40, 41, 90, 17])
    k_scale, v_scale = (0.5, 0.125) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    want_k, want_v = _caches(cache_dtype, block_size=block_size)
    got_k, got_v = _caches(cache_dtype, block_size=block_size)
    reference.write_kv(key, value, want_k, want_v, slots, k_scale, v_scale)
    triton_write.write_kv(key, value, got_k, got_v, slots, k_scale, v_scale)
    assert torch.equal(_bytes(got_k), _bytes(want_k))
    assert torch.equal(_bytes(got_v), _bytes(want_v))


def test_fp8_rounding_is_bit_exact():
    # Values that exercise every branch: zero, subnormals and their ties, mantissa carries into the
    # exponent (7.8 -> 8), the largest finite 448 and saturation past it.
    specials = [0.0, -0.0, 2**-10, 2**-9 * 1.5, 2**-9 * 2.5, 2**-9 * 7.5, 2**-6, 2**-7 * 3, 7.5, 7.75, 7.8,
                -7.8, 15.5, 448.0, 449.0, 470.0, 500.0, -1e6, 1e-30]
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor(specials), 3 * torch.randn(200, generator=gen), 0.01 * torch.randn(100, generator=gen)])
    rows = torch.nn.functional.pad(values, (0, 64 * 5 - values.numel())).view(5, 1, 64)
    slots = torch.arange(5)
    want = torch.zeros(1, 16, 1, 64, dtype=torch.float8_e4m3fn)
    got = want.clone()
    reference.write_kv(rows, rows, want, want.clone(), slots)
    triton_write.write_kv(rows, rows, got, got.clone(), slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().max().item() == 448.0


def test_empty_write_is_a_no_op():
    k, v = _caches(torch.float16)
    triton_write.write_kv(torch.empty(0, 3, 80), torch.empty(0, 3, 80), k, v, torch.empty(0, dtype=torch.int64))
    assert (k.float() == 7.0).all()


def test_refuses_cache_with_strided_head_dim():
    k = torch.zeros(2, 16, 80, 3).transpose(2, 3)  # [2, 16, 3, 80] with stride 3 on head_dim
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        triton_write.write_kv(torch.zeros(1, 3, 80), torch.zeros(1, 3, 80), k, k, torch.tensor([0]))
