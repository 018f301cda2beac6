"""Stowage's engine on the CPU beside transformers (and optionally llama.cpp), on a SmolLM2-360M-shaped model.

    .venv/bin/python bench/engine_bench.py [--repeats 3] [--threads 2] [--llama-cpp] [--write-docs]

Builds the model once into --workdir (random bf16 weights; token ids are fed directly). Each
backend runs in a fresh process per repeat, so load time and peak RSS are its own: load, peak RSS,
private (anonymous) memory, prefill of a 512-token prompt, 128 greedy decode tokens after it, and
the time to first token of a second chat turn after a 2,000-token history, with the history's K/V
reused and recomputed. A separate process measures torch's memory read bandwidth at the same thread
count; decode is shown as a fraction of the roofline bandwidth / weight bytes per token. Medians of
--repeats runs. The default run takes about 5-10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402

CONTEXT_TOKENS = 4096
MiB = 1024**2


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 512
    decode_tokens: int = 128
    history_tokens: int = 2000
    turn1_tokens: int = 16
    turn2_new_tokens: int = 20


QUICK = Workload(prompt_tokens=64, decode_tokens=8, history_tokens=200, turn1_tokens=4, turn2_new_tokens=8)


def token_ids(n: int, stream: int) -> list[int]:
    """Fixed random ids clear of the tokenizer's special tokens; the same in every process."""
    rng = random.Random(1000 + stream)
    return [rng.randrange(10, common.SMOLLM2_360M["vocab_size"]) for _ in range(n)]


def prompts(w: Workload) -> tuple[list[int], list[int], list[int]]:
    """The prefill/decode prompt, the turn-1 history and turn 2's new tokens."""
    return token_ids(w.prompt_tokens, 1), token_ids(w.history_tokens, 2), token_ids(w.turn2_new_tokens, 3)


# -- workers: each runs in its own process and returns a flat dict of figures -------------------
def work_stowage(model_dir: Path, threads: int, w: Workload, profile: Path | None = None) -> dict:
    t = time.perf_counter()
    import torch

    from memory import anonymous_bytes
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.planning import plan_for
    from stowage.engine.runtime.sampler import SamplingParams

    common.set_threads(threads)
    r = {"import_s": time.perf_counter() - t, "torch": torch.__version__}
    anon = anonymous_bytes()
    t = time.perf_counter()
    engine = Engine.load(model_dir, plan_for(model_dir, CONTEXT_TOKENS, kv_disk_budget=0))  # pool.clear() drops
    r["load_s"] = time.perf_counter() - t
    r["private_load_mib"] = anonymous_bytes() / MiB
    kv_bytes = sum(d["kv_cache"] for d in engine.memory_report().values())
    r["kv_cache_mib"] = kv_bytes / MiB
    r["private_growth_mib"] = (anonymous_bytes() - anon - kv_bytes) / MiB  # the KV cache is not a weight copy
    engine.eos_ids = set()  # random weights: never stop early

    def generate(ids, max_tokens):
        return engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens)).run()

    generate(token_ids(64, 9), 4)  # warm-up: first calls build kernels and caches

    engine.pool.clear()  # each measurement starts with nothing cached
    prompt, history, new = prompts(w)
    res = generate(prompt, w.decode_tokens)
    assert len(res.token_ids) == w.decode_tokens, res.finish_reason
    r["prefill_tok_s"], r["decode_tok_s"] = res.prefill_tokens_per_s, res.decode_tokens_per_s

    engine.pool.clear()
    turn1 = generate(history, w.turn1_tokens)
    prompt2 = history + turn1.token_ids + new
    turn2 = generate(prompt2, 1)  # continues turn 1's conversation
    r["ttft2_s"], r["turn2_prefilled"], r["turn2_reused"] = turn2.first_token_seconds, turn2.prefilled_tokens, turn2.reused_tokens
    engine.pool.clear()
    again = generate(prompt2, 1)
    r["reprefill_s"], r["reprefill_prefilled"] = again.first_token_seconds, again.prefilled_tokens
    r["turn2_same_token"] = turn2.token_ids == again.token_ids
    r["peak_rss_mib"], r["private_end_mib"] = common.peak_rss_bytes() / MiB, anonymous_bytes() / MiB
    if profile:
        r |= profile_decode(engine, prompt, profile)
    return r


