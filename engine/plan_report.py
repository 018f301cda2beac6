"""A plan in words: the one-line summary, the table `stowage plan` prints, its JSON, and the error text."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .units import format_bytes

if TYPE_CHECKING:
    from .budgets import Budgets
    from .planner import Plan

COLUMNS = ("device", "layers", "weights", "KV cache", "workspace", "total", "budget", "headroom")


def summary(plan: "Plan") -> str:
    """ "28/32 layers on GPU 0, 4/32 on CPU, 16,384-token KV cache (2.0 GiB float16)"."""
    parts = []
    for d in plan.devices:
        if d.layers:
            where = "CPU" if d.device == "cpu" else d.label
            parts.append(f"{len(d.layers)}/{plan.num_layers} " + ("layers " if not parts else "") + f"on {where}")
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


def format_table(plan: "Plan") -> str:
    """The readable plan: one row per device, then whether it fits and the largest context that does."""
    head = (f"{plan.model_name or 'model'}: {plan.num_layers} layers, {plan.dtype} weights, {plan.kv_dtype} KV cache, "
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
    if plan.note:
        lines.append(plan.note)
    if plan.fits:
        lines.append(f"fits: {summary(plan)}; the largest context that fits is {plan.max_context_tokens:,} tokens")
    else:
        lines.append(f"does not fit: {plan.error}")
    return "\n".join(lines)


def to_dict(plan: "Plan") -> dict:
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
        "embed_device": plan.embed_device,
        "head_device": plan.head_device,
        "devices": [
            {
                "device": d.device,
                "name": d.name,
                "layers": list(d.layers),
                "holds": list(d.holds),
                "weights_bytes": d.weights_bytes,
                "kv_bytes": d.kv_bytes,
                "workspace_bytes": d.workspace_bytes,
                "total_bytes": d.total_bytes,
                "budget_bytes": d.budget_bytes,
                "reserve_bytes": d.reserve_bytes,
                "headroom_bytes": d.headroom_bytes,
            }
            for d in plan.devices
        ],
    }


def error_text(plan: "Plan", budgets: "Budgets", reference: tuple, max_gpu_layers: int) -> str:
    """Why a plan does not fit: what it needs, what each device has, the largest context that fits, what to do.

    `reference`: the device plans of the largest context that fits (this plan's own when none does).
    """
    request, tokens = plan.request, plan.context_tokens
    limit = plan.max_position_embeddings
    clauses: list[str] = []
    advice: list[str] = []
    if tokens > limit:
        clauses.append(f"a {tokens:,}-token context is longer than the model's {limit:,} positions "
                       "(max_position_embeddings in config.json)")
        advice.append(f"at most {limit:,} tokens")
    elif request.gpu_layers and not budgets.gpus:
        clauses.append(f"{request.gpu_layers} GPU layers were asked for, but there is no GPU ({budgets.note})")
        advice.append("plan for the CPU alone (GPU layers: 0, or auto)")
    else:
        # What is left for the cache once the weights sit where they would for the largest context that fits
        # (or, when none fits, where this request put them).
        left = [(d.label, max(0, d.budget_bytes - d.weights_bytes - d.workspace_bytes))
                for d in reference if d.layers or d.budget_bytes]
        where = " and ".join(format_bytes(n) + (" in RAM" if label == "RAM" else f" on {label}") for label, n in left)
        clauses.append(f"a {tokens:,}-token context needs {format_bytes(plan.kv_bytes)} of KV cache ({plan.kv_dtype}); "
                       f"after the weights and workspace, {format_bytes(sum(n for _, n in left))} is left for it"
                       + (f": {where}" if len(left) > 1 else f" {where.split(' ', 2)[2]}"))
        by_device = {b.device: b for b in budgets.devices}
        for d in plan.devices:
            if not d.fits:
                clauses.append(f"{d.label} would hold {format_bytes(d.total_bytes)} ({format_bytes(d.weights_bytes)} "
                               f"weights, {format_bytes(d.kv_bytes)} KV cache, {format_bytes(d.workspace_bytes)} "
                               f"workspace) but has {by_device[d.device].describe()}")
        advice.append("a shorter context")
        if plan.kv_dtype != "fp8":
            advice.append("a smaller KV dtype (fp8 takes 1 byte per value)")
        if request.gpu_layers and any(not d.fits for d in plan.devices if d.device != "cpu"):
            advice.append(f"fewer GPU layers (at most {max_gpu_layers} fit with this context)")
        if not plan.device("cpu").fits:
            advice.append("more free RAM (close programs, or raise the RAM budget or limit; "
                          "Stowage never plans into swap)")
    if plan.max_context_tokens:
        clauses.append(f"the largest context that fits is {plan.max_context_tokens:,} tokens")
    else:
        clauses.append("no context fits: the weights and workspace alone exceed the memory available")
        advice.append("a smaller weights dtype or more memory")
    return "; ".join(clauses) + ". Choose " + _or(advice) + "."


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]
