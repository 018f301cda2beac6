"""GGUF on the CPU: Stowage against llama.cpp (llama-cpp-python) on the same files, and the native block kernels
(kernels/cpu_quant.py) against the torch tile path.

`--mode llama` (the default): a Llama shape written as a bf16/f16 GGUF of random weights, quantized to Q8_0 and
Q4_K_M by llama.cpp itself (llama_model_quantize), then loaded and run by each side in fresh processes at 1 and
2 threads: load time, peak RSS, prefill of 512 tokens, decode tok/s; medians of --runs, quoted as ratios
(Stowage / llama.cpp). `--shape 360m` is SmolLM2-360M's shape (bench/common.py); `--shape tiny` (2 layers of
256) checks that the script works in a minute.

`--mode tiles`: a SmolLM2-360M-shaped Llama (hidden 960, 32 layers, 15/5 heads, intermediate 2560, vocab 49152,
tied head) written with random blocks as Q8_0 and as Q4_K; rows of 960 weights are not whole 256-weight
super-blocks, so the Q4_K file does what llama.cpp's quantizer does there and stores those matrices as Q5_0
(only ffn_down is Q4_K). Each figure is the median of 3 fresh processes; decode bandwidth is the weight bytes one
token reads (every matrix, the tied head included) times tokens/s, beside a numpy copy's bandwidth on this machine.

    .venv/bin/python bench/gguf_bench.py [--shape 360m|tiny] [--write-docs]
    .venv/bin/python bench/gguf_bench.py --mode tiles [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests" / "support"))  # the model writers the tests use

import common  # noqa: E402

SHAPE = common.SMOLLM2_360M
PROMPT_TOKENS = 16
DECODE_TOKENS = {"native": 32, "tiles": 8}  # the tile path runs ~1 token/s: fewer tokens, the same per-token time
# Random blocks: the float16 fields of each block (byte offset) and a magnitude keeping weights below ~0.03.
SCALES = {"q8_0": ([0], 0.02 / 127), "q5_0": ([0], 0.02 / 16), "q4_k": ([0, 2], 2e-5)}
FILE_TYPES = {"q8_0": {"default": "q8_0"}, "q4_k": {"default": "q5_0", "ffn_down": "q4_k"}}
# --mode llama
PREFILL_TOKENS, SIDE_DECODE_TOKENS = 512, 32
CONTEXT_TOKENS = 1024  # the prompt, the reply and the warm-up, for both sides
QUANTS = ("Q8_0", "Q4_K_M")  # llama.cpp's LLAMA_FTYPE_MOSTLY_<name>
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048}


def random_blocks(qtype: str, shape: tuple[int, int], rng):
    import numpy as np

    from stowage.kernels.quants import FORMATS

    fmt = FORMATS[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // fmt.elems_per_block, fmt.bytes_per_block), dtype=np.uint8)
    fields, scale = SCALES[qtype]
    for start in fields:
        blocks[:, start : start + 2] = rng.uniform(0, scale, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def write_model(path: Path, file_type: str) -> Path:
    """The SmolLM2-360M shape as a GGUF of random blocks of `file_type` (written once, kept beside the other models)."""
    if path.exists():
        return path
    import gguf
    import numpy as np
    from gguf_factory import byte_level_vocab

    hidden, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    heads, kv_heads, vocab = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["vocab_size"]
    kv = kv_heads * hidden // heads
    types = FILE_TYPES[file_type]
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(SHAPE["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(SHAPE["rope_theta"])
    w.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    tokens, merges = byte_level_vocab(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def matrix(name, role, shape):
        qtype = types.get(role, types["default"])
        w.add_tensor(name, random_blocks(qtype, shape, rng), raw_dtype=gguf.GGMLQuantizationType[qtype.upper()])

    matrix("token_embd.weight", "token_embd", (vocab, hidden))  # tied: also the head
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for role, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))]:
            matrix(f"blk.{i}.{role}.weight", role, shape)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def bytes_per_token(path: Path) -> int:
    """The weight bytes one decode step reads: every matrix once (the tied embedding as the head)."""
    from stowage.engine.formats.gguf import GGUFFile

    return sum(t.nbytes for t in GGUFFile(path).tensors.values() if len(t.shape) == 2)


def work_decode(path: Path, threads: int, kernels: str) -> dict:
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.planning import plan_for
    from stowage.engine.runtime.sampler import SamplingParams
    from stowage.kernels import cpu_quant

    common.set_threads(threads)
    assert cpu_quant.is_available() == (kernels == "native"), "STOWAGE_FORCE_REFERENCE did not select the path"
    t = time.perf_counter()
    engine = Engine.load(path, plan_for(path, 512, kv_disk_budget=0))  # no disk store: pool.clear() only drops
    load_s = time.perf_counter() - t
    engine.eos_ids = set()  # random weights: never stop early
    prompt = [(7 * i + 3) % SHAPE["vocab_size"] for i in range(PROMPT_TOKENS)]

    def generate(max_tokens):
        engine.pool.clear()  # nothing cached: each run prefills the whole prompt
        return engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)).run()

    generate(2)  # warm-up: the first call builds the kernels and the caches
    result = generate(DECODE_TOKENS[kernels])
    return {"decode_tok_s": result.decode_tokens_per_s, "load_s": load_s, "isa": cpu_quant.selected_isa()}


def work_copy() -> dict:
    """Best of 5 copies of 512 MiB with numpy (one thread): bytes read + written per second."""
    import numpy as np

    a = np.ones(2**26)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return {"copy_gbps": 2 * a.nbytes / best / 1e9}


def float_gguf(shape: str, models: Path) -> Path:
    """The unquantized GGUF llama.cpp quantizes: SmolLM2-360M's shape in bf16 (bench/common.py), or a tiny f16 one."""
    if shape in common.SHAPES:
        return common.convert_gguf(common.build_model(models, shape=shape))
    path = models / "tiny-shape.f16.gguf"
    if not path.exists():
        from factory import make_model
        from gguf_factory import write_gguf

        write_gguf(make_model(models / "tiny-shape-hf", "llama", **TINY), path, "f16")
    return path


