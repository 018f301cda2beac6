"""What a q8_0 or q4_0 KV cache costs in accuracy: perplexity of a real model on a fixed text, per cache type.

    python bench/kv_quant_ppl.py MODEL [--text FILE] [--tokens 2048] [--decode 256] [--kv bfloat16,q8_0,...] [--llama]

One engine per cache type, the same weights, compute dtype and threads (CPU). The text's first `tokens` tokens are
scored: all but the last `decode` go in as prefill chunks (each chunk's K/V written quantized, then attended to
from the cache, so every later token sees the quantized keys and values of all before it), the last `decode` one
decode step at a time (the native decode step's own quantizing write and in-place read). Perplexity is
exp(mean negative log-likelihood) of each next token; its change against the bf16 cache is what docs/benchmarks.md
records, beside the mean KL divergence of each position's next-token distribution from the first type's (list
bfloat16 first): a steadier measure than a perplexity change, which the rounding of one text moves by percents. The default text is /usr/share/common-licenses/GPL-3 (English prose, on every Debian and Ubuntu system;
its sha256 is printed so a figure names the text it was measured on). `--llama` scores the same token ids with
llama.cpp (llama-cpp-python) on the same GGUF with the same cache types, fed the same way, beside each row.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path

import torch

from stowage.engine.planning import plan_for
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
KV_TYPES = ("float32", "bfloat16", "fp8", "q8_0", "q4_0", "q8_0/q4_0")
CHUNK = 256  # prefill chunk


def nll(engine: Engine, ids: list[int], decode: int) -> tuple[list[float], int, torch.Tensor]:
    """Negative log-likelihoods of ids[1:] (the prefill part's, then the decode part's), where decode began, and
    every position's log-probabilities (float16, [len(ids) - 1, vocab]) for the KL divergence."""
    seq, out, rows = Sequence(), [], []
    first_decode = len(ids) - decode
    pos = 0
    while pos < first_decode:
        n = min(CHUNK, first_decode - pos)
        logits = engine.model.forward(ids[pos : pos + n], seq, engine.cache, all_logits=True)
        targets = ids[pos + 1 : pos + n + 1]
        logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        out += (-logp[torch.arange(len(targets)), torch.tensor(targets)]).tolist()
        rows.append(logp.half())
        pos += n
    for pos in range(first_decode, len(ids) - 1):
        logits = engine.model.forward([ids[pos]], seq, engine.cache)
        logp = torch.log_softmax(logits[-1:].float(), dim=-1)
        out.append(float(-logp[0, ids[pos + 1]]))
        rows.append(logp.half())
    return out, first_decode - 1, torch.cat(rows)  # out[i] scores ids[i + 1]


def mean_kl(base: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean over positions of KL(base || logp), both log-probabilities [positions, vocab]."""
    total = 0.0
    for i in range(0, len(base), 64):
        b, q = base[i : i + 64].float(), logp[i : i + 64].float()
        total += float((b.exp() * (b - q)).sum())
    return total / len(base)


LLAMA_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30, "q8_0": 8, "q4_0": 2}  # ggml type ids


def llama_nll(model: Path, ids: list[int], decode: int, kv: str, threads: int) -> list[float] | None:
    """The same scores from llama.cpp (llama-cpp-python) with the same cache types and the same feeding: the
    prefill part in batches of CHUNK, then one token a call. None when a type has no ggml counterpart (fp8)."""
    import numpy as np
    from llama_cpp import Llama

    k, v = (kv.split("/") + [kv])[:2]
    if k not in LLAMA_TYPES or v not in LLAMA_TYPES:
        return None
    llm = Llama(str(model), n_ctx=len(ids) + 16, n_batch=CHUNK, n_ubatch=CHUNK, logits_all=True, flash_attn=True,
                type_k=LLAMA_TYPES[k], type_v=LLAMA_TYPES[v], n_threads=threads, verbose=False)
    first_decode = len(ids) - decode
    llm.eval(ids[:first_decode])
    for token in ids[first_decode:-1]:
        llm.eval([token])
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    del llm
    return (-logp[np.arange(len(ids) - 1), ids[1:]]).tolist()


def ppl_pair(losses: list[float], split: int) -> tuple[float, float]:
    """Perplexity of all scores and of the decode part's."""
    return math.exp(sum(losses) / len(losses)), math.exp(sum(losses[split:]) / len(losses[split:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a .gguf file or a model folder")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored")
    p.add_argument("--decode", type=int, default=256, help="of them, the last ones fed one decode step at a time")
    p.add_argument("--kv", default=",".join(KV_TYPES), help="cache types, comma-separated (K/V pairs allowed)")
    p.add_argument("--llama", action="store_true", help="score the same tokens with llama.cpp beside (a .gguf)")
    args = p.parse_args()
    text = args.text.read_bytes()
    results, peer, kl, base_logp = {}, {}, {}, None
    for kv in args.kv.split(","):
        engine = Engine.load(args.model, plan_for(args.model, args.tokens + 1, kv_dtype=kv, gpu_layers=0))
        ids = engine.tokenizer.encode(text.decode())[: args.tokens]
        t0 = time.perf_counter()
        losses, split, logp = nll(engine, ids, args.decode)
        seconds = time.perf_counter() - t0
        if base_logp is None:
            base_logp = logp  # the first type's: what the others' KL divergence is taken from
        kl[kv] = mean_kl(base_logp, logp)
        del logp
        results[kv] = ppl_pair(losses, split)
        native = engine.model.native(engine.cache) is not None
        print(f"{kv:>12}: ppl {results[kv][0]:.4f} (decode part {results[kv][1]:.4f}), mean KL {kl[kv]:.5f}, "
              f"KV {engine.cache.num_bytes / 2**20:.1f} MiB, {seconds:.1f} s, native decode {native}", flush=True)
        del engine
        theirs = llama_nll(args.model, ids, args.decode, kv, torch.get_num_threads()) if args.llama else None
        if theirs is not None:
            peer[kv] = ppl_pair(theirs, split)
            print(f"{'llama.cpp':>12}: ppl {peer[kv][0]:.4f} (decode part {peer[kv][1]:.4f})", flush=True)
    print(f"\nmodel {args.model.name}, compute {plan_for(args.model, 64).dtype}; text {args.text} "
          f"(sha256 {hashlib.sha256(text).hexdigest()[:16]}), {len(ids)} tokens, last {args.decode} decoded")
    def cells(table: dict, kv: str) -> str:
        if kv not in table:
            return "| — | — | — | — "
        (ppl, dec), base = table[kv], table.get("bfloat16")
        rel = f"{100 * (ppl / base[0] - 1):+.2f}%" if base else "-"
        rel_d = f"{100 * (dec / base[1] - 1):+.2f}%" if base else "-"
        return f"| {ppl:.4f} | {rel} | {dec:.4f} | {rel_d} "

    first = next(iter(results))
    head = f"| KV cache | mean KL from {first} | perplexity | vs bf16 | decode part | vs bf16 "
    if peer:
        head += "| llama.cpp perplexity | vs bf16 | decode part | vs bf16 "
    print(head + "|\n" + "|---" * (10 if peer else 6) + "|")
    for kv in results:
        print(f"| {kv} | {kl[kv]:.5f} " + cells(results, kv) + (cells(peer, kv) if peer else "") + "|")


if __name__ == "__main__":
    main()