def profile_decode(engine, prompt: list[int], path: Path, steps: int = 16) -> dict:
    """Where a decode step's time goes: aten ops (by op) and the rest (Python, dispatch, non-aten kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stowage.engine.runtime.kv_cache import Sequence

    engine.pool.clear()  # the measurements' conversations: the cache is this sequence's
    seq = Sequence()
    engine.model.forward(prompt, seq, engine.cache)
    for _ in range(2):  # settle
        engine.model.forward([prompt[0]], seq, engine.cache)
    t = time.perf_counter()
    for _ in range(steps):
        engine.model.forward([prompt[0]], seq, engine.cache)
    plain_ms = (time.perf_counter() - t) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.model.forward([prompt[0]], seq, engine.cache)
        wall_ms = (time.perf_counter() - t) / steps * 1e3
    engine.cache.release(seq)
    events = prof.key_averages()
    ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    path.write_text(f"Stowage decode step at {len(prompt)} tokens of context, {steps} steps, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads\n"
                    f"step {plain_ms:.2f} ms without the profiler, {wall_ms:.2f} ms with it; inside aten ops "
                    f"{ops_ms:.2f} ms, outside them (Python, dispatch, profiler, kernels that are not aten ops) {wall_ms - ops_ms:.2f} ms\n\n"
                    + events.table(sort_by="self_cpu_time_total", row_limit=20) + "\n")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:5]
    return {"step_ms": plain_ms, "step_ops_ms": ops_ms * plain_ms / wall_ms, "step_outside_ms": (wall_ms - ops_ms) * plain_ms / wall_ms,
            "step_top_ops": ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / steps / ops_ms:.0%} ({e.count // steps} calls)" for e in top)}


class _Clock:
    """A generate() streamer that only notes when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True  # the first put is the prompt

    def end(self):
        pass


def work_transformers(model_dir: Path, threads: int, w: Workload) -> dict:
    t = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    from memory import anonymous_bytes

    common.set_threads(threads)
    r = {"import_s": time.perf_counter() - t, "torch": torch.__version__, "transformers": transformers.__version__}
    anon = anonymous_bytes()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    r["load_s"] = time.perf_counter() - t
    r["private_load_mib"] = anonymous_bytes() / MiB
    r["private_growth_mib"] = (anonymous_bytes() - anon) / MiB
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def ids(x):
        return torch.tensor([x])

    with torch.inference_mode():
        model.generate(ids(token_ids(64, 9)), min_new_tokens=4, max_new_tokens=4, **greedy)  # warm-up

        prompt, history, new = prompts(w)
        prompt = ids(prompt)
        t = time.perf_counter()
        model(input_ids=prompt, use_cache=True)
        r["prefill_tok_s"] = w.prompt_tokens / (time.perf_counter() - t)

        clock = _Clock()
        out = model.generate(prompt, min_new_tokens=w.decode_tokens, max_new_tokens=w.decode_tokens, streamer=clock, **greedy)
        assert out.shape[1] == w.prompt_tokens + w.decode_tokens
        r["decode_tok_s"] = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])

        cache = DynamicCache(config=model.config)
        out = model.generate(ids(history), past_key_values=cache, min_new_tokens=w.turn1_tokens,
                             max_new_tokens=w.turn1_tokens, return_dict_in_generate=True, **greedy)
        prompt2 = history + out.sequences[0, w.history_tokens:].tolist() + new
        cached = out.past_key_values.get_seq_length()
        t = time.perf_counter()
        turn2 = model.generate(ids(prompt2), past_key_values=out.past_key_values, max_new_tokens=1, **greedy)
        r["ttft2_s"] = time.perf_counter() - t
        r["turn2_reused"], r["turn2_prefilled"] = cached, len(prompt2) - cached
        t = time.perf_counter()
        again = model.generate(ids(prompt2), max_new_tokens=1, **greedy)
        r["reprefill_s"], r["reprefill_prefilled"] = time.perf_counter() - t, len(prompt2)
        r["turn2_same_token"] = turn2[0, -1].item() == again[0, -1].item()
    r["peak_rss_mib"], r["private_end_mib"] = common.peak_rss_bytes() / MiB, anonymous_bytes() / MiB
    return r


