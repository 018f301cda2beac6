"""Decode attention on a GPU: Triton paged kernel vs the torch reference vs SDPA on a contiguous cache.

Then prefill of one 512-token chunk at the same context lengths: Triton vs the reference.

    python bench/gpu_kernels.py [--dtype fp16 fp8] [--peak-tbps 4.8] [--tile 64]

Per layer, one decode step: batch 1 and 16 at 1k, 8k and 32k tokens, a Llama-3-8B-shaped layer
(32 query heads, 8 KV heads, head_dim 128) by default. Bandwidth is the K/V bytes the step must read
divided by its time; the fraction is of the device's peak HBM bandwidth (known for common GPUs,
or given with --peak-tbps). Timing is triton.testing.do_bench's median, which flushes the L2
between runs so that small caches are not served from it. Runs in well under 5 minutes on an H100.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# Peak HBM bandwidth in TB/s by (a substring of) torch.cuda.get_device_name(), from the datasheets.
PEAK_TBPS = {
    "H200": 4.8,
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "H100": 3.35,
    "A100-SXM4-80GB": 2.039,
    "A100 80GB PCIe": 1.935,
    "A100": 1.555,
    "L40S": 0.864,
    "RTX 4090": 1.008,
    "RTX 3090": 0.936,
}
CACHE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def peak_tbps(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, value in PEAK_TBPS.items():  # most specific first
        if key in name:
            return value
    return None


def make_inputs(batch, num_tokens, *, num_heads, num_kv_heads, head_dim, block_size, cache_dtype):
    """A paged cache with each sequence's blocks scattered through the pool, and the same K/V contiguous."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    act = torch.float16 if cache_dtype != torch.bfloat16 else torch.bfloat16
    blocks_per_seq = -(-num_tokens // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, device="cuda", generator=gen).to(cache_dtype)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), num_tokens, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_heads, head_dim, device="cuda", generator=gen).to(act)

    def contiguous(cache):  # [batch, num_kv_heads, num_tokens, head_dim], what SDPA wants
        rows = cache[block_tables.long()].to(act)  # [batch, blocks, block_size, kvh, d]
        return rows.flatten(1, 2)[:, :num_tokens].transpose(1, 2).contiguous()

    return query, k_cache, v_cache, block_tables, context_lens, contiguous(k_cache), contiguous(v_cache)


def sdpa_decode(query, k, v, scale):
    # GQA without repeating K/V: the group of query heads becomes the query length (non-causal).
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[1]
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["fp16", "fp8"], choices=sorted(CACHE_DTYPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192, 32768])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-tbps", type=float, default=None, help="the device's peak memory bandwidth, TB/s")
    parser.add_argument("--tile", type=int, default=None, help="tokens per inner step of the Triton kernel")
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference")
    parser.add_argument("--no-prefill", action="store_true", help="time decode only")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the kernels' correctness is tested on the CPU by tests/kernels instead.", file=sys.stderr)
        return 2
    try:
        import triton.testing
    except ImportError:
        print("bench/gpu_kernels.py needs triton: pip install 'stowage[triton]'", file=sys.stderr)
        return 2
    from kernels import reference, triton_attention, triton_decode

    if args.tile:
        triton_decode.TILE_TOKENS = args.tile
    name = torch.cuda.get_device_name()
    peak = peak_tbps(name, args.peak_tbps)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {name}, {num_sms} SMs, peak HBM {peak if peak else '?'} TB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print(f"layer: {args.num_heads} query heads, {args.num_kv_heads} KV heads, head_dim {args.head_dim}, "
          f"block size {args.block_size}, tile {triton_decode.TILE_TOKENS} tokens")
    header = (f"{'cache':>5} {'batch':>5} {'tokens':>6} {'splits':>6} {'KV MiB':>7} | {'triton us':>9} "
              f"{'TB/s':>5} {'%peak':>5} | {'sdpa us':>8} {'%peak':>5} | {'ref us':>8} | {'max err':>7}")
    print(header)
    print("-" * len(header))
    scale = args.head_dim**-0.5
    for dtype_name in args.dtype:
        cache_dtype = CACHE_DTYPES[dtype_name]
        if cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            print(f"{dtype_name}: skipped, Triton's float8_e4m3fn needs compute capability 8.9+")
            continue
        for batch in args.batch:
            for num_tokens in args.tokens:
                query, k_cache, v_cache, tables, lens, k, v = make_inputs(
                    batch, num_tokens, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim, block_size=args.block_size, cache_dtype=cache_dtype)
                kv_bytes = 2 * batch * num_tokens * args.num_kv_heads * args.head_dim * cache_dtype.itemsize
                max_ctx = tables.shape[1] * args.block_size
                splits = triton_decode.choose_num_splits(batch, args.num_kv_heads, max_ctx, num_sms)

                def run_triton():
                    return triton_attention.decode_attention(query, k_cache, v_cache, tables, lens, scale)

                got = run_triton()
                want = sdpa_decode(query, k, v, scale)
                err = (got.float() - want.float()).abs().max().item()
                t_triton = triton.testing.do_bench(run_triton, return_mode="median") * 1e-3
                # SDPA reads 16-bit K/V (fp8 has no SDPA path): its bytes are those of a 16-bit cache.
                sdpa_bytes = kv_bytes * 2 // cache_dtype.itemsize
                t_sdpa = triton.testing.do_bench(lambda: sdpa_decode(query, k, v, scale), return_mode="median") * 1e-3
                t_ref = float("nan")
                if not args.no_reference:
                    t_ref = triton.testing.do_bench(
                        lambda: reference.decode_attention(query, k_cache, v_cache, tables, lens, scale),
                        warmup=5, rep=50, return_mode="median") * 1e-3
                tbps = kv_bytes / t_triton / 1e12
                frac = f"{100 * tbps / peak:5.1f}" if peak else "    ?"
                frac_sdpa = f"{100 * sdpa_bytes / t_sdpa / 1e12 / peak:5.1f}" if peak else "    ?"
                print(f"{dtype_name:>5} {batch:>5} {num_tokens:>6} {splits:>6} {kv_bytes / 2**20:>7.1f} | "
                      f"{t_triton * 1e6:>9.1f} {tbps:>5.2f} {frac} | {t_sdpa * 1e6:>8.1f} {frac_sdpa} | "
                      f"{t_ref * 1e6:>8.1f} | {err:>7.1e}")
                del query, k_cache, v_cache, k, v
                torch.cuda.empty_cache()
    if not args.no_prefill:
        bench_prefill(args, triton.testing.do_bench, reference, triton_attention)
    return 0


