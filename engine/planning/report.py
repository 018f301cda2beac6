"""A plan in words: the one-line summary, the table `stowage plan` prints, and its JSON."""

from __future__ import annotations

from ..units import format_bytes
from .plan import Plan

COLUMNS = ("device", "layers", "weights", "KV cache", "workspace", "total", "budget", "headroom")


def summary(plan: Plan) -> str:
    """ "28/32 layers on GPU 0, 4/32 on CPU, 16,384-token KV cache (2.0 GiB float16)"."""
    parts = []
    for d in plan.devices:
        if d.layers:
            where = "CPU" if d.device == "cpu" else d.label
            parts.append(f"{len(d.layers)}/{plan.num_layers} " + ("layers " if not parts else "") + f"on {where}")
    if plan.num_expert_layers:
        on_gpu = sum(1 for d in plan.expert_devices if d != "cpu")
        parts.append(f"experts of {on_gpu}/{plan.num_expert_layers} layers on GPU")
    parts.append(f"{plan.context_tokens:,}-token KV cache ({format_bytes(plan.kv_bytes)} {plan.kv_dtype})")
    return ("" if plan.fits else "does not fit: ") + ", ".join(parts)


def layer_ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"; () -> "-"."""
    if not layers:
        return "-"
    runs, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + (None,)):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ",".join(runs)


def format_table(plan: Plan) -> str:
    """The readable plan: one row per device, then whether it fits and the largest context that does."""
    head = (f"{plan.model_name or 'model'}: {plan.num_layers} layers, {plan.dtype} compute, {plan.kv_dtype} KV cache, "
            f"{plan.context_tokens:,} tokens (block {plan.block_size}, prefill chunk {plan.prefill_chunk})")
    rows = [COLUMNS]
    for d in plan.devices:
        extra = " +" + ",".join(d.holds) if d.holds else ""
        rows.append((f"{d.device} ({d.name})", layer_ranges(d.layers) + extra, format_bytes(d.weights_bytes),
                     format_bytes(d.kv_bytes), format_bytes(d.workspace_bytes), format_bytes(d.total_bytes),
                     format_bytes(d.budget_bytes), format_bytes(d.headroom_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [head] + ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                      for r in rows]
    for d in plan.devices:
        if d.experts:
            lines.append(f"{d.device}: experts of layers {layer_ranges(d.experts)} ({format_bytes(d.expert_bytes)} of "
                         f"its {format_bytes(d.weights_bytes)} weights)")
    if plan.num_expert_layers:
        read = ", ".join(f"{d.label} {format_bytes(d.read_bytes_per_token)}" for d in plan.devices
                         if d.read_bytes_per_token)
        lines.append(f"weights read per decode token (the chosen experts only): {read}")
    if plan.note:
        lines.append(plan.note)
    if plan.kv_dir:
        lines.append(f"KV spill to disk: {format_bytes(plan.kv_disk_bytes)} for evicted conversations in "
                     f"{plan.kv_dir} ({format_bytes(plan.kv_disk_free_bytes)} free there)"
                     + ("; off" if not plan.kv_disk_bytes else ""))
    if plan.fits:
        lines.append(f"fits: {summary(plan)}; the largest context that fits is {plan.max_context_tokens:,} tokens")
    else:
        lines.append(f"does not fit: {plan.error}")
    return "\n".join(lines)


def to_dict(plan: Plan) -> dict:
    """The JSON object of `stowage plan --json` (the issue's keys, plus a few more for the GUI)."""
    return {
        "fits": plan.fits,
        "context_tokens": plan.context_tokens,
        "max_context_tokens": plan.max_context_tokens,
        "dtype": plan.dtype,
        "kv_dtype": plan.kv_dtype,
        "block_size": plan.block_size,
        "prefill_chunk": plan.prefill_chunk,
        "error": plan.error,
        "summary": summary(plan),
        "note": plan.note,
        "layer_devices": list(plan.layer_devices),
        "expert_devices": list(plan.expert_devices),
        "embed_device": plan.embed_device,
        "head_device": plan.head_device,
        "kv_disk_bytes": plan.kv_disk_bytes,
        "kv_disk_free_bytes": plan.kv_disk_free_bytes,
        "kv_dir": plan.kv_dir,
        "devices": [
            {
                "device": d.device,
                "name": d.name,
                "layers": list(d.layers),
                "holds": list(d.holds),
                "weights_bytes": d.weights_bytes,
                "expert_bytes": d.expert_bytes,
                "other_weights_bytes": d.other_weights_bytes,
                "read_bytes_per_token": d.read_bytes_per_token,
                "experts": list(d.experts),
                "kv_bytes": d.kv_bytes,
                "workspace_bytes": d.workspace_bytes,
                "total_bytes": d.total_bytes,
                "budget_bytes": d.budget_bytes,
                "reserve_bytes": d.reserve_bytes,
                "headroom_bytes": d.headroom_bytes,
                "attention": d.attention,
            }
            for d in plan.devices
        ],
    }
