"""`stowage serve` under concurrent streams: aggregate decode tokens/s and time to first token at 1, 4 and 8 streams.

    .venv/bin/python bench/serve_bench.py [--shape 360m] [--streams 1,4,8] [--runs 3] [--threads 2] [--write-docs]

A live `stowage serve --parallel 8` on 127.0.0.1 (the SmolLM2-360M shape, random bf16 weights,
bench/common.py) and the official `openai` client: N clients at once each stream a chat reply of --tokens
tokens (sampled at temperature 1 with a seed per stream: random weights decode their EOS token greedily at once;
a reply that still ends early counts the tokens it streamed) to a prompt of its own (~100
tokens, no shared prefix). The model's tokenizer is given one text token per id of the vocabulary
(`serving_dir`), so every generated token reaches its client as a chunk of its own and can be timed.

Aggregate decode tok/s: the tokens all clients received while every stream of the round was decoding (from the
last stream's first token to the first stream's last) over that window. Wall tok/s: all generated tokens over
the round's whole time, prefills and queueing included. TTFT per request (median, 95th percentile), the server's
figure. Medians of --runs rounds per stream count, one server for all of them. The target (issue 11): 8 streams
>= 4x the single-stream decode rate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()

import common  # noqa: E402

KEY = "bench-key"


def start_server(model_dir: Path, parallel: int, threads: int, context: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "STOWAGE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "stowage.engine.cli", "serve", str(model_dir), "--port", "0",
                             "--parallel", str(parallel), "--context", str(context), "--threads", str(threads)],
                            cwd=common.ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"the server printed no URL: {url!r}")
    return proc, url


def serving_dir(model_dir: Path) -> Path:
    """The benchmark model with a tokenizer of one text token per id (`<t123>` for id 123, past the test
    tokenizer's own), so each streamed token is a chunk; the weights are linked, not copied."""
    out = model_dir.with_name(model_dir.name + "-serve")
    stamp = out / ".complete"
    want = (model_dir / ".complete").read_text()
    if stamp.exists() and stamp.read_text() == want:
        return out
    from transformers import AutoTokenizer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).symlink_to(model_dir / name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok.add_tokens([f"<t{i}>" for i in range(len(tok), vocab)])
    tok.save_pretrained(out)
    stamp.write_text(want)
    return out


def one_stream(client, i: int, tokens: int, out: dict) -> None:
    try:
        _stream(client, i, tokens, out)
    except Exception as e:  # a thread's error would be lost: keep it for the round to raise
        out[i] = e


def _stream(client, i: int, tokens: int, out: dict) -> None:
    words = " ".join(f"w{(i * 131 + k) % 997}" for k in range(90))  # a prompt of its own: no shared prefix
    start = time.perf_counter()
    count, arrivals = 0, []
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": words}],
                                            max_tokens=tokens, temperature=1.0, seed=i, stream=True,
                                            stream_options={"include_usage": True})
    server_first = None
    for chunk in stream:
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content:  # a token's text (not the role's chunk, not prefill progress)
            arrivals.append(time.perf_counter())
        figures = (chunk.model_extra or {}).get("stowage") or {}
        if "first_token_seconds" in figures:
            server_first = figures["first_token_seconds"]
    end = time.perf_counter()
    if server_first is None or not arrivals:
        raise RuntimeError(f"stream {i} got no token (usage {count})")
    out[i] = {"start": start, "first": start + server_first, "end": end, "tokens": count, "arrivals": arrivals}


def round_of(url: str, streams: int, tokens: int) -> dict:
    import openai

    clients = [openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600) for _ in range(streams)]
    out: dict[int, dict] = {}
    threads = [threading.Thread(target=one_stream, args=(c, i, tokens, out)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in out.values() if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    ttft = sorted(r["first"] - r["start"] for r in out.values())
    begin, end = min(r["start"] for r in out.values()), max(r["end"] for r in out.values())
    # the window in which every stream was decoding: no prefill of this round runs in it (nothing waits)
    lo, hi = max(r["arrivals"][0] for r in out.values()), min(r["arrivals"][-1] for r in out.values())
    in_window = sum(sum(lo < t <= hi for t in r["arrivals"]) for r in out.values())
    if hi - lo <= 0 or in_window < streams:
        raise RuntimeError(f"the streams did not overlap (window {hi - lo:.3f} s): more --tokens")
    return {"decode_tok_s": in_window / (hi - lo), "tok_s": sum(r["tokens"] for r in out.values()) / (end - begin),
            "tokens": statistics.mean(r["tokens"] for r in out.values()),
            "ttft_median": statistics.median(ttft),
            "ttft_p95": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=HERE.parent / "out")
    ap.add_argument("--shape", default="360m", choices=sorted(common.SHAPES))
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    counts = [int(s) for s in args.streams.split(",")]
    model_dir = serving_dir(common.build_model(args.workdir, shape=args.shape))
    load, (digest, commit) = common.load_average(), common.source_state()
    started = time.perf_counter()
    proc, url = start_server(model_dir, max(counts), args.threads, 512)
    try:
        round_of(url, 1, 4)  # warm-up
        results = {n: common.medians([round_of(url, n, args.tokens) for _ in range(args.runs)]) for n in counts}
    finally:
        proc.terminate()
        proc.wait()
    base, wall_base = results[counts[0]]["decode_tok_s"], results[counts[0]]["tok_s"]
    rows = [f"| {n} | {r['tokens']:.0f} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / base:.2f}x | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / wall_base:.2f}x | {r['ttft_median'] * 1e3:.0f} ms | {r['ttft_p95'] * 1e3:.0f} ms |"
            for n, r in results.items()]
    body = "\n".join([
        f"`.venv/bin/python bench/serve_bench.py --shape {args.shape} --streams {args.streams} --tokens {args.tokens} "
        f"--runs {args.runs} --threads {args.threads} --write-docs` on {datetime.date.today()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average before: {load}; engine "
        f"{commit} (source {digest}). One `stowage serve --parallel {max(counts)}` (SmolLM2-{args.shape} shape, random "
        f"bf16); N concurrent `openai` clients, each a {args.tokens}-token sampled (temperature 1) streamed reply to its own ~100-token "
        f"prompt; medians of {args.runs} rounds. Time to first token: the server's figure, from a request's arrival "
        "(its queueing and prefill included). Decode tok/s: tokens received while every stream was decoding, over "
        "that window; wall tok/s: all tokens over the round's whole time, the N prefills included.", "",
        "| streams | tokens per reply (mean) | aggregate decode tok/s | vs 1 stream | wall tok/s | vs 1 stream | "
        "time to first token (median) | (95th percentile) |", "|---|---|---|---|---|---|---|---|", *rows, "",
        f"The run took {(time.perf_counter() - started) / 60:.0f} minutes."])
    print(body)
    if args.write_docs:
        common.write_section(HERE.parents[1] / "docs" / "benchmarks.md", "## Serving concurrent streams (issue 11)", body)


if __name__ == "__main__":
    main()