def bench_prefill(args, do_bench, reference, triton_attention) -> None:
    """A 512-token chunk after 0 and after num_tokens - 512 cached tokens: Triton vs gather + SDPA."""
    chunk = 512
    print(f"\nprefill, one sequence, chunk {chunk} (TFLOP/s counts the causal half of QK^T and PV)")
    header = f"{'cache':>5} {'context':>7} | {'triton us':>9} {'TFLOP/s':>7} | {'ref us':>8} {'TFLOP/s':>7} | {'max err':>7}"
    print(header)
    print("-" * len(header))
    scale = args.head_dim**-0.5
    for dtype_name in args.dtype:
        cache_dtype = CACHE_DTYPES[dtype_name]
        if cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            continue
        for num_tokens in sorted({chunk, *args.tokens}):
            _, k_cache, v_cache, tables, _, _, _ = make_inputs(
                1, num_tokens, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim, block_size=args.block_size, cache_dtype=cache_dtype)
            act = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float16
            query = torch.randn(chunk, args.num_heads, args.head_dim, device="cuda").to(act)
            start = num_tokens - chunk
            call = (query, k_cache, v_cache, tables[0], start, scale)
            err = (triton_attention.prefill_attention(*call).float() - reference.prefill_attention(*call).float())
            t_triton = do_bench(lambda: triton_attention.prefill_attention(*call), return_mode="median") * 1e-3
            t_ref = do_bench(lambda: reference.prefill_attention(*call), return_mode="median") * 1e-3
            # each query attends to start + its index + 1 keys; 2 matmuls of 2 flops per multiply-add
            keys = chunk * start + chunk * (chunk + 1) / 2
            flops = 4 * args.num_heads * args.head_dim * keys
            print(f"{dtype_name:>5} {num_tokens:>7} | {t_triton * 1e6:>9.1f} {flops / t_triton / 1e12:>7.1f} | "
                  f"{t_ref * 1e6:>8.1f} {flops / t_ref / 1e12:>7.1f} | {err.abs().max().item():>7.1e}")
            del k_cache, v_cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
