"""Decode speed with a JSON schema (llguidance's token mask each step) against decode without one.

    .venv/bin/python -P bench/structured_bench.py [--runs 3] [--tokens 128] [--threads 2] [--write-docs]

Two models: the bundled demo model (assets/demo-model, 4.7M parameters, where a step is cheapest and the mask's
share largest) and the SmolLM2-135M shape (bench/common.py, random bf16 weights, 49,152 logits) given a byte-level
BPE tokenizer of 32,000 tokens trained here on Python source (the mask's cost grows with the tokenizer's vocabulary;
no real tokenizer is on this machine). Each run is one in-process reply of --tokens tokens at temperature 1 (seeded),
free, free with the mask threads woken each token (KINDS: this VM steps faster when a thread wakes each token), or
under SCHEMA (an array of >= 100 objects with a bounded string, an enum and an integer range), alternating, EOS
ignored so every reply has --tokens tokens. Decode tok/s: steps over the time of the two
parts of a step a constraint touches, the model's decode step and sampling (the mask's wait, applying it, advancing
the grammar), timed around the engine's own calls (StepClock); detokenizing is left out, as random weights at
temperature 1 write invalid UTF-8 whose held-back bytes make it cost more the longer a free reply runs. Medians of
--runs runs each; the target (issue 29): constrained >= 0.9x free (here: the woken free runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "size", "count"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"enum": ["small", "medium", "large"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 1000}}}}
PROMPT = "List the models on this machine as JSON: "
VOCAB = 32000
# free; free with the mask threads woken each token, as a constrained reply wakes them; under SCHEMA
KINDS = ("free", "woken", "schema")


def bpe_model(workdir: Path) -> Path:
    """The 135M shape with a trained 32k byte-level BPE tokenizer beside its weights (linked, not copied)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    base = common.build_model(workdir, shape="135m")
    model_dir = workdir / "smollm2-135m-shape-bpe32k"
    if (model_dir / "tokenizer.json").exists():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        if not (model_dir / name).exists():
            os.symlink(base / name, model_dir / name)
    files = [str(p) for p in sorted(Path(sys.prefix).rglob("*.py"))[:3000]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    return model_dir


class StepClock:
    """Seconds in the model's decode steps and in sampling (the mask's wait, applying it, advancing the grammar),
    wrapped around the engine's own calls: the two parts of a decode step that a constraint can change."""

    def __init__(self, engine):
        from stowage.engine.runtime.sampler import Sampler
        from stowage.engine.text import grammar

        self.forward = 0.0
        self.samples, self.waits = [], []  # seconds of each sampling call, of each wait for a mask
        decode_step, sample, disallowed = engine.model.decode_step, Sampler.__call__, grammar.Constraint.disallowed

        def timed(fn, add):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    add(time.perf_counter() - start)
            return call

        self.wake = False  # each sampling hands the mask threads an empty task, as a constrained reply hands a mask

        def woken(*args, **kwargs):
            if self.wake:
                grammar._masks.submit(int)  # the pool a constrained reply's masks are computed in
            return sample(*args, **kwargs)

        engine.model.decode_step = timed(decode_step, self._add_forward)
        Sampler.__call__ = timed(woken, self.samples.append)
        grammar.Constraint.disallowed = timed(disallowed, self.waits.append)

    def _add_forward(self, seconds):
        self.forward += seconds

    def reset(self):
        self.forward = 0.0
        self.samples.clear()
        self.waits.clear()


def measure(model_dir: Path, runs: int, tokens: int) -> dict:
    sys.path.insert(0, str(common.ROOT / "tests" / "support"))
    from factory import cpu_plan

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.sampler import SamplingParams
    from stowage.engine.text import grammar

    engine = Engine.load(model_dir, cpu_plan(model_dir, 1024))
    bound = grammar.bind(grammar.json_schema_grammar(SCHEMA), engine.tokenizer, engine.config.vocab_size,
                         engine.eos_ids)
    engine.eos_ids = set()  # every reply runs to `tokens`: a free one would stop at an early EOS
    prompt = engine.tokenizer.encode(PROMPT)
    clock = StepClock(engine)
    rates, waits = {k: [] for k in KINDS}, []
    sampling_us = {k: [] for k in KINDS}  # per run: (mean, median) of a token's sampling
    step_ms = {k: [] for k in KINDS}  # the model's decode step: the same computation in every kind of run
    for i in range(runs * len(KINDS) + len(KINDS)):  # the first round warms up
        kind = KINDS[i % len(KINDS)]
        params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=i,
                                grammar=bound if kind == "schema" else None)
        clock.reset()
        clock.wake = kind == "woken"
        result = engine.generate(prompt, params).run()
        assert result.completion_tokens == tokens, (result.finish_reason, result.text[-80:])
        steps = tokens - 1  # the first token is sampled from the prefill's logits
        if i >= len(KINDS):
            rates[kind].append(steps / (clock.forward + sum(clock.samples)))
            sampling_us[kind].append((statistics.mean(clock.samples) * 1e6, statistics.median(clock.samples) * 1e6))
            step_ms[kind].append(clock.forward / steps * 1e3)
            waits += clock.waits
    engine.close()
    rate = {k: statistics.median(v) for k, v in rates.items()}
    # per kind, the median over runs of a token's mean and of its median sampling time
    mean_us = {k: statistics.median(m for m, _ in v) for k, v in sampling_us.items()}
    median_us = {k: statistics.median(m for _, m in v) for k, v in sampling_us.items()}
    step = statistics.median(step_ms["woken"] + step_ms["schema"]) * 1e3  # µs
    return {"rate": rate, "ratio": rate["schema"] / rate["woken"], "runs": rates,
            "step_ms": {k: statistics.median(v) for k, v in step_ms.items()},
            # one model step plus each kind's sampling: the part a constraint adds
            "ratio_by_parts": (step + mean_us["free"]) / (step + mean_us["schema"]),
            "ratio_typical": (step + median_us["free"]) / (step + median_us["schema"]),
            "sample_us": mean_us, "sample_median_us": median_us,
            "mask_wait_us": statistics.median(waits) * 1e6, "vocab": engine.tokenizer.vocab_size,
            "logits": engine.config.vocab_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "stowage-bench")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    common.set_threads(args.threads)
    models = {"demo model (assets/demo-model)": common.ROOT / "assets" / "demo-model",
              "SmolLM2-135M shape, 32k BPE": bpe_model(args.workdir)}
    rows = []
    for name, model_dir in models.items():
        r = measure(model_dir, args.runs, args.tokens)
        print(json.dumps({"model": name, **r}), flush=True)
        mean, median, step, rate = r["sample_us"], r["sample_median_us"], r["step_ms"], r["rate"]
        rows.append(f"| {name} | {r['vocab']:,} / {r['logits']:,} | "
                    f"{step['free']:.2f} / {step['woken']:.2f} / {step['schema']:.2f} | "
                    f"{median['free']:.0f} / {median['schema']:.0f} | {mean['free']:.0f} / {mean['schema']:.0f} | "
                    f"{r['mask_wait_us']:.0f} | **{r['ratio_typical']:.2f}x** / {r['ratio_by_parts']:.2f}x | "
                    f"{rate['free']:.1f} / {rate['woken']:.1f} / {rate['schema']:.1f} (**{r['ratio']:.2f}x**) |")
    digest, state = common.source_state()
    body = "\n".join([
        f"`.venv/bin/python -P bench/structured_bench.py --runs {args.runs} --tokens {args.tokens} "
        f"--threads {args.threads} --write-docs` ({platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{args.threads}, load {common.load_average()}; engine {state}). Decode tok/s (the model's step and sampling, "
        f"bench/structured_bench.py StepClock) of one in-process reply of "
        f"{args.tokens} tokens at temperature 1, free and under a JSON schema (an array of >= 100 objects: a bounded "
        "string, an enum, an integer range), alternating, medians of "
        f"{args.runs} runs each after a warm-up round (EOS ignored, so every reply has {args.tokens} tokens). The "
        "mask for the next token is computed on a worker thread while the model's step runs (engine/text/grammar.py); "
        "`mask wait` is how long sampling still waited for it. Three kinds of run: free, free with the mask threads "
        "woken each token by an empty task (`woken`), and under the schema. On this VM the model's step is much faster "
        "when another thread wakes each token (a CPU left idle between steps wakes slowly), so a constrained run's "
        "step is faster than a free one's; `woken` runs pay that and nothing else, and are what a constrained run is "
        "compared with (the last column). `schema / free` by parts: one model step (the median of the woken and "
        "schema runs) plus each kind's sampling, its median token (the cost with a core to spare) and its mean (what "
        "this machine's load adds: a thread that waits its turn for a core), medians over runs.",
        "",
        "| model | tokenizer / logits | model step ms: free / woken / schema | sampling µs, median token: free / "
        "schema | mean token: free / schema | mask wait µs (median) | schema / free by parts: median / mean | "
        "tok/s free / woken / schema (schema / woken) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if args.write_docs:
        common.write_section(common.ROOT / "docs" / "benchmarks.md", "## Structured output (issue 29)", body)


if __name__ == "__main__":
    main()
