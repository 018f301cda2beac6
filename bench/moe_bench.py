"""Decode and prefill of a mixture-of-experts GGUF on the CPU (issue 28's shape): Stowage against llama.cpp.

    .venv/bin/python bench/moe_bench.py [--layers 12] [--threads 2] [--runs 3] [--workdir /tmp/moe-bench]
    .venv/bin/python bench/moe_bench.py --mode experts
    .venv/bin/python bench/moe_bench.py --mode grouped-prefill
    .venv/bin/python bench/moe_bench.py --mode gpt-oss-decode [--layers 2]


A Qwen3-30B-A3B-shaped `qwen3moe` file scaled to --layers layers (hidden 2048, 32/4 heads of 128, 48 experts of
768, 8 active, vocabulary 151,936): random f16 matrices (routers and vectors f32) quantized to Q4_K_M by llama.cpp's
own quantizer (llama-cpp-python's llama_model_quantize), written once into --workdir (12 layers: 2.1 GiB, some
13 minutes on this machine). The default mode runs both engines on that same file, each run a fresh process with
an empty STOWAGE_KV_DIR, Stowage and llama.cpp alternating, --runs each: prefill of 512 tokens (one batch), then
32 greedy decode tokens after a 16-token prompt, --threads threads. tok/s are medians; the ratios are Stowage's
over llama.cpp's; each run carries the load average at its start (the machine is shared: the ratios are what
count).

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
PREFILL, DECODE, SHORT = 512, 32, 16
PROMPT = [(i * 7919 + 13) % 150000 + 10 for i in range(PREFILL)]


def _floats(rng, name: str, n: int):
    """float32 values for a vector or a router: norms near 1, routers small."""
    import numpy as np

    scale = 0.02 if name.endswith("ffn_gate_inp.weight") else 0.1
    return (rng.standard_normal(n) * scale + (1 if "norm" in name else 0)).astype(np.float32)


def write_q4_k_m(path: Path, layers: int) -> Path:
    """The issue's file: random f16 matrices (routers and vectors f32) quantized to Q4_K_M by llama.cpp's own
    quantizer (llama_model_quantize, llama-cpp-python), so Q6_K sits where llama.cpp puts it."""
    import llama_cpp
    import numpy as np
    from moe_factory import write_sparse_moe_gguf

    from stowage.engine.formats.gguf import GGUFFile

    source = path.with_suffix(".f16.gguf")
    write_sparse_moe_gguf(source, SHAPE | {"num_hidden_layers": layers}, default="f16")
    rng = np.random.default_rng(0)
    file = GGUFFile(source)
    infos = {name: (t.offset, t.type_name, t.shape) for name, t in file.tensors.items()}
    del file
    with open(source, "r+b") as f:
        for name, (offset, type_name, shape) in infos.items():
            n = int(np.prod(shape))
            f.seek(offset)
            if type_name != "f16":
                f.write(_floats(rng, name, n).tobytes())
                continue
            for start in range(0, n, 1 << 26):  # random sign and mantissa, magnitudes 2^-7 .. 2^-5
                bits = rng.integers(0, 1 << 16, min(1 << 26, n - start), dtype=np.uint16)
                f.write(((bits & 0x87FF) | 0x2000).tobytes())
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source}")
    source.unlink()
    return path


def worker(path: Path, threads: int) -> dict:
    common.set_threads(threads)
    from factory import cpu_plan

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.kv_cache import Sequence
    from stowage.kernels.cpu_decode import torch_on_one_thread

    engine = Engine.load(path, cpu_plan(path, PREFILL + DECODE + 16))
    seq = Sequence()
    start = time.perf_counter()
    logits = engine.model.forward(PROMPT, seq, engine.cache)
    prefill = time.perf_counter() - start
    engine.cache.release(seq)
    seq = Sequence()  # decode after a short prompt, as the issue measures it
    token = int(engine.model.forward(PROMPT[:SHORT], seq, engine.cache)[-1].argmax())
    start = time.perf_counter()
    with torch_on_one_thread():  # as the engine's scheduler runs a native step (engine/serving/scheduler.py)
        for _ in range(DECODE):
            token = int(engine.model.decode_step([token], [seq], engine.cache)[0].argmax())
    decode = time.perf_counter() - start
    del logits
    return {"stowage_prefill_tok_s": PREFILL / prefill, "stowage_decode_tok_s": DECODE / decode,
            "read_bytes_per_token": engine.plan.device("cpu").read_bytes_per_token}


def llama_worker(path: Path, threads: int) -> dict:
    """The same measurement in llama.cpp (llama-cpp-python): prefill in one batch of 512, greedy decode."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(path), n_ctx=PREFILL + DECODE + 16, n_batch=PREFILL, n_ubatch=PREFILL,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))))

    start = time.perf_counter()
    llm.eval(PROMPT)
    prefill = time.perf_counter() - start
    llm.reset()
    llm.eval(PROMPT[:SHORT])
    token = argmax()
    start = time.perf_counter()
    for _ in range(DECODE):
        llm.eval([token])
        token = argmax()
    decode = time.perf_counter() - start
    return {"llama_prefill_tok_s": PREFILL / prefill, "llama_decode_tok_s": DECODE / decode}


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
    ids = PROMPT[:256]
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
    p.add_argument("--llama-worker", type=Path)
    p.add_argument("--result", type=Path)
    args = p.parse_args()
    if args.worker:
        args.result.write_text(json.dumps(worker(args.worker, args.threads)))
        return
    if args.llama_worker:
        args.result.write_text(json.dumps(llama_worker(args.llama_worker, args.threads)))
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
    path = args.workdir / f"qwen3moe-{args.layers}l-q4_k_m.gguf"
    if not path.exists():
        write_q4_k_m(path, args.layers)
    if args.mode == "grouped-prefill":
        print(json.dumps(grouped_prefill_mode(path, args.threads) | {"threads": args.threads,
                                                                      "load": common.load_average()}))
        return
    print(json.dumps(compare(path, args.threads, args.runs) | {"layers": args.layers, "threads": args.threads}))


def compare(path: Path, threads: int, runs: int) -> dict:
    """Both engines on `path`, each run a fresh process (cold: an empty STOWAGE_KV_DIR), alternating; medians,
    ratios, and the load average beside each run."""
    import os
    import statistics
    import tempfile

    out: dict = {"runs": []}
    for _ in range(runs):
        for engine in ("stowage", "llama"):
            with tempfile.TemporaryDirectory() as kv_dir:
                os.environ["STOWAGE_KV_DIR"] = kv_dir
                load = common.load_average()
                flag = "--worker" if engine == "stowage" else "--llama-worker"
                result = common.run_worker(HERE, [flag, str(path), "--threads", str(threads)], threads=threads)
                out["runs"].append(result | {"load": load})
    for key in ("stowage_prefill_tok_s", "stowage_decode_tok_s", "llama_prefill_tok_s", "llama_decode_tok_s",
                "read_bytes_per_token"):
        out[key] = round(statistics.median(r[key] for r in out["runs"] if key in r), 2)
    for phase in ("prefill", "decode"):
        out[f"{phase}_ratio"] = round(out[f"stowage_{phase}_tok_s"] / out[f"llama_{phase}_tok_s"], 3)
    return out


if __name__ == "__main__":
    main()
