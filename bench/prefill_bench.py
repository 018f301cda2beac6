"""CPU prefill of bf16 weights with and without widened fp32 tiles (kernels/cpu_matmul.py), beside transformers.

    .venv/bin/python bench/prefill_bench.py [--shapes 135m,360m] [--threads 1,2] [--runs 3] [--write-docs]

torch multiplies bf16 at speed only with AVX512-BF16 or AMX; most desktop CPUs have neither. To measure that
case on any x86 machine, the "AVX2" rows hold torch (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) and
Stowage's kernels (STOWAGE_DECODE_ISA=avx2) to AVX2, for every engine alike; the "this CPU" rows run as found.
Stowage runs with the widened tiles on and off (STOWAGE_WIDEN_MATMUL=1/0); transformers is the peer. Each
figure is the prefill tok/s of a 512-token prompt, the median of --runs fresh processes (decode_bench.py's
workers). llama.cpp is not in this table: its CPU backend picks its instructions where it was built.

`--gguf FILE,...` (issue 32): cold prefill of quantized GGUF files, Stowage against llama.cpp on the same file:

    .venv/bin/python bench/prefill_bench.py --gguf A.gguf,B.gguf [--requantize q8_0] [--shape 1.7b] [--prompt 721]
        [--threads 1,2] [--runs 3] [--write-docs]

`--requantize Q` adds the first file requantized to Q by llama.cpp (llama_model_quantize, requantizing allowed);
`--shape S` adds a random-weight Llama of that shape (bench/common.py) quantized to Q4_K_M by llama.cpp. Each run is
a fresh process per side, the sides alternating; Stowage's KV store is an empty folder (STOWAGE_KV_DIR, no disk
budget) and its prefix pool is cleared, llama.cpp's context reset, so nothing of the prompt is read back. The prompt
is token ids (no tokenizer in the timing), prefilled in chunks of 512 on both sides (PREFILL_CHUNK, n_batch), then
DECODE greedy tokens. Figures: prefill and decode tok/s, medians; ratios Stowage / llama.cpp.

`--kernels [--runs 7]`: the int8 prefill products (kernels/cpu_quant_matmul.py) alone against the float32 tiles, one
thread, GFLOP/s of CPU time on the bench files' matrix shapes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402

DECODE_BENCH = HERE.parent / "decode_bench.py"
GGUF_BENCH_DECODE = 16  # decode tokens after the GGUF prompt: enough for a rate, short beside the prefill
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "STOWAGE_DECODE_ISA": "avx2"}
PROMPT = 512


def prefill(backend: str, model_dir: Path, threads: int, runs: int, env: dict[str, str]) -> float:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = ["--worker", backend, "--path", str(model_dir), "--threads", str(threads), "--prompt", str(PROMPT),
                "--decode", "4"]
        return common.medians([common.run_worker(DECODE_BENCH, args, threads=threads, timeout=1800)
                               for _ in range(runs)])["prefill_tok_s"]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --kernels: one product of a 512-token chunk per matrix, the shapes of the bench files (135m, Gemma 3 270M, 1.7b)
KERNEL_CASES = [("q4_1", 1536, 576), ("q4_1", 576, 1536), ("q8_0", 1536, 576), ("q5_0", 2048, 640),
                ("q4_k", 640, 1024), ("q6_k", 640, 2048), ("q4_k", 8192, 2048), ("q6_k", 2048, 8192)]


def kernels_main(args) -> None:
    """GFLOP/s of one thread's CPU time (process_time: a busy machine's waits not counted), int8 tiles against the
    float32 tiles of kernels/quant_linear.py, medians of --runs calls."""
    import torch

    sys.path.insert(0, str(common.ROOT / "tests" / "kernels"))
    from quant_blocks import random_blocks

    from stowage.kernels import cpu_decode, cpu_quant_matmul
    from stowage.kernels.quant_linear import QuantizedWeight

    common.set_threads(1)
    print(f"load average before: {common.load_average()}; int8 level: {cpu_decode.selected_isa()}")
    print("| type | rows x cols | int8 tiles GFLOP/s | float32 tiles GFLOP/s | ratio |\n|---|---|---|---|---|")
    for type_name, rows, cols in KERNEL_CASES:
        raw = torch.from_numpy(random_blocks(type_name, (rows, cols), seed=1))
        x = torch.randn(PROMPT, cols)
        weight = QuantizedWeight(raw, type_name, (rows, cols), torch.float32)  # float32: the tiles

        def cpu_seconds(f):
            f()
            times = []
            for _ in range(args.runs):
                start = time.process_time()
                f()
                times.append(time.process_time() - start)
            return sorted(times)[len(times) // 2]

        flops = 2 * rows * cols * PROMPT
        native = flops / cpu_seconds(lambda: cpu_quant_matmul.matmul(raw, type_name, x)) / 1e9
        tiles = flops / cpu_seconds(lambda: weight.linear(x)) / 1e9
        print(f"| {type_name} | {rows} x {cols} | {native:.0f} | {tiles:.0f} | {native / tiles:.1f}x |", flush=True)
    print(f"load average after: {common.load_average()}")


def gguf_prompt(num_tokens: int, vocab: int, seed: int) -> list[int]:
    return [(7919 * i + 13 + seed) % (vocab - 20) + 10 for i in range(num_tokens)]  # past the special ids


def work_gguf_stowage(path: Path, threads: int, prompt: int, torch_threads: int | None = None) -> dict:
    import tempfile

    os.environ["STOWAGE_KV_DIR"] = tempfile.mkdtemp(prefix="kv-cold-")  # empty: nothing read back from disk
    from stowage.engine.planning import plan_for
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.sampler import SamplingParams
    from stowage.kernels import cpu_decode, cpu_quant_matmul

    common.set_threads(threads)
    if torch_threads:  # torch's own ops (norms, activations, rotary) on fewer threads than the native pool's
        import torch

        torch.set_num_threads(torch_threads)
    engine = Engine.load(path, plan_for(path, prompt + GGUF_BENCH_DECODE + 32, kv_disk_budget=0))
    engine.eos_ids = set()
    vocab = engine.config.vocab_size

    def generate(ids, max_tokens):
        engine.pool.clear()  # nothing cached: the whole prompt is prefilled
        reply = engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
        start, first = time.process_time(), None
        for _ in reply:
            first = first or time.process_time() - start  # the process's CPU time (every thread) to the first token
        return reply.result, first

    generate(gguf_prompt(24, vocab, 1), 2)  # warm-up: the native kernels built and loaded
    r, cpu_s = generate(gguf_prompt(prompt, vocab, 0), GGUF_BENCH_DECODE)
    return {"prefill_tok_s": r.prefill_tokens_per_s, "decode_tok_s": r.decode_tokens_per_s, "prefill_cpu_s": cpu_s,
            "prefill_kernels": f"int8 {cpu_decode.selected_isa()}" if cpu_quant_matmul.is_available() else "tiles"}


def work_gguf_llama(path: Path, threads: int, prompt: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=prompt + GGUF_BENCH_DECODE + 32, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, use_mmap=True, verbose=False)
    vocab = llm.n_vocab()

    def generate(ids, max_tokens):
        llm.reset()  # nothing reused
        times, start, cpu_start, cpu_s = [], time.perf_counter(), time.process_time(), None
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            cpu_s = cpu_s or time.process_time() - cpu_start
            if len(times) == max_tokens:
                break
        return start, times, cpu_s

    generate(gguf_prompt(24, vocab, 1), 2)
    start, times, cpu_s = generate(gguf_prompt(prompt, vocab, 0), GGUF_BENCH_DECODE)
    return {"prefill_tok_s": prompt / (times[0] - start), "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "prefill_cpu_s": cpu_s,
            "llama_cpp": llama_cpp.__version__}


def gguf_files(args) -> list[Path]:
    """The files to compare: those named, the first requantized, and a random one of --shape quantized to Q4_K_M."""
    import gguf_bench

    files = [Path(f) for f in args.gguf.split(",") if f]
    out = args.workdir / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    if args.requantize:
        import llama_cpp

        source = files[0]
        target = out / f"{source.stem}.requantized.{args.requantize}.gguf"
        if not target.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.requantize.upper()}")
            params.allow_requantize = True
            params.nthread = 2
            if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
                raise RuntimeError(f"llama.cpp could not requantize {source} to {args.requantize}")
        files.append(target)
    if args.shape:
        files.append(gguf_bench.quantized(gguf_bench.float_gguf(args.shape, out), "Q4_K_M"))
    return files


def gguf_main(args, argv) -> None:
    began, load = time.time(), common.load_average()
    rows = []
    for path in gguf_files(args):
        path.read_bytes()  # into the page cache: both sides map a warm file
        for threads in (int(t) for t in args.threads.split(",")):
            got = {"stowage": [], "llama_cpp": []}
            for _ in range(args.runs):  # alternating: a change in the machine's load touches both sides alike
                for side in got:
                    extra = ["--torch-threads", str(args.torch_threads)] if side == "stowage" and args.torch_threads \
                        else []
                    got[side].append(common.run_worker(HERE, ["--worker", side, "--path", str(path), "--threads",
                                                              str(threads), "--prompt", str(args.prompt), *extra],
                                                       threads=threads, timeout=3600))
            s, ll = common.medians(got["stowage"]), common.medians(got["llama_cpp"])
            rows.append(f"| {path.name} | {threads} | {args.prompt:,} | {s['prefill_tok_s']:,.0f} | "
                        f"{ll['prefill_tok_s']:,.0f} | **{s['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x** | "
                        f"{ll['prefill_cpu_s'] / s['prefill_cpu_s']:.2f}x | "
                        f"{s['decode_tok_s']:.1f} | {ll['decode_tok_s']:.1f} | "
                        f"**{s['decode_tok_s'] / ll['decode_tok_s']:.2f}x** |")
            print(rows[-1], f"(load {common.load_average()})", flush=True)
    engine, source = common.source_state()
    body = "\n".join([
        f"`.venv/bin/python bench/prefill_bench.py {' '.join(argv)}` on {datetime.date.today()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, load average before: {load}, after: {common.load_average()}; "
        f"engine {engine} (source {source}); Stowage's prefill products: {s['prefill_kernels']}; llama-cpp-python "
        f"{ll['llama_cpp']}. Cold prefill (empty KV store, nothing reused) of a {args.prompt:,}-token prompt of token "
        f"ids, then {GGUF_BENCH_DECODE} greedy tokens; medians of {args.runs} fresh processes per side, the sides "
        "alternating; the same GGUF file in both engines" + (
            f"; Stowage's torch ops on {args.torch_threads} thread(s) (--torch-threads), its native pool on the row's"
            if args.torch_threads else "") + ". \"By CPU time\": the prefill's rate in the process's CPU "
        "time (every thread, to the first token), a ratio a busy machine's waits do not enter at 1 thread; at 2 it "
        "counts each engine's spinning threads too.",
        "",
        "| file | threads | prompt | Stowage prefill tok/s | llama.cpp | Stowage / llama.cpp | by CPU time | "
        "Stowage decode tok/s | llama.cpp | Stowage / llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows, "",
        f"The run took {round((time.time() - began) / 60)} minutes."])
    print(body)
    if args.write_docs:
        common.write_section(common.ROOT / "docs" / "benchmarks.md",
                             f"## Cold prefill of quantized GGUF files against llama.cpp (issue 32, "
                             f"{args.prompt:,} tokens)", body)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out")
    ap.add_argument("--shapes", default="135m,360m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--gguf", help="comma-separated GGUF files: cold prefill against llama.cpp")
    ap.add_argument("--requantize", help="--gguf: add the first file requantized to this type (q8_0)")
    ap.add_argument("--shape", help="--gguf: add a random Llama of this shape quantized to Q4_K_M")
    ap.add_argument("--prompt", type=int, default=721)
    ap.add_argument("--kernels", action="store_true", help="the int8 prefill products alone against the tiles")
    ap.add_argument("--torch-threads", type=int, help="--gguf: Stowage's torch ops on this many threads")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        extra = {"torch_threads": args.torch_threads} if args.worker == "stowage" else {}
        work = {"stowage": work_gguf_stowage, "llama_cpp": work_gguf_llama}[args.worker]
        args.result.write_text(json.dumps(work(args.path, int(args.threads), args.prompt, **extra)))
        return
    if args.kernels:
        return kernels_main(args)
    if args.gguf:
        return gguf_main(args, argv if argv is not None else sys.argv[1:])
    began = time.time()
    load = common.load_average()
    rows = []
    for shape in args.shapes.split(","):
        model_dir = common.build_model(args.workdir, shape=shape)
        for threads in (int(t) for t in args.threads.split(",")):
            for level, env in (("AVX2", AVX2), ("this CPU", {})):
                on = prefill("stowage", model_dir, threads, args.runs, env | {"STOWAGE_WIDEN_MATMUL": "1"})
                off = prefill("stowage", model_dir, threads, args.runs, env | {"STOWAGE_WIDEN_MATMUL": "0"})
                peer = prefill("transformers", model_dir, threads, args.runs, env)
                rows.append(f"| {shape} | {level} | {threads} | {on:,.0f} | {off:,.0f} | **{on / off:.2f}x** | "
                            f"{peer:,.0f} | **{on / peer:.2f}x** |")
                print(rows[-1], flush=True)
    engine, source = common.source_state()
    cmd = "`.venv/bin/python bench/prefill_bench.py" + (f" {' '.join(argv or sys.argv[1:])}`" if (argv or sys.argv[1:]) else "`")
    body = "\n".join([
        f"{cmd} on {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, load average before: "
        f"{load}; engine {engine} (source {source}). Prefill tok/s of a {PROMPT}-token prompt, medians of "
        f"{args.runs} fresh processes, random bf16 weights of the named shapes. \"AVX2\": torch and Stowage's "
        "kernels held to AVX2 (what a CPU without AVX512-BF16 runs); \"this CPU\": as found. Widened: Stowage "
        "with kernels/cpu_matmul.py's fp32 tiles (STOWAGE_WIDEN_MATMUL=1); torch's: without (=0).",
        "",
        "| shape | instructions | threads | Stowage widened | Stowage torch's bf16 | widened / torch's | "
        "transformers | Stowage widened / transformers |",
        "|---|---|---|---|---|---|---|---|",
        *rows, "",
        f"The run took {round((time.time() - began) / 60)} minutes."])
    print(body)
    if args.write_docs:
        common.write_section(common.ROOT / "docs" / "benchmarks.md",
                             "## Prefill on CPUs without fast bf16 products (issue 16)", body)


if __name__ == "__main__":
    main()
