"""CPU decode side by side: Stowage's native decode step, llama.cpp and transformers on the same bf16 weights.

    .venv/bin/python bench/decode_bench.py [--shapes 135m,360m,1.7b] [--runs 3] [--long 16384] [--write-docs]

Real-shaped Llama models (SmolLM2-135M, -360M, -1.7B shapes, random bf16 weights; bench/common.py) as
safetensors for Stowage and transformers and as a bf16 GGUF for llama.cpp (llama-cpp-python). Each figure is
the median of --runs fresh processes; token ids are fed directly, greedy, EOS off. Cases:
  decode    tok/s of DECODE tokens after a PROMPT-token prompt (128 for the 1.7B shape), 1 and 2 threads;
            prefill tok/s of that prompt;
  long      decode tok/s after a --long-token context, as a fraction of decode after the short prompt (135m);
  busy      decode at 2 threads with one competing busy process (`python -c 'while 1: pass'`) started by
            this script and stopped after (360m).
Ratios are Stowage / peer; the engines' runs of a case alternate (measure). Takes about 20-30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402

PROMPT, DECODE = 512, 64
SHORT_PROMPT = {"1.7b": 128}  # its prefill alone would take most of a run
BUSY_SHAPE, LONG_SHAPE = "360m", "135m"


def prompt_ids(n: int, vocab: int) -> list[int]:
    return [(i * 7919 + 13) % (vocab - 20) + 10 for i in range(n)]


def work_stowage(model_dir: Path, threads: int, prompt: int, decode: int) -> dict:
    os.environ["STOWAGE_THREADS"] = str(threads)
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.planning import plan_for
    from stowage.engine.runtime.sampler import SamplingParams
    from stowage.kernels import cpu_decode

    common.set_threads(threads)
    engine = Engine.load(model_dir, plan_for(model_dir, prompt + decode + 16))
    engine.eos_ids = set()  # random weights: never stop early
    vocab = engine.config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=decode)
    engine.generate(prompt_ids(32, vocab)[::-1], SamplingParams(temperature=0, max_tokens=4)).run()
    res = engine.generate(prompt_ids(prompt, vocab), greedy).run()
    assert len(res.token_ids) == decode, res.finish_reason
    return {"prefill_tok_s": res.prefill_tokens_per_s, "decode_tok_s": res.decode_tokens_per_s,
            "kernels": cpu_decode.active()}


def work_llama_cpp(gguf_path: Path, threads: int, prompt: int, decode: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), n_ctx=prompt + decode + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, use_mmap=True, verbose=False)
    vocab = llm.n_vocab()

    def run(ids, n):
        llm.reset()
        times, start = [], time.perf_counter()
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return start, times

    run(prompt_ids(32, vocab)[::-1], 4)  # warm-up
    start, times = run(prompt_ids(prompt, vocab), decode)
    return {"prefill_tok_s": prompt / (times[0] - start), "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "llama_cpp": llama_cpp.__version__}


def work_transformers(model_dir: Path, threads: int, prompt: int, decode: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    common.set_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt_ids(32, vocab)]))  # warm-up
        ids = torch.tensor([prompt_ids(prompt, vocab)])
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = prompt / (time.perf_counter() - t)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(decode):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return {"prefill_tok_s": prefill, "decode_tok_s": decode / (time.perf_counter() - t)}


WORKERS = {"stowage": work_stowage, "llama_cpp": work_llama_cpp, "transformers": work_transformers}


def measure(cases: dict[str, tuple[str, Path, int, int]], threads: int, runs: int) -> dict[str, dict]:
    """Medians over `runs` fresh processes of each case (name: backend, path, prompt, decode tokens).

    The cases' runs alternate (a, b, a, b, ...): on a machine whose speed drifts over minutes (a VM beside busy
    neighbours), runs of one engine after the other's would put the drift into the ratio."""
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (backend, path, prompt, decode) in cases.items():
            args = ["--worker", backend, "--path", str(path), "--threads", str(threads), "--prompt", str(prompt),
                    "--decode", str(decode)]
            results[name].append(common.run_worker(HERE, args, threads=threads, timeout=1800))
    return {name: common.medians(r) for name, r in results.items()}


