"""Concurrent requests with one system prompt: prompt tokens prefilled, time to first token and KV blocks held,
with the requests sharing the prompt's blocks (KVCache.share) and without.

    .venv/bin/python bench/prefix_sharing.py [--shape 360m] [--streams 4] [--system 600] [--tail 24] [--reply 16]
                                             [--threads 2] [--modes off,on]

In-process, as `stowage serve` runs it (engine/serving/scheduler.py, --streams sequences of system + tail + reply
tokens, no disk store): --streams requests, each --system random token ids in common and a --tail of its own, are
submitted together (admitted in one scheduler step, prefilled one after another) and decode --reply greedy tokens.
"off" is the engine with sharing taken out (KVCache.num_shareable answers 0: every request prefills its whole
prompt, as before block sharing); "on" is the engine as it is. Reports, per mode, the prompt tokens prefilled, each
request's time to first token (from submit, the scheduler's figure), the most KV blocks held at once, the wall time
and whether each reply's tokens are those of the other mode. One run per mode: on a shared 2-core machine, read
the times as an order of magnitude; the token and block counts are exact.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402


def measure(model_dir: Path, mode: str, prompts: list[list[int]], reply: int) -> dict:
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.generation import GenerationResult
    from stowage.engine.runtime.kv_cache import KVCache
    from stowage.engine.planning import plan_for
    from stowage.engine.planning.budgets import given_budgets
    from stowage.engine.runtime.sampler import SamplingParams
    from stowage.engine.serving.scheduler import Scheduler
    from stowage.engine.units import GiB

    shareable = KVCache.num_shareable
    if mode == "off":
        KVCache.num_shareable = lambda self, seq, num_tokens: 0
    try:
        context = -(-(max(map(len, prompts)) + reply + 1) // 16) * 16
        plan = plan_for(model_dir, context, given_budgets([], 64 * GiB), num_seqs=len(prompts), kv_disk_budget=0)
        engine = Engine.load(model_dir, plan)
        engine.eos_ids.clear()  # every reply runs to --reply tokens
        # the weights' pages and the kernels warmed, as on a server that ran before; then nothing cached
        engine.generate([7 + i for i in range(32)], SamplingParams(temperature=0, max_tokens=4)).run()
        engine.pool.clear()
        allocator, model = engine.cache.allocator, engine.model
        peak = [0]

        def counting(method):
            def call(*args):
                out = method(*args)
                peak[0] = max(peak[0], allocator.num_blocks - allocator.num_free)
                return out
            return call

        model.forward, model.decode_step = counting(model.forward), counting(model.decode_step)
        scheduler = Scheduler(engine, max_running=len(prompts), max_waiting=0)
        results: dict[int, object] = {}
        done = threading.Condition()

        def emitter(i):
            def emit(event):
                if isinstance(event, (GenerationResult, Exception)):
                    with done:
                        results[i] = event
                        done.notify_all()
            return emit

        greedy = SamplingParams(temperature=0, max_tokens=reply)
        for i, prompt in enumerate(prompts):
            scheduler.submit(prompt, greedy, emitter(i), threading.Event())
        start = time.perf_counter()
        scheduler.start()
        with done:
            done.wait_for(lambda: len(results) == len(prompts))
        wall = time.perf_counter() - start
        scheduler.close()
    finally:
        KVCache.num_shareable = shareable
    for r in results.values():
        if isinstance(r, Exception):
            raise r
    ordered = [results[i] for i in range(len(prompts))]
    ttft = [r.first_token_seconds for r in ordered]
    return {"mode": mode, "prefilled_tokens": [r.prefilled_tokens for r in ordered],
            "cached_tokens": [r.reused_tokens for r in ordered], "ttft_s": ttft,
            "ttft_median_s": statistics.median(ttft), "ttft_last_s": max(ttft), "peak_blocks": peak[0],
            "num_blocks": allocator.num_blocks, "wall_s": wall, "prefill_chunk": plan.prefill_chunk,
            "token_ids": [r.token_ids for r in ordered]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="360m", choices=sorted(common.SHAPES))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--system", type=int, default=600, help="tokens of the system prompt all requests share")
    ap.add_argument("--tail", type=int, default=24, help="tokens of each request's own part of the prompt")
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out")
    args = ap.parse_args()
    common.set_threads(args.threads)
    model_dir = common.build_model(args.workdir, shape=args.shape)
    rng = random.Random(0)
    system = [rng.randrange(100, 49000) for _ in range(args.system)]
    prompts = [system + [rng.randrange(100, 49000) for _ in range(args.tail)] for _ in range(args.streams)]
    load_before = common.load_average()
    results = [measure(model_dir, mode, prompts, args.reply) for mode in args.modes.split(",")]
    first = results[0]["token_ids"]
    for r in results:
        r["same_tokens"] = [a == b for a, b in zip(r.pop("token_ids"), first)]
        print(f"  {r['mode']}: prefilled {sum(r['prefilled_tokens'])} tokens, TTFT median {r['ttft_median_s']:.2f} s "
              f"last {r['ttft_last_s']:.2f} s, peak {r['peak_blocks']} blocks, wall {r['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
    out = {"shape": args.shape, "streams": args.streams, "system": args.system, "tail": args.tail,
           "reply": args.reply, "threads": args.threads, "load_average_before": load_before,
           "load_average_after": common.load_average(), "results": results}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
