"""Decode attention bandwidth and prefill throughput of the Triton paged kernels on a GPU.

    python bench/gpu_kernels.py [--dry-run] [--out DIR] [--dtype bf16 fp8] [--tokens 4096 32768 131072]
                                [--batch 1 16] [--peak-tbps 4.8] [--tile 64] [--no-reference] [--no-prefill]

Decode: one layer's step for batch 1 and 16 at 4k, 32k and 128k tokens, a Llama-3-8B-shaped layer
(32 query heads, 8 KV heads, head_dim 128) by default, block size 16, each sequence's blocks scattered
through the pool. Bandwidth is the K/V bytes the step must read divided by its time, as a fraction of
the device's peak HBM bandwidth (datasheet: H200 4.8 TB/s; --peak-tbps overrides) and of a measured
device-to-device copy (read + written bytes, the practical ceiling). Beside it: SDPA on the same K/V laid
out contiguously (16-bit: fp8 has no SDPA path) and the torch reference (up to 32k tokens; past that it
takes seconds). Then prefill: one 512-token chunk after 0 .. tokens-512 cached tokens, Triton vs the
reference, in TFLOP/s of the causal work. Timing is triton.testing.do_bench's median (it flushes the L2
between calls). Target: decode >= 60% of peak at 32k tokens, batch 16. About a minute on an H200.

Writes gpu_kernels.json and gpu_kernels.md to the output folder ($OUT, else bench/out/gpu).

--dry-run (no GPU): the same code on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1) at
tiny sizes (4 heads / 2 KV heads, head_dim 32, up to 1,100 tokens, split-K chosen as for 132 SMs), timed
with a wall clock: it checks the code paths, the errors against SDPA and the output, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from gpu_plan_check import environment, output_dir, write_results  # noqa: E402

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
CACHE_DTYPES = ("fp16", "bf16", "fp8")
TARGET = {"batch": 16, "tokens": 32768, "fraction": 0.60}  # the issue's decode target
MAX_REFERENCE_TOKENS = 32768
PREFILL_CHUNK = 512
DRY = dict(num_heads=4, num_kv_heads=2, head_dim=32, tokens=[64, 1100], batch=[1, 2], chunk=32, num_sms=132)
RESULT_NAME = "gpu_kernels"


def peak_tbps(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, value in PEAK_TBPS.items():  # most specific first
        if key in name:
            return value
    return None


def cache_dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[name]


def query_dtype(cache):
    # The engine's queries are the model's dtype; the 1.5B model is bf16, so fp8 caches are read by bf16 queries.
    import torch

    return torch.float16 if cache == torch.float16 else torch.bfloat16


def make_inputs(batch, num_tokens, *, num_heads, num_kv_heads, head_dim, block_size, cache, device):
    """A paged cache with each sequence's blocks scattered through the pool, and the same K/V contiguous."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    act = query_dtype(cache)
    blocks_per_seq = -(-num_tokens // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, generator=gen).to(cache)
    v_cache = torch.randn(shape, device=device, generator=gen).to(cache)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), num_tokens, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, device=device, generator=gen).to(act)

    def contiguous(c):  # [batch, num_kv_heads, num_tokens, head_dim], what SDPA wants
        # gathered as bytes: indexing has no float8 kernel everywhere
        rows = c.view(torch.uint8)[block_tables.long()].view(c.dtype).to(act)  # [batch, blocks, block_size, kvh, d]
        return rows.flatten(1, 2)[:, :num_tokens].transpose(1, 2).contiguous()

    return query, k_cache, v_cache, block_tables, context_lens, contiguous(k_cache), contiguous(v_cache)


