"""CPU prefill of bf16 weights with and without widened fp32 tiles (kernels/cpu_matmul.py), beside transformers.

    .venv/bin/python bench/prefill_bench.py [--shapes 135m,360m] [--threads 1,2] [--runs 3] [--write-docs]

torch multiplies bf16 at speed only with AVX512-BF16 or AMX; most desktop CPUs have neither. To measure that
case on any x86 machine, the "AVX2" rows hold torch (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) and
Stowage's kernels (STOWAGE_DECODE_ISA=avx2) to AVX2, for every engine alike; the "this CPU" rows run as found.
Stowage runs with the widened tiles on and off (STOWAGE_WIDEN_MATMUL=1/0); transformers is the peer. Each
figure is the prefill tok/s of a 512-token prompt, the median of --runs fresh processes (decode_bench.py's
workers). llama.cpp is not in this table: its CPU backend picks its instructions where it was built.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402

DECODE_BENCH = HERE.parent / "decode_bench.py"
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out")
    ap.add_argument("--shapes", default="135m,360m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
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
