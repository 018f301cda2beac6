"""Predicted vs measured VRAM on a CUDA machine: load under a plan, run the heaviest prefill chunk, compare.

    python bench/gpu_plan_check.py [--record docs/planner.md]

Uses the SmolLM2-360M-shaped random model of bench/common.py (32 layers, 15 heads, 5 KV heads),
with max_position_embeddings raised so long contexts can be planned. Three scenarios, each in a
fresh process so NVML's baseline is clean and the CUDA context is counted:
  offload   8,192 tokens, a GPU budget that holds exactly half the layers (the rest on the CPU)
  all-gpu   32,768 tokens, every layer on the GPU
  long      131,072 tokens, every layer on the GPU (the math-SDPA workspace at its largest)
Per GPU it prints the plan's total and workspace beside NVML's used-memory growth (context included),
torch's peak allocated and reserved bytes, and the overhead they imply (NVML growth - peak reserved):
the number engine/workspace.py's CUDA_OVERHEAD_BYTES should hold. Takes about a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.common import ROOT, build_model, run_worker, write_section  # noqa: E402

SCENARIOS = {"offload": 8192, "all-gpu": 32768, "long": 131072}
MIB = 2**20


def long_context_copy(model_dir: Path) -> Path:
    """The same weights under a config that admits 131,072 positions (the files are linked, not copied)."""
    target = model_dir.parent / (model_dir.name + "-128k")
    target.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name == "config.json" or f.name.startswith("."):
            continue
        if not (target / f.name).exists():
            try:
                (target / f.name).symlink_to(f.resolve())
            except OSError:
                shutil.copy(f, target / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}, indent=2))
    return target


def worker(model_dir: str, scenario: str, result: str) -> None:
    import torch

    from engine.planning.budgets import Budgets, detect_gpus, detect_ram, gpu_budget
    from engine.planning.inspect import inspect
    from bench.plan_check import check_plan
    from engine.planning.plan import PlanRequest, plan

    info = inspect(model_dir)
    gpus, note = detect_gpus()
    if not gpus:
        raise SystemExit(f"no CUDA GPU: {note}")
    context = SCENARIOS[scenario]
    request = PlanRequest(context)
    budgets = Budgets(gpus[:1], detect_ram(), note)
    if scenario == "offload":
        # the budget that holds exactly half the layers: what a 16-layer plan needs, plus the safety buffer
        half = plan(info, PlanRequest(context, gpu_layers=info.num_layers // 2), budgets).devices[0]
        budgets = Budgets((gpu_budget(0, half.total_bytes + gpus[0].reserve_bytes, name=gpus[0].name,
                                      safety_bytes=gpus[0].reserve_bytes),), detect_ram(), note)
    p = plan(info, request, budgets)
    if not p.fits:
        raise SystemExit(p.error)
    checks = check_plan(model_dir, p)
    gpu_plan = p.devices[0]
    out = {"scenario": scenario, "summary": p.summary(), "table": p.format_table(),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "predicted_workspace": gpu_plan.workspace_bytes,
           "predicted_activations": gpu_plan.workspace.activations_bytes + gpu_plan.workspace.logits_bytes,
           "checks": [c.__dict__ | {"describe": c.describe()} for c in checks]}
    Path(result).write_text(json.dumps(out))


def report(results: list[dict]) -> str:
    lines = [f"{results[0]['gpu']}, torch {results[0]['torch']}; bench/gpu_plan_check.py", "",
             "| scenario | plan | GPU predicted | NVML growth | error | torch peak allocated | reserved "
             "| implied CUDA overhead | workspace predicted (activations) | workspace measured |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        gpu = next(c for c in r["checks"] if c["device"].startswith("cuda"))
        measured_ws = gpu["allocated_peak_bytes"] - gpu["weights_bytes"] - gpu["kv_bytes"]
        overhead = gpu["peak_bytes"] - gpu["reserved_peak_bytes"]
        error = (gpu["peak_bytes"] - gpu["predicted_bytes"]) / gpu["predicted_bytes"]
        lines.append(
            f"| {r['scenario']} | {r['summary']} | {gpu['predicted_bytes'] / MIB:,.0f} MiB "
            f"| {gpu['peak_bytes'] / MIB:,.0f} MiB | {error:+.1%} | {gpu['allocated_peak_bytes'] / MIB:,.0f} MiB "
            f"| {gpu['reserved_peak_bytes'] / MIB:,.0f} MiB | {overhead / MIB:,.0f} MiB "
            f"| {r['predicted_activations'] / MIB:,.0f} MiB | {measured_ws / MIB:,.0f} MiB |")
    for r in results:
        lines += ["", f"{r['scenario']}:", "```", r["table"], *(c["describe"] for c in r["checks"]), "```"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="write the results as a section of this markdown file")
    parser.add_argument("--scenario", choices=SCENARIOS, action="append", help="run only these (repeatable)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "SCENARIO"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.result)
        return
    model_dir = long_context_copy(build_model(ROOT / "bench" / "out"))
    results = []
    for scenario in args.scenario or list(SCENARIOS):
        print(f"{scenario} ...", file=sys.stderr, flush=True)
        results.append(run_worker(Path(__file__), ["--worker", str(model_dir), scenario], threads=4, timeout=280))
    text = report(results)
    print(text)
    if args.record:
        write_section(args.record, "## Measured on a GPU", text)


if __name__ == "__main__":
    main()
