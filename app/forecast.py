"""The memory forecast for the user's settings: a plan recomputed on every change, nothing allocated."""

from __future__ import annotations

from dataclasses import replace

from stowage.engine.defaults import BLOCK_SIZE
from stowage.engine.planning.budgets import Budgets
from stowage.engine.planning.inspect import ModelInfo
from stowage.engine.planning.plan import PlanRequest, max_context, plan
from stowage.engine.units import format_bytes

from .model_settings import ModelSettings
from .plan_bar import DeviceBar

GIB = 1024**3


class Forecast:
    """Plans for one inspected model on the budgets detected when it was inspected.

    Budgets are detected once per model, not on every slider move: after a load the model's own
    memory would otherwise count as used and the forecast would shrink under the user.
    """

    def __init__(self, info: ModelInfo, budgets: Budgets, block_size: int = BLOCK_SIZE):
        self.info = info
        self.detected = budgets
        self.block_size = block_size

    def budgets(self, settings: ModelSettings) -> Budgets:
        limit = None if settings.ram_limit_gib is None else int(settings.ram_limit_gib * GIB)
        return replace(self.detected, ram=replace(self.detected.ram, limit_bytes=limit))

    def request(self, settings: ModelSettings, context_tokens: int | None = None, *,
                num_seqs: int = 1) -> PlanRequest:
        """num_seqs: sequences generated at once, each with a whole context of KV cache (Serve's "Sequences")."""
        return PlanRequest(
            context_tokens=context_tokens or settings.context_tokens,
            kv_dtype=settings.kv_dtype,
            dtype=None,
            gpu_layers=settings.gpu_layers,
            cpu_expert_layers=settings.cpu_expert_layers,
            block_size=self.block_size,
            num_seqs=num_seqs,
        )

    def plan(self, settings: ModelSettings, *, num_seqs: int = 1):
        return plan(self.info, self.request(settings, num_seqs=num_seqs), self.budgets(settings))

    def max_context(self, settings: ModelSettings, *, num_seqs: int = 1) -> int:
        """The largest context that fits with these settings (the slider's top)."""
        return max_context(self.info, self.request(settings, num_seqs=num_seqs), self.budgets(settings))

    @property
    def model_max_tokens(self) -> int:
        return self.info.max_position_embeddings

    def bars(self, the_plan, settings: ModelSettings) -> list[DeviceBar]:
        names = {b.device: b for b in self.budgets(settings).devices}
        bars = []
        for device in the_plan.devices:
            budget = names.get(device.device)
            if device.device == "cpu":
                label = "RAM"
            else:
                label = f"GPU {device.device.removeprefix('cuda:')}" + (f" ({budget.name})" if budget else "")
            bars.append(DeviceBar(label, device.other_weights_bytes, device.kv_bytes, device.workspace_bytes,
                                  device.budget_bytes, expert_bytes=device.expert_bytes))
        return bars


def explain(plan, min_tokens: int, ram_limited: bool) -> str:
    """Why `plan` does not fit, in two short sentences: where, by how much, and what to change. The largest context
    is proposed only when the context box can take it (never below `min_tokens`); the planner's whole reasoning is
    plan.error."""
    over = [d for d in plan.devices if not d.fits] or list(plan.devices)
    where = "; ".join(f"{d.label} would hold {format_bytes(d.total_bytes)}, {format_bytes(d.budget_bytes)} is usable"
                      for d in over)
    if plan.max_context_tokens >= min_tokens:
        return (f"{plan.context_tokens:,} tokens do not fit ({where}). The largest context that fits is "
                f"{plan.max_context_tokens:,} tokens.")
    fix = "Raise the RAM limit" if ram_limited and any(d.device == "cpu" for d in over) else "Free some memory"
    return f"Not even {min_tokens:,} tokens fit ({where}). {fix}, or choose fp8 for the KV cache."
