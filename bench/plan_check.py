"""Load a model under a plan, run the heaviest prefill chunk, and set what each device really used beside the plan.

CPU: the engine's own accounting (weights, KV cache: exact) and the process's peak resident growth.
CUDA: torch.cuda.max_memory_allocated (torch's tensors) and NVML's used memory (adds the CUDA context).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch

from memory import rss_bytes
from stowage.engine.dtypes import COMPUTE
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.planning.gpus import used_bytes
from stowage.engine.planning.plan import Plan
from stowage.engine.units import format_bytes


@dataclass(frozen=True)
class DeviceCheck:
    """Predicted and measured bytes of one device."""

    device: str
    predicted_bytes: int  # the plan's total: weights + KV + workspace
    predicted_kv_bytes: int
    predicted_weights_bytes: int
    kv_bytes: int  # what the engine allocated for the cache
    weights_bytes: int  # what the engine placed (copied or mapped)
    peak_bytes: int  # CPU: peak resident growth; CUDA: NVML used growth (context included)
    allocated_peak_bytes: int = 0  # CUDA: torch.cuda.max_memory_allocated
    reserved_peak_bytes: int = 0  # CUDA: torch.cuda.max_memory_reserved (the caching allocator's segments)

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted; positive means the plan was short."""
        return (self.peak_bytes - self.predicted_bytes) / self.predicted_bytes

    def describe(self) -> str:
        text = (f"{self.device}: predicted {format_bytes(self.predicted_bytes)}, measured {format_bytes(self.peak_bytes)}"
                f" ({self.error:+.1%}); KV {format_bytes(self.kv_bytes)} of {format_bytes(self.predicted_kv_bytes)}"
                f" predicted, weights {format_bytes(self.weights_bytes)} of {format_bytes(self.predicted_weights_bytes)}")
        if self.allocated_peak_bytes:
            text += (f"; torch peak allocated {format_bytes(self.allocated_peak_bytes)}, reserved "
                     f"{format_bytes(self.reserved_peak_bytes)}")
        return text


def check_plan(model_dir: str | Path, plan: Plan) -> list[DeviceCheck]:
    """Load under `plan`, prefill one chunk at the end of the full context, and compare per device."""

    gc.collect()
    cuda_devices = sorted({d for d in plan.layer_devices if d.startswith("cuda")} |
                          ({plan.head_device} if plan.head_device.startswith("cuda") else set()))
    nvml_before = {d: used_bytes(d) for d in cuda_devices}  # before torch creates a CUDA context
    _warm_up(COMPUTE[plan.dtype])
    _reset_peak_rss()
    rss_before = rss_bytes()
    for d in cuda_devices:
        torch.cuda.reset_peak_memory_stats(d)
    engine = Engine.load(model_dir, plan)
    _run_heaviest_chunk(engine, plan)
    for d in cuda_devices:
        torch.cuda.synchronize(d)
    report = engine.memory_report()
    checks = []
    for d in plan.devices:
        if d.total_bytes == 0:
            continue
        held = report.get(d.device, {"weights_copied": 0, "weights_mapped": 0, "kv_cache": 0})
        weights = held["weights_copied"] + held["weights_mapped"]
        if d.device == "cpu":
            peak, allocated, reserved = _peak_rss() - rss_before, 0, 0
        else:
            peak = used_bytes(d.device) - nvml_before[d.device]
            allocated = torch.cuda.max_memory_allocated(d.device)
            reserved = torch.cuda.max_memory_reserved(d.device)
        checks.append(DeviceCheck(d.device, d.total_bytes, d.kv_bytes, d.weights_bytes, held["kv_cache"], weights,
                                  peak, allocated, reserved))
    engine.close()
    return checks


def _warm_up(dtype: torch.dtype) -> None:
    # The first matmul, attention and norm page in library code and JIT kernels (tens of MiB, once per
    # process, whatever the model). That is the runtime's fixed footprint, not the plan's memory, so
    # it happens before the baseline.
    import torch.nn.functional as F

    x = torch.randn(64, 64, dtype=dtype)
    torch.mm(x, x.t())
    F.rms_norm(x, (64,), torch.ones(64, dtype=dtype))
    q = torch.randn(1, 2, 64, 64, dtype=dtype)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(64, 64, dtype=torch.bool).tril())
    F.silu(x).index_select(0, torch.arange(8))
    gc.collect()


def _run_heaviest_chunk(engine, plan: Plan) -> None:
    # The last prefill chunk of a full context holds the most: its attention spans every cached token.
    chunk = min(plan.prefill_chunk, plan.context_tokens)
    seq = Sequence()
    earlier = plan.context_tokens - chunk
    for start in range(0, earlier, chunk):  # a chunk at a time, as a prefill does: window groups recycle as they go
        n = min(chunk, earlier - start)
        engine.cache.reserve(seq, n)  # their K/V stay zeros: the memory is the same
        seq.token_ids.extend([0] * n)
    engine.model.forward([1] * chunk, seq, engine.cache)
    engine.cache.release(seq)


def _reset_peak_rss() -> None:
    # Freed heap that malloc keeps would be reused without growing the RSS and hide part of the peak:
    # hand it back first (glibc), so the baseline is what is really in use.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss_bytes()  # no peak where /proc is missing: the current figure is the best there is