def work_llama_cpp(gguf_path: Path, threads: int, w: Workload) -> dict:
    t = time.perf_counter()
    import llama_cpp

    from memory import anonymous_bytes

    r = {"import_s": time.perf_counter() - t, "llama_cpp": llama_cpp.__version__}
    anon = anonymous_bytes()
    t = time.perf_counter()
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=CONTEXT_TOKENS, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, use_mmap=True, verbose=False)
    r["load_s"] = time.perf_counter() - t
    r["private_load_mib"] = anonymous_bytes() / MiB
    c = common.SMOLLM2_360M  # its f16 KV cache, cleared (so resident) when the context is made
    kv_bytes = CONTEXT_TOKENS * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"] * 2
    r["private_growth_mib"] = (anonymous_bytes() - anon - kv_bytes) / MiB

    def generate(prompt, max_tokens, fresh):
        """Token arrival times; llama-cpp-python reuses the longest cached prefix unless fresh."""
        if fresh:
            llm.reset()  # forget what is cached: generate() then evaluates the whole prompt
        times, tokens, start = [], [], time.perf_counter()
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # reset=True: reuse the prefix
            times.append(time.perf_counter())
            tokens.append(tok)
            if len(tokens) == max_tokens:
                break
        return start, times, tokens

    generate(token_ids(64, 9), 4, True)  # warm-up
    prompt, history, new = prompts(w)
    start, times, _ = generate(prompt, w.decode_tokens, True)
    r["prefill_tok_s"] = w.prompt_tokens / (times[0] - start)
    r["decode_tok_s"] = (len(times) - 1) / (times[-1] - times[0])

    _, _, turn1 = generate(history, w.turn1_tokens, True)
    prompt2 = history + turn1 + new
    # generate() fed turn1[:-1] back; the last sampled token is not in the cache yet, as in Stowage
    cached = llm.n_tokens
    start, times, tok2 = generate(prompt2, 1, False)
    r["ttft2_s"], r["turn2_reused"], r["turn2_prefilled"] = times[0] - start, cached, len(prompt2) - cached
    start, times, again = generate(prompt2, 1, True)
    r["reprefill_s"], r["reprefill_prefilled"] = times[0] - start, len(prompt2)
    r["turn2_same_token"] = tok2 == again
    r["peak_rss_mib"], r["private_end_mib"] = common.peak_rss_bytes() / MiB, anonymous_bytes() / MiB
    return r


def work_bandwidth(threads: int) -> dict:
    """Best-of-several read bandwidth of ~1 GiB: an fp32 sum and a bf16 matrix-vector product."""
    import torch

    common.set_threads(threads)
    r = {}
    x = torch.ones(2**28)  # 1 GiB fp32
    w = torch.full((2**17, 4096), 0.5, dtype=torch.bfloat16)  # 1 GiB bf16
    v = torch.ones(1, 4096, dtype=torch.bfloat16)
    for name, tensor, op in [("sum", x, lambda: x.sum()), ("matvec", w, lambda: torch.nn.functional.linear(v, w))]:
        best = float("inf")
        for _ in range(6):
            t = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t)
        r[f"{name}_gbps"] = tensor.numel() * tensor.element_size() / best / 1e9
    r["bandwidth_gbps"] = max(r["sum_gbps"], r["matvec_gbps"])
    return r


