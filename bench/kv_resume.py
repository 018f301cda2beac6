"""Switching back to a long chat: time to the first token, prefilled again vs its KV cache read from disk.

    .venv/bin/python bench/kv_resume.py [--shape 360m] [--tokens 4000] [--runs 3] [--threads 2]

In-process, as `stowage serve` runs it (engine/serving/scheduler.py, one sequence of --tokens + 512 context):
chat A (--tokens random token ids), then chat B of the same length, whose blocks need A's, so A is evicted;
then A's next turn (its history + its reply + 8 new tokens), B's, A's, ... one switch each run. With the disk
store off (--kv-disk-budget 0) every switch prefills the whole history again; with it, the evicted chat was
written to a file (engine/serving/kv_store.py) and is read back. "cold": the file's pages are dropped from the page
cache before the switch (fdatasync + posix_fadvise DONTNEED on that file only), so it is read from the disk.
Reports the medians of --runs switches, the write time at eviction, the file size and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402


def run(scheduler, prompt_ids, n):
    from stowage.engine.runtime.generation import GenerationResult

    done, out = threading.Event(), []

    def emit(event):
        if isinstance(event, (GenerationResult, Exception)):
            out.append(event)
            done.set()

    from stowage.engine.runtime.sampler import SamplingParams

    scheduler.submit(prompt_ids, SamplingParams(temperature=0, max_tokens=n), emit, threading.Event())
    done.wait()
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def timed(method, seconds: list[float]):
    def call(*args):
        start = time.perf_counter()
        result = method(*args)
        seconds.append(time.perf_counter() - start)
        return result

    return call


def drop_page_cache(kv_dir: Path) -> None:
    for path in kv_dir.glob("*/*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(model_dir: Path, mode: str, tokens: int, runs: int, reply: int) -> dict:
    from stowage.engine.runtime.engine import Engine
    from stowage.engine.planning import plan_for
    from stowage.engine.planning.budgets import detect_disk, given_budgets
    from stowage.engine.serving.scheduler import Scheduler
    from stowage.engine.units import GiB

    kv_dir = Path(tempfile.mkdtemp(prefix="kv-resume-"))
    budgets = given_budgets([], 64 * GiB, disk=detect_disk(kv_dir))
    context = -(-(tokens + 512) // 16) * 16
    plan = plan_for(model_dir, context, budgets, kv_disk_budget=0 if mode == "prefill" else 4 * GiB)
    engine = Engine.load(model_dir, plan)
    engine.eos_ids.clear()
    rng = random.Random(0)
    chats = [[rng.randrange(100, 49000) for _ in range(tokens)] for _ in range(2)]
    scheduler = Scheduler(engine, max_running=1, max_waiting=2).start()
    pool = scheduler.pool
    saves: list[float] = []
    loads: list[float] = []
    if pool.store is not None:  # time each write at eviction (it delays the other chat's first token) and read
        store = pool.store
        store.save, store.load = timed(store.save, saves), timed(store.load, loads)
    ttft, reused, prefilled = [], [], []
    try:
        for i, chat in enumerate(chats):
            result = run(scheduler, chat, reply)
            chats[i] = chat + result.token_ids
            print(f"  {mode}: chat {'AB'[i]} first prefill {result.first_token_seconds:.1f} s", file=sys.stderr,
                  flush=True)
        for r in range(runs):
            i = r % 2  # A, B, A, ...: the chat not touched last, evicted by the other
            if mode == "cold":
                drop_page_cache(kv_dir)
            result = run(scheduler, chats[i] + [rng.randrange(100, 49000) for _ in range(8)], reply)
            chats[i] = chats[i] + result.token_ids
            ttft.append(result.first_token_seconds)
            reused.append(result.reused_tokens)
            prefilled.append(result.prefilled_tokens)
            print(f"  {mode}: switch back to {'AB'[i]}: {result.first_token_seconds:.2f} s to the first token "
                  f"({result.reused_tokens} tokens cached, {result.prefilled_tokens} prefilled)", file=sys.stderr,
                  flush=True)
    finally:
        scheduler.close()
    sizes = [p.stat().st_size for p in kv_dir.glob("*/*.kv")]
    return {"mode": mode, "ttft_s": statistics.median(ttft), "ttft_runs_s": ttft, "reused_tokens": reused,
            "prefilled_tokens": prefilled, "save_s": statistics.median(saves) if saves else None,
            "load_s": statistics.median(loads) if loads else None, "load_runs_s": loads,
            "file_bytes": max(sizes) if sizes else None, "kv_dtype": plan.kv_dtype, "context": context}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="360m", choices=sorted(common.SHAPES))
    ap.add_argument("--tokens", type=int, default=4000, help="tokens of each chat's history")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reply", type=int, default=4, help="tokens of each reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="prefill,disk,cold")
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out")
    args = ap.parse_args()
    common.set_threads(args.threads)
    model_dir = common.build_model(args.workdir, shape=args.shape)
    load_before = common.load_average()
    results = [measure(model_dir, mode, args.tokens, args.runs, args.reply) for mode in args.modes.split(",")]
    out = {"shape": args.shape, "tokens": args.tokens, "threads": args.threads, "load_average_before": load_before,
           "load_average_after": common.load_average(), "results": results}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
