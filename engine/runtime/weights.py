"""Putting the tensors the layout names on their device: in place (a view of the map) on the CPU, unless converted."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from stowage.kernels.quant_linear import Mxfp4Weight, QuantizedWeight

from ..formats.checkpoint import Checkpoint
from ..errors import GenerationCancelled


@dataclass
class TensorSet:
    """Named tensors on one device; `copied_bytes` counts what was copied rather than mapped."""

    device: torch.device
    tensors: dict[str, torch.Tensor | QuantizedWeight]
    copied_bytes: int = 0
    label: str = "cpu"  # the plan's name for the device ("cuda:0", "cpu")
    sources: dict[str, str] = field(default_factory=dict)  # short name -> checkpoint name

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get(self, key: str):
        return self.tensors.get(key)

    @property
    def num_bytes(self) -> int:
        return self.bytes_excluding(set())

    def bytes_excluding(self, seen: set[int]) -> int:
        """Bytes of the tensors whose storage is not in `seen` (which this adds them to): shared ones count once."""
        total = 0
        for t in self.tensors.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
        return total


def place(
    checkpoint: Checkpoint, names: dict[str, str], device: torch.device, dtype: torch.dtype,
    label: str = "cpu", shared: TensorSet | None = None, converted: Collection[str] = frozenset(),
) -> TensorSet:
    """Load named tensors onto device; on the CPU, those not `converted` into `dtype` stay views of the mmap.

    `converted`: the checkpoint names to copy into the compute dtype `dtype` (planning/inspect.py converted_names,
    which the forecast counts). `shared`: a set on the same device whose tensors are reused by source name (a tied
    head uses the embedding). Quantized weights (GGUF) are never converted: they stay the stored blocks, on any
    device."""
    out, copied = {}, 0
    by_source = {} if shared is None else {n: shared[s] for s, n in shared.sources.items()}
    for short, name in names.items():
        if name in by_source:  # tied weights: one tensor, two names
            out[short] = by_source[name]
            continue
        stored = checkpoint.tensor(name)
        out[short] = by_source[name] = t = _put(stored, device, dtype if name in converted else None)
        copied += 0 if t is stored else t.nbytes
    return TensorSet(device, out, copied, label, dict(names))


def place_experts(checkpoint, names: dict[str, str], device: torch.device, dtype: torch.dtype, *, label: str,
                  form: str, num_experts: int, converted: Collection[str] = frozenset()) -> TensorSet:
    """One layer's experts on `device` as "gate.E", "up.E", "down.E" matrices [out, in] (and "gate_bias.E" ... where
    biased): per-expert tensors as place() puts them; 3-D ones (ModelLayout.expert_form "fused") sliced per expert
    from the map, `checkpoint.expert(name, E)`. gpt-oss's Hugging Face forms give "gate_up.E" [2 * inter, hidden],
    gate and up rows interleaved, and "down.E": transposed views of the stored [E, in, out] tensors ("gate_up"), or
    MXFP4 blocks read in place ("gate_up_mxfp4", kernels/quant_linear.py Mxfp4Weight)."""
    if form == "per_expert":
        return place(checkpoint, names, device, dtype, label, converted=converted)
    if form in ("gate_up", "gate_up_mxfp4"):
        return _place_gate_up(checkpoint, names, device, dtype, label, form, num_experts, converted)
    out, copied = {}, 0
    for role, name in names.items():
        for e in range(num_experts):
            stored = checkpoint.expert(name, e)
            t = out[f"{role}.{e}"] = _put(stored, device, dtype if name in converted else None)
            copied += 0 if t is stored else t.nbytes
    return TensorSet(device, out, copied, label, dict(names))


def _place_gate_up(checkpoint, names: dict[str, str], device: torch.device, dtype: torch.dtype, label: str, form: str,
                   num_experts: int, converted: Collection[str]) -> TensorSet:
    out, copied = {}, 0
    for short, name in names.items():
        if short.endswith("_scales"):
            continue  # read with its blocks
        if short.endswith("_blocks"):
            role = short.removesuffix("_blocks")
            blocks, scales = checkpoint.tensor(name), checkpoint.tensor(names[f"{role}_scales"])
            for e in range(num_experts):
                w = Mxfp4Weight(blocks[e], scales[e], dtype)
                out[f"{role}.{e}"] = w if device.type == "cpu" else w.to(device)
                copied += 0 if device.type == "cpu" else w.nbytes
            continue
        stored = checkpoint.tensor(name)
        whole = _put(stored, device, dtype if name in converted else None)
        copied += 0 if whole is stored else whole.nbytes
        for e in range(num_experts):  # a bias [out]; a matrix stored [in, out], read as [out, in] (a view)
            out[f"{short}.{e}"] = whole[e] if short.endswith("_bias") else whole[e].t()
    return TensorSet(device, out, copied, label, dict(names))


def _put(t, device: torch.device, dtype: torch.dtype | None):
    """`t` on `device`, converted to `dtype` (None: as stored); on the CPU, unconverted, the mapped view itself.
    Quantized weights are never converted: the stored blocks go as they are."""
    if isinstance(t, QuantizedWeight):
        return t.to(device) if device.type != "cpu" else t
    target = dtype or t.dtype
    return t.to(device=device, dtype=target) if device.type != "cpu" or target != t.dtype else t


def load_layers(
    checkpoint: Checkpoint,
    layer_names: tuple[dict[str, str], ...],
    layer_devices: list[torch.device],
    labels: tuple[str, ...],
    dtype: torch.dtype,
    progress: Callable[[float, str], None] | None = None,
    is_cancelled: Callable[[], bool] = lambda: False,
    converted: Collection[str] = frozenset(),
) -> list[TensorSet]:
    layers = []
    for i, device in enumerate(layer_devices):
        if is_cancelled():
            raise GenerationCancelled("loading cancelled")
        layers.append(place(checkpoint, layer_names[i], device, dtype, labels[i], converted=converted))
        if progress:
            progress((i + 1) / len(layer_devices), f"layer {i + 1}/{len(layer_devices)} on {device}")
    return layers


def load_experts(checkpoint, layout, expert_devices: list[torch.device], labels: tuple[str, ...], dtype: torch.dtype,
                 progress: Callable[[float, str], None] | None = None, is_cancelled: Callable[[], bool] = lambda: False,
                 converted: Collection[str] = frozenset()) -> list[TensorSet | None]:
    """Each layer's experts on the plan's device for them (Plan.expert_devices); None for a layer without experts."""
    out: list[TensorSet | None] = []
    for i, names in enumerate(layout.experts or [{}] * layout.num_layers):
        if is_cancelled():
            raise GenerationCancelled("loading cancelled")
        out.append(place_experts(checkpoint, names, expert_devices[i], dtype, label=labels[i],
                                 form=layout.expert_form, num_experts=layout.config.num_experts,
                                 converted=converted) if names else None)
        if progress and names:
            progress((i + 1) / layout.num_layers, f"experts of layer {i + 1}/{layout.num_layers} on {expert_devices[i]}")
    return out
