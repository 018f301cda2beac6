"""Measured memory, read a few times per second: system RAM and this process (psutil), VRAM per GPU (NVML); and
handing freed memory back to the system so the measurement shows it.

A plain object, no Qt: the memory graph's QTimer calls `sample()` and appends to the ring buffers.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import numpy as np
import psutil

from stowage.engine.planning.gpus import NvmlGpus


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Sample:
    time_s: float
    ram_used_bytes: int  # system-wide: total - available, so caches the kernel can drop do not count
    process_bytes: int  # resident set of this process (mmapped weights count once they are touched)
    gpu_used_bytes: tuple[int, ...]  # one per GPU, in `gpus` order


class RingBuffer:
    """The last `capacity` values of a series, oldest first, without reallocating."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._data = np.zeros(capacity)
        self._next = 0
        self.num_values = 0

    def append(self, value: float) -> None:
        self._data[self._next] = value
        self._next = (self._next + 1) % self.capacity
        self.num_values = min(self.num_values + 1, self.capacity)

    def values(self) -> np.ndarray:
        if self.num_values < self.capacity:
            return self._data[: self.num_values].copy()
        return np.concatenate((self._data[self._next :], self._data[: self._next]))


class MemoryStats:
    """Reads RAM and VRAM; `gpus` is empty and `gpu_note` says why when there is no NVIDIA GPU."""

    def __init__(self):
        self._process = psutil.Process(os.getpid())
        self.ram_total_bytes = psutil.virtual_memory().total
        self.gpu_note = ""
        # GPUs in CUDA's numbering (engine.gpus), so "cuda:N" in a plan is GpuInfo index N here
        self._nvml = NvmlGpus()
        self.gpus: list[GpuInfo] = [GpuInfo(g.cuda_index, g.name, g.total_bytes) for g in self._nvml.gpus]
        if not self.gpus:
            self.gpu_note = "No NVIDIA GPU: " + self._nvml.note

    def follow(self, pid: int | None) -> None:
        """Measure process `pid` (the engine's child process), or this one again with None."""
        try:
            self._process = psutil.Process(pid or os.getpid())
        except psutil.Error:  # gone already: back to this process
            self._process = psutil.Process(os.getpid())

    @property
    def pid(self) -> int:
        return self._process.pid

    def device_summary(self) -> str:
        """For the status bar: "GPU 0: NVIDIA GeForce RTX 4090, 24 GiB" or "CPU only: no NVIDIA driver found"."""
        if not self.gpus:
            return "CPU only: " + self.gpu_note.removeprefix("No NVIDIA GPU: ")
        return "; ".join(f"GPU {g.index}: {g.name}, {g.total_bytes / 1024**3:.0f} GiB" for g in self.gpus)

    def sample(self) -> Sample:
        vm = psutil.virtual_memory()
        gpu_used = [self._nvml.used_bytes(g.index) for g in self.gpus]
        return Sample(
            time_s=time.monotonic(),
            ram_used_bytes=int(vm.total - vm.available),
            process_bytes=self._process_rss(),
            gpu_used_bytes=tuple(gpu_used),
        )

    def _process_rss(self) -> int:
        try:
            return int(self._process.memory_info().rss)
        except psutil.Error:  # the engine's process ended (unloaded, or it died): this one from now on
            self.follow(None)
            return int(self._process.memory_info().rss)


def release_freed_memory() -> None:
    """Hand freed memory back to the system so the graphs show it drop after an unload."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    try:  # glibc keeps freed heap pages otherwise; the process RSS would not move
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
