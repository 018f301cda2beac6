"""NVIDIA GPUs as CUDA numbers them: the one NVML-to-CUDA mapping the budgets, the checks and the GUI use.

NVML numbers GPUs by PCI bus; CUDA numbers the ones CUDA_VISIBLE_DEVICES leaves, in the order it lists
them. Everything in Stowage names a GPU "cuda:N" (CUDA's number) and reads its memory through here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    cuda_index: int
    nvml_index: int
    name: str
    total_bytes: int
    free_bytes: int

    @property
    def device(self) -> str:
        return f"cuda:{self.cuda_index}"


class NvmlGpus:
    """NVML opened once; `gpus` in CUDA order (empty, with `note` saying why, when there are none)."""

    def __init__(self):
        self.gpus: list[Gpu] = []
        self.note = ""
        self._handles: list = []
        try:
            import pynvml
        except ImportError:
            self.note = "no NVIDIA GPU: nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:  # the base class: library missing, driver not loaded, ...
            self.note = f"no NVIDIA driver found ({e})"
            return
        self._nvml = pynvml
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            for cuda_index, nvml_index in enumerate(visible_order(uuids, os.environ.get("CUDA_VISIBLE_DEVICES"))):
                handle = handles[nvml_index]
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                self.gpus.append(Gpu(cuda_index, nvml_index, _text(pynvml.nvmlDeviceGetName(handle)),
                                     int(mem.total), int(mem.free)))
                self._handles.append(handle)
        except pynvml.NVMLError as e:
            self.gpus, self._handles, self.note = [], [], f"the NVIDIA driver did not answer ({e})"
            return
        if not self.gpus:
            self.note = ("CUDA_VISIBLE_DEVICES hides every GPU" if handles else "the NVIDIA driver reports no GPU")

    def used_bytes(self, cuda_index: int) -> int:
        """Memory in use on GPU cuda:`cuda_index` now, all processes (0 if it stopped answering)."""
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handles[cuda_index]).used)
        except Exception:  # a GPU that fell off the bus reads as empty rather than failing the caller
            return 0

    def close(self) -> None:
        if self._handles or hasattr(self, "_nvml"):
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._handles = []


def used_bytes(device: str) -> int:
    """NVML's used memory of `device` ("cuda:N"), in CUDA's numbering."""
    nvml = NvmlGpus()
    try:
        return nvml.used_bytes(int(device.split(":")[1]))
    finally:
        nvml.close()


def visible_order(uuids: list[str], cuda_visible_devices: str | None) -> list[int]:
    """NVML indices in CUDA's numbering, following CUDA_VISIBLE_DEVICES (indices or UUID prefixes)."""
    # NVML numbers GPUs by PCI bus, as CUDA does with CUDA_DEVICE_ORDER=PCI_BUS_ID; on machines mixing GPU
    # models CUDA's default order (fastest first) can differ; docs/planner.md says so.
    if cuda_visible_devices is None:
        return list(range(len(uuids)))
    order: list[int] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < len(uuids):
            index = int(entry)
        else:
            matches = [i for i, u in enumerate(uuids) if entry and u.startswith(entry)]
            if len(matches) != 1:
                break  # CUDA itself ignores everything from the first entry it cannot resolve
            index = matches[0]
        if index in order:
            break
        order.append(index)
    return order


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
