"""Compiled Triton kernels vs the torch reference on CUDA; exits non-zero on any mismatch.

Run by test_gpu.py in fresh interpreters without TRITON_INTERPRET (the kernel tests' conftest sets
it for the whole pytest process), in parts that compile their kernels in parallel. Also runnable by
hand: `python tests/kernels/gpu_check.py [--part K/N] [--list]`.

Cases are grouped by what Triton compiles separately (cache dtype, head_dim, block size); a part takes
whole groups, so no two parts compile the same kernel. `--list` prints every case as "K/N name" (the
part of N that runs it, N from --part) without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from paged_cases import TOLERANCE, make_paged, random_query  # noqa: E402

from stowage.kernels import reference  # noqa: E402

FP16, BF16, FP8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn


def _cuda(paged):
    for name in ("k_cache", "v_cache", "block_tables", "context_lens", "slot_mapping"):
        setattr(paged, name, getattr(paged, name).cuda())
    return paged


def check_decode(lens, *, block_size, num_heads, num_kv_heads, head_dim, cache_dtype, num_splits, scales):
    from stowage.kernels import triton_decode

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
    from stowage.kernels import triton_prefill

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
    from stowage.kernels import triton_write

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


def cases(with_fp8: bool) -> list[tuple[str, str, partial]]:
    """(compile group, name, check) for every case; fp8 needs compute capability 8.9+ (Ada, Hopper)."""
    out = []
    for dt in [FP16, BF16] + ([FP8] if with_fp8 else []):
        for head_dim in (64, 80, 96, 128):
            for block_size in (16, 32):
                group = f"{dt} d={head_dim} bs={block_size}"
                out.append((group, f"decode {group}", partial(
                    check_decode, [1, 37, 1000, 4099], block_size=block_size, num_heads=32, num_kv_heads=8,
                    head_dim=head_dim, cache_dtype=dt, num_splits=None, scales=(0.5, 0.25))))
                out.append((group, f"write {group}", partial(check_write, dt, head_dim, block_size)))
                out.append((group, f"prefill {group}", partial(
                    check_prefill, 333, 517, block_size=block_size, num_heads=28, num_kv_heads=4,
                    head_dim=head_dim, cache_dtype=dt)))
        group = f"{dt} d=128 bs=16"
        out.append((group, f"prefill {dt} first chunk", partial(
            check_prefill, 0, 512, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, cache_dtype=dt)))
        for splits in (1, 7, None):
            out.append((group, f"decode 32k {dt} splits={splits}", partial(
                check_decode, [32768, 5], block_size=16, num_heads=28, num_kv_heads=4, head_dim=128,
                cache_dtype=dt, num_splits=splits, scales=(1.0, 1.0))))
    return out


def part(all_cases: list, index: int, num_parts: int) -> list:
    """The cases of part `index` of `num_parts`: whole compile groups, the largest first onto the part with fewest cases."""
    sizes: dict[str, int] = {}
    for group, _, _ in all_cases:
        sizes[group] = sizes.get(group, 0) + 1
    loads, owner = [0] * num_parts, {}
    for group in sorted(sizes, key=lambda g: -sizes[g]):  # stable: ties keep the listing order
        k = loads.index(min(loads))
        owner[group], loads[k] = k, loads[k] + sizes[group]
    return [c for c in all_cases if owner[c[0]] == index]


def _part_arg(text: str) -> tuple[int, int]:
    index, num_parts = (int(x) for x in text.split("/"))
    if not 0 <= index < num_parts:
        raise argparse.ArgumentTypeError(f"--part K/N needs 0 <= K < N, got {text}")
    return index, num_parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", type=_part_arg, default=(0, 1), help="run part K of N (0-based), e.g. 2/4")
    parser.add_argument("--list", action="store_true", help="print 'K/N name' for every case and exit (no GPU needed)")
    args = parser.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    with_fp8 = torch.cuda.get_device_capability() >= (8, 9) if has_cuda else True
    all_cases = cases(with_fp8)
    index, num_parts = args.part
    if args.list:
        for k in range(num_parts):
            print("\n".join(f"{k}/{num_parts} {name}" for _, name, _ in part(all_cases, k, num_parts)))
        return 0
    selected = part(all_cases, index, num_parts)
    if not has_cuda:
        print("no CUDA device: nothing to check")
        return 2
    from stowage.kernels import triton_attention

    # the facade the engine gets is the Triton one
    assert triton_attention.decode_attention is not reference.decode_attention
    failed = 0
    for _, name, check in selected:
        ok, err = check()
        print(f"{'ok  ' if ok else 'FAIL'} {name}  max abs err {err:.2e}", flush=True)
        failed += not ok
    print(f"{len(selected) - failed}/{len(selected)} passed on {torch.cuda.get_device_name()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
