"""Compiled Triton kernels vs the torch reference on CUDA; exits non-zero on any mismatch.

Run by test_gpu.py in a fresh interpreter without TRITON_INTERPRET (the kernel tests' conftest sets
it for the whole pytest process). Also runnable by hand: `python tests/kernels/gpu_check.py`.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from paged_cases import TOLERANCE, make_paged, random_query  # noqa: E402

from kernels import reference, triton_attention, triton_decode, triton_prefill, triton_write  # noqa: E402


def _cuda(paged):
    for name in ("k_cache", "v_cache", "block_tables", "context_lens", "slot_mapping"):
        setattr(paged, name, getattr(paged, name).cuda())
    return paged


def check_decode(lens, *, block_size, num_heads, num_kv_heads, head_dim, cache_dtype, num_splits, scales):
    paged = _cuda(make_paged(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             cache_dtype=cache_dtype, k_scale=scales[0], v_scale=scales[1]))
    query = random_query(len(lens), num_heads, head_dim, cache_dtype).cuda()
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5,
            paged.k_scale, paged.v_scale)
    want = reference.decode_attention(*args).float()
    got = triton_decode.decode_attention(*args, num_splits=num_splits).float()
    err = (got - want).abs().max().item()
    return err <= TOLERANCE[cache_dtype] and bool(torch.isfinite(got).all()), err


def check_prefill(start_pos, num_new, *, block_size, num_heads, num_kv_heads, head_dim, cache_dtype):
    paged = _cuda(make_paged([50, start_pos + num_new], block_size=block_size, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, cache_dtype=cache_dtype, k_scale=0.5, v_scale=0.25))
    query = random_query(num_new, num_heads, head_dim, cache_dtype).cuda()
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables[1], start_pos, head_dim**-0.5,
            paged.k_scale, paged.v_scale)
    want = reference.prefill_attention(*args).float()
    got = triton_prefill.prefill_attention(*args).float()
    err = (got - want).abs().max().item()
    return err <= TOLERANCE[cache_dtype] and bool(torch.isfinite(got).all()), err


def check_write(cache_dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    src_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float16
    key = (3 * torch.randn(40, 4, head_dim, generator=gen)).to(src_dtype).cuda()
    value = torch.randn(40, 4, head_dim, generator=gen).to(src_dtype).cuda()
    slots = torch.randperm(8 * block_size, generator=gen)[:40].cuda()
    slots[::7] = -1
    shape = (8, block_size, 4, head_dim)
    want = [torch.zeros(shape).to(cache_dtype).cuda() for _ in range(2)]
    got = [t.clone() for t in want]
    scales = (0.5, 0.25) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    reference.write_kv(key, value, *want, slots, *scales)
    triton_write.write_kv(key, value, *got, slots, *scales)
    same = all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    return same, 0.0


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    dtypes = [torch.float16, torch.bfloat16]
    if torch.cuda.get_device_capability() >= (8, 9):  # Triton's fp8e4nv needs Ada or Hopper
        dtypes.append(torch.float8_e4m3fn)
    results = []
    for dt in dtypes:
        for head_dim in (64, 80, 96, 128):
            for block_size in (16, 32):
                name = f"decode {dt} d={head_dim} bs={block_size}"
                results.append((name, check_decode([1, 37, 1000, 4099], block_size=block_size, num_heads=32,
                                                   num_kv_heads=8, head_dim=head_dim, cache_dtype=dt,
                                                   num_splits=None, scales=(0.5, 0.25))))
                results.append((f"write {dt} d={head_dim} bs={block_size}", check_write(dt, head_dim, block_size)))
                name = f"prefill {dt} d={head_dim} bs={block_size}"
                results.append((name, check_prefill(333, 517, block_size=block_size, num_heads=28, num_kv_heads=4,
                                                    head_dim=head_dim, cache_dtype=dt)))
        results.append((f"prefill {dt} first chunk", check_prefill(0, 512, block_size=16, num_heads=32,
                                                                   num_kv_heads=8, head_dim=128, cache_dtype=dt)))
        for splits in (1, 7, None):
            name = f"decode 32k {dt} splits={splits}"
            results.append((name, check_decode([32768, 5], block_size=16, num_heads=28, num_kv_heads=4,
                                               head_dim=128, cache_dtype=dt, num_splits=splits, scales=(1.0, 1.0))))
    # the facade the engine gets
    assert triton_attention.decode_attention is not reference.decode_attention
    failed = 0
    for name, (ok, err) in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}  max abs err {err:.2e}")
        failed += not ok
    print(f"{len(results) - failed}/{len(results)} passed on {torch.cuda.get_device_name()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
