"""Budgets: safety buffer and RAM reserve arithmetic, RAM limit, detection on this (GPU-less) machine."""

import psutil
import pytest

from stowage.engine.planning.budgets import (
    DeviceBudget, default_gpu_safety, default_ram_reserve, detect_budgets, given_budgets, gpu_budget, ram_budget,
)
from stowage.engine.planning.gpus import visible_order
from stowage.engine.units import GiB, MiB


def test_gpu_safety_is_the_larger_of_512_mib_and_2_percent():
    assert default_gpu_safety(24 * GiB) == 512 * MiB  # 2% would be 491.5 MiB
    assert default_gpu_safety(80 * GiB) == int(80 * GiB * 0.02) == 1_717_986_918
    assert default_gpu_safety(8 * GiB) == 512 * MiB


def test_ram_reserve_is_the_larger_of_1_gib_and_5_percent():
    assert default_ram_reserve(16 * GiB) == 1 * GiB  # 5% would be 819 MiB
    assert default_ram_reserve(64 * GiB) == int(64 * GiB * 0.05) == 3_435_973_836


def test_given_gpu_budget_is_free_memory_before_the_buffer():
    gpu = gpu_budget(0, 24 * GiB)
    assert (gpu.device, gpu.label, gpu.is_gpu) == ("cuda:0", "GPU 0", True)
    assert gpu.reserve_bytes == 512 * MiB
    assert gpu.budget_bytes == 24 * GiB - 512 * MiB
    assert gpu_budget(1, 24 * GiB, safety_bytes=0).budget_bytes == 24 * GiB


def test_ram_limit_caps_the_budget():
    ram = ram_budget(64 * GiB, limit_bytes=20 * GiB)
    assert ram.budget_bytes == 20 * GiB
    assert "20.0 GiB RAM limit" in ram.describe()
    loose = ram_budget(16 * GiB, limit_bytes=32 * GiB)
    assert loose.budget_bytes == 15 * GiB  # the limit only ever lowers it
    assert "limit" not in loose.describe()


def test_budget_never_negative_and_sizes_checked():
    assert gpu_budget(0, 256 * MiB).budget_bytes == 0
    with pytest.raises(ValueError, match="negative"):
        DeviceBudget("cpu", "RAM", 1, -1, 0)


def test_given_budgets_number_gpus_in_order():
    b = given_budgets([12 * GiB, 8 * GiB], 16 * GiB)
    assert [g.device for g in b.gpus] == ["cuda:0", "cuda:1"]
    assert [d.device for d in b.devices] == ["cuda:0", "cuda:1", "cpu"]
    assert b.ram.budget_bytes == 15 * GiB
    assert given_budgets([], 16 * GiB).note == "given budgets: CPU only"


def test_detect_without_nvidia_plans_for_the_cpu_and_says_so():
    b = detect_budgets()
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    except pynvml.NVMLError:
        pass
    assert b.gpus == ()
    assert b.note.startswith("CPU only: no NVIDIA driver found")


def test_detected_ram_is_available_memory_never_swap():
    mem = psutil.virtual_memory()
    b = detect_budgets()
    assert b.ram.total_bytes == mem.total
    # available RAM only: at most physical RAM, whatever swap there is
    assert 0 < b.ram.free_bytes <= mem.total
    assert b.ram.budget_bytes == b.ram.free_bytes - default_ram_reserve(mem.total)
    assert detect_budgets(ram_limit_bytes=256 * MiB).ram.budget_bytes <= 256 * MiB
    assert detect_budgets(ram_reserve_bytes=0).ram.reserve_bytes == 0


def test_cuda_visible_devices_order():
    uuids = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]
    assert visible_order(uuids, None) == [0, 1, 2]
    assert visible_order(uuids, "2,0") == [2, 0]
    assert visible_order(uuids, "GPU-bbbb") == [1]
    assert visible_order(uuids, "1,7,0") == [1]  # CUDA stops at the first entry it cannot use
    assert visible_order(uuids, "") == []