def sdpa_decode(query, k, v, scale):
    # GQA without repeating K/V: the group of query heads becomes the query length (non-causal).
    import torch

    batch, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[1]
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def make_timer(dry_run: bool):
    """seconds(fn): do_bench's median on a GPU; one wall-clock call in a dry run (the interpreter is slow, and
    its times mean nothing; each kernel has already run once for its error)."""
    if not dry_run:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3

    def wall(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return wall


def copy_tbps(seconds, device, dry_run: bool) -> float:
    """A device-to-device copy's bytes read + written per second: the bandwidth a kernel can really reach."""
    import torch

    n = (64 << 20) if dry_run else (4 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = seconds(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / t / 1e12


def bench_decode(args, shape, seconds, device, num_sms, peak, copy) -> list[dict]:
    import torch

    from stowage.kernels import reference, triton_decode

    rows = []
    scale = shape["head_dim"] ** -0.5
    for dtype_name in args.dtype:
        cache = cache_dtype(dtype_name)
        if cache == torch.float8_e4m3fn and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            print(f"{dtype_name}: skipped, Triton's float8_e4m3fn needs compute capability 8.9+")
            continue
        for batch in args.batch:
            for num_tokens in args.tokens:
                query, k_cache, v_cache, tables, lens, k, v = make_inputs(
                    batch, num_tokens, block_size=args.block_size, cache=cache, device=device,
                    **{key: shape[key] for key in ("num_heads", "num_kv_heads", "head_dim")})
                kv_bytes = 2 * batch * num_tokens * shape["num_kv_heads"] * shape["head_dim"] * cache.itemsize
                max_ctx = tables.shape[1] * args.block_size
                splits = triton_decode.choose_num_splits(batch, shape["num_kv_heads"], max_ctx, num_sms)

                def run_triton():
                    return triton_decode.decode_attention(query, k_cache, v_cache, tables, lens, scale, num_splits=splits)

                err = (run_triton().float() - sdpa_decode(query, k, v, scale).float()).abs().max().item()
                t_triton = seconds(run_triton)
                sdpa_bytes = kv_bytes * 2 // cache.itemsize  # SDPA reads the 16-bit copy
                t_sdpa = seconds(lambda: sdpa_decode(query, k, v, scale))
                t_ref = None
                if not args.no_reference and num_tokens <= MAX_REFERENCE_TOKENS:
                    t_ref = seconds(lambda: reference.decode_attention(query, k_cache, v_cache, tables, lens, scale))
                tbps = kv_bytes / t_triton / 1e12
                rows.append({"cache": dtype_name, "batch": batch, "tokens": num_tokens, "splits": splits,
                             "kv_bytes": kv_bytes, "triton_us": t_triton * 1e6, "triton_tbps": tbps,
                             "triton_of_peak": tbps / peak if peak else None, "triton_of_copy": tbps / copy,
                             "sdpa_us": t_sdpa * 1e6, "sdpa_of_peak": sdpa_bytes / t_sdpa / 1e12 / peak if peak else None,
                             "reference_us": t_ref * 1e6 if t_ref is not None else None, "max_abs_err_vs_sdpa": err})
                print(_decode_line(rows[-1]), flush=True)
                del query, k_cache, v_cache, k, v
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def bench_prefill(args, shape, seconds, device, chunk) -> list[dict]:
    """A chunk after 0 and after tokens - chunk cached tokens: Triton vs the reference (gather, then fp32 tiles)."""
    import torch

    from stowage.kernels import reference, triton_prefill

    rows = []
    scale = shape["head_dim"] ** -0.5
    heads = shape["num_heads"]
    for dtype_name in args.dtype:
        cache = cache_dtype(dtype_name)
        if cache == torch.float8_e4m3fn and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            continue
        for num_tokens in sorted({chunk, *args.tokens}):
            _, k_cache, v_cache, tables, _, _, _ = make_inputs(
                1, num_tokens, block_size=args.block_size, cache=cache, device=device,
                **{key: shape[key] for key in ("num_heads", "num_kv_heads", "head_dim")})
            query = torch.randn(chunk, heads, shape["head_dim"], device=device).to(query_dtype(cache))
            start = num_tokens - chunk
            call = (query, k_cache, v_cache, tables[0], start, scale)
            err = (triton_prefill.prefill_attention(*call).float() - reference.prefill_attention(*call).float())
            t_triton = seconds(lambda: triton_prefill.prefill_attention(*call))
            t_ref = None
            if not args.no_reference and num_tokens <= MAX_REFERENCE_TOKENS:
                t_ref = seconds(lambda: reference.prefill_attention(*call))
            # each query attends to start + its index + 1 keys; 2 matmuls of 2 flops per multiply-add
            keys = chunk * start + chunk * (chunk + 1) / 2
            flops = 4 * heads * shape["head_dim"] * keys
            rows.append({"cache": dtype_name, "context": num_tokens, "chunk": chunk, "triton_us": t_triton * 1e6,
                         "triton_tflops": flops / t_triton / 1e12,
                         "reference_us": t_ref * 1e6 if t_ref is not None else None,
                         "reference_tflops": flops / t_ref / 1e12 if t_ref else None,
                         "max_abs_err_vs_reference": err.abs().max().item()})
            print(_prefill_line(rows[-1]), flush=True)
            del k_cache, v_cache
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _f(x, fmt) -> str:
    return "—" if x is None else format(x, fmt)


def _decode_line(r: dict) -> str:
    return (f"| {r['cache']} | {r['batch']} | {r['tokens']:,} | {r['splits']} | {r['kv_bytes'] / 2**20:,.1f} "
            f"| {r['triton_us']:,.1f} | {r['triton_tbps']:.2f} | {_f(r['triton_of_peak'], '.1%')} | {r['triton_of_copy']:.1%} "
            f"| {r['sdpa_us']:,.1f} | {_f(r['sdpa_of_peak'], '.1%')} | {_f(r['reference_us'], ',.1f')} "
            f"| {r['max_abs_err_vs_sdpa']:.1e} |")


def _prefill_line(r: dict) -> str:
    return (f"| {r['cache']} | {r['context']:,} | {r['chunk']} | {r['triton_us']:,.1f} | {r['triton_tflops']:.1f} "
            f"| {_f(r['reference_us'], ',.1f')} | {_f(r['reference_tflops'], '.1f')} | {r['max_abs_err_vs_reference']:.1e} |")


def target_verdict(decode: list[dict]) -> str:
    hits = [r for r in decode if r["batch"] == TARGET["batch"] and r["tokens"] == TARGET["tokens"] and r["triton_of_peak"]]
    if not hits:
        return f"Target (decode ≥ {TARGET['fraction']:.0%} of peak at {TARGET['tokens']:,} tokens, batch {TARGET['batch']}): not measured."
    return f"Target (decode ≥ {TARGET['fraction']:.0%} of peak at {TARGET['tokens']:,} tokens, batch {TARGET['batch']}): " + \
        ", ".join(f"{r['cache']} {r['triton_of_peak']:.1%} {'met' if r['triton_of_peak'] >= TARGET['fraction'] else '**not met**'}"
                  for r in hits) + "."


def report(record: dict) -> str:
    env, dry, s = record["environment"], record["mode"] == "dry-run", record["shape"]
    lines = [f"### Paged attention kernels (`bench/gpu_kernels.py`{' --dry-run' if dry else ''})", "",
             f"{env['date']}, Stowage at {env['commit']}; {record['device']}, {record['num_sms']} SMs, peak "
             f"{_f(record['peak_tbps'], '.2f')} TB/s (datasheet), device copy {record['copy_tbps']:.2f} TB/s (measured); "
             f"torch {env['torch']}, triton {env['triton']}. One layer: {s['num_heads']} query heads, {s['num_kv_heads']} "
             f"KV heads, head_dim {s['head_dim']}, block size {record['block_size']}, tile {record['tile']} tokens."
             + (" **Dry run: Triton's interpreter on the CPU, wall-clock times; the numbers say nothing of a GPU.**" if dry else ""),
             "", "Decode (one query token per sequence; TB/s = K/V bytes read / time):", "",
             "| cache | batch | tokens | splits | KV MiB | Triton µs | TB/s | of peak | of copy | SDPA µs | SDPA of peak "
             "| reference µs | max err vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_decode_line(r) for r in record["decode"]]
    if record["prefill"]:
        lines += ["", f"Prefill (one {record['prefill'][0]['chunk']}-token chunk at the end of the context; TFLOP/s of the causal work):",
                  "", "| cache | context | chunk | Triton µs | TFLOP/s | reference µs | TFLOP/s | max err |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [_prefill_line(r) for r in record["prefill"]]
    lines += ["", target_verdict(record["decode"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: tiny sizes through Triton's interpreter")
    parser.add_argument("--out", type=Path, help="output folder (default: $OUT, else bench/out/gpu)")
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp8"], choices=CACHE_DTYPES)
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 32768, 131072])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-tbps", type=float, default=None, help="the device's peak memory bandwidth, TB/s")
    parser.add_argument("--tile", type=int, default=None, help="tokens per inner step of the Triton decode kernel")
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference")
    parser.add_argument("--no-prefill", action="store_true", help="time decode only")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (they decorate at import)
        args.tokens, args.batch = DRY["tokens"], DRY["batch"]
        shape = {k: DRY[k] for k in ("num_heads", "num_kv_heads", "head_dim")}
    else:
        shape = {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim}

    import torch

    if not args.dry_run and not (torch.version.cuda and torch.cuda.is_available()):
        print("bench/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False; run with --dry-run to check "
              "the code on the CPU); the kernels' correctness is tested on the CPU by tests/kernels.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("bench/gpu_kernels.py needs triton: pip install 'stowage[triton]'", file=sys.stderr)
        return 2
    from stowage.kernels import triton_decode

    if args.tile:
        triton_decode.TILE_TOKENS = args.tile
    out_dir = output_dir(args.out)
    if args.dry_run:
        device, name, num_sms, peak = "cpu", "CPU (Triton interpreter)", DRY["num_sms"], None
    else:
        device, name = "cuda", torch.cuda.get_device_name()
        num_sms, peak = torch.cuda.get_device_properties(0).multi_processor_count, peak_tbps(name, args.peak_tbps)
    seconds = make_timer(args.dry_run)
    copy = copy_tbps(seconds, device, args.dry_run)
    print(f"device: {name}, {num_sms} SMs, peak {_f(peak, '.2f')} TB/s, copy {copy:.2f} TB/s; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    record = {"mode": "dry-run" if args.dry_run else "gpu", "environment": environment(), "device": name,
              "num_sms": num_sms, "peak_tbps": peak, "copy_tbps": copy, "shape": shape, "block_size": args.block_size,
              "tile": triton_decode.TILE_TOKENS, "decode": [], "prefill": []}
    record["decode"] = bench_decode(args, shape, seconds, device, num_sms, peak, copy)
    write_results(out_dir, RESULT_NAME, record, report(record))  # decode survives a prefill that hangs
    if not args.no_prefill:
        record["prefill"] = bench_prefill(args, shape, seconds, device, DRY["chunk"] if args.dry_run else PREFILL_CHUNK)
    text = report(record)
    write_results(out_dir, RESULT_NAME, record, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
