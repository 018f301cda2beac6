"""What bench/gpu_plan_check.py derives from a measurement, on hand-checked numbers, and how it judges a plan's split."""

from __future__ import annotations

import pytest
from sparse_models import write_sparse_model

from gpu_plan_check import QWEN2_5_1_5B, Scenario, check_record, make_plan, overhead_summary, split_problem
from plan_check import DeviceCheck
from stowage.engine.planning.budgets import ram_budget
from stowage.engine.planning.workspace import CUDA_OVERHEAD_BYTES
from stowage.engine.units import GiB, MiB

GPU_PLAN = {"reserve_bytes": 512 * MiB, "overhead_bytes": 640 * MiB}


def _gpu_check(predicted_mib: int, peak_mib: int, reserved_mib: int) -> DeviceCheck:
    return DeviceCheck("cuda:0", predicted_mib * MiB, 100 * MiB, 2000 * MiB, 100 * MiB, 2000 * MiB, peak_mib * MiB,
                       allocated_peak_bytes=(reserved_mib - 50) * MiB, reserved_peak_bytes=reserved_mib * MiB)


def test_a_gpu_record_counts_the_context_made_before_the_baseline_and_derives_both_overheads():
    # NVML grew 3,100 MiB after check_plan's baseline and 200 MiB before it (the planner's CUDA init): 3,300 MiB in
    # all against 3,000 predicted; torch reserved 2,300 of it; the plan's terms other than the overhead are 2,360.
    rec = check_record(_gpu_check(3000, 3100, 2300), GPU_PLAN, context_bytes=200 * MiB)
    assert rec["measured_bytes"] == 3300 * MiB
    assert rec["error"] == pytest.approx(0.10)
    assert rec["measured_overhead_bytes"] == 1000 * MiB  # 3,300 - 2,300
    assert rec["exact_overhead_bytes"] == 940 * MiB  # 3,300 - (3,000 - 640)
    assert rec["context_before_baseline_bytes"] == 200 * MiB
    assert rec["under_by_more_than_safety"] is False  # 300 MiB short, the buffer is 512


def test_a_forecast_short_by_more_than_the_safety_buffer_is_flagged():
    assert check_record(_gpu_check(3000, 3600, 2300), GPU_PLAN)["under_by_more_than_safety"] is True  # 600 > 512
    assert check_record(_gpu_check(3000, 3500, 2300), GPU_PLAN)["under_by_more_than_safety"] is False  # 500


def test_the_suggested_overhead_is_the_largest_measured_rounded_up_to_a_mib():
    a = check_record(_gpu_check(3000, 3000, 2300), GPU_PLAN)  # overhead 700 MiB
    b = check_record(_gpu_check(1500, 1400, 600), GPU_PLAN)  # overhead 800 MiB
    b["measured_bytes"] += 1  # 800 MiB + 1 byte: rounds up to 801 MiB
    b["measured_overhead_bytes"] += 1
    summary = overhead_summary([{"scenario": "a", "checks": [a]}, {"scenario": "b", "checks": [b]}])
    assert (summary["min_bytes"], summary["max_bytes"]) == (700 * MiB, 800 * MiB + 1)
    assert summary["suggested_bytes"] == 801 * MiB and summary["current_bytes"] == CUDA_OVERHEAD_BYTES
    # a's forecast with 801 MiB instead of the current constant: 3,000 - constant + 801 MiB against 3,000 measured
    forecast = 3000 * MiB - CUDA_OVERHEAD_BYTES + 801 * MiB
    assert summary["errors_with_suggested"]["a"] == pytest.approx((3000 * MiB - forecast) / forecast)


def test_cpu_records_have_no_gpu_terms():
    cpu = DeviceCheck("cpu", 1000 * MiB, 0, 900 * MiB, 0, 900 * MiB, 1010 * MiB)
    rec = check_record(cpu, {"reserve_bytes": GiB, "overhead_bytes": 32 * MiB})
    assert rec["error"] == pytest.approx(0.01) and "measured_overhead_bytes" not in rec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_sparse_model(tmp_path_factory.mktemp("qwen-1.5b"), QWEN2_5_1_5B)


def test_a_plan_that_does_not_split_as_intended_is_named(model_dir):
    ram = ram_budget(120 * GiB)
    small, large = Scenario(2, 8192, "bfloat16"), Scenario(8, 8192, "bfloat16")
    assert split_problem(make_plan(model_dir, small, ram), small) is None
    assert split_problem(make_plan(model_dir, large, ram), large) is None
    # the 8 GiB plan holds every layer: offered as the 2 GiB case, it is refused, and the other way round
    assert "expected layers on both devices, got 28 on the GPU and 0" in split_problem(make_plan(model_dir, large, ram), small)
    assert "expected every layer and the head on the GPU" in split_problem(make_plan(model_dir, small, ram), large)
    # a RAM budget that cannot hold the CPU's share: the plan does not fit, and says so
    assert "does not fit" in split_problem(make_plan(model_dir, small, ram_budget(3 * GiB)), small)


def test_the_gpu_report_states_the_overhead_to_use_and_the_targets(model_dir):
    # The markdown of a GPU run, from records shaped as its workers write them (no GPU needed to format them).
    from gpu_plan_check import environment, plan_record, report

    s = Scenario(2, 8192, "bfloat16")
    plan = plan_record(make_plan(model_dir, s, ram_budget(120 * GiB)))
    gpu, cpu = plan["devices"][0], plan["devices"][-1]
    checks = [check_record(_gpu_check(gpu["total_bytes"] // MiB, gpu["total_bytes"] // MiB + 60, 900), gpu),
              check_record(DeviceCheck("cpu", cpu["total_bytes"], 0, 0, 0, 0, cpu["total_bytes"] * 2), cpu)]
    results = [{"scenario": s.name, "plan": plan, "gpu": "NVIDIA H200", "checks": checks},
               {"scenario": "4GiB-8k-bf16", "error": "worker [...] failed (1):\nTimeoutExpired after 60 s"}]
    text = report({"mode": "gpu", "environment": environment(), "scenarios": results,
                   "overhead": overhead_summary(results)})
    assert "NVIDIA H200" in text and "Dry run" not in text
    assert f"| {s.name} | {len(gpu['layers'])} / {len(cpu['layers'])} | cuda:0 |" in text
    overhead_mib = (gpu["total_bytes"] // MiB + 60) - 900
    assert f"put **{overhead_mib} * MiB** there" in text
    # the CPU measured twice its forecast: the 5% target is not met, and the worst device is named
    assert "every device within 5% of measured: **not met** (worst: cpu +100.0%)" in text
    assert "| 4GiB-8k-bf16 | | | | **failed** | TimeoutExpired after 60 s |" in text


def test_the_kernel_target_is_judged_at_32k_tokens_batch_16():
    from gpu_kernels import target_verdict

    rows = [{"cache": "bf16", "batch": 16, "tokens": 32768, "triton_of_peak": 0.65},
            {"cache": "fp8", "batch": 16, "tokens": 32768, "triton_of_peak": 0.55},
            {"cache": "bf16", "batch": 1, "tokens": 32768, "triton_of_peak": 0.10}]
    assert target_verdict(rows).endswith("bf16 65.0% met, fp8 55.0% **not met**.")
    assert target_verdict(rows[2:]).endswith("not measured.")
