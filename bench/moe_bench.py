"""Decode and prefill of a mixture-of-experts GGUF on the CPU (issue 28's shape), Stowage alone.

    .venv/bin/python bench/moe_bench.py [--layers 12] [--threads 2] [--runs 3] [--workdir /tmp/moe-bench]
    .venv/bin/python bench/moe_bench.py --mode experts
    .venv/bin/python bench/moe_bench.py --mode grouped-prefill
    .venv/bin/python bench/moe_bench.py --mode gpt-oss-decode [--layers 2]


A Qwen3-30B-A3B-shaped `qwen3moe` file scaled to --layers layers (hidden 2048, 32/4 heads of 128, 48 experts of
768, 8 active, vocabulary 151,936), random Q4_K blocks for every matrix (the routers f32), written once into
--workdir. Each run is a fresh process: prefill of 512 tokens, then 32 greedy decode tokens (ids fed directly);
tok/s are medians of --runs. llama.cpp's side of the issue's comparison needs its quantizer and runtime, which
this machine lacks: docs/moe.md says what is left.

`--mode experts`: one expert's product (768 x 2048 Q4_K, random blocks) over 16, 32 and 85 routed rows, the
float32 tile path against the native kernels 8 rows at a time (QuantizedWeight.linear on slices of 8 rows); ms
per matrix, best of 3 passes over 8 matrices.

`--mode grouped-prefill`: the same choice inside a whole 256-token prefill of the --layers file, in one process
after a warm-up pass (the first pass pages the file in): the experts' products on tiles, as the engine runs them,
against 8 rows at a time on the native kernels, alternating, 3 passes each; tok/s of each pass.

`--mode gpt-oss-decode`: a gpt-oss-20b-shaped `gpt-oss` file (MXFP4 experts, Q8_0 elsewhere, vocabulary 32,768) of
--layers layers whose data is a hole (zeros: the same work), 16 decode tokens after a 32-token prompt, the native
step (decode_layer.c) against the torch path, alternating in one process, --runs each; tok/s and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests" / "support"))

import common  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128, num_experts=48, num_experts_per_tok=8, vocab_size=151936,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
PREFILL, DECODE = 512, 32


def write_model(path: Path, layers: int) -> Path:
    """The file, with random data: the header as tests/support/moe_factory.write_sparse_moe_gguf writes it."""
    import numpy as np
    from gguf_factory import random_k_blocks
    from moe_factory import write_sparse_moe_gguf

    from stowage.engine.formats.gguf import GGUFFile

    write_sparse_moe_gguf(path, SHAPE | {"num_hidden_layers": layers})
    rng = np.random.default_rng(0)
    file = GGUFFile(path)
    infos = {name: (t.offset, t.type_name, t.shape) for name, t in file.tensors.items()}
    del file
    with open(path, "r+b") as f:
        for name, (offset, type_name, shape) in infos.items():
            if type_name == "q4_k":
                rows = int(np.prod(shape[:-1]))
                data = random_k_blocks("q4_k", (rows, shape[-1]), rng)
            else:  # norms near 1, routers small
                scale = 0.02 if name.endswith("ffn_gate_inp.weight") else 0.1
                data = (rng.standard_normal(int(np.prod(shape))) * scale + (1 if "norm" in name else 0))
                data = data.astype(np.float32)
            f.seek(offset)
            f.write(data.tobytes())
    return path


def worker(path: Path, threads: int) -> dict:
    common.set_threads(threads)
    from factory import cpu_plan

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.kv_cache import Sequence

    engine = Engine.load(path, cpu_plan(path, PREFILL + DECODE + 16))
    ids = [(i * 7919 + 13) % 150000 + 10 for i in range(PREFILL)]
    seq = Sequence()
    start = time.perf_counter()
    logits = engine.model.forward(ids, seq, engine.cache)
    prefill = time.perf_counter() - start
    token = int(logits[-1].argmax())
    start = time.perf_counter()
    for _ in range(DECODE):
        token = int(engine.model.decode_step([token], [seq], engine.cache)[0].argmax())
    decode = time.perf_counter() - start
    return {"prefill_tok_s": PREFILL / prefill, "decode_tok_s": DECODE / decode,
            "read_bytes_per_token": engine.plan.device("cpu").read_bytes_per_token}


def experts_mode(threads: int) -> dict:
    import numpy as np
    import torch
    from gguf_factory import random_k_blocks

    from stowage.kernels.quant_linear import QuantizedWeight

    common.set_threads(threads)
    rng = np.random.default_rng(0)
    weights = [QuantizedWeight(random_k_blocks("q4_k", (768, 2048), rng), "q4_k", (768, 2048), torch.bfloat16)
               for _ in range(8)]
    out = {}
    for rows in (16, 32, 85):
        x = torch.randn(rows, 2048).bfloat16()
        for grouped in (False, True):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for w in weights:
                    if grouped:
                        torch.cat([w.linear(x[i : i + 8]) for i in range(0, rows, 8)])
                    else:
                        w.linear(x)
                best = min(best, (time.perf_counter() - start) / len(weights))
            out[f"{rows}_rows_{'native' if grouped else 'tiles'}_ms"] = round(best * 1e3, 1)
    return out


def grouped_prefill_mode(path: Path, threads: int) -> dict:
    import torch
    from factory import cpu_plan

    from stowage.engine.runtime import model
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.kv_cache import Sequence
    from stowage.kernels.quant_linear import QuantizedWeight

    common.set_threads(threads)
    engine = Engine.load(path, cpu_plan(path, 1024))
    ids = [(i * 7919 + 13) % 150000 + 10 for i in range(256)]
    tiles = model.linear
    expert_shapes = {(SHAPE["moe_intermediate_size"], SHAPE["hidden_size"]),
                     (SHAPE["hidden_size"], SHAPE["moe_intermediate_size"])}

    def by_8(x, w, bias=None):
        if isinstance(w, QuantizedWeight) and x.shape[0] > 8 and \
                (w.shape.out_features, w.shape.in_features) in expert_shapes:
            return torch.cat([tiles(x[i : i + 8], w, bias) for i in range(0, x.shape[0], 8)])
        return tiles(x, w, bias)

    out: dict = {"tiles_tok_s": [], "native_by_8_tok_s": []}
    for mode in ("warm-up", *("native_by_8_tok_s", "tiles_tok_s") * 3):
        model.linear = by_8 if mode == "native_by_8_tok_s" else tiles
        seq = Sequence()
        start = time.perf_counter()
        engine.model.forward(ids, seq, engine.cache)
        if mode in out:
            out[mode].append(round(len(ids) / (time.perf_counter() - start), 1))
        engine.cache.release(seq)
    model.linear = tiles
    return out


def gpt_oss_decode_mode(path: Path, threads: int, runs: int) -> dict:
    import statistics

    from factory import cpu_plan

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.kv_cache import Sequence

    common.set_threads(threads)
    engine = Engine.load(path, cpu_plan(path, 512))
    native = engine.model.native(engine.cache)
    out: dict = {"native_tok_s": [], "torch_tok_s": []}
    for key in ("native_tok_s", "torch_tok_s") * runs:
        engine.model._native_for = (engine.cache, native if key == "native_tok_s" else None)
        seq = Sequence()
        token = engine.model.forward(list(range(10, 42)), seq, engine.cache)[-1].argmax().item()
        start = time.perf_counter()
        for _ in range(16):
            token = engine.model.decode_step([token], [seq], engine.cache)[0].argmax().item()
        out[key].append(round(16 / (time.perf_counter() - start), 2))
        engine.cache.release(seq)
    return out | {"native_over_torch": round(statistics.median(out["native_tok_s"])
                                             / statistics.median(out["torch_tok_s"]), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("model", "experts", "grouped-prefill", "gpt-oss-decode"), default="model")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"))
    p.add_argument("--worker", type=Path)
    p.add_argument("--result", type=Path)
    args = p.parse_args()
    if args.worker:
        args.result.write_text(json.dumps(worker(args.worker, args.threads)))
        return
    if args.mode == "experts":
        print(json.dumps(experts_mode(args.threads) | {"threads": args.threads, "load": common.load_average()}))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.mode == "gpt-oss-decode":
        from moe_factory import GPT_OSS_20B, write_sparse_gpt_oss_gguf

        path = args.workdir / f"gpt-oss-20b-{args.layers}l-mxfp4.gguf"
        if not path.exists():
            write_sparse_gpt_oss_gguf(path, GPT_OSS_20B | {"vocab_size": 32768, "num_hidden_layers": args.layers})
        print(json.dumps(gpt_oss_decode_mode(path, args.threads, args.runs)
                         | {"layers": args.layers, "threads": args.threads, "load": common.load_average()}))
        return
    path = args.workdir / f"qwen3moe-{args.layers}l-q4_k.gguf"
    if not path.exists():
        write_model(path, args.layers)
    if args.mode == "grouped-prefill":
        print(json.dumps(grouped_prefill_mode(path, args.threads) | {"threads": args.threads,
                                                                      "load": common.load_average()}))
        return
    runs = [common.run_worker(HERE, ["--worker", str(path), "--threads", str(args.threads)], threads=args.threads)
            for _ in range(args.runs)]
    result = common.medians(runs)
    print(json.dumps(result | {"layers": args.layers, "threads": args.threads, "load": common.load_average()}))


if __name__ == "__main__":
    main()