def quantized(source: Path, quant: str) -> Path:
    """`source` quantized to `quant` by llama.cpp (written once, kept beside it)."""
    path = source.with_name(source.name.replace(".bf16.", ".").replace(".f16.", ".")
                            .removesuffix(".gguf") + f".{quant}.gguf")
    if path.exists():
        return path
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = 2
    tmp = path.with_name(path.name + ".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source.name} to {quant}")
    tmp.rename(path)
    return path


def prompt_ids(num_tokens: int, vocab: int, seed: int) -> list[int]:
    return [(7 * i + 3 + seed) % (vocab - 3) + 3 for i in range(num_tokens)]  # past bos/eos/unk


def work_stowage(path: Path, threads: int) -> dict:
    """Load, warm up, then one 512-token prefill and SIDE_DECODE_TOKENS greedy tokens; this process's peak RSS."""
    t = time.perf_counter()
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.planning import plan_for
    from stowage.engine.runtime.sampler import SamplingParams

    common.set_threads(threads)
    import_s = time.perf_counter() - t
    t = time.perf_counter()
    engine = Engine.load(path, plan_for(path, CONTEXT_TOKENS, kv_disk_budget=0))  # pool.clear() only drops
    load_s = time.perf_counter() - t
    engine.eos_ids = set()  # random weights: never stop early
    vocab = engine.config.vocab_size

    def generate(prompt, max_tokens):
        engine.pool.clear()  # nothing cached: each run prefills the whole prompt
        return engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)).run()

    generate(prompt_ids(16, vocab, 1), 2)  # warm-up: the native kernels and the caches
    r = generate(prompt_ids(PREFILL_TOKENS, vocab, 0), SIDE_DECODE_TOKENS)
    return {"import_s": import_s, "load_s": load_s, "prefill_tok_s": r.prefill_tokens_per_s,
            "decode_tok_s": r.decode_tokens_per_s, "peak_rss_bytes": common.peak_rss_bytes()}


