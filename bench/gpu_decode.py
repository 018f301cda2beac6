"""End-to-end decode tokens/s on one GPU: Stowage vs transformers (eager), a 1.5B-shaped model, on the GPU and split.

    python bench/gpu_decode.py [--dry-run] [--out DIR] [--work DIR] [--prompt 512] [--decode 64]
                               [--split-decode 16] [--runs 3] [--only stowage-full ...]

Model: the Qwen2.5-1.5B shape (bench/gpu_plan_check.py) with random bf16 weights (std 0.02), written once
(3.1 GB). Each backend and placement runs in a fresh process: load, one short warm-up generation, then
`--runs` generations of greedy tokens after a `--prompt`-token prompt, each in a fresh conversation, EOS
ignored; the figures are the medians of the runs.
- full: Stowage plans with the GPU's real free memory (every layer and the head on the GPU; the
  embeddings stay on the CPU, as always); transformers loads with attn_implementation="eager" and moves
  the whole model to the GPU.
- split: Stowage plans with the GPU budget that holds exactly half the layers (the rest and the head on
  the CPU); transformers gets the same placement: each decoder layer on its plan device, a forward pre-hook
  moving its inputs there (what accelerate's device_map does, without needing accelerate).
Decode tok/s counts the tokens after the first over the time from the first to the last (Stowage: its
GenerationResult; transformers: a streamer noting each token's arrival after a device synchronize).
Target: Stowage fully on the GPU >= 2x transformers' eager decode. Stowage has no CUDA graphs yet, so its
GPU decode step is bound by kernel launches; this measures where it stands. About 1-2 minutes on an H200.

Writes gpu_decode.json and gpu_decode.md to the output folder ($OUT, else bench/out/gpu).

--dry-run (no GPU): a tiny Qwen2 on the CPU, the plan's GPU simulated by the CPU
(Engine.load(simulate={"cuda:0": "cpu"})), a few tokens per run: checks the plans, the code paths of
both backends and placements, and the output; its speeds mean nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from common import run_worker  # noqa: E402
from gpu_plan_check import QWEN2_5_1_5B, TINY_QWEN2, environment, output_dir, work_dir, write_model, \
    write_results  # noqa: E402
from stowage.engine.units import GiB  # noqa: E402

RESULT_NAME = "gpu_decode"
BACKENDS = ("stowage", "transformers")
PLACEMENTS = ("full", "split")
CONTEXT_TOKENS = 4096  # the plans' context: the prompt and every generated token fit
TARGET_RATIO = 2.0  # Stowage fully on the GPU vs transformers eager (the target)
SIMULATED = {"cuda:0": "cpu"}  # the dry run's stand-in for the GPU


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 512
    decode_tokens: int = 64  # fully on the GPU
    split_decode_tokens: int = 16  # split: the CPU layers make each token ~10x slower
    runs: int = 3

    def decode_for(self, placement: str) -> int:
        return self.decode_tokens if placement == "full" else self.split_decode_tokens


DRY_WORKLOAD = Workload(prompt_tokens=16, decode_tokens=4, split_decode_tokens=4, runs=3)


def token_ids(n: int, vocab_size: int, stream: int) -> list[int]:
    """Fixed random ids clear of the tokenizer's special tokens; the same in every process."""
    rng = random.Random(1000 + stream)
    return [rng.randrange(10, vocab_size) for _ in range(n)]