def work_runtime(threads: int) -> dict:
    """Peak RSS of the torch runtime alone (imports, a small matmul): the allowance over llama.cpp."""
    import torch

    import stowage.engine.runtime.engine  # noqa: F401

    common.set_threads(threads)
    torch.randn(256, 256, dtype=torch.bfloat16) @ torch.randn(256, 256, dtype=torch.bfloat16)
    return {"runtime_rss_mib": common.peak_rss_bytes() / MiB}


# -- the report ---------------------------------------------------------------------------------
def fmt(x, digits=2):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:,}"


def table(res: dict, bw: dict, weight_bytes: int, runtime_mib: float, has_llama: bool, w: Workload) -> str:
    """The markdown table: one row per figure, one column per backend, ratios and targets."""
    s, h, l = res["stowage"], res.get("transformers", {}), res.get("llama_cpp", {})
    roofline = bw["bandwidth_gbps"] * 1e9 / weight_bytes
    for r in (s, h, l):
        if "decode_tok_s" in r:
            r["roofline_frac"] = r["decode_tok_s"] / roofline

    def ratio(key, other):
        return s[key] / other[key] if other.get(key) else None

    def rs(key):
        return ratio(key, h)

    def rl(key):
        return ratio(key, l)

    def verdict(*checks):
        """'met' when every check holds; 'n/a' when one cannot be made (its figure is missing)."""
        if any(c is None for c in checks):
            return "n/a"
        return "met" if all(checks) else "**not met**"

    def at_least(x, bound):
        return None if x is None else x >= bound

    def at_most(x, bound):
        return None if x is None else x <= bound

    reuse_speedup = s["reprefill_s"] / s["ttft2_s"]
    decode_checks = [at_least(rs("decode_tok_s"), 2.5)] + ([at_least(rl("decode_tok_s"), 0.8)] if has_llama else [])
    rows = [
        ("load s", "load_s", 2, "≤ 1.5x llama.cpp", verdict(at_most(rl("load_s"), 1.5))),
        ("peak RSS MiB", "peak_rss_mib", 0, f"≤ llama.cpp + torch runtime ({runtime_mib:,.0f} MiB)",
         verdict(at_most(s["peak_rss_mib"], l["peak_rss_mib"] + runtime_mib) if l else None)),
        ("private MiB after load", "private_load_mib", 0, "", ""),
        ("private MiB growth in load (less KV cache)", "private_growth_mib", 0,
         f"< 10% of weights ({weight_bytes / MiB / 10:,.0f} MiB)", verdict(s["private_growth_mib"] < weight_bytes / MiB / 10)),
        ("private MiB at end", "private_end_mib", 0, "", ""),
        (f"prefill tok/s ({w.prompt_tokens})", "prefill_tok_s", 1, "≥ 1.0x transformers",
         verdict(at_least(rs("prefill_tok_s"), 1.0))),
        (f"decode tok/s ({w.decode_tokens})", "decode_tok_s", 1,
         "≥ 2.5x transformers" + (", ≥ 0.8x llama.cpp" if has_llama else ""), verdict(*decode_checks)),
        ("decode / roofline", "roofline_frac", 2, "", ""),
        ("turn-2 TTFT s", "ttft2_s", 3, f"≥ 10x below re-prefill (here {reuse_speedup:,.0f}x)", verdict(reuse_speedup >= 10)),
        ("re-prefill s", "reprefill_s", 2, "", ""),
    ]
    head = "| | Stowage | transformers |" + (" llama.cpp |" if has_llama else "") + " Stowage / transformers |" + \
        (" Stowage / llama.cpp |" if has_llama else "") + " target |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, key, digits, target, outcome in rows:
        cells = [label, fmt(s.get(key), digits), fmt(h.get(key), digits)]
        if has_llama:
            cells.append(fmt(l.get(key), digits))
        cells.append(fmt(rs(key)) + "x" if rs(key) is not None else "—")
        if has_llama:
            cells.append(fmt(rl(key)) + "x" if rl(key) is not None else "—")
        cells.append(f"{target}: {outcome}" if target else "")
        lines.append("| " + " | ".join(cells) + " |")
    counters = [f"{name}: turn 2 prefilled {r['turn2_prefilled']:,.0f} tokens, reused {r['turn2_reused']:,.0f}; "
                f"re-prefill {r['reprefill_prefilled']:,.0f}, same next token: {'yes' if r['turn2_same_token'] else 'no'}" for name, r in
                (("Stowage", s), ("transformers", h), ("llama.cpp", l)) if "turn2_prefilled" in r]
    lines += ["", f"Roofline: bandwidth {bw['bandwidth_gbps']:.1f} GB/s (fp32 sum {bw['sum_gbps']:.1f}, bf16 matvec "
              f"{bw['matvec_gbps']:.1f}) / {weight_bytes / 1e6:,.0f} MB of weights per token = {roofline:.1f} tok/s.",
              "", "Prefix reuse: " + "; ".join(counters) + "."]
    if "step_ms" in s:
        lines += ["", f"Stowage decode step (torch profiler, `--profile`): {s['step_ms']:.1f} ms, of which "
                  f"{s['step_ops_ms']:.1f} ms inside aten ops and {s['step_ms'] - s['step_ops_ms']:.1f} ms outside them "
                  f"(Python, dispatch, and any kernel that is not an aten op). Share of op time per step: {s['step_top_ops']}. The per-op table is in the workdir's "
                  "profile_stowage_decode.txt."]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out", help="where the model is built and cached")
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process runs per backend (medians reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch / llama.cpp threads")
    ap.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on a bf16 GGUF")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers (quick Stowage-only runs)")
    ap.add_argument("--quick", action="store_true", help=f"a smoke run with tiny prompts ({QUICK}); never written to the docs")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    ap.add_argument("--profile", action="store_true",
                    help="also profile Stowage's decode step (torch profiler) into WORKDIR/profile_stowage_decode.txt")
    ap.add_argument("--profile-to", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:  # inside a fresh process
        w = Workload(**json.loads(args.workload)) if args.workload else Workload()
        work = {"stowage": lambda: work_stowage(args.model, args.threads, w, args.profile_to),
                "transformers": lambda: work_transformers(args.model, args.threads, w),
                "llama_cpp": lambda: work_llama_cpp(args.model, args.threads, w),
                "bandwidth": lambda: work_bandwidth(args.threads),
                "runtime": lambda: work_runtime(args.threads)}[args.worker]
        args.result.write_text(json.dumps(work()))
        return

    if args.quick and args.write_docs:
        ap.error("--quick runs are smoke tests: they are not written to the docs")
    workload = QUICK if args.quick else Workload()
    started, load_before = time.perf_counter(), common.load_average()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = common.build_model(args.workdir)
    backends = {"stowage": model_dir}
    if not args.no_transformers:
        backends["transformers"] = model_dir
    llama_note = ""
    if args.llama_cpp:
        try:
            import gguf  # noqa: F401
            import llama_cpp  # noqa: F401
        except ImportError as e:
            llama_note = f"llama.cpp skipped: {e.name} is not importable (pip install llama-cpp-python gguf)"
            print(llama_note, file=sys.stderr)
        else:
            backends["llama_cpp"] = common.convert_gguf(model_dir)

    def worker(name, model=None):
        extra = ["--model", str(model), "--workload", json.dumps(asdict(workload))] if model else []
        if name == "stowage" and args.profile:
            extra += ["--profile-to", str(args.workdir / "profile_stowage_decode.txt")]
        return common.run_worker(HERE, ["--worker", name, "--threads", str(args.threads), *extra], threads=args.threads)

    runtime = worker("runtime")["runtime_rss_mib"]
    digests, revision = set(), common.source_state()[1]
    runs = {name: [] for name in backends} | {"bandwidth": []}
    for rep in range(args.repeats):  # interleaved, so that a burst of load hits every backend alike
        runs["bandwidth"].append(worker("bandwidth"))
        print(f"[{rep + 1}/{args.repeats}] bandwidth {runs['bandwidth'][-1]['bandwidth_gbps']:.1f} GB/s "
              f"(load {common.load_average()})", file=sys.stderr, flush=True)
        for name, path in backends.items():
            if name == "stowage":
                digests.add(common.source_state()[0])
            t = time.perf_counter()
            runs[name].append(worker(name, path))
            print(f"[{rep + 1}/{args.repeats}] {name}: {time.perf_counter() - t:.0f} s (load {common.load_average()}) "
                  + ", ".join(f"{k} {v:.3g}" for k, v in runs[name][-1].items() if isinstance(v, float)),
                  file=sys.stderr, flush=True)
    changed = ""
    if len(digests) > 1:
        changed = (f" **The engine's source changed during the run ({len(digests)} versions): its figures mix "
                   "versions; run again.**")
        print(changed.strip(" *"), file=sys.stderr)
    res = {name: common.medians(r) for name, r in runs.items()}
    bw = res.pop("bandwidth")
    wbytes = common.weight_bytes(model_dir)
    body = table(res, bw, wbytes, runtime, "llama_cpp" in res, workload)

    import torch

    versions = f"torch {torch.__version__}" + (f", transformers {res['transformers']['transformers']}" if "transformers" in res else "") \
        + (f", llama-cpp-python {res['llama_cpp']['llama_cpp']}" if "llama_cpp" in res else "")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    command = " ".join(["python", "bench/engine_bench.py", *(argv if argv is not None else sys.argv[1:])])
    header = (f"`{command}` — {datetime.date.today().isoformat()}, engine at {revision}, {cpu}, {args.threads} threads, {versions}; "
              f"load average {load_before} before, {common.load_average()} after; medians of {args.repeats} fresh "
              f"processes per backend; took {time.perf_counter() - started:.0f} s.{changed}")
    print(header + "\n\n" + body + ("\n\n" + llama_note if llama_note else ""))
    if args.write_docs:
        notes = "\n".join([
            "",
            "What each figure is (a SmolLM2-360M-shaped Llama, random bf16 weights, token ids fed directly):",
            "- load: `Engine.load(dir, plan_for(dir, 4096))` vs `AutoModelForCausalLM.from_pretrained"
            "(dir, dtype=torch.bfloat16)` vs `llama_cpp.Llama(gguf, n_ctx=4096)`; imports excluded, page cache warm.",
            "- peak RSS: the process's VmHWM at the end (mapped weights count once touched); private: `Anonymous` in "
            "`/proc/self/smaps_rollup`.",
            "- prefill: a 512-token prompt (Stowage: `generate`'s own prefill timing; transformers: one forward with "
            "`use_cache`; llama.cpp: time to its first token).",
            "- decode: 128 greedy tokens after that prompt, batch 1; tokens after the first / time between the first "
            "and the last (transformers: `generate` with a streamer noting each token's arrival).",
            "- turn-2 TTFT: after turn 1 (a 2,000-token prompt, 16 tokens generated), the same conversation gets "
            "history + reply + 20 new tokens; re-prefill is that prompt in a fresh conversation (transformers: "
            "`generate` with and without turn 1's `DynamicCache`).",
            "- roofline: torch's best read bandwidth over 1 GiB at the same thread count (best of 6, median over "
            "the repeats) / all stored weight bytes (the tied lm_head read once).",
            "- same next token: whether turn 2 with reuse picks the token a re-prefill picks. In bf16 a prompt "
            "split differently rounds differently (logits move by a few 0.01; in fp32 they agree to ~1e-6), so "
            "with random weights' near-flat logits a 'no' is rounding, not a reuse bug.",
            "- the machine is shared: compare columns of one run (ratios), not runs of different days.",
        ] + ([f"- {llama_note}."] if llama_note else []))
        common.write_section(common.ROOT / "docs" / "benchmarks.md", "## Engine (CPU)", header + "\n\n" + body + "\n" + notes)
        print("wrote docs/benchmarks.md", file=sys.stderr)


if __name__ == "__main__":
    main()
