"""bench/gpu_suite.sh --dry-run on this CPU: the plans split as intended, every script's output is written and
well formed, and the GPU run's commands are printed. Without a GPU the real run refuses with a clear message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "gpu_suite.sh"
# What the GPU machine sends back is at most 8 files: the suite writes exactly these.
OUTPUTS = ["gpu_decode.json", "gpu_decode.md", "gpu_kernels.json", "gpu_kernels.md", "gpu_plan_check.json",
           "gpu_plan_check.md", "suite.log", "summary.md"]
PLANS = {f"{b}GiB-{t}k-{kv}" for b in (2, 4, 8) for t in (8, 32) for kv in ("bf16", "fp8")}
NUM_LAYERS = 28  # the Qwen2.5-1.5B shape


def _suite(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env |= {"OUT": str(tmp_path / "out"), "STOWAGE_GPU_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SUITE), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-suite")
    proc = _suite(tmp, "--dry-run", timeout=240)  # ~50 s on a 2-core machine
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    return tmp / "out"


def _json(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
def test_the_dry_run_writes_exactly_the_files_a_gpu_run_sends_back(dry_run):
    assert sorted(p.name for p in dry_run.iterdir()) == OUTPUTS
    summary = (dry_run / "summary.md").read_text()
    for step in ("pytest -m gpu", "plan check", "kernels", "decode"):
        assert f"| {step} | ok |" in summary
    for section in ("### Forecast vs measured memory per device", "### Paged attention kernels", "### End-to-end decode"):
        assert section in summary


@pytest.mark.slow
def test_the_dry_run_prints_the_gpu_commands(dry_run):
    log = (dry_run / "suite.log").read_text()
    gpu_commands = log.split("the GPU run would execute", 1)[1].split("\n== ", 1)[0]
    lines = [line.split("] ", 1)[1].strip() for line in gpu_commands.splitlines() if "] " in line]
    commands = [line.split(sys.executable + " ", 1)[1] for line in lines]
    assert commands[1:] == ["bench/gpu_plan_check.py", "bench/gpu_kernels.py", "bench/gpu_decode.py"]
    assert commands[0].startswith("-m pytest -q -p no:cacheprovider -m gpu -rs ")
    assert "tests/kernels/test_gpu.py" in commands[0].split()  # every file with a gpu-marked test
    # and each plan's worker command
    for name in PLANS:
        assert f"bench/gpu_plan_check.py --worker " in log and f" {name} --result FILE" in log


@pytest.mark.slow
def test_the_small_budgets_split_the_layers_and_8_gib_holds_them_all(dry_run):
    record = _json(dry_run, "gpu_plan_check")
    assert record["mode"] == "dry-run" and not record["problems"]
    scenarios = {s["scenario"]: s for s in record["scenarios"]}
    assert set(scenarios) == PLANS
    for name, s in scenarios.items():
        plan, budget_gib = s["plan"], int(name.split("GiB")[0])
        gpu, cpu = plan["devices"][0], plan["devices"][-1]
        assert plan["fits"] and s["split_ok"] and gpu["device"] == "cuda:0" and cpu["device"] == "cpu"
        assert gpu["budget_bytes"] == budget_gib * 2**30 - 512 * 2**20  # the safety buffer comes off the budget
        assert gpu["total_bytes"] <= gpu["budget_bytes"] and gpu["attention"] == "triton"
        assert len(gpu["layers"]) + len(cpu["layers"]) == NUM_LAYERS
        assert plan["kv_dtype"] == ("fp8" if name.endswith("fp8") else "bfloat16")
        if budget_gib in (2, 4):
            assert gpu["layers"] and cpu["layers"] and plan["head_device"] == "cpu", name
        else:
            assert len(gpu["layers"]) == NUM_LAYERS and plan["head_device"] == "cuda:0", name
    # a larger budget never holds fewer layers
    for t in (8, 32):
        for kv in ("bf16", "fp8"):
            counts = [len(scenarios[f"{b}GiB-{t}k-{kv}"]["plan"]["devices"][0]["layers"]) for b in (2, 4, 8)]
            assert counts == sorted(counts) and counts[0] < counts[1]


@pytest.mark.slow
def test_the_measuring_path_ran_on_the_cpu(dry_run):
    check = _json(dry_run, "gpu_plan_check")["cpu_check"]["checks"]
    assert [c["device"] for c in check] == ["cpu"]
    # the engine's own accounting equals the plan's (exact), and a peak was read
    assert check[0]["kv_bytes"] == check[0]["predicted_kv_bytes"] > 0
    assert check[0]["weights_bytes"] == check[0]["predicted_weights_bytes"] > 0
    assert check[0]["measured_bytes"] > 0 and "error" in check[0]


@pytest.mark.slow
def test_the_kernels_ran_through_the_interpreter_with_split_k(dry_run):
    record = _json(dry_run, "gpu_kernels")
    decode = {(r["cache"], r["batch"], r["tokens"]): r for r in record["decode"]}
    assert set(decode) == {(c, b, t) for c in ("bf16", "fp8") for b in (1, 2) for t in (64, 1100)}
    for (_, _, tokens), r in decode.items():
        assert r["splits"] == (1 if tokens < 1024 else 2)  # as choose_num_splits decides for an H200's 132 SMs
        assert r["max_abs_err_vs_sdpa"] < 3e-2 and r["triton_us"] > 0 and r["triton_of_peak"] is None
    assert {(r["cache"], r["context"]) for r in record["prefill"]} == {(c, t) for c in ("bf16", "fp8") for t in (32, 64, 1100)}
    assert all(r["max_abs_err_vs_reference"] < 3e-2 for r in record["prefill"])


@pytest.mark.slow
def test_both_backends_decoded_in_both_placements(dry_run):
    record = _json(dry_run, "gpu_decode")
    results = record["results"]
    assert set(results) == {"stowage-full", "transformers-full", "stowage-split", "transformers-split"}
    for key, r in results.items():
        assert "error" not in r, r.get("error")
        assert len(r["runs"]) == 3 and r["decode_tokens"] == 4 and r["decode_tok_s"] > 0, key
    assert (results["stowage-full"]["plan"]["gpu_layers"], results["stowage-full"]["plan"]["cpu_layers"]) == (4, 0)
    for key in ("stowage-split", "transformers-split"):  # the same placement for both backends
        assert (results[key]["plan"]["gpu_layers"], results[key]["plan"]["cpu_layers"]) == (2, 2)
    assert set(record["ratios"]) == {"full", "split"}


def test_without_a_cuda_gpu_the_real_run_refuses_and_says_what_to_do(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real run would start")
    proc = _suite(tmp_path, timeout=120)
    assert proc.returncode == 3, proc.stdout
    assert "no Python whose torch is a CUDA build that sees a GPU" in proc.stdout
    assert "bash bench/gpu_suite.sh --dry-run" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["suite.log"]
