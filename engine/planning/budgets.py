"""How much memory a plan may use on each device: NVIDIA GPUs via NVML, RAM via psutil (never swap)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .gpus import NvmlGpus
from ..units import GiB, MiB, format_bytes

MIN_GPU_SAFETY_BYTES = 512 * MiB
GPU_SAFETY_FRACTION = 0.02
MIN_RAM_RESERVE_BYTES = 1 * GiB
RAM_RESERVE_FRACTION = 0.05
MAX_KV_DISK_BYTES = 4 * GiB
KV_DISK_FRACTION = 0.10


def default_gpu_safety(total_bytes: int) -> int:
    """max(512 MiB, 2% of the GPU): room for other processes' growth and allocator fragmentation."""
    return max(MIN_GPU_SAFETY_BYTES, int(total_bytes * GPU_SAFETY_FRACTION))


def default_ram_reserve(total_bytes: int) -> int:
    """max(1 GiB, 5% of RAM): the desktop, the app's own Python objects, and what other programs grow into."""
    return max(MIN_RAM_RESERVE_BYTES, int(total_bytes * RAM_RESERVE_FRACTION))


def default_kv_disk_budget(free_bytes: int) -> int:
    """min(4 GiB, 10% of the free disk): conversations' K/V spilled there (engine/serving/kv_store.py) without filling it."""
    return min(MAX_KV_DISK_BYTES, int(free_bytes * KV_DISK_FRACTION))


@dataclass(frozen=True)
class DiskBudget:
    """The folder evicted conversations' K/V are written to, and the space free on its disk."""

    folder: str
    free_bytes: int

    def __post_init__(self):
        if self.free_bytes < 0:
            raise ValueError(f"{self.folder}: free disk space cannot be negative")


@dataclass(frozen=True)
class DeviceBudget:
    """What one device has free and what a plan may use of it: free - reserve, capped by an optional limit."""

    device: str  # "cuda:0", "cuda:1", ... or "cpu"
    name: str  # "NVIDIA GeForce RTX 4090", "RAM"
    total_bytes: int
    free_bytes: int
    reserve_bytes: int  # the GPU safety buffer or the RAM reserve
    limit_bytes: int | None = None  # a user's RAM limit: the plan never puts more than this in RAM

    def __post_init__(self):
        if min(self.total_bytes, self.free_bytes, self.reserve_bytes) < 0 or (self.limit_bytes or 0) < 0:
            raise ValueError(f"{self.device}: memory sizes cannot be negative")

    @property
    def budget_bytes(self) -> int:
        usable = max(0, self.free_bytes - self.reserve_bytes)
        return usable if self.limit_bytes is None else min(usable, self.limit_bytes)

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def label(self) -> str:
        """How messages name the device: "GPU 0", "RAM"."""
        return f"GPU {self.device.removeprefix('cuda:')}" if self.is_gpu else "RAM"

    def describe(self) -> str:
        """ "23.5 GiB usable on GPU 0 (24.0 GiB free minus a 512.0 MiB safety buffer)"."""
        held = "safety buffer" if self.is_gpu else "reserve"
        where = f"on {self.label}" if self.is_gpu else "in RAM"
        text = (f"{format_bytes(self.budget_bytes)} usable {where} ({format_bytes(self.free_bytes)} free "
                f"minus a {format_bytes(self.reserve_bytes)} {held}")
        if self.limit_bytes is not None and self.limit_bytes < self.free_bytes - self.reserve_bytes:
            text += f", capped by the {format_bytes(self.limit_bytes)} RAM limit"
        return text + ")"


@dataclass(frozen=True)
class Budgets:
    """Every device a plan may use: the GPUs in CUDA order, then RAM; `note` says how they were found."""

    gpus: tuple[DeviceBudget, ...]
    ram: DeviceBudget
    note: str = ""
    disk: DiskBudget | None = None  # None: no KV spill to disk

    @property
    def devices(self) -> tuple[DeviceBudget, ...]:
        return self.gpus + (self.ram,)


