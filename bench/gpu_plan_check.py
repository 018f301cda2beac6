"""Predicted vs measured VRAM per device: a 1.5B-shaped model under small GPU budgets that force a split.

    python bench/gpu_plan_check.py [--dry-run] [--out DIR] [--work DIR] [--only NAME ...] [--record FILE]

The model has the Qwen2.5-1.5B shape (28 layers, hidden 1536, 12 heads / 2 KV heads, intermediate 8960,
vocab 151,936, tied embeddings), written as a sparse safetensors file: its data are holes that read as
zeros, so the bytes are a real download's and the file costs no disk. Twelve plans: a GPU budget of 2, 4
or 8 GiB ("plan as if the GPU had that much free": the 512 MiB safety buffer comes off it, as
`stowage plan --gpu-budget` does), 8,192 or 32,768 tokens, a bf16 or an fp8 KV cache. 2 and 4 GiB split
the layers between the GPU and the CPU; 8 GiB holds them all and the head.

Each plan is loaded in a fresh process (NVML's baseline is clean and the CUDA context is counted) by
bench/plan_check.py check_plan, which runs the heaviest prefill chunk (the last one of the full context).
Per device: predicted and measured bytes (GPU: NVML used-memory growth since before torch started; CPU:
peak resident growth) and the error; per GPU also torch's peak allocated and reserved bytes, the measured
CUDA overhead (NVML growth - peak reserved: the context and kernel images, outside torch's allocator) and
the overhead that would have made the forecast exact (NVML growth - the plan's other terms).
engine/planning/workspace.py CUDA_OVERHEAD_BYTES (640 MiB, "not yet measured") is what the first replaces.

Writes gpu_plan_check.json and gpu_plan_check.md to the output folder ($OUT, else bench/out/gpu) after
every plan, so a run cut short keeps what it measured. About two minutes on an H200.

--dry-run (no GPU needed): writes the model, makes every plan with the same budgets, checks that each
splits as intended, prints the command each plan's worker would run, and runs check_plan on a tiny
CPU-only model (the measuring path and the records it feeds). Exit status 1 if a plan is not as intended
or a GPU worker failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the model writers the tests use

from common import run_worker, source_state, write_section  # noqa: E402
from stowage.engine.units import GiB, MiB  # noqa: E402  (no torch: the orchestrator must not touch CUDA)

# Qwen2.5-1.5B's config.json, the parts Stowage and transformers read.
QWEN2_5_1_5B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "use_sliding_window": False,
}
# The same family at a size the CPU runs in a second: the dry runs' stand-in.
TINY_QWEN2 = {**QWEN2_5_1_5B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
MODEL_VERSION = 1  # bump when write_model's files change, so cached copies are rebuilt
SPLIT_BUDGETS_GIB = (2, 4)  # these split the 1.5B shape's layers; 8 GiB holds every layer and the head
RESULT_NAME = "gpu_plan_check"


# -- where things go ----------------------------------------------------------------------------
def output_dir(given: Path | None = None) -> Path:
    """Results: --out, else $OUT (the GPU machine's returned folder), else bench/out/gpu."""
    path = given or Path(os.environ.get("OUT") or ROOT / "bench" / "out" / "gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def work_dir(given: Path | None = None) -> Path:
    """Model folders (gigabytes on the GPU run: never under the output folder, which travels back)."""
    path = given or Path(os.environ.get("STOWAGE_GPU_WORK") or ROOT / "bench" / "out" / "gpu-models")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_model(model_dir: Path, config: dict, *, sparse: bool, seed: int = 0) -> Path:
    """config.json, tokenizer files and weights: holes (sparse) or random bf16 (std 0.02, norms 1); reused once written."""
    stamp = model_dir / ".complete"
    want = json.dumps({"version": MODEL_VERSION, "config": config, "sparse": sparse, "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return model_dir
    from factory import save_tokenizer
    from sparse_models import tensor_shapes, write_sparse_model

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=model_dir.parent))
    if sparse:
        write_sparse_model(tmp, config)
    else:
        import torch
        from safetensors.torch import save_file

        # On the GPU when there is one: 1.5B normal samples take seconds there, a minute on a few cores.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        tensors = {}
        for name, shape in tensor_shapes(config).items():
            if "norm" in name:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                x = torch.randn(shape, generator=gen, device=device).mul_(0.02)
                tensors[name] = x.to(torch.bfloat16).cpu()
        if device == "cuda":
            torch.cuda.empty_cache()  # the caller measures nothing, but its workers share the GPU
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(tmp)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    stamp.write_text(want)
    return model_dir


def environment() -> dict:
    """What the figures were measured with; the GPU through NVML, so this process makes no CUDA context."""
    import torch

    from stowage.engine.planning.gpus import NvmlGpus

    nvml = NvmlGpus()
    nvml.close()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    digest, commit = source_state()
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit, "source_digest": digest,
            "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version, "cpu_count": os.cpu_count(),
            "gpus": [{"device": g.device, "name": g.name, "total_bytes": g.total_bytes} for g in nvml.gpus],
            "gpu_note": nvml.note}


def write_results(out_dir: Path, name: str, record: dict, markdown: str) -> None:
    """NAME.json and NAME.md in the output folder, each replaced whole (a reader never sees half a file)."""
    for suffix, text in ((".json", json.dumps(record, indent=2)), (".md", markdown.rstrip() + "\n")):
        tmp = out_dir / (name + suffix + ".partial")
        tmp.write_text(text)
        os.replace(tmp, out_dir / (name + suffix))


# -- the plans ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One plan: a GPU budget, a context, a KV dtype."""

    gpu_budget_gib: int
    context_tokens: int
    kv_dtype: str  # "bfloat16" or "fp8"

    @property
    def name(self) -> str:
        kv = "bf16" if self.kv_dtype == "bfloat16" else self.kv_dtype
        return f"{self.gpu_budget_gib}GiB-{self.context_tokens // 1024}k-{kv}"

    @property
    def expect_split(self) -> bool:
        return self.gpu_budget_gib in SPLIT_BUDGETS_GIB


# All-GPU first (the cleanest reading of the CUDA overhead), then the splits; bf16 before fp8 and 8k before
# 32k, so a run cut short has the plainest cases.
SCENARIOS = [Scenario(b, t, kv) for kv in ("bfloat16", "fp8") for t in (8192, 32768) for b in (8, 2, 4)]
BY_NAME = {s.name: s for s in SCENARIOS}


def budgets_for(s: Scenario, ram, gpu_name: str = "GPU"):
    """GPU 0 as if `gpu_budget_gib` were free (the default safety buffer comes off it), and this RAM budget."""
    from stowage.engine.planning.budgets import Budgets, gpu_budget

    return Budgets((gpu_budget(0, s.gpu_budget_gib * GiB, name=gpu_name),), ram,
                   f"given: GPU 0 as if {s.gpu_budget_gib} GiB were free")


def make_plan(model_dir: Path, s: Scenario, ram, gpu_name: str = "GPU"):
    from stowage.engine.planning.inspect import inspect
    from stowage.engine.planning.plan import PlanRequest, plan

    return plan(inspect(model_dir), PlanRequest(s.context_tokens, kv_dtype=s.kv_dtype), budgets_for(s, ram, gpu_name))


def split_problem(p, s: Scenario) -> str | None:
    """None when the plan fits and places layers as the scenario intends; else what is wrong."""
    if not p.fits:
        return f"{s.name}: the plan does not fit: {p.error}"
    gpu, cpu = len(p.devices[0].layers), len(p.device("cpu").layers)
    if s.expect_split and not (gpu and cpu):
        return f"{s.name}: expected layers on both devices, got {gpu} on the GPU and {cpu} on the CPU"
    if not s.expect_split and (cpu or p.head_device == "cpu"):
        return f"{s.name}: expected every layer and the head on the GPU, got {cpu} layers on the CPU, head on {p.head_device}"
    return None


def plan_record(p) -> dict:
    """`stowage plan --json`'s object and table, with each device's workspace by term."""
    from stowage.engine.planning.report import format_table, to_dict

    record = to_dict(p) | {"table": format_table(p)}
    for d, rec in zip(p.devices, record["devices"]):
        rec |= {"activations_bytes": d.workspace.activations_bytes, "logits_bytes": d.workspace.logits_bytes,
                "overhead_bytes": d.workspace.overhead_bytes}
    return record


def check_record(check, device_plan: dict, context_bytes: int = 0) -> dict:
    """A DeviceCheck as JSON, with what the GPU rows derive from it.

    `context_bytes`: NVML growth between the worker's start and check_plan's baseline (a CUDA context made
    by the planning itself); counted in `measured_bytes`, since the plan must cover it too."""
    rec = dict(check.__dict__) | {"describe": check.describe()}
    measured = check.peak_bytes + context_bytes
    predicted = check.predicted_bytes
    rec |= {"measured_bytes": measured, "error": (measured - predicted) / predicted,
            "under_by_more_than_safety": measured - predicted > device_plan["reserve_bytes"],
            "reserve_bytes": device_plan["reserve_bytes"]}
    if check.device.startswith("cuda"):
        rec["context_before_baseline_bytes"] = context_bytes
        rec["measured_overhead_bytes"] = measured - check.reserved_peak_bytes
        rec["exact_overhead_bytes"] = measured - (predicted - device_plan["overhead_bytes"])
    return rec


# -- the GPU run --------------------------------------------------------------------------------
def worker(model_dir: str, name: str, result: str) -> None:
    """One plan in this fresh process: plan on this machine, load, run the heaviest chunk, measure."""
    from stowage.engine.planning.gpus import used_bytes

    before_torch = used_bytes("cuda:0")  # nothing of this process on the GPU yet
    import torch

    from plan_check import check_plan
    from stowage.engine.planning.budgets import detect_gpus, detect_ram

    gpus, note = detect_gpus()
    if not gpus:
        raise SystemExit(f"no CUDA GPU: {note}")
    s = BY_NAME[name]
    p = make_plan(Path(model_dir), s, detect_ram(), gpus[0].name)
    problem = split_problem(p, s)
    if problem:
        raise SystemExit(problem)
    baseline = used_bytes("cuda:0")  # check_plan takes its own baseline right after this
    started = time.perf_counter()
    checks = check_plan(model_dir, p)
    record = plan_record(p)
    by_device = {d["device"]: d for d in record["devices"]}
    out = {"scenario": name, "plan": record, "seconds": time.perf_counter() - started,
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nvml_before_torch_bytes": before_torch, "nvml_at_baseline_bytes": baseline,
           "checks": [check_record(c, by_device[c.device], baseline - before_torch if c.device.startswith("cuda") else 0)
                      for c in checks]}
    Path(result).write_text(json.dumps(out))


def worker_command(model_dir: Path, s: Scenario) -> list[str]:
    return [sys.executable, str(Path(__file__).relative_to(ROOT)), "--worker", str(model_dir), s.name]


def overhead_summary(results: list[dict]) -> dict:
    """The measured CUDA overhead over every plan that ran, and the constant it suggests."""
    from stowage.engine.planning.workspace import CUDA_OVERHEAD_BYTES

    gpu = [c for r in results for c in r.get("checks", []) if c["device"].startswith("cuda")]
    measured = [c["measured_overhead_bytes"] for c in gpu]
    summary = {"current_bytes": CUDA_OVERHEAD_BYTES, "num_plans": len(gpu)}
    if measured:
        suggested = -(-max(measured) // MiB) * MiB  # the largest seen, rounded up to a MiB
        summary |= {"min_bytes": min(measured), "max_bytes": max(measured), "suggested_bytes": suggested,
                    "errors_with_suggested": {r["scenario"]: (c["measured_bytes"] - (c["predicted_bytes"] - CUDA_OVERHEAD_BYTES + suggested))
                                              / (c["predicted_bytes"] - CUDA_OVERHEAD_BYTES + suggested)
                                              for r in results for c in r.get("checks", []) if c["device"].startswith("cuda")}}
    return summary


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:,.0f} MiB"


def report(record: dict) -> str:
    """The markdown section: one row per device per plan, then the overhead and the targets."""
    env, dry = record["environment"], record["mode"] == "dry-run"
    gpu_name = next((r["gpu"] for r in record["scenarios"] if r.get("gpu")), None) or \
        (env["gpus"][0]["name"] if env["gpus"] else "no GPU")
    lines = [f"### Forecast vs measured memory per device (`bench/gpu_plan_check.py`{' --dry-run' if dry else ''})", "",
             f"{env['date']}, Stowage at {env['commit']}; {gpu_name}; torch {env['torch']} (CUDA {env['cuda']}), "
             f"triton {env['triton']}. Model: the Qwen2.5-1.5B shape, bf16, sparse file; the heaviest prefill chunk of "
             "each plan's full context. GPU measured: NVML used-memory growth from before torch started; CPU: peak "
             "resident growth." + (" **Dry run: plans only, nothing measured.**" if dry else ""), "",
             "| plan | layers GPU / CPU | device | predicted | measured | error | torch peak allocated | reserved "
             "| CUDA overhead (NVML − reserved) | overhead for an exact forecast |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["scenarios"]:
        plan = r.get("plan")
        if plan is None:
            lines.append(f"| {r['scenario']} | | | | **failed** | {r.get('error', '').splitlines()[-1][:120] if r.get('error') else ''} | | | | |")
            continue
        split = " / ".join(str(len(d["layers"])) for d in plan["devices"])
        checks = {c["device"]: c for c in r.get("checks", [])}
        for d in plan["devices"]:
            c = checks.get(d["device"], {})
            gpu = d["device"].startswith("cuda")
            error = f"{c['error']:+.1%}" if c else "—"
            lines.append(f"| {r['scenario']} | {split} | {d['device']} | {_mib(d['total_bytes'])} "
                         f"| {_mib(c.get('measured_bytes'))} | {error} "
                         f"| {_mib(c.get('allocated_peak_bytes')) if gpu else ''} | {_mib(c.get('reserved_peak_bytes')) if gpu else ''} "
                         f"| {_mib(c.get('measured_overhead_bytes')) if gpu else ''} | {_mib(c.get('exact_overhead_bytes')) if gpu else ''} |")
    o = record["overhead"]
    lines.append("")
    if o.get("num_plans"):
        worst = max((c for r in record["scenarios"] for c in r.get("checks", [])), key=lambda c: abs(c["error"]))
        within = all(abs(c["error"]) <= 0.05 for r in record["scenarios"] for c in r.get("checks", []))
        safe = not any(c["under_by_more_than_safety"] for r in record["scenarios"] for c in r.get("checks", []))
        lines += [f"CUDA overhead (NVML growth − torch's peak reserved) over {o['num_plans']} plans: "
                  f"{_mib(o['min_bytes'])} to {_mib(o['max_bytes'])}; `CUDA_OVERHEAD_BYTES` is {_mib(o['current_bytes'])} "
                  f"(not yet measured): put **{o['suggested_bytes'] // MiB} * MiB** there. With it the GPU errors would be "
                  + ", ".join(f"{k} {v:+.1%}" for k, v in o["errors_with_suggested"].items()) + ".", "",
                  f"Targets: every device within 5% of measured: {'met' if within else '**not met**'} (worst: "
                  f"{worst['device']} {worst['error']:+.1%}); never under by more than the safety buffer: "
                  f"{'met' if safe else '**not met**'}."]
    elif dry:
        lines.append("Every plan splits as intended: " + ("yes" if not record.get("problems") else
                                                          "**no**: " + "; ".join(record["problems"])) + ".")
    return "\n".join(lines)


def run(args) -> int:
    out_dir, models = output_dir(args.out), work_dir(args.work)
    selected = [BY_NAME[n] for n in args.only] if args.only else SCENARIOS
    print(f"writing the Qwen2.5-1.5B-shaped sparse model under {models} ...", file=sys.stderr, flush=True)
    model_dir = write_model(models / "qwen2.5-1.5b-shape-sparse", QWEN2_5_1_5B, sparse=True)
    record = {"mode": "dry-run" if args.dry_run else "gpu", "environment": environment(), "model": QWEN2_5_1_5B,
              "model_dir": str(model_dir), "scenarios": [], "problems": []}
    if args.dry_run:
        from stowage.engine.planning.budgets import ram_budget
        from stowage.engine.planning.report import summary

        ram = ram_budget(120 * GiB)  # about what the 128 GiB GPU machine has available
        for s in selected:
            p = make_plan(model_dir, s, ram)
            problem = split_problem(p, s)
            record["problems"] += [problem] if problem else []
            print(f"{s.name}: {summary(p)}{'' if problem is None else '  <-- ' + problem}")
            print("  GPU run: " + " ".join(worker_command(model_dir, s)) + " --result FILE")
            record["scenarios"].append({"scenario": s.name, "expect_split": s.expect_split, "plan": plan_record(p),
                                        "split_ok": problem is None, "worker_command": worker_command(model_dir, s)})
        record["cpu_check"] = cpu_check(models)
        print(f"check_plan on a tiny CPU-only model: " + "; ".join(c["describe"] for c in record["cpu_check"]["checks"]))
    else:
        threads = min(16, os.cpu_count() or 1)
        for s in selected:
            print(f"{s.name}: " + " ".join(worker_command(model_dir, s)), file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                r = run_worker(Path(__file__), ["--worker", str(model_dir), s.name], threads=threads,
                               timeout=args.worker_timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                r = {"scenario": s.name, "error": str(e)[-3000:]}
                record["problems"].append(f"{s.name}: {str(e).splitlines()[0]}")
            r["wall_seconds"] = time.perf_counter() - started
            for c in r.get("checks", []):
                print(f"  {c['describe']}; measured overhead {_mib(c.get('measured_overhead_bytes'))}", file=sys.stderr)
            record["scenarios"].append(r)
            record["overhead"] = overhead_summary(record["scenarios"])
            write_results(out_dir, RESULT_NAME, record, report(record))
    record["overhead"] = overhead_summary(record["scenarios"])
    text = report(record)
    write_results(out_dir, RESULT_NAME, record, text)
    print(text)
    if args.record:
        write_section(args.record, "## Forecast vs measured VRAM (GPU)", text)
    return 1 if record["problems"] else 0


def cpu_check(models: Path) -> dict:
    """check_plan on a tiny CPU-only plan: the measuring path and the records the GPU run writes, on this machine."""
    from plan_check import check_plan
    from stowage.engine.planning.budgets import given_budgets
    from stowage.engine.planning.inspect import inspect
    from stowage.engine.planning.plan import PlanRequest, plan

    model_dir = write_model(models / "tiny-qwen2", TINY_QWEN2, sparse=False)
    p = plan(inspect(model_dir), PlanRequest(1024, prefill_chunk=256), given_budgets([], 8 * GiB))
    by_device = {d["device"]: d for d in plan_record(p)["devices"]}
    return {"plan": plan_record(p), "checks": [check_record(c, by_device[c.device]) for c in check_plan(model_dir, p)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: make and check the plans, print the commands")
    parser.add_argument("--out", type=Path, help="output folder (default: $OUT, else bench/out/gpu)")
    parser.add_argument("--work", type=Path, help="model folder (default: $STOWAGE_GPU_WORK, else bench/out/gpu-models)")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), help="run only these plans")
    parser.add_argument("--worker-timeout", type=float, default=60, help="seconds for one plan's process")
    parser.add_argument("--record", type=Path, help="also write the table as a section of this markdown file")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "SCENARIO"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.result)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
