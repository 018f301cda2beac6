"""What an fp8 KV cache costs in accuracy: logits and greedy tokens against a full-precision cache.

    python bench/fp8_accuracy.py [MODEL_DIR] [--tokens 64] [--device cpu|cuda]

MODEL_DIR defaults to the bundled demo model (assets/demo-model); without one, a tiny random Llama
is built with transformers. Each prompt is run through engines that differ only in kv_dtype:
- teacher-forced: the baseline's own greedy continuation is fed token by token (prefill, then
  decode steps, so the decode path is what is measured) and the logits compared per position;
- free-running: each engine decodes greedily on its own; we count tokens equal to the baseline's.
fp8 is measured with the engine's per-layer scale of 1.0 and with scales calibrated from the
baseline's K/V (amax / 448), to show whether calibration is needed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence  # noqa: E402
from stowage.engine.planning import plan_for  # noqa: E402

FP8_MAX = 448.0
PROMPTS = [
    "What does Stowage do?",
    "How much memory does a 32k context need?",
    "Tell me a short story about a lighthouse keeper.",
    "Explain the KV cache in two sentences.",
]


def random_model_dir(out: Path) -> Path:
    """A tiny random Llama with a byte-level tokenizer, as the tests build it."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from factory import make_model  # the test suite's builder: one source of tiny models

    # initializer_range 0.2, as tests/engine uses: 0.02 leaves logits nearly flat and argmax a coin toss
    return make_model(out, "llama", initializer_range=0.2)


def prompt_ids(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    try:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    except Exception:  # a model without a chat template: the plain text
        return tok.encode(text)


def greedy(engine: Engine, ids: list[int], num_tokens: int) -> list[int]:
    """num_tokens greedy tokens, EOS included and not stopped at, so every engine makes as many."""
    seq = Sequence()
    logits = engine.model.forward(ids, seq, engine.cache)[-1]
    out = []
    for _ in range(num_tokens):
        out.append(int(logits.argmax()))
        logits = engine.model.forward([out[-1]], seq, engine.cache)[-1]
    engine.cache.release(seq)
    return out


def forced_logits(engine: Engine, ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits predicting each continuation token, fed one decode step at a time: [len, vocab]."""
    seq = Sequence()
    rows = [engine.model.forward(ids, seq, engine.cache)[-1]]
    for token in continuation[:-1]:
        rows.append(engine.model.forward([token], seq, engine.cache)[-1])
    engine.cache.release(seq)
    return torch.stack(rows)


def kv_amax(engine: Engine, ids: list[int]) -> list[tuple[float, float]]:
    """Per layer, the largest |K| and |V| the model writes for these tokens."""
    seq = Sequence()
    engine.model.forward(ids, seq, engine.cache)
    blocks = torch.tensor(seq.block_table)
    n = seq.num_tokens
    out = []
    for k, v in zip(engine.cache.k_cache, engine.cache.v_cache):
        rows_k = k[blocks.to(k.device)].flatten(0, 1)[:n].float()
        rows_v = v[blocks.to(v.device)].flatten(0, 1)[:n].float()
        out.append((rows_k.abs().max().item(), rows_v.abs().max().item()))
    engine.cache.release(seq)
    return out


def compare(base_logits, logits, base_tokens, tokens) -> dict[str, float]:
    diff = (logits - base_logits).abs()
    logp, base_logp = logits.log_softmax(-1), base_logits.log_softmax(-1)
    kl = (base_logp.exp() * (base_logp - logp)).sum(-1)
    first_diff = next((i for i, (a, b) in enumerate(zip(base_tokens, tokens)) if a != b), len(tokens))
    return {
        "max_abs_logit_diff": diff.max().item(),
        "mean_abs_logit_diff": diff.mean().item(),
        "logit_std": base_logits.std().item(),
        "mean_kl": kl.mean().item(),
        "top1_agree_forced": (logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item(),
        "greedy_agree": sum(a == b for a, b in zip(base_tokens, tokens)) / len(tokens),
        "first_divergence": first_diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="device for every layer (cpu, cuda:0)")
    parser.add_argument("--random", action="store_true", help="use a tiny random Llama, not the demo model")
    parser.add_argument("--baseline", default=None, help="kv_dtype of the baseline (default: the compute dtype)")
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(args.model_dir) if args.model_dir else ROOT / "assets" / "demo-model"
    if args.random or not (model_dir / "config.json").exists():
        print("building a tiny random Llama", file=sys.stderr)
        model_dir = random_model_dir(Path(tmp.name))

    def load(kv_dtype):
        # every layer on args.device: 0 GPU layers for the CPU, all of them (more than any model has) for a GPU
        gpu_layers = 0 if args.device == "cpu" else 1 << 20
        return Engine.load(model_dir, plan_for(model_dir, 1024, kv_dtype=kv_dtype, gpu_layers=gpu_layers))

    base = load(args.baseline)
    variants = {name: load(kv) for name, kv in [("bfloat16", "bfloat16"), ("fp8 scale 1", "fp8"),
                                                ("fp8 calibrated", "fp8")]}
    all_ids = [prompt_ids(base, p) for p in PROMPTS]
    # Calibrate on the prompts and the baseline's replies, as a loader could on a few sample texts.
    conts = [greedy(base, ids, args.tokens) for ids in all_ids]
    amax = [kv_amax(base, ids + cont) for ids, cont in zip(all_ids, conts)]
    calibrated = variants["fp8 calibrated"].cache
    for layer in range(len(calibrated.k_scale)):
        calibrated.k_scale[layer] = max(a[layer][0] for a in amax) / FP8_MAX
        calibrated.v_scale[layer] = max(a[layer][1] for a in amax) / FP8_MAX

    cfg = base.config
    print(f"model: {model_dir.name}: {cfg.num_layers} layers, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
          f"head_dim {cfg.head_dim}; baseline KV {base.cache.spec.dtype}; device {args.device}; "
          f"{len(PROMPTS)} prompts x {args.tokens} tokens")
    layer_amax = [(max(a[i][0] for a in amax), max(a[i][1] for a in amax)) for i in range(cfg.num_layers)]
    print("per-layer max |K|, |V|: " + ", ".join(f"{k:.2f}/{v:.2f}" for k, v in layer_amax))
    keys = ["max_abs_logit_diff", "mean_abs_logit_diff", "logit_std", "mean_kl", "top1_agree_forced",
            "greedy_agree", "first_divergence"]
    print(f"{'kv cache':<16}" + "".join(f"{k:>20}" for k in keys))
    for name, engine in variants.items():
        rows = []
        for ids, cont in zip(all_ids, conts):
            base_logits = forced_logits(base, ids, cont)
            rows.append(compare(base_logits, forced_logits(engine, ids, cont), cont, greedy(engine, ids, args.tokens)))
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
        mean["max_abs_logit_diff"] = max(r["max_abs_logit_diff"] for r in rows)
        mean["first_divergence"] = min(r["first_divergence"] for r in rows)
        print(f"{name:<16}" + "".join(f"{mean[k]:>20.4g}" for k in keys))
    print("(max_abs_logit_diff: max over prompts; first_divergence: earliest over prompts; the rest: means)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