def gpu_budget(index: int, free_bytes: int, *, total_bytes: int | None = None, name: str = "GPU",
               safety_bytes: int | None = None) -> DeviceBudget:
    """GPU `index` with `free_bytes` free; the safety buffer comes off that (total defaults to free)."""
    total = free_bytes if total_bytes is None else total_bytes
    safety = default_gpu_safety(total) if safety_bytes is None else safety_bytes
    return DeviceBudget(f"cuda:{index}", name, total, free_bytes, safety)


def ram_budget(available_bytes: int, *, total_bytes: int | None = None, reserve_bytes: int | None = None,
               limit_bytes: int | None = None) -> DeviceBudget:
    """RAM with `available_bytes` available (swap excluded); the reserve comes off that, then the limit caps it."""
    total = available_bytes if total_bytes is None else total_bytes
    reserve = default_ram_reserve(total) if reserve_bytes is None else reserve_bytes
    return DeviceBudget("cpu", "RAM", total, available_bytes, reserve, limit_bytes)


def given_budgets(gpu_free_bytes: list[int], ram_available_bytes: int, *, gpu_safety_bytes: int | None = None,
                  ram_reserve_bytes: int | None = None, ram_limit_bytes: int | None = None,
                  disk: DiskBudget | None = None) -> Budgets:
    """Budgets stated by a user or a test: plan as if these GPUs and this RAM were free (they need not exist)."""
    gpus = tuple(gpu_budget(i, free, safety_bytes=gpu_safety_bytes) for i, free in enumerate(gpu_free_bytes))
    ram = ram_budget(ram_available_bytes, reserve_bytes=ram_reserve_bytes, limit_bytes=ram_limit_bytes)
    note = f"given budgets: {len(gpus)} GPU(s)" if gpus else "given budgets: CPU only"
    return Budgets(gpus, ram, note, disk)


def detect_budgets(gpu_safety_bytes: int | None = None, ram_limit_bytes: int | None = None,
                   ram_reserve_bytes: int | None = None) -> Budgets:
    """This machine's budgets now: each NVIDIA GPU's free memory (NVML) and available RAM (psutil)."""
    gpus, note = detect_gpus(gpu_safety_bytes)
    return Budgets(gpus, detect_ram(ram_reserve_bytes, ram_limit_bytes), note, detect_disk())


def detect_disk(folder: str | Path | None = None) -> DiskBudget:
    """The KV spill folder (default: engine/serving/kv_store.py's) and the space free on its disk now (0 if unreadable)."""
    from ..serving.kv_store import default_kv_dir

    folder = Path(folder) if folder is not None else default_kv_dir()
    probe = folder
    while not probe.exists() and probe != probe.parent:  # not made yet: the disk it will be on
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 0
    return DiskBudget(str(folder), free)


def detect_ram(reserve_bytes: int | None = None, limit_bytes: int | None = None) -> DeviceBudget:
    import psutil

    # `available` counts free memory plus reclaimable page cache; swap is never added to it.
    mem = psutil.virtual_memory()
    return ram_budget(mem.available, total_bytes=mem.total, reserve_bytes=reserve_bytes, limit_bytes=limit_bytes)


def detect_gpus(safety_bytes: int | None = None) -> tuple[tuple[DeviceBudget, ...], str]:
    """The GPUs CUDA will number cuda:0, cuda:1, ...; and a note saying what was found or why none."""
    nvml = NvmlGpus()
    nvml.close()
    if not nvml.gpus:
        return (), f"CPU only: {nvml.note}"
    import torch

    if torch.version.cuda is None:
        return (), (f"CPU only: {len(nvml.gpus)} NVIDIA GPU(s) found, but this torch build has no CUDA; "
                    "install a CUDA build of torch to use them")
    gpus = tuple(gpu_budget(g.cuda_index, g.free_bytes, total_bytes=g.total_bytes, name=g.name,
                            safety_bytes=safety_bytes) for g in nvml.gpus)
    names = ", ".join(f"{g.name} ({g.device})" for g in gpus)
    return gpus, f"{len(gpus)} NVIDIA GPU(s): {names}"