class Busy:
    """One process spinning on a core for as long as the `with` lasts."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", "while 1: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}x"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out")
    ap.add_argument("--shapes", default="135m,360m,1.7b")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--long", type=int, default=16384, help="context of the long case (0: skip it)")
    ap.add_argument("--no-busy", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--worker")
    ap.add_argument("--path", type=Path)
    ap.add_argument("--prompt", type=int)
    ap.add_argument("--decode", type=int)
    ap.add_argument("--result", type=Path)
    args = ap.parse_args(argv)
    if args.worker:
        threads = int(args.threads)
        args.result.write_text(json.dumps(WORKERS[args.worker](args.path, threads, args.prompt, args.decode)))
        return

    shapes, thread_counts = args.shapes.split(","), [int(t) for t in args.threads.split(",")]
    started, load = time.perf_counter(), common.load_average()
    digest, commit = common.source_state()
    models = {s: common.build_model(args.workdir, shape=s) for s in shapes}
    ggufs = {s: common.convert_gguf(m) for s, m in models.items()}
    rows, kernels = [], ""
    for shape in shapes:
        prompt = SHORT_PROMPT.get(shape, PROMPT)
        for threads in thread_counts:
            cases = {"stowage": ("stowage", models[shape], prompt, DECODE),
                     "llama_cpp": ("llama_cpp", ggufs[shape], prompt, DECODE)}
            if shape != "1.7b":
                cases["transformers"] = ("transformers", models[shape], prompt, 16)
            got = measure(cases, threads, args.runs)
            s, l, t = got["stowage"], got["llama_cpp"], got.get("transformers", {})
            kernels = s.get("kernels", kernels)
            rows.append(f"| {shape} | {threads} | {prompt} | {fmt(s['decode_tok_s'])} | {fmt(l['decode_tok_s'])} | "
                        f"**{ratio(s['decode_tok_s'], l['decode_tok_s'])}** | {fmt(t.get('decode_tok_s'))} | "
                        f"{fmt(s['prefill_tok_s'], 0)} | {fmt(l['prefill_tok_s'], 0)} | {fmt(t.get('prefill_tok_s'), 0)} | "
                        f"**{ratio(s['prefill_tok_s'], t.get('prefill_tok_s'))}** |")
            print(rows[-1], flush=True)
    extra = []
    if args.long and LONG_SHAPE in shapes:
        threads = max(thread_counts)
        fractions = {}
        for backend, path in (("stowage", models[LONG_SHAPE]), ("llama_cpp", ggufs[LONG_SHAPE])):
            got = measure({"short": (backend, path, PROMPT, DECODE), "long": (backend, path, args.long, 32)},
                          threads, args.runs)
            fractions[backend] = (got["short"]["decode_tok_s"], got["long"]["decode_tok_s"])
        extra += ["", f"Decode after a {args.long:,}-token context ({LONG_SHAPE}, {threads} threads), as a fraction of "
                      f"decode after {PROMPT}:", "",
                  "| | after 512 | after long | fraction |", "|---|---|---|---|"]
        for backend, (short, long) in fractions.items():
            extra.append(f"| {backend} | {fmt(short)} | {fmt(long)} | {long / short:.2f} |")
        print("\n".join(extra), flush=True)
    if not args.no_busy and BUSY_SHAPE in shapes:
        threads = max(thread_counts)
        with Busy():
            got = measure({"stowage": ("stowage", models[BUSY_SHAPE], PROMPT, DECODE),
                           "llama_cpp": ("llama_cpp", ggufs[BUSY_SHAPE], PROMPT, DECODE)}, threads, args.runs)
            s, l = got["stowage"], got["llama_cpp"]
        extra += ["", f"With one busy process on the machine ({BUSY_SHAPE}, {threads} threads): Stowage "
                      f"{fmt(s['decode_tok_s'])} tok/s, llama.cpp {fmt(l['decode_tok_s'])}: "
                      f"**{ratio(s['decode_tok_s'], l['decode_tok_s'])}**."]
        print(extra[-1], flush=True)
    body = "\n".join([
        f"`.venv/bin/python bench/decode_bench.py --shapes {args.shapes} --runs {args.runs} --long {args.long}"
        f"{' --no-busy' if args.no_busy else ''} --write-docs` on {datetime.date.today()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average before: {load}; "
        f"engine {commit} (source {digest}); Stowage's CPU decode step: {kernels}. Medians of {args.runs} fresh "
        f"processes, the engines' runs alternating; random bf16 weights of the named shapes, the same weights in "
        f"every engine (bf16 GGUF for llama.cpp); {DECODE} decode tokens (transformers: 16).", "",
        "| shape | threads | prompt | Stowage decode tok/s | llama.cpp | Stowage / llama.cpp | transformers | "
        "Stowage prefill tok/s | llama.cpp | transformers | Stowage / transformers |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows, *extra, "",
        f"The run took {(time.perf_counter() - started) / 60:.0f} minutes."])
    print(body)
    if args.write_docs:
        common.write_section(HERE.parents[1] / "docs" / "benchmarks.md", "## CPU decode step (issue 16)", body)


if __name__ == "__main__":
    main()