def work_llama(path: Path, threads: int) -> dict:
    """The same on llama.cpp: its mmap'd load, the same prompt ids, greedy decoding (top_k=1)."""
    t = time.perf_counter()
    import llama_cpp

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=CONTEXT_TOKENS, n_batch=PREFILL_TOKENS, n_threads=threads,
                          n_threads_batch=threads, use_mmap=True, verbose=False)
    load_s = time.perf_counter() - t
    vocab = llm.n_vocab()

    def generate(prompt, max_tokens):
        llm.reset()  # nothing reused: the whole prompt is evaluated, as on Stowage's fresh conversation
        times, start = [], time.perf_counter()
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == max_tokens:
                break
        return start, times

    generate(prompt_ids(16, vocab, 1), 2)
    start, times = generate(prompt_ids(PREFILL_TOKENS, vocab, 0), SIDE_DECODE_TOKENS)
    return {"import_s": import_s, "load_s": load_s, "prefill_tok_s": PREFILL_TOKENS / (times[0] - start),
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]), "peak_rss_bytes": common.peak_rss_bytes(),
            "llama_cpp": llama_cpp.__version__}


def side_by_side(args) -> None:
    models = common.ROOT / "bench" / "out" / "gguf"
    models.mkdir(parents=True, exist_ok=True)
    source = float_gguf(args.shape, models)
    load = common.load_average()
    rows = []
    for quant in QUANTS:
        path = quantized(source, quant)
        path.read_bytes()  # into the page cache: both sides then map a warm file
        for threads in (1, 2):
            r = {}
            for _ in range(args.runs):  # alternating, so a change in the machine's load touches both sides alike
                for side in ("stowage", "llama"):
                    r.setdefault(side, []).append(common.run_worker(
                        HERE, ["--worker", side, "--model", str(path), "--threads", str(threads)], threads=threads))
            s, ll = common.medians(r["stowage"]), common.medians(r["llama"])
            rows.append((quant, path.stat().st_size, threads, s, ll))
            print(quant, threads, f"decode {s['decode_tok_s']:.1f} vs {ll['decode_tok_s']:.1f} tok/s", flush=True)
    digest, state = common.source_state()
    mib = 2**20
    lines = [
        f"`.venv/bin/python bench/gguf_bench.py --shape {args.shape} --write-docs` ({state}, source {digest}; "
        f"llama-cpp-python {rows[0][4]['llama_cpp']}; load average before: {load}).",
        f"{'SmolLM2-' + args.shape.upper() if args.shape in common.SHAPES else 'A tiny'} Llama shape, random weights "
        "quantized by llama.cpp "
        f"(llama_model_quantize); a {PREFILL_TOKENS}-token prompt, then {SIDE_DECODE_TOKENS} greedy tokens; "
        f"medians of {args.runs} fresh processes per side, alternating; the file in the page cache. Ratios are "
        "Stowage / llama.cpp (targets: decode >= 0.8x, load <= 1.5x, peak RSS <= llama.cpp + 250 MiB).",
        "",
        "| file | MiB | threads | load s (Stowage / llama.cpp) | load x | peak RSS MiB | RSS diff MiB | "
        "prefill tok/s | prefill x | decode tok/s | decode x |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for quant, size, threads, s, ll in rows:
        lines.append(
            f"| {quant} | {size / mib:.0f} | {threads} | {s['load_s']:.2f} / {ll['load_s']:.2f} | "
            f"{s['load_s'] / ll['load_s']:.2f}x | {s['peak_rss_bytes'] / mib:.0f} / {ll['peak_rss_bytes'] / mib:.0f} | "
            f"{(s['peak_rss_bytes'] - ll['peak_rss_bytes']) / mib:+.0f} | "
            f"{s['prefill_tok_s']:.1f} / {ll['prefill_tok_s']:.1f} | {s['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x | "
            f"{s['decode_tok_s']:.1f} / {ll['decode_tok_s']:.1f} | {s['decode_tok_s'] / ll['decode_tok_s']:.2f}x |")
    lines += ["", "Load time excludes importing (Stowage's torch import: "
              f"{rows[0][3]['import_s']:.1f} s; llama_cpp's: {rows[0][4]['import_s']:.2f} s); peak RSS includes it, "
              "and the file pages each side touched."]
    body = "\n".join(lines)
    print(body)
    if args.write_docs:
        heading = "## GGUF against llama.cpp" + ("" if args.shape == "360m" else f" ({args.shape} shape)")
        common.write_section(common.ROOT / "docs" / "benchmarks.md", heading, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mode", choices=("llama", "tiles"), default="llama",
                    help="against llama.cpp (default), or the native kernels against the tile path")
    ap.add_argument("--shape", choices=(*common.SHAPES, "tiny"), default="360m", help="--mode llama: the model's shape")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--kernels", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        workers = {"decode": lambda: work_decode(args.model, args.threads, args.kernels), "copy": work_copy,
                   "stowage": lambda: work_stowage(args.model, args.threads),
                   "llama": lambda: work_llama(args.model, args.threads)}
        args.result.write_text(json.dumps(workers[args.worker]()))
        return
    if args.mode == "llama":
        side_by_side(args)
        return

    import os

    models = common.ROOT / "bench" / "out" / "gguf"
    models.mkdir(parents=True, exist_ok=True)
    load = common.load_average()
    copy = common.medians([common.run_worker(HERE, ["--worker", "copy"], threads=1) for _ in range(args.runs)])
    rows = []
    for file_type in FILE_TYPES:
        path = write_model(models / f"smollm2-360m-shape.{file_type}.gguf", file_type)
        nbytes = bytes_per_token(path)
        for threads in (1, 2):
            for kernels in ("native", "tiles"):
                env = {"STOWAGE_FORCE_REFERENCE": "1" if kernels == "tiles" else "0"}
                os.environ.update(env)
                runs = [common.run_worker(HERE, ["--worker", "decode", "--model", str(path), "--kernels", kernels,
                                                        "--threads", str(threads)],
                                          threads=threads) for _ in range(args.runs)]
                r = common.medians(runs)
                rows.append((file_type, nbytes, threads, kernels, r))
                print(file_type, threads, kernels, f"{r['decode_tok_s']:.2f} tok/s", flush=True)
    os.environ.pop("STOWAGE_FORCE_REFERENCE", None)
    digest, state = common.source_state()
    lines = [
        f"`.venv/bin/python bench/gguf_bench.py --write-docs` ({state}, source {digest}; load average before: {load}).",
        f"SmolLM2-360M shape, random blocks, {PROMPT_TOKENS}-token prompt, then {DECODE_TOKENS['native']} greedy "
        f"tokens (native) / {DECODE_TOKENS['tiles']} (tiles); medians of {args.runs} fresh processes. "
        f"numpy copy on this machine: {copy['copy_gbps']:.1f} GB/s (read + written).",
        "The Q4_K file stores the 960-wide rows as Q5_0, as llama.cpp's quantizer does (only ffn_down is Q4_K).",
        "",
        "| file | weight MiB read per token | threads | kernels | decode tok/s | GB/s of weights | vs tiles |",
        "|---|---|---|---|---|---|---|",
    ]
    for file_type, nbytes, threads, kernels, r in rows:
        tiles = next(x for f, _, t, k, x in rows if (f, t, k) == (file_type, threads, "tiles"))
        isa = f" ({r['isa']})" if kernels == "native" else ""
        lines.append(f"| {file_type} | {nbytes / 2**20:.0f} | {threads} | {kernels}{isa} | {r['decode_tok_s']:.2f} | "
                     f"{nbytes * r['decode_tok_s'] / 1e9:.1f} | {r['decode_tok_s'] / tiles['decode_tok_s']:.1f}x |")
    body = "\n".join(lines)
    print(body)
    if args.write_docs:
        common.write_section(common.ROOT / "docs" / "benchmarks.md", "## GGUF on the CPU", body)


if __name__ == "__main__":
    main()
