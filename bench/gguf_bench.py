"""GGUF decode on the CPU: the native block kernels (kernels/cpu_quant.py) against the torch tile path.

A SmolLM2-360M-shaped Llama (hidden 960, 32 layers, 15/5 heads, intermediate 2560, vocab 49152, tied head) is
written with random blocks as Q8_0 and as Q4_K; rows of 960 weights are not whole 256-weight super-blocks, so
the Q4_K file does what llama.cpp's quantizer does there and stores those matrices as Q5_0 (only ffn_down is
Q4_K). Each figure is the median of 3 fresh processes; decode bandwidth is the weight bytes one token reads
(every matrix, the tied head included) times tokens/s, beside a numpy copy's bandwidth on this machine.

    .venv/bin/python bench/gguf_bench.py [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "tests" / "support")]

from bench import common  # noqa: E402

SHAPE = common.SMOLLM2_360M
PROMPT_TOKENS = 16
DECODE_TOKENS = {"native": 32, "tiles": 8}  # the tile path runs ~1 token/s: fewer tokens, the same per-token time
# Random blocks: the float16 fields of each block (byte offset) and a magnitude keeping weights below ~0.03.
SCALES = {"q8_0": ([0], 0.02 / 127), "q5_0": ([0], 0.02 / 16), "q4_k": ([0, 2], 2e-5)}
FILE_TYPES = {"q8_0": {"default": "q8_0"}, "q4_k": {"default": "q5_0", "ffn_down": "q4_k"}}


def random_blocks(qtype: str, shape: tuple[int, int], rng):
    import numpy as np

    from kernels.quants import FORMATS

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
    from engine.gguf import GGUFFile

    return sum(t.nbytes for t in GGUFFile(path).tensors.values() if len(t.shape) == 2)


def work_decode(path: Path, threads: int, kernels: str) -> dict:
    from engine.engine import Engine
    from engine.planning import plan_for
    from engine.sampler import SamplingParams
    from kernels import cpu_quant

    common.set_threads(threads)
    assert cpu_quant.is_available() == (kernels == "native"), "STOWAGE_FORCE_REFERENCE did not select the path"
    t = time.perf_counter()
    engine = Engine.load(path, plan_for(path, 512))
    load_s = time.perf_counter() - t
    engine.eos_ids = set()  # random weights: never stop early
    prompt = [(7 * i + 3) % SHAPE["vocab_size"] for i in range(PROMPT_TOKENS)]

    def generate(max_tokens):
        conv = engine.new_conversation()
        result = engine.generate(conv, prompt, SamplingParams(temperature=0, max_tokens=max_tokens)).run()
        engine.release(conv)
        return result

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--kernels", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        r = work_decode(args.model, args.threads, args.kernels) if args.worker == "decode" else work_copy()
        args.result.write_text(json.dumps(r))
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
                runs = [common.run_worker(HERE, ["--worker", "decode", "--model", str(path), "--kernels", kernels],
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