def plan_for_placement(model_dir: Path, placement: str, dry_run: bool):
    """full: this GPU's real budget (dry run: a roomy given one); split: a GPU budget that holds half the layers."""
    from stowage.engine.planning.budgets import Budgets, detect_budgets, given_budgets, gpu_budget
    from stowage.engine.planning.inspect import inspect
    from stowage.engine.planning.plan import PlanRequest, check, plan

    info = inspect(model_dir)
    budgets = given_budgets([64 * GiB], 64 * GiB) if dry_run else detect_budgets()
    if not budgets.gpus:
        raise SystemExit(f"no CUDA GPU: {budgets.note}")
    request = PlanRequest(CONTEXT_TOKENS, kv_disk_budget=0)  # no disk store: pool.clear() between runs only drops
    if placement == "split":
        gpu = budgets.gpus[0]
        half = plan(info, PlanRequest(CONTEXT_TOKENS, gpu_layers=info.num_layers // 2), budgets).devices[0]
        small = gpu_budget(0, half.total_bytes + gpu.reserve_bytes, name=gpu.name, safety_bytes=gpu.reserve_bytes)
        budgets = Budgets((small,), budgets.ram, f"given: GPU 0 as if {half.total_bytes + gpu.reserve_bytes:,} bytes were free")
    p = check(info, request, budgets)
    gpu_layers, cpu_layers = len(p.devices[0].layers), len(p.device("cpu").layers)
    wanted = (info.num_layers, 0) if placement == "full" else (info.num_layers // 2, info.num_layers - info.num_layers // 2)
    if (gpu_layers, cpu_layers) != wanted:
        raise SystemExit(f"{placement}: the plan put {gpu_layers} layers on the GPU and {cpu_layers} on the CPU, "
                         f"not {wanted[0]} and {wanted[1]}")
    return p


def placement_record(p) -> dict:
    from stowage.engine.planning.report import summary

    return {"summary": summary(p), "gpu_budget_bytes": p.devices[0].budget_bytes + p.devices[0].reserve_bytes,
            "gpu_layers": len(p.devices[0].layers), "cpu_layers": len(p.device("cpu").layers),
            "layer_devices": list(p.layer_devices), "embed_device": p.embed_device, "head_device": p.head_device}


def _median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# -- workers: each in its own process -----------------------------------------------------------
def work_stowage(model_dir: Path, placement: str, w: Workload, dry_run: bool) -> dict:
    import torch

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.sampler import SamplingParams

    p = plan_for_placement(model_dir, placement, dry_run)
    started = time.perf_counter()
    engine = Engine.load(model_dir, p, simulate=SIMULATED if dry_run else None)
    load_s = time.perf_counter() - started
    engine.eos_ids = set()  # random weights: never stop early
    vocab = engine.config.vocab_size
    decode = w.decode_for(placement)

    def generate(prompt, max_tokens):
        engine.pool.clear()  # nothing cached: each run prefills the whole prompt
        res = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)).run()
        if len(res.token_ids) != max_tokens:
            raise RuntimeError(f"generated {len(res.token_ids)} tokens, not {max_tokens} ({res.finish_reason})")
        return res

    generate(token_ids(min(64, w.prompt_tokens), vocab, 9), 4)  # warm-up: kernels compile, caches fill
    prompt = token_ids(w.prompt_tokens, vocab, 1)
    runs = []
    for _ in range(w.runs):
        res = generate(prompt, decode)
        runs.append({"decode_tok_s": res.decode_tokens_per_s, "prefill_tok_s": res.prefill_tokens_per_s})
    out = {"backend": "stowage", "placement": placement, "plan": placement_record(p), "load_s": load_s,
           "decode_tokens": decode, "runs": runs, **_median_of(runs), "torch": torch.__version__,
           "attention": engine.model.attention_kernels()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    engine.close()
    return out


class _Clock:
    """A generate() streamer that notes when each new token arrives (after the device has finished it)."""

    def __init__(self, sync):
        self.times: list[float] = []
        self._sync = sync
        self._prompt_seen = False

    def put(self, value):
        if self._prompt_seen:
            self._sync()
            self.times.append(time.perf_counter())
        self._prompt_seen = True  # the first put is the prompt

    def end(self):
        pass


def _moved(x, device):
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _moved(v, device) for k, v in x.items()}
    return x


def place_like_plan(model, p, devices: dict[str, str]) -> None:
    """Each decoder layer, the embeddings and the head on their plan devices; inputs follow each module."""
    import torch

    def follow(module, device):
        module.to(device)
        module.register_forward_pre_hook(lambda m, args, kwargs: (_moved(args, device), _moved(kwargs, device)),
                                         with_kwargs=True)

    inner = model.model
    embed, head = torch.device(devices[p.embed_device]), torch.device(devices[p.head_device])
    inner.embed_tokens.to(embed)
    inner.rotary_emb.to(embed)  # cos/sin are made beside the embeddings and follow each layer
    for layer, name in zip(inner.layers, p.layer_devices):
        follow(layer, torch.device(devices[name]))
    follow(inner.norm, head)
    if head != embed and model.lm_head.weight is inner.embed_tokens.weight:
        raise ValueError("a tied head away from the embeddings needs a copy of its own; this placement makes none")
    follow(model.lm_head, head)


def work_transformers(model_dir: Path, placement: str, w: Workload, dry_run: bool) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    gpu = "cpu" if dry_run else "cuda:0"
    out = {"backend": "transformers", "placement": placement, "transformers": transformers.__version__,
           "torch": torch.__version__}
    if placement == "full":
        model.to(gpu)
        device = gpu
    else:
        p = plan_for_placement(model_dir, placement, dry_run)
        place_like_plan(model, p, {"cpu": "cpu", "cuda:0": gpu})
        out["plan"] = placement_record(p)
        device = p.embed_device
    out["load_s"] = time.perf_counter() - started
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    vocab = model.config.vocab_size
    decode = w.decode_for(placement)

    def generate(prompt, max_tokens):
        ids = torch.tensor([prompt], device=device)
        clock = _Clock(sync)
        sync()
        t0 = time.perf_counter()
        result = model.generate(ids, min_new_tokens=max_tokens, max_new_tokens=max_tokens, streamer=clock, **greedy)
        if result.shape[1] != len(prompt) + max_tokens:
            raise RuntimeError(f"generated {result.shape[1] - len(prompt)} tokens, not {max_tokens}")
        first, last = clock.times[0], clock.times[-1]
        return {"decode_tok_s": (len(clock.times) - 1) / (last - first),
                "prefill_tok_s": len(prompt) / (first - t0)}

    with torch.inference_mode():
        generate(token_ids(min(64, w.prompt_tokens), vocab, 9), 4)
        prompt = token_ids(w.prompt_tokens, vocab, 1)
        runs = [generate(prompt, decode) for _ in range(w.runs)]
    out |= {"decode_tokens": decode, "runs": runs, **_median_of(runs)}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def worker(backend: str, placement: str, model_dir: str, result: str, w: Workload, dry_run: bool) -> None:
    import json

    work = work_stowage if backend == "stowage" else work_transformers
    Path(result).write_text(json.dumps(work(Path(model_dir), placement, w, dry_run)))


# -- the run ------------------------------------------------------------------------------------
def worker_args(backend: str, placement: str, model_dir: Path, w: Workload, dry_run: bool) -> list[str]:
    return (["--worker", backend, placement, str(model_dir), "--prompt", str(w.prompt_tokens), "--decode",
             str(w.decode_tokens), "--split-decode", str(w.split_decode_tokens), "--runs", str(w.runs)]
            + (["--dry-run"] if dry_run else []))


def report(record: dict) -> str:
    env, dry, res = record["environment"], record["mode"] == "dry-run", record["results"]
    gpu = next((r["gpu"] for r in res.values() if r.get("gpu")), "CPU (dry run)")
    w = record["workload"]
    lines = [f"### End-to-end decode (`bench/gpu_decode.py`{' --dry-run' if dry else ''})", "",
             f"{env['date']}, Stowage at {env['commit']}; {gpu}, {env['cpu_count']} CPU cores; torch {env['torch']}"
             + (f", transformers {next((r['transformers'] for r in res.values() if r.get('transformers')), '?')}" if res else "")
             + f". Model: {record['model_name']}, random bf16 weights; a {w['prompt_tokens']}-token prompt, greedy, "
             f"medians of {w['runs']} runs after a warm-up, each process fresh."
             + (" **Dry run: a tiny model on the CPU with the GPU simulated; the speeds mean nothing.**" if dry else ""), "",
             "| placement | decode tokens | Stowage decode tok/s | transformers eager decode tok/s | Stowage / transformers "
             "| Stowage prefill tok/s | transformers prefill tok/s | target |", "|---|---|---|---|---|---|---|---|"]
    for placement in PLACEMENTS:
        s, t = res.get(f"stowage-{placement}"), res.get(f"transformers-{placement}")
        if not (s or t):
            continue
        where = s or t
        plan = where.get("plan")
        label = "fully on the GPU" if placement == "full" else "split"
        if plan:
            label += f" ({plan['gpu_layers']} GPU / {plan['cpu_layers']} CPU layers)"
        ratio = record["ratios"].get(placement)
        target = ""
        if placement == "full" and ratio is not None and not dry:
            target = f"≥ {TARGET_RATIO:g}x: " + ("met" if ratio >= TARGET_RATIO else "**not met**")
        lines.append(f"| {label} | {where['decode_tokens']} | {_fmt(s, 'decode_tok_s')} | {_fmt(t, 'decode_tok_s')} "
                     f"| {f'{ratio:.2f}x' if ratio is not None else '—'} | {_fmt(s, 'prefill_tok_s', ',.0f')} "
                     f"| {_fmt(t, 'prefill_tok_s', ',.0f')} | {target} |")
    for key, r in res.items():
        if r.get("error"):
            lines += ["", f"{key} failed: {r['error'].strip().splitlines()[-1][:300]}"]
    return "\n".join(lines)


def _fmt(r: dict | None, key: str, spec: str = ",.1f") -> str:
    return "—" if not r or key not in r else format(r[key], spec)


def run(args, w: Workload) -> int:
    out_dir, models = output_dir(args.out), work_dir(args.work)
    config, name = (TINY_QWEN2, "a tiny Qwen2 (4 layers, hidden 64)") if args.dry_run else \
        (QWEN2_5_1_5B, "the Qwen2.5-1.5B shape")
    print(f"writing {name} with random weights under {models} ...", file=sys.stderr, flush=True)
    model_dir = write_model(models / ("tiny-qwen2" if args.dry_run else "qwen2.5-1.5b-shape-random"), config, sparse=False)
    record = {"mode": "dry-run" if args.dry_run else "gpu", "environment": environment(), "model": config,
              "model_name": name, "workload": asdict(w), "results": {}, "ratios": {}}
    failed = 0
    for key in args.only or [f"{b}-{p}" for p in PLACEMENTS for b in BACKENDS]:
        backend, placement = key.split("-")
        command = worker_args(backend, placement, model_dir, w, args.dry_run)
        print(f"{key}: {sys.executable} {Path(__file__).relative_to(ROOT)} {' '.join(command)} --result FILE",
              file=sys.stderr, flush=True)
        try:
            r = run_worker(Path(__file__), command, threads=os.cpu_count() or 1, timeout=args.worker_timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            r, failed = {"backend": backend, "placement": placement, "error": str(e)[-3000:]}, failed + 1
        record["results"][key] = r
        for placement_ in PLACEMENTS:
            s, t = record["results"].get(f"stowage-{placement_}"), record["results"].get(f"transformers-{placement_}")
            if s and t and "decode_tok_s" in s and "decode_tok_s" in t:
                record["ratios"][placement_] = s["decode_tok_s"] / t["decode_tok_s"]
        print(f"  {key}: " + (f"decode {r['decode_tok_s']:.1f} tok/s (runs: "
                              + ", ".join(f"{x['decode_tok_s']:.1f}" for x in r["runs"]) + ")"
                              if "decode_tok_s" in r else "failed: " + r["error"].strip().splitlines()[-1][:300]),
              file=sys.stderr, flush=True)
        write_results(out_dir, RESULT_NAME, record, report(record))
    text = report(record)
    print(text)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: a tiny model on the CPU, the GPU simulated")
    parser.add_argument("--out", type=Path, help="output folder (default: $OUT, else bench/out/gpu)")
    parser.add_argument("--work", type=Path, help="model folder (default: $STOWAGE_GPU_WORK, else bench/out/gpu-models)")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 512; dry run 16)")
    parser.add_argument("--decode", type=int, help="tokens generated fully on the GPU (default 64; dry run 4)")
    parser.add_argument("--split-decode", type=int, help="tokens generated split GPU/CPU (default 16; dry run 4)")
    parser.add_argument("--runs", type=int, help="generations per backend and placement (default 3)")
    parser.add_argument("--only", nargs="+", choices=[f"{b}-{p}" for b in BACKENDS for p in PLACEMENTS])
    parser.add_argument("--worker-timeout", type=float, default=60, help="seconds for one backend's process")
    parser.add_argument("--worker", nargs=3, metavar=("BACKEND", "PLACEMENT", "MODEL_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    base = DRY_WORKLOAD if args.dry_run else Workload()
    w = Workload(args.prompt or base.prompt_tokens, args.decode or base.decode_tokens,
                 args.split_decode or base.split_decode_tokens, args.runs or base.runs)
    if args.worker:
        worker(*args.worker, args.result, w, args.dry_run)
        return 0
    if not args.dry_run:
        import torch

        if not (torch.version.cuda and torch.cuda.is_available()):
            print("bench/gpu_decode.py needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run checks it on "
                  "the CPU", file=sys.stderr)
            return 2
    return run(args, w)


if __name__ == "__main__":
    sys.exit(main())
